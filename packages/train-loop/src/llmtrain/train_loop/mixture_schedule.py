"""A run's mixture schedule as steps: what checkpoints record, what a resume may change.

`data.phases` gives each phase's weights and where it ends (a step, or a fraction of the run);
`data.train`'s weights alone are a schedule of one phase. The schedule a run trains on is
recorded with its checkpoints and in its log (`data.mixture`) as plain steps and weights, so a
resume can tell whether the config changes the mixture of steps already trained, and
`llmtrain which` rebuilds the order the run really read.

A resume may change the schedule from the step it goes on at: the steps already trained keep
their data, and each source reads on where it stopped. A change to the mixture of trained steps
(another weight in a finished phase, a phase end moved into the past: a fraction of a longer run)
would describe data the run never read: it is refused, or with `training.on_extend: keep` the
run goes on with the schedule it trained on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from llmtrain.core_mesh.config import ConfigValueError
from llmtrain.core_mesh.errors import UserError
from llmtrain.data_pack.sampling import Phase
from llmtrain.train_loop.run_config import DataConfig

# one phase as recorded: {"weights": [...], "until_step": int | None}
Schedule = list[dict[str, Any]]


def schedule_of(data: DataConfig, total_steps: int) -> Schedule:
    """The configured schedule of a run of `total_steps`: phases with their end steps."""
    if not data.phases:
        return [{"weights": [d.weight for d in data.train], "until_step": None}]
    try:
        ends = data.phase_ends(total_steps)
    except ConfigValueError as exc:
        raise UserError(f"data.{exc.field}: {exc}") from None
    return [
        {"weights": list(phase.weights), "until_step": end}
        for phase, end in zip(data.phases, ends, strict=True)
    ]


def sampler_phases(schedule: Schedule, global_batch: int) -> list[Phase] | None:
    """The schedule as the sampler takes it (ends in global samples); None for one phase (the
    sampler's plain weights, which draw the same order)."""
    if len(schedule) == 1:
        return None
    return [
        Phase(
            tuple(float(w) for w in phase["weights"]),
            None if phase["until_step"] is None else int(phase["until_step"]) * global_batch,
        )
        for phase in schedule
    ]


def _trained_part(schedule: Schedule, step: int) -> list[tuple[tuple[float, ...], int]]:
    """(weights, end clipped to `step`) of each phase that began before `step`: what decides the
    data of steps 1..step."""
    part, start = [], 0
    for phase in schedule:
        if start >= step:
            break
        end = phase["until_step"]
        part.append((tuple(float(w) for w in phase["weights"]), min(step, end or step)))
        start = end if end is not None else step
    return part


@attrs.frozen
class Resumed:
    """The schedule a resumed run goes on with, and the warning that says so (None: none)."""

    schedule: Schedule
    event: str | None = None
    message: str | None = None


def on_resume(trained: Schedule, configured: Schedule, step: int, on_extend: str) -> Resumed:
    """The schedule to go on with at checkpoint `step`: the configured one when it gives the
    trained steps the same data; otherwise the trained one (`on_extend: keep`) or a one-line
    refusal."""
    if trained == configured:
        return Resumed(configured)
    was, now = described(trained), described(configured)
    if _trained_part(trained, step) == _trained_part(configured, step):
        return Resumed(
            configured,
            "data.mixture_changed",
            f"data: the mixture schedule becomes {now} from step {step + 1} (trained: {was}); "
            "the steps already trained keep their data",
        )
    if on_extend == "keep":
        return Resumed(
            trained,
            "data.mixture_kept",
            f"training.on_extend=keep: going on with the trained mixture schedule, {was}, "
            f"not {now}",
        )
    raise UserError(
        f"data: checkpoint step {step} was trained on the mixture schedule {was}; this config's "
        f"{now} changes the data of steps already trained. Change the mixture only from step "
        f"{step + 1} on (a new phase from there: data.phases with until_step), set "
        "training.on_extend=keep to go on with the trained schedule, or start a new run "
        "(init.from)"
    )


def described(schedule: Sequence[dict[str, Any]]) -> str:
    """'[0.5, 0.5] to step 80, then [0.2, 0.8]'."""
    parts = []
    for phase in schedule:
        weights = "[" + ", ".join(f"{float(w):g}" for w in phase["weights"]) + "]"
        end = phase["until_step"]
        parts.append(weights if end is None else f"{weights} to step {end}")
    return ", then ".join(parts)
