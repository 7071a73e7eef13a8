"""The `default` strategy's options as a config section: defaults, strict structuring with the
path of every problem, and the resolved number of pipeline stages per rank."""

from __future__ import annotations

import pytest

from llmtrain.core_mesh.config import ConfigError, dump_config, parse_yaml, structure
from llmtrain.parallel.options import (
    PIPELINE_SCHEDULES,
    SINGLE_STAGE_SCHEDULES,
    V_SCHEDULES,
    ActivationCheckpointing,
    ContextParallel,
    ParallelOptions,
    Pipeline,
)


def problems(raw) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        structure(raw, ParallelOptions)
    return {p.dotted: p.message for p in info.value.problems}


def test_defaults():
    options = structure({}, ParallelOptions)
    assert options == ParallelOptions()
    assert structure(None, ParallelOptions) == options
    assert options.activation_checkpointing == ActivationCheckpointing(mode="none", every=2)
    assert options.compile is False and options.float8 is False
    assert (options.param_dtype, options.reduce_dtype) == ("float32", "float32")
    assert options.reshard_after_forward == "default"
    assert options.sequence_parallel is True and options.loss_parallel is False
    assert options.pipeline == Pipeline(
        schedule="1F1B", stages_per_rank=None, first_stage_weight=1.0, last_stage_weight=1.0
    )
    assert options.context_parallel == ContextParallel(load_balance=True)


def test_a_full_section_structures():
    raw = parse_yaml(
        """
activation_checkpointing: {mode: blocks, every: 3}
compile: true
param_dtype: bfloat16
reduce_dtype: float32
reshard_after_forward: never
sequence_parallel: false
loss_parallel: true
pipeline: {schedule: Interleaved1F1B, stages_per_rank: 4, first_stage_weight: 2, last_stage_weight: 0.5}
context_parallel: {load_balance: false}
float8: true
"""
    )
    options = structure(raw, ParallelOptions)
    assert options == ParallelOptions(
        activation_checkpointing=ActivationCheckpointing(mode="blocks", every=3),
        compile=True,
        param_dtype="bfloat16",
        reduce_dtype="float32",
        reshard_after_forward="never",
        sequence_parallel=False,
        loss_parallel=True,
        pipeline=Pipeline(
            schedule="Interleaved1F1B",
            stages_per_rank=4,
            first_stage_weight=2.0,
            last_stage_weight=0.5,
        ),
        context_parallel=ContextParallel(load_balance=False),
        float8=True,
    )
    # an int weight becomes a float; the dump loads back to an equal config
    assert isinstance(options.pipeline.first_stage_weight, float)
    assert structure(parse_yaml(dump_config(options)), ParallelOptions) == options


def test_unknown_keys_name_their_path():
    found = problems({"pipelin": {}, "pipeline": {"microbatches": 4}})
    assert set(found) == {"pipelin", "pipeline.microbatches"}
    assert found["pipelin"].startswith("unknown key (did you mean 'pipeline'?)")
    assert found["pipeline.microbatches"].startswith(
        "unknown key; allowed: schedule, stages_per_rank, first_stage_weight, last_stage_weight"
    )


def test_wrong_types_and_values_all_at_once():
    found = problems(
        {
            "compile": "yes",
            "float8": 1,
            "param_dtype": "fp8",
            "reshard_after_forward": "sometimes",
            "activation_checkpointing": {"mode": "some"},
            "pipeline": {"schedule": "2F2B"},
            "context_parallel": {"load_balance": "true"},
        }
    )
    assert found == {
        "compile": "expected bool (true or false), got str 'yes'",
        "float8": "expected bool (true or false), got int 1",
        "param_dtype": "expected one of 'float32', 'bfloat16', 'float16', got 'fp8'",
        "reshard_after_forward": "expected one of 'default', 'always', 'never', got 'sometimes'",
        "activation_checkpointing.mode": "expected one of 'none', 'full', 'blocks', 'ops', "
        "got 'some'",
        "pipeline.schedule": "expected one of "
        + ", ".join(repr(s) for s in PIPELINE_SCHEDULES)
        + ", got '2F2B'",
        "context_parallel.load_balance": "expected bool (true or false), got str 'true'",
    }


def test_validators_name_their_path():
    found = problems(
        {
            "activation_checkpointing": {"every": 0},
            "pipeline": {"stages_per_rank": 0, "first_stage_weight": -1, "last_stage_weight": -0.5},
        }
    )
    assert found == {
        "activation_checkpointing.every": "must be at least 1, got 0",
        "pipeline.stages_per_rank": "must be at least 1, got 0",
        "pipeline.first_stage_weight": "must be at least 0, got -1.0",
        "pipeline.last_stage_weight": "must be at least 0, got -0.5",
    }
    assert problems({"pipeline": {"stages_per_rank": 1.5}}) == {
        "pipeline.stages_per_rank": "expected int, got float 1.5"
    }
    assert problems({"pipeline": []}) == {"pipeline": "expected a mapping, got list []"}


def test_validators_also_guard_direct_construction():
    with pytest.raises(ValueError, match="must be at least 1, got 0"):
        Pipeline(stages_per_rank=0)
    with pytest.raises(ValueError, match="must be at least 0, got -1"):
        Pipeline(last_stage_weight=-1)
    with pytest.raises(ValueError):
        Pipeline(schedule="2F2B")
    with pytest.raises(ValueError, match="must be at least 1"):
        ActivationCheckpointing(mode="blocks", every=0)


@pytest.mark.parametrize("schedule", PIPELINE_SCHEDULES)
def test_resolved_stages_per_rank(schedule):
    expected = 1 if schedule in SINGLE_STAGE_SCHEDULES else 2
    assert Pipeline(schedule=schedule).resolved_stages_per_rank == expected
    assert Pipeline(schedule=schedule, stages_per_rank=3).resolved_stages_per_rank == 3


def test_schedule_groups_are_schedules():
    assert set(SINGLE_STAGE_SCHEDULES) | set(V_SCHEDULES) < set(PIPELINE_SCHEDULES)
    assert not set(SINGLE_STAGE_SCHEDULES) & set(V_SCHEDULES)
