"""`pack`: JSONL in, a packed zarr dataset out, tokenized by worker processes. With chat settings
(`llmtrain data pack-chat`) the records are conversations, rendered with a chat template into
tokens and a loss mask and laid into blocks of the sequence length (see `chat.py`).

The recipe: check the options and expand the inputs → start the workers (they import while the
rest of the set-up runs) → resolve the tokenizer and token dtype (errors before any output) →
choose the encoder path (the fast BPE path only if it matches on a sample) → open the output
under a temporary name → tokenize tasks in the spawn-started workers, consuming results in task
order → write whole chunks as they fill → commit the group metadata last. Any failure (a bad line
in `error` mode, a worker that dies, an interrupt) removes the partial output; nothing is
committed.
"""

from __future__ import annotations

import collections
import multiprocessing
import os
import pickle
import tempfile
import time
from collections.abc import Generator, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from multiprocessing.process import BaseProcess
from typing import Any, Literal

import attrs
import numpy as np
import structlog

from llmtrain.core_mesh.errors import UserError
from llmtrain.core_mesh.plugins import PluginManager
from llmtrain.data_pack.chat import BlockPacker, ChatSettings, ChatTemplate
from llmtrain.data_pack.documents import read_documents
from llmtrain.data_pack.filters import Where
from llmtrain.data_pack.formats import InputFormats
from llmtrain.data_pack.pack_worker import (
    PackError,
    PackSettings,
    TaskResult,
    init_worker,
    tokenize_task,
    warm_up,
)
from llmtrain.data_pack.progress import Progress, ProgressSettings
from llmtrain.data_pack.sources import (
    InputError,
    LineNumbers,
    Source,
    Task,
    expand_inputs,
    location,
    plan_tasks,
)
from llmtrain.data_pack.store import (
    DEFAULT_COMPRESSION,
    FORMAT,
    FORMAT_VERSION,
    DatasetWriter,
    Origins,
    Output,
    compressors,
    token_dtype,
)
from llmtrain.data_pack.tokenizer import tokenizer_from_raw

log = structlog.get_logger("llmtrain.data_pack")

MAX_RECORDED_BAD_LINES = 100
FAST_SAMPLE_BYTES = 512 << 10  # HF's encoding of it is most of the check's CPU
MAX_SPLIT_BYTES = 16 << 20


@attrs.frozen
class PackSummary:
    url: str
    documents: int
    tokens: int
    bad_lines: int
    empty_documents: int
    blank_lines: int
    input_bytes: int
    seconds: float
    encoder: str
    dropped: int = 0  # records the --where filter dropped
    n_bytes: int | None = None  # the UTF-8 bytes of the documents' text (counts.bytes); chat: None

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def default_workers() -> int:
    """One per core this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


# how often a wait for a task's result checks that the workers are alive
_WORKER_CHECK_SECONDS = 1.0


# -- the parent side ------------------------------------------------------------------------------


class _Workers:
    """The processes that read and tokenize tasks, spawn-started first thing in `pack` so that
    they import the readers and the tokenizer stack while this process builds and checks the
    tokenizer they are then given. With one worker, tasks run in this process."""

    def __init__(self, workers: int, storage_options: dict[str, Any]):
        self.pool: ProcessPoolExecutor | None = None
        self.count = max(1, workers)
        self.runs = 0
        if workers <= 1:
            init_worker(storage_options)
            return
        self.folder = tempfile.TemporaryDirectory(prefix="llmtrain-pack-")
        self.pool = ProcessPoolExecutor(
            max_workers=workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=init_worker,
            initargs=(storage_options,),
        )
        for _ in range(workers):  # a process starts for each task submitted while none is idle
            self.pool.submit(warm_up)

    def run(
        self, tasks: Iterable[Task], settings: PackSettings, tokenizer: Any
    ) -> Generator[TaskResult, None, None]:
        """Results in task order. `tokenizer`: pickled bytes, or its spec (see `_portable`)."""
        task: Task | None = None  # the one under way, named when a worker dies
        if self.pool is None:
            for task in tasks:
                yield tokenize_task(task, settings, tokenizer)
            return
        tokenizer = self._by_file(tokenizer)
        pending: collections.deque[tuple[Task, Future[TaskResult]]] = collections.deque()
        try:
            for task in tasks:
                pending.append((task, self.pool.submit(tokenize_task, task, settings, tokenizer)))
                while len(pending) >= 2 * self.count:
                    task, future = pending.popleft()
                    yield self._result(future)
            while pending:
                task, future = pending.popleft()
                yield self._result(future)
        except BrokenProcessPool:
            raise PackError(
                f"a worker process died{_while(task)}; nothing was written. Check memory limits "
                "and the log, then pack again"
            ) from None
        finally:  # a run given up (the fast encoder's check failed) leaves its queue to the next
            for _, future in pending:
                future.cancel()

    def _result(self, future: Future[TaskResult]) -> TaskResult:
        """The future's result, or BrokenProcessPool as soon as a worker has died. The pool
        itself may never notice: a worker killed while sending its result leaves the pool's
        reader thread waiting for the rest of that message."""
        while True:
            try:
                return future.result(timeout=_WORKER_CHECK_SECONDS)
            except TimeoutError:
                if any(process.exitcode is not None for process in self._processes()):
                    raise BrokenProcessPool("a worker process died") from None

    def _processes(self) -> list[BaseProcess]:
        return list((getattr(self.pool, "_processes", None) or {}).values())

    def _by_file(self, tokenizer: bytes | dict[str, Any]) -> str | dict[str, Any]:
        """A pickled tokenizer as a file the workers read: a task's arguments are pickled for
        every task, a path costs nothing."""
        if isinstance(tokenizer, dict):
            return tokenizer
        self.runs += 1
        path = os.path.join(self.folder.name, f"tokenizer-{self.runs}.pickle")
        with open(path, "wb") as f:
            f.write(tokenizer)
        return path

    def __len__(self) -> int:
        return self.count

    def __enter__(self) -> _Workers:
        return self

    def __exit__(self, error_type: Any, *_: Any) -> None:
        self.close(finished=error_type is None)

    def close(self, *, finished: bool) -> None:
        """Wait for the workers after a finished pack; else end them at once: a worker killed
        mid-task can leave the others blocked on the task queue, and a graceful shutdown would
        wait for them forever."""
        if self.pool is None:
            return
        if finished:
            self.pool.shutdown(wait=True)
        else:
            processes = self._processes()
            results = getattr(self.pool, "_result_queue", None)  # shutdown forgets it
            self.pool.shutdown(wait=False, cancel_futures=True)
            for process in processes:
                if process.is_alive():
                    process.kill()
            for process in processes:
                process.join(timeout=10)
            _unblock_reader(results)
        self.folder.cleanup()


def _unblock_reader(results: Any) -> None:
    """Close this process's end of the pipe the workers sent results through (`results`: the
    pool's result queue), once they are dead. A worker killed halfway through sending a result
    leaves the pool's reader thread waiting for the rest forever, and the interpreter waits for
    that thread at exit; with every writer gone it reads end-of-file and winds the pool up."""
    writer = getattr(results, "_writer", None)
    if writer is not None:
        writer.close()


def _while(task: Task | None) -> str:
    if task is None:
        return ""
    span = f"bytes {task.start}-{task.end}" if task.payload is None else f"line {task.first_line}"
    return f" while tokenizing {task.url} ({span} or a task beside it)"


@attrs.define
class _Encoder:
    """Which encoder the workers run (`for_workers`: the tokenizer or its spec), and the check of
    the fast one that may still be running in a thread of this process."""

    name: str  # fast or reference
    for_workers: Any
    check: Future[tuple[int | None, int]] | None = None

    def settle(self) -> None:
        """Wait for the check; raise _FastDiffers if the fast encoder failed it. Called before
        anything is written, so a failed check costs only the work done so far."""
        if self.check is None:
            return
        differs, checked = self.check.result()
        self.check = None
        if differs is not None:
            raise _FastDiffers(differs)
        log.info("pack.fast_encoder", checked_documents=checked)


class _FastDiffers(Exception):
    """The fast encoder gave other ids than the reference on the sample (args[0]: which text)."""


def _choose_encoder(
    tokenizer: Any,
    raw: dict[str, Any],
    sources: Sequence[Source],
    settings: PackSettings,
    storage_options: dict[str, Any],
) -> _Encoder:
    """Use the fast BPE path only if it gives the reference ids on a sample of every input. The
    workers start with it at once while a thread here checks it on the sample: the check costs no
    time of its own, and nothing is written until it passes (else the pack starts over with the
    reference encoder)."""
    if not getattr(tokenizer, "fast", False) or raw.get("fast") == "off" or settings.chat:
        return _Encoder("reference", _portable(tokenizer, raw))
    if raw.get("fast") == "on":
        return _Encoder("fast", _portable(tokenizer, raw))

    def check() -> tuple[int | None, int]:
        texts = _sample_texts(sources, settings, storage_options)
        return tokenizer.first_fast_difference(texts), len(texts)

    checker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fast-check")
    future = checker.submit(check)
    checker.shutdown(wait=False)
    return _Encoder("fast", _portable(tokenizer.with_fast(True), {**raw, "fast": "on"}), future)


def _settled_first(
    results: Generator[TaskResult, None, None], encoder: _Encoder
) -> Iterator[TaskResult]:
    """The results, each only once the fast encoder's check has passed (nothing is written
    before). A failure of the work before then is what the fast encoder did if the check fails:
    the check's verdict comes first."""
    try:
        for result in results:
            encoder.settle()
            yield result
    except Exception:
        encoder.settle()
        raise
    finally:  # a run given up stops here, its queued tasks cancelled, before the next starts
        results.close()


def _reference_encoder(tokenizer: Any, raw: dict[str, Any]) -> _Encoder:
    return _Encoder("reference", _portable(tokenizer.with_fast(False), {**raw, "fast": "off"}))


def _sample_texts(
    sources: Sequence[Source], settings: PackSettings, storage_options: dict[str, Any]
) -> list[str]:
    """Documents from the start of each input (up to 16 files, FAST_SAMPLE_BYTES in all; a longer
    document's start); bad records are left out here (the pack itself reports them)."""
    chosen = list(sources[:: max(1, len(sources) // 16)])[:16]
    per_file = max(32 << 10, FAST_SAMPLE_BYTES // max(1, len(chosen)))
    selection = attrs.evolve(settings.selection, stop_on_bad=False)
    texts: list[str] = []
    for source in chosen:
        try:  # a file that cannot be read is the pack's to report (or skip), not the sample's
            task = next(plan_tasks([source], per_file, storage_options), None)
            if task is None:
                continue
            documents = read_documents(task, selection, storage_options, limit_rows=1024)
        except InputError:
            continue
        size = 0
        for text in documents.texts:
            texts.append(text[: per_file - size])  # HF's encoding of a whole long one is slow
            size += len(texts[-1])
            if size >= per_file:
                break
    return texts


def pack(
    inputs: Sequence[str],
    output: str,
    tokenizer: Mapping[str, Any],
    *,
    field: str = "text",
    workers: int | None = None,
    on_bad_line: Literal["error", "skip"] = "error",
    overwrite: bool = False,
    dtype: str | None = None,
    chunk_tokens: int = 1 << 20,
    shard_chunks: int = 0,
    compression: str = DEFAULT_COMPRESSION,
    split_bytes: int | None = None,
    batch_docs: int = 512,
    storage_options: Mapping[str, Any] | None = None,
    plugins: PluginManager | None = None,
    progress: ProgressSettings = ProgressSettings(),
    chat: ChatSettings | None = None,
    where: Sequence[str] = (),
    id_field: str = "id",
    input_format: str = "auto",
    text_per_line: bool = False,
    max_doc_bytes: int = 0,
) -> PackSummary:
    """Pack files of any installed input format (JSONL, Parquet, Arrow, text, ...: the
    `data_format` plugins of `plugins`) into a zarr token dataset; returns the counts. See the
    module docstring. `input_format`: a format's name for every input, or "auto" (by suffix).
    `where`: filter expressions every kept record meets. With `chat`, the records are JSONL
    conversations (`field` is unused). `max_doc_bytes`: a longer document (its text in UTF-8)
    is a bad record, refused or skipped as `on_bad_line` says; 0: no limit."""
    started = time.perf_counter()
    storage_options = dict(storage_options or {})
    if on_bad_line not in ("error", "skip"):
        raise UserError(f"on_bad_line {on_bad_line!r}: use error or skip")
    filters = Where.parse(where)  # a bad expression is an error before any work
    plugins = plugins or PluginManager().load_entry_points()
    formats = InputFormats.from_plugins(plugins)
    sources = expand_inputs(
        inputs, storage_options, input_format, text_per_line=text_per_line, formats=formats
    )
    _check_formats(sources, chat, filters, formats)
    total_bytes = sum(s.size for s in sources)
    workers = workers or default_workers()
    if split_bytes is None:  # enough tasks that the last ones do not run alone
        split_bytes = int(min(MAX_SPLIT_BYTES, max(1 << 20, total_bytes // (workers * 8))))
    _check_sizes(max_doc_bytes, chunk_tokens, shard_chunks, split_bytes, batch_docs)
    compressors(compression)  # a bad spelling is an error before any work
    # the workers start now: they import while the tokenizer is built and checked here
    with _Workers(_workers_for(sources, split_bytes, workers), storage_options) as pool:
        raw, tok = _built_tokenizer(tokenizer, plugins)
        token_type = token_dtype(tok.vocab_size, dtype)
        settings = PackSettings(
            field,
            on_bad_line,
            batch_docs,
            token_type.name,
            tok.vocab_size,
            chat,
            tok.eod_id,
            filters.expressions,
            id_field,
            max_doc_bytes,
        )
        if chat is not None:  # the template compiles and its tokens exist, before any work
            _check_template(chat, tok)
        encoder = _choose_encoder(tok, raw, sources, settings, storage_options)
        out = Output(output, overwrite=overwrite, storage_options=storage_options)
        meter = None
        try:  # from the moment the staging directory exists: an interrupt anywhere removes it
            log.info(
                "pack.start",
                inputs=len(sources),
                bytes=total_bytes,
                workers=len(pool),
                tokenizer=tok.name,
                encoder=encoder.name,
                output=output,
            )
            meter = Progress(progress, total_bytes, event="pack.progress", desc="packing")
            writer = DatasetWriter(
                out,
                token_type,
                chunk_tokens=chunk_tokens,
                shard_chunks=shard_chunks,
                compression=compression,
                loss_mask=chat is not None,
                origins=chat is None,
            )
            work = _Work(sources, settings, pool, storage_options, writer, split_bytes, meter)
            counts, encoder = _write_checked(work, encoder, tok, raw)
            if chat is not None and not counts["counts"]["documents"]:
                raise PackError(
                    f"no conversation of {', '.join(inputs)} was kept "
                    f"({counts['counts']['too_long']} too long, {counts['counts']['bad_lines']} "
                    "bad); nothing was written"
                )
            out.commit(_metadata(tok, raw, token_type.name, settings, sources, counts))
        except BaseException as exc:
            out.abort(exc)
            raise
        finally:
            if meter is not None:
                meter.close()
    return _summary(output, counts["counts"], total_bytes, started, encoder.name)


def _check_sizes(
    max_doc_bytes: int,
    chunk_tokens: int,
    shard_chunks: int,
    split_bytes: int,
    batch_docs: int,
) -> None:
    """The sizes, refused by name before any work."""
    if max_doc_bytes < 0:
        raise UserError(f"--max-doc-bytes {max_doc_bytes}: give 0 (no limit) or more bytes")
    if chunk_tokens < 1 or shard_chunks < 0 or split_bytes < 1 or batch_docs < 1:
        raise UserError(
            f"chunk_tokens ({chunk_tokens}), split size ({split_bytes} bytes) and batch_docs "
            f"({batch_docs}) must be at least 1, shard_chunks ({shard_chunks}) at least 0"
        )


def _built_tokenizer(
    tokenizer: Mapping[str, Any], plugins: PluginManager
) -> tuple[dict[str, Any], Any]:
    """The tokenizer's spec as the dataset stores it (a local path made absolute, so the spec
    works from anywhere) and the tokenizer built from it."""
    raw = dict(tokenizer)
    if isinstance(raw.get("path"), str) and "://" not in raw["path"]:
        raw["path"] = os.path.abspath(raw["path"])
    return raw, tokenizer_from_raw(raw, plugins)


@attrs.frozen
class _Work:
    """What `_write` needs besides the encoder: the inputs, how to read them, where to."""

    sources: Sequence[Source]
    settings: PackSettings
    pool: _Workers
    storage_options: dict[str, Any]
    writer: DatasetWriter
    split_bytes: int
    meter: Progress


def _write_checked(
    work: _Work, encoder: _Encoder, tok: Any, raw: dict[str, Any]
) -> tuple[dict[str, Any], _Encoder]:
    """The counts of writing every input, and the encoder that wrote them: when the fast
    encoder fails its check on the sample, the pack starts over with the reference encoder."""
    try:
        return _write(work, encoder), encoder
    except _FastDiffers as differs:
        log.warning("pack.fast_encoder_differs", document=differs.args[0], using="reference")
    encoder = _reference_encoder(tok, raw)
    work.meter.reset()
    return _write(work, encoder), encoder


def _metadata(
    tok: Any,
    raw: dict[str, Any],
    dtype: str,
    settings: PackSettings,
    sources: Sequence[Source],
    counts: dict[str, Any],
) -> dict[str, Any]:
    """The dataset's metadata: format, tokenizer, dtype, sources with their tallies, counts."""
    chat, expressions = settings.chat, settings.where
    extra = {} if chat is None else {"chat": chat.to_meta()}
    return {
        **extra,
        "format": FORMAT,
        "version": FORMAT_VERSION if chat is not None else 1,
        "tokenizer": {
            "name": tok.name,
            "fingerprint": tok.fingerprint,
            "vocab_size": tok.vocab_size,
            "eod_id": tok.eod_id,
            "spec": {k: v for k, v in raw.items() if k != "fast"},
        },
        "dtype": dtype,
        "field": None if chat is not None else settings.field,
        "sources": [
            {**s.to_meta(), **tally} for s, tally in zip(sources, counts["per_file"], strict=True)
        ],
        "filter": {"where": list(expressions)} if expressions else None,
        "counts": counts["counts"],
        "bad_lines": counts["bad_lines"],
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _summary(
    output: str, c: dict[str, Any], total_bytes: int, started: float, encoder: str
) -> PackSummary:
    """The counts `pack` returns, logged as `pack.done`."""
    summary = PackSummary(
        output,
        c["documents"],
        c["tokens"],
        c["bad_lines"],
        c["empty_documents"],
        c["blank_lines"],
        total_bytes,
        time.perf_counter() - started,
        encoder,
        c.get("dropped", 0),
        c.get("bytes"),
    )
    log.info(
        "pack.done",
        documents=summary.documents,
        tokens=summary.tokens,
        bad_lines=summary.bad_lines,
        empty_documents=summary.empty_documents,
        utf8_bytes=summary.n_bytes,
        seconds=round(summary.seconds, 3),
        tokens_per_s=round(summary.tokens_per_second),
    )
    return summary


def _portable(tokenizer: Any, raw: dict[str, Any]) -> bytes | dict[str, Any]:
    """What the workers get: the tokenizer pickled (built and checked once, here), or its spec
    if it does not pickle (each worker builds it through the plugins). Pickled bytes rather than
    the object: a process start blocks until the new process has read its arguments, so an object
    would be unpickled by one worker after the other, bytes by all of them at once."""
    try:
        return pickle.dumps(tokenizer)
    except (pickle.PicklingError, TypeError, AttributeError):  # a plugin's need not pickle
        return raw


def _workers_for(sources: Sequence[Source], split_bytes: int, workers: int) -> int:
    """No more workers than tasks. Plain files of a format cut by size have tasks known from
    their sizes; any other file (compressed, columnar, ...) may hold more than its size says,
    and counts as enough work for every worker."""
    tasks = 0
    for source in sources:
        if source.compression is not None or not source.format.cut_by_size:
            return workers
        tasks += -(-source.size // split_bytes) or 1
    return min(workers, tasks)


def _check_template(chat: ChatSettings, tok: Any) -> None:
    """The chat template compiles and its tokens exist; a warning for markers tokenized as text."""
    template = ChatTemplate.from_meta(chat.template)
    template.check_tokenizer(tok)
    plain = template.plain_markers(tok)
    if plain:
        log.warning(
            "pack.template_markers_not_special",
            markers=plain,
            message=f"the chat template writes {', '.join(plain)}, which tokenizer "
            f"{tok.name} has no single id for: they are tokenized as plain text",
        )


def _check_formats(
    sources: Sequence[Source], chat: ChatSettings | None, filters: Where, formats: InputFormats
) -> None:
    """Refuse what an input's format cannot do, before any work."""
    for source in sources:
        if chat is not None and source.format.name != "jsonl":
            raise UserError(
                f"{source.url}: pack-chat reads JSONL conversations; this is "
                f"{source.format.name} (convert it, or pass --input-format jsonl if it is JSONL "
                "after all)"
            )
        if filters.expressions and not source.format.fields:
            with_fields = ", ".join(name for name, fmt in formats.items() if fmt.fields)
            raise UserError(
                f"{source.url}: {source.format.name} has no fields for --where to test; filter "
                f"inputs of a format with fields ({with_fields})"
            )


def _write(work: _Work, encoder: _Encoder) -> dict[str, Any]:
    """Run the tasks and append their documents in task order; returns counts, bad records and
    what each input file gave (kept, dropped by the filter, bad)."""
    sources, settings, pool, writer, meter = (
        work.sources,
        work.settings,
        work.pool,
        work.writer,
        work.meter,
    )
    tasks_by_index: dict[int, Task] = {}
    numbers = LineNumbers()
    empty = blank = too_long = n_bytes = 0
    chat = settings.chat
    skip = settings.on_bad_line == "skip"
    packer = None if chat is None else BlockPacker(writer, chat.seq_len, settings.eod_id)
    bad_lines: list[dict[str, Any]] = []
    per_file = [{"kept": 0, "dropped": 0, "bad": 0} for _ in sources]
    bad_files: list[tuple[int, str]] = []

    def bad(source: int, number: int | None, why: str) -> None:
        source_ = sources[source]
        where = source_.url if number is None else location(source_.url, source_.unit, number)
        if not skip or "--too-long" in why:
            hint = (
                ""
                if "--too-long" in why
                else "; fix the line, or pass --on-bad-line skip to skip and count such lines"
                if source_.unit == "line"
                else "; pass --skip-bad to skip and count such rows and files"
            )
            raise PackError(f"{where}: {why}{hint}")
        if len(bad_lines) < MAX_RECORDED_BAD_LINES:
            entry: dict[str, str | int] = {"file": source_.url, "reason": why}
            if number is not None and source_.unit != "file":
                entry[source_.unit] = number
            bad_lines.append(entry)

    def remember(stream: Iterable[Task]) -> Iterator[Task]:
        for task in stream:
            while bad_files:  # unreadable files the plan left out (--skip-bad)
                source, why = bad_files.pop(0)
                per_file[source]["bad"] += 1
                bad(source, None, why)
            tasks_by_index[task.index] = task
            yield task

    plan = plan_tasks(
        sources, work.split_bytes, work.storage_options, skip_bad=skip, bad_files=bad_files
    )
    results = pool.run(remember(plan), settings, encoder.for_workers)
    for result in _settled_first(results, encoder):
        task = tasks_by_index.pop(result.index)
        first = numbers.first(task, result.n_lines)
        owners = result.bad_sources or [task.source] * len(result.bad)
        for (relative, why), source in zip(result.bad, owners, strict=True):
            bad(source, first + relative, why)
            per_file[source]["bad"] += 1
        per_file[task.source]["bad"] += result.lost_rows
        if packer is None:
            if result.doc_sources is None or result.doc_numbers is None or result.doc_ids is None:
                raise ValueError(f"task {result.index}: a text result without its origins")
            if result.doc_bytes is None:
                raise ValueError(f"task {result.index}: a text result without its text's size")
            origins = Origins(result.doc_sources, first + result.doc_numbers, result.doc_ids)
            writer.add(result.tokens, result.doc_lengths, origins=origins)
            n_bytes += result.doc_bytes
            for source, n in zip(*np.unique(result.doc_sources, return_counts=True), strict=True):
                per_file[int(source)]["kept"] += int(n)
            for source, n in result.dropped.items():
                per_file[source]["dropped"] += n
        else:
            if result.mask is None:
                raise ValueError(f"task {result.index}: a chat result without its loss mask")
            packer.add(result.tokens, result.doc_lengths, result.mask)
        too_long += result.too_long
        empty += result.empty_documents
        blank += result.blank_lines
        meter.update(result.input_bytes, documents=writer.n_documents, tokens=writer.n_tokens)
    encoder.settle()
    for source, why in bad_files:  # unreadable files after the last task
        per_file[source]["bad"] += 1
        bad(source, None, why)
    if packer is not None:
        packer.close()
    writer.close()
    counts = {
        "documents": writer.n_documents,
        "tokens": writer.n_tokens,
        "empty_documents": empty,
        "blank_lines": blank,
        "bad_lines": sum(f["bad"] for f in per_file),
    }
    if packer is not None:
        counts.update(
            counted_tokens=writer.counted,
            padding_tokens=packer.padding,
            too_long=too_long,
        )
    else:  # chat has no bytes: see the README (the loss counts only the trained turns)
        counts["dropped"] = sum(f["dropped"] for f in per_file)
        counts["bytes"] = n_bytes
    return {"counts": counts, "bad_lines": bad_lines, "per_file": per_file}
