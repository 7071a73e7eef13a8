"""The README's "From a sweep to a verdict" laptop commands, run once per test session as
printed (`laptop`, a session fixture): test_laptop_ladder.py checks what they trained and wrote,
test_verdict.py the report in a real browser. The quickstart's data (`llmtrain quickstart
--steps 10`), then `llmtrain sweep examples/ladder-laptop.yaml --ladder --preset laptop` (six
rungs, one after another), `llmtrain fit` and `llmtrain report`, from a directory that holds
examples/ and quickstart/ as the repository root would: about a minute and a half on 2 cores."""

from __future__ import annotations

import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

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


@pytest.fixture(scope="session")
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
