"""Helpers shared by the integration tests: the repo root, the package list, and running commands
with checks."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def noxfile_constant(name: str):
    """The literal noxfile.py assigns to `name` (read with `ast`, since nox is not installed
    where the tests run)."""
    tree = ast.parse((ROOT / "noxfile.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == [
            name
        ]:
            return ast.literal_eval(node.value)
    raise AssertionError(f"noxfile.py assigns no {name}")


def noxfile_packages() -> list[str]:
    """The packages under packages/, as noxfile.py's PACKAGES lists them (the one list)."""
    return list(noxfile_constant("PACKAGES"))


PACKAGES = noxfile_packages()


def run(cmd, *, env=None, cwd=None, timeout=300, check=True):
    """Run a command; on failure show its output in the assertion message."""
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(map(str, cmd))} exited {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
        )
    return proc


def torchrun(script, *args, nproc, env=None, timeout=300, check=True):
    """Run a script under torchrun on this machine (gloo on CPU), with a free rendezvous port."""
    return run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            str(script),
            *map(str, args),
        ],
        env=env,
        timeout=timeout,
        check=check,
    )


def make_plugin(base: Path, dist: str, module: str, source: str) -> Path:
    """A plugin package `dist` in `base`: one module, `source`, declared as the `llmtrain` entry
    point of the same name; `pip install` it to use it."""
    pkg = base / dist
    (pkg / "src").mkdir(parents=True)
    (pkg / "src" / f"{module}.py").write_text(textwrap.dedent(source))
    (pkg / "pyproject.toml").write_text(
        textwrap.dedent(f'''
        [build-system]
        requires = ["hatchling"]
        build-backend = "hatchling.build"

        [project]
        name = "{dist}"
        version = "1.2.3"
        dependencies = ["llmtrain-core-mesh"]

        [project.entry-points.llmtrain]
        {module} = "{module}"

        [tool.hatch.build.targets.wheel]
        packages = ["src/{module}.py"]
    ''')
    )
    return pkg
