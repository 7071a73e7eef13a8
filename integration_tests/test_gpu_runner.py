"""The GPU kit's dry run on CPU (tools/gpu/runner.py --dry-run): every step's command parses
and starts here, so the first GPU session does not die on a typo; a failing step is reported
with its tail and costs the steps after it nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

RUNNER = Path(__file__).resolve().parents[1] / "tools" / "gpu" / "runner.py"
STEPS = [
    "install", "data", "gpu-tests", "bench-model", "bench-parallel", "gpt2-run", "float8-run",
    "moe-run", "deterministic", "llama-run", "bare-loop", "torchtitan",
]  # fmt: skip


def dry_run(tmp_path: Path, *args: str) -> dict:
    """No bundle folder: the runner builds the repo's wheels offline and installs those."""
    out = tmp_path / "out"
    command = [sys.executable, str(RUNNER), "--dry-run", "--bundle", str(tmp_path / "no-bundle")]
    command += ["--out", str(out), "--work", str(tmp_path / "work"), *args]
    subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert (out / "report.md").is_file()
    return json.loads((out / "report.json").read_text())


@pytest.mark.slow
def test_dry_run_passes_every_step(tmp_path):
    report = dry_run(tmp_path)
    assert report["mode"] == "dry-run"
    assert [s["name"] for s in report["steps"]] == STEPS
    status = {s["name"]: (s["status"], s["tail"][-2000:]) for s in report["steps"]}
    assert all(s == "passed" for s, _ in list(status.values())[:-1]), status
    assert status["torchtitan"][0] == "skipped"
    runs = {s["name"]: s["figures"] for s in report["steps"]}
    assert runs["gpt2-run"]["tokens_per_s"] > 0 and runs["bare-loop"]["tokens_per_s"] > 0


@pytest.mark.slow
def test_a_failing_step_is_reported_and_the_next_steps_run(tmp_path):
    report = dry_run(tmp_path, "--only", "gpu-tests,float8-run", "--break", "gpu-tests")
    steps = {s["name"]: s for s in report["steps"]}
    assert list(steps) == ["install", "data", "gpu-tests", "float8-run"]
    assert steps["gpu-tests"]["status"] == "failed"
    assert "gpu-tests made to fail by --break" in steps["gpu-tests"]["tail"]
    assert steps["float8-run"]["status"] == "passed", steps["float8-run"]["tail"]
