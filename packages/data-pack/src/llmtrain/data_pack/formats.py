"""The input formats `pack` and `train-tokenizer` read, as one registry: the entries of plugin
kind `data_format` (hook `llmtrain_data_formats`). data-pack's own formats are registered through
the same hook as a third party's, so a new format is a class and one `register(...)` call.

An `InputFormat` says what a dataset records of its files (its name, what a document's number
counts), which files it claims (suffixes; `.gz`/`.zst` copies too when it reads them through
`compressed.py`), how one file is cut into tasks (`plan`, in the pack's process) and how a task's
documents are read (`read`, in a worker process). The format object travels to the workers inside
every task, so it must pickle (a module-level class holding little) and its module must import
nothing heavy at the top (pyarrow only inside the methods that need it): a worker imports it
to unpickle its first task.

`InputFormats` is one pack's view of the registry: every installed format built once, found by
name (`--input-format`) or by a file's suffix. The CLI's choices and its error for an unknown
name come from it, and a test holds data-pack's README table of formats to it.
"""

from __future__ import annotations

import abc
import functools
import posixpath
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, Literal

from llmtrain.core_mesh.errors import UserError, did_you_mean
from llmtrain.core_mesh.plugins import DATA_FORMAT
from llmtrain.data_pack.sources import COMPRESSION

if TYPE_CHECKING:
    from llmtrain.core_mesh.plugins import Entry, PluginManager
    from llmtrain.data_pack.documents import Documents, Selection
    from llmtrain.data_pack.sources import Source, Task

AUTO = "auto"  # `--input-format auto`: each file's format by its suffix
# what a file is read as when no format claims its suffix: object names often have none, and
# JSONL was the only format before there were others
FALLBACK = "jsonl"

Unit = Literal["line", "row", "file"]


class InputFormat(abc.ABC):
    """One input format. A subclass sets the class attributes below and implements `plan` and
    `read`; an attrs class works (fields for what differs between entries of one class, such as
    a delimiter). Instances should compare by value (attrs does that): sources holding them do."""

    name: str  # the entry's name, recorded as each source's `format` in a dataset's metadata
    suffixes: tuple[str, ...] = ()  # the suffixes it claims, lower case with the dot: (".csv",)
    compressible: bool = False  # read `NAME.gz`, `NAME.zst`, `NAME.zstd` decompressed
    # what a document's number counts: lines (from 1), rows (from 0), or nothing (a file is one
    # document); messages name `file:line`, `file, row N` or the file accordingly
    unit: Unit = "line"
    fields: bool = True  # records have fields that `--where` can test
    # a plain file is cut into byte ranges of the split size, so its tasks can be counted from
    # its size before planning (the pack starts no more workers than there are tasks)
    cut_by_size: bool = False
    # the format that reads the same files one document a line (`--text-per-line`), if any
    one_per_line: str | None = None

    @abc.abstractmethod
    def plan(
        self,
        source: Source,
        number: int,
        split_bytes: int,
        storage_options: dict[str, Any] | None,
    ) -> Iterator[Task]:
        """The tasks of one file (the `number`th input), in order, each about `split_bytes` of
        input, with `source=number` and `format=self`. They depend only on the file and
        `split_bytes`, never on the number of workers, which is what keeps a pack's output the
        same whatever runs it. Runs in the pack's process; a file that cannot be used raises a
        `BadFile` (`--skip-bad` leaves it out). Tasks of whole files (`members`) are joined
        with the next ones of the same format up to `split_bytes` (`plan_tasks`)."""

    @abc.abstractmethod
    def read(
        self,
        task: Task,
        selection: Selection,
        storage_options: dict[str, Any] | None,
        limit_rows: int | None,
    ) -> Documents:
        """The documents of one task in input order, with the text `selection` names, each
        numbered from the task's first line or row, and what was blank, empty, dropped by the
        filter or bad. With `selection.stop_on_bad`, reading stops after the first bad record.
        `limit_rows`: a sample needs no more records than this (a hint; None: all). Runs in a
        worker process."""


class InputFormats(Mapping[str, InputFormat]):
    """The installed input formats by name, and the suffixes they claim."""

    def __init__(self, formats: Mapping[str, InputFormat]):
        self._formats = dict(sorted(formats.items()))
        self._by_suffix: dict[str, InputFormat] = {}
        for fmt in self._formats.values():
            for suffix in fmt.suffixes:
                taken = self._by_suffix.setdefault(suffix.lower(), fmt)
                if taken is not fmt:
                    raise UserError(
                        f"input formats {taken.name!r} and {fmt.name!r} both claim the suffix "
                        f"{suffix}; disable the plugin of one (LLMTRAIN_DISABLE_PLUGINS, see "
                        "`llmtrain plugins`)"
                    )

    @classmethod
    def from_plugins(cls, plugins: PluginManager) -> InputFormats:
        """Every `data_format` entry, built with its defaults."""
        return cls(
            {entry.name: _built(plugins, entry) for entry in plugins.registry(DATA_FORMAT).values()}
        )

    def named(self, name: str) -> InputFormat:
        """The format called `name`; an unknown name is an error listing the choices."""
        if name in self._formats:
            return self._formats[name]
        choices = ", ".join([AUTO, *self._formats])
        raise UserError(
            f"unknown input format {name!r}{did_you_mean(name, self._formats)}; choose one of "
            f"{choices} (`llmtrain plugins` lists the data_format plugins that add them)"
        )

    def for_file(self, url: str, requested: str = AUTO) -> InputFormat:
        """A file's format: the one requested, else the one claiming its suffix (under any
        compression suffix), else FALLBACK."""
        if requested != AUTO:
            return self.named(requested)
        return self._by_suffix.get(_suffix(url)) or self.named(FALLBACK)

    def claims(self, path: str) -> bool:
        """Whether a file found in a directory input is one to read: some format claims its
        suffix, and its name does not start with `.` or `_` (hidden files, Spark's _SUCCESS)."""
        name = posixpath.basename(path)
        return not name.startswith((".", "_")) and _suffix(name) in self._by_suffix

    def suffixes(self) -> list[str]:
        return list(self._by_suffix)

    def one_per_line(self, fmt: InputFormat) -> InputFormat:
        """The format that reads `fmt`'s files one document a line, or `fmt` itself."""
        return fmt if fmt.one_per_line is None else self.named(fmt.one_per_line)

    def __getitem__(self, name: str) -> InputFormat:
        return self.named(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._formats)

    def __len__(self) -> int:
        return len(self._formats)


def _suffix(url: str) -> str:
    name = posixpath.basename(url)
    for suffix in COMPRESSION:
        name = name.removesuffix(suffix)
    return posixpath.splitext(name)[1].lower()


def _built(plugins: PluginManager, entry: Entry) -> InputFormat:
    """What an entry's factory builds, checked: core-mesh cannot check it (it does not know the
    type), and a wrong object would otherwise fail in a worker, far from its plugin."""
    built = plugins.build(DATA_FORMAT, entry.name)
    where = f"data_format {entry.name!r} of {entry.origin.describe()}"
    if not isinstance(built, InputFormat):
        raise UserError(
            f"{where} built a {type(built).__name__}, not an InputFormat; its factory must "
            "return an instance of a subclass of llmtrain.data_pack.formats.InputFormat"
        )
    if built.name != entry.name:
        raise UserError(
            f"{where} built a format named {built.name!r}; a format's name is its entry's"
        )
    return built


@functools.cache
def installed_formats() -> InputFormats:
    """The formats of the installed plugins, for callers that pass no plugin manager (and for
    a `Source` made by hand with a format's name)."""
    from llmtrain.core_mesh.plugins import PluginManager

    return InputFormats.from_plugins(PluginManager().load_entry_points())
