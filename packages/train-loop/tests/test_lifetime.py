"""A sweep's run dies with the sweep (`lifetime.py`), tested with real processes: a run (or a
torchrun rank) whose parent is SIGKILLed gets SIGTERM, one started after its sweep ended stops at
once, and a sweep's child ignores the terminal's SIGINT. The whole sweep under SIGKILL, and its
resume, is in integration_tests/test_sweep.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from llmtrain.train_loop import lifetime

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's"
)

# a stand-in for `llmtrain run`: says how it ended in a file
RUN = """
import os, signal, sys, time
from pathlib import Path
from llmtrain.train_loop.lifetime import die_with_the_sweep

out = Path(sys.argv[1])
def stop(signum, frame):
    out.write_text(signal.Signals(signum).name)
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
die_with_the_sweep()
print(os.getpid(), flush=True)
time.sleep(120)
out.write_text("slept on")
"""


def _ended_with(path: Path, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"still running {timeout} s later"
        time.sleep(0.05)
    return path.read_text()


def test_a_rank_whose_parent_is_killed_gets_sigterm(tmp_path):
    """The parent stands for torchrun (the rank is not the sweep's child): SIGKILLed, its rank
    hears SIGTERM (saves, stops) instead of training on alone."""
    parent = textwrap.dedent(
        f"""
        import os, subprocess, sys, time
        env = {{**os.environ, "{lifetime.SWEEP_PID_ENV}": str(os.getppid())}}
        child = subprocess.Popen([sys.executable, "-c", {RUN!r}, sys.argv[1]], env=env,
                                 stdout=subprocess.PIPE, text=True)
        child.stdout.readline()  # its parent-death signal is set
        print("ready", flush=True)
        time.sleep(120)
        """
    )
    out = tmp_path / "ended"
    proc = subprocess.Popen(
        [sys.executable, "-c", parent, str(out)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline() == "ready\n"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        assert _ended_with(out) == "SIGTERM"
    finally:
        proc.kill()


def test_a_run_started_after_its_sweep_ended_stops_at_once(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(timeout=60)
    out = tmp_path / "ended"
    env = {**os.environ, lifetime.SWEEP_PID_ENV: str(gone.pid)}
    proc = subprocess.run(
        [sys.executable, "-c", RUN, str(out)], env=env, capture_output=True, timeout=60
    )
    assert (proc.returncode, out.read_text()) == (0, "SIGTERM")


def test_outside_a_sweep_nothing_changes(tmp_path):
    out = tmp_path / "ended"
    env = {k: v for k, v in os.environ.items() if k != lifetime.SWEEP_PID_ENV}
    proc = subprocess.Popen(
        [sys.executable, "-c", RUN.replace("time.sleep(120)", "time.sleep(0.5)"), str(out)],
        env=env,
        stdout=subprocess.PIPE,
    )
    assert proc.wait(timeout=60) == 0
    assert out.read_text() == "slept on"


def test_a_sweeps_child_ignores_sigint_and_dies_with_the_sweep(tmp_path):
    """The child as `llmtrain sweep` starts it (its preexec and environment), from a stand-in
    sweep: Ctrl-C's SIGINT leaves it running; the sweep SIGKILLed, it gets SIGTERM."""
    sweep = textwrap.dedent(
        f"""
        import subprocess, sys, time
        from llmtrain.train_loop import lifetime
        child = subprocess.Popen(
            [sys.executable, "-c", {RUN!r}, sys.argv[1]],
            env=lifetime.child_environment(), preexec_fn=lifetime.child_preexec(),
            stdout=subprocess.PIPE, text=True)
        print(child.stdout.readline().strip(), flush=True)
        time.sleep(120)
        """
    )
    out = tmp_path / "ended"
    proc = subprocess.Popen(
        [sys.executable, "-c", sweep, str(out)], stdout=subprocess.PIPE, text=True
    )
    try:
        child = int(proc.stdout.readline())
        assert os.getpgid(child) == os.getpgid(proc.pid)  # a kill of the group reaches it
        os.kill(child, signal.SIGINT)
        time.sleep(0.5)
        assert not out.exists(), out.read_text()
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        assert _ended_with(out) == "SIGTERM"
    finally:
        proc.kill()


def test_the_childs_environment_names_the_sweep_and_leaves_sigint_to_it():
    env = lifetime.child_environment({"PATH": "/bin"})
    assert env == {
        "PATH": "/bin",
        lifetime.SWEEP_PID_ENV: str(os.getpid()),
        "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGHUP,SIGQUIT",
    }
    # a user's own torchrun setting wins
    given = {"TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM"}
    assert lifetime.child_environment(given)["TORCHELASTIC_SIGNALS_TO_HANDLE"] == "SIGTERM"
