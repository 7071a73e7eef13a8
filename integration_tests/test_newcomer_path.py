"""The newcomer's path of the root README: `llmtrain quickstart` does the whole job, then every
next step it prints runs as printed, in a shell where `llmtrain` is not on the PATH until the
printed PATH line puts it there (as after `nox -s quickstart`), exits 0 and does what it says.
One quickstart run (a real `python -m llmtrain` subprocess) serves every test here."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sysconfig
from pathlib import Path
from types import SimpleNamespace

import pytest
import train_support as ts

STEPS = 30
LR, MIN_RATIO = 3.0e-3, 0.1  # the quickstart's run config


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory):
    work = tmp_path_factory.mktemp("newcomer") / "qs"
    proc = ts.run(ts.llmtrain("quickstart", "--dir", work, "--steps", STEPS), timeout=600)
    return SimpleNamespace(work=work, proc=proc, run_dir=work / "runs" / "quickstart")


def test_quickstart_does_the_whole_job(quickstart):
    proc, work, run_dir = quickstart.proc, quickstart.work, quickstart.run_dir
    assert "Traceback" not in proc.stderr
    assert "[quickstart] 6/6 sample: 'The cat'" in proc.stderr
    metrics = ts.read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [10, 20, 30]  # log_every 10
    assert metrics[-1]["loss"] < metrics[0]["loss"]
    assert ts.committed_steps(run_dir / "checkpoints") == [15, 30]
    assert (work / "tokenizer.json").exists() and (run_dir / "config.yaml").exists()
    samples = [line for line in proc.stdout.splitlines() if line.startswith("The cat")]
    assert len(samples) == 1 and len(samples[0]) > len("The cat")
    # stdout is the sample and nothing else (progress and next steps go to stderr)
    assert proc.stdout.startswith("The cat"), proc.stdout


def next_steps(stderr: str) -> tuple[str, list[str]]:
    """The header line and the commands printed under it (indented by two spaces)."""
    lines = stderr.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("[quickstart] next steps"))
    steps = []
    for line in lines[start + 1 :]:
        if not line.startswith("  "):
            break
        steps.append(line[2:])
    return lines[start], steps


def shell_without_llmtrain() -> dict[str, str]:
    """This environment without its scripts directory on the PATH (nor VIRTUAL_ENV): a user's
    shell after `nox -s quickstart`, where nothing activated the session's environment."""
    scripts = Path(sysconfig.get_path("scripts")).resolve()
    path = [p for p in os.environ["PATH"].split(os.pathsep) if p and Path(p).resolve() != scripts]
    env = {**os.environ, "PATH": os.pathsep.join(path)}
    env.pop("VIRTUAL_ENV", None)
    return env


def in_a_shell(script: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-c", script], capture_output=True, text=True, env=env, timeout=600
    )


def test_every_printed_next_step_runs_as_printed_and_does_what_it_says(quickstart):
    header, steps = next_steps(quickstart.proc.stderr)
    scripts = Path(sysconfig.get_path("scripts"))
    # the integration tests run in a virtual environment (nox's), so the first line is the one
    # that puts its llmtrain on the PATH, and the header says where llmtrain is
    assert f"llmtrain is in {scripts}" in header, header
    path_line, *commands = steps
    assert path_line == f"source {scripts / 'activate'}", steps
    env = shell_without_llmtrain()
    if shutil.which("llmtrain", path=env["PATH"]) is None:
        assert in_a_shell("command -v llmtrain", env).returncode != 0
    found = in_a_shell(f"{path_line}\ncommand -v llmtrain", env)
    assert found.stdout.strip() == str(scripts / "llmtrain"), found

    checkpoints = quickstart.run_dir / "checkpoints"
    by_command = {command.split()[1]: command for command in commands}
    assert sorted(by_command) == ["eval", "generate", "run"], commands  # each one checked below
    ran = {}
    for name, command in by_command.items():
        done = in_a_shell(f"{path_line}\n{command}", env)
        assert done.returncode == 0, f"{command}\n--- stderr\n{done.stderr[-4000:]}"
        assert "Traceback" not in done.stderr and "deprecated" not in done.stderr, done.stderr
        ran[name] = done

    # sample: the checkpoint positional, text that goes on from the prompt
    assert by_command["generate"].startswith(f"llmtrain generate {checkpoints} --prompt 'A dog'")
    sample = ran["generate"].stdout
    assert sample.startswith("A dog") and len(sample.strip()) > len("A dog"), sample

    # evaluate: the loss on the held-out data
    assert by_command["eval"].startswith(f"llmtrain eval {checkpoints} --data ")
    result = json.loads(ran["eval"].stdout)
    assert result["step"] == STEPS and 0 < result["loss"] < math.log(360), result

    # train longer: STEPS more steps at the schedule's final lr, as the comment says, and the
    # log says the trained schedule was kept (no silent jump back up)
    final = f"{LR * MIN_RATIO:.2e}"
    assert by_command["run"].endswith(f"# {STEPS} more steps at the final lr, {final}")
    assert "training.on_extend=keep: going on with the trained schedule" in ran["run"].stderr
    metrics = ts.by_step(ts.read_metrics(quickstart.run_dir))
    assert sorted(metrics) == list(range(10, 2 * STEPS + 1, 10))
    for step in range(STEPS + 10, 2 * STEPS + 1, 10):
        assert metrics[step]["lr"] == pytest.approx(LR * MIN_RATIO, rel=1e-9), step
    assert ts.committed_steps(checkpoints)[-1] == 2 * STEPS
