"""Real plugin packages (pyproject + entry point) installed into a fresh venv, seen by `llmtrain plugins`."""

from __future__ import annotations

import json
import os
import shutil
import textwrap

import pytest
from support import ROOT, run

GOOD = """
import attrs
from llmtrain.core_mesh.plugins import hookimpl

@attrs.frozen
class MambaOptions:
    n_layers: int = 2

@hookimpl
def llmtrain_models(register):
    register("mamba", "builder", options=MambaOptions, help="a state-space model")
"""

BROKEN = """
import flash_attn_that_is_not_installed  # fails at import, as a real broken plugin would
"""

SQUATTER = """
from llmtrain.core_mesh.plugins import hookimpl

@hookimpl
def llmtrain_models(register):
    register("mamba", "other builder")
    register("rwkv", "rwkv builder")
"""


def make_plugin(base, dist, module, source):
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


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    if shutil.which("uv") is None:
        pytest.fail(
            "uv is needed to build the test venv (it is in the `integration` dependency group)"
        )
    base = tmp_path_factory.mktemp("plugins")
    plugins = [
        make_plugin(base, "llmtrain-mamba", "llmtrain_mamba", GOOD),
        make_plugin(base, "llmtrain-broken", "llmtrain_broken", BROKEN),
        make_plugin(base, "llmtrain-squatter", "llmtrain_squatter", SQUATTER),
    ]
    env_dir = base / "venv"
    run(["uv", "venv", "-q", str(env_dir)])
    python = env_dir / "bin" / "python"
    run(
        [
            "uv",
            "pip",
            "install",
            "-q",
            "--python",
            str(python),
            str(ROOT / "packages" / "core-mesh"),
            *map(str, plugins),
        ]
    )
    return env_dir


def plugins_json(venv, **env):
    full_env = {**os.environ, **env}
    out = run([str(venv / "bin" / "llmtrain"), "plugins", "--json"], env=full_env).stdout
    return json.loads(out)


def test_installed_plugin_is_listed_and_broken_ones_reported(venv):
    report = plugins_json(venv)
    entries = {(e["kind"], e["name"]): e for e in report["entries"]}
    mamba = entries[("model", "mamba")]
    assert (mamba["plugin"], mamba["package"], mamba["version"]) == (
        "llmtrain_mamba",
        "llmtrain-mamba",
        "1.2.3",
    )
    assert mamba["help"] == "a state-space model"
    assert entries[("model", "rwkv")]["package"] == "llmtrain-squatter"
    problems = {p["plugin"]: p for p in report["problems"]}
    assert set(problems) == {"llmtrain_broken", "llmtrain_squatter"}
    broken = problems["llmtrain_broken"]
    assert (broken["package"], broken["version"]) == ("llmtrain-broken", "1.2.3")
    assert (
        "ModuleNotFoundError" in broken["error"]
        and "flash_attn_that_is_not_installed" in broken["error"]
    )
    assert (
        "model 'mamba' is already registered by plugin 'llmtrain_mamba'"
        in problems["llmtrain_squatter"]["error"]
    )


def test_table_output_and_other_commands_survive(venv):
    table = run([str(venv / "bin" / "llmtrain"), "plugins"]).stdout
    rows = [line.split() for line in table.splitlines()]
    assert ["model", "mamba", "llmtrain_mamba", "llmtrain-mamba", "1.2.3"] in rows
    assert "broken (2):" in table
    check = run([str(venv / "bin" / "llmtrain"), "plugins", "--check"], check=False)
    assert check.returncode == 1
    version = run([str(venv / "bin" / "llmtrain"), "--version"])
    assert version.stdout.startswith("llmtrain ")


def test_disable_env_blocks_named_plugins(venv):
    report = plugins_json(venv, LLMTRAIN_DISABLE_PLUGINS="llmtrain_broken,llmtrain_mamba")
    names = {e["name"] for e in report["entries"]}
    assert "mamba" in names  # now registered by the squatter, whose entries no longer collide
    assert [e["package"] for e in report["entries"] if e["name"] == "mamba"] == [
        "llmtrain-squatter"
    ]
    assert report["problems"] == []
    assert report["blocked"] == ["llmtrain_broken", "llmtrain_mamba"]
