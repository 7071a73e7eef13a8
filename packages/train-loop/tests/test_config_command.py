"""`llmtrain config validate|show`: the run config checked end to end through the CLI."""

from __future__ import annotations

import attrs
import pytest
import yaml

from llmtrain.core_mesh.cli import main
from llmtrain.core_mesh.plugins import PluginManager, hookimpl


@attrs.frozen(kw_only=True)
class TinyModel:
    n_layers: int = 2
    d_model: int = 32


@attrs.frozen(kw_only=True)
class Sgd:
    lr: float = 0.1


class Components:
    @hookimpl
    def llmtrain_models(self, register):
        register("toy", object(), options=TinyModel)

    @hookimpl
    def llmtrain_optimizers(self, register):
        register("sgd", object(), options=Sgd)

    @hookimpl
    def llmtrain_loggers(self, register):
        register("jsonl", object())


CONFIG = """\
name: smoke
model: {kind: toy, n_layers: 3}
optimizer: {kind: sgd}
loggers: [{kind: jsonl}]
mesh: {tp: 2}
training: {steps: 5}
"""


@pytest.fixture
def plugins():
    pm = PluginManager(blocked=()).load_entry_points()
    pm.register(Components(), "components")
    return pm


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(CONFIG)
    return path


def test_validate_ok(plugins, config, capsys):
    assert main(["config", "validate", str(config)], plugins=plugins) == 0
    assert capsys.readouterr().out == f"{config}: ok\n"


def test_show_fills_defaults_and_applies_overrides(plugins, config, capsys):
    assert main(["config", "show", str(config), "model.d_model=64", "seed=7"], plugins=plugins) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["model"] == {"kind": "toy", "n_layers": 3, "d_model": 64}
    assert shown["seed"] == 7
    assert shown["mesh"] == {"dp_replicate": 1, "dp_shard": -1, "cp": 1, "tp": 2, "pp": 1}
    assert shown["training"] == {"steps": 5, "log_every": 10}


def test_errors_are_listed_together_without_traceback(plugins, config, capsys):
    config.write_text(
        CONFIG.replace("n_layers: 3", "n_layers: three, n_layer: 2").replace("steps: 5", "steps: 0")
    )
    assert main(["config", "validate", str(config), "optimizer.lr=fast"], plugins=plugins) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.startswith(f"error: {config}: 4 config problems:")
    assert f"{config}:2: model.n_layers: expected int, got str 'three'" in err
    assert f"{config}:2: model.n_layer: unknown key (did you mean 'n_layers'?)" in err
    assert "override 'optimizer.lr=fast': optimizer.lr: expected float, got str 'fast'" in err
    assert f"{config}:6: training.steps: must be at least 1, got 0" in err


def test_unknown_kind(plugins, config, capsys):
    config.write_text(CONFIG.replace("kind: toy", "kind: mamba"))
    assert main(["config", "validate", str(config)], plugins=plugins) == 2
    err = capsys.readouterr().err
    assert "model.kind: unknown model 'mamba'; known: " in err
    assert "toy" in err.split("known: ")[1].split(", ")


def test_mesh_checked_against_world_size(plugins, config, capsys):
    assert main(["config", "validate", str(config), "--world-size", "8"], plugins=plugins) == 0
    capsys.readouterr()
    assert (
        main(
            ["config", "validate", str(config), "--world-size", "3", "mesh.dp_shard=2"],
            plugins=plugins,
        )
        == 2
    )
    err = capsys.readouterr().err
    assert (
        "mesh: mesh pp=1 x dp_replicate=1 x dp_shard=2 x cp=1 x tp=2 multiplies to 4 processes, but the world has 3"
        in err
    )


def test_missing_file(plugins, tmp_path, capsys):
    assert main(["config", "validate", str(tmp_path / "absent.yaml")], plugins=plugins) == 2
    assert "cannot read the config file: No such file or directory" in capsys.readouterr().err
