"""The input formats data-pack has always read, as entries of the format registry: `jsonl`,
`text` (a document a file), `text-lines` (a document a line: `--text-per-line`), `parquet` and
`arrow`. Each class only says what the format is and which of the readers in `sources.py`,
`documents.py` and `columnar.py` plan and read it; `plugin.py` registers them.

Nothing heavy is imported here: a worker imports this module to unpickle its tasks, and pyarrow
only comes with the first Parquet or Arrow task (`columnar.py`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import attrs

from llmtrain.data_pack.documents import (
    Documents,
    Selection,
    read_columnar,
    read_jsonl,
    read_text_files,
    read_text_lines,
)
from llmtrain.data_pack.formats import InputFormat
from llmtrain.data_pack.sources import Source, Task, line_tasks


@attrs.frozen
class JsonlFormat(InputFormat):
    """JSON lines: an object a line, the text at `--field` (a dotted path); any suffix that no
    format claims is read as JSONL too."""

    name = "jsonl"
    suffixes = (".jsonl", ".ndjson", ".json")
    compressible = True
    cut_by_size = True

    def plan(
        self, source: Source, number: int, split_bytes: int, storage_options: dict[str, Any] | None
    ) -> Iterator[Task]:
        return line_tasks(source, number, split_bytes, storage_options)

    def read(
        self,
        task: Task,
        selection: Selection,
        storage_options: dict[str, Any] | None,
        limit_rows: int | None,
    ) -> Documents:
        return read_jsonl(task, selection, storage_options)


@attrs.frozen
class TextFormat(InputFormat):
    """Plain UTF-8 text, a document a file; small files are read several to a task."""

    name = "text"
    suffixes = (".txt",)
    compressible = True
    unit = "file"
    fields = False
    one_per_line = "text-lines"

    def plan(
        self, source: Source, number: int, split_bytes: int, storage_options: dict[str, Any] | None
    ) -> Iterator[Task]:
        yield Task(
            source=number,
            url=source.url,
            format=self,
            first_line=0,  # a whole file is one document: its number is 0
            input_bytes=source.size,
            members=((number, source.url),),
        )

    def read(
        self,
        task: Task,
        selection: Selection,
        storage_options: dict[str, Any] | None,
        limit_rows: int | None,
    ) -> Documents:
        return read_text_files(task, selection, storage_options)


@attrs.frozen
class TextLinesFormat(InputFormat):
    """Plain UTF-8 text, a document a line (`.txt` files with `--text-per-line`)."""

    name = "text-lines"
    compressible = True
    fields = False
    cut_by_size = True

    def plan(
        self, source: Source, number: int, split_bytes: int, storage_options: dict[str, Any] | None
    ) -> Iterator[Task]:
        return line_tasks(source, number, split_bytes, storage_options)

    def read(
        self,
        task: Task,
        selection: Selection,
        storage_options: dict[str, Any] | None,
        limit_rows: int | None,
    ) -> Documents:
        return read_text_lines(task, selection, storage_options)


class _Columnar(InputFormat):
    """Parquet and Arrow: planned from file metadata, read a bounded batch of rows at a time."""

    unit = "row"

    def plan(
        self, source: Source, number: int, split_bytes: int, storage_options: dict[str, Any] | None
    ) -> Iterator[Task]:
        from llmtrain.data_pack.columnar import plan_columnar

        return plan_columnar(source, number, split_bytes, storage_options)

    def read(
        self,
        task: Task,
        selection: Selection,
        storage_options: dict[str, Any] | None,
        limit_rows: int | None,
    ) -> Documents:
        return read_columnar(task, selection, storage_options, limit_rows)


@attrs.frozen
class ParquetFormat(_Columnar):
    """Parquet files, cut into runs of row groups."""

    name = "parquet"
    suffixes = (".parquet",)


@attrs.frozen
class ArrowFormat(_Columnar):
    """Arrow IPC files and streams (what `datasets.save_to_disk` writes), cut into runs of
    record batches."""

    name = "arrow"
    suffixes = (".arrow",)
