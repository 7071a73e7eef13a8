"""The newcomer's path of the root README: `llmtrain quickstart` does the whole job, then every
next step it prints runs as printed, in a shell where `llmtrain` is not on the PATH until the
printed PATH line puts it there (as after `nox -s quickstart`), exits 0 and does what it says.
One quickstart run (a real `python -m llmtrain` subprocess) serves every test here. Then what a
newcomer meets next (issue 51): a second quickstart refuses to replace the longer run; in a venv
made as the quickstart's (uv, pip), a missing command's install hint runs as printed from the
checkout, and the root README's plugin example installs with the README's commands."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
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


def test_the_quickstart_refuses_to_replace_a_longer_run(quickstart):
    """`llmtrain quickstart --steps 10` (the README's laptop block, once) must not replace the
    quickstart's longer run: one line naming the run, its steps and --overwrite, exit 2, and
    nothing in the directory changed."""
    run_dir, work = quickstart.run_dir, quickstart.work
    trained = ts.committed_steps(run_dir / "checkpoints")[-1]  # STEPS, or 2 * STEPS once extended
    config_before = (work / "run.yaml").read_text()
    proc = ts.run(ts.llmtrain("quickstart", "--dir", work, "--steps", 10), check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == (
        f"error: {run_dir} holds a quickstart run that trained {trained} steps, more than "
        "--steps 10; not replacing it: pass --overwrite to replace it, or use another --dir\n"
    )
    assert ts.committed_steps(run_dir / "checkpoints")[-1] == trained
    assert (work / "run.yaml").read_text() == config_before


ROOT = Path(__file__).resolve().parents[1]


def readme_plugin_example() -> tuple[str, str, list[str]]:
    """The root README's "Writing a plugin": its pyproject, its plugin module and the lines of
    the install block (`source ...activate`, `pip install ./llmtrain-mamba`, `llmtrain
    plugins`), comments dropped."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("## Writing a plugin") :]

    def block(fence: str, after: str = "") -> str:
        start = section.index(fence, section.index(after) if after else 0) + len(fence)
        return section[start : section.index("```", start)]

    install = [
        line.split("#")[0].strip()
        for line in block("```bash\n", "Install it into").splitlines()
        if line.split("#")[0].strip()
    ]
    return block("```toml\n"), block("```python\n"), install


def quickstart_venv_installs() -> list[str]:
    """What the nox session `quickstart` installs besides the checkout's packages, read from
    noxfile.py's install_for_users (pip, since uv makes venvs without it)."""
    source = (ROOT / "noxfile.py").read_text(encoding="utf-8")
    function = source[source.index("def install_for_users") :]
    function = function[: function.index("\n\n\n")]
    install = function[function.index("session.install(") :]
    return [word.strip('"') for word in install.replace(",", " ").split() if word[0] == '"']


@pytest.fixture(scope="module")
def user_venv(tmp_path_factory):
    """A venv made as `nox -s quickstart` makes its own (uv, then pip and the checkout's
    packages installed from their paths; here only core-mesh, a CPU box's start, so a missing
    command's install hint has something to install)."""
    assert quickstart_venv_installs() == ["pip"], "the quickstart venv must have pip (issue 51)"
    env = tmp_path_factory.mktemp("user-venv") / "venv"
    subprocess.run(["uv", "venv", "-q", "--python", sys.executable, str(env)], check=True)
    subprocess.run(
        [
            *("uv", "pip", "install", "-q", "--python", str(env / "bin" / "python")),
            *quickstart_venv_installs(),
            str(ROOT / "packages" / "core-mesh"),
        ],
        check=True,
        timeout=600,
    )
    return env


def test_a_missing_commands_install_hint_works_from_the_checkout(user_venv):
    """Only core-mesh installed: `llmtrain data` names the command that installs data-pack from
    this checkout (no package index has it), and that command, run as printed from the
    checkout's root in the activated venv, makes `llmtrain data` work."""
    env = shell_without_llmtrain()
    activate = f"source {user_venv / 'bin' / 'activate'}"
    proc = subprocess.run(
        ["bash", "-c", f"{activate}\nllmtrain data pack corpus.jsonl -o corpus.zarr"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )
    assert proc.returncode == 2, proc
    prefix = "error: `data` is provided by llmtrain-data-pack: "
    assert proc.stderr.startswith(prefix) and proc.stderr.count("\n") == 1, proc.stderr
    hint = proc.stderr[len(prefix) :].strip()
    assert hint == "pip install ./packages/data-pack", hint  # the venv's own pip, a path
    done = subprocess.run(
        ["bash", "-c", f"{activate}\n{hint} -q\nllmtrain data --help"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "pack" in done.stdout


def test_a_plugin_installs_into_the_quickstart_venv_as_the_readme_says(user_venv, tmp_path):
    """The root README's plugin example, written out as it is printed, installed with its
    commands (`source .../activate`, `pip install ./llmtrain-mamba`, `llmtrain plugins`) into
    a venv made as the quickstart's: its dependency llmtrain-core-mesh resolves to what is
    installed. torch, which the example declares, comes from this environment (a .pth file:
    the quickstart venv has it), added here, after the install-hint test used the venv."""
    pyproject, module, install = readme_plugin_example()
    assert [line.split()[0] for line in install] == ["source", "pip", "llmtrain"], install
    assert install[0] == "source .nox/quickstart/bin/activate", install
    assert install[1] == "pip install ./llmtrain-mamba", install
    package = tmp_path / "llmtrain-mamba"
    (package / "llmtrain_mamba").mkdir(parents=True)
    (package / "pyproject.toml").write_text(pyproject)
    (package / "llmtrain_mamba" / "__init__.py").write_text("")
    (package / "llmtrain_mamba" / "plugin.py").write_text(module)
    python = user_venv / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    ours = sysconfig.get_paths()["purelib"]
    Path(site, "zz-llmtrain-test-parent.pth").write_text(
        f"import site; site.addsitedir({ours!r})\n"
    )
    commands = [f"source {user_venv / 'bin' / 'activate'}", *install[1:]]
    done = subprocess.run(
        ["bash", "-c", "set -e\n" + "\n".join(commands)],
        capture_output=True,
        text=True,
        env=shell_without_llmtrain(),
        cwd=tmp_path,
        timeout=600,
    )
    assert done.returncode == 0, f"{done.stdout[-2000:]}\n--- stderr\n{done.stderr[-4000:]}"
    assert [row.split() for row in done.stdout.splitlines() if " mamba " in f" {row} "] == [
        ["model", "mamba", "mamba", "llmtrain-mamba", "0.1.0"]
    ], done.stdout
