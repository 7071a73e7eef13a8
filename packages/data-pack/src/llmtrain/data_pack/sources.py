"""JSONL inputs: expanding globs, splitting files into byte ranges, and reading documents.

Plain `.jsonl` files are split into byte ranges that worker processes read themselves, so no
indexing pass is needed: a range owns every line whose first byte lies inside it. Compressed files
(`.gz`, `.zst`) cannot be split by bytes; they are streamed and cut into batches of whole lines.
Both kinds become a sequence of `Task`s whose order depends only on the input, never on the number
of workers, which is what makes the packed order deterministic.
"""

from __future__ import annotations

import io
import itertools
import json
import re
from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import fsspec
import fsspec.compression
from fsspec.core import url_to_fs

from llmtrain.core_mesh.errors import UserError

COMPRESSION = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
_SURROGATE = re.compile("[\ud800-\udfff]")


class InputError(UserError):
    """An input file that cannot be found or read."""


@attrs.frozen
class Source:
    url: str
    size: int
    compression: str | None


@attrs.frozen
class Task:
    """One unit of work: bytes [start, end) of a plain file, or whole lines already read."""

    index: int
    source: int
    url: str
    start: int = 0
    end: int = 0
    payload: bytes | None = None
    first_line: int = 1  # the line number of the payload's first line (compressed inputs)
    input_bytes: int = 0  # input (compressed) bytes this task accounts for, for progress


def compression_of(url: str) -> str | None:
    for suffix, name in COMPRESSION.items():
        if url.endswith(suffix):
            return name
    return None


def expand_inputs(patterns: Sequence[str], storage_options: dict | None = None) -> list[Source]:
    """Files matching each pattern (globs, local or fsspec URLs), in a stable sorted order."""
    sources: list[Source] = []
    seen: set[str] = set()
    for pattern in patterns:
        fs, path = url_to_fs(pattern, **(storage_options or {}))
        matches = sorted(fs.glob(path)) if fs.glob and any(c in path for c in "*?[") else [path]
        matches = [m for m in matches if not fs.isdir(m)] if len(matches) > 1 else matches
        if not matches:
            raise InputError(f"{pattern}: no file matches")
        for match in matches:
            url = fs.unstrip_protocol(match) if "://" in pattern else match
            if url in seen:
                continue
            try:
                info = fs.info(match)
            except FileNotFoundError:
                raise InputError(f"{pattern}: no such file") from None
            if info.get("type") == "directory":
                raise InputError(f"{url}: is a directory; give a glob such as {url}/*.jsonl")
            seen.add(url)
            sources.append(Source(url, int(info.get("size") or 0), compression_of(url)))
    return sources


def plan_tasks(
    sources: Sequence[Source], chunk_bytes: int, storage_options: dict | None = None
) -> Iterator[Task]:
    """Tasks in input order: byte ranges of plain files, batches of lines of compressed ones."""
    index = itertools.count()
    for number, source in enumerate(sources):
        if source.compression is None:
            for start in range(0, source.size, chunk_bytes):
                end = min(start + chunk_bytes, source.size)
                yield Task(next(index), number, source.url, start, end, input_bytes=end - start)
            continue
        line, counted = 1, 0
        with fsspec.open(source.url, "rb", **(storage_options or {})) as raw:
            reader = io.BufferedReader(fsspec.compression.compr[source.compression](raw, mode="rb"))
            while block := reader.read(chunk_bytes):
                if not block.endswith(b"\n"):
                    block += reader.readline()
                position = raw.tell()
                yield Task(
                    next(index),
                    number,
                    source.url,
                    payload=block,
                    first_line=line,
                    input_bytes=position - counted,
                )
                counted = position
                line += block.count(b"\n")


def read_range(task: Task, storage_options: dict | None = None) -> bytes:
    """The whole lines a byte-range task owns: those whose first byte is in [start, end)."""
    if task.payload is not None:
        return task.payload
    if task.end <= task.start:
        return b""
    with fsspec.open(task.url, "rb", **(storage_options or {})) as f:
        skip = task.start > 0
        f.seek(task.start - 1 if skip else 0)
        data = f.read(task.end - task.start + (1 if skip else 0))
        if skip:
            cut = data.find(b"\n")
            data = b"" if cut < 0 else data[cut + 1 :]
        if data and not data.endswith(b"\n"):
            tail = bytearray()
            while True:
                piece = f.read(1 << 16)
                if not piece:
                    break
                cut = piece.find(b"\n")
                if cut >= 0:
                    tail += piece[: cut + 1]
                    break
                tail += piece
            data += bytes(tail)
    return data


def field_getter(field: str):
    """A function reading the dotted path `field` ("text", "meta.body") from a parsed record."""
    parts = field.split(".")

    def get(record: Any) -> Any:
        for part in parts:
            if not isinstance(record, dict) or part not in record:
                raise KeyError(field)
            record = record[part]
        return record

    return get


def parse_record(line: bytes) -> tuple[Any, str | None]:
    """(the parsed JSON value, None) for a good line, (None, reason) for a bad one."""
    try:
        decoded = line.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, f"invalid UTF-8 at byte {exc.start}"
    try:
        return json.loads(decoded), None
    except json.JSONDecodeError as exc:
        return None, f"malformed JSON ({exc.msg} at column {exc.colno})"
    except RecursionError:
        return None, "JSON nested too deeply"


def parse_line(line: bytes, get) -> tuple[str | None, str | None]:
    """(text, None) for a good line, (None, reason) for a bad one."""
    record, why = parse_record(line)
    if why is not None:
        return None, why
    try:
        text = get(record)
    except KeyError as exc:
        return None, f"no field {exc.args[0]!r}"
    if not isinstance(text, str):
        return None, f"field is {type(text).__name__}, not a string"
    # a surrogate can only come from a \\u escape (UTF-8 decoding refuses encoded ones)
    if b"\\u" in line and (bad := _SURROGATE.search(text)) is not None:
        return None, f"unpaired surrogate \\u{ord(bad.group()):04x} in the text (not valid Unicode)"
    return text, None


def iter_texts(
    sources: Sequence[Source], field: str, storage_options: dict | None = None
) -> Iterator[str]:
    """Every non-empty document of the inputs in order (one process; for training tokenizers).

    A bad line stops with its file:line, as `pack` does by default."""
    get = field_getter(field)
    for source in sources:
        with fsspec.open(
            source.url, "rb", compression=source.compression, **(storage_options or {})
        ) as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                text, why = parse_line(line.rstrip(b"\n"), get)
                if why is not None:
                    raise InputError(f"{source.url}:{number}: {why}")
                if text:
                    yield text
