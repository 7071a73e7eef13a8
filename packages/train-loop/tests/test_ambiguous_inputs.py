"""Inputs that ran, or never returned, without saying what they did (issue 52), through the
real CLI: each is one `error:` line and exit 2 before anything is trained, or one warning that
says what the run did instead of what the config asked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

LR = 1e-3


def error_line(code: int, err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1, err
    assert "Traceback" not in err and "this is a bug" not in err, err
    return lines[0]


def lrs(tmp_path: Path) -> dict[int, float]:
    lines = (tmp_path / "runs" / "r" / "metrics.jsonl").read_text().splitlines()
    return {m["step"]: m["lr"] for m in map(json.loads, lines) if "lr" in m}


def steps_logged(tmp_path: Path) -> list[int]:
    metrics = tmp_path / "runs" / "r" / "metrics.jsonl"
    if not metrics.exists():
        return []
    return [m["step"] for m in map(json.loads, metrics.read_text().splitlines()) if "loss" in m]


# -- 1. YAML that never returned -----------------------------------------------------------------


def test_config_validate_refuses_an_alias_bomb_in_one_line(tmp_path):
    lines = ["name: r", "a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 9):
        lines.append(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]")
    path = tmp_path / "bomb.yaml"
    path.write_text("\n".join(lines) + "\n")
    # a process that does not return is the failure (it did not, before)
    done = subprocess.run(
        [sys.executable, "-m", "llmtrain", "config", "validate", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    line = error_line(done.returncode, done.stderr)
    assert line.startswith(f"error: {path}:7: this value holds more than 100000 values"), line


def test_deep_nesting_and_huge_numbers_are_one_line_each(run_cli, tiny_run_config, tmp_path):
    deep = tmp_path / "deep.yaml"
    deep.write_text("name: r\nx: " + "[" * 10_000 + "]" * 10_000 + "\n")
    line = error_line(*run_cli("config", "validate", deep)[::2])
    assert line == f"error: {deep}:2: nested more than 100 levels deep; no config needs that many"

    path = tiny_run_config()
    code, _, err = run_cli("config", "validate", path, "training.steps=1e400")
    assert "1e400 is beyond the largest number a float holds" in error_line(code, err)
    huge = tmp_path / "huge.yaml"
    huge.write_text(path.read_text().replace("steps: 4", "steps: " + "9" * 10_000))
    line = error_line(*run_cli("config", "validate", huge)[::2])
    assert line.endswith(": a number of 10000 digits; no option takes more than 100"), line


# -- 2. µP ---------------------------------------------------------------------------------------


def test_sgd_with_a_mup_model_is_refused_at_validation(run_cli, tiny_run_config, tmp_path):
    path = tiny_run_config(
        model={"parametrization": "mup", "mup_base_width": 8},
        optimizer={"kind": "sgd", "lr": 0.1},
    )
    code, _, err = run_cli("config", "validate", path)
    line = error_line(code, err)
    assert line.startswith(f"error: {path}:")
    assert "optimizer.kind: sgd has no µP learning-rate rule, and model.parametrization is mup" in (
        line
    )


def test_a_mup_checkpoint_does_not_resume_as_standard(run_cli, tiny_run_config, tmp_path):
    mup = {"parametrization": "mup", "mup_base_width": 8}
    path = tiny_run_config(model=mup)
    code, _, err = run_cli("run", path)
    assert code == 0, err
    code, _, err = run_cli("run", path, "training.steps=6", "model.parametrization=standard")
    line = error_line(code, err)
    assert line == (
        "error: model.parametrization: checkpoint step 4 was trained with parametrization "
        "mup, the config says standard: the same weights would be another model; set "
        "model.parametrization: mup to resume, or start a new run (another name, or "
        "init.from) to change it"
    )
    assert steps_logged(tmp_path) == [1, 2, 3, 4]  # nothing trained


# -- 3. ambiguity --------------------------------------------------------------------------------


def test_objective_with_the_deprecated_z_loss_is_refused(run_cli, tiny_run_config, tmp_path):
    path = tiny_run_config(
        training={"objective": {"kind": "cross_entropy", "z_loss": 1e-4}, "z_loss": 1e-3},
    )
    code, _, err = run_cli("config", "validate", path)
    line = error_line(code, err)
    assert line.endswith(
        "training.z_loss: the deprecated training.z_loss and training.objective are both "
        "given; write the weight in the objective (training.objective: {kind: cross_entropy, "
        "z_loss: 0.001}, where it takes one) and remove training.z_loss"
    ), line


def test_the_deprecated_z_loss_alone_still_runs_and_is_written_moved(
    run_cli, tiny_run_config, tmp_path
):
    path = tiny_run_config(training={"z_loss": 1e-3, "steps": 2})
    code, _, err = run_cli("run", path)
    assert code == 0, err
    assert "training.z_loss is deprecated" in err
    written = yaml.safe_load((tmp_path / "runs" / "r" / "config.yaml").read_text())
    assert written["training"]["z_loss"] == 0.0
    assert written["training"]["objective"]["z_loss"] == 1e-3
    # the written config reads back (a resume from it, or a sweep's copy)
    code, _, err = run_cli("config", "validate", tmp_path / "runs" / "r" / "config.yaml")
    assert code == 0, err


def test_extending_with_another_lr_refuses_keeps_or_recomputes_saying_so(
    run_cli, tiny_run_config, tmp_path
):
    path = tiny_run_config()
    code, _, err = run_cli("run", path)
    assert code == 0, err
    said = "optimizer.lr: checkpoint step 4 was trained at lr 1.00e-03, the config says 2.00e-03"

    code, _, err = run_cli("run", path, "training.steps=6", "optimizer.lr=0.002")
    assert error_line(code, err) == (
        f"error: {said}. Set optimizer.lr: 0.001 to resume as trained, "
        "training.on_extend=keep to go on at 1.00e-03 or training.on_extend=recompute to train "
        "at 2.00e-03 from step 5"
    )
    assert steps_logged(tmp_path) == [1, 2, 3, 4]

    # keep: the trained lr (the optimizer state's), said; before, the config's was dropped unsaid
    code, _, err = run_cli(
        "run", path, "training.steps=6", "training.on_extend=keep", "optimizer.lr=0.002"
    )
    assert code == 0, err
    assert f"{said}; training.on_extend=keep goes on at 1.00e-03" in err
    assert lrs(tmp_path)[5] == LR

    # recompute: the configured lr from the next step
    code, _, err = run_cli(
        "run", path, "training.steps=8", "training.on_extend=recompute", "optimizer.lr=0.002"
    )
    assert code == 0, err
    said = said.replace("step 4", "step 6")
    assert f"{said}; training.on_extend=recompute goes on at 2.00e-03 from step 7" in err
    assert lrs(tmp_path)[7] == 2 * LR


def test_rerunning_a_finished_run_with_fewer_steps_is_refused(run_cli, tiny_run_config, tmp_path):
    path = tiny_run_config()
    code, _, err = run_cli("run", path)
    assert code == 0, err
    code, _, err = run_cli("run", path, "training.steps=2")
    assert error_line(code, err) == (
        "error: training.steps: checkpoint step 4 is past the 2 steps the config asks for: "
        "nothing would be trained; set training.steps for more than 4 steps to train on, or "
        "choose another run name to start over"
    )
    # the same steps again: finished already, nothing to train, exit 0 as before
    code, _, err = run_cli("run", path)
    assert code == 0, err
