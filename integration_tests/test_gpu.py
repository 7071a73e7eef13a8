"""CUDA checks for the `gpu` nox session: nccl process group, device mesh and bf16 on a real GPU."""

from __future__ import annotations

import json
import re
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
    layouts = _gpu_layouts(torch.cuda.device_count())
    for world in sorted({nproc for nproc, _ in layouts}):  # one torchrun per world size
        cases = {
            f"layout{i}": {**layout, "device": "cuda"}
            for i, (nproc, layout) in enumerate(layouts)
            if nproc == world
        }
        out = tmp_path / f"world{world}.json"
        torchrun(
            Path(__file__).with_name("parallel_worker.py"), out, json.dumps(cases), nproc=world
        )
        results = json.loads(out.read_text())
        for name, layout in cases.items():
            got = results[name]
            bf16 = layout.get("options", {}).get("param_dtype") == "bfloat16"
            rel = 2e-2 if bf16 else 1e-3
            assert got["losses"] == pytest.approx(want["losses"], rel=rel), layout
            assert got["final_loss"] == pytest.approx(want["final_loss"], rel=rel), layout


# --- observability on CUDA: the out-of-memory snapshot, CUDA memory metrics, profiles ---
def _gpu_run_config(tmp_path: Path, **extra) -> Path:
    import train_support as ts

    data = ts.pack_corpus(tmp_path / "data")
    config = ts.run_config(data, tmp_path / "runs", name="gpu")
    config.update(device="cuda", **extra)
    config["training"] = {"steps": 6, "log_every": 1}
    config["data"].pop("eval")
    return ts.write_config(tmp_path / "run.yaml", config)


def test_cuda_oom_writes_a_memory_snapshot(tmp_path):
    import train_support as ts

    free, _ = torch.cuda.mem_get_info()
    # a micro-batch whose logits alone do not fit: vocab x seq x batch x 4 bytes > free memory
    batch = int(free / (320 * 32 * 4)) + 1024
    path = _gpu_run_config(tmp_path, debug={"memory_history": True})
    proc = ts.run(
        ts.llmtrain("run", path, f"data.micro_batch={batch}", f"data.global_batch={batch}"),
        timeout=300,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    snapshots = list((tmp_path / "runs" / "gpu" / "memory").glob("oom-step1-rank0.pickle"))
    assert snapshots and snapshots[0].stat().st_size > 0
    assert "out of memory in step 1" in proc.stderr and str(snapshots[0]) in proc.stderr
    summary = json.loads((tmp_path / "runs" / "gpu" / "summary.json").read_text())
    assert summary["status"] == "failed"


def test_cuda_memory_metrics_and_profile(tmp_path):
    import train_support as ts

    path = _gpu_run_config(tmp_path, profile={"every": 3, "active": 1, "warmup": 1})
    ts.run(ts.llmtrain("run", path), timeout=300)
    metrics = ts.read_metrics(tmp_path / "runs" / "gpu")
    last = metrics[-1]
    assert last["reserved_memory_mib"] >= last["peak_memory_mib"] >= last["active_memory_mib"] > 0
    trace = json.loads(
        (tmp_path / "runs" / "gpu" / "profiles" / "step-4" / "rank0.json").read_text()
    )
    assert any(e.get("cat") == "kernel" for e in trace["traceEvents"])
    assert any(e.get("cat") == "ac2g" for e in trace["traceEvents"])
    out = ts.run(ts.llmtrain("profile", tmp_path / "runs" / "gpu", "--top", "5"), timeout=60)
    lines = out.stdout.splitlines()
    # the operators by the GPU time they launched, then the kernels (ablate's test_profile_cuda)
    assert "operators by GPU time launched (CUDA trace: " in lines[0], out.stdout
    op_rows = [m for line in lines if (m := re.match(r"^(.+?)\s+cpu\s+\d+\s+([\d.]+)\s", line))]
    assert op_rows and float(op_rows[0][2]) > 0, out.stdout  # the top operator launched kernels
    title = next(i for i, line in enumerate(lines) if "GPU kernels, copies and sets" in line)
    kernels = lines[title + 2 :]
    assert 0 < len(kernels) <= 5 and all(" gpu " in row for row in kernels), out.stdout
    assert any(not row.rstrip().endswith(" -") for row in kernels), out.stdout  # launched by ops


def test_chunked_loss_on_cuda_equals_the_plain_form_in_less_memory():
    """The trainer's loss from the hidden states, its per-chunk softmax compiled, under bf16
    autocast on a 128k vocabulary: the plain form's loss and gradients, and the peak memory above
    the inputs a fraction of the plain form's (which holds the batch's logits several times)."""
    import torch.nn.functional as F

    from llmtrain.train_loop.loss import IGNORE, cross_entropy_sum

    g = torch.Generator(device="cuda").manual_seed(0)
    n_tokens, dim, vocab = 4096, 1024, 128_256
    hidden = torch.randn(1, n_tokens, dim, device="cuda", generator=g)
    weight = torch.randn(vocab, dim, device="cuda", generator=g) * dim**-0.5
    targets = torch.randint(0, vocab, (1, n_tokens), device="cuda", generator=g)
    targets[0, :100] = IGNORE
    loss = cross_entropy_sum(1e-4, compile_chunks=True)

    def run(chunked: bool):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            value = loss.from_hidden(h, w, targets) if chunked else loss(F.linear(h, w), targets)
        value.backward()
        torch.cuda.synchronize()
        return value.detach(), h.grad, w.grad, torch.cuda.max_memory_allocated() - base

    run(chunked=True)  # compiles
    got, expected = run(chunked=True), run(chunked=False)
    torch.testing.assert_close(got[0], expected[0], rtol=1e-4, atol=0)
    for g_, e_ in zip(got[1:3], expected[1:3], strict=True):
        assert ((g_ - e_).norm() / e_.norm()).item() < 1e-2
    assert got[3] < 0.5 * expected[3], (got[3], expected[3])
