"""A callback from a real plugin package (pyproject + entry point) installed into a venv, used
by `llmtrain run` processes: it adds metrics, its state survives a SIGKILL and resume exactly,
a bad option is a config error, and a callback that raises stops the run naming its package."""

from __future__ import annotations

import json
import os
import signal
import sys
import sysconfig
from pathlib import Path

import pytest
import train_support as ts
from support import make_plugin, run

PLUGIN = """
import attrs
from llmtrain.core_mesh.interfaces import Callback, TrainingRun
from llmtrain.core_mesh.plugins import hookimpl


@attrs.frozen(kw_only=True)
class EmaOptions:
    decay: float = 0.9
    fail_at: int | None = None


class LossEma(Callback):
    '''An exponential moving average of the loss, and how many steps it has seen.'''

    def __init__(self, options):
        self.options = options
        self.ema = None
        self.seen = 0

    def on_run_start(self, run):
        if not isinstance(run, TrainingRun):
            wanted = [m for m in dir(TrainingRun) if not m.startswith("_")]
            missing = [m for m in wanted if not hasattr(run, m)]
            raise TypeError(f"the run lacks {missing}")

    def after_step(self, run, step, metrics):
        if step == self.options.fail_at:
            raise RuntimeError(f"refusing step {step}")
        loss = metrics["loss"]
        d = self.options.decay
        self.ema = loss if self.ema is None else d * self.ema + (1 - d) * loss
        self.seen += 1
        metrics["loss_ema"] = self.ema
        metrics["steps_seen"] = self.seen

    def state_dict(self):
        return {"ema": self.ema, "seen": self.seen}

    def load_state_dict(self, state):
        self.ema, self.seen = state["ema"], state["seen"]


@hookimpl
def llmtrain_callbacks(register):
    register("loss_ema", LossEma, options=EmaOptions, help="moving average of the loss")
"""


@pytest.fixture(scope="module")
def python(tmp_path_factory):
    """A venv that sees this environment's packages (a .pth file) and has the plugin package
    installed into it, so `llmtrain` finds the callback through its entry point only."""
    base = tmp_path_factory.mktemp("callback-plugin")
    pkg = make_plugin(base, "llmtrain-ema", "llmtrain_ema", PLUGIN)
    env = base / "venv"
    run(["uv", "venv", "-q", "--python", sys.executable, str(env)])
    python = env / "bin" / "python"
    site = run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
    ours = sysconfig.get_paths()["purelib"]
    with open(os.path.join(site.stdout.strip(), "llmtrain-test-parent.pth"), "w") as f:
        f.write(f"import site; site.addsitedir({ours!r})\n")  # its own .pth files count too
    run(["uv", "pip", "install", "-q", "--no-deps", "--python", str(python), str(pkg)])
    return python


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return ts.pack_corpus(tmp_path_factory.mktemp("data"))


def llmtrain(python, *args) -> list[str]:
    return [str(python), "-m", "llmtrain", *map(str, args)]


def write(data, tmp_path, **callback) -> str:
    config = ts.run_config(data, tmp_path / "runs")
    config["model"]["dropout"] = 0.1
    config["callbacks"] = [{"kind": "loss_ema", **callback}]
    return str(ts.write_config(tmp_path / "run.yaml", config))


def test_this_process_does_not_see_the_plugin():
    from llmtrain.core_mesh.plugins import PluginManager

    assert "loss_ema" not in PluginManager().load_entry_points().registry("callback")


def test_the_callback_s_metric_and_state_survive_a_sigkill(python, data, tmp_path):
    path = write(data, tmp_path, decay=0.8)
    run_dir = tmp_path / "runs" / "killed"
    # the uninterrupted run beside the one to kill (each start is seconds of imports, on one core)
    uninterrupted = ts.start(llmtrain(python, "run", path, "name=whole"))
    proc = ts.start(llmtrain(python, "run", path, "name=killed"))
    try:
        seen = ts.wait_for_step(run_dir / "metrics.jsonl", 13, proc, timeout=600)
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=60)
        done = ts.finish(uninterrupted, timeout=600)
    finally:
        ts.stop_group(proc)
        if uninterrupted.poll() is None:
            ts.stop_group(uninterrupted)
            uninterrupted.communicate()
    assert proc.returncode == -signal.SIGKILL
    assert done.returncode == 0, done.stderr[-6000:]
    whole = ts.by_step(ts.read_metrics(tmp_path / "runs" / "whole"))
    assert [whole[s]["steps_seen"] for s in whole] == list(range(1, 31))
    ema = whole[1]["loss"]
    for step in range(2, 31):  # the metric is the average of the logged losses, by hand
        ema = 0.8 * ema + 0.2 * whole[step]["loss"]
        assert whole[step]["loss_ema"] == pytest.approx(ema, rel=1e-9)

    committed = ts.committed_steps(run_dir / "checkpoints")
    assert seen < 30 and committed and committed[-1] < 30, (seen, committed)

    resumed = ts.run(llmtrain(python, "run", path, "name=killed"), timeout=600)
    assert "run.resumed" in resumed.stderr
    got = ts.by_step(ts.read_metrics(run_dir))
    assert sorted(got) == list(range(1, 31))
    for step in range(1, 31):
        for key in ("loss", "loss_ema", "steps_seen"):
            where = f"step {step} {key} (killed at {seen}, resumed from {committed[-1]})"
            assert got[step][key] == pytest.approx(whole[step][key], rel=1e-6), where
    info = json.loads((run_dir / "checkpoints" / "step-30" / "llmtrain.json").read_text())
    assert info["info"]["callbacks"]["loss_ema"]["seen"] == 30


def test_a_bad_callback_option_is_a_config_error(python, data, tmp_path):
    path = write(data, tmp_path, decay="high")
    proc = ts.run(llmtrain(python, "run", path), timeout=300, check=False)
    assert proc.returncode == 2, proc.stderr
    line = Path(path).read_text().splitlines().index("  decay: high") + 1
    want = f"run.yaml:{line}: callbacks[0].decay: expected float, got str 'high'"
    assert want in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_callback_that_raises_stops_the_run_naming_its_package(python, data, tmp_path):
    path = write(data, tmp_path, fail_at=4)
    proc = ts.run(llmtrain(python, "run", path), timeout=300, check=False)
    assert proc.returncode == 2, proc.stderr
    [line] = ts.error_lines(proc.stderr)
    assert (
        "callback 'loss_ema' of plugin 'llmtrain_ema' (llmtrain-ema 1.2.3) failed in after_step"
        in line
    )
    assert "RuntimeError: refusing step 4" in line
    summary = json.loads((tmp_path / "runs" / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["step"] == 4
    assert summary["error"].startswith("CallbackError: callback 'loss_ema'")
