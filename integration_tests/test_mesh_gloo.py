"""The device mesh on 4 real processes (torchrun, gloo): sizes and groups of every named dimension."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from support import torchrun

WORKER = Path(__file__).with_name("mesh_worker.py")


def test_four_ranks_dp2_tp2(tmp_path):
    torchrun(WORKER, tmp_path, 2, nproc=4)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    for rank, res in enumerate(results):
        assert res["world"] == [rank, rank, 4]
        assert res["backend"] == "gloo"
        assert res["sizes"] == {
            "pp": 1,
            "dp_replicate": 1,
            "dp_shard": 2,
            "cp": 1,
            "tp": 2,
            "dp": 2,
            "ep": 1,
            "dp_shard_mod_ep": 2,
        }
        # tp is innermost: ranks {0,1} and {2,3}; dp pairs {0,2} and {1,3}
        tp_peer, dp_peer = rank ^ 1, rank ^ 2
        assert res["sums"]["tp"] == rank + tp_peer
        assert res["sums"]["dp_shard"] == rank + dp_peer
        assert res["sums"]["dp"] == rank + dp_peer
        assert res["sums"]["dp_shard_cp"] == rank + dp_peer
        assert res["sums"]["pp"] == rank
        assert res["sums"]["ep"] == rank


def test_four_ranks_of_dp_shard_two_of_them_splitting_the_experts(tmp_path):
    """ep=2 of dp_shard=4: ep is the inner part of dp_shard, so the ranks that split one layer's
    experts are neighbours ({0,1}, {2,3}) and the ranks holding the same experts are {0,2},
    {1,3}; dp_shard itself is still all four."""
    torchrun(WORKER, tmp_path, 1, 2, nproc=4)
    for rank in range(4):
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert res["sizes"]["dp_shard"] == 4 and res["sizes"]["dp"] == 4
        assert res["sizes"]["ep"] == 2 and res["sizes"]["dp_shard_mod_ep"] == 2
        assert res["sums"]["ep"] == rank + (rank ^ 1)
        assert res["sums"]["dp_shard_mod_ep"] == rank + (rank ^ 2)
        assert res["sums"]["dp_shard"] == res["sums"]["dp"] == 0 + 1 + 2 + 3


def test_single_process_without_launcher(tmp_path):
    from support import run

    probe = (
        "from llmtrain.core_mesh.mesh import MeshSpec, build_device_mesh\n"
        "from llmtrain.core_mesh.world import World, init_distributed, shutdown_distributed\n"
        "init_distributed(World.from_env({}), 'cpu')\n"
        "mesh = build_device_mesh(MeshSpec(), 'cpu')\n"
        "print(mesh.shape, mesh['dp'].size())\n"
        "shutdown_distributed()\n"
    )
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    assert (
        run([sys.executable, "-c", probe], env=env).stdout.split("\n")[0] == "(1, 1, 1, 1, 1, 1) 1"
    )
