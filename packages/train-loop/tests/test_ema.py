"""The `ema` callback in real `llmtrain run`s of a tiny model, in this process: its average
equals a hand computation from the weights the run saved at every step, a resumed run's average
equals an uninterrupted run's, the average is evaluated beside the weights without changing
the training, and `--weights ema` loads it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from llmtrain.checkpoint.export import load_model_weights

EMA = {"kind": "ema", "decay": 0.8, "start": 2, "every": 2}


def config(tiny_run_config: Any, dataset: Path, *callbacks: dict[str, Any]) -> Path:
    return tiny_run_config(
        data={"eval": {"path": str(dataset), "every": 2, "batches": 1}},
        checkpoint={"keep_last": 20},
        training={"steps": 7, "log_every": 1, "checkpoint_every": 1},
        callbacks=list(callbacks),
    )


def logged(run_dir: Path) -> dict[int, dict[str, float]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {m["step"]: m for m in map(json.loads, lines)}


def weights(run_dir: Path, step: int, which: str = "model") -> dict[str, torch.Tensor]:
    return load_model_weights(str(run_dir / "checkpoints"), step=step, weights=which)[0]


def by_hand(run_dir: Path, *, decay: float, start: int, every: int, last: int) -> dict:
    """The average from the saved weights of each step: equal to them at `start`, then at
    every `every`-th step after it `a + (1 - decay**every) * (w - a)`, in float32."""
    average = {k: v.float().clone() for k, v in weights(run_dir, start).items()}
    for step in range(start + every, last + 1, every):
        current = weights(run_dir, step)
        for name, value in average.items():
            average[name] = torch.lerp(value, current[name].float(), 1 - decay**every)
    return average


@pytest.fixture(scope="module")
def trained(tmp_path_factory, dataset):
    """One 7-step run with the callback (saved every step) and the same run without it."""
    from llmtrain.core_mesh.cli import main

    root = tmp_path_factory.mktemp("ema")
    runs = {}
    for name, callbacks in (("with", [EMA]), ("without", [])):
        path = root / f"{name}.yaml"
        cfg = {
            "name": name,
            "run_dir": str(root / "runs"),
            "device": "cpu",
            "model": {"kind": "tiny", "max_seq_len": 32, "d_model": 16, "n_layers": 1},
            "data": {
                "train": [{"path": str(dataset)}],
                "seq_len": 32,
                "micro_batch": 4,
                "eval": {"path": str(dataset), "every": 2, "batches": 1},
            },
            "optimizer": {"kind": "adamw", "lr": 1e-2},
            "loggers": [{"kind": "jsonl"}],
            "checkpoint": {"keep_last": 20},
            "training": {"steps": 7, "log_every": 1, "checkpoint_every": 1},
            "callbacks": callbacks,
        }
        path.write_text(json.dumps(cfg))
        assert main(["run", str(path)]) == 0
        runs[name] = root / "runs" / name
    return runs


def test_the_average_equals_a_hand_computation_from_every_steps_weights(trained):
    run_dir = trained["with"]
    for step in (2, 4, 6, 7):
        got = weights(run_dir, step, "ema")
        expected = by_hand(run_dir, decay=0.8, start=2, every=2, last=step)
        assert got.keys() == expected.keys()
        for name, value in expected.items():
            assert torch.equal(got[name], value), (step, name)
    # at step 2 the average is the weights themselves, and it lags them afterwards
    assert all(
        torch.equal(v, weights(run_dir, 2)[k]) for k, v in weights(run_dir, 2, "ema").items()
    )
    average, own = weights(run_dir, 6, "ema"), weights(run_dir, 6)
    assert not any(torch.equal(average[k], own[k]) for k in own if own[k].is_floating_point())


def test_a_step_saved_before_the_start_holds_no_average(trained, run_cli):
    with pytest.raises(Exception, match="holds no moving average of the weights"):
        weights(trained["with"], 1, "ema")
    code, _, err = run_cli(
        "eval", trained["with"] / "checkpoints", "--step", 1, "--weights", "ema", "--data", "x"
    )
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1 and "--weights model" in lines[0], err


def test_the_average_is_evaluated_beside_the_weights_and_changes_no_training(trained):
    with_ema, without = logged(trained["with"]), logged(trained["without"])
    assert [m["loss"] for m in with_ema.values()] == [m["loss"] for m in without.values()]
    assert [m.get("eval_loss") for m in with_ema.values()] == [
        m.get("eval_loss") for m in without.values()
    ]
    assert "eval/ema/loss" not in with_ema[1]  # no eval at step 1, none of the average
    # at its first step the average is the weights: the same loss on the same batches
    assert with_ema[2]["eval/ema/loss"] == with_ema[2]["eval_loss"]
    for step in (4, 6):
        assert with_ema[step]["eval/ema/loss"] != with_ema[step]["eval_loss"]
        assert {"eval/ema/ppl", "eval/ema/bpb"} <= with_ema[step].keys()
    summary = json.loads((trained["with"] / "summary.json").read_text())
    assert summary["eval"]["eval/ema/loss"] == with_ema[6]["eval/ema/loss"]
    assert summary["better"]["eval/ema/loss"] == "lower"


def test_eval_with_weights_ema_loads_the_average(trained, run_cli, dataset):
    checkpoints = trained["with"] / "checkpoints"
    results = {}
    for which in ("model", "ema"):
        code, out, err = run_cli("eval", checkpoints, "--weights", which, "--data", dataset)
        assert code == 0, err
        results[which] = json.loads(out)["loss"]
    assert results["model"] != results["ema"]


def test_a_resumed_run_keeps_the_uninterrupted_average(trained, tiny_run_config, run_cli, tmp_path):
    whole = trained["with"]
    resumed = tmp_path / "runs" / "with"
    shutil.copytree(whole, resumed)
    for step in (5, 6, 7):
        shutil.rmtree(resumed / "checkpoints" / f"step-{step}")
    cfg = json.loads((whole.parent.parent / "with.yaml").read_text())
    cfg["run_dir"] = str(tmp_path / "runs")
    path = tmp_path / "with.yaml"
    path.write_text(json.dumps(cfg))
    code, _, err = run_cli("run", path)  # from step 4
    assert code == 0, err
    assert "run.resumed" in err
    for step in (6, 7):
        a, b = weights(whole, step, "ema"), weights(resumed, step, "ema")
        assert all(torch.equal(a[k], b[k]) for k in a), step
    assert logged(resumed)[6]["eval/ema/loss"] == logged(whole)[6]["eval/ema/loss"]


def test_an_average_added_on_resume_starts_there_with_a_warning(trained, run_cli, tmp_path):
    plain = tmp_path / "runs" / "without"
    shutil.copytree(trained["without"], plain)
    for step in (5, 6, 7):
        shutil.rmtree(plain / "checkpoints" / f"step-{step}")
    cfg = json.loads((trained["without"].parent.parent / "without.yaml").read_text())
    cfg |= {"run_dir": str(tmp_path / "runs"), "callbacks": [EMA]}
    path = tmp_path / "without.yaml"
    path.write_text(json.dumps(cfg))
    code, _, err = run_cli("run", path)
    assert code == 0, err
    assert "ema.restarted" in err and "starts at step 4" in err
    average, start = weights(plain, 6, "ema"), weights(plain, 4)
    expected = {k: torch.lerp(v, weights(plain, 6)[k], 1 - 0.8**2) for k, v in start.items()}
    assert all(torch.equal(average[k], expected[k]) for k in expected)


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ({"decay": 1.0}, "callbacks[0].decay: must be between 0 and 1"),
        ({"decay": 0}, "callbacks[0].decay: must be between 0 and 1"),
        ({"every": 0}, "callbacks[0].every: must be at least 1"),
        ({"start": -1}, "callbacks[0].start: must be a step number"),
    ],
)
def test_bad_options_are_one_line(tiny_run_config, run_cli, option, message):
    path = tiny_run_config(callbacks=[{"kind": "ema", **option}])
    code, _, err = run_cli("run", path)
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1 and message in lines[0], err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--last", "9"],
            "--last 9: {ckpt} has 7 committed steps (committed: 1, 2, 3, 4, 5, 6, 7)",
        ),
        (["--steps", "3,99"], "--steps: step 99 is not a committed step of {ckpt}"),
        (["--steps", "3,x"], "argument --steps: 'x' is not a step number"),
        (["--steps", "3,3"], "name each step once"),
        (["--step", "3", "--last", "2"], "--step, --steps and --last each choose the steps"),
        (["--last", "0"], "argument --last: '0' is not a whole number of at least 1"),
        (["--weights", "mean"], "argument --weights: invalid choice: 'mean'"),
    ],
)
def test_eval_tasks_steps_and_weights_refused_in_one_line(trained, run_cli, args, message):
    checkpoints = trained["with"] / "checkpoints"
    code, _, err = run_cli("eval-tasks", checkpoints, "--tasks", "hellaswag=none.jsonl", *args)
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1, err
    assert message.format(ckpt=checkpoints) in lines[0]
