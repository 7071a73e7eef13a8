"""Steps that could not be applied, counted on the device and judged when the counts are read.

A step is applied when its loss and gradient norm are finite and its loss mask counted a
target. Whether it was is a device flag (`step_gate` skips the update on it), so the host learns
of a skipped step only when it next reads the device: at a logged or saved step, where
`training.non_finite` is applied to what happened since. A run that must stop therefore stops a
few steps late at most (up to `training.log_every`), and says at which step the trouble began.
"""

from __future__ import annotations

import torch

# the names the counts are read under, beside the step's metrics (one read for both)
FIELDS = ("non_finite", "first_non_finite", "first_loss", "first_grad_norm", "empty", "first_empty")


class StepHealth:
    """Since the last read: how many steps were not finite (the first one's step, loss and
    gradient norm) and how many counted no target (the first one's step)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.reset()

    def reset(self) -> None:
        zeros = torch.zeros(len(FIELDS), dtype=torch.float64, device=self.device)
        self.counts = dict(zip(FIELDS, zeros.unbind(), strict=True))

    def check(
        self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, count: torch.Tensor
    ) -> torch.Tensor:
        """Whether step `step` may be applied (a boolean device tensor), counted as it is."""
        counted = count > 0
        bad = counted & ~(torch.isfinite(loss) & torch.isfinite(grad_norm))
        empty = ~counted
        c = self.counts
        first_bad = bad & (c["non_finite"] == 0)
        c["first_non_finite"] = torch.where(first_bad, step, c["first_non_finite"])
        c["first_loss"] = torch.where(first_bad, loss.double(), c["first_loss"])
        c["first_grad_norm"] = torch.where(first_bad, grad_norm.double(), c["first_grad_norm"])
        c["non_finite"] = c["non_finite"] + bad
        c["first_empty"] = torch.where(empty & (c["empty"] == 0), step, c["first_empty"])
        c["empty"] = c["empty"] + empty
        return counted & ~bad

    def tensors(self) -> dict[str, torch.Tensor]:
        """The counts, under `FIELDS`' names, to be read with the step's metrics."""
        return dict(self.counts)
