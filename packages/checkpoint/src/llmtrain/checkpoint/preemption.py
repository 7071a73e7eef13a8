"""Preemption: SIGTERM/SIGUSR1 (SLURM sends them before killing a job) ask the loop to stop.

The handler only sets a flag; the training loop calls `should_stop()` after each step, saves a
final checkpoint (`Checkpointer.save(..., blocking=True)`) and exits 0. With several ranks the
flag is all-reduced, so every rank stops at the same step even if only one got the signal.
Importing this module imports no torch, so a command can listen before its slow imports.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

import structlog

log = structlog.get_logger("llmtrain.checkpoint")

DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preemption:
    def __init__(
        self, signals: Sequence[int] = DEFAULT_SIGNALS, *, device: torch.device | str = "cpu"
    ):
        self.requested = False
        self.signal_name: str | None = None
        self.device = device  # where the all-reduced flag lives (the loop's device under NCCL)
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in signals:
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        self.requested = True
        self.signal_name = signal.Signals(signum).name
        log.warning(
            "preemption.requested",
            signal=self.signal_name,
            action="finishing the step, saving a checkpoint, exiting",
        )

    def should_stop(self) -> bool:
        """True on every rank once any rank was signalled (a collective when distributed)."""
        import torch
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return self.requested  # nobody to ask: the flag, no tensor
        flag = torch.tensor([1.0 if self.requested else 0.0], device=torch.device(self.device))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        # every rank returns the vote, so all stop at the same step; a signal that lands during
        # the vote is kept for the next one
        voted = bool(flag.item())
        self.requested = self.requested or voted
        return voted

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
