"""The worker side of `pack`: what each spawn-started process runs on a task (read its documents,
tokenize them, return arrays). Kept apart from `pack.py` so that a worker imports only this, the
readers and the tokenizer, not zarr, logging or the plugins: a worker starts in a fraction of the
time, which is most of what a pack costs beyond tokenizing on a small machine.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import pickle
import threading
from collections.abc import Sequence
from typing import Any, Literal

import attrs
import numpy as np

from llmtrain.core_mesh.errors import UserError
from llmtrain.data_pack.chat import (
    ChatSettings,
    ChatTemplate,
    Encoder,
    RenderError,
    messages_of,
    pieces,
    tokenize_conversations,
)
from llmtrain.data_pack.documents import Selection, read_documents, utf8_size
from llmtrain.data_pack.sources import Task, parse_record, read_range


class PackError(UserError):
    """A pack that cannot finish: bad input in `error` mode, or a worker process that died."""


@attrs.frozen
class PackSettings:
    field: str = "text"
    on_bad_line: Literal["error", "skip"] = "error"
    batch_docs: int = 512
    dtype: str = "uint16"
    vocab_size: int = 0
    chat: ChatSettings | None = None
    eod_id: int = 0
    where: tuple[str, ...] = ()
    id_field: str = "id"
    max_doc_bytes: int = 0  # longer documents are bad records; 0: no limit

    @property
    def selection(self) -> Selection:
        stop_on_bad = self.on_bad_line == "error"
        return Selection(self.field, self.where, self.id_field, stop_on_bad, self.max_doc_bytes)


@attrs.frozen
class TaskResult:
    index: int
    tokens: np.ndarray
    doc_lengths: np.ndarray
    n_lines: int
    bad: list[tuple[int, str]]
    empty_documents: int
    blank_lines: int
    input_bytes: int
    text_bytes: int  # what the reader went through (`Documents.text_bytes`), not `doc_bytes`
    mask: np.ndarray | None = None  # chat: the loss mask of `tokens`
    too_long: int = 0  # chat: conversations skipped or truncated for length
    # text: each document's input file and line or row (relative to the task's first), id
    doc_sources: np.ndarray | None = None
    doc_numbers: np.ndarray | None = None
    doc_ids: list[str] | None = None
    bad_sources: list[int] | None = None  # text: the input file of each entry of `bad`
    dropped: dict[int, int] = attrs.Factory(dict)  # input file -> records the filter dropped
    lost_rows: int = 0  # bad rows beyond those listed in `bad` (undecodable row groups)
    # text: the UTF-8 bytes of the documents tokenized (the dataset's counts.bytes); chat: None
    doc_bytes: int | None = None


_worker: dict[str, Any] = {}


def _exit_with_the_parent() -> None:
    """End this worker when the pack's process dies (a SIGKILL, the OOM killer): otherwise it
    would wait forever on the pool's queues, whose pipes it holds open itself."""
    parent = multiprocessing.parent_process()
    if parent is None:  # the one worker that runs in the pack's own process
        return

    def watch() -> None:
        parent.join()
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def init_worker(storage_options: dict[str, Any]) -> None:
    """Set a worker up before its first task: it imports the tokenizer module meanwhile, while the
    pack's process is still building the tokenizer it will be given."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core; no thread pools inside
    _exit_with_the_parent()
    _worker.clear()  # one pack's state (its tokenizer) must not reach the next in this process
    _worker["storage_options"] = storage_options
    import llmtrain.data_pack.tokenizer  # noqa: F401 (imported now, used by the first task)


def warm_up() -> None:
    """A task that does nothing: submitting one per worker starts them all at once."""


def _tokenizer(given: bytes | str | dict[str, Any]) -> Any:
    """The tokenizer a task names, loaded once per worker: the parent's tokenizer pickled
    (nothing to rebuild or check again), in bytes or in a file of them, or its spec when it does
    not pickle (built here through the plugins)."""
    if _worker.get("tokenizer_given") == given:
        return _worker["tokenizer"]
    if isinstance(given, dict):
        from llmtrain.data_pack.tokenizer import tokenizer_from_raw

        tokenizer = tokenizer_from_raw(given)
    elif isinstance(given, str):
        with open(given, "rb") as f:
            tokenizer = pickle.loads(f.read())  # noqa: S301 (our own parent's bytes)
    else:
        tokenizer = pickle.loads(given)  # noqa: S301
    _worker.update(tokenizer_given=given, tokenizer=tokenizer, chat_encoders={})
    return tokenizer


def tokenize_task(
    task: Task, settings: PackSettings, tokenizer: bytes | str | dict[str, Any]
) -> TaskResult:
    """Read a task's documents and tokenize them (each ended by eod). `tokenizer`: see
    `_tokenizer`."""
    tok = _tokenizer(tokenizer)
    if settings.chat is not None:
        data = read_range(task, _worker["storage_options"])
        size = len(data)
        lines = data.split(b"\n")
        del data  # the lines hold the bytes now (a long line is then held once)
        if lines and not lines[-1]:
            lines.pop()
        return _chat_task(task, settings, tok, lines, size)
    docs = read_documents(task, settings.selection, _worker["storage_options"])
    texts = [] if docs.bad and settings.on_bad_line == "error" else docs.texts
    dtype = np.dtype(settings.dtype)
    pieces, lengths = [], []
    for begin in range(0, len(texts), settings.batch_docs):
        batch = texts[begin : begin + settings.batch_docs]
        encode = getattr(tok, "encode_batch_arrays", None) or tok.encode_batch
        tokens, doc_lengths = _with_eod(encode(batch), tok.eod_id, dtype, settings.vocab_size)
        pieces.append(tokens)
        lengths.append(doc_lengths)
    kept = len(texts)
    return TaskResult(
        index=task.index,
        tokens=np.concatenate(pieces) if pieces else np.empty(0, dtype),
        doc_lengths=np.concatenate(lengths) if lengths else np.empty(0, np.int64),
        n_lines=docs.n_lines,
        bad=docs.bad,
        empty_documents=docs.empty,
        blank_lines=docs.blank,
        input_bytes=task.input_bytes,
        text_bytes=docs.text_bytes,
        doc_sources=np.asarray(docs.sources[:kept], np.uint32),
        doc_numbers=np.asarray(docs.numbers[:kept], np.int64),
        doc_ids=docs.ids[:kept],
        bad_sources=docs.bad_sources,
        dropped=docs.dropped,
        lost_rows=docs.lost_rows,
        doc_bytes=sum(map(utf8_size, texts)),
    )


def _chat_task(
    task: Task, settings: PackSettings, tokenizer: Any, lines: list[bytes], size: int
) -> TaskResult:
    """Conversations to tokens and loss masks, each fitted to the sequence length."""
    chat = settings.chat
    if chat is None:
        raise ValueError("a chat task needs chat settings")
    template = ChatTemplate.from_meta(chat.template)
    encoders = _worker["chat_encoders"]  # of this tokenizer
    if template.source not in encoders:
        encoders[template.source] = Encoder(tokenizer, template)
    stop_on_bad = settings.on_bad_line == "error"
    rendered, numbers = [], []
    bad: list[tuple[int, str]] = []
    blank = 0
    for number, line in enumerate(lines):
        if not line.strip():
            blank += 1
            continue
        record, why = parse_record(line)
        if why is None:
            try:
                rendered.append(pieces(template, messages_of(record, chat), chat.train_roles))
                numbers.append(number)
            except RenderError as exc:
                why = str(exc)
        if why is not None:
            bad.append((number, why))
            if stop_on_bad:
                break  # the conversations before it are still checked for length (below)
    tokens, masks = [], []
    too_long = 0
    for number, (ids, mask) in zip(
        numbers,
        tokenize_conversations(rendered, encoders[template.source], tokenizer.eod_id),
        strict=True,
    ):
        if len(ids) > chat.seq_len:
            if chat.too_long == "error":
                bad.append(
                    (
                        number,
                        f"{len(ids)} tokens (with its eod), longer than the sequence length "
                        f"{chat.seq_len}; pass --too-long skip or truncate to fit such "
                        "conversations, or a larger --seq-len",
                    )
                )
                break
            too_long += 1
            if chat.too_long == "skip":
                continue
            ids, mask = ids[: chat.seq_len].copy(), mask[: chat.seq_len].copy()
            ids[-1], mask[-1] = tokenizer.eod_id, False
            if not mask.any():
                continue  # nothing left to learn from
        tokens.append(ids)
        masks.append(mask)
    bad.sort()  # the parent reports the first problem of the file, whatever its kind
    dtype = np.dtype(settings.dtype)
    flat = np.concatenate(tokens) if tokens else np.empty(0, np.int64)
    if len(flat) and (int(flat.max()) >= settings.vocab_size or int(flat.min()) < 0):
        raise PackError(
            f"the tokenizer produced id {int(flat.max())}, outside its vocab of "
            f"{settings.vocab_size}"
        )
    return TaskResult(
        index=task.index,
        tokens=flat.astype(dtype),
        doc_lengths=np.asarray([len(t) for t in tokens], np.int64),
        n_lines=len(lines),
        bad=bad,
        empty_documents=0,
        blank_lines=blank,
        input_bytes=task.input_bytes,
        text_bytes=size,
        mask=np.concatenate(masks) if masks else np.empty(0, bool),
        too_long=too_long,
    )


def _with_eod(
    ids: Sequence[Sequence[int]] | Sequence[np.ndarray], eod: int, dtype: np.dtype, vocab_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """Flatten a batch of id lists (or arrays) into one array with eod after every document."""
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids)) + 1
    total = int(lengths.sum()) - len(ids)
    if len(ids) == 1 and isinstance(ids[0], np.ndarray):
        flat = ids[0]  # one (long) document: no copy
    elif ids and isinstance(ids[0], np.ndarray):
        flat = np.concatenate(ids) if total else np.empty(0, np.int64)
    else:
        flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int64, count=total)
    if len(flat) and (int(flat.max()) >= vocab_size or int(flat.min()) < 0):
        raise PackError(
            f"the tokenizer produced id {int(flat.max())}, outside its vocab of {vocab_size}"
        )
    out = np.empty(total + len(ids), dtype=dtype)
    ends = np.cumsum(lengths) - 1
    keep = np.ones(len(out), dtype=bool)
    keep[ends] = False
    out[keep] = flat
    out[ends] = eod
    return out, lengths
