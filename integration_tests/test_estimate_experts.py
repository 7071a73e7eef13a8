"""`llmtrain estimate` with expert parallelism, on llmtrain-moe's olmoe-tiny (its experts conform
to core-mesh's `ExpertParallel`): the numbers worked out by hand from the preset's shape.

olmoe-tiny: d_model 64, 2 layers, 16 experts of SwiGLU hidden 32 (w1, w3: 32 x 64, w2: 64 x 32),
vocab 320 untied. Experts: 2 layers x 16 x 3 x 32 x 64 = 196,608 parameters in 6 tensors.
"""

from __future__ import annotations

import math

import pytest

from llmtrain.core_mesh.config import structure
from llmtrain.core_mesh.plugins import PluginManager
from llmtrain.train_loop.experiments import estimate
from llmtrain.train_loop.run_config import RunConfig

EXPERTS = 2 * 16 * 3 * 32 * 64
EXPERT_TENSORS = 2 * 3


@pytest.fixture(scope="module")
def plugins():
    return PluginManager().load_entry_points()


def olmoe_tiny(plugins, **mesh):
    raw = {
        "name": "e",
        "model": {"kind": "olmoe-tiny", "max_seq_len": 64},
        "data": {"train": [{"path": "unused.zarr"}], "seq_len": 64, "micro_batch": 4},
        "optimizer": {"kind": "adamw", "lr": 1e-3},
        "training": {"steps": 1},
        "mesh": mesh,
    }
    return structure(raw, RunConfig, plugins=plugins)


def test_expert_parallelism_splits_the_experts_and_fsdp_the_rest(plugins):
    one = estimate.estimate(olmoe_tiny(plugins, ep=1), plugins, world=2)
    two = estimate.estimate(olmoe_tiny(plugins, ep=2), plugins, world=2)
    other = one.n_params - EXPERTS  # embeddings, attention, norms, routers
    assert "dp_shard 2 x cp 1 x tp 1 x pp 1, ep 1;" in one.layout
    assert "dp_shard 2 x cp 1 x tp 1 x pp 1, ep 2;" in two.layout
    # before FSDP a rank holds every expert at ep 1, half of them at ep 2
    assert (one.rank_expert_params, two.rank_expert_params) == (EXPERTS, EXPERTS // 2)
    assert (one.rank_params, two.rank_params) == (other + EXPERTS, other + EXPERTS // 2)
    # FSDP: at ep 1 every expert over the 2 dp_shard ranks, at ep 2 each rank's half over
    # dp_shard / ep = 1 rank: the same bytes per rank; the rest over dp_shard 2 either way
    params = (math.ceil(other / 2) + EXPERTS // 2) * 4
    assert one.params == two.params == params
    assert one.grads == two.grads == params
    # AdamW: exp_avg and exp_avg_sq (fp32) and a 4-byte step per tensor, same split
    expert_state = 8 * EXPERTS + 4 * EXPERT_TENSORS
    assert one.optimizer - two.optimizer in (-1, 0, 1)  # two ceilings
    experts_at_two = math.ceil(expert_state * (EXPERTS // 2) / EXPERTS / 1)
    assert two.optimizer - experts_at_two == pytest.approx(8 * other / 2, rel=0.01)
    # what differs: FSDP gathers two blocks at a time (fp32 parameters and reduce), and at
    # ep 2 a block's experts are not gathered at all (this rank holds them whole)
    assert one.transient - two.transient == 2 * (EXPERTS // 2) * (4 + 4)
    assert one.activations == two.activations  # balanced routing: as many rows per rank


def test_with_more_ranks_ep_halves_the_experts_before_fsdp_shards_them(plugins):
    one = estimate.estimate(olmoe_tiny(plugins, ep=1), plugins, world=4)
    two = estimate.estimate(olmoe_tiny(plugins, ep=2), plugins, world=4)
    other = one.n_params - EXPERTS
    assert two.rank_expert_params == EXPERTS // 2
    # ep 2 of dp_shard 4: half of the experts, sharded over 2 ranks: a quarter, as at ep 1
    assert one.params == two.params == (math.ceil(other / 4) + EXPERTS // 4) * 4
    # a gathered block: all its experts / 1 at ep 1, this rank's half at ep 2
    assert one.transient - two.transient == 2 * (EXPERTS // 2 // 2) * (4 + 4)


def test_context_parallel_ranks_hold_the_experts_they_share(plugins):
    """FSDP shards dense weights over dp_shard x cp, but experts only over dp_shard / ep: with
    cp 2 and ep 2 each rank keeps its half of the experts whole."""
    one = estimate.estimate(olmoe_tiny(plugins, cp=2, ep=1), plugins, world=4)
    two = estimate.estimate(olmoe_tiny(plugins, cp=2, ep=2), plugins, world=4)
    other = one.n_params - EXPERTS
    assert one.params == (math.ceil(other / 4) + EXPERTS // 4) * 4
    assert two.params == (math.ceil(other / 4) + EXPERTS // 2) * 4
