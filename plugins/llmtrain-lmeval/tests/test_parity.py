"""Item for item, the same scores three ways on one trained checkpoint and one ARC-layout file:
llmtrain's own `evaluate_task` (the built-in `arc_easy`), lm-evaluation-harness through this
plugin (`--model llmtrain`), and lm-evaluation-harness's transformers backend (`--model hf`) on
the checkpoint exported with llmtrain-hf."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from support import run

# float32 log-likelihoods (about -80) of the same weights by two implementations that batch and
# pad differently: other matmul shapes round otherwise, and other CPUs run other kernels. A
# relative bound (about 80 float32 ulps of the sum) holds whatever the magnitude; the absolute
# floor covers sums near zero.
REL, FLOOR = 1e-5, 1e-6


def harness(model: str, model_args: dict, arc, task_manager) -> dict:
    """lm-eval's results for the local task, with every sample (`log_samples`)."""
    import llmtrain_lmeval  # noqa: F401 - registers `llmtrain` for the Python API
    import lm_eval

    return lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[arc.name],
        task_manager=task_manager,
        batch_size=8,
        device="cpu",
        log_samples=True,
    )


def samples(results: dict, task: str) -> list[dict]:
    """Per item, in file order: the options' log-likelihoods, greedy flags, acc and acc_norm."""
    out = []
    for sample in sorted(results["samples"][task], key=lambda s: s["doc_id"]):
        responses = [r[0] for r in sample["resps"]]  # one (ll, is_greedy) per option
        out.append(
            {
                "loglikelihoods": [float(ll) for ll, _ in responses],
                "acc": float(sample["acc"]),
                "acc_norm": float(sample["acc_norm"]),
            }
        )
    return out


def assert_same(ours, theirs: list[dict], metrics: dict, *, exact: bool) -> None:
    """Every item's acc, acc_norm and log-likelihoods, and the task's metrics. `exact`: the
    same bits (the same code on the same batches); else within REL of the magnitude."""
    assert len(theirs) == len(ours.items)
    for i, (mine, other) in enumerate(zip(ours.items, theirs, strict=True)):
        assert (mine["acc"], mine["acc_norm"]) == (other["acc"], other["acc_norm"]), i
        if exact:
            assert other["loglikelihoods"] == mine["loglikelihoods"], i
        else:
            close = pytest.approx(mine["loglikelihoods"], rel=REL, abs=FLOOR)
            assert other["loglikelihoods"] == close, i
    assert metrics["acc,none"] == pytest.approx(ours.metrics["acc"], abs=1e-12)
    assert metrics["acc_norm,none"] == pytest.approx(ours.metrics["acc_norm"], abs=1e-12)


def test_harness_through_the_adapter_scores_as_llmtrain(ours, trained, arc, task_manager):
    """lm-eval's Python API: `import llmtrain_lmeval` makes `model="llmtrain"` known. The
    adapter scores a document's options as `evaluate_task` scores an item's, in batches of the
    same size: the same rows through the same code, so the same bits."""
    results = harness("llmtrain", {"checkpoint": trained.checkpoint}, arc, task_manager)
    theirs = samples(results, arc.name)
    assert_same(ours, theirs, results["results"][arc.name], exact=True)


def test_harness_hf_backend_on_the_export_scores_as_llmtrain(ours, trained, arc, task_manager):
    model_args = {"pretrained": trained.export, "dtype": "float32"}
    results = harness("hf", model_args, arc, task_manager)
    theirs = samples(results, arc.name)
    assert_same(ours, theirs, results["results"][arc.name], exact=False)
    # the items are not all alike: a parity check on a constant answer would prove little
    assert len({tuple(s["loglikelihoods"]) for s in theirs}) == len(theirs)


def test_lm_eval_command_runs_the_llmtrain_model(ours, trained, arc, tmp_path):
    """`lm_eval --model llmtrain` from the shell: the installed startup hook registers the model
    in a fresh interpreter (nothing imports llmtrain_lmeval), and the per-sample log it writes
    holds llmtrain's scores, bit for bit: the same batch size, and one torch thread as here."""
    lm_eval = Path(sys.executable).parent / "lm_eval"
    out = tmp_path / "out"
    run(
        [
            str(lm_eval),
            "--model", "llmtrain",
            "--model_args", f"checkpoint={trained.checkpoint},batch_size=8",
            "--include_path", arc.tasks,
            "--tasks", arc.name,
            "--device", "cpu",
            "--log_samples",
            "--output_path", str(out),
        ],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=600,
    )  # fmt: skip
    (samples_file,) = out.rglob(f"samples_{arc.name}_*.jsonl")
    (results_file,) = out.rglob("results_*.json")
    logged = [json.loads(line) for line in samples_file.read_text().splitlines()]
    results = json.loads(results_file.read_text())
    theirs = samples({"samples": {arc.name: logged}}, arc.name)
    assert_same(ours, theirs, results["results"][arc.name], exact=True)
    assert results["config"]["model"] == "llmtrain"
