"""Shared test setup for train-loop's unit tests: one torch thread, and a fresh plugin manager with
the installed entry points (the built-in models, optimizers, schedules, loggers, commands)."""

from __future__ import annotations

import pytest
import torch
from shared_fixtures import run_cli  # noqa: F401

from llmtrain.core_mesh.plugins import PluginManager


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread():
    # the test modules are tiny: threads buy nothing on a small, busy machine
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def installed() -> PluginManager:
    """A fresh manager with every installed plugin (nothing blocked by the environment)."""
    pm = PluginManager(blocked=()).load_entry_points()
    assert pm.problems == [], pm.problems
    return pm
