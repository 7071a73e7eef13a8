"""Run under torchrun by test_gpu.py: nccl all-reduce over the mesh and a bf16 matmul."""

import json
import sys

import torch
import torch.distributed as dist

from llmtrain.core_mesh.mesh import MeshSpec, build_device_mesh
from llmtrain.core_mesh.world import World, init_distributed, shutdown_distributed

world = World.from_env()
device = init_distributed(world, "cuda")
mesh = build_device_mesh(MeshSpec(), "cuda")
t = torch.tensor([float(world.rank)], device=device)
dist.all_reduce(t, group=mesh["dp"].get_group())
a = torch.randn(512, 512, device=device)
b = torch.randn(512, 512, device=device)
exact = a @ b
approx = (a.bfloat16() @ b.bfloat16()).float()
result = {
    "backend": dist.get_backend() if dist.is_initialized() else "nccl",
    "sum": t.item(),
    "bf16_dtype": str(a.bfloat16().dtype),
    "bf16_max_rel_err": ((approx - exact).norm() / exact.norm()).item(),
}
with open(f"{sys.argv[1]}/rank{world.rank}.json", "w") as f:
    json.dump(result, f)
shutdown_distributed()
