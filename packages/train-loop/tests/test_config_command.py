"""`llmtrain config validate|show`: the run config checked end to end through the CLI."""

from __future__ import annotations

import attrs
import pytest
import yaml

from llmtrain.core_mesh.cli import main
from llmtrain.core_mesh.plugins import PluginManager, hookimpl


@attrs.frozen(kw_only=True)
class ToyModel:
    n_layers: int = 2
    d_model: int = 32


class Components:
    @hookimpl
    def llmtrain_models(self, register):
        register("toy", object(), options=ToyModel)


# line numbers matter: the error tests below name them
CONFIG = """\
name: smoke
model: {kind: toy, n_layers: 3}
data:
  train: [{path: train.zarr}]
  seq_len: 64
optimizer: {kind: sgd}
mesh: {tp: 2}
training: {steps: 5}
"""


@pytest.fixture
def plugins():
    pm = PluginManager(blocked=()).load_entry_points()
    pm.register(Components(), "components")
    assert pm.problems == []
    return pm


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(CONFIG)
    return path


def show(plugins, capsys, *argv) -> dict:
    assert main(["config", "show", *map(str, argv)], plugins=plugins) == 0
    return yaml.safe_load(capsys.readouterr().out)


def test_validate_ok(plugins, config, capsys):
    assert main(["config", "validate", str(config)], plugins=plugins) == 0
    out, err = capsys.readouterr()
    assert out == f"{config}: ok\n"
    assert err == ""


def test_show_fills_defaults_and_applies_overrides(plugins, config, capsys):
    shown = show(
        plugins,
        capsys,
        config,
        "model.d_model=64",
        "seed=7",
        "data.micro_batch=4",
        "optimizer.lr=0.5",
    )
    assert shown["name"] == "smoke"
    assert shown["seed"] == 7
    assert shown["run_dir"] == "runs"
    assert shown["device"] == "auto"
    assert shown["model"] == {"kind": "toy", "n_layers": 3, "d_model": 64}
    assert shown["optimizer"] == {
        "kind": "sgd",
        "lr": 0.5,
        "momentum": 0.9,
        "nesterov": False,
        "weight_decay": 0.0,
    }
    assert shown["lr_scheduler"] is None
    assert shown["mesh"] == {"dp_replicate": 1, "dp_shard": -1, "cp": 1, "tp": 2, "pp": 1, "ep": 1}
    assert shown["parallel"]["kind"] == "default"
    assert [logger["kind"] for logger in shown["loggers"]] == ["console", "jsonl"]

    data = shown["data"]
    assert data["train"] == [{"path": "train.zarr", "weight": 1.0, "name": None}]
    assert (data["seq_len"], data["micro_batch"]) == (64, 4)
    assert data["grad_accum"] is data["global_batch"] is data["global_batch_tokens"] is None
    assert data["eval"] is None
    assert (data["seed"], data["shuffle"]) == (None, True)

    training = shown["training"]
    assert (training["steps"], training["tokens"]) == (5, None)
    assert (training["log_every"], training["checkpoint_every"]) == (10, None)
    assert (training["max_grad_norm"], training["z_loss"]) == (1.0, 0.0)
    assert training["non_finite"] == {"action": "stop", "max_skips": 10}

    checkpoint = shown["checkpoint"]
    assert checkpoint["dir"] is None
    assert (checkpoint["keep_last"], checkpoint["async_save"], checkpoint["resume"]) == (
        3,
        False,
        "auto",
    )


def test_shown_config_reads_back_to_the_same_config(plugins, config, capsys, tmp_path):
    """The resolved config is a fixed point: components left to their defaults (`parallel`,
    `loggers`) are written with their options, like the ones the file names."""
    first = show(plugins, capsys, config, "model.d_model=64", "training.log_every=2")
    resolved = tmp_path / "resolved.yaml"
    resolved.write_text(yaml.safe_dump(first, sort_keys=False))
    assert show(plugins, capsys, resolved) == first


def test_errors_are_listed_together_without_traceback(plugins, config, capsys):
    config.write_text(
        CONFIG.replace("n_layers: 3", "n_layers: three, n_layer: 2")
        .replace("seq_len: 64", "seq_len: 0")
        .replace("steps: 5", "steps: 0")
    )
    assert main(["config", "validate", str(config), "optimizer.lr=fast"], plugins=plugins) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.startswith(f"error: {config}: 5 config problems:")
    assert f"{config}:2: model.n_layers: expected int, got str 'three'" in err
    assert f"{config}:2: model.n_layer: unknown key (did you mean 'n_layers'?)" in err
    assert f"{config}:5: data.seq_len: must be at least 1, got 0" in err
    assert "override 'optimizer.lr=fast': optimizer.lr: expected float, got str 'fast'" in err
    assert f"{config}:8: training.steps: must be at least 1, got 0" in err


def test_data_section_is_required(plugins, config, capsys):
    config.write_text(CONFIG.replace("data:\n  train: [{path: train.zarr}]\n  seq_len: 64\n", ""))
    assert main(["config", "validate", str(config)], plugins=plugins) == 2
    assert f"{config}: data: required key is missing" in capsys.readouterr().err


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
