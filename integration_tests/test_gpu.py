"""CUDA checks for the `gpu` nox session: nccl process group, device mesh and bf16 on a real GPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support import torchrun

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

WORKER = Path(__file__).with_name("gpu_worker.py")


def test_nccl_mesh_and_bf16(tmp_path):
    nproc = torch.cuda.device_count()
    torchrun(WORKER, tmp_path, nproc=nproc)
    for rank in range(nproc):
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert res["backend"] == "nccl"
        assert res["sum"] == sum(range(nproc))
        assert res["bf16_dtype"] == "torch.bfloat16"
        assert res["bf16_max_rel_err"] < 2e-2
