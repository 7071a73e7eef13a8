"""Pipeline parallelism: split the blocks into stages, place stages on ranks, build the schedule.

`split_blocks` is plain arithmetic (no torch): contiguous stages whose largest cost is as small as
possible, where a block costs 1, the first stage's embedding `first_weight` and the last stage's
norm and head `last_weight`. Stages are placed in a loop (stage s on rank s mod pp), or in a V for
the V schedules (rank r holds stages r and 2·pp - 1 - r), which keeps the first and last stage on
rank 0.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from llmtrain.parallel.options import V_SCHEDULES, Pipeline

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed import ProcessGroup

_SCHEDULE_CLASSES = {
    "GPipe": "ScheduleGPipe",
    "1F1B": "Schedule1F1B",
    "Interleaved1F1B": "ScheduleInterleaved1F1B",
    "LoopedBFS": "ScheduleLoopedBFS",
    "InterleavedZeroBubble": "ScheduleInterleavedZeroBubble",
    "ZBVZeroBubble": "ScheduleZBVZeroBubble",
    "DualPipeV": "ScheduleDualPipeV",
}


def split_blocks(
    n_blocks: int, n_stages: int, first_weight: float = 1.0, last_weight: float = 1.0
) -> list[range]:
    """Contiguous block ranges, one per stage, each non-empty, minimising the largest stage cost."""
    if not 1 <= n_stages <= n_blocks:
        raise ValueError(f"cannot split {n_blocks} blocks into {n_stages} non-empty stages")

    def cost(stage: int, start: int, end: int) -> float:
        extra = (first_weight if stage == 0 else 0.0) + (
            last_weight if stage == n_stages - 1 else 0.0
        )
        return end - start + extra

    @functools.cache
    def best(stage: int, start: int) -> tuple[float, tuple[int, ...]]:
        """Lowest max cost of stages stage.. covering blocks start.., and the stage ends."""
        if stage == n_stages - 1:
            return cost(stage, start, n_blocks), (n_blocks,)
        options = []
        for end in range(start + 1, n_blocks - (n_stages - stage - 1) + 1):
            rest, ends = best(stage + 1, end)
            # ties go to the later cut, so spare blocks land on earlier stages
            options.append((max(cost(stage, start, end), rest), -end, (end, *ends)))
        top = min(options)
        return top[0], top[2]

    ends = best(0, 0)[1]
    starts = (0, *ends[:-1])
    return [range(s, e) for s, e in zip(starts, ends, strict=True)]


def stages_of_rank(rank: int, pp: int, stages_per_rank: int, schedule: str) -> list[int]:
    if schedule in V_SCHEDULES:
        return [rank, 2 * pp - 1 - rank]
    return [rank + pp * i for i in range(stages_per_rank)]


def build_stage_modules(
    module: nn.Module,
    trim_to_stage: Callable[[Any, Sequence[int], bool, bool], None],
    stage_ids: list[int],
    ranges: list[range],
) -> list[nn.Module]:
    """One trimmed copy of `module` per stage this rank runs (copies are cheap on the meta device)."""
    n_stages = len(ranges)
    parts = []
    for i, stage in enumerate(stage_ids):
        part = module if i == len(stage_ids) - 1 else copy.deepcopy(module)
        trim_to_stage(part, list(ranges[stage]), stage == 0, stage == n_stages - 1)
        parts.append(part)
    return parts


def build_schedule(
    parts: list[nn.Module],
    stage_ids: list[int],
    n_stages: int,
    options: Pipeline,
    *,
    microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    device: torch.device,
    group: ProcessGroup | None,
) -> Any:
    from torch.distributed.pipelining import PipelineStage, schedules

    stages = [
        PipelineStage(part, stage, n_stages, device, group=group)
        for part, stage in zip(parts, stage_ids, strict=True)
    ]
    cls = getattr(schedules, _SCHEDULE_CLASSES[options.schedule])
    if issubclass(cls, schedules.PipelineScheduleSingle):
        return cls(stages[0], microbatches, loss_fn=loss_fn, scale_grads=False)
    return cls(stages, microbatches, loss_fn=loss_fn, scale_grads=False)
