"""Typed plugin kinds: `build(LOGGER, ...)` checks what a factory returned, every target is a
factory, and a command or weight format registered the old way (an instance) still works.

That a typed build is typed as its kind's Protocol is checked statically: `_typed_builds` at the
end of plugins.py holds `assert_type`s that `nox -s typecheck` runs mypy over."""

from __future__ import annotations

import argparse
import warnings

import pytest

from llmtrain.core_mesh.cli import Command, main
from llmtrain.core_mesh.config import Choice
from llmtrain.core_mesh.errors import UserError
from llmtrain.core_mesh.interfaces import WeightFormat
from llmtrain.core_mesh.plugins import (
    COMMAND,
    KINDS,
    LOGGER,
    MODEL,
    TASK,
    TOKENIZER,
    WEIGHTS,
    PluginManager,
    UnknownEntryError,
    hookimpl,
    kind_of,
)


class ListSink:
    def __init__(self, run_info):
        self.run_info = run_info
        self.logged = []

    def log(self, step, metrics, /):
        self.logged.append((step, dict(metrics)))

    def close(self):
        pass


class HalfSink:
    """Has `log` but no `close`: not a MetricsSink."""

    def log(self, step, metrics, /):
        pass


class Weights:
    def recognizes(self, path, storage_options, /):
        return path.endswith(".w")

    def describe(self):
        return "*.w files"

    def model(self, path, storage_options, /):
        return {"kind": "net"}

    def load(self, path, storage_options, /):
        return {}, {"kind": "net"}


def _run_ok(args: argparse.Namespace, ctx: object) -> int:
    return 0


def _noop(parser: argparse.ArgumentParser) -> None:
    pass


class Plugin:
    @hookimpl
    def llmtrain_loggers(self, register):
        register("list", lambda options, run_info: ListSink(run_info))
        register("half", lambda options, run_info: HalfSink())

    @hookimpl
    def llmtrain_tasks(self, register):
        register("nothing", lambda options: None)

    @hookimpl
    def llmtrain_commands(self, register):
        register("new-style", lambda options: Command("a factory", _noop, _run_ok))

    @hookimpl
    def llmtrain_weight_formats(self, register):
        register("w", lambda options: Weights())


class OldStyle:
    """Registers instances for `command` and `weights`, as plugins did before factories."""

    @hookimpl
    def llmtrain_commands(self, register):
        register("old-style", Command("an instance", _noop, _run_ok))

    @hookimpl
    def llmtrain_weight_formats(self, register):
        register("old-w", Weights())


def manager(*plugins):
    pm = PluginManager(blocked=())
    for i, plugin in enumerate(plugins):
        pm.register(plugin, f"p{i}")
    return pm


def test_a_typed_build_returns_what_the_factory_built():
    pm = manager(Plugin())
    sink = pm.build(LOGGER, Choice.of("logger")("list"), "the run")
    assert isinstance(sink, ListSink) and sink.run_info == "the run"
    # a kind named by string builds the same, and so does an entry's bare name
    assert type(pm.build("logger", "list", "run")) is ListSink
    assert isinstance(pm.build(WEIGHTS, "w"), WeightFormat)
    assert pm.build(COMMAND, "new-style").help == "a factory"


def test_a_factory_that_builds_the_wrong_thing_is_an_error_naming_the_plugin():
    pm = manager(Plugin())
    with pytest.raises(UserError) as info:
        pm.build(LOGGER, "half", "run")
    message = str(info.value)
    assert "logger 'half' of plugin 'p0' (registered in process)" in message
    assert "built a HalfSink, not a MetricsSink (it has no close)" in message
    with pytest.raises(UserError, match=r"task 'nothing' of plugin 'p0' .* built a NoneType"):
        pm.build(TASK, "nothing")
    # the same check when the kind is named by string
    with pytest.raises(UserError, match="not a MetricsSink"):
        pm.build("logger", "half", "run")


def test_a_target_that_is_no_factory_is_an_error_naming_the_plugin():
    class NotAFactory:
        @hookimpl
        def llmtrain_models(self, register):
            register("gpt", "gpt-builder")

    pm = manager(NotAFactory())
    with pytest.raises(UserError, match=r"model 'gpt' of plugin 'p0' .* must be a factory"):
        pm.build(MODEL, "gpt")


def test_instances_registered_for_commands_and_weights_still_work_with_a_warning():
    pm = manager(OldStyle())
    with pytest.warns(DeprecationWarning) as caught:
        registry = pm.registry(COMMAND)
        pm.registry(WEIGHTS)
    messages = sorted(str(w.message) for w in caught)
    assert messages == [
        "command 'old-style' of plugin 'p0' (registered in process) is registered as an "
        "instance; register a factory instead: "
        "register('old-style', lambda options: instance, ...)",
        "weights 'old-w' of plugin 'p0' (registered in process) is registered as an instance; "
        "register a factory instead: register('old-w', lambda options: instance, ...)",
    ]
    command = pm.build(COMMAND, "old-style")
    assert command.help == "an instance"
    assert pm.build(COMMAND, "old-style") is command  # the very instance, each time
    assert registry.get("old-style").target(None) is command
    weights = pm.build(WEIGHTS, "old-w")
    assert weights.recognizes("a.w", {}) and not weights.recognizes("a.x", {})
    # and the command line runs the old-style command
    assert main(["old-style"], plugins=pm) == 0


def test_factories_for_commands_and_weights_raise_no_warning():
    pm = manager(Plugin())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pm.registry(COMMAND)
        pm.registry(WEIGHTS)


def test_a_class_registered_as_a_weight_format_is_taken_as_its_factory():
    class Format(Weights):
        def __init__(self, options):
            self.options = options

    class ByClass:
        @hookimpl
        def llmtrain_weight_formats(self, register):
            register("cls", Format)

    pm = manager(ByClass())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        built = pm.build(WEIGHTS, "cls")
    assert type(built) is Format and built.options is None


def test_string_kinds_name_the_typed_keys():
    assert kind_of("logger") is LOGGER
    assert kind_of("weights") is WEIGHTS
    assert {kind_of(name).hook for name in KINDS} == set(KINDS.values())
    with pytest.raises(UnknownEntryError, match="unknown plugin kind 'loggers'"):
        kind_of("loggers")
    with pytest.raises(UnknownEntryError, match="unknown plugin kind 'loggers'"):
        manager().registry("loggers")


def test_the_check_runs_no_property_and_takes_members_served_by_getattr():
    class LazyTokenizer:
        """A Tokenizer whose members a wrapped object serves; `fingerprint` would load it."""

        name = "lazy"
        vocab_size = 3
        eod_id = 0

        @property
        def fingerprint(self):
            raise AssertionError("the check ran a property")

        def __getattr__(self, member):
            if member in ("encode_batch", "decode"):
                return lambda *args: []
            raise AttributeError(member)

    class Tokenizers:
        @hookimpl
        def llmtrain_tokenizers(self, register):
            register("lazy", lambda options: LazyTokenizer())

    pm = manager(Tokenizers())
    assert type(pm.build(TOKENIZER, "lazy")) is LazyTokenizer
