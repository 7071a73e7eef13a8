"""Interrupted runs: a run SIGKILLed at a random step and started again logs exactly what the
uninterrupted run logs; SIGTERM saves and exits 0, and the next start finishes the run; a NaN loss
stops the run naming the step and the last good checkpoint, or is skipped without touching the
weights. Kills are real signals to real `python -m llmtrain run` processes."""

from __future__ import annotations

import json
import math
import os
import random
import signal
import time

import pytest
import torch
import train_support as ts
from shared_fixtures import run_cli  # noqa: F401

from llmtrain.core_mesh.cli import main
from llmtrain.core_mesh.plugins import PluginManager, hookimpl

KILL_SEED = 20261122  # the kill step is random, but the same on every run of the suite


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return ts.pack_corpus(tmp_path_factory.mktemp("data"))


@pytest.fixture
def config(data, tmp_path):
    """The shared config with dropout, so the resumed RNG state matters too."""
    config = ts.run_config(data, tmp_path / "runs")
    config["model"]["dropout"] = 0.1
    return config


def test_sigkill_at_a_random_step_then_resume_equals_the_uninterrupted_run(config, tmp_path):
    path = ts.write_config(tmp_path / "run.yaml", config)
    ts.run(ts.llmtrain("run", path, "name=whole"), timeout=600)
    whole = ts.by_step(ts.read_metrics(tmp_path / "runs" / "whole"))

    kill_at = random.Random(KILL_SEED).randint(8, 22)
    run_dir = tmp_path / "runs" / "killed"
    proc = ts.start(ts.llmtrain("run", path, "name=killed"))
    try:
        seen = ts.wait_for_step(run_dir / "metrics.jsonl", kill_at, proc)
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)
    finally:
        ts.stop_group(proc)
    assert proc.returncode == -signal.SIGKILL
    assert seen < 30, "the run ended before it could be killed"
    committed = ts.committed_steps(run_dir / "checkpoints")
    assert committed and committed[-1] % 5 == 0 and committed[-1] < 30

    resumed = ts.run(ts.llmtrain("run", path, "name=killed"), timeout=600)
    assert "run.resumed" in resumed.stderr
    metrics = ts.read_metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(1, 31)), f"killed at step {seen}"
    got = ts.by_step(metrics)
    for step in range(1, 31):
        for key in ("loss", "lr", "grad_norm", "eval_loss", "tokens"):
            want, have = whole[step].get(key), got[step].get(key)
            where = f"step {step} {key} after a SIGKILL at step {seen}"
            if want is None:  # eval_loss exists on eval steps only
                assert have is None, where
            else:
                assert have == pytest.approx(want, rel=1e-6), where
    assert ts.committed_steps(run_dir / "checkpoints")[-1] == 30


@pytest.mark.parametrize("checkpoint_every", [None, 1], ids=["final-save", "on-a-checkpoint-step"])
def test_sigterm_saves_exits_zero_and_the_next_start_finishes(config, tmp_path, checkpoint_every):
    """With checkpoint_every 1 the stop lands on a step that was just saved: the final save must
    not try to write that step again."""
    config["training"].update(steps=120, checkpoint_every=checkpoint_every)
    config["data"].pop("eval")
    path = ts.write_config(tmp_path / "run.yaml", config)
    run_dir = tmp_path / "runs" / "run"
    proc = ts.start(ts.llmtrain("run", path))
    try:
        ts.wait_for_step(run_dir / "metrics.jsonl", 4, proc)
        proc.send_signal(signal.SIGTERM)
        done = ts.finish(proc, timeout=600)
    finally:
        ts.stop_group(proc)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    stopped = ts.last_logged_step(run_dir / "metrics.jsonl")
    assert 4 <= stopped < 120
    assert f"stopped by a signal after step {stopped}; the checkpoint is saved" in done.stderr
    assert f"run: {stopped} steps" in done.stderr
    assert ts.committed_steps(run_dir / "checkpoints")[-1] == stopped

    again = ts.run(ts.llmtrain("run", path, "training.checkpoint_every=null"), timeout=600)
    assert "run: 120 steps" in again.stderr
    steps = [m["step"] for m in ts.read_metrics(run_dir)]
    assert steps == list(range(1, 121))
    resumed = [
        json.loads(line)
        for line in (run_dir / "logs" / "rank0.jsonl").open()
        if '"run.resumed"' in line
    ]
    assert [event["step"] for event in resumed] == [stopped]
    assert ts.committed_steps(run_dir / "checkpoints")[-1] == 120


def _catches(pid: int, sig: signal.Signals) -> bool:
    """Whether the process has a handler installed for `sig` (its SigCgt mask in /proc)."""
    with open(f"/proc/{pid}/status") as f:
        caught = next(line for line in f if line.startswith("SigCgt:")).split()[1]
    return bool(int(caught, 16) >> (sig - 1) & 1)


def test_sigterm_during_setup_stops_before_the_first_step(config, tmp_path):
    """SIGTERM as soon as `llmtrain run` listens, long before its loop (torch is not imported
    yet): the run stops before step 1 with a message and a summary, and exits 0."""
    path = ts.write_config(tmp_path / "run.yaml", config)
    run_dir = tmp_path / "runs" / "run"
    proc = ts.start(ts.llmtrain("run", path))
    try:
        deadline = time.monotonic() + 300
        while not _catches(proc.pid, signal.SIGTERM):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "`llmtrain run` never listened for SIGTERM"
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        done = ts.finish(proc, timeout=600)
    finally:
        ts.stop_group(proc)
    assert done.returncode == 0, done.stderr
    assert "stopped by a signal before step 1" in done.stderr
    assert "run: 0 steps" in done.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["status"], summary["step"]) == ("stopped", 0)
    assert ts.committed_steps(run_dir / "checkpoints") == []
    assert not (run_dir / "metrics.jsonl").exists() or ts.read_metrics(run_dir) == []


# --- non-finite steps: a model plugin that turns the loss into NaN on chosen steps ---


class Poison:
    """Registers model `poisoned-tiny`: the tiny transformer whose logits are NaN in the training
    forwards numbered in `steps` (1-based; one forward per step without accumulation)."""

    def __init__(self, steps):
        self.steps = set(steps)
        self.forwards = 0

    @hookimpl
    def llmtrain_models(self, register):
        from llmtrain.models.config import TransformerConfig
        from llmtrain.models.presets import PRESETS

        register("poisoned-tiny", self.build, options=TransformerConfig, defaults=PRESETS["tiny"])

    def build(self, options):
        from llmtrain.models.transformer import Transformer

        poison = self

        class Poisoned(Transformer):
            def forward(self, tokens, *args, **kwargs):
                logits = super().forward(tokens, *args, **kwargs)
                if self.training and torch.is_grad_enabled():
                    poison.forwards += 1
                    if poison.forwards in poison.steps:
                        logits = logits * math.nan
                return logits

        return Poisoned(options)


@pytest.fixture
def poisoned(config, tmp_path, capsys, run_cli):  # noqa: F811 - run_cli's teardown resets logging
    """poisoned(steps, *overrides) -> (exit code, stderr, run dir) of an in-process run of the
    poisoned model: 12 steps of one forward each, a checkpoint every 5 steps, no eval."""
    import torch.distributed as dist

    config["model"]["kind"] = "poisoned-tiny"
    config["data"].pop("eval")
    config["data"]["micro_batch"] = 8
    config["training"]["steps"] = 12
    path = ts.write_config(tmp_path / "run.yaml", config)

    def run(steps, *overrides):
        plugins = PluginManager(blocked=()).load_entry_points()
        plugins.register(Poison(steps), "poison")
        capsys.readouterr()
        code = main(["run", str(path), *map(str, overrides)], plugins=plugins)
        assert not dist.is_initialized(), "the run did not shut its process group down"
        return code, capsys.readouterr().err, tmp_path / "runs" / "run"

    return run


def test_nan_loss_stops_naming_the_step_and_the_last_good_checkpoint(poisoned):
    """The step right after a checkpoint: the message names that checkpoint, which exists."""
    code, err, run_dir = poisoned([6])
    assert code == 2
    [error] = ts.error_lines(err)
    assert "Traceback" not in err
    assert error.startswith("error: step 6: loss nan, gradient norm nan is not finite")
    assert "the step was not applied and the last good checkpoint is step 5" in error
    assert "training.non_finite.action: skip" in error
    assert [m["step"] for m in ts.read_metrics(run_dir)] == list(range(1, 6))
    assert ts.committed_steps(run_dir / "checkpoints") == [5]


def test_nan_loss_skipped_leaves_the_weights_as_they_were(poisoned):
    from llmtrain.checkpoint.export import load_model_weights

    code, err, run_dir = poisoned(
        [4],
        "training.non_finite.action=skip",
        "training.non_finite.max_skips=2",
        "training.checkpoint_every=1",
        "checkpoint.keep_last=20",
    )
    assert code == 0, err
    metrics = ts.by_step(ts.read_metrics(run_dir))
    assert list(metrics) == list(range(1, 13))
    assert math.isnan(metrics[4]["loss"]) and math.isnan(metrics[4]["grad_norm"])
    assert all(math.isfinite(metrics[s]["loss"]) for s in metrics if s != 4)
    assert metrics[12]["loss"] < metrics[1]["loss"]

    checkpoints = str(run_dir / "checkpoints")
    before, _, _ = load_model_weights(checkpoints, step=3)
    skipped, _, _ = load_model_weights(checkpoints, step=4)
    after, _, _ = load_model_weights(checkpoints, step=5)
    assert all(torch.equal(before[k], skipped[k]) for k in before), "step 4 changed the weights"
    assert any(not torch.equal(skipped[k], after[k]) for k in before), "step 5 changed nothing"
    events = [json.loads(line) for line in (run_dir / "logs" / "rank0.jsonl").open()]
    assert [e["step"] for e in events if e["event"] == "step.skipped"] == [4]


def test_too_many_nan_steps_stop_the_skipping_run(poisoned):
    code, err, run_dir = poisoned(
        [3, 4, 10], "training.non_finite.action=skip", "training.non_finite.max_skips=2"
    )
    assert code == 2
    [error] = ts.error_lines(err)
    assert error.startswith("error: step 10: loss nan, gradient norm nan is not finite after 2")
    assert "the last good checkpoint is step 5" in error
    assert [m["step"] for m in ts.read_metrics(run_dir)] == list(range(1, 10))
