"""Learning-rate schedule plugins. A schedule's target is called as `target(options, total_steps)`
and returns the multiplier of the optimizer's base lr at each step (0-based).

A checkpoint records the schedule its run trained with (`lr_scheduler` and the steps it spans);
`schedule_change` says what a resume with another schedule (more steps, other options) would do
to the lr, and `on_extend` refuses, keeps or recomputes it as `training.on_extend` says."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import attrs


def _non_negative(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value < 0:
        raise ValueError(f"must be at least 0, got {value}")


def _fraction(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"must be in [0, 1], got {value}")


@attrs.frozen(kw_only=True)
class WarmupOptions:
    """`warmup_steps` of linear warmup from 0, then the schedule; it ends at `min_ratio` x lr."""

    warmup_steps: int = attrs.field(default=0, validator=_non_negative)
    min_ratio: float = attrs.field(default=0.1, validator=_fraction)


@attrs.frozen(kw_only=True)
class WSDOptions:
    """Warmup, a stable phase at the full lr, then a decay over the last `decay_fraction` of the
    steps (or the last `decay_steps`, when given) (`linear`, `cosine` or `sqrt`) down to
    `min_ratio`. Only the decay depends on the run's length: a run resumed with more steps from
    a checkpoint in the stable phase goes on at the same lr and decays at its new end."""

    warmup_steps: int = attrs.field(default=0, validator=_non_negative)
    decay_fraction: float = attrs.field(default=0.2, validator=_fraction)
    decay_steps: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(_non_negative)
    )
    decay: str = attrs.field(
        default="linear", validator=attrs.validators.in_(("linear", "cosine", "sqrt"))
    )
    min_ratio: float = attrs.field(default=0.0, validator=_fraction)


Schedule = Callable[[int], float]


def _warmup(step: int, warmup: int) -> float | None:
    return (step + 1) / warmup if step < warmup else None


def constant(options: WarmupOptions, total_steps: int) -> Schedule:
    def factor(step: int) -> float:
        return _warmup(step, options.warmup_steps) or 1.0

    return factor


def _decaying(shape: Callable[[float], float]) -> Callable[[WarmupOptions, int], Schedule]:
    """A schedule that warms up, then follows shape(progress) from 1 to 0, scaled to min_ratio."""

    def build(options: WarmupOptions, total_steps: int) -> Schedule:
        def factor(step: int) -> float:
            warm = _warmup(step, options.warmup_steps)
            if warm is not None:
                return warm
            span = max(1, total_steps - options.warmup_steps)
            progress = min(1.0, (step - options.warmup_steps) / span)
            return options.min_ratio + (1 - options.min_ratio) * shape(progress)

        return factor

    return build


cosine = _decaying(lambda p: 0.5 * (1 + math.cos(math.pi * p)))
linear = _decaying(lambda p: 1.0 - p)

_DECAYS: dict[str, Callable[[float], float]] = {
    "linear": lambda p: 1.0 - p,
    "cosine": lambda p: 0.5 * (1 + math.cos(math.pi * p)),
    "sqrt": lambda p: 1.0 - math.sqrt(p),
}


def wsd(options: WSDOptions, total_steps: int) -> Schedule:
    if options.decay_steps is not None:
        decay_steps = min(options.decay_steps, total_steps)
    else:
        decay_steps = round(total_steps * options.decay_fraction)
    decay_start = total_steps - decay_steps

    def factor(step: int) -> float:
        warm = _warmup(step, options.warmup_steps)
        if warm is not None:
            return warm
        if step < decay_start or decay_steps == 0:
            return 1.0
        progress = min(1.0, (step - decay_start) / decay_steps)
        return options.min_ratio + (1 - options.min_ratio) * _DECAYS[options.decay](progress)

    return factor


def decay_start(options: object, total_steps: int) -> int | None:
    """The (0-based) step where a wsd schedule leaves its stable phase; None for other options."""
    if not isinstance(options, WSDOptions):
        return None
    if options.decay_steps is not None:
        return total_steps - min(options.decay_steps, total_steps)
    return total_steps - round(total_steps * options.decay_fraction)


ON_EXTEND = ("refuse", "keep", "recompute")


@attrs.frozen(kw_only=True)
class ScheduleChange:
    """A resume at `step` (0-based: the next step to train) whose configured schedule differs
    from the one the checkpoint was trained with: the lr there on each."""

    step: int
    trained: float
    configured: float

    @property
    def jumps(self) -> bool:
        return not math.isclose(self.trained, self.configured, rel_tol=1e-9, abs_tol=1e-15)


def schedule_change(
    trained: Schedule, configured: Schedule, step: int, base_lr: float
) -> ScheduleChange:
    return ScheduleChange(
        step=step, trained=base_lr * trained(step), configured=base_lr * configured(step)
    )


@attrs.frozen
class Extension:
    """What a resume does with a schedule that changed (`on_extend`): go on with the trained one
    (`keep_trained`) or the configured one, said as the log `event` with its `message`."""

    keep_trained: bool
    event: str
    message: str


def on_extend(
    mode: str,
    change: ScheduleChange,
    trained: dict[str, Any],
    configured: dict[str, Any],
    keys: list[str],
    decays_from: int | None,
) -> Extension:
    """`training.on_extend` on a resume whose schedule changed (`trained` and `configured`, as
    checkpoints record them; `keys`: the settings that changed it): go on with the configured
    schedule where the lr stays where it is; otherwise refuse (a one-line `UserError`), keep the
    trained one or recompute, as `mode` says. Loud either way: never a silent jump."""
    from llmtrain.core_mesh.errors import UserError

    options = "lr_scheduler" in keys
    was, now = described(trained, options), described(configured, options)
    at = f"step {change.step + 1}"
    if mode == "keep":
        return Extension(
            True,
            "lr.schedule_kept",
            f"training.on_extend=keep: going on with the trained schedule, {was} (lr "
            f"{change.trained:.2e} at {at}), not {now}",
        )
    if not change.jumps:
        decays = f"; it decays from step {decays_from + 1}" if decays_from is not None else ""
        return Extension(
            False,
            "lr.schedule_extended",
            f"{', '.join(keys)}: the lr schedule becomes {now} (trained: {was}); "
            f"the lr at {at} stays {change.configured:.2e}{decays}",
        )
    if mode == "recompute":
        return Extension(
            False,
            "lr.schedule_recomputed",
            f"training.on_extend=recompute: the lr jumps at {at} from "
            f"{change.trained:.2e} to {change.configured:.2e} ({now}, trained: {was})",
        )
    raise UserError(
        f"{', '.join(keys)}: checkpoint step {change.step} was trained on {was}; {now} moves "
        f"the lr at {at} from {change.trained:.2e} to {change.configured:.2e}. Set "
        f"training.on_extend=keep to go on with the trained schedule "
        f"({change.trained:.2e} at {at}) or training.on_extend=recompute to take the "
        "jump; a wsd schedule extends without one from a checkpoint before its decay"
    )


def on_lr_change(mode: str, step: int, trained: float, configured: float) -> Extension:
    """`training.on_extend` on a resume whose `optimizer.lr` is not the one the checkpoint was
    trained at (its optimizer state holds that one): keep it, take the configured one
    (recompute) or refuse (a one-line `UserError`). Said either way."""
    from llmtrain.core_mesh.errors import UserError

    said = (
        f"optimizer.lr: checkpoint step {step} was trained at lr {trained:.2e}, the config "
        f"says {configured:.2e}"
    )
    if mode == "keep":
        return Extension(
            True, "lr.base_kept", f"{said}; training.on_extend=keep goes on at {trained:.2e}"
        )
    if mode == "recompute":
        return Extension(
            False,
            "lr.base_changed",
            f"{said}; training.on_extend=recompute goes on at {configured:.2e} from step "
            f"{step + 1}",
        )
    raise UserError(
        f"{said}. Set optimizer.lr: {trained:g} to resume as trained, training.on_extend=keep "
        f"to go on at {trained:.2e} or training.on_extend=recompute to train at "
        f"{configured:.2e} from step {step + 1}"
    )


def described(record: dict[str, Any], options: bool) -> str:
    """'a cosine lr schedule over 600 steps' (with its options, when `options`)."""
    choice = record["lr_scheduler"] or {"kind": "constant"}
    text = choice["kind"]
    if options:
        shown = ", ".join(f"{k}={v}" for k, v in choice.items() if k != "kind")
        text += f" ({shown})" if shown else ""
    return f"a {text} lr schedule over {record['total_steps']} steps"
