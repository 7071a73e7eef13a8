"""Stateful parts a training state is made of (DCP calls `state_dict`/`load_state_dict`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)


class ModelState:
    """A model (or the parts of it this rank holds: pipeline stages) and its optimizers, through
    torch's distributed state-dict helpers, so plain, DDP, FSDP2, tensor- and pipeline-parallel
    models all save as fully-qualified sharded tensors and load at any layout.

    `optimizers`: for one module, its optimizers; for a list of parts, one list per part.
    Optimizer state is saved per parameter name (flattened), so it also reloads when the parts
    are cut differently.
    """

    def __init__(
        self,
        model: torch.nn.Module | Sequence[torch.nn.Module],
        optimizers: Sequence[Any] = (),
    ):
        self.parts = [model] if isinstance(model, torch.nn.Module) else list(model)
        optimizers = list(optimizers)
        if optimizers and not isinstance(optimizers[0], (list, tuple)):
            optimizers = [optimizers]
        if optimizers and len(optimizers) != len(self.parts):
            raise ValueError(f"{len(self.parts)} model parts but {len(optimizers)} optimizer lists")
        self.optimizers = [list(opts) for opts in optimizers]

    @property
    def model(self) -> torch.nn.Module:
        return self.parts[0]

    def state_dict(self) -> dict[str, object]:
        model: dict[str, object] = {}
        optim: dict[str, object] = {}
        for i, part in enumerate(self.parts):
            if self.optimizers:
                m, o = get_state_dict(part, self.optimizers[i], options=_OPTIONS)
                optim.update(o)
            else:
                m = get_model_state_dict(part)
            model.update(m)
        return {"model": model, "optim": optim} if self.optimizers else {"model": model}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for i, part in enumerate(self.parts):
            own = get_model_state_dict(part).keys()
            model = {k: state["model"][k] for k in own}
            if not self.optimizers:
                set_model_state_dict(part, model, options=StateDictOptions(strict=True))
                continue
            params = {name for name, _ in part.named_parameters()}
            optim = {k: v for k, v in state["optim"].items() if _param_of(k) in params}
            set_state_dict(
                part,
                self.optimizers[i],
                model_state_dict=model,
                optim_state_dict=optim,
                options=_OPTIONS,
            )


_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def _param_of(flat_key: str) -> str:
    """`state.blocks.0.wq.weight.exp_avg` / `param_groups.blocks.0.wq.weight.lr` -> the name."""
    return flat_key.split(".", 1)[1].rsplit(".", 1)[0]


class Values:
    """Plain numbers and strings (step, tokens seen, the data position) saved by value."""

    def __init__(self, **values: Any):
        self.values = dict(values)

    def state_dict(self) -> dict[str, Any]:
        return dict(self.values)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.values.update(state)

    def __getitem__(self, key: str) -> Any:
        return self.values[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self.values[key] = value
