"""Plugins: the hookspecs, the plugin manager, and one registry of named entries per kind.

A plugin is a module (or object) found through the `llmtrain` entry-point group, or registered in
process. It implements hooks named `llmtrain_<kinds>(register)` and calls
`register(name, target, options=OptionsClass, help="...")` once per entry. The built-in entries of
every llmtrain package come through the same entry points.

Every entry's target is a factory: `target(options, *args)` returns the kind's object (a
`MetricsSink` for a logger, a `Command` for a command, ...). Each kind is a typed `Kind` key
(`LOGGER: Kind[MetricsSink]`): `PluginManager.build(LOGGER, choice, run_info)` is typed as the
kind's Protocol and checks at run time that the plugin's factory returned one. A command or weight
format registered as an instance (the convention before factories) is still accepted, with a
DeprecationWarning saying to register `lambda options: instance` instead.

Loading never raises into unrelated code: a plugin that fails to import, raises inside a hook,
names an unknown hook or registers a taken name is recorded as a `PluginProblem` and shown by
`llmtrain plugins`. `LLMTRAIN_DISABLE_PLUGINS=a,b` blocks plugins by entry-point name.
"""

from __future__ import annotations

import inspect
import os
import traceback
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar, overload

import attrs
import importlib_metadata
import pluggy

from llmtrain.core_mesh.errors import UserError, did_you_mean
from llmtrain.core_mesh.interfaces import (
    Callback,
    MetricsSink,
    Objective,
    ParallelStrategy,
    Task,
    Tokenizer,
    WeightFormat,
)

if TYPE_CHECKING:
    from llmtrain.core_mesh.cli import Command
    from llmtrain.core_mesh.config import Choice

GROUP = "llmtrain"
DISABLE_ENV = "LLMTRAIN_DISABLE_PLUGINS"

hookspec = pluggy.HookspecMarker(GROUP)
hookimpl = pluggy.HookimplMarker(GROUP)

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class Kind(Generic[T_co]):
    """One plugin kind as a typed key: its name (`logger`, as configs and `llmtrain plugins` say
    it), the hook that registers its entries, and what its entries build (`T_co`, checked at run
    time against `product()` when that is given; None: not checked, e.g. torch objects, which
    core-mesh does not import). `instances_ok`: a plugin may still register an instance in place
    of a factory (commands and weight formats did before factories were the one convention)."""

    __slots__ = ("hook", "instances_ok", "name", "product")

    def __init__(
        self,
        name: str,
        hook: str,
        product: Callable[[], type] | None = None,
        *,
        instances_ok: bool = False,
    ):
        self.name = name
        self.hook = hook
        self.product = product  # a function, so a type defined above core-mesh's imports works
        self.instances_ok = instances_ok

    def __repr__(self) -> str:
        return f"Kind({self.name!r})"


def _command() -> type:
    from llmtrain.core_mesh.cli import Command  # cli builds on this module

    return Command


# the torch objects (model, optimizer, schedule) are Any: core-mesh does not import torch
MODEL: Kind[Any] = Kind("model", "llmtrain_models")
OPTIMIZER: Kind[Any] = Kind("optimizer", "llmtrain_optimizers")
LR_SCHEDULER: Kind[Any] = Kind("lr_scheduler", "llmtrain_lr_schedulers")
LOGGER: Kind[MetricsSink] = Kind("logger", "llmtrain_loggers", lambda: MetricsSink)
TOKENIZER: Kind[Tokenizer] = Kind("tokenizer", "llmtrain_tokenizers", lambda: Tokenizer)
PARALLEL: Kind[ParallelStrategy] = Kind(
    "parallel", "llmtrain_parallel_strategies", lambda: ParallelStrategy
)
COMMAND: Kind[Command] = Kind("command", "llmtrain_commands", _command, instances_ok=True)
WEIGHTS: Kind[WeightFormat] = Kind(
    "weights", "llmtrain_weight_formats", lambda: WeightFormat, instances_ok=True
)
# a callback need not subclass Callback (any object with event methods is one): train-loop
# checks what a callback plugin built, with the run config's `callbacks[i]` in its message
CALLBACK: Kind[Callback] = Kind("callback", "llmtrain_callbacks")
TASK: Kind[Task] = Kind("task", "llmtrain_tasks", lambda: Task)
OBJECTIVE: Kind[Objective] = Kind("objective", "llmtrain_objectives", lambda: Objective)
# an input format is data-pack's type (`llmtrain.data_pack.formats.InputFormat`), which core-mesh
# does not import: data-pack checks what a format plugin built, naming the plugin
DATA_FORMAT: Kind[Any] = Kind("data_format", "llmtrain_data_formats")

# kind -> the hook that registers entries of that kind (configs and the CLI name kinds by string)
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
    "objective": "llmtrain_objectives",
    "data_format": "llmtrain_data_formats",
}
# the kinds with a typed key; a kind added to KINDS without one builds as Any
_TYPED: dict[str, Kind[Any]] = {
    kind.name: kind
    for kind in (
        *(MODEL, OPTIMIZER, LR_SCHEDULER, LOGGER, TOKENIZER, PARALLEL),
        *(COMMAND, WEIGHTS, CALLBACK, TASK, OBJECTIVE, DATA_FORMAT),
    )
}


def kind_of(name: str) -> Kind[Any]:
    """The typed key of a kind named by string (`Choice.of("logger")`, `registry("logger")`)."""
    if name not in KINDS:
        raise UnknownEntryError(f"unknown plugin kind {name!r}; kinds are: {', '.join(KINDS)}")
    return _TYPED.get(name) or Kind(name, KINDS[name])


class Register(Protocol):
    """The `register` every hook receives: one call per entry; `target(options, *args)` builds
    the entry's object (see the hook's docstring for the args and what it returns)."""

    def __call__(
        self,
        name: str,
        target: Callable[..., object],
        *,
        options: type | None = None,
        help: str = "",
        defaults: Mapping[str, object] | None = None,
    ) -> None: ...


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
        """Register `llmtrain` subcommands; target: `target(None)` returns a
        `llmtrain.core_mesh.cli.Command` (an instance is still accepted, deprecated)."""

    @hookspec
    def llmtrain_weight_formats(self, register: Register) -> None:
        """Register formats of model weights a run can start from (`init: {from: PATH}`);
        target: `target(None)` returns a `llmtrain.core_mesh.interfaces.WeightFormat` (an
        instance is still accepted, deprecated)."""

    @hookspec
    def llmtrain_callbacks(self, register: Register) -> None:
        """Register training callbacks (`callbacks: [{kind: NAME, ...}]` in a run config);
        target: `target(options)` returns a `llmtrain.core_mesh.interfaces.Callback`."""

    @hookspec
    def llmtrain_tasks(self, register: Register) -> None:
        """Register downstream evaluation tasks (HellaSwag, ARC, ...; `llmtrain eval-tasks` and
        the `downstream` callback); target: `target(options)` returns a
        `llmtrain.core_mesh.interfaces.Task`."""

    @hookspec
    def llmtrain_objectives(self, register: Register) -> None:
        """Register training objectives (`training.objective: {kind: NAME, ...}`); target:
        `target(options, context: ObjectiveContext)` returns a
        `llmtrain.core_mesh.interfaces.Objective`."""

    @hookspec
    def llmtrain_data_formats(self, register: Register) -> None:
        """Register input formats of `llmtrain data pack` and `train-tokenizer` (JSONL,
        Parquet, CSV, ...: `--input-format NAME`, or chosen by a file's suffix); target:
        `target(options)` returns a `llmtrain.data_pack.formats.InputFormat`."""


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
    target: Callable[..., Any]  # the factory: `target(options, *args)`
    options: type | None
    help: str
    origin: Origin
    defaults: Mapping[str, object] = attrs.field(factory=dict)


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

    def registry(self, kind: str | Kind[object]) -> Registry:
        return self._collect()[kind_of(kind if isinstance(kind, str) else kind.name).name]

    def entries(self) -> list[Entry]:
        return [entry for registry in self._collect().values() for entry in registry.values()]

    # -- building ----------------------------------------------------------------------------

    def options_of(self, kind: str | Kind[object], choice: Choice | str) -> Any:
        """The options of a `kind:` choice (a `Choice.of(kind)`, or an entry's name): its
        structured options; when it has none (a choice made in code,
        `Choice.of("parallel")(kind="default")`), the entry's defaults structured into its
        options class, as a config section `{kind: NAME}` would give them; None when the entry
        takes no options."""
        name, options = (choice, None) if isinstance(choice, str) else (choice.kind, choice.options)
        if options is not None:
            return options
        entry = self.registry(kind).get(name)
        if entry.options is None:
            return None
        from llmtrain.core_mesh.config import structure  # config builds on this module

        where = f"{entry.kind} {name!r} of {entry.origin.describe()} (its defaults)"
        return structure(dict(entry.defaults), entry.options, plugins=self, source=where)

    @overload
    def build(self, kind: Kind[T], choice: Choice | str, /, *args: object) -> T: ...

    @overload
    def build(self, kind: str, choice: Choice | str, /, *args: object) -> Any: ...

    def build(self, kind: Kind[object] | str, choice: Choice | str, /, *args: object) -> Any:
        """What the chosen entry builds: `entry.target(self.options_of(kind, choice), *args)`
        (a model from its options, an optimizer from its options and the model, ...). With a
        typed kind (`LOGGER`) it is typed as the kind's Protocol; a factory that returns
        something else is a UserError naming the plugin. `choice` may be an entry's name (its
        default options)."""
        typed = kind_of(kind) if isinstance(kind, str) else kind
        entry = self.registry(typed).get(choice if isinstance(choice, str) else choice.kind)
        if not callable(entry.target):
            raise UserError(
                f"{entry.kind} {entry.name!r} of {entry.origin.describe()} is registered with a "
                f"{type(entry.target).__name__} as its target; the target must be a factory, "
                "`target(options, ...)`"
            )
        built = entry.target(self.options_of(typed, choice), *args)
        if typed.product is not None:
            _check_product(entry, built, typed.product())
        return built

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

    def _collect_one(self, kind: str, impl: pluggy.HookImpl, entries: dict[str, Entry]) -> None:
        origin = self._origins.get(impl.plugin_name, Origin(impl.plugin_name))
        found: list[Entry] = []

        def register(
            name: str,
            target: Callable[..., object],
            *,
            options: type | None = None,
            help: str = "",
            defaults: Mapping[str, object] | None = None,
        ) -> None:
            if not isinstance(name, str) or not name:
                raise TypeError(f"a {kind} name must be a non-empty string, got {name!r}")
            target = _factory(kind_of(kind), name, target, origin)
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


def _factory(kind: Kind[Any], name: str, target: Any, origin: Origin) -> Callable[..., Any]:
    """The entry's factory: `target` itself, or for a kind that still takes instances (commands,
    weight formats) an instance wrapped into a factory that returns it, with a warning."""
    product = kind.product() if kind.instances_ok and kind.product is not None else None
    if product is not None and not isinstance(target, type) and _provides(target, product):
        warnings.warn(
            f"{kind.name} {name!r} of {origin.describe()} is registered as an instance; register "
            f"a factory instead: register({name!r}, lambda options: instance, ...)",
            DeprecationWarning,
            stacklevel=3,
        )
        return lambda options, *args: target
    return target  # type: ignore[no-any-return]  # `build` checks that it is callable


def _provides(obj: object, product: type) -> bool:
    """Whether `obj` is a `product`: isinstance for a class; for a Protocol, whether it has
    every member, looked up statically (isinstance would evaluate properties, which may load)."""
    if not getattr(product, "_is_protocol", False):
        return isinstance(obj, product)
    return not _missing(obj, product)


def _missing(obj: object, protocol: type) -> list[str]:
    members = [
        name
        for name in (*vars(protocol), *getattr(protocol, "__annotations__", {}))
        if not name.startswith("_") or name == "__call__"
    ]
    absent = object()
    # static first (a property is not run); hasattr only for what that misses, e.g. a member a
    # wrapper serves through __getattr__
    return [
        name
        for name in members
        if inspect.getattr_static(obj, name, absent) is absent and not hasattr(obj, name)
    ]


def _check_product(entry: Entry, built: object, product: type) -> None:
    if _provides(built, product):
        return
    missing = _missing(built, product) if getattr(product, "_is_protocol", False) else []
    lacks = f" (it has no {', '.join(missing)})" if missing else ""
    raise UserError(
        f"{entry.kind} {entry.name!r} of {entry.origin.describe()} built a "
        f"{type(built).__name__}, not a {product.__name__}{lacks}; its factory "
        f"`target(options, ...)` must return a {product.__name__}"
    )


def _problem(origin: Origin, error: str, exc: BaseException | None = None) -> PluginProblem:
    detail = "".join(traceback.format_exception(exc)) if exc is not None else ""
    return PluginProblem(origin, error, detail)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


if TYPE_CHECKING:
    from typing import assert_type

    from llmtrain.core_mesh.interfaces import RunInfo

    def _typed_builds(plugins: PluginManager, run_info: RunInfo) -> None:
        """Checked by mypy (`nox -s typecheck`), never run: a build with a typed kind is typed as
        the kind's Protocol, one with a kind named by string as Any."""
        assert_type(plugins.build(LOGGER, "jsonl", run_info), MetricsSink)
        assert_type(plugins.build(TOKENIZER, "bytes"), Tokenizer)
        assert_type(plugins.build(PARALLEL, "default"), ParallelStrategy)
        assert_type(plugins.build(COMMAND, "plugins"), Command)
        assert_type(plugins.build(WEIGHTS, "hf"), WeightFormat)
        assert_type(plugins.build(CALLBACK, "throughput"), Callback)
        assert_type(plugins.build(TASK, "hellaswag"), Task)
        assert_type(plugins.build(OBJECTIVE, "cross_entropy", run_info), Objective)
        assert_type(plugins.build("logger", "jsonl", run_info), Any)
