"""Shared test setup for train-loop's unit tests: one torch thread, and a fresh plugin manager with
the installed entry points (the built-in models, optimizers, schedules, loggers, commands)."""

from __future__ import annotations

from pathlib import Path

import pytest
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
