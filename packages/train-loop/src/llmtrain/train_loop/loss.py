"""The training loss: summed cross-entropy over target tokens, with an optional z-loss.

Sums, not means: the trainer divides by the global number of target tokens once, so the loss and
its gradient do not depend on how ranks, micro-batches or pipeline stages split the batch.

The loss takes logits, or (where the model and layout allow: see `Parallelized`) the final
hidden states and the output matrix, `from_hidden`, which gives the same numbers without the
batch's logits (`linear_cross_entropy`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs
import torch
import torch.nn.functional as F

from llmtrain.core_mesh.interfaces import AuxiliaryLosses
from llmtrain.train_loop.linear_cross_entropy import IGNORE, linear_cross_entropy_sum

if TYPE_CHECKING:
    from llmtrain.data_pack.store import PackedDataset

__all__ = ["IGNORE", "AuxiliaryTerms", "CrossEntropySum", "cross_entropy_sum"]


@attrs.define
class AuxiliaryTerms:
    """The auxiliary losses of model parts that take them out of their own backward
    (`AuxiliaryLosses`, MoE load balancing), added to the loss of each micro-batch as a term of
    value zero whose gradient is theirs: `(aux - aux.detach()) * count / averaged_ranks`. The
    layout scales the summed loss by `averaged_ranks / count` (FSDP and DDP then average over
    those ranks), so each forward's `aux` gets gradient 1 before the average, as the models' own
    injection gives it (the same numbers at any layout as before the seam), and the logged loss
    stays the cross-entropy. `count`: the step's global number of counted targets (a device
    tensor, never read on the host), set by `prepare`; `averaged_ranks`:
    `ObjectiveContext.averaged_ranks`."""

    parts: Sequence[AuxiliaryLosses]
    averaged_ranks: int = 1
    count: torch.Tensor | float = 1.0

    def term(self) -> torch.Tensor:
        aux = sum((part.aux_loss() for part in self.parts), torch.zeros(()))
        # the quotient in float64, rounded to float32 once: the bits a Python number gave
        count = self.count
        factor = (
            (count.double() / self.averaged_ranks).float()
            if isinstance(count, torch.Tensor)
            else count / self.averaged_ranks
        )
        return (aux - aux.detach()) * factor


@attrs.frozen
class CrossEntropySum:
    """loss(logits (B, T, V), targets (B, T)) -> the summed loss (a scalar);
    loss.from_hidden(hidden (B, T, d), weight (V, d), targets) -> the same from the hidden states.
    `compile_chunks`: compile the chunked form's softmax on CUDA."""

    z_loss: float = 0.0
    compile_chunks: bool = False
    # as the `cross_entropy` objective: the model parts' auxiliary losses (MoE), or None
    aux: AuxiliaryTerms | None = None

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = self._cross_entropy(logits, targets)
        return loss if self.aux is None else loss + self.aux.term()

    def _cross_entropy(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
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
        loss = linear_cross_entropy_sum(
            hidden, weight, targets, z_loss=self.z_loss, compile_chunks=self.compile_chunks
        )
        return loss if self.aux is None else loss + self.aux.term()

    # the `objective` seam (core-mesh interfaces.Objective): cross-entropy reads the targets as
    # they are and records nothing beyond the loss
    def prepare(
        self, inputs: torch.Tensor, targets: torch.Tensor, count: torch.Tensor, /
    ) -> torch.Tensor:
        if self.aux is not None:
            self.aux.count = count
        return targets


def cross_entropy_sum(z_loss: float = 0.0, *, compile_chunks: bool = False) -> CrossEntropySum:
    return CrossEntropySum(z_loss, compile_chunks)


def bits_per_byte(loss: float, dataset: PackedDataset) -> float | None:
    """A mean loss (nats per target token) over `dataset` as bits per byte of its text: bits
    per token times the dataset's tokens per byte, both as `llmtrain data pack` counted them.
    None for a dataset packed without its byte count."""
    if not dataset.n_bytes:
        return None
    return loss / math.log(2) * dataset.n_tokens / dataset.n_bytes
