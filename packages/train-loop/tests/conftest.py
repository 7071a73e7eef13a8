"""Shared test setup for train-loop's unit tests: one torch thread, and a fresh plugin manager with
the installed entry points (the built-in models, optimizers, schedules, loggers, commands)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from shared_fixtures import one_torch_thread, run_cli  # noqa: F401

from llmtrain.core_mesh.plugins import PluginManager


@pytest.fixture
def installed() -> PluginManager:
    """A fresh manager with every installed plugin (nothing blocked by the environment)."""
    pm = PluginManager(blocked=()).load_entry_points()
    assert pm.problems == [], pm.problems
    return pm


@pytest.fixture(scope="session")
def dataset(tmp_path_factory) -> Path:
    """A small packed dataset (60 generated documents, the bytes tokenizer), shared by the
    tests that train a few steps."""
    from llmtrain.data_pack.pack import pack
    from llmtrain.train_loop.experiments.quickstart import write_corpus

    root = tmp_path_factory.mktemp("data")
    write_corpus(root / "train.jsonl", 60, seed=0)
    pack([str(root / "train.jsonl")], str(root / "train.zarr"), {"kind": "bytes"}, workers=1)
    return root / "train.zarr"


@pytest.fixture
def tiny_run_config(dataset: Path, tmp_path: Path) -> Callable[..., Path]:
    """write(**sections) -> the path of a run config `r` of a tiny model on `dataset`, on CPU, in
    tmp_path/runs, 4 steps logged at each; a section given as a mapping updates the default
    one, anything else replaces it."""

    def write(**sections: Any) -> Path:
        config: dict[str, Any] = {
            "name": "r",
            "run_dir": str(tmp_path / "runs"),
            "device": "cpu",
            "model": {"kind": "tiny", "max_seq_len": 32, "d_model": 16, "n_layers": 1},
            "data": {"train": [{"path": str(dataset)}], "seq_len": 32, "micro_batch": 4},
            "optimizer": {"kind": "adamw", "lr": 1e-3},
            "loggers": [{"kind": "jsonl"}],
            "training": {"steps": 4, "log_every": 1},
        }
        for key, value in sections.items():
            given = config.get(key)
            config[key] = {**given, **value} if isinstance(given, dict) else value
        path = tmp_path / "run.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        return path

    return write
