"""The README's "From a sweep to a verdict" on a laptop, command for command: the quickstart's
data (`llmtrain quickstart --steps 10`), then `llmtrain sweep examples/ladder-laptop.yaml --ladder
--preset laptop` trains its six rungs here, one after another, `llmtrain fit` fits them (with two
IsoFLOP profiles) and `llmtrain report` writes the page. Each command runs as printed, from a
directory that holds quickstart/ as the repository root would. About a minute and a half on two
CPU cores, most of it the six runs.

test_verdict.py checks the report in a browser; this test checks that the documented commands
work as documented."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "ladder-laptop.yaml"
RUNGS = [f"C={c},r={r}" for c in ("1.2e11", "4.8e11") for r in (2, 8, 32)]


def readme_commands() -> list[str]:
    """The laptop commands as the root README shows them, in order."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("## From a sweep to a verdict") :]
    section = section[: section.index("\n## ", 1)]
    laptop = section[section.index("On a laptop") :]
    block = laptop[laptop.index("```bash\n") + 8 :]
    block = block[: block.index("```")]
    return [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]


def llmtrain(command: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """A README line (`llmtrain ...`) run in `cwd` with this environment's Python."""
    words = shlex.split(command)
    assert words[0] == "llmtrain", command
    proc = subprocess.run(
        [sys.executable, "-m", "llmtrain", *words[1:]],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, (
        f"{command} exited {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n"
        f"--- stderr\n{proc.stderr[-6000:]}"
    )
    return proc


@pytest.fixture(scope="module")
def laptop(tmp_path_factory):
    """The README's laptop commands, run in a fresh directory with the example config in it."""
    work = tmp_path_factory.mktemp("laptop")
    (work / "examples").mkdir()
    (work / "examples" / EXAMPLE.name).write_text(EXAMPLE.read_text(encoding="utf-8"))
    commands = readme_commands()
    assert [shlex.split(c)[1] for c in commands] == ["quickstart", "sweep", "fit", "report"]
    seconds, outputs = {}, {}
    for command in commands:
        started = time.perf_counter()
        outputs[shlex.split(command)[1]] = llmtrain(command, work, timeout=600)
        seconds[shlex.split(command)[1]] = time.perf_counter() - started
    print(f"laptop commands took {', '.join(f'{k} {v:.0f} s' for k, v in seconds.items())}")
    return work, outputs


def test_the_sweep_trains_the_six_rungs_it_planned(laptop):
    work, outputs = laptop
    sweep = work / "sweeps" / "laptop"
    manifest = json.loads((sweep / "manifest.json").read_text())
    assert [run["id"] for run in manifest["runs"]] == RUNGS
    assert "--preset laptop" in manifest["command"]
    planned = {f"C={row['label']['C']},r={row['label']['r']}": row for row in manifest["ladder"]}
    for rung in RUNGS:
        summary = json.loads((sweep / rung / "summary.json").read_text())
        assert summary["status"] == "finished", rung
        assert summary["non_embedding_params"] == planned[rung]["params"], rung
        assert summary["tokens"] == planned[rung]["tokens"], rung
    # the table on stderr, then every run finished
    err = outputs["sweep"].stderr
    assert all(rung in err for rung in RUNGS)
    assert "sweep laptop: all 6 runs finished" in err


def test_fit_and_report_are_written(laptop):
    work, outputs = laptop
    assert "alpha" in outputs["fit"].stdout and "IsoFLOP" in outputs["fit"].stdout
    fit = json.loads((work / "fit.json").read_text())
    assert sorted(run["name"] for run in fit["runs"]) == sorted(RUNGS)
    # each budget's three rungs cost the same FLOPs as the fit counts them: two IsoFLOP profiles
    budgets = fit["isoflop"]["budgets"]
    assert [sorted(b["runs"]) for b in budgets] == [sorted(RUNGS[:3]), sorted(RUNGS[3:])]
    assert [b["rejected"] for b in budgets] == [None, None]
    assert (work / "fit.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = (work / "report.html").read_text(encoding="utf-8")
    assert page.lstrip().lower().startswith("<!doctype html")
    assert all(rung in page for rung in RUNGS)
