"""Every program outside Python that a test runs is installed by the nox session that runs the
test (noxfile.py's SYSTEM_PROGRAMS), so each session passes alone on a new machine, whatever ran
before it. The tests' sources are read with `ast`: `shutil.which("NAME")`, and subprocess calls
whose command list starts with a literal program name."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from support import ROOT, noxfile_constant

# on every machine that can clone the repository and run nox: git and a Debian base system's
# shell and mount; uv comes with the test dependencies, python and llmtrain with the session's
ANYWHERE = {"git", "bash", "sh", "mount", "umount", "uv", "python", "llmtrain", "rm"}
SUBPROCESS = {"run", "Popen", "check_call", "check_output", "call"}


def programs_run(source: str) -> set[str]:
    """The programs a Python source looks up with shutil.which or starts with subprocess."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        owner = getattr(node.func.value, "id", None)
        first = node.args[0] if node.args else None
        if owner == "shutil" and node.func.attr == "which":
            pass
        elif owner == "subprocess" and node.func.attr in SUBPROCESS:
            first = first.elts[0] if isinstance(first, ast.List) and first.elts else None
        else:
            continue
        if isinstance(first, ast.Constant) and isinstance(first.value, str):
            found.add(first.value)
    return found


def session_of(test_file: Path) -> str:
    """The nox session that runs a test file: the package's, `plugin-NAME`, `slurm` (the job
    script's tests in packages/train-loop/tests_slurm), `gpu-kit` (tools/gpu/tests) or
    integration."""
    parts = test_file.relative_to(ROOT).parts
    if parts[0] == "packages" and parts[2] == "tests_slurm":
        return "slurm"
    if parts[:3] == ("tools", "gpu", "tests"):
        return "gpu-kit"
    if parts[0] == "packages":
        return parts[1]
    if parts[0] == "plugins":
        return "plugin-" + parts[1].removeprefix("llmtrain-")
    return "integration"


def sources_of_tests() -> list[Path]:
    roots = [
        *ROOT.glob("packages/*/tests"),
        *ROOT.glob("packages/*/tests_slurm"),
        *ROOT.glob("plugins/*/tests"),
        ROOT / "integration_tests",
        ROOT / "tools" / "gpu" / "tests",
    ]
    return sorted(path for root in roots for path in root.rglob("*.py"))


def test_every_program_a_test_runs_is_installed_by_its_session():
    installs = noxfile_constant("SYSTEM_PROGRAMS")
    missing = {
        f"{path.relative_to(ROOT)} ({session_of(path)}): {program}"
        for path in sources_of_tests()
        for program in programs_run(path.read_text(encoding="utf-8")) - ANYWHERE
        if program not in installs.get(session_of(path), {})
    }
    assert not missing, "add these to noxfile.py's SYSTEM_PROGRAMS: " + "; ".join(sorted(missing))


def test_the_browser_tests_are_found_and_their_sessions_install_chromium():
    """What the rule above checks is really read: the two browser tests' sessions."""
    by_session = {}
    for path in sources_of_tests():
        for program in programs_run(path.read_text(encoding="utf-8")):
            by_session.setdefault(session_of(path), set()).add(program)
    assert "chromium" in by_session["ablate"] and "chromium" in by_session["integration"]
    assert noxfile_constant("SYSTEM_PROGRAMS")["ablate"] == {"chromium": "chromium"}


def test_the_slurm_tests_are_found_and_their_session_installs_slurm():
    """The job script's tests run Slurm's daemons and commands: the `slurm` session's."""
    found = set()
    for path in sources_of_tests():
        if session_of(path) == "slurm":
            found |= programs_run(path.read_text(encoding="utf-8"))
    assert {"munged", "slurmctld", "slurmd", "sbatch", "scancel", "scontrol", "squeue"} <= found
    assert found - ANYWHERE <= set(noxfile_constant("SYSTEM_PROGRAMS")["slurm"])


# sources with a made-up program NAME filled in, so that this file itself starts no program
# (the rule above reads this file too)
FORMS = [
    ("import shutil\nshutil.which({name!r})", True),
    ("import subprocess\nsubprocess.run([{name!r}, 'new'], check=True)", True),
    ("import subprocess\nsubprocess.Popen([{name!r}, ':1'])", True),
    ("import subprocess, sys\nsubprocess.run([sys.executable, '-c', {name!r}])", False),
    ("import subprocess\nsubprocess.run(command, {name!r})", False),
]


@pytest.mark.parametrize(("form", "found"), FORMS)
def test_the_reader_finds_programs_in_every_form(form, found):
    source = form.format(name="made-up-viewer")
    assert programs_run(source) == ({"made-up-viewer"} if found else set())
