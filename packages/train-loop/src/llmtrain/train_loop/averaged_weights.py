"""A float32 moving average of a model's trainable weights, laid out like them.

Each average is a copy of its parameter made with the parameter's own layout: a DTensor sharded
like an FSDP or tensor-parallel weight, the stage's weights of a pipeline rank, the experts this
rank holds. Updates are local (no collective), saving goes through DCP with the model's names,
so an average saved at one layout loads at another. Used by the `ema` callback (`ema.py`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import _get_fqns, get_model_state_dict


class AveragedWeights:
    """float32 averages of the trainable parameters of `parts` (a model or its pipeline stages),
    started equal to them. `state_dict()` is `{"weights": {name: average}}` under the names the
    model's own state dict uses (a tied weight under each of its names)."""

    def __init__(self, parts: Sequence[torch.nn.Module]):
        self.params: list[torch.Tensor] = []
        self.averages: list[torch.Tensor] = []
        self.by_name: dict[str, torch.Tensor] = {}
        for part in parts:
            self._add(part)
        if not self.params:
            raise ValueError("the model has no trainable parameters to average")
        self._groups = _same_layout(self.params)

    def _add(self, part: torch.nn.Module) -> None:
        known = set(get_model_state_dict(part))
        own: dict[int, torch.Tensor] = {}
        for name, param in part.named_parameters(remove_duplicate=False):
            if not param.requires_grad:
                continue
            # the name without wrappers (compile, activation checkpointing, DDP), as DCP saves
            # the model's tensors: the same names load the average at any layout
            (fqn,) = _get_fqns(part, name)
            if fqn not in known:
                raise AssertionError(f"{fqn!r} is not a name of the model's state dict")
            if id(param) not in own:
                own[id(param)] = param.detach().to(torch.float32, copy=True)
                self.params.append(param)
                self.averages.append(own[id(param)])
            self.by_name[fqn] = own[id(param)]

    @torch.no_grad()
    def reset(self) -> None:
        """The averages become the current weights."""
        for average, param in zip(self.averages, self.params, strict=True):
            average.copy_(param.detach())

    @torch.no_grad()
    def update(self, weight: float) -> None:
        """average += weight x (parameter - average), for every parameter."""
        for group in self._groups:
            averages = [self.averages[i] for i in group]
            current = [self.params[i].detach().to(torch.float32) for i in group]
            torch._foreach_lerp_(averages, current, weight)

    @contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The model holds the averages (cast to each weight's dtype) inside the block, and its
        own weights again after it. The own weights wait in a copy on their device."""
        with torch.no_grad():
            kept = [param.detach().clone() for param in self.params]
            for param, average in zip(self.params, self.averages, strict=True):
                param.copy_(average)
        try:
            yield
        finally:
            with torch.no_grad():
                for param, own in zip(self.params, kept, strict=True):
                    param.copy_(own)

    def state_dict(self) -> dict[str, Any]:
        return {"weights": dict(self.by_name)}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        # DCP loads into the tensors state_dict() handed it; copy in case it made new ones
        for name, value in state["weights"].items():
            average = self.by_name[name]
            if value is not average:
                average.copy_(value)


def _same_layout(params: Sequence[torch.Tensor]) -> list[list[int]]:
    """The parameters in groups that one foreach call can update: the same device, and for
    DTensors the same mesh and placements (expert weights live on another mesh than the rest)."""
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, param in enumerate(params):
        mesh = getattr(param, "device_mesh", None)
        placements = tuple(getattr(param, "placements", ()))
        key = (param.device, type(param), id(mesh) if mesh is not None else None, placements)
        groups.setdefault(key, []).append(i)
    return list(groups.values())
