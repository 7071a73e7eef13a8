"""The training loss: summed cross-entropy (masked targets excluded) plus an optional z-loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmtrain.train_loop.loss import IGNORE, cross_entropy_sum


def batch(seed: int = 0, shape=(3, 5), vocab: int = 11):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(*shape, vocab, generator=g) * 3
    targets = torch.randint(0, vocab, shape, generator=g)
    return logits, targets


def by_hand(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """-log softmax at each kept target, summed, in float64."""
    logp = torch.log_softmax(logits.double(), dim=-1)
    keep = targets != IGNORE
    return -logp[keep].gather(-1, targets[keep].unsqueeze(-1)).sum()


def test_is_the_sum_of_per_token_cross_entropy():
    logits, targets = batch()
    loss = cross_entropy_sum()(logits, targets)
    assert loss.shape == () and loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), by_hand(logits, targets), rtol=1e-6, atol=0)
    expected = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
    torch.testing.assert_close(loss, expected)
    # a sum, not a mean: two halves add up to the whole
    halves = cross_entropy_sum()(logits[:1], targets[:1]) + cross_entropy_sum()(
        logits[1:], targets[1:]
    )
    torch.testing.assert_close(halves, loss)


def test_ignored_targets_count_nothing():
    logits, targets = batch(1)
    masked = targets.clone()
    masked[0, :3] = IGNORE
    masked[2, -1] = IGNORE
    loss = cross_entropy_sum()(logits, masked)
    torch.testing.assert_close(loss.double(), by_hand(logits, masked), rtol=1e-6, atol=0)
    assert loss < cross_entropy_sum()(logits, targets)
    all_masked = torch.full_like(targets, IGNORE)
    assert cross_entropy_sum()(logits, all_masked).item() == 0.0


def test_z_loss_adds_z_times_the_sum_of_squared_log_partition():
    logits, targets = batch(2)
    targets[1, 1] = IGNORE
    z = 1e-2
    log_z = torch.logsumexp(logits.double(), dim=-1)
    expected = by_hand(logits, targets) + z * (log_z[targets != IGNORE] ** 2).sum()
    loss = cross_entropy_sum(z)(logits, targets)
    torch.testing.assert_close(loss.double(), expected, rtol=1e-6, atol=0)
    assert (loss - cross_entropy_sum()(logits, targets)).item() > 0


def test_low_precision_logits_are_summed_in_float32():
    logits, targets = batch(3)
    loss = cross_entropy_sum()(logits.bfloat16(), targets)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(
        loss, cross_entropy_sum()(logits.bfloat16().float(), targets), rtol=0, atol=0
    )


def test_gradient_is_softmax_minus_one_hot():
    logits, targets = batch(4, shape=(2, 3), vocab=5)
    logits.requires_grad_(True)
    cross_entropy_sum()(logits, targets).backward()
    expected = torch.softmax(logits.detach(), -1) - F.one_hot(targets, 5).float()
    torch.testing.assert_close(logits.grad, expected)
