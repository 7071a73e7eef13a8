"""The run config: one YAML file that describes a whole training run.

Components (model, optimizer, lr schedule, loggers) are chosen by `kind:` among the installed
plugins; each plugin's own options class validates the rest of its section.
"""

from __future__ import annotations

import attrs

from llmtrain.core_mesh.config import Choice
from llmtrain.core_mesh.mesh import MeshSpec


def _positive(instance: object, attribute: attrs.Attribute, value: int) -> None:
    if value < 1:
        raise ValueError(f"must be at least 1, got {value}")


def _name(instance: object, attribute: attrs.Attribute, value: str) -> None:
    if not value or "/" in value or value.strip() != value:
        raise ValueError(
            f"must be a non-empty name without '/' or surrounding spaces, got {value!r}"
        )


@attrs.frozen(kw_only=True)
class TrainingConfig:
    steps: int = attrs.field(validator=_positive)
    log_every: int = attrs.field(default=10, validator=_positive)


@attrs.frozen(kw_only=True)
class RunConfig:
    name: str = attrs.field(validator=_name)
    seed: int = 0
    model: Choice.of("model")  # type: ignore[valid-type]
    optimizer: Choice.of("optimizer")  # type: ignore[valid-type]
    lr_scheduler: Choice.of("lr_scheduler") | None = None  # type: ignore[valid-type]
    loggers: list[Choice.of("logger")] = attrs.Factory(list)  # type: ignore[valid-type]
    mesh: MeshSpec = attrs.Factory(MeshSpec)
    training: TrainingConfig
