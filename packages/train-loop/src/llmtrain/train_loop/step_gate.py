"""Optimizer steps that happen only where a device flag says so, without the host reading it.

A step whose loss or gradient norm is not finite must not move the weights. Deciding that on
the host means reading the flag, a sync that stalls the device's queue every step; as AMP's
grad scaler does, the decision stays on the device instead:

- torch's fused optimizers (AdamW, Adam and SGD on CUDA by default) take the flag as
  `found_inf` and skip the update in their kernel (their step counters too);
- any other optimizer (the foreach and for-loop implementations, Muon) steps, and its
  parameters and state take back their values where the flag says skip. That holds a copy of
  them while it steps, after the backward has freed the activations. State the optimizer
  creates in a skipped step (its first) starts from zeros, as torch's optimizers start it.
  torch keeps the step counters of these implementations on the host: on CUDA, taking them
  back copies the flag there, one sync per step that the fused optimizers do not have.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch.distributed.tensor import DTensor

# torch optimizers whose fused kernels take `found_inf` (torch.amp.GradScaler's contract)
FOUND_INF_OPTIMIZERS = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)


def step_where(optimizers: Iterable[torch.optim.Optimizer], applied: torch.Tensor) -> None:
    """Step each optimizer; where `applied` (a boolean device tensor) is False nothing moves."""
    skip = (~applied).float()
    for optimizer in optimizers:
        if takes_found_inf(optimizer):
            optimizer.found_inf = skip  # type: ignore[attr-defined]  # read by torch's step
            optimizer.step()
        else:
            _step_undone_unless(optimizer, applied)


def takes_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer skips its own update on a device flag (a fused torch one)."""
    return isinstance(optimizer, FOUND_INF_OPTIMIZERS) and all(
        group.get("fused") for group in optimizer.param_groups
    )


@torch.no_grad()
def _step_undone_unless(optimizer: torch.optim.Optimizer, applied: torch.Tensor) -> None:
    before = {key: t.clone() for key, t in _tensors(optimizer)}
    optimizer.step()
    for key, tensor in _tensors(optimizer):
        kept = before.get(key)
        if kept is None:  # created by this step: as if never created
            kept = torch.zeros_like(tensor)
        torch.where(applied.to(tensor.device), tensor, kept, out=tensor)


def _tensors(
    optimizer: torch.optim.Optimizer,
) -> Iterator[tuple[tuple[int, str], torch.Tensor]]:
    """((the parameter's id, the state's name or ""), the local tensor: a DTensor's shard) of
    the optimizer's parameters and their state."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            yield (id(param), ""), _local(param)
            for name, value in optimizer.state.get(param, {}).items():
                if isinstance(value, torch.Tensor):
                    yield (id(param), name), _local(value)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
