"""Tasks read from files: the options every built-in task takes, reading task files from a
local path or any fsspec URL with errors that name file:line, and few-shot prompts.

Loading this module imports no torch.
"""

from __future__ import annotations

import codecs
import csv
import io
import json
import lzma
import random
import string
import sys
import zipfile
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import attrs
import fsspec
import fsspec.compression
import fsspec.core

from llmtrain.core_mesh.errors import UserError
from llmtrain.core_mesh.interfaces import TaskItem
from llmtrain.core_mesh.json_types import JSONObject

FEWSHOT_DELIMITER = "\n\n"  # between few-shot examples and before the question, as the harness


# a validated field's type: some are optional (None: unset)
_Count = TypeVar("_Count", int, int | None)


class TaskFileError(UserError):
    """A task file that cannot be read or holds a bad record; the message names file:line."""


def _non_negative(instance: object, attribute: attrs.Attribute[_Count], value: _Count) -> None:
    if value is not None and value < 0:
        raise ValueError(f"must be at least 0, got {value}")


def _not_blank(instance: object, attribute: attrs.Attribute[str], value: str) -> None:
    if isinstance(value, str) and not value.strip():
        raise ValueError("must name the task file, got an empty path")


def _positive(instance: object, attribute: attrs.Attribute[_Count], value: _Count) -> None:
    if value is not None and value < 1:
        raise ValueError(f"must be at least 1, got {value}")


@attrs.frozen(kw_only=True)
class TaskOptions:
    """Where a task's items are and how to prompt them.

    `path`: the task file (local path or fsspec URL, with `storage_options`). `limit`: score
    only the first N items. `shots`: few-shot examples before each question, drawn with `seed`
    from `fewshot_path` (default: the other items of `path`, never the question itself).
    """

    path: str = attrs.field(validator=_not_blank)
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
        items = _text_only(self.reader(options.path, options))
        if not items:
            raise TaskFileError(f"{options.path}: no items in the file ({self.name})")
        pool = (
            items
            if options.fewshot_path is None
            else _text_only(self.reader(options.fewshot_path, options))
        )
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


def _text_only(items: list[TaskItem]) -> list[TaskItem]:
    """The items, refused where a prompt holds what is no text: JSON's `\\ud800` escapes make
    lone surrogates, which no tokenizer can encode (found here, not after the model loads)."""
    for item in items:
        for text in (*item.contexts, *item.choices):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                bad = text[exc.start]
                raise TaskFileError(
                    f"{item.where}: {bad!r} is half a surrogate pair, not a character; fix the "
                    "record's \\u escapes"
                ) from None
    return items


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
# how binary files that are no task text begin, and what to do about them (looked for only in
# a file that is not text)
_MAGIC = (
    (b"\x1f\x8b", "gzip-compressed data without a .gz suffix: name the file *.gz"),
    (b"(\xb5/\xfd", "zstd-compressed data without a .zst suffix: name the file *.zst"),
    (b"BZh", "bzip2-compressed data without a .bz2 suffix: name the file *.bz2"),
    (b"\xfd7zXZ\x00", "xz-compressed data without a .xz suffix: name the file *.xz"),
    (b"PK\x03\x04", "a zip archive without a .zip suffix: name the file *.zip"),
    (b"PAR1", "a Parquet file, which tasks do not read: export its rows as JSON lines"),
)
# what the network clients of fsspec's remote file systems raise when a store cannot be reached
# or refuses (s3fs turns most of botocore's errors into OSErrors, but not all); matched only
# among the modules already loaded: a client that raised is loaded
_TRANSPORT_ERRORS = (
    ("botocore.exceptions", "BotoCoreError"),
    ("botocore.exceptions", "ClientError"),
    ("aiohttp", "ClientError"),
    ("httpx", "HTTPError"),
    ("httpx2", "HTTPError"),
    ("requests", "RequestException"),
    ("google.auth.exceptions", "GoogleAuthError"),
)
# what decompressors raise on data cut short or damaged (zip's: no member at all, IndexError)
_DECOMPRESSION_ERRORS = (
    OSError,
    EOFError,
    ValueError,
    IndexError,
    zlib.error,
    lzma.LZMAError,
    zipfile.BadZipFile,
)
_ZSTD_ERRORS = (("zstandard", "ZstdError"), ("compression.zstd", "ZstdError"))


def _loaded(names: Sequence[tuple[str, str]]) -> tuple[type[BaseException], ...]:
    found = (getattr(sys.modules.get(module), name, None) for module, name in names)
    return tuple(kind for kind in found if isinstance(kind, type))


def read_bytes(path: str, options: TaskOptions) -> bytes:
    """The file's bytes, decompressed as its suffix says (`.gz`, `.bz2`, `.xz`, `.zst`, `.zip`).
    Every way the file cannot be had is a one-line `TaskFileError` naming it and what to do: an
    unknown protocol, a missing file or bucket, a directory, a store that cannot be reached,
    rejected `storage_options`, compressed data cut short or damaged."""
    try:
        fs, fs_path = fsspec.core.url_to_fs(path, **options.storage_options)
        compression = fsspec.core.get_compression(fs_path, "infer")
    except ValueError as exc:  # "Protocol not known: foo"
        raise TaskFileError(
            f"{path}: {exc}: give a local path or an fsspec URL (s3://, gs://, ...)"
        ) from None
    except ImportError as exc:  # the protocol's package (gcsfs, ...) is not installed
        raise TaskFileError(f"{path}: {exc}") from None
    except TypeError as exc:  # the file system's constructor refused an option
        raise TaskFileError(f"{path}: storage_options: {exc}") from None
    try:
        with fs.open(fs_path, "rb") as f:
            raw: bytes = f.read()  # a file opened "rb" reads bytes; fsspec's read is untyped
    except FileNotFoundError:
        raise TaskFileError(f"{path}: no such task file; check the path") from None
    except IsADirectoryError:
        raise TaskFileError(f"{path}: is a directory; give the task file in it") from None
    except OSError as exc:  # permission denied, an object store's refusal
        raise TaskFileError(f"{path}: cannot read the task file: {_one_line(exc)}") from None
    except _loaded(_TRANSPORT_ERRORS) as exc:
        raise TaskFileError(
            f"{path}: cannot read the task file from its store: {_one_line(exc)}; check the "
            "endpoint, the network and the credentials (storage_options)"
        ) from None
    except TypeError as exc:
        if not options.storage_options:
            raise
        # a remote file system passes its options on to its client when it first connects
        raise TaskFileError(f"{path}: storage_options: {_one_line(exc)}") from None
    except ValueError:
        # s3fs: "Attempt to open non key-like path" for a bucket
        if fs.isdir(fs_path):
            raise TaskFileError(f"{path}: is a directory; give the task file in it") from None
        raise
    if not raw and fs.isdir(fs_path):  # an object store's "directory": a prefix of keys
        raise TaskFileError(f"{path}: is a directory; give the task file in it")
    if compression is None:
        return raw
    try:
        return _decompress(raw, compression)
    except _decompression_errors() as exc:
        raise TaskFileError(
            f"{path}: not complete {compression} data ({_one_line(exc) or type(exc).__name__}): "
            f"the file is cut short, damaged or not {compression}; download it again"
        ) from None


def _decompression_errors() -> tuple[type[BaseException], ...]:
    # called as the exception is caught, so a zstd module the decompression loaded is seen
    return (*_DECOMPRESSION_ERRORS, *_loaded(_ZSTD_ERRORS))


def _decompress(raw: bytes, compression: str) -> bytes:
    # fsspec reads .zst with zstandard where the standard library has no zstd; its stream reader
    # stops without a word where the data is cut, so each frame is checked for its end here
    zstandard = sys.modules.get("zstandard")
    if compression == "zstd" and zstandard is not None:
        parts = []
        while raw:
            frame = zstandard.ZstdDecompressor().decompressobj()
            parts.append(frame.decompress(raw))
            if not frame.eof:
                raise EOFError("the data ends inside a zstd frame")
            raw = frame.unused_data
        return b"".join(parts)
    with fsspec.compression.compr[compression](io.BytesIO(raw), mode="rb") as f:
        data: bytes = f.read()  # a stream opened "rb" reads bytes; fsspec's compr is untyped
    return data


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def read_text(path: str, options: TaskOptions) -> str:
    """The whole file as text (`read_bytes`); a file that is empty, binary (a NUL byte, a
    compressed file without its suffix, Parquet) or not UTF-8 is a one-line error (naming the
    line where it can). A UTF-8 byte order mark is skipped."""
    data = read_bytes(path, options)
    bom = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
    try:
        text = data[bom:].decode("utf-8")
    except UnicodeDecodeError as exc:
        at = bom + exc.start
        raise _not_text(
            path, data, at, f"not UTF-8 text (byte {at}); task files are UTF-8"
        ) from None
    if "\0" in text:
        what = "a NUL byte: binary data, not task text; check the path"
        raise _not_text(path, data, data.find(b"\0"), what)
    if not text.strip():
        raise TaskFileError(f"{path}: the file is empty; check the path or download it again")
    return text


def _not_text(path: str, data: bytes, at: int, what: str) -> TaskFileError:
    """The error for a file that is no text: what it is when its first bytes say (compressed
    data without its suffix, Parquet), else `what` is wrong at byte `at` (named by its line)."""
    for magic, known in _MAGIC:
        if data.startswith(magic):
            return TaskFileError(f"{path}: {known}")
    line = data.count(b"\n", 0, at) + 1
    return TaskFileError(f"{path}:{line}: {what}")


def _json_error(exc: ValueError | RecursionError) -> str:
    if isinstance(exc, json.JSONDecodeError):
        return f"{exc.msg} (column {exc.colno})"
    if isinstance(exc, RecursionError):
        return "nested too deeply"
    return "a number too long to read"  # int() refuses more than 4300 digits


def json_lines(path: str, options: TaskOptions) -> Iterator[tuple[str, JSONObject]]:
    """(where, record) of every non-blank line of a JSON-lines file; `where` is `path:line`.
    Only a newline ends a line: str.splitlines also splits at U+2028, U+0085, ..., which JSON
    strings may hold raw; a carriage return before the newline is JSON whitespace."""
    text = read_text(path, options)
    lines = text.split("\n")
    first = True
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except (ValueError, RecursionError) as exc:
            raise TaskFileError(
                f"{where}: not a JSON line: {_json_error(exc)}{_why(text, lines, number, first)}"
            ) from None
        if not isinstance(record, dict):
            raise TaskFileError(f"{where}: expected a JSON object, got {_json_type(record)}")
        first = False
        yield where, record


def _why(text: str, lines: list[str], number: int, first: bool) -> str:
    """What a line that is no JSON suggests about the file: cut short, or one JSON document."""
    if number == len(lines):  # the last line, with no newline after it
        return "; the file ends inside this record: truncated? download it again"
    if first:
        try:
            whole = json.loads(text)
        except (ValueError, RecursionError):
            return ""
        return f"; the file is one JSON {_json_type(whole)}, not JSON lines (one object a line)"
    return ""


def _json_type(value: object) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    return names.get(type(value), "number")


def json_records(path: str, options: TaskOptions) -> Iterator[tuple[str, JSONObject]]:
    """Records of a JSON-lines file or of a file holding one JSON array of objects (SciQ's
    release); an array's records are named `path:line` by the line each object starts on. An
    array not closed (a file cut short) or followed by more text is an error."""
    text = read_text(path, options)
    if not text.lstrip().startswith("["):
        yield from json_lines(path, options)
        return
    decoder = json.JSONDecoder()
    position = text.index("[") + 1
    while True:
        while position < len(text) and text[position] in " \t\r\n,":
            position += 1
        where = f"{path}:{text.count(chr(10), 0, position) + 1}"
        if position >= len(text):
            raise TaskFileError(
                f"{where}: the JSON array is not closed: truncated? download it again"
            )
        if text[position] == "]":
            if text[position + 1 :].strip():
                raise TaskFileError(f"{where}: more text after the JSON array")
            return
        try:
            record, position = decoder.raw_decode(text, position)
        except (ValueError, RecursionError) as exc:
            cut = "" if text.rstrip().endswith("]") else "; the array is not closed: truncated?"
            raise TaskFileError(f"{where}: not JSON: {_json_error(exc)}{cut}") from None
        if not isinstance(record, dict):
            raise TaskFileError(f"{where}: expected a JSON object, got {_json_type(record)}")
        yield where, record


def csv_rows(path: str, options: TaskOptions) -> Iterator[tuple[str, list[str]]]:
    """(where, row) of every non-empty row of a CSV file (quoted fields may span lines)."""
    reader = csv.reader(io.StringIO(read_text(path, options), newline=""))
    line = 1
    while True:
        try:
            row = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:  # a field over csv's size limit
            raise TaskFileError(f"{path}:{reader.line_num}: not CSV: {exc}") from None
        where = f"{path}:{line}"
        line = reader.line_num + 1
        if row:
            yield where, row


def field(
    record: Mapping[str, object], name: str, kind: type | tuple[type, ...], where: str
) -> Any:
    """A record's field, dotted names reaching into nested objects (`question.stem`) and lists
    (`question.choices.0.text`); a missing field or one of the wrong type is a `TaskFileError`
    naming file:line and the field. (Any: a value of the type `kind` names.)"""
    value: object = record
    for part in name.split("."):
        if isinstance(value, list) and part.isdecimal() and int(part) < len(value):
            value = value[int(part)]
        elif isinstance(value, Mapping) and part in value:
            value = value[part]
        else:
            raise TaskFileError(f"{where}: field {name!r} is missing")
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _as_tuple(kind)):
        names = "/".join(k.__name__ for k in _as_tuple(kind))
        raise TaskFileError(f"{where}: field {name!r} must be {names}, got {value!r:.60}")
    return value


def _as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def answer_index(value: object, n_choices: int, name: str, where: str) -> int:
    """A gold label as an index into the choices: an int, a string of ASCII digits, or a letter
    A-Z (either case)."""
    index: int | None = None
    text = value.strip() if isinstance(value, str) else None
    if isinstance(value, int) and not isinstance(value, bool):
        index = value
    elif text and text.isascii() and text.isdigit():
        index = int(text) if len(text) <= 18 else None  # int() refuses over 4300 digits
    elif text and len(text) == 1 and text in string.ascii_letters:
        index = ord(text.upper()) - ord("A")
    if index is None or not 0 <= index < n_choices:
        raise TaskFileError(
            f"{where}: field {name!r}: {value!r:.60} is not the index of one of {n_choices} choices"
        )
    return index


def choices_of(values: object, name: str, where: str) -> tuple[str, ...]:
    """A non-empty list of strings (a question's choices)."""
    if not isinstance(values, list) or not values:
        raise TaskFileError(f"{where}: field {name!r} must be a non-empty list of choices")
    for value in values:
        if not isinstance(value, str):
            raise TaskFileError(
                f"{where}: field {name!r}: every choice must be text, got {value!r}"
            )
    return tuple(values)
