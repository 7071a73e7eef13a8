"""Tasks read from files: the options every built-in task takes, reading task files from a
local path or any fsspec URL with errors that name file:line, and few-shot prompts.

Loading this module imports no torch.
"""

from __future__ import annotations

import csv
import io
import json
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import fsspec

from llmtrain.core_mesh.errors import UserError
from llmtrain.core_mesh.interfaces import TaskItem

FEWSHOT_DELIMITER = "\n\n"  # between few-shot examples and before the question, as the harness


class TaskFileError(UserError):
    """A task file that cannot be read or holds a bad record; the message names file:line."""


def _non_negative(instance: object, attribute: attrs.Attribute, value: int | None) -> None:
    if value is not None and value < 0:
        raise ValueError(f"must be at least 0, got {value}")


def _positive(instance: object, attribute: attrs.Attribute, value: int | None) -> None:
    if value is not None and value < 1:
        raise ValueError(f"must be at least 1, got {value}")


@attrs.frozen(kw_only=True)
class TaskOptions:
    """Where a task's items are and how to prompt them.

    `path`: the task file (local path or fsspec URL, with `storage_options`). `limit`: score
    only the first N items. `shots`: few-shot examples before each question, drawn with `seed`
    from `fewshot_path` (default: the other items of `path`, never the question itself).
    """

    path: str
    storage_options: dict[str, Any] = attrs.field(factory=dict)
    limit: int | None = attrs.field(default=None, validator=_positive)
    shots: int = attrs.field(default=0, validator=_non_negative)
    seed: int = 1234
    fewshot_path: str | None = None


Reader = Callable[[str, TaskOptions], list[TaskItem]]


@attrs.define
class FileTask:
    """A task whose items a `reader` makes from the file at `options.path`; implements
    `llmtrain.core_mesh.interfaces.Task`. Items are read once, on the first `items()` call."""

    name: str
    scoring: str
    options: TaskOptions
    reader: Reader
    description: str = ""  # text before the first example (MMLU's subject line)
    # MMLU's rule: every question gets the same examples, the first `shots` of the pool (its dev
    # file), in file order; other tasks draw theirs at random
    first_examples: bool = False
    _items: list[TaskItem] | None = None

    def items(self) -> list[TaskItem]:
        if self._items is None:
            self._items = self._prompts()
        return self._items

    def _prompts(self) -> list[TaskItem]:
        options = self.options
        items = self.reader(options.path, options)
        if not items:
            raise TaskFileError(f"{options.path}: no items in the file ({self.name})")
        pool = items if options.fewshot_path is None else self.reader(options.fewshot_path, options)
        if options.limit is not None:
            items = items[: options.limit]
        if options.shots and self.scoring == "perplexity":
            raise UserError(f"task {self.name!r}: shots: perplexity tasks take no examples")
        same_pool = options.fewshot_path is None
        if options.shots > len(pool) - same_pool:
            raise UserError(
                f"task {self.name!r}: shots: {options.shots} examples asked for, but "
                f"{options.fewshot_path or options.path} has only {len(pool) - same_pool} to draw"
            )
        return [
            with_examples(item, self.description, self._examples(i, pool, same_pool))
            for i, item in enumerate(items)
        ]

    def _examples(self, index: int, pool: Sequence[TaskItem], same_pool: bool) -> list[TaskItem]:
        """`shots` items of the pool, never the question itself: the first ones, or drawn by a
        generator seeded by (seed, index), the same examples for an item whatever the ranks,
        batches or limit."""
        if not self.options.shots:
            return []
        candidates = [j for j in range(len(pool)) if not (same_pool and j == index)]
        if self.first_examples:
            return [pool[j] for j in candidates[: self.options.shots]]
        rng = random.Random(self.options.seed * 1_000_003 + index)  # noqa: S311 (not secret)
        return [pool[j] for j in rng.sample(candidates, self.options.shots)]


def demonstration(item: TaskItem) -> str:
    """An item solved: its (gold) context followed by its gold answer."""
    return item.context(item.gold) + item.delimiter + item.choice(item.gold)


def with_examples(item: TaskItem, description: str, examples: Sequence[TaskItem]) -> TaskItem:
    """The item with the description and the solved examples before each of its contexts."""
    prefix = description + "".join(demonstration(e) + FEWSHOT_DELIMITER for e in examples)
    if not prefix:
        return item
    return attrs.evolve(item, contexts=tuple(prefix + c for c in item.contexts))


# --- reading files ---
def read_text(path: str, options: TaskOptions) -> str:
    """The whole file as text; a missing file or a non-UTF-8 byte is a one-line error (the
    latter names the line)."""
    try:
        with fsspec.open(path, "rb", compression="infer", **options.storage_options) as f:
            data = f.read()
    except FileNotFoundError:
        raise TaskFileError(f"{path}: no such task file") from None
    except OSError as exc:
        raise TaskFileError(f"{path}: cannot read the task file: {exc}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise TaskFileError(f"{path}:{line}: not UTF-8 text (byte {exc.start})") from None


def json_lines(path: str, options: TaskOptions) -> Iterator[tuple[str, dict]]:
    """(where, record) of every non-blank line of a JSON-lines file; `where` is `path:line`.
    Only a newline ends a line: str.splitlines also splits at U+2028, U+0085, ..., which JSON
    strings may hold raw; a carriage return before the newline is JSON whitespace."""
    for number, line in enumerate(read_text(path, options).split("\n"), 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TaskFileError(f"{where}: not a JSON line: {exc.msg}") from None
        if not isinstance(record, dict):
            raise TaskFileError(f"{where}: expected a JSON object, got {type(record).__name__}")
        yield where, record


def json_records(path: str, options: TaskOptions) -> Iterator[tuple[str, dict]]:
    """Records of a JSON-lines file or of a file holding one JSON array of objects (SciQ's
    release); an array's records are named `path:line` by the line each object starts on."""
    text = read_text(path, options)
    if not text.lstrip().startswith("["):
        yield from json_lines(path, options)
        return
    decoder = json.JSONDecoder()
    position = text.index("[") + 1
    while True:
        while position < len(text) and text[position] in " \t\r\n,":
            position += 1
        if position >= len(text) or text[position] == "]":
            return
        where = f"{path}:{text.count(chr(10), 0, position) + 1}"
        try:
            record, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError as exc:
            raise TaskFileError(f"{where}: not JSON: {exc.msg}") from None
        if not isinstance(record, dict):
            raise TaskFileError(f"{where}: expected a JSON object, got {type(record).__name__}")
        yield where, record


def csv_rows(path: str, options: TaskOptions) -> Iterator[tuple[str, list[str]]]:
    """(where, row) of every non-empty row of a CSV file (quoted fields may span lines)."""
    reader = csv.reader(io.StringIO(read_text(path, options), newline=""))
    line = 1
    for row in reader:
        where = f"{path}:{line}"
        line = reader.line_num + 1
        if row:
            yield where, row


def field(record: Mapping[str, Any], name: str, kind: type | tuple[type, ...], where: str) -> Any:
    """A record's field, dotted names reaching into nested objects (`question.stem`); a missing
    field or one of the wrong type is a `TaskFileError` naming file:line and the field."""
    value: Any = record
    for part in name.split("."):
        if not isinstance(value, Mapping) or part not in value:
            raise TaskFileError(f"{where}: field {name!r} is missing")
        value = value[part]
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _as_tuple(kind)):
        names = "/".join(k.__name__ for k in _as_tuple(kind))
        raise TaskFileError(f"{where}: field {name!r} must be {names}, got {value!r:.60}")
    return value


def _as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def answer_index(value: Any, n_choices: int, name: str, where: str) -> int:
    """A gold label as an index into the choices: an int, a digit string, or a letter A-Z."""
    index: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        index = value
    elif isinstance(value, str) and value.strip().isdigit():
        index = int(value.strip())
    elif isinstance(value, str) and len(value.strip()) == 1 and value.strip().isalpha():
        index = ord(value.strip().upper()) - ord("A")
    if index is None or not 0 <= index < n_choices:
        raise TaskFileError(
            f"{where}: field {name!r}: {value!r} is not the index of one of {n_choices} choices"
        )
    return index


def choices_of(values: Any, name: str, where: str) -> tuple[str, ...]:
    """A non-empty list of strings (a question's choices)."""
    if not isinstance(values, list) or not values:
        raise TaskFileError(f"{where}: field {name!r} must be a non-empty list of choices")
    for value in values:
        if not isinstance(value, str):
            raise TaskFileError(
                f"{where}: field {name!r}: every choice must be text, got {value!r}"
            )
    return tuple(values)
