"""Profiler windows: torch.profiler opened for a few steps every so often."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from llmtrain.train_loop.run_config import ProfileConfig

if TYPE_CHECKING:
    import torch
    from torch.profiler import profile

log = structlog.get_logger("llmtrain.train_loop")


class StepProfiler:
    """Opens torch.profiler for `warmup + active` steps every `every` steps; otherwise costs
    one modulo per step."""

    def __init__(
        self, config: ProfileConfig | None, run_dir: Path, rank: int, device: torch.device
    ):
        self.config = config
        self.run_dir = run_dir
        self.rank = rank
        self.device = device
        self.prof: profile | None = None
        self.left = 0
        self.enabled = config is not None and (config.ranks is None or rank in config.ranks)

    def before_step(self, step: int, last_step: int) -> None:
        """`step`: the 1-based number of the step about to run; a window that would not end by
        `last_step` is not opened."""
        c = self.config
        if not self.enabled or c is None or self.prof is not None or step % c.every:
            return
        if step + c.warmup + c.active - 1 > last_step:
            return
        from torch.profiler import ProfilerActivity, profile, schedule

        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        first = step + c.warmup
        last = first + c.active - 1
        self.prof = profile(
            activities=activities,
            schedule=schedule(wait=0, warmup=c.warmup, active=c.active, repeat=1),
            on_trace_ready=lambda prof: self._export(prof, first, last),
            record_shapes=c.record_shapes,
            profile_memory=c.profile_memory,
            with_stack=c.with_stack,
        )
        self.prof.start()
        self.left = c.warmup + c.active

    def after_step(self) -> None:
        if self.prof is None:
            return
        self.prof.step()
        self.left -= 1
        if self.left == 0:
            self.close()

    def _export(self, prof: profile, first: int, last: int) -> None:
        path = self.run_dir / "profiles" / f"step-{first}" / f"rank{self.rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        prof.export_chrome_trace(str(tmp))
        tmp.replace(path)
        log.info("profile.written", steps=f"{first}-{last}", trace=str(path))

    def close(self) -> None:
        if self.prof is not None:
            prof, self.prof = self.prof, None
            prof.stop()
