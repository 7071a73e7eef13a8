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
RUNGS = [f"C={c},r={r}" for c in ("1.2e11", "4.8e11") for r in (2, 8, 32)]


def readme_commands() -> dict[str, list[str]]:
    """The laptop commands as the root README shows them, in order: the ladder's (quickstart,
    sweep, fit, report) and, after the block's comment line, the ablation's (sweep, compare,
    report)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("## From a sweep to a verdict") :]
    section = section[: section.index("\n## ", 1)]
    laptop = section[section.index("On a laptop") :]
    block = laptop[laptop.index("```bash\n") + 8 :]
    block = block[: block.index("```")]
    groups: dict[str, list[str]] = {"ladder": [], "ablation": []}
    group = "ladder"
    for line in block.splitlines():
        if line.startswith("#"):
            group = "ablation"
        elif line.strip():
            groups[group].append(line.split("#")[0].strip())
    return groups


def llmtrain(command: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """A README line (`llmtrain ...`, or `[ -d PATH ] || llmtrain ...`: only where PATH is not a
    directory) run in `cwd` with this environment's Python."""
    words = shlex.split(command)
    if words[:2] == ["[", "-d"]:
        assert words[3:5] == ["]", "||"], command
        if (cwd / words[2]).is_dir():
            return subprocess.CompletedProcess(words, 0, "", "")
        words = words[5:]
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
    for example in (ROOT / "examples").glob("*.yaml"):
        (work / "examples" / example.name).write_text(example.read_text(encoding="utf-8"))
    groups = readme_commands()
    names = {
        group: [c.split("llmtrain ", 1)[1].split()[0] for c in lines]
        for group, lines in groups.items()
    }
    assert names == {
        "ladder": ["quickstart", "sweep", "fit", "report"],
        "ablation": ["sweep", "compare", "report"],
    }
    seconds, outputs = {}, {}
    for group, lines in groups.items():
        outputs[group] = {}
        for command in lines:
            name = command.split("llmtrain ", 1)[1].split()[0]
            started = time.perf_counter()
            outputs[group][name] = llmtrain(command, work, timeout=600)
            seconds[f"{group} {name}"] = time.perf_counter() - started
    print(f"laptop commands took {', '.join(f'{k} {v:.0f} s' for k, v in seconds.items())}")
    return work, outputs
