"""Gradient clipping that is right for sharded (DTensor) parameters and pipeline stages: the norm
is over every parameter of the whole model, whichever rank and stage holds it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Placement


def _squared_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    norm = torch.nn.utils.get_total_norm(grads, 2.0, foreach=True)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()  # sums the partial norms of the shards across their mesh
    return norm.float() ** 2


def clip_grad_norm_(
    parameters: Iterable[torch.nn.Parameter],
    max_norm: float | None,
    pp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Scale gradients so their global L2 norm is at most `max_norm` (None: only measure); return
    the norm before clipping, a float32 tensor on the gradients' device: not read here, so the
    step queues on without waiting for it. `pp_group`: the pipeline group, whose stages hold
    disjoint params."""
    # (the parameters, their gradients) per group
    groups: dict[
        tuple[DeviceMesh, tuple[Placement, ...]] | None,
        tuple[list[torch.nn.Parameter], list[torch.Tensor]],
    ] = {}
    for p in parameters:
        grad = p.grad
        if grad is None:
            continue
        # DTensor grads on one mesh with one placement are reduced together; plain tensors apart
        key = (grad.device_mesh, tuple(grad.placements)) if isinstance(grad, DTensor) else None
        params, grads = groups.setdefault(key, ([], []))
        params.append(p)
        grads.append(grad)
    device = next(iter(groups.values()))[1][0].device if groups else torch.device("cpu")
    total = torch.zeros((), device=device)
    for _, grads in groups.values():
        total = total + _squared_norm(grads).to(device)
    if pp_group is not None:
        dist.all_reduce(total, group=pp_group)
    norm = total.sqrt()
    if max_norm is not None:
        for params, _ in groups.values():
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm
