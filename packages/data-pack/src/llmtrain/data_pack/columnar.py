"""Parquet and Arrow inputs, read with pyarrow: planning tasks from file metadata, checking the
schema before any row is read, and streaming the needed columns in bounded record batches.

A Parquet task is one or more consecutive row groups (up to the split size, compressed); an Arrow
task is a run of record batches of a local file (memory-mapped, so counting them reads nothing),
or the whole file when it is remote. Workers open the files themselves and read only the columns
the pack needs (the text, the filter's columns, the id), `READ_ROWS` rows at a time, so memory
stays bounded whatever the file size. Rows are numbered from 0 within each file.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from llmtrain.data_pack.sources import BadFile, Source, Task

READ_ROWS = 2048
_STRINGS = (pa.string(), pa.large_string())
# what ends every Arrow IPC stream its writer closed (a continuation marker and a length of 0)
_END_OF_STREAM = b"\xff\xff\xff\xff\x00\x00\x00\x00"


class ColumnarError(BadFile):
    """A Parquet or Arrow file that cannot be read, or whose columns do not fit the pack."""

    rows = 0  # rows an undecodable part held (what --skip-bad counts as bad)


def _unreadable(url: str, what: str, exc: BaseException, advice: str) -> ColumnarError:
    reason = f"not a readable {what} file ({_reason(exc)})"
    error = ColumnarError(f"{url}: {reason}; it may be truncated or corrupt: {advice}")
    error.reason = reason
    return error


def _local(url: str) -> str | None:
    if "://" not in url:
        return url
    return url.removeprefix("file://") if url.startswith("file://") else None


@contextlib.contextmanager
def _opened(url: str, storage_options: dict[str, Any] | None) -> Iterator[Any]:
    """A file pyarrow reads: memory-mapped when local, an fsspec file otherwise."""
    path = _local(url)
    if path is not None:
        with pa.memory_map(path) as f:
            yield f
        return
    with fsspec.open(url, "rb", **(storage_options or {})) as f:
        yield f


def _parquet(f: Any, url: str) -> pq.ParquetFile:
    """The file's reader; pages that carry a checksum are checked against it as they are read,
    so flipped bits are an error rather than silently different text."""
    try:
        return pq.ParquetFile(f, page_checksum_verification=True)
    except (pa.ArrowException, OSError) as exc:
        advice = "download it again, or pass --skip-bad to leave it out"
        raise _unreadable(url, "Parquet", exc, advice) from None


def _arrow(f: Any, url: str) -> Any:
    """An IPC file reader (random access) or stream reader (what datasets writes)."""
    try:
        return pa.ipc.open_file(f)
    except (pa.ArrowException, OSError):
        pass
    advice = "write it again, or pass --skip-bad to leave it out"
    try:
        f.seek(0, 2)
        f.seek(max(0, f.tell() - len(_END_OF_STREAM)))
        ended = f.read(len(_END_OF_STREAM)) == _END_OF_STREAM
        f.seek(0)
        reader = pa.ipc.open_stream(f)
    except (pa.ArrowException, OSError) as exc:
        raise _unreadable(url, "Arrow", exc, advice) from None
    if not ended:  # cut between two record batches, it would read as fewer rows
        problem = ValueError("the stream has no end-of-stream marker: cut short")
        raise _unreadable(url, "Arrow", problem, advice)
    return reader


def _reason(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0].rstrip(".") if text else type(exc).__name__


def _batches(reader: Any) -> Iterator[pa.RecordBatch]:
    if isinstance(reader, pa.ipc.RecordBatchFileReader):
        for i in range(reader.num_record_batches):
            yield reader.get_batch(i)
    else:
        yield from reader


def schema_of(source: Source, storage_options: dict[str, Any] | None = None) -> pa.Schema:
    with _opened(source.url, storage_options) as f:
        if source.format.name == "parquet":
            return _parquet(f, source.url).schema_arrow
        return _arrow(f, source.url).schema


def plan_columnar(
    source: Source,
    number: int,
    split_bytes: int,
    storage_options: dict[str, Any] | None = None,
) -> Iterator[Task]:
    """A file's tasks: runs of row groups (Parquet) or record batches (local Arrow) of about
    `split_bytes`, each knowing the number of its first row."""
    with _opened(source.url, storage_options) as f:
        if source.format.name == "parquet":
            meta = _parquet(f, source.url).metadata
            sizes = [
                (
                    meta.row_group(g).num_rows,
                    sum(
                        meta.row_group(g).column(c).total_compressed_size
                        for c in range(meta.num_columns)
                    ),
                )
                for g in range(meta.num_row_groups)
            ]
        elif _local(source.url) is None:  # a remote stream: one task reads it through
            yield Task(
                source=number,
                url=source.url,
                format=source.format,
                first_line=0,
                input_bytes=source.size,
            )
            return
        else:
            try:
                sizes = [(b.num_rows, b.nbytes) for b in _batches(_arrow(f, source.url))]
            except (pa.ArrowException, OSError) as exc:
                reason = f"cannot read its record batches ({_reason(exc)}; a truncated file?)"
                error = ColumnarError(f"{source.url}: {reason}")
                error.reason = reason
                raise error from None
    total = sum(size for _, size in sizes) or 1
    row = group_start = 0
    while group_start < len(sizes):
        stop, size = group_start, 0
        while stop < len(sizes) and (stop == group_start or size + sizes[stop][1] <= split_bytes):
            size += sizes[stop][1]
            stop += 1
        rows = sum(n for n, _ in sizes[group_start:stop])
        input_bytes = source.size * size // total
        if source.format.name == "parquet":
            yield Task(
                source=number,
                url=source.url,
                format=source.format,
                row_groups=tuple(range(group_start, stop)),
                first_line=row,
                input_bytes=input_bytes,
            )
        else:
            yield Task(
                source=number,
                url=source.url,
                format=source.format,
                batches=(group_start, stop),
                first_line=row,
                input_bytes=input_bytes,
            )
        row += rows
        group_start = stop


def read_batches(
    task: Task, columns: Sequence[str], storage_options: dict[str, Any] | None = None
) -> Iterator[tuple[int, pa.RecordBatch | ColumnarError]]:
    """(first row, batch of `columns`) for a task's rows, at most READ_ROWS rows a batch. A part
    that fails to decode comes as a ColumnarError in its batch's place, naming the row group or
    batch, its rows and the column that fails (its `rows`: how many rows were lost); reading
    goes on with the next row group, or stops for an Arrow stream, which has no way past it."""
    row = task.first_line or 0
    with _opened(task.url, storage_options) as f:
        if task.format.name == "parquet":
            pf = _parquet(f, task.url)
            for group in task.row_groups:
                n = pf.metadata.row_group(group).num_rows
                start = row
                try:
                    for batch in pf.iter_batches(
                        batch_size=READ_ROWS,
                        row_groups=[group],
                        columns=list(columns),
                        use_threads=False,
                    ):
                        yield row, batch
                        row += batch.num_rows
                except (pa.ArrowException, OSError) as exc:
                    error = ColumnarError(
                        f"{_failing_columns(pf, group, columns)}row group {group} (rows "
                        f"{start}-{start + n - 1}) cannot be decoded: {_reason(exc)}"
                    )
                    error.rows = start + n - row
                    yield row, error
                    row = start + n
            return
        first, stop = task.batches
        try:
            for number, batch in enumerate(_batches(_arrow(f, task.url))):
                if stop and number >= stop:
                    break
                if number < first:
                    continue
                batch = batch.select(list(columns))
                for begin in range(0, batch.num_rows, READ_ROWS):
                    piece = batch.slice(begin, READ_ROWS)
                    yield row, piece
                    row += piece.num_rows
        except (pa.ArrowException, OSError) as exc:
            error = ColumnarError(
                f"the record batches from row {row} on cannot be read: {_reason(exc)} "
                "(a truncated file?)"
            )
            error.rows = 1  # a broken stream has no row count past the break
            yield row, error


def _failing_columns(pf: pq.ParquetFile, group: int, columns: Sequence[str]) -> str:
    """A message's prefix naming the columns that fail to decode on their own ("column 'text'
    of "); the row group is read again, one column at a time, only after it failed."""
    failing = []
    for column in columns:
        try:
            for _ in pf.iter_batches(
                batch_size=READ_ROWS, row_groups=[group], columns=[column], use_threads=False
            ):
                pass
        except (pa.ArrowException, OSError):
            failing.append(repr(column))
    if not failing:
        return ""
    return f"column{'s' if len(failing) > 1 else ''} {', '.join(failing)} of "


def field_type(schema: pa.Schema, path: str) -> pa.DataType | None:
    """The type at a dotted path through struct columns, or None if there is none."""
    kind: Any = schema
    for part in path.split("."):
        if isinstance(kind, pa.Schema):
            found = kind.get_field_index(part)
            kind = kind.field(found).type if found >= 0 else None
        elif isinstance(kind, pa.StructType):
            found = kind.get_field_index(part)
            kind = kind.field(found).type if found >= 0 else None
        else:
            kind = None
        if kind is None:
            return None
    return kind


def check_text_field(schema: pa.Schema, field: str, url: str) -> None:
    """The text column exists and holds strings, before any row is read."""
    kind = field_type(schema, field)
    if kind is None:
        raise ColumnarError(
            f"{url}: no column {field!r} (columns: {', '.join(schema.names)}); pass --field "
            "with the text column (a dotted path for a struct field)"
        )
    if pa.types.is_dictionary(kind):  # categorical strings (pandas writes them so)
        kind = kind.value_type
    if kind not in _STRINGS and not str(kind).startswith("string_view"):
        raise ColumnarError(
            f"{url}: column {field!r} is {kind}, not a string; pass --field with the text column"
        )


def column_values(batch: pa.RecordBatch, path: str) -> list[Any]:
    """A (possibly dotted) column's values as Python objects; a row whose struct is null is
    null (`StructArray.field` alone would show whatever its child holds there)."""
    import pyarrow.compute as pc

    top, *rest = path.split(".")
    array: Any = batch.column(batch.schema.get_field_index(top))
    if rest:
        array = pc.struct_field(array, rest)
    values: list[Any] = array.to_pylist()
    return values
