"""The callbacks of one run, in their order, and how the loop calls them.

Order (the same for every event): the built-in callbacks (`builtin_callbacks.py`: summary,
watchdog, profiler, throughput, stragglers), then the run config's `callbacks:` list as written.
A callback sees what the ones before it added to a metrics dict.

Only the events a callback's class overrides are called, so an idle callback costs nothing per
step. A callback that raises stops the run with a `CallbackError` naming it and its plugin
package (the traceback goes to the rank's JSON log); during `on_failure` an exception is logged
and the run's own error goes on.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import structlog

from llmtrain.core_mesh.errors import UserError, no_space
from llmtrain.core_mesh.interfaces import CALLBACK_EVENTS, Callback, TrainingRun
from llmtrain.core_mesh.plugins import CALLBACK, PluginManager

log = structlog.get_logger("llmtrain.callbacks")


class CallbackError(UserError):
    pass


@attrs.frozen
class Named:
    """A callback with the name its state is saved under and where it comes from."""

    key: str  # `loss_spike`, or `loss_spike#2` for the second of one kind
    callback: Any
    origin: str  # `plugin 'moe' (llmtrain-moe 0.3.0)`, for errors


def overrides(callback: Any, event: str) -> bool:
    """Whether `callback` does something at `event` (not the base class's no-op)."""
    method = getattr(type(callback), event, None)
    return method is not None and method is not getattr(Callback, event)


class Callbacks:
    """Calls each event on the callbacks that implement it, in order."""

    def __init__(self, named: Iterable[Named]):
        self.named = list(named)
        self._by_event = {
            event: [n for n in self.named if overrides(n.callback, event)]
            for event in CALLBACK_EVENTS
        }

    def emit(self, event: str, run: TrainingRun, *args: Any) -> None:
        # `run` typed as the Protocol: mypy checks that the Trainer passing itself conforms
        for named in self._by_event[event]:
            try:
                getattr(named.callback, event)(run, *args)
            except Exception as exc:
                # a full disk is the user's, said in one line by the command: no traceback
                traced = no_space(exc) is None
                log.error("callback.failed", callback=named.key, at=event, exc_info=traced)
                raise CallbackError(
                    f"callback {named.key!r} of {named.origin} failed in {event}: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc

    def emit_failure(self, run: TrainingRun, error: BaseException) -> None:
        """`on_failure` on every callback; one that raises is logged, not raised."""
        for named in self._by_event["on_failure"]:
            try:
                named.callback.on_failure(run, error)
            except Exception as exc:  # the run's own error matters more: log this one
                log.error(
                    "callback.failed",
                    callback=named.key,
                    at="on_failure",
                    message=f"callback {named.key!r} of {named.origin} failed in on_failure: "
                    f"{type(exc).__name__}: {exc}",
                    exc_info=True,
                )

    # --- state carried by checkpoints ---
    def state(self) -> dict[str, Any]:
        """Each stateful callback's `state_dict()`, as JSON-safe plain data (a copy)."""
        states = {}
        for named in self.named:
            if not callable(getattr(named.callback, "state_dict", None)):
                continue
            try:
                state = named.callback.state_dict()
                states[named.key] = json.loads(json.dumps(state, default=_read_number))
            except Exception as exc:
                raise CallbackError(
                    f"callback {named.key!r} of {named.origin}: state_dict() must return plain "
                    f"data (numbers, strings, lists, dicts; a one-element tensor is read as its "
                    f"number): {type(exc).__name__}: {exc}"
                ) from exc
        return states

    def tensor_states(self, run: TrainingRun) -> dict[str, Any]:
        """The tensors callbacks keep laid out like the model, by callback key: what a
        callback's `tensor_state(run)` returns (a Stateful of tensors; None while it keeps
        none), saved and loaded with the model's shards. Its step-independent facts go in
        its plain `state_dict()`, which a resume restores first."""
        states = {}
        for named in self.named:
            method = getattr(named.callback, "tensor_state", None)
            if callable(method) and (state := method(run)) is not None:
                states[named.key] = state
        return states

    def load_state(self, states: Mapping[str, Any], where: str) -> None:
        """Give each stateful callback its saved state; one the checkpoint lacks starts fresh."""
        for named in self.named:
            if not callable(getattr(named.callback, "load_state_dict", None)):
                continue
            if named.key not in states:
                log.info("callback.fresh_state", callback=named.key, checkpoint=where)
                continue
            try:
                named.callback.load_state_dict(copy.deepcopy(states[named.key]))
            except Exception as exc:
                raise CallbackError(
                    f"callback {named.key!r} of {named.origin} could not load its state from "
                    f"{where}: {type(exc).__name__}: {exc}"
                ) from exc


def _read_number(value: Any) -> Any:
    """A one-element tensor in a callback's state (a value kept on the device, e.g. from the
    step's metrics) as its number: read at a save, which waits for the device anyway."""
    numel = getattr(value, "numel", None)
    if callable(numel) and numel() == 1:
        return value.item()
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def configured(choices: Iterable[Any], plugins: PluginManager) -> list[Named]:
    """The run config's `callbacks:` entries, built by their plugins, in order."""
    named: list[Named] = []
    seen: dict[str, int] = {}
    for index, choice in enumerate(choices):
        entry = plugins.registry("callback").get(choice.kind)
        origin = entry.origin.describe()
        try:
            callback = plugins.build(CALLBACK, choice)
        except UserError:
            raise
        except Exception as exc:
            raise CallbackError(
                f"callbacks[{index}]: callback {choice.kind!r} of {origin} failed to build: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        if not any(overrides(callback, event) for event in CALLBACK_EVENTS):
            raise CallbackError(
                f"callbacks[{index}]: callback {choice.kind!r} of {origin} built a "
                f"{type(callback).__name__}, which has no callback event method; subclass "
                "llmtrain.core_mesh.interfaces.Callback"
            )
        seen[choice.kind] = seen.get(choice.kind, 0) + 1
        key = choice.kind if seen[choice.kind] == 1 else f"{choice.kind}#{seen[choice.kind]}"
        named.append(Named(key, callback, origin))
    return named
