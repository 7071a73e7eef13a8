"""The options of the `default` parallel strategy: plain attrs config (no torch).

The mesh degrees themselves (dp_replicate, dp_shard, cp, tp, pp) are the run's `mesh:` section;
these options say how each dimension is applied.
"""

from __future__ import annotations

from typing import Literal, TypeVar

import attrs

PIPELINE_SCHEDULES = (
    "GPipe",
    "1F1B",
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
)
# schedules that run one stage per rank; the others take several (`stages_per_rank`)
SINGLE_STAGE_SCHEDULES = ("GPipe", "1F1B")
# schedules that place two stages per rank in a V (rank r holds stages r and 2·pp - 1 - r)
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
DTYPES = ("float32", "bfloat16", "float16")

# an option's value, for the validators that check one
_Number = TypeVar("_Number", bound=float)
_Count = TypeVar("_Count", bound=int | None)


def _positive(instance: object, attribute: attrs.Attribute[_Count], value: _Count) -> None:
    if value is not None and value < 1:
        raise ValueError(f"must be at least 1, got {value}")


def _non_negative(instance: object, attribute: attrs.Attribute[_Number], value: _Number) -> None:
    if value < 0:
        raise ValueError(f"must be at least 0, got {value}")


@attrs.frozen(kw_only=True)
class ActivationCheckpointing:
    """Recompute activations in backward instead of keeping them.

    - `none`: keep everything (fastest, most memory).
    - `full`: checkpoint every block.
    - `blocks`: checkpoint every `every`-th block (every: 2 → half of them).
    - `ops`: per-operator selective: keep the outputs of matmuls and attention (every other
      matmul output is recomputed), recompute the cheap elementwise ops.
    """

    mode: Literal["none", "full", "blocks", "ops"] = attrs.field(
        default="none", validator=attrs.validators.in_(("none", "full", "blocks", "ops"))
    )
    every: int = attrs.field(default=2, validator=_positive)


@attrs.frozen(kw_only=True)
class Pipeline:
    """Pipeline parallelism (mesh `pp` > 1) with torch.distributed.pipelining.

    The blocks are split into `pp x stages_per_rank` contiguous stages of balanced cost, where the
    first stage's embedding counts as `first_stage_weight` blocks and the last stage's norm and
    head as `last_stage_weight` blocks. The pipeline's micro-batches are the run's gradient
    accumulation steps.
    """

    schedule: Literal[PIPELINE_SCHEDULES] = attrs.field(  # type: ignore[valid-type]
        default="1F1B", validator=attrs.validators.in_(PIPELINE_SCHEDULES)
    )
    stages_per_rank: int | None = attrs.field(default=None, validator=_positive)
    first_stage_weight: float = attrs.field(default=1.0, validator=_non_negative)
    last_stage_weight: float = attrs.field(default=1.0, validator=_non_negative)

    @property
    def resolved_stages_per_rank(self) -> int:
        if self.stages_per_rank is not None:
            return self.stages_per_rank
        return 1 if self.schedule in SINGLE_STAGE_SCHEDULES else 2


@attrs.frozen(kw_only=True)
class ContextParallel:
    """Context parallelism (mesh `cp` > 1): each rank holds a shard of every sequence and gathers
    keys and values from the others. `load_balance` gives each rank one chunk from the head and
    one from the tail of the sequence, so causal attention costs every rank the same."""

    load_balance: bool = True


@attrs.frozen(kw_only=True)
class ParallelOptions:
    activation_checkpointing: ActivationCheckpointing = attrs.Factory(ActivationCheckpointing)
    compile: bool = False
    param_dtype: Literal["float32", "bfloat16", "float16"] = attrs.field(
        default="float32", validator=attrs.validators.in_(DTYPES)
    )
    reduce_dtype: Literal["float32", "bfloat16", "float16"] = attrs.field(
        default="float32", validator=attrs.validators.in_(DTYPES)
    )
    reshard_after_forward: Literal["default", "always", "never"] = attrs.field(
        default="default", validator=attrs.validators.in_(("default", "always", "never"))
    )
    sequence_parallel: bool = True
    loss_parallel: bool = False
    pipeline: Pipeline = attrs.Factory(Pipeline)
    context_parallel: ContextParallel = attrs.Factory(ContextParallel)
    float8: bool = False
