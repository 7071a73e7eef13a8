"""The callbacks of a run: order, which events reach which callback, errors that name the
callback and its plugin, state that goes to checkpoints, and the `callbacks:` config list."""

from __future__ import annotations

import attrs
import pytest

from llmtrain.core_mesh.config import ConfigError, load_config
from llmtrain.core_mesh.interfaces import CALLBACK_EVENTS, Callback
from llmtrain.core_mesh.plugins import PluginManager, hookimpl
from llmtrain.train_loop.callbacks import CallbackError, Callbacks, Named, configured, overrides
from llmtrain.train_loop.run_config import RunConfig


class Recorder(Callback):
    def __init__(self, name: str, calls: list):
        self.name, self.calls = name, calls

    def before_step(self, run, step):
        self.calls.append((self.name, "before_step", step))

    def after_step(self, run, step, metrics):
        self.calls.append((self.name, "after_step", dict(metrics)))
        metrics[self.name] = len(metrics)


class OnlyEnd(Callback):
    def __init__(self, calls: list):
        self.calls = calls

    def on_run_end(self, run, status):
        self.calls.append(("end", status))


def test_events_run_in_order_and_see_what_earlier_callbacks_added():
    calls: list = []
    cbs = Callbacks([Named("a", Recorder("a", calls), "x"), Named("b", Recorder("b", calls), "y")])
    metrics = {"loss": 1.0}
    cbs.emit("before_step", None, 7)
    cbs.emit("after_step", None, 7, metrics)
    assert calls == [
        ("a", "before_step", 7),
        ("b", "before_step", 7),
        ("a", "after_step", {"loss": 1.0}),
        ("b", "after_step", {"loss": 1.0, "a": 1}),
    ]
    assert metrics == {"loss": 1.0, "a": 1, "b": 2}


def test_only_overridden_events_are_called():
    calls: list = []
    end = OnlyEnd(calls)
    assert [e for e in CALLBACK_EVENTS if overrides(end, e)] == ["on_run_end"]
    cbs = Callbacks([Named("end", end, "x")])
    assert cbs._by_event["before_step"] == [] and len(cbs._by_event["on_run_end"]) == 1
    cbs.emit("before_step", None, 1)
    cbs.emit("on_run_end", None, "finished")
    assert calls == [("end", "finished")]


class Raises(Callback):
    def after_step(self, run, step, metrics):
        raise KeyError("no such metric")

    def on_failure(self, run, error):
        raise RuntimeError("and this one fails too")


def test_a_raising_callback_is_an_error_naming_it_and_its_origin():
    cbs = Callbacks([Named("bad#2", Raises(), "plugin 'bad' (llmtrain-bad 1.0)")])
    with pytest.raises(CallbackError) as info:
        cbs.emit("after_step", None, 3, {})
    assert str(info.value) == (
        "callback 'bad#2' of plugin 'bad' (llmtrain-bad 1.0) failed in after_step: "
        "KeyError: 'no such metric'"
    )
    assert isinstance(info.value.__cause__, KeyError)
    cbs.emit_failure(None, ValueError("the run's own error"))  # logged, not raised


class Counter(Callback):
    def __init__(self, state=None):
        self.state = state if state is not None else {"n": 0, "seen": []}

    def after_step(self, run, step, metrics):
        self.state["n"] += 1
        self.state["seen"].append(step)

    def state_dict(self):
        return self.state

    def load_state_dict(self, state):
        self.state = state


def test_state_is_a_plain_copy_and_loads_back():
    counter = Counter()
    cbs = Callbacks([Named("count", counter, "x"), Named("end", OnlyEnd([]), "y")])
    cbs.emit("after_step", None, 1, {})
    saved = cbs.state()
    assert saved == {"count": {"n": 1, "seen": [1]}}  # stateless callbacks save nothing
    cbs.emit("after_step", None, 2, {})
    assert saved == {"count": {"n": 1, "seen": [1]}}  # a copy, not the live state

    again = Counter()
    Callbacks([Named("count", again, "x")]).load_state(saved, "step-1")
    assert again.state == {"n": 1, "seen": [1]}
    again.state["seen"].append(5)
    assert saved["count"]["seen"] == [1]


def test_a_callback_new_to_the_checkpoint_starts_fresh():
    fresh = Counter()
    Callbacks([Named("count", fresh, "x")]).load_state({"other": {"n": 9}}, "step-5")
    assert fresh.state == {"n": 0, "seen": []}


def test_state_that_is_not_plain_data_is_refused():
    cbs = Callbacks([Named("count", Counter({"n": object()}), "plugin 'p' (pkg 1)")])
    with pytest.raises(CallbackError, match=r"callback 'count' of plugin 'p' \(pkg 1\): state_"):
        cbs.state()


# --- the `callbacks:` list of a run config ---
@attrs.frozen(kw_only=True)
class EveryOptions:
    every: int = 1


class Every(Callback):
    def __init__(self, options: EveryOptions):
        self.options = options

    def after_step(self, run, step, metrics):
        pass


class TestPlugin:
    @hookimpl
    def llmtrain_callbacks(self, register):
        register("every", Every, options=EveryOptions)
        register("not_a_callback", lambda options: object())
        register("broken", lambda options: 1 / 0)


@pytest.fixture
def plugins(installed: PluginManager) -> PluginManager:
    installed.register(TestPlugin(), "test-callbacks")
    return installed


def test_configured_callbacks_are_built_in_order_with_unique_keys(plugins, tmp_path):
    config = write_config(tmp_path, "[{kind: every, every: 3}, {kind: every}, {kind: loss_spike}]")
    run = load_config(str(config), RunConfig, plugins=plugins)
    named = configured(run.callbacks, plugins)
    assert [n.key for n in named] == ["every", "every#2", "loss_spike"]
    assert [n.callback.options.every for n in named[:2]] == [3, 1]
    assert named[0].origin == "plugin 'test-callbacks' (registered in process)"
    assert named[2].origin.startswith("plugin 'train_loop' (llmtrain-train-loop ")


def test_callback_options_are_strict(plugins, tmp_path):
    config = write_config(tmp_path, "[{kind: every, every: often}, {kind: evry}]")
    with pytest.raises(ConfigError) as info:
        load_config(str(config), RunConfig, plugins=plugins)
    lines = str(info.value).splitlines()[1:]
    assert lines[0].endswith("run.yaml:6: callbacks[0].every: expected int, got str 'often'")
    assert (
        "run.yaml:6: callbacks[1].kind: unknown callback 'evry' (did you mean 'every'?)"
        in (lines[1])
    )


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("not_a_callback", "built a object, which has no callback event method"),
        ("broken", "failed to build: ZeroDivisionError: division by zero"),
    ],
)
def test_a_target_that_builds_no_callback_is_refused(plugins, tmp_path, kind, message):
    config = write_config(tmp_path, f"[{{kind: every}}, {{kind: {kind}}}]")
    run = load_config(str(config), RunConfig, plugins=plugins)
    with pytest.raises(CallbackError, match=rf"^callbacks\[1\]: callback '{kind}' of plugin"):
        configured(run.callbacks, plugins)
    with pytest.raises(CallbackError, match=message):
        configured(run.callbacks, plugins)


def write_config(tmp_path, callbacks: str):
    path = tmp_path / "run.yaml"
    path.write_text(
        f"""\
name: cb
model: {{kind: tiny}}
data: {{train: [{{path: x.zarr}}], seq_len: 16}}
optimizer: {{kind: adamw}}
training: {{steps: 2}}
callbacks: {callbacks}
"""
    )
    return path
