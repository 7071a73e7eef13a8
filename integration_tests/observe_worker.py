"""Run under torchrun by test_observe.py: `llmtrain run CONFIG OVERRIDES...` with one more model
kind, `slow-tiny`: the tiny transformer whose training forwards sleep on one rank.

Environment: SLOW_RANK (default 1) is the rank that sleeps; SLOW_SECONDS (default 0) per training
forward; HANG_AT_FORWARD=N makes that rank's N-th training forward (1-based) sleep for
HANG_SECONDS (default 600), a hang for the watchdog to find."""

from __future__ import annotations

import os
import sys
import time

import torch

from llmtrain.core_mesh.cli import main
from llmtrain.core_mesh.plugins import PluginManager, hookimpl


def straggle(seconds: float) -> None:
    time.sleep(seconds)


def hang_in_forward(seconds: float) -> None:
    time.sleep(seconds)


class SlowModel:
    def __init__(self, rank: int):
        self.sleeps = rank == int(os.environ.get("SLOW_RANK", "1"))
        self.seconds = float(os.environ.get("SLOW_SECONDS", "0"))
        self.hang_at = int(os.environ.get("HANG_AT_FORWARD", "0"))
        self.hang_seconds = float(os.environ.get("HANG_SECONDS", "600"))
        self.forwards = 0

    @hookimpl
    def llmtrain_models(self, register):
        from llmtrain.models.config import TransformerConfig
        from llmtrain.models.presets import PRESETS

        register("slow-tiny", self.build, options=TransformerConfig, defaults=PRESETS["tiny"])

    def training_forward(self) -> None:
        self.forwards += 1
        if not self.sleeps:
            return
        if self.forwards == self.hang_at:
            hang_in_forward(self.hang_seconds)
        if self.seconds:
            straggle(self.seconds)

    def build(self, options):
        from llmtrain.models.transformer import Transformer

        slow = self

        class SlowTransformer(Transformer):
            def forward(self, tokens, *args, **kwargs):
                if self.training and torch.is_grad_enabled():
                    slow.training_forward()
                return super().forward(tokens, *args, **kwargs)

        return SlowTransformer(options)


if __name__ == "__main__":
    plugins = PluginManager(blocked=()).load_entry_points()
    plugins.register(SlowModel(int(os.environ.get("RANK", "0"))), "slow-model")
    sys.exit(main(["run", *sys.argv[1:]], plugins=plugins))
