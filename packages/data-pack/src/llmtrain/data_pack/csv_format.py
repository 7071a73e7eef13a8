"""CSV and TSV inputs (formats `csv` and `tsv`, by the suffixes `.csv` and `.tsv`, also `.gz` or
`.zst` compressed): a header row naming the columns, then a record a row, the text in the column
`--field` names (default `text`). Python's csv module reads them, so a quoted field may hold the
delimiter, quotes (doubled) and newlines; a quote out of place is a bad record, not a guess. A
record's number is the line it starts on (from 1; the header is line 1), so bad input is named
`file:line`, as JSONL's is. `--id-field` and `--where` read the other columns, whose values are
strings.

Cutting a file into tasks. A quoted field may hold newlines, so a byte offset cannot tell where a
record starts: the pack's process reads each file once with the reader the workers use, and cuts
it after the record that brings a task to the split size. A plain file becomes byte ranges that
the workers read themselves; a compressed one, tasks holding their records' bytes (as compressed
JSONL's lines are held). Every task carries the header. The reader starts afresh at a cut just as
it does after any record when it reads the file through, so the tasks hold exactly the records of
one reading of the file, and the cuts depend only on the file and the split size.
"""

from __future__ import annotations

import collections
import csv
import io
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import attrs
import fsspec

from llmtrain.data_pack.compressed import DamagedStream, Decompressed
from llmtrain.data_pack.documents import Documents, Selection
from llmtrain.data_pack.filters import RecordMismatch
from llmtrain.data_pack.formats import InputFormat
from llmtrain.data_pack.sources import BadFile, InputError, Source, Task, damaged, read_range

READ_BYTES = 1 << 20  # what the planner reads of a file (decompressed) at a time
# the csv module refuses a field longer than 128 Ki characters unless told otherwise, and its
# limit is one for the whole process; documents are limited by --max-doc-bytes instead
_FIELD_LIMIT = 2**31 - 1


@attrs.frozen
class Header:
    """A file's column names and the line they end on (a task's records follow it)."""

    names: tuple[str, ...]
    line: int

    def text_column(self, name: str, url: str) -> int:
        """Where the text column `name` (`--field`) is; a name the header lacks is an error
        saying what to pass instead."""
        if name in self.names:
            return self.names.index(name)
        raise InputError(
            f"{url}:{self.line}: no column {name!r} in the header (columns: "
            f"{', '.join(self.names)}); pass --field with the column that holds the text"
        )


@attrs.frozen
class CsvFormat(InputFormat):
    """Delimited text with a header row, read with Python's csv module."""

    name: str
    delimiter: str
    suffixes: tuple[str, ...]
    compressible = True

    def plan(
        self, source: Source, number: int, split_bytes: int, storage_options: dict[str, Any] | None
    ) -> Iterator[Task]:
        with fsspec.open(source.url, "rb", **(storage_options or {})) as raw:
            yield from _Planner(self, source, number, split_bytes).tasks(raw)

    def read(
        self,
        task: Task,
        selection: Selection,
        storage_options: dict[str, Any] | None,
        limit_rows: int | None,
    ) -> Documents:
        columns = _Columns(task.detail, selection, task.url)
        data = read_range(task, storage_options)
        docs = Documents(text_bytes=len(data))
        lines = _Lines(io.BytesIO(data))
        for start, row, why in self._rows(lines, columns.header):
            if why is None and not row:
                docs.blank += 1
                continue
            if why is None and columns.where is not None:
                try:
                    if not columns.where.keep(columns.record(row)):
                        docs.drop(task.source)
                        continue
                except RecordMismatch as exc:
                    why = str(exc.args[0])
            text = "" if why is not None else row[columns.text]
            why = why or selection.size_problem(text)
            if why is not None:
                docs.fail(start, task.source, why)
                if selection.stop_on_bad:
                    break
                continue
            docs.add(text, start, task.source, columns.id_of(row))
        docs.n_lines = lines.count
        return docs

    def _rows(self, lines: _Lines, header: Header) -> Iterator[tuple[int, list[str], str | None]]:
        """(the line it starts on, from the task's first; its fields; why it cannot be used,
        or None) for every row, a blank line's fields being []."""
        records = self.reader(lines)
        while True:
            start = lines.count
            try:
                row = next(records)
            except StopIteration:
                return
            except csv.Error as exc:
                yield start, [], f"malformed {self.name.upper()} ({exc})"
                continue
            yield start, row, _problem(row, header, lines.undecodable_since(start))

    def reader(self, lines: Iterable[str]) -> Iterator[list[str]]:
        """The csv module's reader of this format's rows (the planner's and the workers')."""
        csv.field_size_limit(_FIELD_LIMIT)
        return csv.reader(lines, delimiter=self.delimiter, strict=True)


class _Columns:
    """Where a task's records hold what the pack reads: the text (`--field`), the id
    (`--id-field`, when the header has it) and the filter's columns, checked against the
    header before any record is read."""

    def __init__(self, header: Header, selection: Selection, url: str):
        self.header = header
        self.text = header.text_column(selection.field, url)
        ids = selection.id_field
        self.id = header.names.index(ids) if ids in header.names else None
        self.where = selection.filter
        if self.where is not None:
            self.where.check_columns(header.names, f"{url}:{header.line}")

    def record(self, row: list[str]) -> dict[str, str]:
        """A row as the filter reads it: column name to value."""
        return dict(zip(self.header.names, row, strict=True))

    def id_of(self, row: list[str]) -> str:
        return "" if self.id is None else row[self.id]


def _problem(row: list[str], header: Header, undecodable: tuple[int, int] | None) -> str | None:
    """Why a parsed record cannot be used, or None (a blank line is no record, and no problem)."""
    if undecodable is not None:
        line, byte = undecodable
        return f"invalid UTF-8 at byte {byte}" + (f" of its line {line + 1}" if line else "")
    if row and len(row) != len(header.names):
        return (
            f"{len(row)} fields where the header has {len(header.names)} (a delimiter inside "
            "a field that is not quoted?)"
        )
    return None


class _Lines:
    """A file's lines (each up to and including its b"\\n") decoded for the csv reader, which
    takes a line at a time as it needs them: so `count` and `bytes` say where in the file the
    reader is. A line that is not UTF-8 is remembered (and given to the reader with the bad
    bytes replaced), so the record holding it is refused without stopping the reader."""

    def __init__(self, raw: Iterable[bytes]):
        self._raw = iter(raw)
        self.count = 0  # lines given to the reader
        self.bytes = 0  # their bytes
        # (line, byte in it) of each line that is not UTF-8, those of earlier records dropped
        self.undecodable: collections.deque[tuple[int, int]] = collections.deque()
        self.kept: list[bytes] | None = None  # the lines themselves, when a caller collects them

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        line = next(self._raw)
        if self.kept is not None:
            self.kept.append(line)
        self.count += 1
        self.bytes += len(line)
        try:
            return line.decode("utf-8")
        except UnicodeDecodeError as exc:
            self.undecodable.append((self.count - 1, exc.start))
            return line.decode("utf-8", "replace")

    def undecodable_since(self, line: int) -> tuple[int, int] | None:
        """The first line that is not UTF-8 from `line` on (relative to it) and where in it,
        or None. Records are read in order, so the lines before `line` are forgotten."""
        while self.undecodable and self.undecodable[0][0] < line:
            self.undecodable.popleft()
        if not self.undecodable:
            return None
        bad, byte = self.undecodable[0]
        return bad - line, byte


class _Pieces(io.RawIOBase):
    """Bytes that come a piece at a time (`read_some()`, b"" at the end) as a raw stream, so
    that io.BufferedReader cuts them into lines, in C (a DamagedStream passes through)."""

    def __init__(self, read_some: Callable[[], bytes]):
        self._read_some = read_some
        self._piece = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if not self._piece:
            self._piece = memoryview(self._read_some())
        n = min(len(buffer), len(self._piece))
        buffer[:n] = self._piece[:n]
        self._piece = self._piece[n:]
        return n


@attrs.define
class _Planner:
    """One file read through once, cut after the record that fills a task (see the module's
    docstring)."""

    format: CsvFormat
    source: Source
    number: int
    split_bytes: int
    stream: Decompressed | None = None
    counted: int = 0  # input bytes the tasks so far account for (for progress)

    def tasks(self, raw: Any) -> Iterator[Task]:
        compression = self.source.compression
        if compression is not None:
            self.stream = Decompressed(raw, compression)
            pieces = _Pieces(self.stream.read_some)
        else:
            pieces = _Pieces(lambda: bytes(raw.read(READ_BYTES)))
        # a binary stream's lines end after each b"\n"
        lines = _Lines(io.BufferedReader(pieces, READ_BYTES))
        records = self.format.reader(lines)
        try:
            header = self._header(records, lines)
        except DamagedStream as exc:
            raise damaged(self.source.url, exc, None) from None
        if header is None:
            return
        lines.kept = None if self.stream is None else []  # a compressed file's tasks hold them
        start = end = (lines.bytes, lines.count)  # (byte, line) where a task starts, ends
        damage = None
        while True:
            try:
                next(records)
            except StopIteration:
                break
            except csv.Error:
                pass  # the worker reports it; the reader goes on after it, as the worker's does
            except DamagedStream as exc:
                damage = exc
                break
            end = (lines.bytes, lines.count)
            if end[0] - start[0] >= self.split_bytes:
                yield self._task(header, lines, start, end)
                start = end
        if end[0] > start[0]:
            yield self._task(header, lines, start, end)
        if damage is not None:
            whole = f"{end[1]:,} whole lines" if end[1] else None
            raise damaged(self.source.url, damage, whole)

    def _header(self, records: Iterator[list[str]], lines: _Lines) -> Header | None:
        """The first row that is not blank, as column names; None for a file without one."""
        url = self.source.url
        names: list[str] = []
        while not names:
            start = lines.count + 1  # the line it starts on
            try:
                names = next(records)
            except StopIteration:
                return None
            except csv.Error as exc:
                raise _bad_file(url, start, f"a malformed header ({exc})") from None
            if lines.undecodable:
                _, byte = lines.undecodable[0]
                raise _bad_file(url, start, f"a header that is not UTF-8 (at byte {byte})")
        names[0] = names[0].removeprefix("\ufeff")  # a byte-order mark (Excel writes one)
        return Header(tuple(names), lines.count)

    def _task(
        self, header: Header, lines: _Lines, start: tuple[int, int], end: tuple[int, int]
    ) -> Task:
        """The records of lines [start, end): a byte range of a plain file, or the lines'
        bytes of a compressed one."""
        task = Task(
            source=self.number,
            url=self.source.url,
            format=self.format,
            first_line=start[1] + 1,
            detail=header,
        )
        if self.stream is None or lines.kept is None:  # a plain file: the workers read it
            input_bytes, self.counted = end[0] - self.counted, end[0]
            return attrs.evolve(task, start=start[0], end=end[0], input_bytes=input_bytes)
        payload = b"".join(lines.kept[: end[1] - start[1]])
        del lines.kept[: end[1] - start[1]]
        input_bytes, self.counted = self.stream.position - self.counted, self.stream.position
        return attrs.evolve(task, payload=payload, input_bytes=input_bytes)


def _bad_file(url: str, line: int, reason: str) -> BadFile:
    """A file whose header cannot be read: the pack stops, or --skip-bad leaves the file out."""
    error = BadFile(
        f"{url}:{line}: {reason}; fix the header, or pass --skip-bad to leave the file out"
    )
    error.url, error.reason = url, f"line {line}: {reason}"
    return error
