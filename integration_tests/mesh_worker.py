"""Run under torchrun by test_mesh_gloo.py: build the device mesh and reduce over its groups."""

import json
import sys

import torch
import torch.distributed as dist

from llmtrain.core_mesh.mesh import MeshSpec, build_device_mesh
from llmtrain.core_mesh.world import World, init_distributed, shutdown_distributed

out_dir, tp = sys.argv[1], int(sys.argv[2])
ep = int(sys.argv[3]) if len(sys.argv) > 3 else 1
world = World.from_env()
init_distributed(world, "cpu")
mesh = build_device_mesh(MeshSpec(tp=tp, ep=ep), "cpu")
value = torch.tensor([float(world.rank)])
sums = {}
for name in ("tp", "dp_shard", "dp", "dp_shard_cp", "pp", "ep", "dp_shard_mod_ep"):
    t = value.clone()
    dist.all_reduce(t, group=mesh[name].get_group())
    sums[name] = t.item()
result = {
    "world": [world.rank, world.local_rank, world.world_size],
    "backend": dist.get_backend(),
    "sizes": {
        name: mesh[name].size()
        for name in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "dp", "ep", "dp_shard_mod_ep")
    },
    "sums": sums,
}
with open(f"{out_dir}/rank{world.rank}.json", "w") as f:
    json.dump(result, f)
shutdown_distributed()
