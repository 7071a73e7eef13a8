"""The chunked cross-entropy of the output projection: the plain form's loss and gradients
(ignored targets, z-loss, uneven chunks, bf16 autocast), without the batch's logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from llmtrain.train_loop import linear_cross_entropy as lce
from llmtrain.train_loop.loss import IGNORE, cross_entropy_sum

VOCAB, DIM = 50, 12


def inputs(n_tokens: int = 40, seed: int = 0, ignored: int = 5):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, n_tokens // 2, DIM, generator=g, requires_grad=True)
    weight = (torch.randn(VOCAB, DIM, generator=g) * 0.5).requires_grad_()
    targets = torch.randint(0, VOCAB, (2, n_tokens // 2), generator=g)
    targets.view(-1)[torch.randperm(n_tokens, generator=g)[:ignored]] = IGNORE
    return hidden, weight, targets


def loss_and_grads(loss_of, hidden, weight, targets, scale: float = 1.0):
    hidden = hidden.detach().clone().requires_grad_()
    weight = weight.detach().clone().requires_grad_()
    loss = loss_of(hidden, weight, targets)
    (loss * scale).backward()
    return loss.detach(), hidden.grad, weight.grad


def plain(z_loss: float = 0.0):
    return lambda h, w, t: cross_entropy_sum(z_loss)(F.linear(h, w), t)


def chunked(z_loss: float = 0.0):
    return cross_entropy_sum(z_loss).from_hidden


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 128 rows at this vocabulary: 40 tokens still make one chunk, so tests that
    need several chunks lower the row floor too."""
    monkeypatch.setattr(lce, "CHUNK_ELEMENTS", 8 * VOCAB)
    real = lce.chunk_rows
    monkeypatch.setattr(lce, "chunk_rows", lambda n, v: min(real(n, v), 7))


@pytest.mark.parametrize("z_loss", [0.0, 1e-2])
def test_equals_the_plain_loss_and_gradients_over_uneven_chunks(small_chunks, z_loss):
    hidden, weight, targets = inputs()
    got = loss_and_grads(chunked(z_loss), hidden, weight, targets, scale=0.37)
    expected = loss_and_grads(plain(z_loss), hidden, weight, targets, scale=0.37)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)
    assert got[0].item() > 0


def test_ignored_targets_count_in_neither_the_loss_nor_the_gradient():
    hidden, weight, targets = inputs(ignored=0)
    targets[0, :4] = IGNORE
    loss, grad_hidden, _ = loss_and_grads(chunked(), hidden, weight, targets)
    assert torch.count_nonzero(grad_hidden[0, :4]) == 0
    assert torch.count_nonzero(grad_hidden[0, 4:].abs().sum(-1)) == grad_hidden[0, 4:].size(0)
    kept = targets != IGNORE
    by_hand = -torch.log_softmax(F.linear(hidden, weight).double(), -1)[kept].gather(
        -1, targets[kept].unsqueeze(-1)
    )
    torch.testing.assert_close(loss.double(), by_hand.sum(), rtol=1e-5, atol=0)
    nothing = torch.full_like(targets, IGNORE)
    assert loss_and_grads(chunked(), hidden, weight, nothing)[0].item() == 0.0


def test_under_bf16_autocast_it_matches_autocasts_plain_form():
    """Logits in bf16 as autocast's F.linear makes them, softmax in float32: the same loss and
    gradients within bf16 rounding of the gradient matmuls."""
    hidden, weight, targets = inputs(n_tokens=64, ignored=3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = loss_and_grads(chunked(1e-3), hidden, weight, targets)
        expected = loss_and_grads(plain(1e-3), hidden, weight, targets)
    assert got[0].dtype == torch.float32
    assert got[1].dtype == hidden.dtype and got[2].dtype == weight.dtype
    torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=0)
    for g, e in zip(got[1:], expected[1:], strict=True):
        torch.testing.assert_close(g, e, rtol=2e-2, atol=2e-3)


def test_without_gradients_it_computes_only_the_loss():
    hidden, weight, targets = inputs()
    with torch.no_grad():
        loss = chunked()(hidden, weight, targets)
    torch.testing.assert_close(loss, plain()(hidden, weight, targets).detach())


class LargestTensor(TorchDispatchMode):
    """The largest number of elements of any tensor an operator returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_no_tensor_as_large_as_the_batchs_logits_exists(monkeypatch):
    """4 chunks of 256 tokens: the largest tensor made is one chunk's logits, a quarter of the
    batch's; the plain form makes the batch's logits (and more of their size)."""
    vocab, n_tokens = 512, 1024
    monkeypatch.setattr(lce, "CHUNK_ELEMENTS", 256 * vocab)
    hidden = torch.randn(1, n_tokens, 64, requires_grad=True)
    weight = torch.randn(vocab, 64, requires_grad=True)
    targets = torch.randint(0, vocab, (1, n_tokens))
    for loss_of, largest in ((chunked(), 256 * vocab), (plain(), n_tokens * vocab)):
        with LargestTensor() as seen:
            loss_of(hidden, weight, targets).backward()
        assert seen.largest == largest


def test_chunks_are_equal_where_the_token_count_allows():
    assert lce.chunk_rows(8192, 128_256) == 1024  # 8 chunks of 1024 tokens
    assert lce.chunk_rows(8000, 128_256) == 1000  # 8 equal chunks, not 7 x 1024 + 832
    assert lce.chunk_rows(100, 128_256) == 100  # one chunk
    assert lce.chunk_rows(8191, 128_256) == 1024  # a prime count: full chunks and a rest
