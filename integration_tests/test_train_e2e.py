"""`llmtrain run` end to end on CPU: one process writes what it promises (metrics, config,
checkpoints) and learns; `llmtrain eval` and `generate` read its checkpoints; 2 gloo ranks under
torchrun (FSDP, TP, PP) log the same numbers as one process (`llmtrain quickstart` and its next
steps: test_newcomer_path.py). Each run is a real `python -m llmtrain` subprocess."""

from __future__ import annotations

import importlib.metadata
import json
import math
import shutil

import pytest
import train_support as ts
import yaml
from shared_fixtures import run_cli  # noqa: F401

from llmtrain.train_loop.schedules import WarmupOptions, cosine

RTOL = 1e-4  # float32 sums taken in another order: differences seen are ~1e-7


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return ts.pack_corpus(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory):
    """One process, 30 steps, as written in the shared config."""
    tmp = tmp_path_factory.mktemp("reference")
    config = ts.run_config(data, tmp / "runs", name="ref")
    return ts.one_process_run(tmp, config)


def test_one_process_run_end_to_end(reference):
    proc, run_dir, metrics = reference["proc"], reference["dir"], reference["metrics"]
    assert "Traceback" not in proc.stderr
    assert f"ref: 30 steps; run directory {run_dir}" in proc.stderr

    assert list(metrics) == list(range(1, 31))
    first, last = metrics[1], metrics[30]
    assert first["loss"] == pytest.approx(math.log(320), rel=0.05)  # starts near uniform
    early = sum(metrics[s]["loss"] for s in range(1, 6)) / 5
    late = sum(metrics[s]["loss"] for s in range(26, 31)) / 5
    assert late < early - 1.0, (early, late)  # bytes of a small grammar: learns fast

    schedule = cosine(WarmupOptions(warmup_steps=3, min_ratio=0.1), 30)
    for step, m in metrics.items():
        assert m["lr"] == pytest.approx(3e-3 * schedule(step - 1), rel=1e-12), step
        assert m["tokens"] == step * 8 * 32
        assert math.isfinite(m["grad_norm"]) and m["grad_norm"] > 0
        assert m["tokens_per_s"] > 0 and 0 <= m["data_wait"] <= 1
        assert m["peak_memory_mib"] > 0 and m["step_time_s"] > 0
        assert ("eval_loss" in m) == (step % 10 == 0), step
    for step in (10, 20, 30):
        assert metrics[step]["eval_ppl"] == pytest.approx(math.exp(metrics[step]["eval_loss"]))
    assert metrics[30]["eval_loss"] < metrics[10]["eval_loss"] < first["loss"]
    assert last["lr"] == pytest.approx(3e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 26 / 27))))

    checkpoints = run_dir / "checkpoints"
    assert ts.committed_steps(checkpoints) == [5, 10, 15, 20, 25, 30]
    info = json.loads((checkpoints / "step-30" / "llmtrain.json").read_text())
    assert info["step"] == 30 and info["info"]["data"]["global_batch"] == 8
    assert info["info"]["model"]["kind"] == "tiny" and info["info"]["model"]["d_model"] == 32

    events = [json.loads(line)["event"] for line in (run_dir / "logs" / "rank0.jsonl").open()]
    assert "run.start" in events and "checkpoint.committed" in events


def test_written_config_is_the_resolved_run(reference, run_cli):  # noqa: F811
    written = reference["dir"] / "config.yaml"
    code, out, err = run_cli("config", "validate", written)
    assert (code, out) == (0, f"{written}: ok\n"), err
    resolved = yaml.safe_load(written.read_text())
    given = reference["config"]
    assert resolved["model"]["d_model"] == 32 and resolved["model"]["n_layers"] == 2  # preset
    assert resolved["data"]["global_batch"] == 8 and resolved["data"]["shuffle"] is True
    assert resolved["training"] == {**resolved["training"], **given["training"]}
    assert resolved["checkpoint"]["keep_last"] == 10 and resolved["checkpoint"]["resume"] == "auto"


def test_written_config_records_versions(reference):
    """DESIGN: the resolved config in the run directory carries the package versions (and the
    git sha if any), so a run can be traced to the code that made it."""
    text = (reference["dir"] / "config.yaml").read_text()
    version = importlib.metadata.version("llmtrain-train-loop")
    assert "llmtrain-train-loop" in text and version in text


def test_eval_and_generate_read_the_checkpoint(reference, data, run_cli):  # noqa: F811
    checkpoints, metrics = reference["dir"] / "checkpoints", reference["metrics"]
    # the same 2 global batches of the eval set the run evaluated at steps 30 and 20
    code, out, err = run_cli(
        "eval", checkpoints, "--data", data.valid, "--batches", 2, "--batch-size", 8
    )
    assert code == 0, err
    result = json.loads(out)
    assert (result["step"], result["tokens"]) == (30, 2 * 8 * 32)
    assert result["loss"] == pytest.approx(metrics[30]["eval_loss"], rel=1e-5)
    assert result["perplexity"] == pytest.approx(math.exp(result["loss"]))
    code, out, err = run_cli(
        "eval", checkpoints, "--step", 20, "--data", data.valid, "--batches", 4,
        "--batch-size", 4,
    )  # fmt: skip
    assert code == 0, err
    assert json.loads(out)["loss"] == pytest.approx(metrics[20]["eval_loss"], rel=1e-5)

    argv = ["generate", checkpoints, "--prompt", "The cat", "--max-new-tokens", 20]
    code, out, err = run_cli(*argv)
    assert code == 0, err
    assert out.startswith("The cat") and len(out.rstrip("\n")) > len("The cat")
    assert run_cli(*argv)[1] == out  # the same seed samples the same text
    code, greedy, err = run_cli(*argv, "--top-k", 1, "--seed", 5)
    assert code == 0 and greedy == run_cli(*argv, "--top-k", 1, "--seed", 6)[1]


@pytest.mark.parametrize(
    ("layout", "overrides"),
    [
        ("fsdp", []),  # the default mesh: dp_shard -1, 4 sequences per rank, no accumulation
        ("tp", ["mesh.tp=2"]),
        # norms stay whole beside DTensors: the optimizer must not use multi-tensor kernels
        ("tp-no-sp", ["mesh.tp=2", "parallel.kind=default", "parallel.sequence_parallel=false"]),
        ("pp", ["mesh.pp=2"]),  # 2 micro-batches through a 1F1B pipeline
    ],
)
def test_two_ranks_log_the_same_numbers_as_one_process(reference, layout, overrides):
    name = f"two-{layout}"
    proc = ts.run(
        ts.torchrun(
            2, "run", reference["path"], f"name={name}", "training.checkpoint_every=null",
            *overrides,
        ),
        timeout=600,
    )  # fmt: skip
    run_dir = reference["tmp"] / "runs" / name
    start = json.loads((run_dir / "logs" / "rank0.jsonl").read_text().splitlines()[0])
    assert start["event"] == "run.start" and start["world"] == 2
    assert (run_dir / "logs" / "rank1.jsonl").exists()
    assert ts.error_lines(proc.stderr) == []
    got = ts.by_step(ts.read_metrics(run_dir))
    assert list(got) == list(range(1, 31))
    ts.assert_close_runs(
        reference["metrics"], got, RTOL, ["loss", "grad_norm", "lr", "eval_loss", "tokens"]
    )
    assert ts.committed_steps(run_dir / "checkpoints") == [30]


def test_two_ranks_resume_a_one_process_checkpoint_and_keep_saving(reference):
    """A run started in one process continues under FSDP on 2 ranks from its step-10 checkpoint
    (DCP reshards) with the same numbers, saving every 5 steps as configured."""
    run_dir = reference["tmp"] / "runs" / "moved"
    (run_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(
        reference["dir"] / "checkpoints" / "step-10", run_dir / "checkpoints" / "step-10"
    )
    ts.run(ts.torchrun(2, "run", reference["path"], "name=moved"), timeout=600)
    got = ts.by_step(ts.read_metrics(run_dir))
    assert list(got) == list(range(11, 31))
    ts.assert_close_runs(reference["metrics"], got, RTOL, ["loss", "grad_norm", "lr", "eval_loss"])
    assert ts.committed_steps(run_dir / "checkpoints") == [10, 15, 20, 25, 30]


def test_every_eval_is_logged(reference, run_cli):  # noqa: F811
    """An eval step that is not a logging step still reaches metrics.jsonl: its result is not
    computed only to be dropped."""
    code, _, err = run_cli(
        "run", reference["path"], "name=evals", "training.log_every=4", "data.eval.every=6",
        "training.checkpoint_every=null",
    )  # fmt: skip
    assert code == 0, err
    metrics = ts.by_step(ts.read_metrics(reference["tmp"] / "runs" / "evals"))
    assert {4, 8, 12, 16, 20, 24, 28, 30} <= set(metrics)
    # the reference run, logged and evaluated at other steps: the same numbers
    ts.assert_close_runs(reference["metrics"], metrics, RTOL, ["loss", "lr", "grad_norm"])
    assert metrics[30]["eval_loss"] == pytest.approx(reference["metrics"][30]["eval_loss"], 1e-4)
    assert [s for s, m in metrics.items() if "eval_loss" in m] == [6, 12, 18, 24, 30]
