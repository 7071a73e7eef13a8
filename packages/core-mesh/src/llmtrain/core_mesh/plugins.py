"""Plugins: the hookspecs, the plugin manager, and one registry of named entries per kind.

A plugin is a module (or object) found through the `llmtrain` entry-point group, or registered in
process. It implements hooks named `llmtrain_<kinds>(register)` and calls
`register(name, target, options=OptionsClass, help="...")` once per entry. The built-in entries of
every llmtrain package come through the same entry points.

Loading never raises into unrelated code: a plugin that fails to import, raises inside a hook,
names an unknown hook or registers a taken name is recorded as a `PluginProblem` and shown by
`llmtrain plugins`. `LLMTRAIN_DISABLE_PLUGINS=a,b` blocks plugins by entry-point name.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import attrs
import importlib_metadata
import pluggy

from llmtrain.core_mesh.errors import UserError, did_you_mean

GROUP = "llmtrain"
DISABLE_ENV = "LLMTRAIN_DISABLE_PLUGINS"

hookspec = pluggy.HookspecMarker(GROUP)
hookimpl = pluggy.HookimplMarker(GROUP)

# kind -> the hook that registers entries of that kind
KINDS: dict[str, str] = {
    "model": "llmtrain_models",
    "optimizer": "llmtrain_optimizers",
    "lr_scheduler": "llmtrain_lr_schedulers",
    "logger": "llmtrain_loggers",
    "tokenizer": "llmtrain_tokenizers",
    "parallel": "llmtrain_parallel_strategies",
    "command": "llmtrain_commands",
    "weights": "llmtrain_weight_formats",
    "callback": "llmtrain_callbacks",
    "task": "llmtrain_tasks",
}

Register = Callable[..., None]


class Hookspecs:
    """Every hook takes one argument, `register(name, target, *, options=None, help="", defaults=None)`.

    `defaults` (with `options`) are option values used where the config gives none: a preset.
    """

    @hookspec
    def llmtrain_models(self, register: Register) -> None:
        """Register model builders; `options` is the attrs class of the model's config."""

    @hookspec
    def llmtrain_optimizers(self, register: Register) -> None:
        """Register optimizer factories."""

    @hookspec
    def llmtrain_lr_schedulers(self, register: Register) -> None:
        """Register learning-rate schedules."""

    @hookspec
    def llmtrain_loggers(self, register: Register) -> None:
        """Register metrics sinks (console, jsonl, tensorboard, ...)."""

    @hookspec
    def llmtrain_tokenizers(self, register: Register) -> None:
        """Register tokenizer backends."""

    @hookspec
    def llmtrain_parallel_strategies(self, register: Register) -> None:
        """Register parallel strategies."""

    @hookspec
    def llmtrain_commands(self, register: Register) -> None:
        """Register `llmtrain` subcommands (target: a `llmtrain.core_mesh.cli.Command`)."""

    @hookspec
    def llmtrain_weight_formats(self, register: Register) -> None:
        """Register formats of model weights a run can start from (`init: {from: PATH}`);
        target: a `llmtrain.core_mesh.interfaces.WeightFormat`."""

    @hookspec
    def llmtrain_callbacks(self, register: Register) -> None:
        """Register training callbacks (`callbacks: [{kind: NAME, ...}]` in a run config);
        target: `target(options)` returns a `llmtrain.core_mesh.interfaces.Callback`."""

    @hookspec
    def llmtrain_tasks(self, register: Register) -> None:
        """Register downstream evaluation tasks (HellaSwag, ARC, ...; `llmtrain eval-tasks` and
        the `downstream` callback); target: `target(options)` returns a
        `llmtrain.core_mesh.interfaces.Task`."""


@attrs.frozen
class Origin:
    """Where a plugin came from: its entry-point name and the distribution that declared it."""

    plugin: str
    distribution: str | None = None
    version: str | None = None

    def describe(self) -> str:
        if self.distribution is None:
            return f"plugin {self.plugin!r} (registered in process)"
        return f"plugin {self.plugin!r} ({self.distribution} {self.version})"


@attrs.frozen
class Entry:
    """One named thing of one kind: a model builder, an optimizer factory, a command, ..."""

    kind: str
    name: str
    target: Any
    options: type | None
    help: str
    origin: Origin
    defaults: Mapping[str, Any] = attrs.field(factory=dict)


@attrs.frozen
class PluginProblem:
    """A plugin that could not be (fully) used, and why."""

    origin: Origin
    error: str
    detail: str = ""


class UnknownEntryError(UserError):
    pass


class Registry(Mapping[str, Entry]):
    """The entries of one kind, by name."""

    def __init__(self, kind: str, entries: Mapping[str, Entry]):
        self.kind = kind
        self._entries = dict(sorted(entries.items()))

    def get(self, name: str) -> Entry:  # type: ignore[override]
        """The entry called `name`; an unknown name is a UserError listing the known ones."""
        if name in self._entries:
            return self._entries[name]
        known = ", ".join(self._entries) or "none installed"
        raise UnknownEntryError(
            f"unknown {self.kind} {name!r}{did_you_mean(name, self._entries)}; known: {known}"
        )

    def names(self) -> list[str]:
        return list(self._entries)

    def __getitem__(self, name: str) -> Entry:
        return self.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


_IMPL_DEFAULTS: pluggy.HookimplOpts = {
    "wrapper": False,
    "hookwrapper": False,
    "optionalhook": False,
    "tryfirst": False,
    "trylast": False,
    "specname": None,
}


class _Pluggy(pluggy.PluginManager):
    """Also accept undecorated `llmtrain_*` functions, so a forgotten `@hookimpl` still works."""

    def parse_hookimpl_opts(self, plugin: object, name: str) -> pluggy.HookimplOpts | None:
        opts = super().parse_hookimpl_opts(plugin, name)
        if opts is None and name.startswith("llmtrain_") and callable(getattr(plugin, name, None)):
            return pluggy.HookimplOpts(**_IMPL_DEFAULTS)  # a copy: pluggy may change it
        return opts


def blocked_from_env(environ: Mapping[str, str] | None = None) -> frozenset[str]:
    raw = (os.environ if environ is None else environ).get(DISABLE_ENV, "")
    return frozenset(name.strip() for name in raw.split(",") if name.strip())


class PluginManager:
    """Loads plugins and builds the registries. An instance, so tests can build a fresh one."""

    def __init__(self, *, group: str = GROUP, blocked: Iterable[str] | None = None):
        self.group = group
        self.blocked = blocked_from_env() if blocked is None else frozenset(blocked)
        self._pm = _Pluggy(group)
        self._pm.add_hookspecs(Hookspecs)
        for name in self.blocked:
            self._pm.set_blocked(name)
        self._origins: dict[str, Origin] = {}
        self._load_problems: list[PluginProblem] = []
        self._hook_problems: list[PluginProblem] = []
        self._registries: dict[str, Registry] | None = None

    # -- loading -----------------------------------------------------------------------------

    def load_entry_points(self) -> PluginManager:
        """Import every entry point of the group, one by one, recording each failure."""
        for ep in sorted(importlib_metadata.entry_points(group=self.group), key=lambda e: e.name):
            dist = ep.dist
            origin = Origin(ep.name, dist.name if dist else None, dist.version if dist else None)
            if ep.name in self.blocked:
                continue
            if ep.name in self._origins:
                taken = self._origins[ep.name]
                self._problem(
                    origin, f"plugin name {ep.name!r} is already taken by {taken.describe()}"
                )
                continue
            try:
                plugin = ep.load()
            except Exception as exc:  # noqa: BLE001 - any import failure is the plugin's problem
                self._problem(origin, f"failed to import {ep.value}: {_one_line(exc)}", exc)
                continue
            self.register(plugin, ep.name, origin=origin)
        return self

    def register(
        self, plugin: object, name: str | None = None, *, origin: Origin | None = None
    ) -> None:
        """Register a plugin object in process (tests, applications embedding llmtrain)."""
        name = name or getattr(plugin, "__name__", None) or repr(plugin)
        origin = origin or Origin(name)
        if name in self.blocked:
            return
        if name in self._origins:
            taken = self._origins[name]
            self._problem(origin, f"plugin name {name!r} is already taken by {taken.describe()}")
            return
        try:
            self._pm.register(plugin, name)
        except Exception as exc:  # noqa: BLE001 - pluggy rejects bad hook signatures here
            self._problem(origin, _one_line(exc), exc)
            return
        self._origins[name] = origin
        known = set(KINDS.values())
        for caller in self._pm.get_hookcallers(plugin) or []:
            if caller.name not in known:
                self._problem(
                    origin,
                    f"unknown hook {caller.name!r}{did_you_mean(caller.name, known)}; it is ignored",
                )
        self._registries = None

    def unregister(self, name: str) -> None:
        self._pm.unregister(name=name)
        self._origins.pop(name, None)
        self._registries = None

    def plugins(self) -> list[Origin]:
        return sorted(self._origins.values(), key=lambda o: o.plugin)

    @property
    def problems(self) -> list[PluginProblem]:
        self._collect()
        return self._load_problems + self._hook_problems

    # -- registries --------------------------------------------------------------------------

    def registry(self, kind: str) -> Registry:
        if kind not in KINDS:
            raise UnknownEntryError(f"unknown plugin kind {kind!r}; kinds are: {', '.join(KINDS)}")
        return self._collect()[kind]

    def entries(self) -> list[Entry]:
        return [entry for registry in self._collect().values() for entry in registry.values()]

    # -- building ----------------------------------------------------------------------------

    def options_of(self, kind: str, choice: Any) -> Any:
        """The options of a `kind:` choice (a `Choice.of(kind)`): its structured options; when it
        has none (a choice made in code, `Choice.of("parallel")(kind="default")`), the entry's
        defaults structured into its options class, as a config section `{kind: NAME}` would
        give them; None when the entry takes no options."""
        if choice.options is not None:
            return choice.options
        entry = self.registry(kind).get(choice.kind)
        if entry.options is None:
            return None
        from llmtrain.core_mesh.config import structure  # config builds on this module

        where = f"{kind} {choice.kind!r} of {entry.origin.describe()} (its defaults)"
        return structure(dict(entry.defaults), entry.options, plugins=self, source=where)

    def build(self, kind: str, choice: Any, *args: Any) -> Any:
        """What the chosen entry builds: `entry.target(self.options_of(kind, choice), *args)`
        (a model from its options, an optimizer from its options and the model, ...)."""
        entry = self.registry(kind).get(choice.kind)
        return entry.target(self.options_of(kind, choice), *args)

    def _collect(self) -> dict[str, Registry]:
        if self._registries is not None:
            return self._registries
        self._hook_problems = []
        registries = {}
        for kind, hook_name in KINDS.items():
            entries: dict[str, Entry] = {}
            for impl in getattr(self._pm.hook, hook_name).get_hookimpls():
                self._collect_one(kind, impl, entries)
            registries[kind] = Registry(kind, entries)
        self._registries = registries
        return registries

    def _collect_one(self, kind: str, impl: Any, entries: dict[str, Entry]) -> None:
        origin = self._origins.get(impl.plugin_name, Origin(impl.plugin_name))
        found: list[Entry] = []

        def register(
            name: str,
            target: Any,
            *,
            options: type | None = None,
            help: str = "",
            defaults: Mapping[str, Any] | None = None,
        ) -> None:
            if not isinstance(name, str) or not name:
                raise TypeError(f"a {kind} name must be a non-empty string, got {name!r}")
            if options is not None and not attrs.has(options):
                raise TypeError(
                    f"options of {kind} {name!r} must be an attrs class, got {options!r}"
                )
            if defaults and options is None:
                raise TypeError(f"{kind} {name!r} has defaults but no options class")
            found.append(Entry(kind, name, target, options, help, origin, dict(defaults or {})))

        try:
            impl.function(**{arg: register for arg in impl.argnames})
        except Exception as exc:  # noqa: BLE001 - a broken plugin must not break the others
            self._hook_problems.append(
                _problem(origin, f"in hook {impl.function.__name__}: {_one_line(exc)}", exc)
            )
            return
        for entry in found:
            if entry.name in entries:
                taken = entries[entry.name].origin
                self._hook_problems.append(
                    _problem(
                        origin,
                        f"in hook {KINDS[kind]}: {kind} {entry.name!r} is already registered by "
                        f"{taken.describe()}; this one is ignored",
                    )
                )
                continue
            entries[entry.name] = entry

    def _problem(self, origin: Origin, error: str, exc: BaseException | None = None) -> None:
        self._load_problems.append(_problem(origin, error, exc))


def _problem(origin: Origin, error: str, exc: BaseException | None = None) -> PluginProblem:
    detail = "".join(traceback.format_exception(exc)) if exc is not None else ""
    return PluginProblem(origin, error, detail)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
