"""Inputs: finding the files, telling their formats apart, and cutting them into tasks.

Formats: JSONL (`.jsonl`, `.ndjson`, optionally `.gz`/`.zst`; also any file of no other known
suffix), plain text (`.txt`, one document per file or per line), Parquet (`.parquet`) and Arrow
(`.arrow` files, and the directories `datasets.save_to_disk` writes). A directory input is an
Arrow dataset when it holds a `state.json`, otherwise every input file below it.

Plain line files are split into byte ranges that worker processes read themselves, so no
indexing pass is needed: a range owns every line whose first byte lies inside it. Compressed files
(`.gz`, `.zst`) cannot be split by bytes; they are streamed and cut into batches of whole lines.
Parquet files are cut by row groups and Arrow files by record batches (`columnar.py`). Every kind
becomes a sequence of `Task`s whose order depends only on the input, never on the number of
workers, which is what makes the packed order deterministic.
"""

from __future__ import annotations

import itertools
import json
import posixpath
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
import fsspec
import orjson
from fsspec.core import url_to_fs

from llmtrain.core_mesh.errors import UserError
from llmtrain.core_mesh.storage_errors import missing_bucket, storage_errors
from llmtrain.data_pack.compressed import DamagedStream, Decompressed

COMPRESSION = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
FORMATS = ("auto", "jsonl", "text", "parquet", "arrow")
SUFFIX_FORMATS = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "jsonl",
    ".txt": "text",
    ".parquet": "parquet",
    ".arrow": "arrow",
}
LINE_FORMATS = ("jsonl", "text-lines")  # read by byte ranges or batches of lines
ARROW_STATE = "state.json"  # what `datasets.save_to_disk` writes beside its .arrow files
_INT64 = 2.0**63  # orjson reads integers from -2**63 to 2**64 - 1 exactly
_SURROGATE = re.compile("[\ud800-\udfff]")


class InputError(UserError):
    """An input file that cannot be found or read."""


class UnreadableInput(InputError):
    """An input file that cannot be read through (a compressed file cut short or corrupt): the
    pack stops at it, or with --skip-bad keeps what came before the damage and counts the file
    as bad. `reason` is the message without the file's name and the advice."""

    url = ""
    reason = ""


@attrs.frozen
class Source:
    url: str
    size: int
    compression: str | None
    format: str = "jsonl"  # jsonl, text (a document per file), text-lines, parquet or arrow
    dataset: str | None = None  # an Arrow file's save_to_disk directory

    @property
    def unit(self) -> str:
        """What a document's number counts in this file: lines (from 1), rows (from 0), or
        nothing (the whole file is one document)."""
        if self.format == "text":
            return "file"
        return "line" if self.format in LINE_FORMATS else "row"

    def to_meta(self) -> dict[str, Any]:
        meta = {"url": self.url, "bytes": self.size, "format": self.format, "unit": self.unit}
        if self.dataset is not None:
            meta["dataset"] = self.dataset
        return meta


@attrs.frozen
class Task:
    """One unit of work: bytes [start, end) of a plain line file, whole lines already read
    (`payload`), row groups of a Parquet file, record batches of an Arrow file, or whole text
    files (`members`: (source number, url) pairs)."""

    index: int
    source: int
    url: str
    format: str = "jsonl"
    start: int = 0
    end: int = 0
    payload: bytes | None = None
    # the first line's number (1-based; compressed inputs) or the first row's (0-based;
    # columnar inputs); None for a byte range, whose lines follow those of the ranges before it
    first_line: int | None = None
    input_bytes: int = 0  # input (compressed) bytes this task accounts for, for progress
    row_groups: tuple[int, ...] = ()  # parquet
    batches: tuple[int, int] = (0, 0)  # arrow: record batches [first, stop); (0, 0): all
    members: tuple[tuple[int, str], ...] = ()  # text, one document per file


def compression_of(url: str) -> str | None:
    for suffix, name in COMPRESSION.items():
        if url.endswith(suffix):
            return name
    return None


def format_of(url: str, requested: str = "auto") -> str:
    """The input format: as requested, else by suffix (under any compression suffix); JSONL for
    a suffix of no other format."""
    if requested != "auto":
        return requested
    name = posixpath.basename(url)
    for suffix in COMPRESSION:
        name = name.removesuffix(suffix)
    return SUFFIX_FORMATS.get(posixpath.splitext(name)[1].lower(), "jsonl")


def _known_input(path: str) -> bool:
    name = posixpath.basename(path)
    if name.startswith((".", "_")):
        return False
    for suffix in COMPRESSION:
        name = name.removesuffix(suffix)
    return posixpath.splitext(name)[1].lower() in SUFFIX_FORMATS


def expand_inputs(
    patterns: Sequence[str],
    storage_options: dict[str, Any] | None = None,
    input_format: str = "auto",
    *,
    text_per_line: bool = False,
) -> list[Source]:
    """Files matching each pattern (globs, directories, local or fsspec URLs), in a stable
    sorted order, each with its format (plain text: a document per line if `text_per_line`,
    else per file)."""
    if input_format not in FORMATS:
        raise InputError(f"input format {input_format!r}: use one of {', '.join(FORMATS)}")
    sources: list[Source] = []
    seen: set[str] = set()
    for pattern in patterns:
        with storage_errors(pattern, error=InputError):
            found = _expand(pattern, storage_options, input_format)
        if text_per_line:
            found = [
                attrs.evolve(s, format="text-lines") if s.format == "text" else s for s in found
            ]
        for source in found:
            if source.url not in seen:
                seen.add(source.url)
                sources.append(source)
    return sources


def _expand(
    pattern: str, storage_options: dict[str, Any] | None, input_format: str
) -> list[Source]:
    """The input files one pattern names."""
    fs, path = url_to_fs(pattern, **(storage_options or {}))
    infos: dict[str, dict[str, Any]] = {}
    matches = [path]
    if fs.glob and any(c in path for c in "*?["):
        # one listing gives every match's type and size (no request per match on S3)
        infos = fs.glob(path, detail=True)
        files = sorted(m for m, i in infos.items() if i.get("type") != "directory")
        # a glob of directories (data/CC-MAIN-*) reads each; one that also matches files
        # (data/**) reads the files, not their directories a second time
        matches = files or sorted(infos)
    if not matches:
        raise InputError(missing_bucket(fs, pattern) or f"{pattern}: no file matches")
    found: list[Source] = []
    for match in matches:
        url = fs.unstrip_protocol(match) if "://" in pattern else match
        try:
            info = infos.get(match) or fs.info(match)
        except FileNotFoundError:
            raise InputError(missing_bucket(fs, pattern) or f"{pattern}: no such file") from None
        if info.get("type") == "directory":
            found.extend(_directory(fs, match, url, input_format))
        else:
            found.append(_source(url, info, input_format))
    return found


def _source(url: str, info: dict[str, Any], input_format: str) -> Source:
    kind = format_of(url, input_format)
    compression = compression_of(url) if kind in ("jsonl", "text") else None
    return Source(url, int(info.get("size") or 0), compression, kind)


def _directory(fs: Any, path: str, url: str, input_format: str) -> list[Source]:
    """An Arrow dataset directory's files in its own order, or every input file below a
    directory (sorted)."""
    names = {posixpath.basename(p) for p in fs.ls(path, detail=False)}
    prefix = url.rstrip("/") + "/"
    if ARROW_STATE in names:
        return _arrow_dataset(fs, path, url)
    if "dataset_dict.json" in names:
        _refuse_dataset_dict(fs, path, url)
    if any(n.endswith(".arrow") for n in names):
        raise InputError(
            f"{url}: .arrow files without the {ARROW_STATE} that datasets.save_to_disk writes "
            "beside them (an incomplete save?); save the dataset again, or give the .arrow "
            "files themselves"
        )
    found = []
    listing = sorted(fs.find(path, detail=True).items())
    # save_to_disk directories inside the tree are read as datasets (their own file order),
    # never as loose .arrow files plus their .json bookkeeping read as JSONL
    datasets = {posixpath.dirname(f) for f, _ in listing if posixpath.basename(f) == ARROW_STATE}
    for file, info in listing:
        relative = file[len(path.rstrip("/")) + 1 :]
        folder = posixpath.dirname(file)
        if posixpath.basename(file) == "dataset_dict.json":
            _refuse_dataset_dict(fs, folder, prefix + posixpath.dirname(relative))
        if any(folder == d or folder.startswith(d + "/") for d in datasets):
            if posixpath.basename(file) == ARROW_STATE and folder in datasets:
                found.extend(_arrow_dataset(fs, folder, prefix + posixpath.dirname(relative)))
            continue
        # hidden below the input, not above it (~/.cache/... is a fine place for data)
        if _known_input(file) and not any(part.startswith(".") for part in relative.split("/")):
            found.append(_source(prefix + relative if "://" in url else file, info, input_format))
    if not found:
        raise InputError(
            f"{url}: a directory with no input files (.jsonl, .txt, .parquet, .arrow, "
            "optionally .gz/.zst) below it"
        )
    return found


def _refuse_dataset_dict(fs: Any, path: str, url: str) -> None:
    """A DatasetDict's splits (train, test, ...) are never packed together unasked."""
    names = [posixpath.basename(p) for p in fs.ls(path, detail=False)]
    splits = sorted(n for n in names if fs.isdir(posixpath.join(path, n)))
    raise InputError(
        f"{url}: a DatasetDict with splits {', '.join(splits)}; give one split's directory, "
        f"e.g. {url.rstrip('/')}/{splits[0] if splits else 'train'}"
    )


def _arrow_dataset(fs: Any, path: str, url: str) -> list[Source]:
    state_path = posixpath.join(path, ARROW_STATE)
    try:
        with fs.open(state_path, "rb") as f:
            files = [entry["filename"] for entry in json.load(f)["_data_files"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise InputError(
            f"{url}/{ARROW_STATE}: not a datasets state file ({type(exc).__name__}: {exc}); "
            "save the dataset again"
        ) from None
    sources = []
    for name in files:
        file = posixpath.join(path, name)
        if not fs.exists(file):
            raise InputError(f"{url}/{ARROW_STATE} lists {name}, which is missing")
        size = int(fs.info(file).get("size") or 0)
        file_url = url.rstrip("/") + "/" + name
        sources.append(Source(file_url, size, None, "arrow", url.rstrip("/")))
    return sources


def plan_tasks(
    sources: Sequence[Source],
    chunk_bytes: int,
    storage_options: dict[str, Any] | None = None,
    *,
    skip_bad: bool = False,
    bad_files: list[tuple[int, str]] | None = None,
) -> Iterator[Task]:
    """Tasks in input order. Columnar files that cannot be opened stop the plan, or with
    `skip_bad` are left out and listed in `bad_files` as (source number, reason)."""
    from llmtrain.data_pack.columnar import ColumnarError, plan_columnar

    index = itertools.count()
    text_files: list[tuple[int, Source]] = []
    for number, source in enumerate(sources):
        if source.format == "text":
            text_files.append((number, source))
            if sum(s.size for _, s in text_files) >= chunk_bytes:
                yield _text_task(next(index), text_files)
                text_files = []
            continue
        if text_files:
            yield _text_task(next(index), text_files)
            text_files = []
        try:
            with storage_errors(source.url, error=InputError):
                if source.format in ("parquet", "arrow"):
                    yield from plan_columnar(source, number, chunk_bytes, index, storage_options)
                else:
                    yield from _line_tasks(source, number, chunk_bytes, index, storage_options)
        except (ColumnarError, UnreadableInput) as exc:
            if not skip_bad or bad_files is None:
                raise
            bad_files.append((number, exc.reason or str(exc)))
    if text_files:
        yield _text_task(next(index), text_files)


def _line_tasks(
    source: Source,
    number: int,
    chunk_bytes: int,
    index: Iterator[int],
    storage_options: dict[str, Any] | None,
) -> Iterator[Task]:
    """Byte ranges of a plain line file; batches of whole lines of a compressed one."""
    kind = source.format
    if source.compression is None:
        for start in range(0, source.size, chunk_bytes):
            end = min(start + chunk_bytes, source.size)
            yield Task(next(index), number, source.url, kind, start, end, input_bytes=end - start)
        return
    line, counted = 1, 0
    with fsspec.open(source.url, "rb", **(storage_options or {})) as raw:
        stream = Decompressed(raw, source.compression)
        buffer = bytearray()
        searched = 0  # the buffer's bytes already searched for the newline that ends a block
        damage = None
        while True:
            try:
                piece = stream.read_some()
            except DamagedStream as exc:
                damage, piece = exc, b""
            buffer += piece
            # blocks: the first chunk_bytes bytes and the rest of the line they end in; at the
            # end of the file whatever is left, before damage the whole lines that are left
            while True:
                cut = -1
                if len(buffer) >= chunk_bytes:
                    cut = buffer.find(b"\n", max(chunk_bytes - 1, searched))
                    searched = len(buffer)
                if cut < 0 and not piece:
                    cut = len(buffer) - 1 if damage is None else buffer.rfind(b"\n")
                if cut < 0:
                    break
                block = bytes(buffer[: cut + 1])
                del buffer[: cut + 1]
                searched = 0
                position = stream.position
                yield Task(
                    next(index),
                    number,
                    source.url,
                    kind,
                    payload=block,
                    first_line=line,
                    input_bytes=position - counted,
                )
                counted = position
                line += block.count(b"\n")
            if not piece:
                break
    if damage is not None:
        raise _damaged(source.url, damage, f"{line - 1:,} whole lines" if line > 1 else None)


def _damaged(url: str, damage: DamagedStream, before: str | None) -> UnreadableInput:
    """The error of a compressed input that does not decompress whole."""
    reason = damage.problem if before is None else f"{damage.problem}, after {before}"
    error = UnreadableInput(
        f"{url}: {reason}; the file is incomplete or damaged: download or compress it again, or "
        "pass --on-bad-line skip to keep what comes before the damage and count the file as bad"
    )
    error.url, error.reason = url, reason
    return error


def _text_task(index: int, files: list[tuple[int, Source]]) -> Task:
    """Whole text files, each one document, read together by one worker."""
    number, first = files[0]
    return Task(
        index,
        number,
        first.url,
        "text",
        first_line=0,  # a whole file is one document: its number is 0
        input_bytes=sum(s.size for _, s in files),
        members=tuple((n, s.url) for n, s in files),
    )


def read_text_file(url: str, storage_options: dict[str, Any] | None = None) -> bytes:
    """A whole text file, decompressed (.gz, .zst); an UnreadableInput if that fails."""
    with (
        storage_errors(url, error=InputError),
        fsspec.open(url, "rb", **(storage_options or {})) as f,
    ):
        compression = compression_of(url)
        if compression is None:
            data: bytes = f.read()
            return data
        try:
            return Decompressed(f, compression).read_all()
        except DamagedStream as exc:
            raise _damaged(url, exc, None) from None


def read_range(task: Task, storage_options: dict[str, Any] | None = None) -> bytes:
    """The whole lines a byte-range task owns: those whose first byte is in [start, end). Where
    they begin and where the last one ends are found first, and the lines read with one call: a
    line of any length is held once, not as the range, its tail and their concatenation."""
    if task.payload is not None:
        return task.payload
    if task.end <= task.start:
        return b""
    with (
        storage_errors(task.url, error=InputError),
        fsspec.open(task.url, "rb", **(storage_options or {})) as f,
    ):
        begin = 0
        if task.start > 0:
            newline = _newline_at(f, task.start - 1, task.end - 1)
            if newline is None:
                return b""  # a line that began in an earlier range runs through this one
            begin = newline + 1
        end = _newline_at(f, task.end - 1)
        f.seek(begin)
        lines: bytes = f.read() if end is None else f.read(end + 1 - begin)
        return lines


_SCAN_BYTES = 1 << 16


def _newline_at(f: Any, position: int, stop: int | None = None) -> int | None:
    """The offset of the first newline at or after `position` (and before `stop`) in the open
    file `f`, or None; read a block at a time and kept nowhere."""
    f.seek(position)
    while stop is None or position < stop:
        block = f.read(_SCAN_BYTES if stop is None else min(_SCAN_BYTES, stop - position))
        if not block:
            return None
        found: int = block.find(b"\n")
        if found >= 0:
            return position + found
        position += len(block)
    return None


def field_getter(field: str) -> Callable[[Any], Any]:
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
    """(the parsed JSON value, None) for a good line, (None, reason) for a bad one.

    orjson parses the good lines (several times faster than json, which on a fast tokenizer is
    a tenth of a pack's work); what it refuses goes through json, which says exactly what is
    wrong and accepts what orjson does not (NaN). A record with a float of an integer's value
    beyond 64 bits goes to json too: orjson reads such integers as floats, json exactly."""
    try:
        record = orjson.loads(line)
        if not _maybe_big_integer(record):
            return record, None
    except orjson.JSONDecodeError:
        pass
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


def _maybe_big_integer(record: Any) -> bool:
    """Whether a parsed record holds a whole float beyond 64-bit integers (orjson's reading of
    such an integer, or such a float written as one: json reads both right). A walk over the
    values, several times cheaper than searching every line's bytes for long digit runs."""
    stack = [record]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
        elif isinstance(value, float) and abs(value) >= _INT64 and value.is_integer():
            return True
    return False


def text_of(record: Any, get: Callable[[Any], Any], line: bytes) -> tuple[str | None, str | None]:
    """(text, None) from a parsed JSONL record, or (None, reason)."""
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


class LineNumbers:
    """Absolute numbers of a task's documents: a byte-range task's lines follow the lines of
    the earlier ranges of its file (known, since results arrive in task order); every other
    task knows its first line or row."""

    def __init__(self) -> None:
        self.seen: dict[int, int] = {}

    def first(self, task: Task, n_lines: int) -> int:
        if task.first_line is not None:
            return task.first_line
        first = self.seen.get(task.source, 0) + 1
        self.seen[task.source] = first - 1 + n_lines
        return first


def location(url: str, unit: str, number: int) -> str:
    """How a message names a document: file:line, "file, row N", or the file."""
    if unit == "line":
        return f"{url}:{number}"
    return f"{url}, row {number}" if unit == "row" else url
