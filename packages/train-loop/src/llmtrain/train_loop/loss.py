"""The training loss: summed cross-entropy over target tokens, with an optional z-loss.

Sums, not means: the trainer divides by the global number of target tokens once, so the loss and
its gradient do not depend on how ranks, micro-batches or pipeline stages split the batch.

The loss takes logits, or (where the model and layout allow: see `Parallelized`) the final
hidden states and the output matrix, `from_hidden`, which gives the same numbers without the
batch's logits (`linear_cross_entropy`).
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

from llmtrain.train_loop.linear_cross_entropy import IGNORE, linear_cross_entropy_sum

__all__ = ["IGNORE", "CrossEntropySum", "cross_entropy_sum"]


@attrs.frozen
class CrossEntropySum:
    """loss(logits (B, T, V), targets (B, T)) -> the summed loss (a scalar);
    loss.from_hidden(hidden (B, T, d), weight (V, d), targets) -> the same from the hidden states.
    `compile_chunks`: compile the chunked form's softmax on CUDA."""

    z_loss: float = 0.0
    compile_chunks: bool = False

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        flat = logits.flatten(0, 1).float()
        target = targets.flatten()
        loss = F.cross_entropy(flat, target, reduction="sum", ignore_index=IGNORE)
        if self.z_loss:
            # pushes log Z towards 0 so logits stay in range (PaLM's auxiliary loss)
            log_z = torch.logsumexp(flat, dim=-1)
            loss = loss + self.z_loss * (log_z.square() * (target != IGNORE)).sum()
        return loss

    def from_hidden(
        self, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor
    ) -> torch.Tensor:
        return linear_cross_entropy_sum(
            hidden, weight, targets, z_loss=self.z_loss, compile_chunks=self.compile_chunks
        )


def cross_entropy_sum(z_loss: float = 0.0, *, compile_chunks: bool = False) -> CrossEntropySum:
    return CrossEntropySum(z_loss, compile_chunks)
