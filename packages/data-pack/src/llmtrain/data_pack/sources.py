"""Inputs: finding the files, giving each its format, and cutting them into tasks.

Which formats there are is the registry's (`formats.py`: plugins of kind `data_format`,
data-pack's own among them). Here: globs, directories and URLs become `Source`s, each with the
format that claims its suffix (or the one `--input-format` names; JSONL for a suffix no format
claims). A directory input is a `datasets.save_to_disk` dataset when it
holds a `state.json` (its Arrow files, in its own order), otherwise every input file below it.

Each format cuts its files into `Task`s (`InputFormat.plan`); `plan_tasks` numbers them in input
order and joins whole-file tasks up to the split size. The order depends only on the input, never
on the number of workers, which is what makes the packed order deterministic. The line formats'
shared pieces live here too: plain line files are split into byte ranges that worker processes
read themselves, so no indexing pass is needed (a range owns every line whose first byte lies
inside it); compressed files (`.gz`, `.zst`) cannot be split by bytes, so they are streamed and
cut into batches of whole lines.
"""

from __future__ import annotations

import functools
import itertools
import json
import posixpath
import re
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import fsspec
import orjson
from fsspec.core import url_to_fs

from llmtrain.core_mesh.errors import UserError
from llmtrain.core_mesh.storage_errors import missing_bucket, storage_errors
from llmtrain.data_pack.compressed import DamagedStream, Decompressed

if TYPE_CHECKING:
    from llmtrain.data_pack.formats import InputFormat, InputFormats

COMPRESSION = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
ARROW_STATE = "state.json"  # what `datasets.save_to_disk` writes beside its .arrow files
_INT64 = 2.0**63  # orjson reads integers from -2**63 to 2**64 - 1 exactly
_SURROGATE = re.compile("[\ud800-\udfff]")


class InputError(UserError):
    """An input file that cannot be found or read."""


class BadFile(InputError):
    """An input file the pack cannot use at all (a Parquet file that does not open, a compressed
    file cut short): the pack stops at it, or with --skip-bad leaves it out and counts it as
    bad. `reason` is the message without the file's
    name and the advice."""

    url = ""
    reason = ""


class UnreadableInput(BadFile):
    """An input file that cannot be read through (a compressed file cut short or corrupt): the
    pack stops at it, or with --skip-bad keeps what came before the damage and counts the file
    as bad."""


def _format_named(fmt: InputFormat | str) -> InputFormat:
    """A source's format: given, or an installed one's name (a `Source` made by hand)."""
    if not isinstance(fmt, str):
        return fmt
    from llmtrain.data_pack.formats import installed_formats

    return installed_formats().named(fmt)


@attrs.frozen
class Source:
    url: str
    size: int
    compression: str | None
    format: InputFormat = attrs.field(
        factory=lambda: _format_named("jsonl"), converter=_format_named
    )
    dataset: str | None = None  # an Arrow file's save_to_disk directory

    @property
    def unit(self) -> str:
        """What a document's number counts in this file: lines (from 1), rows (from 0), or
        nothing (the whole file is one document)."""
        return self.format.unit

    def to_meta(self) -> dict[str, Any]:
        meta = {"url": self.url, "bytes": self.size, "format": self.format.name, "unit": self.unit}
        if self.dataset is not None:
            meta["dataset"] = self.dataset
        return meta


@attrs.frozen(kw_only=True)
class Task:
    """One unit of work, made by its format's `plan`: bytes [start, end) of a plain line file,
    whole lines already read (`payload`), row groups of a Parquet file, record batches of an
    Arrow file, or whole files (`members`: (source number, url) pairs)."""

    source: int  # the number of its input file
    url: str
    format: InputFormat  # what reads it, in a worker process
    index: int = -1  # its place in the pack, set by `plan_tasks`
    start: int = 0
    end: int = 0
    payload: bytes | None = None
    # the first line's number (1-based; compressed inputs) or the first row's (0-based;
    # columnar inputs); None for a byte range, whose lines follow those of the ranges before it
    first_line: int | None = None
    input_bytes: int = 0  # input (compressed) bytes this task accounts for, for progress
    row_groups: tuple[int, ...] = ()  # parquet
    batches: tuple[int, int] = (0, 0)  # arrow: record batches [first, stop); (0, 0): all
    members: tuple[tuple[int, str], ...] = ()  # whole files, each one document
    detail: Any = None  # what else its format needs to read it (e.g. a header); picklable


def compression_of(url: str) -> str | None:
    for suffix, name in COMPRESSION.items():
        if url.endswith(suffix):
            return name
    return None


def expand_inputs(
    patterns: Sequence[str],
    storage_options: dict[str, Any] | None = None,
    input_format: str = "auto",
    *,
    text_per_line: bool = False,
    formats: InputFormats | None = None,
) -> list[Source]:
    """Files matching each pattern (globs, directories, local or fsspec URLs), in a stable
    sorted order, each with its format from `formats` (default: the installed ones): the one
    `input_format` names, else by suffix; with `text_per_line`, a format's one-document-a-line
    reading where it has one (plain text)."""
    if formats is None:
        from llmtrain.data_pack.formats import installed_formats

        formats = installed_formats()
    if input_format != "auto":
        formats.named(input_format)  # an unknown name is an error before any listing
    sources: list[Source] = []
    seen: set[str] = set()
    for pattern in patterns:
        with storage_errors(pattern, error=InputError):
            found = _expand(pattern, storage_options, _Choosing(formats, input_format))
        if text_per_line:
            found = [attrs.evolve(s, format=formats.one_per_line(s.format)) for s in found]
        for source in found:
            if source.url not in seen:
                seen.add(source.url)
                sources.append(source)
    return sources


@attrs.frozen
class _Choosing:
    """How files get their formats: the registry, and `--input-format`."""

    formats: InputFormats
    requested: str

    def source(self, url: str, info: dict[str, Any]) -> Source:
        fmt = self.formats.for_file(url, self.requested)
        compression = compression_of(url) if fmt.compressible else None
        return Source(url, int(info.get("size") or 0), compression, fmt)


def _expand(
    pattern: str, storage_options: dict[str, Any] | None, choosing: _Choosing
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
            found.extend(_directory(fs, match, url, choosing))
        else:
            found.append(choosing.source(url, info))
    return found


def _directory(fs: Any, path: str, url: str, choosing: _Choosing) -> list[Source]:
    """An Arrow dataset directory's files in its own order, or every input file below a
    directory (sorted)."""
    names = {posixpath.basename(p) for p in fs.ls(path, detail=False)}
    prefix = url.rstrip("/") + "/"
    if ARROW_STATE in names:
        return _arrow_dataset(fs, path, url, choosing.formats)
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
                dataset_url = prefix + posixpath.dirname(relative)
                found.extend(_arrow_dataset(fs, folder, dataset_url, choosing.formats))
            continue
        # hidden below the input, not above it (~/.cache/... is a fine place for data)
        if choosing.formats.claims(file) and not any(
            part.startswith(".") for part in relative.split("/")
        ):
            found.append(choosing.source(prefix + relative if "://" in url else file, info))
    if not found:
        suffixes = ", ".join(choosing.formats.suffixes())
        raise InputError(
            f"{url}: a directory with no input files ({suffixes}, optionally .gz/.zst) below it"
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


def _arrow_dataset(fs: Any, path: str, url: str, formats: InputFormats) -> list[Source]:
    """The .arrow files a `datasets.save_to_disk` directory's state.json lists, in its order."""
    arrow = formats.named("arrow")
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
        sources.append(Source(file_url, size, None, arrow, url.rstrip("/")))
    return sources


def plan_tasks(
    sources: Sequence[Source],
    chunk_bytes: int,
    storage_options: dict[str, Any] | None = None,
    *,
    skip_bad: bool = False,
    bad_files: list[tuple[int, str]] | None = None,
) -> Iterator[Task]:
    """Every file's tasks (its format's `plan`), numbered in input order. Consecutive tasks of
    whole files of one format are joined until they hold `chunk_bytes`. A file whose format
    cannot use it (`BadFile`) stops the plan, or with `skip_bad` is left out and listed in
    `bad_files` as (source number, reason)."""
    numbers = itertools.count()
    whole: list[Task] = []  # tasks of whole files, to be joined

    def joined() -> Task:
        first = whole[0]
        members = tuple(m for task in whole for m in task.members)
        input_bytes = sum(task.input_bytes for task in whole)
        whole.clear()
        return attrs.evolve(first, index=next(numbers), members=members, input_bytes=input_bytes)

    for number, source in enumerate(sources):
        if whole and source.format != whole[0].format:
            yield joined()
        try:
            with storage_errors(source.url, error=InputError):
                for task in source.format.plan(source, number, chunk_bytes, storage_options):
                    if not task.members:
                        yield attrs.evolve(task, index=next(numbers))
                        continue
                    whole.append(task)
                    if sum(t.input_bytes for t in whole) >= chunk_bytes:
                        yield joined()
        except BadFile as exc:
            if not skip_bad or bad_files is None:
                raise
            bad_files.append((number, exc.reason or str(exc)))
    if whole:
        yield joined()


def line_tasks(
    source: Source,
    number: int,
    chunk_bytes: int,
    storage_options: dict[str, Any] | None,
) -> Iterator[Task]:
    """A line format's tasks: byte ranges of a plain file; batches of whole lines of a
    compressed one."""
    task = functools.partial(Task, source=number, url=source.url, format=source.format)
    if source.compression is None:
        for start in range(0, source.size, chunk_bytes):
            end = min(start + chunk_bytes, source.size)
            yield task(start=start, end=end, input_bytes=end - start)
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
                yield task(payload=block, first_line=line, input_bytes=position - counted)
                counted = position
                line += block.count(b"\n")
            if not piece:
                break
    if damage is not None:
        raise damaged(source.url, damage, f"{line - 1:,} whole lines" if line > 1 else None)


def damaged(url: str, damage: DamagedStream, before: str | None) -> UnreadableInput:
    """The error of a compressed input that does not decompress whole; `before`: what of it
    was read (kept with --skip-bad)."""
    reason = damage.problem if before is None else f"{damage.problem}, after {before}"
    error = UnreadableInput(
        f"{url}: {reason}; the file is incomplete or damaged: download or compress it again, or "
        "pass --on-bad-line skip to keep what comes before the damage and count the file as bad"
    )
    error.url, error.reason = url, reason
    return error


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
            raise damaged(url, exc, None) from None


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
