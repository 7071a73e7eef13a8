"""Shared test setup for train-loop's unit tests: one torch thread, and a fresh plugin manager with
the installed entry points (the built-in models, optimizers, schedules, loggers, commands)."""

from __future__ import annotations

import pytest
from shared_fixtures import one_torch_thread, run_cli  # noqa: F401

from llmtrain.core_mesh.plugins import PluginManager


@pytest.fixture
def installed() -> PluginManager:
    """A fresh manager with every installed plugin (nothing blocked by the environment)."""
    pm = PluginManager(blocked=()).load_entry_points()
    assert pm.problems == [], pm.problems
    return pm
