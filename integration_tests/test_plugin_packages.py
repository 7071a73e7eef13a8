"""Real plugin packages (pyproject + entry point) installed into a fresh venv, seen by `llmtrain plugins`."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from support import ROOT, make_plugin, run

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


# --- the real plugins in plugins/: found through their entry points, and only through them ---
def real_plugins() -> list[tuple[str, str]]:
    """(distribution, entry point name) of every package in plugins/."""
    import tomllib

    found = []
    for pyproject in sorted((ROOT / "plugins").glob("*/pyproject.toml")):
        meta = tomllib.loads(pyproject.read_text())["project"]
        for entry in meta["entry-points"]["llmtrain"]:
            found.append((meta["name"], entry))
    return found


@pytest.fixture(scope="module")
def plugin_venv(tmp_path_factory):
    """A light venv: core-mesh with its dependencies, then the other llmtrain packages and
    every plugin without theirs (registering must not import torch or the plugins' libraries)."""
    env_dir = tmp_path_factory.mktemp("real-plugins") / "venv"
    run(["uv", "venv", "-q", str(env_dir)])
    python = str(env_dir / "bin" / "python")
    run(["uv", "pip", "install", "-q", "--python", python, str(ROOT / "packages" / "core-mesh")])
    others = [p.parent for p in sorted((ROOT / "packages").glob("*/pyproject.toml"))]
    plugins = [p.parent for p in sorted((ROOT / "plugins").glob("*/pyproject.toml"))]
    paths = [str(p) for p in [*others, *plugins] if p.name != "core-mesh"]
    run(["uv", "pip", "install", "-q", "--no-deps", "--python", python, *paths])
    return env_dir


def test_every_real_plugin_is_found_only_through_its_entry_point(plugin_venv):
    expected = real_plugins()
    assert {dist for dist, _ in expected} >= {
        "llmtrain-tensorboard",
        "llmtrain-wandb",
        "llmtrain-hf",
        "llmtrain-moe",
    }
    report = plugins_json(plugin_venv)
    by_package: dict[str, set] = {}
    for entry in report["entries"]:
        by_package.setdefault(entry["package"], set()).add((entry["plugin"], entry["kind"]))
    for dist, name in expected:
        assert dist in by_package, f"{dist} registered nothing: {report['problems']}"
        assert {plugin for plugin, _ in by_package[dist]} == {name}
    assert not [p for p in report["problems"] if p["package"] in dict(expected)]

    python = str(plugin_venv / "bin" / "python")
    for dist, name in expected:  # uninstalled: gone, and nothing else is disturbed
        run(["uv", "pip", "uninstall", "-q", "--python", python, dist])
        after = plugins_json(plugin_venv)
        assert dist not in {e["package"] for e in after["entries"]}
        assert name not in {e["plugin"] for e in after["entries"]}
        gone = {e["package"] for e in report["entries"]} - {e["package"] for e in after["entries"]}
        assert gone == {dist}, gone
        report = after
