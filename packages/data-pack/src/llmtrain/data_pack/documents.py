"""From a task to its documents: what every input format's reader fills (`Documents`: the text
of each record that passes the `--where` filter, where it came from (file, line or row, id), and
the counts of what was dropped, empty, blank or bad) from what the pack asks of it (`Selection`),
and the readers of the JSONL, text, Parquet and Arrow formats. Runs in the pack's worker
processes, and in one process for training tokenizers and for the fast encoder's sample.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from typing import Any

import attrs

from llmtrain.core_mesh.errors import UserError
from llmtrain.core_mesh.storage_errors import storage_errors
from llmtrain.data_pack.filters import RecordMismatch, Where, quoted
from llmtrain.data_pack.sources import (
    InputError,
    LineNumbers,
    Source,
    Task,
    UnreadableInput,
    field_getter,
    location,
    parse_record,
    plan_tasks,
    read_range,
    read_text_file,
    text_of,
)


@attrs.frozen
class Selection:
    """What to take from each record (picklable: it travels with every task)."""

    field: str = "text"
    where: tuple[str, ...] = ()
    id_field: str = "id"
    stop_on_bad: bool = True
    max_doc_bytes: int = 0  # a longer document (UTF-8 bytes) is bad; 0: no limit

    def size_problem(self, text: str) -> str | None:
        """Why `text` is too long a document (`max_doc_bytes`), or None."""
        limit = self.max_doc_bytes
        if not limit or len(text) * 4 <= limit:  # UTF-8 takes at most 4 bytes a character
            return None
        size = utf8_size(text)
        if size <= limit:
            return None
        return f"a document of {size:,} bytes, above --max-doc-bytes {limit:,}"

    @property
    def filter(self) -> Where | None:
        """The `--where` expressions compiled (once per process), or None without any."""
        return _where(self.where) if self.where else None


UTF8_PIECE_CHARS = 1 << 20


def utf8_size(text: str) -> int:
    """The size of `text` in UTF-8 (a lone surrogate, which a JSON escape can spell, as its 3
    bytes), without holding a long document's whole encoding: ASCII text costs nothing (CPython
    knows it is ASCII), other text is encoded a piece at a time."""
    if text.isascii():
        return len(text)
    return sum(
        len(text[begin : begin + UTF8_PIECE_CHARS].encode("utf-8", "surrogatepass"))
        for begin in range(0, len(text), UTF8_PIECE_CHARS)
    )


@functools.lru_cache(maxsize=8)
def _where(expressions: tuple[str, ...]) -> Where:
    return Where.parse(expressions)


@attrs.define
class Documents:
    """A task's documents, in input order. Numbers are relative to the task's first line or row
    (`LineNumbers` makes them absolute); `bad` holds (relative number, reason), and
    `bad_sources` the input file of each (a task of whole text files spans several)."""

    texts: list[str] = attrs.Factory(list)
    numbers: list[int] = attrs.Factory(list)
    sources: list[int] = attrs.Factory(list)
    ids: list[str] = attrs.Factory(list)
    bad: list[tuple[int, str]] = attrs.Factory(list)
    bad_sources: list[int] = attrs.Factory(list)
    dropped: dict[int, int] = attrs.Factory(dict)  # source -> records the filter dropped
    lost_rows: int = 0  # rows of undecodable parts beyond their one entry in `bad`
    empty: int = 0
    blank: int = 0
    n_lines: int = 0
    # the input bytes the reader went through (raw lines or file bytes; the texts' characters
    # for Parquet and Arrow), kept for readers' own use: not the size of the documents' text,
    # which the pack counts from `texts` (`utf8_size`) as the dataset's counts.bytes
    text_bytes: int = 0

    def add(self, text: str, number: int, source: int, record_id: str) -> None:
        if not text:
            self.empty += 1
            return
        self.texts.append(text)
        self.numbers.append(number)
        self.sources.append(source)
        self.ids.append(record_id)

    def fail(self, number: int, source: int, why: str) -> None:
        self.bad.append((number, why))
        self.bad_sources.append(source)

    def drop(self, source: int) -> None:
        self.dropped[source] = self.dropped.get(source, 0) + 1


def _id_of(record: Any, id_field: str) -> str:
    value = record.get(id_field) if isinstance(record, dict) else None
    return "" if value is None else str(value)


def read_documents(
    task: Task,
    selection: Selection,
    storage_options: dict[str, Any] | None = None,
    *,
    limit_rows: int | None = None,
) -> Documents:
    """The documents of one task, as its format reads them (at most about `limit_rows` records
    of a columnar one). With `stop_on_bad`, reading stops at the first bad record (the caller
    reports it)."""
    return task.format.read(task, selection, storage_options, limit_rows)


def read_jsonl(
    task: Task, selection: Selection, storage_options: dict[str, Any] | None
) -> Documents:
    """A JSONL task's records: the text at `selection.field` of each line's object."""
    docs, lines = _lines(task, storage_options)
    _jsonl(docs, task, lines, selection)
    return docs


def read_text_lines(
    task: Task, selection: Selection, storage_options: dict[str, Any] | None
) -> Documents:
    """A plain text task of one document a line."""
    docs, lines = _lines(task, storage_options)
    _text_lines(docs, task, lines, selection)
    return docs


def _lines(task: Task, storage_options: dict[str, Any] | None) -> tuple[Documents, list[bytes]]:
    """A line task's lines (without their newlines), and its Documents to fill, which count
    them and their bytes."""
    data = read_range(task, storage_options)
    size = len(data)
    lines = data.split(b"\n")
    del data  # the lines hold the bytes now; one long line is then held once while parsed
    if lines and not lines[-1]:
        lines.pop()
    return Documents(n_lines=len(lines), text_bytes=size), lines


def _jsonl(docs: Documents, task: Task, lines: list[bytes], selection: Selection) -> None:
    get = field_getter(selection.field)
    where = selection.filter
    for number, line in enumerate(lines):
        if not line.strip():
            docs.blank += 1
            continue
        record, why = parse_record(line)
        if why is None and where is not None:
            try:
                if not where.keep(record):
                    docs.drop(task.source)
                    continue
            except RecordMismatch as exc:
                why = str(exc.args[0])
        text = ""
        if why is None:
            found, why = text_of(record, get, line)
            if found is not None:  # else why says what is wrong
                text = found
                why = selection.size_problem(text)
        if why is not None:
            docs.fail(number, task.source, why)
            if selection.stop_on_bad:
                return
            continue
        docs.add(text, number, task.source, _id_of(record, selection.id_field))


def _text_lines(docs: Documents, task: Task, lines: list[bytes], selection: Selection) -> None:
    for number, line in enumerate(lines):
        line = line.removesuffix(b"\r")  # a CRLF line ending is no part of the document
        if not line.strip():
            docs.blank += 1
            continue
        try:
            text = line.decode("utf-8")
            why = selection.size_problem(text)
        except UnicodeDecodeError as exc:
            why = f"invalid UTF-8 at byte {exc.start}"
        if why is not None:
            docs.fail(number, task.source, why)
            if selection.stop_on_bad:
                return
            continue
        docs.add(text, number, task.source, "")


def read_text_files(
    task: Task, selection: Selection, storage_options: dict[str, Any] | None
) -> Documents:
    """Whole files, each one document. A file that is not UTF-8 stops the pack, naming it, or
    without `stop_on_bad` is bad (number 0, its own source in `bad_sources`)."""
    docs = Documents()
    why: str | None
    for source, url in task.members:
        try:
            data = read_text_file(url, storage_options)
        except UnreadableInput as exc:
            if selection.stop_on_bad:
                raise
            docs.fail(0, source, exc.reason)
            continue
        docs.text_bytes += len(data)
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            why = f"invalid UTF-8 at byte {exc.start}; plain text inputs must be UTF-8"
            if selection.stop_on_bad:
                raise InputError(
                    f"{url}: {why}; pass --skip-bad to skip and count such files"
                ) from None
            docs.fail(0, source, why)
            continue
        why = selection.size_problem(text)
        if why is not None:
            docs.fail(0, source, why)
            if selection.stop_on_bad:
                return docs
            continue
        docs.add(text, 0, source, "")
    return docs


def read_columnar(
    task: Task, selection: Selection, storage_options: dict[str, Any] | None, limit_rows: int | None
) -> Documents:
    """A Parquet or Arrow task's rows: the text column, the filter's and the id's, checked
    against the file's schema before any row is read."""
    with storage_errors(task.url, error=InputError):
        return _columnar(task, selection, storage_options, limit_rows)


def _columnar(
    task: Task, selection: Selection, storage_options: dict[str, Any] | None, limit_rows: int | None
) -> Documents:
    from llmtrain.data_pack.columnar import (
        ColumnarError,
        check_text_field,
        column_values,
        read_batches,
        schema_of,
    )

    where = selection.filter
    source = Source(task.url, 0, None, task.format)
    schema = schema_of(source, storage_options)
    check_text_field(schema, selection.field, task.url)
    if where is not None:
        where.check_columns(schema.names, task.url)
        _check_nested_fields(where, schema, task.url)
    id_field = selection.id_field if selection.id_field in schema.names else None
    wanted = [selection.field.split(".")[0], *(where.columns if where else ()), id_field]
    columns = list(dict.fromkeys(c for c in wanted if c is not None))
    first = task.first_line or 0
    docs = Documents()
    for row, batch in read_batches(task, columns, storage_options):
        if isinstance(batch, ColumnarError):  # its rows are bad; with --skip-bad the rest stay
            docs.fail(row - first, task.source, str(batch))
            docs.lost_rows += max(0, batch.rows - 1)
            docs.n_lines += batch.rows
            if selection.stop_on_bad:
                return docs
            continue
        texts = column_values(batch, selection.field)
        ids = column_values(batch, id_field) if id_field else [None] * len(texts)
        records = _records(batch, where) if where is not None else None
        docs.n_lines += len(texts)
        for i, text in enumerate(texts):
            number = row + i - first
            if where is not None and records is not None:
                try:
                    if not where.keep(records[i]):
                        docs.drop(task.source)
                        continue
                except RecordMismatch as exc:
                    docs.fail(number, task.source, str(exc.args[0]))
                    if selection.stop_on_bad:
                        return docs
                    continue
            why = (
                f"column {selection.field!r} is null"
                if text is None
                else selection.size_problem(text)
            )
            if why is not None:
                docs.fail(number, task.source, why)
                if selection.stop_on_bad:
                    return docs
                continue
            docs.text_bytes += len(text)
            docs.add(text, number, task.source, "" if ids[i] is None else str(ids[i]))
        if limit_rows is not None and docs.n_lines >= limit_rows:
            break
    return docs


def _check_nested_fields(where: Where, schema: Any, url: str) -> None:
    """A dotted filter field the schema cannot hold (a struct without that field, or a column
    that is no struct) is refused before any row is read, as a missing column is."""
    import pyarrow as pa

    for text in where.expressions:
        label = f"{url}: --where {quoted(text)} names field"
        for field in _where((text,)).fields:
            parts = field.split(".")
            kind = schema.field(parts[0]).type
            for depth, part in enumerate(parts[1:], start=1):
                parent = ".".join(parts[:depth])
                if not pa.types.is_struct(kind):
                    raise UserError(f"{label} {field!r}, but {parent!r} is {kind}, not a struct")
                found = kind.get_field_index(part)
                if found < 0:
                    names = ", ".join(kind.field(i).name for i in range(kind.num_fields))
                    raise UserError(
                        f"{label} {field!r}, which struct {parent!r} lacks (its fields: {names})"
                    )
                kind = kind.field(found).type


def _records(batch: Any, where: Where) -> list[dict[str, Any]]:
    """The filter's columns of each row, as dicts (struct columns become nested dicts)."""
    names = where.columns
    values = [batch.column(batch.schema.get_field_index(n)).to_pylist() for n in names]
    return [dict(zip(names, row, strict=True)) for row in zip(*values, strict=True)]


def text_batches(
    sources: Sequence[Source],
    field: str,
    storage_options: dict[str, Any] | None = None,
    split_bytes: int = 16 << 20,
) -> Iterator[tuple[list[str], int]]:
    """Every non-empty document of the inputs in order, a task's at a time with the input bytes
    the task read (one process; for training tokenizers). A bad record stops with where it is,
    as `pack` does by default."""
    selection = Selection(field)
    numbers = LineNumbers()
    try:
        for task in plan_tasks(sources, split_bytes, storage_options):
            docs = read_documents(task, selection, storage_options)
            first = numbers.first(task, docs.n_lines)
            if docs.bad:
                relative, why = docs.bad[0]
                unit = sources[task.source].unit
                raise InputError(f"{location(task.url, unit, first + relative)}: {why}")
            yield docs.texts, task.input_bytes
    except UnreadableInput as exc:  # without pack's advice to skip (no such option here)
        raise InputError(
            f"{exc.url}: {exc.reason}; the file is incomplete or damaged: download or "
            "compress it again"
        ) from None
