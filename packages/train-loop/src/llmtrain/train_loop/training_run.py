"""What a callback sees of the run: core-mesh's `TrainingRun`, and nothing else of the Trainer.

Callbacks get this view, not the Trainer: they read the run through it and change it only
through `record_metric` and `request_stop`, so the Trainer's own state (its optimizers, its
recorder, its loop) stays its own to change. Each property reads the Trainer's current value.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from llmtrain.core_mesh.interfaces import (
    Better,
    ModelDescription,
    ParallelModel,
    Reduce,
    RunInfo,
    Tokenizer,
)
from llmtrain.core_mesh.plugins import PluginManager
from llmtrain.core_mesh.world import World

if TYPE_CHECKING:
    import torch

    from llmtrain.checkpoint.state import Values
    from llmtrain.data_pack.loader import WindowDataset
    from llmtrain.data_pack.sampling import BatchPlan
    from llmtrain.train_loop.run_config import RunConfig
    from llmtrain.train_loop.trainer import Trainer


class RunView:
    """The `TrainingRun` of one Trainer."""

    __slots__ = ("_trainer",)

    def __init__(self, trainer: Trainer):
        self._trainer = trainer

    @property
    def config(self) -> RunConfig:
        return self._trainer.config

    @property
    def run_info(self) -> RunInfo:
        return self._trainer.run_info

    @property
    def run_dir(self) -> Path:
        return self._trainer.run_dir

    @property
    def world(self) -> World:
        return self._trainer.world

    @property
    def device(self) -> torch.device:
        return self._trainer.device

    @property
    def model(self) -> ParallelModel:
        return self._trainer.model

    @property
    def description(self) -> ModelDescription:
        return self._trainer.description

    @property
    def step(self) -> int:
        return self._trainer.step

    @property
    def total_steps(self) -> int:
        return self._trainer.total_steps

    @property
    def global_batch(self) -> int:
        return self._trainer.global_batch

    @property
    def plan(self) -> BatchPlan:
        return self._trainer.plan

    @property
    def train_data(self) -> WindowDataset:
        return self._trainer.train_data

    @property
    def counters(self) -> Values:
        return self._trainer.counters

    @property
    def data_wait_s(self) -> float:
        return self._trainer.data_wait_s

    @property
    def sync_wait_s(self) -> float:
        return self._trainer.sync_wait_s

    @property
    def last_local_loss(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self._trainer.last_local_loss

    @property
    def plugins(self) -> PluginManager:
        return self._trainer.plugins

    @property
    def tokenizer(self) -> Tokenizer:
        return self._trainer.tokenizer

    @property
    def random(self) -> random.Random:
        return self._trainer.random

    @property
    def metric_directions(self) -> Mapping[str, str]:
        return self._trainer.metric_directions

    @property
    def secrets(self) -> set[str]:
        """The config's credentials, masked in what the summary callback writes."""
        return self._trainer.secrets

    def record_metric(
        self,
        name: str,
        value: float | torch.Tensor,
        /,
        *,
        reduce: Reduce = "mean",
        better: Better = None,
    ) -> None:
        self._trainer.record_metric(name, value, reduce=reduce, better=better)

    def request_stop(self, reason: str, /) -> None:
        self._trainer.request_stop(reason)

    def evaluate(self, due: Sequence[int] | None = None, /) -> dict[str, float]:
        return self._trainer.evaluate(due)
