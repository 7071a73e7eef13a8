"""Strict config: YAML -> attrs classes through cattrs, every problem reported at once with its path.

- Unknown keys, wrong scalar types ("false" for a bool, 1.7 for an int), missing keys and failed
  validators are all collected and raised as one `ConfigError`, each with its dotted path
  (`model.n_heads`) and, where the YAML says, `file:line`.
- A component is chosen by `kind:`. A field typed `Choice.of("model")` looks the kind up in the
  plugin registry and structures the remaining keys into that entry's own attrs options class.
- Overrides `a.b.c=value` (values parsed as YAML scalars) are applied before structuring.
- `dump_config` writes YAML that loads back to an equal config.
- A field whose YAML key is not a Python name (`from`) says so in its metadata:
  `from_: str = attrs.field(metadata={YAML_KEY: "from"})`; structuring, dumping, overrides and
  error messages all use the YAML key.

Options classes raise `ConfigValueError(field, message)` from `__attrs_post_init__` for checks
that span fields, so the error names the right path (`field` may be a path below the class:
`("train", 0, "weight")`).

A config file is read as UTF-8 text (`read_config_text`): a binary or otherwise undecodable file
is one problem naming the file. A field that names a path of the run directory is checked by
`inside_run_dir("file" | "directory")`, which also marks it (`RUN_PATH` metadata) so that the
paths a run will write can be checked before it starts.
"""

from __future__ import annotations

import math
import re
import types
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path, PurePath
from typing import Any, ClassVar, Literal, TypeAlias, TypeVar

import attrs
import cattrs
import yaml
from cattrs.errors import (
    AttributeValidationNote,
    BaseValidationError,
    ClassValidationError,
    ForbiddenExtraKeysError,
    IterableValidationError,
    IterableValidationNote,
)
from cattrs.gen import make_dict_structure_fn, make_dict_unstructure_fn, override

from llmtrain.core_mesh.errors import UserError, did_you_mean
from llmtrain.core_mesh.plugins import PluginManager

T = TypeVar("T")
PathParts = tuple[str | int, ...]
# what a hook factory of the strict converter returns: (parsed YAML, the target type) -> value
StructureFn: TypeAlias = Callable[[object, type], object]

# attrs field metadata: the key the field has in YAML when it differs from the attribute name
# (a Python keyword such as `from`)
YAML_KEY = "llmtrain.yaml_key"
# attrs field metadata: the field is a path relative to the run directory ("file" or
# "directory"), set by `inside_run_dir`
RUN_PATH = "llmtrain.run_path"


def yaml_key(field: attrs.Attribute[T]) -> str:
    """The key of an attrs field in YAML: its `YAML_KEY` metadata, else its name."""
    return field.metadata.get(YAML_KEY) or field.name


def _renames(cls: type) -> dict[str, Any]:
    """cattrs overrides for the fields of `cls` whose YAML key is not their attribute name.
    (Values typed Any: they are passed as keyword arguments to cattrs' `make_dict_*_fn`, whose
    other keyword parameters mypy would check them against.)"""
    return {
        a.name: override(rename=yaml_key(a)) for a in attrs.fields(cls) if yaml_key(a) != a.name
    }


def _key_of(cls: object, name: str) -> str:
    """The YAML key of the attribute `name` of `cls` (cattrs reports attribute names)."""
    if isinstance(cls, type) and attrs.has(cls):
        for a in attrs.fields(cls):
            if a.name == name:
                return yaml_key(a)
    return name


# -- errors ------------------------------------------------------------------------------------


@attrs.frozen
class Problem:
    path: PathParts
    message: str
    where: str | None = None  # "file:line" or "override a.b=1"

    @property
    def dotted(self) -> str:
        return format_path(self.path)

    def __str__(self) -> str:
        # a problem of the whole file (unreadable, invalid YAML, not a mapping) names no key
        parts = [self.where, self.dotted, self.message]
        return ": ".join(part for part in parts if part)


class ConfigError(UserError):
    """One or more config problems; `str()` is one line for one problem (`file:line: path:
    message`), else a count and one line per problem."""

    def __init__(self, problems: Sequence[Problem], source: str | None = None):
        self.problems = list(problems)
        self.source = source
        head = f"{source}: " if source else ""
        n = len(self.problems)
        if n == 1:
            [problem] = self.problems
            # named once: the problem's own `file:line` names the file already
            named = source and problem.where and problem.where.startswith(source)
            super().__init__(str(problem) if named else f"{head}{problem}")
            return
        lines = [f"{head}{n} config problem{'s' if n != 1 else ''}:"]
        lines += [f"  {p}" for p in self.problems]
        super().__init__("\n".join(lines))


class ConfigValueError(ValueError):
    """Raised by options classes for a bad value; `field` names the offending key (or a path
    below the class, `("train", 0, "weight")`; `path` is always the tuple and `field` its
    dotted form)."""

    def __init__(self, field: str | PathParts, message: str):
        self.path: PathParts = tuple(field) if isinstance(field, tuple) else (field,)
        self.field = format_path(self.path)
        super().__init__(message)


def format_path(path: PathParts) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


# -- YAML with line numbers --------------------------------------------------------------------


class _Lined(dict[object, object]):
    """A mapping that remembers the line of each key (1-based)."""

    lines: dict[object, int]


class _LinedList(list[object]):
    lines: list[int]


# What a config may hold, bounded before anything expands it: values once aliases are expanded
# (a "billion laughs" of nested aliases would otherwise expand past any memory while the config
# is structured), levels of nesting (Python's recursion ends near a few hundred), digits of a
# number (no option takes more than 2**64, 20 digits)
MAX_VALUES = 100_000
MAX_DEPTH = 100
MAX_DIGITS = 100


class _Refused(yaml.MarkedYAMLError):
    """YAML that parses but is refused: too many values, too deep, a number too large."""


class _Loader(yaml.SafeLoader):
    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0
        # each composed node's size with its aliases expanded (id: the node stays in the tree)
        self._sizes: dict[int, int] = {}

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        if self.check_event(yaml.AliasEvent):  # a node composed before, its size known
            return super().compose_node(parent, index)
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise _Refused(
                    None,
                    None,
                    f"nested more than {MAX_DEPTH} levels deep; no config needs that many",
                    None if parent is None else parent.start_mark,
                )
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        if node is None:
            return None
        children: list[yaml.Node] = []
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        size = 1 + sum(self._sizes.get(id(child), 1) for child in children)
        if size > MAX_VALUES:
            raise _Refused(
                None,
                None,
                f"this value holds more than {MAX_VALUES} values once its aliases (*name) are "
                "expanded (nested aliases, a YAML alias bomb?); write the values out instead",
                node.start_mark,
            )
        self._sizes[id(node)] = size
        return node


# PyYAML follows YAML 1.1, where `3e-4` is a string; people mean a float.
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+][0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def _construct_mapping(loader: _Loader, node: yaml.MappingNode) -> _Lined:
    loader.flatten_mapping(node)
    out = _Lined()
    out.lines = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key in out:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark
            )
        out[key] = loader.construct_object(value_node, deep=True)
        out.lines[key] = key_node.start_mark.line + 1
    return out


def _construct_sequence(loader: _Loader, node: yaml.SequenceNode) -> _LinedList:
    out = _LinedList(loader.construct_object(child, deep=True) for child in node.value)
    out.lines = [child.start_mark.line + 1 for child in node.value]
    return out


def _construct_int(loader: _Loader, node: yaml.ScalarNode) -> int:
    digits = sum(c.isdigit() for c in str(node.value))
    if digits > MAX_DIGITS:
        raise _Refused(
            None,
            None,
            f"a number of {digits} digits; no option takes more than {MAX_DIGITS}",
            node.start_mark,
        )
    value: int = loader.construct_yaml_int(node)
    return value


def _construct_float(loader: _Loader, node: yaml.ScalarNode) -> float:
    value: float = loader.construct_yaml_float(node)
    if math.isinf(value) and "inf" not in str(node.value).lower():
        shown = node.value if len(node.value) <= 20 else f"{node.value[:20]}..."
        raise _Refused(
            None,
            None,
            f"{shown} is beyond the largest number a float holds (about 1.8e308)",
            node.start_mark,
        )
    return value


_Loader.add_constructor("tag:yaml.org,2002:int", _construct_int)
_Loader.add_constructor("tag:yaml.org,2002:float", _construct_float)
_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_SEQUENCE_TAG, _construct_sequence)


def parse_yaml(text: str, source: str = "<string>") -> object:
    """Parse YAML (safe subset) keeping line numbers; syntax errors become a ConfigError."""
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader derives from SafeLoader
    except yaml.reader.ReaderError as exc:  # a character YAML does not allow (a NUL byte)
        line = text.count("\n", 0, exc.position) + 1
        problem = f"character {exc.character!r} is not allowed in YAML (a binary file?)"
        raise ConfigError([Problem((), problem, f"{source}:{line}")], source) from None
    except _Refused as exc:
        where = f"{source}:{exc.problem_mark.line + 1}" if exc.problem_mark else source
        raise ConfigError([Problem((), str(exc.problem), where)], source) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{source}:{mark.line + 1}" if mark is not None else source
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError([Problem((), f"invalid YAML: {problem}", where)], source) from None


def line_of(raw: object, path: PathParts) -> int | None:
    """The line (1-based) of the key at `path` in YAML parsed by `parse_yaml` (of the deepest
    key on the path that is there), or None."""
    return _line_of(raw, path)


def _line_of(raw: object, path: PathParts) -> int | None:
    line = None
    node = raw
    for part in path:
        if isinstance(node, _Lined) and part in node.lines:
            line = node.lines[part]
            node = node[part]
        elif isinstance(node, _LinedList) and isinstance(part, int) and part < len(node.lines):
            line = node.lines[part]
            node = node[part]
        else:
            break
    return line


# -- overrides ---------------------------------------------------------------------------------


def key_path(key: str) -> PathParts:
    """`a.b.0.c` -> ("a", "b", 0, "c"): a dotted key as a config path (digits index lists)."""
    return tuple(int(p) if p.isdigit() else p for p in key.strip().split("."))


def parse_override(text: str) -> tuple[PathParts, object]:
    """`a.b.0.c=value` -> (("a", "b", 0, "c"), parsed value)."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(
            [Problem((), "an override looks like key.path=value", f"override {text!r}")]
        )
    path = key_path(key)
    if any(p == "" for p in path):
        raise ConfigError([Problem((), "empty key in the dotted path", f"override {text!r}")])
    parsed = parse_yaml(value, f"override {text!r}") if value.strip() else None
    parsed = "" if parsed is None and value.strip() == "" else parsed
    return path, parsed


def apply_overrides(raw: object, overrides: Iterable[str]) -> tuple[object, dict[PathParts, str]]:
    """Apply dotted overrides to parsed YAML; returns the new data and, for each overridden
    path, where it was set (`override 'a.b=1'`), for `structure(overridden=...)`."""
    raw = {} if raw is None else raw
    applied: dict[PathParts, str] = {}
    for text in overrides:
        path, value = parse_override(text)
        applied[path] = f"override {text!r}"
        set_value(raw, path, value, where=applied[path])
    return raw, applied


def set_value(raw: object, path: PathParts, value: object, *, where: str) -> None:
    """Set `value` at `path` in parsed YAML, making mappings on the way; `where` names the
    source of the change in errors (list indexes must exist)."""
    # Any: the last key is set on whatever the path leads to (a scalar raises TypeError there)
    node: Any = raw
    for i, part in enumerate(path[:-1]):
        if isinstance(node, list) and isinstance(part, int) and part < len(node):
            node = node[part]
        elif isinstance(node, dict):
            nxt = node.get(part)
            if nxt is None:
                nxt = node[part] = {}
            node = nxt
        else:
            raise ConfigError([Problem(path[: i + 1], "cannot set a key inside this value", where)])
        if not isinstance(node, (dict, list)):
            raise ConfigError(
                [Problem(path[: i + 1], "is not a mapping; cannot set a key inside it", where)]
            )
    last = path[-1]
    if isinstance(node, list):
        if not isinstance(last, int) or last >= len(node):
            raise ConfigError([Problem(path, "list index out of range", where)])
    node[last] = value


# -- the kind-selected component ---------------------------------------------------------------


@attrs.frozen
class Choice:
    """A component chosen by `kind:`, with that entry's structured options (or None).

    A choice made in code may leave `options` None; `PluginManager.options_of(kind, choice)`
    then gives the entry's defaults, and `PluginManager.build(kind, choice, ...)` builds it."""

    kind: str
    # Any, not a type parameter: the options class is the chosen entry's (`NetOptions` for one
    # model, `MoEOptions` for another), known only once the config names the entry
    options: Any = None

    plugin_kind: ClassVar[str] = ""
    _types: ClassVar[dict[str, type[Choice]]] = {}

    @classmethod
    def of(cls, plugin_kind: str) -> type[Choice]:
        """The Choice type for one plugin kind, e.g. `model: Choice.of("model")`."""
        if plugin_kind not in cls._types:
            name = "".join(p.title() for p in plugin_kind.split("_")) + "Choice"
            cls._types[plugin_kind] = type(name, (cls,), {"plugin_kind": plugin_kind})
        return cls._types[plugin_kind]


# -- the strict converter ----------------------------------------------------------------------


def _type_name(value: object) -> str:
    if value is None:
        return "null"
    names: dict[type, str] = {dict: "mapping", _Lined: "mapping", list: "list", _LinedList: "list"}
    return names.get(type(value), type(value).__name__)


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _expect(kind: str, value: object) -> TypeError:
    return TypeError(f"expected {kind}, got {_type_name(value)} {_shown(value)}")


def _strict_int(value: object, _: type) -> int:
    if type(value) is not int:
        raise _expect("int", value)
    return value


def _strict_float(value: object, _: type) -> float:
    if type(value) is not int and type(value) is not float:
        raise _expect("float", value)
    if not math.isfinite(value):
        # no option means infinity or NaN (YAML's .inf / .nan); an unbounded option takes null
        raise ValueError(f"expected a finite number, got {_shown(value)}")
    return float(value)


def _strict_bool(value: object, _: type) -> bool:
    if type(value) is not bool:
        raise _expect("bool (true or false)", value)
    return value


def _strict_str(value: object, _: type) -> str:
    if type(value) is not str:
        raise _expect("str", value)
    return value


class _NestedProblems(Exception):
    """Problems found below a path that cattrs does not know about (kind-selected options)."""

    def __init__(self, problems: list[Problem]):
        self.problems = problems
        super().__init__("; ".join(map(str, problems)))


def make_converter(plugins: PluginManager | None = None) -> cattrs.Converter:
    """A converter that structures strictly; `Choice` fields look kinds up in `plugins`."""
    conv = cattrs.Converter(forbid_extra_keys=True, detailed_validation=True)
    conv.register_structure_hook(int, _strict_int)
    conv.register_structure_hook(float, _strict_float)
    conv.register_structure_hook(bool, _strict_bool)
    conv.register_structure_hook(str, _strict_str)
    conv.register_structure_hook_factory(_origin_is(list), lambda cls: _list_hook(conv, cls))
    conv.register_structure_hook_factory(_origin_is(tuple), lambda cls: _tuple_hook(conv, cls))
    conv.register_structure_hook_factory(_origin_is(Literal), _literal_hook)
    conv.register_structure_hook_factory(_is_one_or_list, lambda cls: _one_or_list_hook(conv, cls))
    conv.register_structure_hook_factory(_is_options, lambda cls: _attrs_hook(conv, cls))
    conv.register_unstructure_hook_factory(
        _is_options, lambda cls: make_dict_unstructure_fn(cls, conv, **_renames(cls))
    )
    conv.register_structure_hook_factory(_is_choice, lambda cls: _choice_hook(conv, plugins, cls))
    conv.register_unstructure_hook_factory(
        _is_choice,
        lambda cls: lambda c: {"kind": c.kind, **(conv.unstructure(c.options) or {})},
    )
    return conv


def _is_options(cls: object) -> bool:
    """An attrs class structured field by field (a `Choice` is structured by its kind)."""
    return isinstance(cls, type) and attrs.has(cls) and not issubclass(cls, Choice)


def _is_choice(cls: object) -> bool:
    return isinstance(cls, type) and issubclass(cls, Choice)


def _attrs_hook(conv: cattrs.Converter, cls: type) -> StructureFn:
    """Structure an attrs class with its validators run after every field has structured, so
    one error lists every field's problem (cattrs would stop at the first validator)."""
    base: cattrs.SimpleStructureHook[Mapping[str, object], object] = make_dict_structure_fn(
        cls, conv, **_renames(cls)
    )
    validated = [a for a in attrs.fields(cls) if a.validator is not None]

    def structure(value: object, _: type) -> object:
        if not isinstance(value, Mapping):
            raise _expect("a mapping", value)
        with attrs.validators.disabled():
            try:
                obj = base(value, cls)
            except BaseValidationError as exc:
                raise _NestedProblems(_structure_problems(conv, cls, value, exc)) from None
            except ConfigValueError as exc:  # a cross-field check in __attrs_post_init__
                own = _field_problems(conv, cls, value, skip=set())
                raise _NestedProblems(own or [Problem(exc.path, str(exc))]) from None
        problems = []
        for a in validated:
            try:
                a.validator(obj, a, getattr(obj, a.name))
            except (ValueError, TypeError) as exc:
                problems.append(Problem((yaml_key(a),), _validator_message(exc)))
        if problems:
            raise _NestedProblems(problems)
        return obj

    return structure


def _structure_problems(
    conv: cattrs.Converter, cls: type, value: Mapping[str, object], exc: BaseValidationError
) -> list[Problem]:
    """cattrs' errors for `value`, plus the validator problems of the fields that did
    structure."""
    with_notes, without = _grouped(exc)
    failed = {
        _key_of(cls, note.name)
        for _, note in with_notes
        if isinstance(note, AttributeValidationNote)
    }
    own = _field_problems(conv, cls, value, skip=failed)
    problems = list(_noted_problems(exc, ()))
    for sub in without:
        # __attrs_post_init__'s own errors are left out when a field fails its validator: the
        # check ran on a value already refused (validators are off while structuring) and
        # would only repeat it (`integer modulo by zero`); unknown keys are always said
        if not own or isinstance(sub, ForbiddenExtraKeysError):
            problems += _problems_from(sub, (), None)
    return problems + own


def _choice_hook(
    conv: cattrs.Converter, plugins: PluginManager | None, cls: type[Choice]
) -> StructureFn:
    """Structure a `Choice`: its `kind` looked up in `plugins`, the other keys (over the
    entry's defaults) structured as that kind's options."""

    def structure(value: object, _: type) -> Choice:
        if plugins is None:
            raise TypeError(f"no plugin registry to choose a {cls.plugin_kind} kind from")
        if not isinstance(value, Mapping):
            raise _expect(f"a mapping with a 'kind' key naming a {cls.plugin_kind}", value)
        kind = _kind_of(value, plugins, cls.plugin_kind)
        try:
            entry = plugins.registry(cls.plugin_kind).get(kind)
        except UserError as exc:
            raise _NestedProblems([Problem(("kind",), str(exc))]) from None
        given = {k: v for k, v in value.items() if k != "kind"}
        rest = {**entry.defaults, **given}
        if entry.options is None:
            if rest:
                extra = ", ".join(map(str, rest))
                raise _NestedProblems(
                    [
                        Problem((k,), f"{cls.plugin_kind} {kind!r} takes no options ({extra})")
                        for k in rest
                    ]
                )
            return cls(kind, None)
        if isinstance(value, _Lined):
            rest = _Lined(rest)
            rest.lines = value.lines
        return cls(kind, conv.structure(rest, entry.options))

    return structure


def _kind_of(value: Mapping[str, object], plugins: PluginManager, plugin_kind: str) -> str:
    """A choice's `kind` key, a string; missing, the error lists the installed kinds."""
    kind = value.get("kind")
    if kind is None:
        known = ", ".join(plugins.registry(plugin_kind).names()) or "none installed"
        raise _NestedProblems([Problem(("kind",), f"missing; known {plugin_kind} kinds: {known}")])
    if type(kind) is not str:
        raise _NestedProblems([Problem(("kind",), str(_expect("str", kind)))])
    return kind


def _literal_hook(cls: object) -> StructureFn:
    allowed = typing.get_args(cls)

    def structure(value: object, _: type) -> object:
        if not any(type(value) is type(a) and value == a for a in allowed):
            choices = ", ".join(repr(a) for a in allowed)
            raise ValueError(f"expected one of {choices}, got {_shown(value)}")
        return value

    return structure


def _list_hook(conv: cattrs.Converter, cls: type) -> StructureFn:
    from cattrs.cols import list_structure_factory

    items = list_structure_factory(cls, conv)

    def structure(value: object, _: type) -> object:
        # cattrs would take a string as its characters and a mapping as its keys
        if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
            raise _expect("a list", value)
        return items(value, cls)

    return structure


def _tuple_hook(conv: cattrs.Converter, cls: type) -> StructureFn:
    args = typing.get_args(cls)
    fixed = bool(args) and args[-1] is not Ellipsis

    def structure(value: object, _: type) -> object:
        # cattrs would take a string as its characters, and name a short list's length only as
        # "not enough values"
        if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
            raise _expect(f"a list of {len(args)}" if fixed else "a list", value)
        items = list(value)
        if fixed and len(items) != len(args):
            raise ValueError(f"expected a list of {len(args)}, got {_shown(items)}")
        return conv._structure_tuple(items, cls)

    return structure


def _one_or_list_parts(t: object) -> tuple[type, Any] | None:
    """(C, list[C]) of `C | list[C]` (with or without `| None`), C an attrs class; else None."""
    if typing.get_origin(t) not in (typing.Union, types.UnionType):
        return None
    parts = [a for a in typing.get_args(t) if a is not type(None)]
    one = next((a for a in parts if isinstance(a, type) and attrs.has(a)), None)
    if len(parts) != 2 or one is None or list[one] not in parts:  # type: ignore[valid-type]
        return None
    return one, list[one]  # type: ignore[valid-type]


def _is_one_or_list(t: object) -> bool:
    return _one_or_list_parts(t) is not None


def _one_or_list_hook(conv: cattrs.Converter, cls: object) -> StructureFn:
    """An option that takes one item or a list of them (`eval: {...}` or `eval: [{...}, ...]`):
    a mapping is the one, a list the list, null (where allowed) None."""
    parts = _one_or_list_parts(cls)
    assert parts is not None
    one, many = parts
    optional = type(None) in typing.get_args(cls)

    def structure(value: object, _: type) -> object:
        if value is None and optional:
            return None
        if isinstance(value, Mapping):
            return conv.structure(value, one)
        if isinstance(value, list):
            return conv.structure(value, many)
        raise _expect("a mapping or a list of mappings", value)

    return structure


def _origin_is(origin: object) -> Callable[[object], bool]:
    """A hook factory's predicate: the type's `typing.get_origin` is `origin`."""

    def predicate(t: object) -> bool:
        return typing.get_origin(t) is origin

    return predicate


def _field_problems(
    conv: cattrs.Converter, cls: type, value: Mapping[str, object], *, skip: set[str]
) -> list[Problem]:
    """Validator problems of the fields of `value` that structure on their own."""
    problems = []
    for a in attrs.fields(cls):
        key = yaml_key(a)
        if a.validator is None or key in skip or key not in value:
            continue
        try:
            field = conv.structure(value[key], a.type)
        except Exception:  # noqa: BLE001, S112 - cattrs reports this field's own error
            continue
        try:
            a.validator(None, a, field)
        except (ValueError, TypeError) as exc:
            problems.append(Problem((key,), _validator_message(exc)))
        except AttributeError:  # a validator that reads other fields waits for the whole object
            pass
    return problems


def _validator_message(exc: Exception) -> str:
    # attrs' own validators put a tuple in args; their first element is the readable sentence
    first = exc.args[0] if exc.args else str(exc)
    return first if isinstance(first, str) else str(exc)


def _grouped(
    exc: BaseValidationError,
) -> tuple[
    list[tuple[Exception, AttributeValidationNote | IterableValidationNote]], list[Exception]
]:
    """`exc.group_exceptions()`: the sub-exceptions with a field or index note, and the others.
    (cattrs raises only the two subclasses that have it; any other has no notes to go by.)"""
    if isinstance(exc, ClassValidationError | IterableValidationError):
        with_notes, without = exc.group_exceptions()
        return list(with_notes), without
    return [], list(exc.exceptions)


def _noted_problems(exc: BaseValidationError, path: PathParts) -> Iterator[Problem]:
    """The problems of the sub-exceptions cattrs noted with a field or an index."""
    for sub, note in _grouped(exc)[0]:
        step: str | int = (
            _key_of(exc.cl, note.name) if isinstance(note, AttributeValidationNote) else note.index
        )
        yield from _problems_from(sub, (*path, step), None)


def _problems_from(
    exc: BaseException, path: PathParts, schema_fields: type | None
) -> Iterator[Problem]:
    if isinstance(exc, _NestedProblems):
        for p in exc.problems:
            yield attrs.evolve(p, path=path + p.path)
    elif isinstance(exc, ForbiddenExtraKeysError):
        known = [yaml_key(a) for a in attrs.fields(exc.cl)] if attrs.has(exc.cl) else []
        for key in sorted(exc.extra_fields, key=str):
            hint = did_you_mean(str(key), known)
            yield Problem((*path, key), f"unknown key{hint}; allowed: {', '.join(known)}")
    elif isinstance(exc, BaseValidationError):
        yield from _noted_problems(exc, path)
        for sub in _grouped(exc)[1]:
            yield from _problems_from(sub, path, None)
    elif isinstance(exc, ConfigValueError):
        yield Problem((*path, *exc.path), str(exc))
    elif isinstance(exc, KeyError):
        yield Problem(path, "required key is missing")
    else:
        yield Problem(path, str(exc) or type(exc).__name__)


# -- load / dump -------------------------------------------------------------------------------


def structure(
    raw: object,
    schema: type[T],
    *,
    plugins: PluginManager | None = None,
    source: str | None = None,
    overridden: Mapping[PathParts, str] | None = None,
    converter: cattrs.Converter | None = None,
    check: Callable[[T], Iterable[Problem]] | None = None,
) -> T:
    """Structure parsed YAML into `schema`, raising one ConfigError with every problem.
    `check` looks at the structured config and returns its problems (by config path), which
    are raised located like the others (`file:line`)."""
    conv = converter or make_converter(plugins)
    try:
        config = conv.structure({} if raw is None else raw, schema)
    except (BaseValidationError, _NestedProblems, TypeError) as exc:
        problems = list(_problems_from(exc, (), schema))
    else:
        problems = list(check(config)) if check is not None else []
        if not problems:
            return config
    located = [_locate(p, raw, source, overridden or {}) for p in problems]
    raise ConfigError(located, source) from None


def _locate(
    problem: Problem, raw: object, source: str | None, overridden: Mapping[PathParts, str]
) -> Problem:
    for path, where in overridden.items():
        if problem.path[: len(path)] == path:
            return attrs.evolve(problem, where=where)
    line = _line_of(raw, problem.path)
    if source is None:
        return problem
    return attrs.evolve(problem, where=f"{source}:{line}" if line else source)


def read_config_text(path: str | Path) -> str:
    """A config file's text: a file that cannot be read, or is not UTF-8 text (a binary file, a
    UTF-16 one), is one ConfigError naming it."""
    source = str(path)
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(
            [Problem((), f"cannot read the config file: {exc.strerror or exc}")], source
        ) from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            [
                Problem(
                    (),
                    f"not a YAML text file: byte 0x{data[exc.start]:02x} at offset {exc.start} "
                    "is not UTF-8 (a binary file, or text in another encoding?)",
                )
            ],
            source,
        ) from None


def load_config(
    path: str | Path,
    schema: type[T],
    *,
    plugins: PluginManager | None = None,
    overrides: Sequence[str] = (),
    prepare: Callable[[object], object] | None = None,
    check: Callable[[T], Iterable[Problem]] | None = None,
) -> T:
    """Read a YAML file, apply overrides, and structure it strictly into `schema`. `prepare`
    turns the parsed, overridden YAML into what is structured (a schema's own expansions, such
    as a run's `model: {from: PATH}`). `check` looks at the structured config and returns its
    problems (by config path), which are raised located like the others (`file:line`)."""
    source = str(path)
    raw = parse_yaml(read_config_text(path), source)
    raw, overridden = apply_overrides(raw, overrides)
    if prepare is not None:
        raw = prepare(raw)
    return structure(
        raw, schema, plugins=plugins, source=source, overridden=overridden, check=check
    )


# -- paths of the run directory ----------------------------------------------------------------


def inside_run_dir(kind: Literal["file", "directory"] = "file") -> Callable[..., None]:
    """An attrs validator for an option that names a file (or directory) of the run directory:
    a relative path may not leave it (`../x` is refused), an absolute one is a choice made on
    purpose. A directory may be `.` (the run directory itself). The validator marks the field
    `RUN_PATH` when used as `attrs.field(validator=..., metadata=run_path(kind))`."""

    def check(instance: object, attribute: attrs.Attribute[str | None], value: str | None) -> None:
        if value is None:
            return
        path = PurePath(value)
        if not value.strip():
            raise ValueError(f"must name a {kind}, got {value!r}")
        if kind == "file" and path.name in ("", ".", ".."):
            raise ValueError(f"must name a file, got {value!r}")
        if not path.is_absolute() and ".." in path.parts:
            raise ValueError(
                f"{value!r} leaves the run directory; give a path inside it, or an absolute "
                "path to write elsewhere on purpose"
            )

    return check


def run_path(kind: Literal["file", "directory"] = "file") -> dict[str, str]:
    """The attrs metadata that marks a field as a path of the run directory (see
    `inside_run_dir`)."""
    return {RUN_PATH: kind}


def run_paths(options: object) -> Iterator[tuple[str, str, str]]:
    """(YAML key, kind, value) of each field of an options object marked `RUN_PATH` that has a
    value."""
    cls = type(options)
    if options is None or not attrs.has(cls):
        return
    for field in attrs.fields(cls):
        kind = field.metadata.get(RUN_PATH)
        value = getattr(options, field.name)
        if kind and isinstance(value, str):
            yield yaml_key(field), kind, value


def unstructure(config: object, *, converter: cattrs.Converter | None = None) -> Any:
    """`config` as plain data (cattrs' `unstructure`, which is untyped: a mapping for an attrs
    class)."""
    return (converter or make_converter()).unstructure(config)


def dump_config(config: object, *, converter: cattrs.Converter | None = None) -> str:
    """YAML that `load_config` reads back into an equal config."""
    return yaml.safe_dump(unstructure(config, converter=converter), sort_keys=False)
