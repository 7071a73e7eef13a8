"""Every parallel layout trains like one process: for the tiny model (4 blocks) and a fixed batch,
the loss and gradient norm of 3 AdamW steps (with clipping), and the loss after them, equal a
plain single-process PyTorch loop within rtol 1e-4 (float32 on CPU; the differences seen are
about 1e-6, the order in which sums are taken).

The cases run in real torchruns of gloo processes running `parallel_worker.py`: one torchrun of
2 processes for the 2-rank cases, one of 4 for the 4-rank ones, each case in turn on its own
device mesh (a process start costs more than a case's 3 steps). A case that fails shows its own
traceback; the cases after it in the same torchrun fail saying they did not run.
"""

from __future__ import annotations

import json
from pathlib import Path

import parallel_worker
import pytest
from support import torchrun

WORKER = Path(__file__).with_name("parallel_worker.py")
RTOL, ATOL = 1e-4, 1e-6

GPT2_LIKE = {"positions": "learned", "norm": "layernorm", "mlp": "gelu", "bias": True}
# local and global blocks (a window of 8 keys in blocks 0 and 2) over packed documents
WINDOWED = {"attention": {"window": 8, "pattern": ["local", "global"]}, "doc_masking": True}
# Gemma 2's block: sandwich norms, GeGLU, scaled embeddings, soft-capped scores and logits
GEMMA_LIKE = {
    **WINDOWED,
    "norm_placement": "sandwich",
    "mlp": "geglu",
    "scale_embeddings": True,
    "attention": {**WINDOWED["attention"], "softcap": 50.0},
    "logit_softcap": 30.0,
}
CASES = {
    # name: (processes, layout)
    "ddp2": (2, {"mesh": {"dp_replicate": 2, "dp_shard": 1}, "microbatches": 2}),
    "fsdp2": (2, {"mesh": {"dp_shard": 2}, "microbatches": 2}),
    "hsdp2x2": (4, {"mesh": {"dp_replicate": 2, "dp_shard": 2}}),
    "tp2": (2, {"mesh": {"tp": 2}}),
    "tp2_tied": (2, {"mesh": {"tp": 2}, "model": {"tied_embeddings": True}}),
    "tp2_loss_parallel_gpt2": (
        2,
        {"mesh": {"tp": 2}, "model": GPT2_LIKE, "options": {"loss_parallel": True}},
    ),
    "tp2_no_sp": (2, {"mesh": {"tp": 2}, "options": {"sequence_parallel": False}}),
    "fsdp2xtp2": (4, {"mesh": {"dp_shard": 2, "tp": 2}}),
    # document masking with the heads split over ranks, and with stages handed document starts
    "tp2_doc_masking": (2, {"mesh": {"tp": 2}, "model": {"doc_masking": True}}),
    "pp2_doc_masking": (2, {"mesh": {"pp": 2}, "microbatches": 4, "model": {"doc_masking": True}}),
    "pp2_gpipe": (2, {"mesh": {"pp": 2}, "microbatches": 4, "options": {"pipeline": {"schedule": "GPipe"}}}),
    "pp2_1f1b": (2, {"mesh": {"pp": 2}, "microbatches": 4}),
    "pp2_interleaved1f1b": (
        2,
        {"mesh": {"pp": 2}, "microbatches": 4, "options": {"pipeline": {"schedule": "Interleaved1F1B"}}},
    ),
    "pp2_zbv": (
        2,
        {"mesh": {"pp": 2}, "microbatches": 4, "options": {"pipeline": {"schedule": "ZBVZeroBubble"}}},
    ),
    "pp2xfsdp2": (4, {"mesh": {"pp": 2, "dp_shard": 2}, "microbatches": 2}),
    "pp2xtp2": (4, {"mesh": {"pp": 2, "tp": 2}, "microbatches": 2}),
    "cp2": (2, {"mesh": {"cp": 2}}),
    # the model's masks over every key of the sequence, answered with the gathered keys
    "cp2_doc_masking": (2, {"mesh": {"cp": 2}, "model": {"doc_masking": True}}),
    "cp2_windows": (2, {"mesh": {"cp": 2}, "model": WINDOWED}),
    "tp2_windows": (2, {"mesh": {"tp": 2}, "model": WINDOWED}),
    "pp2_windows": (2, {"mesh": {"pp": 2}, "microbatches": 4, "model": WINDOWED}),
    "tp2_gemma": (2, {"mesh": {"tp": 2}, "model": GEMMA_LIKE}),
    "pp2_gemma": (2, {"mesh": {"pp": 2}, "microbatches": 4, "model": GEMMA_LIKE}),
    "cp2xfsdp2": (4, {"mesh": {"cp": 2, "dp_shard": 2}}),
    "fsdp2_ac_full": (2, {"mesh": {"dp_shard": 2}, "options": {"activation_checkpointing": {"mode": "full"}}}),
    "fsdp2_ac_every2": (
        2,
        {"mesh": {"dp_shard": 2}, "options": {"activation_checkpointing": {"mode": "blocks", "every": 2}}},
    ),
    "fsdp2_ac_ops": (2, {"mesh": {"dp_shard": 2}, "options": {"activation_checkpointing": {"mode": "ops"}}}),
    "fsdp2_compile_ac": (
        2,
        {
            "mesh": {"dp_shard": 2},
            "options": {"compile": True, "activation_checkpointing": {"mode": "blocks"}},
        },
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def references():
    """The plain PyTorch run per model variant, computed once."""
    cache: dict[str, dict] = {}

    def get(model_overrides: dict) -> dict:
        key = json.dumps(model_overrides, sort_keys=True)
        if key not in cache:
            cache[key] = parallel_worker.bare(parallel_worker.model_config(**model_overrides))
        return cache[key]

    return get


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """runs(nproc) -> ({name: result} of that world size's cases, the torchrun's process): one
    torchrun per world size, started when a test first asks for it."""
    done: dict[int, tuple[dict, object]] = {}

    def get(nproc: int) -> tuple[dict, object]:
        if nproc not in done:
            out = tmp_path_factory.mktemp(f"world{nproc}") / "results.json"
            cases = {name: layout for name, (n, layout) in CASES.items() if n == nproc}
            proc = torchrun(WORKER, out, json.dumps(cases), nproc=nproc, timeout=900, check=False)
            done[nproc] = (json.loads(out.read_text()) if out.exists() else {}, proc)
        return done[nproc]

    return get


def case_result(runs, name: str) -> dict:
    """The case's result from its world size's torchrun; its traceback, or the run's output
    where it did not run, as the failure."""
    nproc, _ = CASES[name]
    results, proc = runs(nproc)
    if name not in results:
        pytest.fail(
            f"{name} did not run: the {nproc}-rank torchrun exited {proc.returncode}\n"
            f"{proc.stderr[-6000:]}"
        )
    assert "error" not in results[name], results[name]["error"]
    return results[name]


@pytest.mark.parametrize("name", list(CASES))
def test_layout_matches_one_process(name, runs, references):
    _, layout = CASES[name]
    got = case_result(runs, name)
    want = references(layout.get("model", {}))
    assert got["losses"] == pytest.approx(want["losses"], rel=RTOL, abs=ATOL)
    assert got["grad_norms"] == pytest.approx(want["grad_norms"], rel=RTOL, abs=ATOL)
    assert got["final_loss"] == pytest.approx(want["final_loss"], rel=RTOL, abs=ATOL)
    # the run really learned something, so equal numbers are not equal constants
    assert got["final_loss"] < got["losses"][0] - 0.3
    # the chunked loss from the hidden states wherever the model's output is whole on a rank
    mesh = layout["mesh"]
    assert got["loss_from_hidden"] == (mesh.get("tp", 1) == 1 and mesh.get("pp", 1) == 1)
