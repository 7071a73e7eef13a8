"""The plugin manager: registries per kind, broken plugins recorded instead of raised, and the
options and builds of chosen entries."""

from __future__ import annotations

import types

import attrs
import pytest

from llmtrain.core_mesh.config import Choice, ConfigError, structure
from llmtrain.core_mesh.errors import UserError
from llmtrain.core_mesh.plugins import (
    KINDS,
    PluginManager,
    UnknownEntryError,
    blocked_from_env,
    hookimpl,
)


class Models:
    @hookimpl
    def llmtrain_models(self, register):
        register("gpt", "gpt-builder", help="a GPT")
        register("llama", "llama-builder")


class Optimizers:
    @hookimpl
    def llmtrain_optimizers(self, register):
        register("adamw", "adamw-factory")


def fresh(*plugins, blocked=()):
    pm = PluginManager(blocked=blocked)
    for i, plugin in enumerate(plugins):
        pm.register(plugin, f"p{i}")
    return pm


def test_registries_per_kind():
    pm = fresh(Models(), Optimizers())
    assert pm.registry("model").names() == ["gpt", "llama"]
    assert pm.registry("model").get("gpt").target == "gpt-builder"
    assert pm.registry("model")["gpt"].help == "a GPT"
    assert pm.registry("optimizer").names() == ["adamw"]
    assert pm.registry("logger").names() == []
    assert {e.name for e in pm.entries()} == {"gpt", "llama", "adamw"}
    assert pm.problems == []


def test_unknown_name_suggests_and_lists():
    pm = fresh(Models())
    with pytest.raises(UnknownEntryError) as info:
        pm.registry("model").get("lama")
    assert str(info.value) == "unknown model 'lama' (did you mean 'llama'?); known: gpt, llama"
    assert isinstance(info.value, UserError)
    with pytest.raises(UnknownEntryError, match="kinds are: model, optimizer"):
        pm.registry("models")


def test_duplicate_entry_name_is_a_problem_and_first_wins():
    class Other:
        @hookimpl
        def llmtrain_models(self, register):
            register("gpt", "other-gpt")
            register("mamba", "mamba-builder")

    pm = fresh(Models(), Other())
    assert pm.registry("model").get("gpt").target == "gpt-builder"
    assert pm.registry("model").get("mamba").target == "mamba-builder"
    [problem] = pm.problems
    assert problem.origin.plugin == "p1"
    assert "model 'gpt' is already registered by plugin 'p0'" in problem.error


def test_hook_that_raises_is_recorded_and_others_still_load():
    class Broken:
        @hookimpl
        def llmtrain_models(self, register):
            register("half", "x")
            raise RuntimeError("boom")

    pm = fresh(Broken(), Models())
    assert pm.registry("model").names() == ["gpt", "llama"]  # nothing of the broken hook survives
    [problem] = pm.problems
    assert problem.error == "in hook llmtrain_models: RuntimeError: boom"
    assert "RuntimeError: boom" in problem.detail


def test_bad_registrations_are_problems():
    class BadName:
        @hookimpl
        def llmtrain_loggers(self, register):
            register("", object())

    class BadOptions:
        @hookimpl
        def llmtrain_loggers(self, register):
            register("x", object(), options=dict)

    pm = fresh(BadName(), BadOptions())
    errors = sorted(p.error for p in pm.problems)
    assert "must be a non-empty string" in errors[0] + errors[1]
    assert "must be an attrs class" in errors[0] + errors[1]


def test_undecorated_hooks_work_and_typos_are_reported():
    module = types.ModuleType("plain")
    module.llmtrain_models = lambda register: register("plain", 1)
    module.llmtrain_model = lambda register: None
    pm = fresh(module)
    assert pm.registry("model").names() == ["plain"]
    [problem] = pm.problems
    assert (
        problem.error
        == "unknown hook 'llmtrain_model' (did you mean 'llmtrain_models'?); it is ignored"
    )


def test_taken_plugin_name_is_a_problem():
    pm = PluginManager(blocked=())
    pm.register(Models(), "same")
    pm.register(Optimizers(), "same")
    assert pm.registry("optimizer").names() == []
    assert "plugin name 'same' is already taken" in pm.problems[0].error


def test_blocked_plugins_are_skipped(monkeypatch):
    monkeypatch.setenv("LLMTRAIN_DISABLE_PLUGINS", " p1 , x,")
    assert blocked_from_env() == {"p1", "x"}
    pm = PluginManager()
    pm.register(Models(), "p0")
    pm.register(Optimizers(), "p1")
    assert pm.registry("optimizer").names() == []
    assert pm.registry("model").names() == ["gpt", "llama"]
    assert pm.blocked == {"p1", "x"}


def test_unregister_rebuilds_registries():
    pm = fresh(Models(), Optimizers())
    assert "adamw" in pm.registry("optimizer")
    pm.unregister("p1")
    assert "adamw" not in pm.registry("optimizer")


def test_entry_points_load_the_builtin_plugin():
    pm = PluginManager(blocked=()).load_entry_points()
    entry = pm.registry("command").get("plugins")
    assert entry.origin.plugin == "core"
    assert entry.origin.distribution == "llmtrain-core-mesh"
    assert set(KINDS) == {
        "model",
        "optimizer",
        "lr_scheduler",
        "logger",
        "tokenizer",
        "parallel",
        "command",
        "weights",
        "callback",
        "task",
        "objective",
        "data_format",
    }


@attrs.frozen(kw_only=True)
class Depth:
    layers: int = 2


@attrs.frozen(kw_only=True)
class NetOptions:
    width: int = 8
    rate: float = 0.1
    depth: Depth = attrs.Factory(Depth)


class Nets:
    @hookimpl
    def llmtrain_models(self, register):
        register("net", lambda options, *args: (options, args), options=NetOptions)
        register(
            "wide-net",
            lambda options, *args: (options, args),
            options=NetOptions,
            defaults={"width": 64, "rate": 1, "depth": {"layers": 6}},
        )
        register("plain", lambda options, *args: (options, args))


def test_options_of_a_choice():
    pm = fresh(Nets())
    model = Choice.of("model")
    given = NetOptions(width=3)
    assert pm.options_of("model", model("wide-net", given)) is given
    assert pm.options_of("model", model("net")) == NetOptions()
    # the defaults are structured as a config section `{kind: wide-net}` would be
    preset = pm.options_of("model", model("wide-net"))
    assert preset == NetOptions(width=64, rate=1.0, depth=Depth(layers=6))
    assert preset == structure({"kind": "wide-net"}, model, plugins=pm).options
    assert type(preset.rate) is float
    assert pm.options_of("model", model("plain")) is None
    with pytest.raises(UnknownEntryError, match="unknown model 'nett'"):
        pm.options_of("model", model("nett"))


def test_options_of_reports_bad_defaults_as_the_plugins():
    class Broken:
        @hookimpl
        def llmtrain_models(self, register):
            register("bad", object(), options=NetOptions, defaults={"width": "wide"})

    pm = fresh(Broken())
    with pytest.raises(ConfigError) as info:
        pm.options_of("model", Choice.of("model")("bad"))
    assert "model 'bad' of plugin 'p0' (registered in process) (its defaults)" in str(info.value)
    assert [p.dotted for p in info.value.problems] == ["width"]


def test_build_passes_the_options_and_the_arguments():
    pm = fresh(Nets())
    model = Choice.of("model")
    assert pm.build("model", model("wide-net"), "part", 2) == (
        NetOptions(width=64, rate=1.0, depth=Depth(layers=6)),
        ("part", 2),
    )
    assert pm.build("model", model("net", NetOptions(width=5))) == (NetOptions(width=5), ())
    assert pm.build("model", model("plain"), 1) == (None, (1,))
