"""The `parallel` plugin: registers the `default` strategy with its options class, builds a
DefaultStrategy (a core-mesh `ParallelStrategy` whose models are `ParallelModel`s), and loads
without torch."""

from __future__ import annotations

import subprocess
import sys

import attrs
import importlib_metadata
import pytest

import llmtrain.parallel.plugin as plugin
from llmtrain.core_mesh.config import Choice, ConfigError, structure
from llmtrain.core_mesh.conformance import protocol_mismatches
from llmtrain.core_mesh.interfaces import ParallelModel, ParallelStrategy
from llmtrain.core_mesh.plugins import KINDS, PluginManager
from llmtrain.parallel.options import ParallelOptions, Pipeline


@attrs.frozen
class RunSection:
    parallel: Choice.of("parallel")  # type: ignore[valid-type]


@pytest.fixture
def plugins() -> PluginManager:
    pm = PluginManager(blocked=())
    pm.register(plugin, "parallel")
    return pm


def test_registers_the_default_strategy(plugins):
    registry = plugins.registry("parallel")
    assert registry.names() == ["default"]
    entry = registry.get("default")
    assert entry.options is ParallelOptions
    assert entry.defaults == {}
    assert "pipeline" in entry.help and "FSDP2" in entry.help
    assert entry.origin.plugin == "parallel"
    assert plugins.problems == []
    # it registers nothing of any other kind
    assert [k for k in KINDS if k != "parallel" and plugins.registry(k).names()] == []


def test_the_target_builds_a_default_strategy(plugins):
    from llmtrain.parallel.strategy import DefaultStrategy

    options = ParallelOptions(compile=True, pipeline=Pipeline(schedule="GPipe"))
    strategy = plugins.build("parallel", Choice.of("parallel")("default", options))
    assert isinstance(strategy, DefaultStrategy)
    assert strategy.options is options
    made_in_code = plugins.build("parallel", Choice.of("parallel")("default"))
    assert made_in_code.options == ParallelOptions()


def test_the_strategy_and_its_model_are_the_typed_seams():
    """What train-loop calls (core-mesh's Protocols), with signatures that take those calls."""
    from llmtrain.parallel.strategy import DefaultStrategy, Parallelized

    assert protocol_mismatches(DefaultStrategy, ParallelStrategy) == []
    assert protocol_mismatches(Parallelized, ParallelModel) == []
    assert isinstance(DefaultStrategy(ParallelOptions()), ParallelStrategy)


def test_a_config_chooses_it_by_kind(plugins):
    raw = {"parallel": {"kind": "default", "float8": False, "pipeline": {"schedule": "GPipe"}}}
    section = structure(raw, RunSection, plugins=plugins)
    assert section.parallel.kind == "default"
    assert section.parallel.options == ParallelOptions(pipeline=Pipeline(schedule="GPipe"))
    with pytest.raises(ConfigError) as info:
        structure(
            {"parallel": {"kind": "default", "pipeline": {"schedul": "x"}}},
            RunSection,
            plugins=plugins,
        )
    [problem] = info.value.problems
    assert problem.dotted == "parallel.pipeline.schedul"
    assert "did you mean 'schedule'" in problem.message
    with pytest.raises(ConfigError, match="unknown parallel 'defualt'"):
        structure({"parallel": {"kind": "defualt"}}, RunSection, plugins=plugins)


def test_declared_as_an_entry_point():
    [entry_point] = importlib_metadata.entry_points(group="llmtrain", name="parallel")
    assert entry_point.value == "llmtrain.parallel.plugin"
    assert entry_point.load() is plugin


def test_plugin_and_options_load_without_torch():
    code = (
        "import sys, llmtrain.parallel.plugin, llmtrain.parallel.options; "
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
