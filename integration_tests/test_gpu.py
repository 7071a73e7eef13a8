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


def _gpu_layouts(n_gpus: int) -> list[tuple[int, dict]]:
    bf16 = {"param_dtype": "bfloat16", "reduce_dtype": "float32"}
    layouts = [(1, {"options": {**bf16, "compile": True}})]
    if n_gpus >= 2:
        layouts += [
            (2, {"mesh": {"dp_shard": 2}, "options": {**bf16, "compile": True}}),
            (2, {"mesh": {"tp": 2}}),
            (2, {"mesh": {"pp": 2}, "microbatches": 4}),
            (2, {"mesh": {"cp": 2}}),
        ]
    return layouts


def test_parallel_layouts_nccl_bf16(tmp_path):
    """The key layouts on nccl match the float32 CPU reference (bf16: within 2%)."""
    import parallel_worker

    want = parallel_worker.bare(parallel_worker.model_config())
    for i, (nproc, layout) in enumerate(_gpu_layouts(torch.cuda.device_count())):
        out = tmp_path / f"layout{i}.json"
        torchrun(
            Path(__file__).with_name("parallel_worker.py"),
            out,
            json.dumps({**layout, "device": "cuda"}),
            nproc=nproc,
        )
        got = json.loads(out.read_text())
        bf16 = layout.get("options", {}).get("param_dtype") == "bfloat16"
        rel = 2e-2 if bf16 else 1e-3
        assert got["losses"] == pytest.approx(want["losses"], rel=rel), layout
        assert got["final_loss"] == pytest.approx(want["final_loss"], rel=rel), layout
