"""`llmtrain eval`: one JSON object with or without `--json`, over the whole held-out set by
default; `--batches B --batch-size G` reads the windows a run's in-loop eval reads
(`data.eval.batches` global batches of G rows) and gives the run's logged eval_loss."""

from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, dataset):
    import yaml

    from llmtrain.core_mesh.cli import main

    tmp = tmp_path_factory.mktemp("eval-cmd")
    config = {
        "name": "r",
        "run_dir": str(tmp / "runs"),
        "device": "cpu",
        "model": {"kind": "tiny", "max_seq_len": 32, "d_model": 16, "n_layers": 1},
        # global batch 8: 2 micro-batches of 4
        "data": {
            "train": [{"path": str(dataset)}],
            "seq_len": 32,
            "micro_batch": 4,
            "grad_accum": 2,
            "eval": {"path": str(dataset), "every": 2, "batches": 2},
        },
        "optimizer": {"kind": "adamw", "lr": 1e-3},
        "loggers": [{"kind": "jsonl"}],
        "training": {"steps": 4, "log_every": 1},
    }
    path = tmp / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["run", str(path)]) == 0
    return tmp / "runs" / "r"


def logged_eval_loss(run_dir, step):
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["step"] == step and "eval_loss" in record:
            return record["eval_loss"]
    raise AssertionError(f"no eval_loss at step {step}")


def test_eval_prints_json_with_or_without_the_flag(run_dir, run_cli, dataset):
    checkpoints = run_dir / "checkpoints"
    code, plain, err = run_cli("eval", checkpoints, "--data", dataset)
    assert code == 0, err
    code, flagged, err = run_cli("eval", checkpoints, "--data", dataset, "--json")
    assert code == 0, err
    assert flagged == plain  # scripts that parse today's line keep working
    result = json.loads(flagged)
    assert result["step"] == 4 and {"loss", "perplexity", "tokens"} <= result.keys()


def test_batches_and_the_global_batch_give_the_runs_eval_loss(run_dir, run_cli, dataset):
    checkpoints = run_dir / "checkpoints"
    logged = logged_eval_loss(run_dir, 4)
    code, out, err = run_cli(
        "eval", checkpoints, "--data", dataset, "--batches", 2, "--batch-size", 8, "--json"
    )
    assert code == 0, err
    same = json.loads(out)
    assert same["tokens"] == 2 * 8 * 32  # the same 16 windows of seq_len targets
    assert same["loss"] == pytest.approx(logged, rel=1e-5)
    # the whole held-out set is another number
    code, out, err = run_cli("eval", checkpoints, "--data", dataset)
    whole = json.loads(out)
    assert whole["tokens"] > same["tokens"] and whole["loss"] != pytest.approx(logged, rel=1e-5)


@pytest.mark.parametrize("flag", ["--batches", "--batch-size"])
def test_a_batch_count_below_one_is_one_line(run_dir, run_cli, dataset, flag):
    code, out, err = run_cli("eval", run_dir / "checkpoints", "--data", dataset, flag, 0)
    assert code == 2 and out == ""
    assert err == f"error: {flag} 0: must be at least 1; see llmtrain eval --help\n"
