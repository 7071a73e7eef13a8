"""The packed-dataset format: a zarr v3 group, written so that a crash never looks complete.

```
<dataset>/zarr.json      group metadata; attribute "llmtrain" holds the dataset's metadata
<dataset>/tokens         1-D uint16 (vocab <= 65536) or uint32: every document, each ended by eod
<dataset>/doc_offsets    1-D int64, n_documents + 1: where each document starts in `tokens`
<dataset>/chunk_docs     1-D int64, n_chunks + 1: the first document starting in each token chunk
<dataset>/chunk_heads    2-D, the first tokens of each chunk (windows that just reach into it)
<dataset>/loss_mask      1-D bool beside `tokens` (chat datasets, format version 2): True where
                         the token is a target the loss counts
<dataset>/doc_source     1-D uint32, n_documents: each document's input file (an index into the
                         metadata's "sources")
<dataset>/doc_row        1-D int64, n_documents: its line (1-based, JSONL and text) or row
                         (0-based, Parquet and Arrow) in that file
<dataset>/doc_id_offsets 1-D int64, n_documents + 1, and doc_id_bytes, 1-D uint8: its `id` field
                         as UTF-8 ("" when it had none)
```

The four `doc_*` arrays (provenance) are optional: datasets packed before them, chat datasets
and merges of datasets without them have none, and readers that predate them ignore them.

The group's `zarr.json` (with `"complete": true`) is written last, after every array; a directory
without it is not a dataset. On a local disk everything is first written under a temporary name
and renamed into place; on object storage, where renames are copies, the group metadata written
last is the commit. No pickle anywhere: arrays and JSON only.

Every chunk's size and CRC-32 are recorded as written and checked when the dataset is opened and
read (`integrity.py`); the temporary a pack killed on a local disk leaves behind is removed by the
next pack or merge of the same output (`staging.py`).
"""

from __future__ import annotations

import itertools
import json
import os
import posixpath
import shutil
import uuid
from collections.abc import Callable, Mapping
from typing import Any, TypeGuard

import attrs
import numpy as np
import structlog
import zarr
import zarr.codecs
from fsspec.core import url_to_fs
from zarr.abc.store import Store

from llmtrain.core_mesh.errors import UserError, no_space, no_space_message
from llmtrain.core_mesh.storage_errors import missing_bucket, problem_of, storage_errors
from llmtrain.data_pack.errors import DatasetError
from llmtrain.data_pack.integrity import (
    CHECKSUM,
    CORE_ARRAYS,
    INTEGRITY_KEY,
    REPACK,
    VERIFY_BATCH_BYTES,
    CheckedArray,
    CheckedStore,
    ChunkDamage,
    DamagedDatasetError,
    RecordingStore,
    batches,
    chunk_order,
    content_problem,
    size_problem,
    stored_sizes,
)
from llmtrain.data_pack.staging import (
    OWNER_FILE,
    GatedStore,
    WriteGate,
    remove_stale_temporaries,
    write_owner,
)

log = structlog.get_logger("llmtrain.data_pack")

FORMAT = "llmtrain-tokens"
FORMAT_VERSION = 2  # 2: chat datasets (a loss mask; readers of version 1 would ignore it)
META_KEY = "llmtrain"
# local reads are faster uncompressed (the memmap-like case); object storage may prefer zstd
DEFAULT_COMPRESSION = "none"
HEAD_TOKENS = 8192  # first tokens of each chunk kept in `chunk_heads` (windows up to 8191 long)
HEADS_PER_CHUNK = 64
# how long an abandoned (or committing) pack waits for writes under way in zarr's threads before
# it removes (or renames) its staging area: a local chunk write takes milliseconds
STAGING_WRITES_TIMEOUT = 120.0
ORIGIN_ARRAYS = ("doc_source", "doc_row", "doc_id_offsets", "doc_id_bytes")
ARRAYS = ("tokens", "doc_offsets", "chunk_docs", "chunk_heads", "loss_mask", *ORIGIN_ARRAYS)
# arrays whose every chunk is read and checked against its CRC-32 when a dataset is opened, when
# they hold OPEN_CHECK_BYTES or less (chunk_docs is read whole at every open anyway): 8 bytes a
# document and 16 KiB a chunk of 1 Mi uint16 tokens, so datasets of up to a few billion tokens
OPEN_CHECKED_ARRAYS = ("doc_offsets", "chunk_heads")
OPEN_CHECK_BYTES = 64 << 20
# what zarr raises on a metadata file that is there but unreadable: not JSON (JSONDecodeError is a
# ValueError), keys missing (KeyError) or of the wrong type (TypeError), or invalid values (its
# MetadataValidationError and UnknownCodecError are ValueErrors)
METADATA_ERRORS = (ValueError, TypeError, KeyError, zarr.errors.BaseZarrError)


@attrs.frozen
class Origins:
    """Where consecutive documents came from: input file index, line or row, and id."""

    sources: np.ndarray  # uint32
    rows: np.ndarray  # int64
    ids: list[str]

    def __attrs_post_init__(self) -> None:
        if not len(self.sources) == len(self.rows) == len(self.ids):
            raise ValueError("one source, row and id per document")

    @classmethod
    def empty(cls) -> Origins:
        return cls(np.empty(0, np.uint32), np.empty(0, np.int64), [])


def token_dtype(vocab_size: int, requested: str | None = None) -> np.dtype:
    """uint16 when every id fits, else uint32; a requested dtype too small is an error."""
    if requested is not None:
        dtype = np.dtype(requested)
        if dtype not in (np.uint16, np.uint32):
            raise UserError(f"token dtype {requested!r}: use uint16 or uint32")
        if vocab_size - 1 > np.iinfo(dtype).max:
            raise UserError(
                f"the tokenizer has {vocab_size} ids, more than {dtype} holds "
                f"(max {np.iinfo(dtype).max}); use uint32"
            )
        return dtype
    if vocab_size - 1 > np.iinfo(np.uint32).max:
        raise UserError(f"the tokenizer has {vocab_size} ids, more than uint32 holds")
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def _is_local(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


def _local_path(url: str) -> str:
    return url.removeprefix("file://")


def _join(url: str, name: str) -> str:
    return url.rstrip("/") + "/" + name


def _store(url: str, storage_options: Mapping[str, Any] | None, *, read_only: bool) -> Store:
    if _is_local(url):
        return zarr.storage.LocalStore(_local_path(url), read_only=read_only)
    return zarr.storage.FsspecStore.from_url(
        url, storage_options=dict(storage_options or {}), read_only=read_only
    )


def compressors(name: str) -> Any:
    if name == "none":
        return None
    kind, _, level = name.partition(":")
    if kind == "zstd":
        try:
            value = int(level or 1)
        except ValueError:
            value = None
        if value is not None and -7 <= value <= 22:
            return zarr.codecs.ZstdCodec(level=value)
    raise UserError(f"compression {name!r}: use none, zstd or zstd:LEVEL (LEVEL from -7 to 22)")


def _unreadable(path: str, kind: str, exc: BaseException) -> DatasetError:
    reason = f"{type(exc).__name__}: {exc}" if isinstance(exc, KeyError) else str(exc)
    reason = " ".join(reason.split())  # one line
    return DatasetError(f"{path} cannot be read as zarr {kind} metadata ({reason}) {REPACK}")


def _is_count(value: object, *, positive: bool = False) -> TypeGuard[int]:
    return type(value) is int and value >= (1 if positive else 0)


def meta_problem(meta: Mapping[str, Any]) -> str | None:
    """What is wrong with the fields of a dataset's metadata that its readers use (counts,
    tokenizer, dtype, sources, the integrity record, chat settings), or None."""
    counts = meta.get("counts")
    if not isinstance(counts, dict):
        return "has no counts"
    for key, value in counts.items():
        if not _is_count(value):
            return f"count {key!r} is {json.dumps(value)}, not a count"
    for key in ("tokens", "documents"):
        if key not in counts:
            return f"has no count of {key}"
    tokenizer = meta.get("tokenizer")
    if not isinstance(tokenizer, dict):
        return "has no tokenizer"
    for key, kind in (("name", str), ("fingerprint", str), ("spec", dict)):
        if not isinstance(tokenizer.get(key), kind):
            return f"tokenizer has no {key}"
    vocab, eod = tokenizer.get("vocab_size"), tokenizer.get("eod_id")
    if not _is_count(vocab, positive=True) or not _is_count(eod) or eod >= vocab:
        return f"tokenizer's vocab_size {vocab!r} and eod_id {eod!r} do not fit"
    if meta.get("dtype") not in ("uint16", "uint32"):
        return f"dtype {meta.get('dtype')!r} is not uint16 or uint32"
    sources = meta.get("sources")
    if not isinstance(sources, list) or not all(
        isinstance(s, dict) and isinstance(s.get("url"), str) for s in sources
    ):
        return "has no list of sources"
    if "version" in meta and not _is_count(meta["version"]):
        return f"version {meta['version']!r} is not a number"
    record = meta.get(INTEGRITY_KEY)
    if record is not None and not _is_record(record):
        return (
            f"{INTEGRITY_KEY} record is not {{checksum, chunks: {{array: {{key: [bytes, crc]}}}}}}"
        )
    chat = meta.get("chat")
    if chat is not None and not (
        isinstance(chat, dict)
        and _is_count(chat.get("seq_len"), positive=True)
        and isinstance(chat.get("template"), dict)
    ):
        return "chat settings have no template or sequence length"
    return None


def _is_record(record: Any) -> bool:
    if not isinstance(record, dict) or record.get("checksum") != CHECKSUM:
        return False
    chunks = record.get("chunks")
    if not isinstance(chunks, dict):
        return False
    for name, keys in chunks.items():
        if name not in ARRAYS or not isinstance(keys, dict):
            return False
        for entry in keys.values():
            if not (isinstance(entry, list) and len(entry) == 2 and all(map(_is_count, entry))):
                return False
    return True


def _is_dataset_metadata(fs: Any, path: str) -> bool:
    """Whether the file at `path` is the group metadata of a dataset llmtrain packed."""
    try:
        meta = json.loads(fs.cat_file(path))
    except (OSError, ValueError):
        return False
    attributes = meta.get("attributes") if isinstance(meta, dict) else None
    ours = attributes.get(META_KEY) if isinstance(attributes, dict) else None
    return isinstance(ours, dict) and ours.get("format") == FORMAT


class AppendArray:
    """A 1-D zarr array written front to back in whole chunks (or shards): no partial rewrites."""

    def __init__(
        self,
        store: Store,
        dtype: Any,
        chunk: int,
        *,
        shard_chunks: int = 0,
        compression: str = "none",
    ):
        self.unit = chunk * shard_chunks if shard_chunks else chunk
        self.array = zarr.create_array(
            store=store,
            shape=(0,),
            dtype=dtype,
            chunks=(chunk,),
            shards=(self.unit,) if shard_chunks else None,
            compressors=compressors(compression),
            fill_value=0,
            zarr_format=3,
        )
        self.dtype = np.dtype(dtype)
        self.written = 0
        self._pending: list[np.ndarray] = []
        self._pending_len = 0
        self.on_write: Callable[[int, np.ndarray], None] | None = (
            None  # called with each chunk-aligned block written (and its offset)
        )

    def append(self, values: np.ndarray) -> None:
        if len(values):
            self._pending.append(values.astype(self.dtype, copy=False))
            self._pending_len += len(values)
        if self._pending_len >= self.unit:
            self._flush(final=False)

    def _flush(self, *, final: bool) -> None:
        if not self._pending_len:
            return
        data = np.concatenate(self._pending)
        whole = len(data) if final else len(data) // self.unit * self.unit
        if whole:
            end = self.written + whole
            self.array.resize((end,))
            self.array[self.written : end] = data[:whole]
            if self.on_write is not None:
                self.on_write(self.written, data[:whole])
            self.written = end
        rest = data[whole:]
        self._pending = [rest] if len(rest) else []
        self._pending_len = len(rest)

    def close(self) -> int:
        self._flush(final=True)
        return self.written


class Output:
    """Where a pack or merge writes: refuses an existing dataset unless asked, commits last,
    and records every chunk it writes (size and CRC-32) in the committed metadata."""

    def __init__(
        self, url: str, *, overwrite: bool, storage_options: Mapping[str, Any] | None = None
    ):
        self.url = url.rstrip("/")
        self.storage_options = dict(storage_options or {})
        self.local = _is_local(url)
        self.overwrite = overwrite
        self.chunks: dict[str, dict[str, list[int]]] = {}  # array -> chunk key -> [bytes, crc]
        self.staging = f"{self.url}.tmp-{uuid.uuid4().hex[:8]}" if self.local else self.url
        # every write into staging passes it; closed before staging is removed or renamed
        self.gate = WriteGate(self.staging)
        self._old: str | None = None  # the local dataset the commit replaces, while it does
        with storage_errors(self.url, doing="write", error=DatasetError):
            self._prepare()

    def _prepare(self) -> None:
        """Check the output (an existing one is replaced only if asked and only if it is a
        dataset; a bucket must exist) and make the staging area."""
        self.fs, self.path = url_to_fs(self.url, **self.storage_options)
        if self.fs.exists(self.path):
            if not self.overwrite:
                raise UserError(
                    f"{self.url} already exists; pass --overwrite to replace it, or choose "
                    "another output"
                )
            self._check_replaceable()
        elif not self.local and (problem := missing_bucket(self.fs, self.url)) is not None:
            raise DatasetError(problem)
        if not self.local and self.fs.exists(self.path):
            # object storage has no rename: the old dataset goes first, the new one's metadata
            # is written last, so a crash in between leaves no complete-looking dataset
            self.fs.rm(self.path, recursive=True)
        if self.local:
            remove_stale_temporaries(_local_path(self.url))
            staged = _local_path(self.staging)
            try:  # an interrupt right after the directory is made leaves nothing either
                os.makedirs(staged, exist_ok=False)
                write_owner(staged)
            except FileExistsError:
                raise  # another pack's (the same id): not ours to remove
            except BaseException:
                shutil.rmtree(staged, ignore_errors=True)
                raise

    def _check_replaceable(self) -> None:
        """`--overwrite` replaces a dataset llmtrain packed (its group metadata says so), or the
        arrays of a pack that did not finish (on object storage they are written in place and
        the group metadata last), or an empty folder; anything else is refused before anything
        is deleted: it is someone's files (an input, a folder of results, a checkpoint)."""
        if not self.fs.isdir(self.path):
            found = "a file"
        else:
            names = {posixpath.basename(p.rstrip("/")) for p in self.fs.ls(self.path, detail=False)}
            if not names or ("zarr.json" not in names and names <= set(ARRAYS)):
                return
            if "zarr.json" in names and _is_dataset_metadata(
                self.fs, posixpath.join(self.path, "zarr.json")
            ):
                return
            if "zarr.json" in names:
                found = "a folder whose zarr.json is not the metadata of a packed dataset"
            else:
                shown = ", ".join(sorted(names)[:4]) + (", ..." if len(names) > 4 else "")
                entries = "entry" if len(names) == 1 else "entries"
                found = f"a folder of {len(names)} {entries} ({shown})"
        raise UserError(
            f"{self.url} is {found}, not a packed dataset: --overwrite only replaces one, so "
            "nothing was deleted; choose another output, or remove it yourself if it is to go"
        )

    def array_url(self, name: str) -> str:
        return _join(self.staging, name)

    def array_store(self, name: str) -> Store:
        """The store to create array `name` in; what is written there is recorded."""
        return RecordingStore(
            self._writable(self.array_url(name)), self.chunks.setdefault(name, {})
        )

    def _writable(self, url: str) -> Store:
        """A store under staging, written through the gate."""
        return GatedStore(_store(url, self.storage_options, read_only=False), self.gate)

    def integrity(self) -> dict[str, Any]:
        return {
            "checksum": CHECKSUM,
            "chunks": {
                name: {key: record[key] for key in sorted(record, key=chunk_order)}
                for name, record in sorted(self.chunks.items())
            },
        }

    def commit(self, attributes: Mapping[str, Any]) -> None:
        zarr.create_group(
            store=self._writable(self.staging),
            attributes={
                META_KEY: {**attributes, INTEGRITY_KEY: self.integrity(), "complete": True}
            },
            zarr_format=3,
        )
        self._settle()  # nothing more is written, and no write is still under way
        if not self.local:
            return
        final, staged = _local_path(self.url), _local_path(self.staging)
        os.remove(os.path.join(staged, OWNER_FILE))  # it only marks a staging directory
        if os.path.exists(final):
            self._old = f"{final}.old-{uuid.uuid4().hex[:8]}"
            os.rename(final, self._old)
        os.rename(staged, final)
        if self._old is not None:
            shutil.rmtree(self._old, ignore_errors=True)
            self._old = None

    def _settle(self) -> None:
        """Close the gate: later writes into staging are refused, and those under way (in
        zarr's threads, which an interrupt of this thread does not stop) are waited for."""
        if not self.gate.close(timeout=STAGING_WRITES_TIMEOUT):
            log.warning(
                "output.writes_still_running",
                path=self.staging,
                writes=self.gate.active,
                waited_s=STAGING_WRITES_TIMEOUT,
            )

    def abort(self, error: BaseException | None = None) -> None:
        """Remove what was staged (after `error`, if one ended the pack), once no write into it
        is under way. A full disk is then raised as one line naming the output (a chunk write
        that fails names no file), with the space given back. Interrupted within the commit's
        renames, the dataset it replaced is put back (or, once the new one is in place, removed).
        """
        self._settle()
        try:
            fs, path = url_to_fs(self.staging, **self.storage_options)
            if fs.exists(path):
                fs.rm(path, recursive=True)
        except Exception as exc:  # noqa: BLE001 - the error that ended the pack is the one to raise
            log.warning("output.not_removed", path=self.staging, error=str(exc))
        if self._old is not None and os.path.exists(self._old):
            final = _local_path(self.url)
            if os.path.exists(final):
                shutil.rmtree(self._old, ignore_errors=True)
            else:
                os.rename(self._old, final)
        if error is not None and (full := no_space(error)) is not None:
            raise DatasetError(
                f"{self.url}: {no_space_message(full)}; nothing was written"
            ) from error
        if isinstance(error, Exception) and not isinstance(error, UserError):
            problem = problem_of(error, self.url, doing="write")
            if problem is not None:
                raise DatasetError(f"{self.url}: {problem}; nothing was written") from error


class PackedDataset:
    """A committed packed dataset, opened read-only (local path or fsspec URL).

    Opening it checks, from one listing, that every chunk it needs is stored with the size
    recorded when it was written (datasets packed before sizes were recorded: that every chunk
    of its core arrays is there). `verify()` reads every chunk and checks its checksum.
    """

    def __init__(self, url: str, *, storage_options: Mapping[str, Any] | None = None):
        self.url = url.rstrip("/")
        self.storage_options = dict(storage_options or {})
        self._open()

    def _open(self) -> None:
        with storage_errors(self.url, error=DatasetError):
            self._open_checked()

    def _open_checked(self) -> None:
        store = CheckedStore(_store(self.url, self.storage_options, read_only=True), self.url)
        group, meta = self._open_group(store)
        self.meta = meta
        sizes = stored_sizes(self.url, self.storage_options)
        self._stored = self._open_arrays(group, sizes)
        self._check_shapes()
        expected = self._expected_chunks()
        self._check_stored(expected, sizes)
        store.expected.update(expected)
        self._check_small_arrays()
        self.tokens = self._stored["tokens"]
        self.doc_offsets = self._stored["doc_offsets"]
        self.chunk_docs = np.asarray(self._stored["chunk_docs"][:], dtype=np.int64)
        # optional: datasets written before it existed read whole chunks instead
        self.chunk_heads = self._stored.get("chunk_heads")
        self.chat = meta.get("chat")  # chat datasets: template, block length, roles, mask
        self.loss_mask = self._stored.get("loss_mask")
        if self.chat is not None and self.loss_mask is None:
            raise DatasetError(
                f"{self.url}: a chat dataset without its loss_mask array (damaged); pack it again"
            )
        self._origins = None  # provenance (optional): the doc_* arrays, when all are there
        if all(name in self._stored for name in ORIGIN_ARRAYS):
            self._origins = {name: self._stored[name] for name in ORIGIN_ARRAYS}
        self.n_tokens = int(meta["counts"]["tokens"])
        self.n_documents = int(meta["counts"]["documents"])
        # the UTF-8 bytes of the documents' text; None for datasets packed before it was
        # counted, chat datasets and merges of inputs without it (tokens / bytes for bits per byte)
        bytes_ = meta["counts"].get("bytes")
        self.n_bytes: int | None = None if bytes_ is None else int(bytes_)
        self.chunk_tokens = int(self.tokens.chunks[0])
        self.dtype = np.dtype(self.tokens.dtype)
        self.eod_id = int(meta["tokenizer"]["eod_id"])
        self.vocab_size = int(meta["tokenizer"]["vocab_size"])
        self.fingerprint = str(meta["tokenizer"]["fingerprint"])

    def _open_group(self, store: Store) -> tuple[zarr.Group, dict[str, Any]]:
        try:
            group = zarr.open_group(store=store, mode="r", zarr_format=3)
            attributes = group.attrs.get(META_KEY)
            # not a mapping (damaged): no fields, so refused below as not a complete dataset
            meta = dict(attributes) if isinstance(attributes, Mapping) else {}
        except (FileNotFoundError, zarr.errors.GroupNotFoundError, zarr.errors.ContainsArrayError):
            if not _is_local(self.url):
                fs = url_to_fs(self.url, **self.storage_options)[0]
                if (problem := missing_bucket(fs, self.url)) is not None:
                    raise DatasetError(problem) from None
            raise DatasetError(
                f"{self.url}: not a packed dataset (no committed group metadata): it does not "
                "exist, is not complete (a pack that did not finish), or was not written by "
                "`llmtrain data pack`"
            ) from None
        except METADATA_ERRORS as exc:  # there, but not zarr group metadata
            raise _unreadable(_join(self.url, "zarr.json"), "group", exc) from None
        if meta.get("format") != FORMAT or not meta.get("complete"):
            raise DatasetError(f"{self.url}: not a complete {FORMAT} dataset")
        version = meta.get("version", 0)
        if isinstance(version, int) and version > FORMAT_VERSION:
            raise DatasetError(
                f"{self.url}: format version {meta['version']} is newer than this llmtrain "
                f"reads ({FORMAT_VERSION}); upgrade llmtrain-data-pack"
            )
        problem = meta_problem(meta)
        if problem is not None:
            raise DatasetError(
                f"{_join(self.url, 'zarr.json')}: the dataset's metadata {problem} {REPACK}"
            )
        return group, meta

    def _open_arrays(self, group: zarr.Group, sizes: Mapping[str, int]) -> dict[str, CheckedArray]:
        """The dataset's arrays that exist (their metadata; no chunk is read). One whose
        metadata file is listed but does not read as array metadata is damage, not absence."""
        arrays = {}
        for name in ARRAYS:
            if f"{name}/zarr.json" not in sizes:
                continue
            try:
                array = group[name]
            except (*METADATA_ERRORS, FileNotFoundError) as exc:
                raise _unreadable(_join(self.url, f"{name}/zarr.json"), "array", exc) from None
            if not isinstance(array, zarr.Array) or array.ndim < 1:
                what = "a group" if not isinstance(array, zarr.Array) else "a scalar"
                problem = ValueError(f"it describes {what}, not an array of rows")
                raise _unreadable(_join(self.url, f"{name}/zarr.json"), "array", problem)
            arrays[name] = CheckedArray(array, name, self.url)
        for name in ("tokens", "doc_offsets", "chunk_docs"):
            if name not in arrays:
                raise DatasetError(
                    f"{self.url}: not a packed dataset any more: its {name} array is missing "
                    f"{REPACK}"
                )
        return arrays

    def _check_shapes(self) -> None:
        """Every array's metadata against the counts the pack recorded in the group's: a
        `zarr.json` whose shape, data type or chunk grid was changed would read zeros past the
        end, miss tokens, or cut the stored bytes at other places."""
        self._check_grid()
        counts = self.meta["counts"]
        n_tokens, n_documents = int(counts["tokens"]), int(counts["documents"])
        tokens = self._stored["tokens"]
        chunk = int(tokens.chunks[0]) if tokens.ndim == 1 else 0
        n_chunks = -(-n_tokens // chunk) if chunk > 0 else 0
        heads = self._stored.get("chunk_heads")
        head = int(heads.shape[1]) if heads is not None and heads.ndim == 2 else 0
        expected = {
            "tokens": ((n_tokens,), f"the {n_tokens:,} tokens"),
            "loss_mask": ((n_tokens,), f"the {n_tokens:,} tokens"),
            "doc_offsets": ((n_documents + 1,), f"the {n_documents:,} documents (+ 1)"),
            "chunk_docs": ((n_chunks + 1,), f"the {n_chunks:,} token chunks (+ 1)"),
            "chunk_heads": ((n_chunks, head), f"one row for each of the {n_chunks:,} token chunks"),
            "doc_source": ((n_documents,), f"the {n_documents:,} documents"),
            "doc_row": ((n_documents,), f"the {n_documents:,} documents"),
            "doc_id_offsets": ((n_documents + 1,), f"the {n_documents:,} documents (+ 1)"),
        }
        for name, array in self._stored.items():
            where = _join(self.url, f"{name}/zarr.json")
            problem = None
            shape = tuple(int(n) for n in array.shape)
            if name in expected and shape != expected[name][0]:
                problem = (
                    f"shape {list(shape)} does not fit {expected[name][1]} recorded at pack time"
                )
            elif name in ("tokens", "chunk_heads") and np.dtype(array.dtype) != np.dtype(
                self.meta["dtype"]
            ):
                problem = f"data type {array.dtype} is not the {self.meta['dtype']} packed"
            elif name == "chunk_heads" and not 0 < head <= chunk:
                problem = f"rows of {head} tokens do not fit chunks of {chunk}"
            elif array.ndim >= 1 and int((array.shards or array.chunks)[0]) < 1:
                problem = "has chunks of no length"
            if problem is not None:
                raise DatasetError(f"{where}: {problem} {REPACK}")

    def _check_grid(self) -> None:
        """Every chunk the pack recorded is a chunk of its array's grid: metadata whose chunk
        shape or key encoding changed names other objects than the ones written."""
        record = self.meta.get(INTEGRITY_KEY)
        if record is None:
            return
        for name, chunks in record["chunks"].items():
            array = self._stored.get(name)
            if array is None or not chunks:
                continue
            where = _join(self.url, f"{name}/zarr.json")
            stray = sorted(set(chunks) - set(array.keys()), key=chunk_order)
            if stray:
                raise DatasetError(
                    f"{where}: its chunk grid has no chunk {stray[0]}, which the pack wrote "
                    f"(chunk shape or key encoding changed) {REPACK}"
                )
            # a chunk stored as raw bytes holds the whole chunk shape (an edge chunk is padded)
            if not (array.compressors or array.filters or array.shards):
                size = int(np.prod(array.chunks)) * np.dtype(array.dtype).itemsize
                key, (written, _) = next(iter(chunks.items()))
                if written != size:
                    raise DatasetError(
                        f"{where}: chunks of shape {list(array.chunks)} ({size:,} bytes), but "
                        f"the pack wrote chunk {key} of {written:,} bytes (chunk shape or data "
                        f"type changed) {REPACK}"
                    )

    def _check_small_arrays(self) -> None:
        """Read the chunks of `doc_offsets` and `chunk_heads` whole and check them against their
        recorded CRC-32 when they hold OPEN_CHECK_BYTES or less in all (datasets of up to a few
        billion tokens): a flipped bit there is refused when a run starts, not when a read
        first reaches it. Larger ones are checked as they are read, like every chunk."""
        if not self.checksummed:
            return
        items = self._recorded(OPEN_CHECKED_ARRAYS)
        if sum(size for _, _, size, _ in items) <= OPEN_CHECK_BYTES:
            damage = self._check_items(items)
            if damage:
                raise DamagedDatasetError(self.url, damage)

    def _expected_chunks(self) -> dict[str, tuple[int, int] | None]:
        """Every stored chunk the dataset needs ("tokens/c/0") and its recorded size and CRC-32:
        those the
        pack recorded, or, for a dataset packed before it recorded them, every chunk of the
        grid of its core arrays (their size unknown). An optional array that is gone as a whole
        (metadata too) reads as absent, as in datasets packed without it: its readers already
        handle that (provenance then says it is not recorded)."""
        record = self.meta.get(INTEGRITY_KEY)
        if record is not None:
            return {
                f"{name}/{key}": (int(size), int(crc))
                for name, chunks in record["chunks"].items()
                if name in self._stored
                for key, (size, crc) in chunks.items()
            }
        if not int(self.meta["counts"]["documents"]):
            return {}  # offsets and chunk index hold one 0 each, which zarr does not store
        return {
            f"{name}/{key}": None
            for name in CORE_ARRAYS
            if name in self._stored
            for key in self._stored[name].keys()
        }

    def _check_stored(
        self, expected: Mapping[str, tuple[int, int] | None], sizes: Mapping[str, int]
    ) -> None:
        damage = []
        for path, recorded in expected.items():
            problem = size_problem(sizes.get(path), None if recorded is None else recorded[0])
            if problem is not None:
                array, _, key = path.partition("/")
                damage.append(ChunkDamage(array, key, problem))
        if damage:
            raise DamagedDatasetError(self.url, damage)

    @property
    def checksummed(self) -> bool:
        """Whether the pack recorded every chunk's size and checksum (datasets packed before
        llmtrain recorded them: False)."""
        return INTEGRITY_KEY in self.meta

    def verify(self) -> int:
        """Read every stored chunk and check it: against its recorded size and checksum, or,
        for a dataset packed before they were recorded, that it decodes. Returns how many
        chunks were checked; a DamagedDatasetError names the damaged ones."""
        if self.checksummed:
            checked, damage = self._verify_checksums()
        else:
            checked, damage = self._verify_decoding()
        if damage:
            raise DamagedDatasetError(self.url, damage)
        return checked

    def _recorded(self, names: tuple[str, ...] | None = None) -> list[tuple[str, str, int, int]]:
        """(array, chunk key, size, crc32) of the recorded chunks of the stored arrays (those
        named, or all)."""
        return [
            (name, key, int(size), int(crc))
            for name, chunks in self.meta[INTEGRITY_KEY]["chunks"].items()
            if name in self._stored and (names is None or name in names)
            for key, (size, crc) in chunks.items()
        ]

    def _verify_checksums(self) -> tuple[int, list[ChunkDamage]]:
        items = self._recorded()
        with storage_errors(self.url, error=DatasetError):
            return len(items), self._check_items(items)

    def _check_items(self, items: list[tuple[str, str, int, int]]) -> list[ChunkDamage]:
        """Read the chunks whole (concurrently on object storage) and check each."""
        fs, root = url_to_fs(self.url, **self.storage_options)
        damage = []
        for batch in batches(items, VERIFY_BATCH_BYTES):
            paths = [f"{root.rstrip('/')}/{name}/{key}" for name, key, _, _ in batch]
            # one call per batch: object storage fetches its objects concurrently
            contents = fs.cat(paths, on_error="return")
            for path, (name, key, size, crc) in zip(paths, batch, strict=True):
                data = contents.get(path, FileNotFoundError(path))
                problem = content_problem(data, size, crc)
                if problem is not None:
                    damage.append(ChunkDamage(name, key, problem))
        return damage

    def _verify_decoding(self) -> tuple[int, list[ChunkDamage]]:
        checked, damage = 0, []
        for name, array in self._stored.items():
            for unit in range(array.n_units):
                checked += 1
                problem = array.unit_problem(unit)
                if problem is not None:
                    damage.append(ChunkDamage(name, array.key(unit), problem))
        return checked, damage

    def __getstate__(self) -> dict[str, Any]:
        return {"url": self.url, "storage_options": self.storage_options}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.url, self.storage_options = state["url"], state["storage_options"]
        self._open()

    @property
    def n_chunks(self) -> int:
        return -(-self.n_tokens // self.chunk_tokens)

    def read(self, start: int, stop: int) -> np.ndarray:
        return np.asarray(self.tokens[start:stop])

    def read_chunk(self, chunk: int) -> np.ndarray:
        """The tokens of one chunk."""
        base = chunk * self.chunk_tokens
        return self.read(base, min(base + self.chunk_tokens, self.n_tokens))

    @property
    def block(self) -> int | None:
        """Chat datasets: the block length no conversation crosses (windows must be multiples)."""
        return int(self.chat["seq_len"]) if self.chat else None

    def read_mask_chunk(self, chunk: int) -> np.ndarray:
        """The loss mask of one chunk (bool); all True for a dataset without one."""
        base = chunk * self.chunk_tokens
        stop = min(base + self.chunk_tokens, self.n_tokens)
        if self.loss_mask is None:
            return np.ones(stop - base, dtype=bool)
        return np.asarray(self.loss_mask[base:stop], dtype=bool)

    @property
    def head_tokens(self) -> int:
        return 0 if self.chunk_heads is None else int(self.chunk_heads.shape[1])

    def read_heads(self, block: int) -> np.ndarray:
        """The stored first tokens of chunks [block*64, block*64 + 64), one row each."""
        if self.chunk_heads is None:
            raise ValueError(f"{self.url} stores no chunk heads (see head_tokens)")
        rows = self.chunk_heads.chunks[0]
        return np.asarray(self.chunk_heads[block * rows : (block + 1) * rows])

    def chunk_doc_starts(self, chunk: int) -> np.ndarray:
        """Where documents start in one chunk (positions within the chunk)."""
        first, last = self.chunk_docs[chunk], self.chunk_docs[chunk + 1]
        base = chunk * self.chunk_tokens
        return np.asarray(self.doc_offsets[first:last], dtype=np.int64) - base

    def document(self, index: int) -> np.ndarray:
        """The tokens of document `index`, without its end-of-document token."""
        if not 0 <= index < self.n_documents:
            raise IndexError(f"document {index} of {self.n_documents}")
        start, stop = (int(v) for v in self.doc_offsets[index : index + 2])
        return self.read(start, stop - 1)

    @property
    def has_origins(self) -> bool:
        return self._origins is not None

    def origins(self, begin: int, end: int) -> Origins:
        """Where documents [begin, end) came from; a DatasetError if the dataset has no record."""
        if self._origins is None:
            raise DatasetError(
                f"{self.url} records no provenance (packed before llmtrain recorded it, a chat "
                "dataset, or a merge of such datasets); pack it again to have it"
            )
        if not 0 <= begin <= end:
            raise IndexError(f"documents [{begin}, {end}) of {self.n_documents}")
        end = min(end, self.n_documents)
        begin = min(begin, end)
        arrays = self._origins
        offsets = np.asarray(arrays["doc_id_offsets"][begin : end + 1], np.int64)
        blob = bytes(np.asarray(arrays["doc_id_bytes"][int(offsets[0]) : int(offsets[-1])]))
        base = int(offsets[0])
        ids = [
            blob[a - base : b - base].decode("utf-8", "surrogatepass")
            for a, b in itertools.pairwise(offsets.tolist())
        ]
        return Origins(
            np.asarray(arrays["doc_source"][begin:end], np.uint32),
            np.asarray(arrays["doc_row"][begin:end], np.int64),
            ids,
        )

    def check_tokenizer(self, tokenizer: Any) -> None:
        """Refuse a tokenizer other than the one the dataset was packed with."""
        if tokenizer.fingerprint != self.fingerprint:
            packed = self.meta["tokenizer"]
            raise DatasetError(
                f"{self.url} was packed with tokenizer {packed['name']} (fingerprint "
                f"{packed['fingerprint']}), but this run uses {tokenizer.name} (fingerprint "
                f"{tokenizer.fingerprint}); use the same tokenizer or pack the data again"
            )


class DatasetWriter:
    """Appends documents (tokens with their eod, and their lengths; for chat data also their
    loss mask) to an Output's arrays."""

    def __init__(
        self,
        out: Output,
        dtype: Any,
        *,
        chunk_tokens: int = 1 << 20,
        shard_chunks: int = 0,
        compression: str = DEFAULT_COMPRESSION,
        loss_mask: bool = False,
        origins: bool = False,
    ):
        self.out = out
        self.chunk_tokens = chunk_tokens
        self.tokens = AppendArray(
            out.array_store("tokens"),
            dtype,
            chunk_tokens,
            shard_chunks=shard_chunks,
            compression=compression,
        )
        self.offsets = AppendArray(
            out.array_store("doc_offsets"),
            np.int64,
            1 << 16,  # small chunks: a token chunk's document starts decode little else
            compression=compression,
        )
        self.offsets.append(np.zeros(1, np.int64))
        self.mask: AppendArray | None = None
        if loss_mask:
            self.mask = AppendArray(
                out.array_store("loss_mask"),
                np.bool_,
                chunk_tokens,
                shard_chunks=shard_chunks,
                compression=compression,
            )
        self.origins = _OriginsWriter(out, compression) if origins else None
        self.counted = 0
        # the first tokens of every chunk, kept apart: a window that reaches a few tokens into
        # the next chunk reads them here instead of decoding that whole chunk
        self.head_tokens = min(HEAD_TOKENS, chunk_tokens)
        self.heads = zarr.create_array(
            store=out.array_store("chunk_heads"),
            shape=(0, self.head_tokens),
            dtype=dtype,
            chunks=(HEADS_PER_CHUNK, self.head_tokens),
            compressors=compressors(compression),
            fill_value=0,
            zarr_format=3,
        )
        self._heads: list[np.ndarray] = []
        self.tokens.on_write = self._collect_heads
        self.chunk_docs: list[int] = [0]
        self.n_tokens = 0
        self.n_documents = 0

    def add(
        self,
        tokens: np.ndarray,
        doc_lengths: np.ndarray,
        mask: np.ndarray | None = None,
        origins: Origins | None = None,
    ) -> None:
        if not len(doc_lengths):
            return
        if (origins is None) != (self.origins is None) or (
            origins is not None and len(origins.rows) != len(doc_lengths)
        ):
            raise ValueError("origins go with every document of a dataset that records them")
        ends = self.n_tokens + np.cumsum(doc_lengths)
        if int(ends[-1]) != self.n_tokens + len(tokens):
            raise ValueError("document lengths do not add up to the tokens given")
        if (mask is None) != (self.mask is None) or (mask is not None and len(mask) != len(tokens)):
            raise ValueError(
                "a loss mask goes with every token of a masked dataset, and only there"
            )
        if mask is not None:
            assert self.mask is not None  # checked above: a mask goes with a masked dataset
            self.mask.append(mask)
            self.counted += int(np.count_nonzero(mask))
        if origins is not None:
            assert self.origins is not None  # checked above, as for the mask
            self.origins.append(origins)
        starts = ends - doc_lengths
        # chunk c's first document: the first one starting at or after c * chunk_tokens
        last_chunk = int(starts[-1]) // self.chunk_tokens
        boundaries = np.arange(len(self.chunk_docs), last_chunk + 1) * self.chunk_tokens
        first = self.n_documents + np.searchsorted(starts, boundaries, "left")
        self.chunk_docs.extend(first.tolist())
        self.offsets.append(ends)
        self.tokens.append(tokens)
        self.n_tokens = int(ends[-1])
        self.n_documents += len(doc_lengths)

    def _collect_heads(self, offset: int, block: np.ndarray) -> None:
        for start in range(0, len(block), self.chunk_tokens):
            head = np.zeros(self.head_tokens, dtype=block.dtype)
            piece = block[start : start + self.head_tokens]
            head[: len(piece)] = piece
            self._heads.append(head)
        if len(self._heads) >= HEADS_PER_CHUNK:
            self._write_heads(final=False)

    def _write_heads(self, *, final: bool) -> None:
        keep = len(self._heads) if final else len(self._heads) // HEADS_PER_CHUNK * HEADS_PER_CHUNK
        if not keep:
            return
        done = self.heads.shape[0]
        self.heads.resize((done + keep, self.head_tokens))
        self.heads[done : done + keep] = np.stack(self._heads[:keep])
        self._heads = self._heads[keep:]

    def close(self) -> None:
        n_chunks = -(-self.n_tokens // self.chunk_tokens)
        self.chunk_docs.extend([self.n_documents] * (n_chunks + 1 - len(self.chunk_docs)))
        self.tokens.close()
        self._write_heads(final=True)
        self.offsets.close()
        if self.mask is not None:
            self.mask.close()
        if self.origins is not None:
            self.origins.close()
        index = AppendArray(self.out.array_store("chunk_docs"), np.int64, max(n_chunks + 1, 1))
        index.append(np.asarray(self.chunk_docs[: n_chunks + 1], np.int64))
        index.close()


class _OriginsWriter:
    """The provenance arrays, appended beside the documents."""

    def __init__(self, out: Output, compression: str):
        def array(name: str, dtype: Any, chunk: int) -> AppendArray:
            return AppendArray(out.array_store(name), dtype, chunk, compression=compression)

        self.sources = array("doc_source", np.uint32, 1 << 16)
        self.rows = array("doc_row", np.int64, 1 << 16)
        self.id_offsets = array("doc_id_offsets", np.int64, 1 << 16)
        self.id_bytes = array("doc_id_bytes", np.uint8, 1 << 20)
        self.id_offsets.append(np.zeros(1, np.int64))
        self.id_end = 0

    def append(self, origins: Origins) -> None:
        self.sources.append(origins.sources)
        self.rows.append(origins.rows)
        encoded = [i.encode("utf-8", "surrogatepass") for i in origins.ids]
        lengths = np.fromiter(map(len, encoded), np.int64, len(encoded))
        self.id_offsets.append(self.id_end + np.cumsum(lengths))
        self.id_end += int(lengths.sum())
        self.id_bytes.append(np.frombuffer(b"".join(encoded), np.uint8))

    def close(self) -> None:
        for array in (self.sources, self.rows, self.id_offsets, self.id_bytes):
            array.close()
