"""The `distill` objective: knowledge distillation from a teacher llmtrain checkpoint
(`training.objective: {kind: distill, teacher: PATH}`).

`llmtrain` loads this module on every start: torch is imported only when a run builds the
objective (`llmtrain_distill.objective`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

from llmtrain.core_mesh.plugins import Register, hookimpl

if TYPE_CHECKING:
    from llmtrain.core_mesh.interfaces import ObjectiveContext
    from llmtrain_distill.objective import Distill


def _non_negative(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if value < 0:
        raise ValueError(f"{attribute.name} must be >= 0, got {value}")


def _weight(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{attribute.name} must be in [0, 1], got {value}")


def _positive(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if value <= 0:
        raise ValueError(f"{attribute.name} must be > 0, got {value}")


def _path(_: object, attribute: attrs.Attribute[str], value: str) -> None:
    if not value.strip():
        raise ValueError(f"{attribute.name} must name a run directory or checkpoint")


@attrs.frozen(kw_only=True)
class DistillOptions:
    # a run directory, its checkpoints directory, or one step directory (`.../step-200`)
    teacher: str = attrs.field(validator=_path)
    # weight of the hard-label cross-entropy; 1 - alpha weighs the KL to the teacher
    alpha: float = attrs.field(default=0.5, validator=_weight)
    temperature: float = attrs.field(default=1.0, validator=_positive)
    z_loss: float = attrs.field(default=0.0, validator=_non_negative)


def distill(options: DistillOptions, context: ObjectiveContext) -> Distill:
    from llmtrain_distill.objective import build

    return build(options, context)


@hookimpl
def llmtrain_objectives(register: Register) -> None:
    register(
        "distill",
        distill,
        options=DistillOptions,
        help="knowledge distillation from a teacher checkpoint (alpha·CE + (1-alpha)·T²·KL)",
    )
