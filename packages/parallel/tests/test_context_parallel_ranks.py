"""Context parallelism over two gloo processes trains conftest's toy decoder as one process does,
with document masking and sliding windows too: the model builds each block's mask over its
queries and every key of the sequence (from the `positions`, `sequence_length` and whole
`doc_starts` it is given), and attention answers it with the gathered keys in position order.

One torchrun of 2 processes runs every case (`cp_worker.py`); the losses and gradient norms of
3 AdamW steps, and the loss after them, must equal the plain loop's within rtol 1e-4, the
tolerance of the layout tests in integration_tests/test_parallel_layouts.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("cp_worker.py")
RTOL, ATOL = 1e-4, 1e-6

CASES = {
    "plain": {},
    # causal attention recomputed in backward by activation checkpointing
    "causal_recomputed": {"options": {"activation_checkpointing": {"mode": "full"}}},
    "documents": {"model": {"doc_masking": True}},
    # local and global blocks over packed documents; recomputed in backward (the gathered
    # attention must answer there too) and split into micro-batches (`sequence_length` goes to
    # each as it is)
    "documents_windows": {
        "model": {"doc_masking": True, "window": 3},
        "options": {"activation_checkpointing": {"mode": "full"}},
        "microbatches": 2,
    },
    # without load balancing the gathered keys are already in position order; selective
    # checkpointing keeps attention's output and recomputes the rest, the gathers included
    "windows_in_order": {
        "model": {"window": 3},
        "options": {
            "context_parallel": {"load_balance": False},
            "activation_checkpointing": {"mode": "ops"},
        },
    },
}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("cp") / "results.json"
    # the worker imports conftest (this directory, its own) and what conftest imports
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        str(WORKER), str(out), json.dumps(CASES),
    ]  # fmt: skip
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    got = json.loads(out.read_text()) if out.exists() else {}
    got["_run"] = f"torchrun exited {proc.returncode}\n{proc.stderr[-6000:]}"
    return got


@pytest.mark.parametrize("name", list(CASES))
def test_context_parallel_trains_like_one_process(results, name):
    if name not in results:
        pytest.fail(f"{name} did not run: {results['_run']}")
    assert "error" not in results[name], results[name]["error"]
    got, want = results[name]["parallel"], results[name]["plain"]
    assert got["spec"].startswith("MeshSpec(") and "cp=2" in got["spec"]
    for key in ("losses", "grad_norms", "final_loss"):
        assert got[key] == pytest.approx(want[key], rel=RTOL, abs=ATOL), key
    assert got["final_loss"] < got["losses"][0]
    if "model" in CASES[name]:
        # guard: the masks changed what the model computes, so equal is not trivially equal
        plain = results["plain"]["plain"]
        assert abs(want["losses"][0] - plain["losses"][0]) > 1e-3
