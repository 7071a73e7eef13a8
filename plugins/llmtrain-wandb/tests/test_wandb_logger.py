"""The `wandb` logger, installed as a plugin package: real `llmtrain run` processes log to W&B in
offline mode (no network, no login), and the run's own `.wandb` transaction log, read back with
`wandb leet inspect --json`, holds every metric of metrics.jsonl at its step and the resolved
config; a run stopped by SIGTERM and started again continues the same W&B run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import train_support as ts
import yaml
from llmtrain_wandb.plugin import ID_FILE, WandbOptions, run_id

from llmtrain.core_mesh.metric_names import dashboard_name


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return ts.pack_corpus(tmp_path_factory.mktemp("data"))


def config(data, tmp_path) -> dict:
    """The shared 30-step config (eval every 10), logging to metrics.jsonl and to W&B offline."""
    config = ts.run_config(data, tmp_path / "runs")
    wandb = {"kind": "wandb", "mode": "offline", "project": "llmtrain-tests", "tags": ["ci"]}
    config["loggers"] = [{"kind": "jsonl"}, wandb]
    return config


def records(path: Path) -> list[dict]:
    """The records of a `.wandb` transaction log, as wandb's own reader prints them."""
    cmd = [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(path)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True).stdout
    return [json.loads(line) for line in out.splitlines()]


def segments(run_dir: Path) -> list[list[dict]]:
    """The records of each process that logged this run, oldest first (one offline run
    directory per process start)."""
    files = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    return [records(path) for path in files]


def of_type(recs: list[dict], kind: str) -> list[dict]:
    return [r[kind] for r in recs if r["type"] == kind]


def history(recs: list[dict]) -> list[tuple[int, dict]]:
    """(step, {key: value}) per logged step, without wandb's own `_` keys."""
    return [
        (h["step"]["num"], {k: v for k, v in h["item"].items() if not k.startswith("_")})
        for h in of_type(recs, "history")
    ]


def expected(metrics: list[dict]) -> list[tuple[int, dict]]:
    return [
        (m["step"], {dashboard_name(k): v for k, v in m.items() if k != "step"}) for m in metrics
    ]


def test_entry_point_loads_without_wandb():
    probe = (
        "import sys, importlib.metadata as md\n"
        "from llmtrain.core_mesh.plugins import PluginManager\n"
        "(ep,) = md.entry_points(group='llmtrain', name='wandb')\n"
        "pm = PluginManager(blocked=())\n"
        "pm.register(ep.load(), ep.name)\n"
        "entry = pm.registry('logger').get('wandb')\n"
        "print(ep.value, entry.options.__name__, pm.problems, 'wandb' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout == "llmtrain_wandb.plugin WandbOptions [] False\n"


def test_keys_and_the_run_id_file(tmp_path):
    # the shared mapping of llmtrain.core_mesh.metric_names, the same as the tensorboard logger's
    assert [dashboard_name(k) for k in ("loss", "lr", "eval_loss", "eval_ppl", "sys/x")] == [
        "loss/train",
        "optim/lr",
        "loss/eval",
        "loss/eval_ppl",
        "sys/x",
    ]
    first = run_id(tmp_path / "run")
    assert len(first) == 8 and first.isalnum() and first.islower()
    assert (tmp_path / "run" / ID_FILE).read_text() == first + "\n"
    assert run_id(tmp_path / "run") == first
    assert WandbOptions().mode is None  # wandb's own setting decides unless the config says


def test_options_are_validated_with_the_config_path(data, tmp_path, run_cli):
    bad = config(data, tmp_path)
    bad["loggers"][1].update(mode="offlne", entity=3, projekt="x")
    code, _, err = run_cli("config", "validate", ts.write_config(tmp_path / "bad.yaml", bad))
    assert code != 0
    assert "loggers[1].mode: expected one of 'online', 'offline', 'disabled', got 'offlne'" in err
    assert "loggers[1].entity: expected str, got int" in err, err
    assert "loggers[1].projekt: unknown key" in err, err


ELSEWHERE = "; give a path inside it, or an absolute path to write elsewhere on purpose"


@pytest.mark.parametrize(
    ("directory", "says"),
    [
        ("../../x", "'../../x' leaves the run directory" + ELSEWHERE),
        ("w/../../../x", "'w/../../../x' leaves the run directory" + ELSEWHERE),
        ("", "must name a directory, got ''"),
    ],
)
def test_the_directory_stays_in_the_run_as_jsonls_file_does(
    data, tmp_path, run_cli, directory, says
):
    """Refused before the run starts (as the jsonl logger's `../x.jsonl` is): no W&B run, and
    nothing written inside the run directory or out of it."""
    bad = config(data, tmp_path)
    bad["loggers"][1].update(dir=directory)
    path = ts.write_config(tmp_path / "bad.yaml", bad)
    for command in (("config", "validate"), ("run",)):
        code, _, err = run_cli(*command, path)
        assert code == 2, err
        assert err.startswith(f"error: {path}:") and f": loggers[1].dir: {says}\n" in err, err
        assert len(err.splitlines()) == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml"]
    assert not (tmp_path.parent / "x").exists()


def test_offline_run_logs_every_step_and_the_config(data, tmp_path):
    path = ts.write_config(tmp_path / "run.yaml", config(data, tmp_path))
    done = ts.run(ts.llmtrain("run", path), timeout=600)
    assert "Traceback" not in done.stderr
    run_dir = tmp_path / "runs" / "run"

    (recs,) = segments(run_dir)
    metrics = ts.read_metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(1, 31))
    assert history(recs) == expected(metrics)  # every key, every step, exactly
    assert [step for step, items in history(recs) if "loss/eval" in items] == [10, 20, 30]
    # W&B makes a section of each key's part before its first `/`: `loss` is the first by name,
    # and the first W&B sees (every step logs its loss keys first)
    sections = sorted({key.split("/")[0] for _, items in history(recs) for key in items})
    assert sections == ["loss", "memory", "optim", "perf", "progress"]
    for _, items in history(recs):
        keys = list(items)
        assert keys[0] == ("loss/eval" if "loss/eval" in items else "loss/train"), keys
        assert keys == sorted(keys, key=lambda k: (not k.startswith("loss/"), k)), keys

    (run,) = of_type(recs, "run")
    assert run["run_id"] == (run_dir / ID_FILE).read_text().strip()
    assert run["project"] == "llmtrain-tests" and run["display_name"] == "run"
    assert run["tags"] == ["ci"]
    logged = {k: v for k, v in run["config"]["update"].items() if k != "_wandb"}
    assert logged == yaml.safe_load((run_dir / "config.yaml").read_text())
    assert logged["model"]["kind"] == "tiny" and logged["model"]["d_model"] == 32
    assert [e["exit_code"] for e in of_type(recs, "exit")] == [0]


def test_sigterm_then_resume_continues_the_same_wandb_run(data, tmp_path):
    cfg = config(data, tmp_path)
    cfg["training"].update(checkpoint_every=None)  # the stop itself saves
    path = ts.write_config(tmp_path / "run.yaml", cfg)
    run_dir = tmp_path / "runs" / "run"
    proc = ts.start(ts.llmtrain("run", path))
    try:
        ts.wait_for_step(run_dir / "metrics.jsonl", 5, proc)
        proc.send_signal(signal.SIGTERM)  # to the training process only
        stopped = ts.finish(proc, timeout=60)
    finally:
        ts.stop_group(proc)
    assert stopped.returncode == 0, stopped.stderr
    at = ts.last_logged_step(run_dir / "metrics.jsonl")
    assert 5 <= at < 30 and ts.committed_steps(run_dir / "checkpoints") == [at]

    resumed = ts.run(ts.llmtrain("run", path), timeout=600)
    assert "run.resumed" in resumed.stderr and "Traceback" not in resumed.stderr

    first, second = segments(run_dir)
    ids = {r["run_id"] for recs in (first, second) for r in of_type(recs, "run")}
    assert ids == {(run_dir / ID_FILE).read_text().strip()}
    assert of_type(second, "run")[0]["resume"] is True
    assert [step for step, _ in history(first)] == list(range(1, at + 1))
    assert [step for step, _ in history(second)] == list(range(at + 1, 31))
    assert history(first) + history(second) == expected(ts.read_metrics(run_dir))
    assert [e["exit_code"] for e in of_type(first, "exit") + of_type(second, "exit")] == [0, 0]

    # `wandb sync` takes both pieces (it uploads them in order of start time, to the one run)
    pieces = sorted((run_dir / "wandb").glob("offline-run-*"))
    cmd = [sys.executable, "-m", "wandb", "sync", "--dry-run", *map(str, pieces)]
    listed = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True)
    shown = listed.stdout + listed.stderr
    assert "Would sync 2 run(s)" in shown, shown
    assert all(str(next(piece.glob("*.wandb"))) in shown for piece in pieces), shown


def test_wandb_killed_with_the_run_does_not_fail_the_run(data, tmp_path):
    """A scheduler that signals every process of a job (SLURM) stops wandb-core too: the run
    still saves and exits 0, the logger warns, and W&B loses what it had not written yet."""
    import psutil

    cfg = config(data, tmp_path)
    cfg["training"].update(checkpoint_every=None)
    path = ts.write_config(tmp_path / "run.yaml", cfg)
    run_dir = tmp_path / "runs" / "run"
    proc = ts.start(ts.llmtrain("run", path))
    try:
        ts.wait_for_step(run_dir / "metrics.jsonl", 5, proc)
        family = [proc.pid, *(p.pid for p in psutil.Process(proc.pid).children(recursive=True))]
        assert len(family) > 1, "no wandb service process"
        for pid in family:
            os.kill(pid, signal.SIGTERM)
        stopped = ts.finish(proc, timeout=60)
    finally:
        ts.stop_group(proc)
    assert stopped.returncode == 0, stopped.stderr
    assert "Traceback" not in stopped.stderr and "Exception ignored" not in stopped.stderr
    assert "wandb logger:" in stopped.stderr and "the training goes on" in stopped.stderr
    at = ts.last_logged_step(run_dir / "metrics.jsonl")
    assert ts.committed_steps(run_dir / "checkpoints") == [at]
    assert f"run: {at} steps" in stopped.stderr


def test_online_without_a_login_is_a_readable_error(tmp_path):
    """Built directly (no training): no API key anywhere, so wandb refuses before any network."""
    probe = (
        "from llmtrain.core_mesh.errors import UserError\n"
        "from llmtrain.core_mesh.interfaces import RunInfo\n"
        "from llmtrain_wandb.plugin import WandbOptions, WandbSink\n"
        f"run = RunInfo(name='r', run_dir={str(tmp_path)!r}, total_steps=1, start_step=0,\n"
        "              config={})\n"
        "try:\n"
        "    WandbSink(WandbOptions(mode='online', project='p'), run)\n"
        "except UserError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=600, check=True
    )
    assert out.stdout.startswith("the wandb logger could not start its W&B run: "), out
    assert "set `mode: offline` on the logger" in out.stdout and "wandb sync" in out.stdout


def test_disabled_mode_logs_nothing(tmp_path):
    probe = (
        "from llmtrain.core_mesh.interfaces import RunInfo\n"
        "from llmtrain_wandb.plugin import WandbOptions, WandbSink\n"
        f"run = RunInfo(name='r', run_dir={str(tmp_path)!r}, total_steps=1, start_step=0,\n"
        "              config={'model': {'kind': 'tiny'}})\n"
        "sink = WandbSink(WandbOptions(mode='disabled'), run)\n"
        "sink.log(1, {'loss': 1.0})\n"
        "sink.close()\n"
    )
    subprocess.run([sys.executable, "-c", probe], capture_output=True, timeout=600, check=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == [ID_FILE]


def test_a_run_that_raises_is_marked_failed(tmp_path):
    """The trainer closes its loggers in a `finally`: closing while an exception propagates
    finishes the W&B run with exit code 1."""
    probe = (
        "from llmtrain.core_mesh.interfaces import RunInfo\n"
        "from llmtrain_wandb.plugin import WandbOptions, WandbSink\n"
        f"run = RunInfo(name='r', run_dir={str(tmp_path)!r}, total_steps=9, start_step=0,\n"
        "              config={'model': {'kind': 'tiny'}})\n"
        "sink = WandbSink(WandbOptions(mode='offline'), run)\n"
        "try:\n"
        "    try:\n"
        "        sink.log(1, {'loss': 2.5})\n"
        "        raise FloatingPointError('loss is nan')\n"
        "    finally:\n"
        "        sink.close()\n"
        "except FloatingPointError:\n"
        "    pass\n"
    )
    subprocess.run([sys.executable, "-c", probe], capture_output=True, timeout=600, check=True)
    (recs,) = segments(tmp_path)
    assert history(recs) == [(1, {"loss/train": 2.5})]
    assert [e["exit_code"] for e in of_type(recs, "exit")] == [1]
