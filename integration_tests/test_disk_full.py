"""A full disk under a run: real `llmtrain run` processes writing to a real tmpfs that fills up.
The run ends with one line naming the file and "no space left", its summary.json is written
when the space allows, nothing unfinished looks complete, and once space is freed the run
resumes from its newest checkpoint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import train_support as ts
from shared_fixtures import resize, small_disk  # noqa: F401


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return ts.pack_corpus(tmp_path_factory.mktemp("data"))


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def _assert_one_clear_error(stderr: str, path_part: str) -> str:
    assert "this is a bug" not in stderr and "Traceback" not in stderr, stderr[-3000:]
    assert "Logging error" not in stderr, stderr[-3000:]
    [line] = _error_lines(stderr)
    assert "no space left on device" in line and path_part in line, line
    return line


def test_a_checkpoint_that_fills_the_disk_ends_the_run_cleanly_and_resumes(
    data,
    tmp_path,
    small_disk,  # noqa: F811
):
    disk = small_disk("2m")  # the tiny model's checkpoints take ~0.5 MB each
    config = ts.run_config(data, disk / "runs")
    config["training"].update(steps=30, checkpoint_every=5)
    config["data"].pop("eval")
    config["checkpoint"]["keep_last"] = 100
    path = ts.write_config(tmp_path / "run.yaml", config)
    run_dir = disk / "runs" / "run"

    done = ts.run(ts.llmtrain("run", path), timeout=600, check=False)
    assert done.returncode == 2, done.stderr[-3000:]
    line = _assert_one_clear_error(done.stderr, str(run_dir / "checkpoints" / "step-"))
    assert "earlier committed checkpoints are untouched" in line

    committed = ts.committed_steps(run_dir / "checkpoints")
    assert committed and committed[-1] < 30
    # the unfinished step is gone, so nothing half-written looks like a checkpoint
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        f"step-{s}" for s in sorted(committed, key=str)
    ]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed"
    assert summary["step"] == committed[-1] + 5
    assert "no space left on device" in summary["error"]
    assert not list(run_dir.glob("*.tmp"))

    resize(disk, "64m")
    again = ts.run(ts.llmtrain("run", path), timeout=600)
    assert "run: 30 steps" in again.stderr
    resumed = [
        json.loads(line)["step"]
        for line in (run_dir / "logs" / "rank0.jsonl").open()
        if '"run.resumed"' in line
    ]
    assert resumed == [committed[-1]]
    assert [m["step"] for m in ts.read_metrics(run_dir)] == list(range(1, 31))
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "finished"


def _fill(disk: Path) -> None:
    """Take every free byte of `disk`."""
    with open(disk / "filler", "wb") as f:
        block = b"\0" * (1 << 16)
        try:
            while True:
                f.write(block)
                f.flush()
        except OSError:
            pass


def test_a_disk_full_from_the_start_is_one_line_naming_the_file(data, tmp_path, small_disk):  # noqa: F811
    disk = small_disk("1m")
    (disk / "runs").mkdir()
    _fill(disk)
    config = ts.run_config(data, disk / "runs")
    path = ts.write_config(tmp_path / "run.yaml", config)

    done = ts.run(ts.llmtrain("run", path), timeout=600, check=False)
    assert done.returncode == 2, done.stderr[-3000:]
    _assert_one_clear_error(done.stderr, str(disk / "runs" / "run"))


def test_a_disk_the_run_fills_with_its_metrics_still_gets_its_summary(data, tmp_path, small_disk):  # noqa: F811
    """The disk fills while the run trains (its metrics and logs grow): one error line naming
    the file, at most one warning about the full disk before it, no traceback, and summary.json
    says how the run ended (its space was taken when the run started)."""
    disk = small_disk("1m")
    runs = disk / "runs"
    runs.mkdir()
    with open(disk / "filler", "wb") as f:  # all but 48 KiB: the setup fits, the steps do not
        f.write(b"\0" * (shutil.disk_usage(disk).free - (48 << 10)))
    config = ts.run_config(data, runs)
    config["training"].update(steps=100_000, checkpoint_every=None)
    config["data"].pop("eval")
    path = ts.write_config(tmp_path / "run.yaml", config)
    run_dir = runs / "run"

    done = ts.run(ts.llmtrain("run", path), timeout=1200, check=False)
    assert done.returncode == 2, done.stderr[-3000:]
    line = _assert_one_clear_error(done.stderr, str(run_dir))
    about_the_disk = [
        text
        for text in done.stderr.splitlines()
        if "no space left" in text.lower() and text != line
    ]
    assert len(about_the_disk) <= 1 and all("warning" in t for t in about_the_disk), about_the_disk
    assert "callback.failed" not in done.stderr and "close_failed" not in done.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed", summary
    assert "No space left on device" in summary["error"], summary
    assert 0 < summary["step"] < 100_000
    assert not list(run_dir.glob("*.tmp"))
    assert not (run_dir / "checkpoints").exists() or not list(run_dir.rglob("COMMITTED"))
