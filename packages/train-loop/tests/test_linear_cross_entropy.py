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
    """Softmax chunks of 7 rows in matmul groups of 14 (the real sizes are 128-row multiples:
    40 tokens would make one of each): 40 tokens make 3 groups, the last one short, and 6
    chunks, two of them short."""
    monkeypatch.setattr(lce, "group_rows", lambda n, v: (14, 7))


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
    """2 groups of 512 tokens, each of 2 chunks: the largest tensor made is one group's logits,
    half the batch's; the plain form makes the batch's logits (and more of their size)."""
    vocab, n_tokens = 512, 1024
    monkeypatch.setattr(lce, "CHUNK_ELEMENTS", 256 * vocab)
    monkeypatch.setattr(lce, "GROUP_ELEMENTS", 512 * vocab)
    assert lce.group_rows(n_tokens, vocab) == (512, 256)
    hidden = torch.randn(1, n_tokens, 64, requires_grad=True)
    weight = torch.randn(vocab, 64, requires_grad=True)
    targets = torch.randint(0, vocab, (1, n_tokens))
    for loss_of, largest in ((chunked(), 512 * vocab), (plain(), n_tokens * vocab)):
        with LargestTensor() as seen:
            loss_of(hidden, weight, targets).backward()
        assert seen.largest == largest


def test_compiled_chunk_overwrites_its_logits_with_the_eager_gradient():
    """The CUDA path compiles the chunk function, whose gradient is written into its input:
    Inductor (here its CPU backend) must give the eager loss and leave the eager gradient."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(64, 96, generator=g)
    targets = torch.randint(0, 96, (64,), generator=g)
    targets[::5] = IGNORE
    eager_logits, compiled_logits = logits.clone(), logits.clone()
    eager = lce.chunk_loss_and_grad_(eager_logits, targets, 1e-3)
    compiled_fn = torch.compile(lce.chunk_loss_and_grad_, dynamic=False)
    compiled = compiled_fn(compiled_logits[16:48], targets[16:48], 1e-3)
    expected = lce.chunk_loss_and_grad_(logits.clone()[16:48], targets[16:48], 1e-3)
    torch.testing.assert_close(compiled, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(compiled_logits[16:48], eager_logits[16:48], rtol=1e-5, atol=1e-6)
    assert torch.equal(compiled_logits[:16], logits[:16])  # rows outside the slice untouched
    assert torch.equal(compiled_logits[48:], logits[48:])
    assert eager.item() > 0


def test_groups_are_whole_numbers_of_chunks():
    assert lce.group_rows(8192, 128_256) == (4096, 1024)  # 2 matmuls, 8 softmax chunks
    assert lce.group_rows(16384, 128_256) == (4096, 1024)  # batch 8: 4 matmuls
    assert lce.group_rows(8000, 128_256) == (4000, 1000)
    assert lce.group_rows(100, 128_256) == (100, 100)
    assert lce.group_rows(4096, 50_257) == (4096, 2048)  # gpt2: one matmul, 2 chunks


def test_chunks_are_equal_where_the_token_count_allows():
    assert lce.chunk_rows(8192, 128_256) == 1024  # 8 chunks of 1024 tokens
    assert lce.chunk_rows(8000, 128_256) == 1000  # 8 equal chunks, not 7 x 1024 + 832
    assert lce.chunk_rows(100, 128_256) == 100  # one chunk
    assert lce.chunk_rows(8191, 128_256) == 1024  # a prime count: full chunks and a rest
