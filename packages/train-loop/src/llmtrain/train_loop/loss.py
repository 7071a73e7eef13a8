"""The training loss: summed cross-entropy over target tokens, with an optional z-loss.

Sums, not means: the trainer divides by the global number of target tokens once, so the loss and
its gradient do not depend on how ranks, micro-batches or pipeline stages split the batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE = -100  # targets with this value (masked tokens) count neither in the loss nor the total


def cross_entropy_sum(z_loss: float = 0.0):
    """loss_fn(logits (B, T, V), targets (B, T)) -> the summed loss (a scalar)."""

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        flat = logits.flatten(0, 1).float()
        target = targets.flatten()
        loss = F.cross_entropy(flat, target, reduction="sum", ignore_index=IGNORE)
        if z_loss:
            # pushes log Z towards 0 so logits stay in range (PaLM's auxiliary loss)
            log_z = torch.logsumexp(flat, dim=-1)
            loss = loss + z_loss * (log_z.square() * (target != IGNORE)).sum()
        return loss

    return loss_fn
