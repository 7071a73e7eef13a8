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
    """A model and (optionally) its optimizers, through torch's distributed state-dict helpers,
    so plain, DDP, FSDP2 and tensor-parallel models all save as fully-qualified sharded tensors
    and load at any layout."""

    def __init__(self, model: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer] = ()):
        self.model = model
        self.optimizers = list(optimizers)

    def state_dict(self) -> dict[str, Any]:
        if not self.optimizers:
            return {"model": get_model_state_dict(self.model)}
        model, optim = get_state_dict(self.model, self.optimizers)
        return {"model": model, "optim": optim}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not self.optimizers:
            set_model_state_dict(self.model, state["model"], options=StateDictOptions(strict=True))
            return
        set_state_dict(
            self.model,
            self.optimizers,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )


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
