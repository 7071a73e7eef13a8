"""World from the launcher environment, and mesh specs checked against the world size."""

from __future__ import annotations

import pytest

from llmtrain.core_mesh.mesh import MeshError, MeshSpec
from llmtrain.core_mesh.world import World, WorldError


def test_single_process_without_launcher_variables():
    assert World.from_env({}) == World(0, 0, 1, 1)
    assert not World.from_env({}).distributed


def test_torchrun_variables():
    env = {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}
    world = World.from_env(env)
    assert world == World(rank=5, local_rank=1, world_size=8, local_world_size=4)
    assert world.distributed and not world.is_main


def test_slurm_variables_when_not_under_torchrun():
    env = {
        "SLURM_PROCID": "3",
        "SLURM_LOCALID": "1",
        "SLURM_NTASKS": "4",
        "SLURM_NTASKS_PER_NODE": "2(x2)",
    }
    assert World.from_env(env) == World(3, 1, 4, 2)


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"RANK": "0", "WORLD_SIZE": "2"}, "LOCAL_RANK missing"),
        ({"RANK": "x", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}, "RANK='x' is not an integer"),
        ({"RANK": "2", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}, "rank 2"),
    ],
)
def test_bad_launcher_environment(env, match):
    with pytest.raises(WorldError, match=match):
        World.from_env(env)


def test_dp_shard_inferred():
    spec = MeshSpec(tp=2, dp_replicate=2).resolve(16)
    assert spec.shape == (1, 2, 4, 1, 2)  # pp, dp_replicate, dp_shard, cp, tp
    assert spec.dp == 8 and spec.size == 16


def test_explicit_layout_must_multiply_to_world():
    assert MeshSpec(dp_shard=2, tp=2).resolve(4).size == 4
    with pytest.raises(MeshError) as info:
        MeshSpec(dp_shard=2, tp=2).resolve(8)
    assert "multiplies to 4 processes, but the world has 8" in str(info.value)


def test_inferred_layout_must_divide_world():
    with pytest.raises(MeshError, match=r"needs a multiple of 6 processes .* but the world has 8"):
        MeshSpec(tp=2, pp=3).resolve(8)


@pytest.mark.parametrize("field", ["dp_replicate", "cp", "tp", "pp"])
def test_degrees_must_be_positive(field):
    with pytest.raises(ValueError, match="must be a positive integer"):
        MeshSpec(**{field: 0})
    with pytest.raises(ValueError, match="or -1"):
        MeshSpec(dp_shard=0)
