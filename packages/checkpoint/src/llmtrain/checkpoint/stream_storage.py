"""DCP storage that streams raw tensor bytes: llmtrain's checkpoint format 2.

DCP keeps the planning, the resharding and the metadata; this layer only moves bytes.

- Writing: each rank splits its items into `threads` files of about equal size
  (`__<rank>_<i>.bin`), written by one thread each in large sequential writes of the tensors'
  own memory (no serialisation, no copy on CPU), then fsynced. Format 1 (DCP's FileSystemWriter)
  wrote each tensor through `torch.save`, a zip record whose CRC32 one thread computed over every
  byte before the write.
- Integrity: every item records the 64-bit XXH3 hash of its bytes (`xxhash`: about 16 GB/s on
  one core here, against 3.7 for zlib's CRC32, and it releases the GIL), computed slice by slice
  in the writing thread as the slice is written, so it runs beside the other threads' I/O rather
  than as a pass of its own. It finds any flipped byte or torn write (it is not a defence against
  deliberate tampering; the allow-listed metadata reader is). It is checked on every load, on
  the bytes as read, in the reading threads.
- Reading: a tensor stored whole and wanted whole is read straight into the destination
  tensor's memory (`readinto`, no intermediate buffer); a resharded read fills a buffer of the
  stored chunk and copies the wanted slice. Files are read by `threads` threads.
- Object storage: each thread uploads its own file and reads its own byte ranges, so `threads`
  bounds the concurrency. A file of up to `REMOTE_WHOLE` bytes goes up in one request from the
  tensors' memory joined once (s3fs splits a large one into concurrent multipart parts), and is
  read back with one ranged request over the items this rank needs; a larger one streams
  through an fsspec file in `REMOTE_BLOCK` parts.

A missing file, a truncated one or a wrong checksum is a `CorruptCheckpointError` naming the
file and the tensor. The metadata is read whole and checked before it is unpickled: against the
size and hash its commit recorded (`integrity`), then for the shape of checkpoint metadata. Format-1
items in a checkpoint are read by DCP's own reader.
"""

from __future__ import annotations

import ctypes
import dataclasses
import io
import os
import pickle
import threading
import uuid
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType
from typing import Any, Protocol

import torch
import xxhash
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult

from llmtrain.checkpoint.integrity import (
    METADATA_FILE,
    CorruptCheckpointError,
    Damage,
    FileEntry,
    check_bytes,
    damaged,
    file_entry,
    plain_path,
    reading,
    reason,
)
from llmtrain.checkpoint.safe_io import (
    SafeFsspecReader,
    UnsafeCheckpointError,
    _finish_metadata,
    load_metadata,
)
from llmtrain.core_mesh.errors import naming_file

FORMAT = 2
SUFFIX = ".bin"
# bytes per write or read call, and per checksum update: large enough for sequential I/O,
# small enough that a thread's checksum of one slice overlaps the others' I/O
SLICE = 1 * 2**20
# I/O threads per rank: up to 4, and no more than the cores (reading from the page cache copies
# and hashes on the CPU; more threads than cores only contend)
DEFAULT_THREADS = max(1, min(4, os.cpu_count() or 1))
# object storage: files up to REMOTE_WHOLE bytes move in one request each (that much memory per
# thread); larger ones stream in REMOTE_BLOCK parts
REMOTE_WHOLE = 512 * 2**20
REMOTE_BLOCK = 64 * 2**20


@dataclasses.dataclass(frozen=True)
class StoredItem:
    """Where one saved item's bytes are (DCP `storage_data`): its file, its place in it, the XXH3
    (64-bit) hash of its bytes, and for a tensor its stored chunk's dtype and shape."""

    relative_path: str
    offset: int
    length: int
    xxh3: int
    dtype: str | None = None
    shape: tuple[int, ...] | None = None


def _memory(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable, without a copy (no numpy needed). The
    caller keeps `tensor` alive while the view is used."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


def _dtype(name: str) -> torch.dtype | None:
    """The torch dtype named `name` (`torch.float32`), or None."""
    dtype = getattr(torch, name.removeprefix("torch."), None) if isinstance(name, str) else None
    return dtype if isinstance(dtype, torch.dtype) else None


class _Closing(Protocol):
    """A file used in a `with` block (closed on leaving it)."""

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        tb: TracebackType | None,
        /,
    ) -> object: ...


class _Sink(_Closing, Protocol):
    """A checkpoint file open for writing: a local file, a `_WholeUpload` or an fsspec file."""

    def write(self, data: memoryview, /) -> int | None: ...

    def fileno(self) -> int: ...

    def __enter__(self) -> _Sink: ...


class _Uploads(Protocol):
    """What a `_WholeUpload` asks of its file system (an fsspec one)."""

    def pipe_file(self, path: str, value: bytes, /) -> object: ...


class _Source(_Closing, Protocol):
    """A checkpoint file open for reading: a local file, a `_Span` or an fsspec file."""

    def seek(self, position: int, /) -> object: ...

    def readinto(self, into: memoryview, /) -> int | None: ...

    def __enter__(self) -> _Source: ...


class _Files:
    """Opening the checkpoint's files: plain unbuffered files on a local disk, fsspec files
    elsewhere."""

    def __init__(self, url: str, storage_options: Mapping[str, object]):
        self.fs, self.root = url_to_fs(url, **storage_options)
        # the plain local filesystem only: a subclass may change how files open
        self.local = type(self.fs) is LocalFileSystem

    def path(self, name: str) -> str:
        return f"{self.root.rstrip('/')}/{name}"

    def create(self, name: str, size: int) -> _Sink:
        if self.local:
            return open(self.path(name), "wb", buffering=0)
        if size <= REMOTE_WHOLE:
            return _WholeUpload(self.fs, self.path(name))
        sink: _Sink = self.fs.open(self.path(name), "wb", block_size=REMOTE_BLOCK)
        return sink

    def open(self, name: str, start: int, end: int) -> _Source:
        """The file, for reads of bytes start..end (a local file, one ranged request's bytes, or
        an fsspec file that requests each read)."""
        if self.local:
            return open(self.path(name), "rb", buffering=0)
        if end - start <= REMOTE_WHOLE:
            return _Span(self.fs.cat_file(self.path(name), start=start, end=end), start)
        source: _Source = self.fs.open(
            self.path(name), "rb", block_size=REMOTE_BLOCK, cache_type="none"
        )
        return source

    def size(self, name: str) -> int:
        return int(self.fs.size(self.path(name)))


class _WholeUpload:
    """A remote file written as one request at close: the pieces written (views of the tensors'
    memory, which the caller keeps alive and unchanged until then) are joined once."""

    def __init__(self, fs: _Uploads, path: str):
        self.fs, self.path = fs, path
        self.pieces: list[memoryview] = []

    def write(self, piece: memoryview) -> int:
        self.pieces.append(piece)
        return len(piece)

    def fileno(self) -> int:
        raise io.UnsupportedOperation("a whole upload is no file of the operating system")

    def __enter__(self) -> _WholeUpload:
        return self

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> None:
        if kind is None:  # a failed write uploads nothing
            self.fs.pipe_file(self.path, b"".join(self.pieces))
        self.pieces = []


class _Span:
    """Bytes start..end of a file, fetched in one request, read like the file."""

    def __init__(self, data: bytes, start: int):
        self.data, self.start, self.position = memoryview(data), start, start

    def seek(self, position: int) -> None:
        self.position = position

    def readinto(self, into: memoryview) -> int:
        at = self.position - self.start
        got = max(0, min(len(into), len(self.data) - at))
        into[:got] = self.data[at : at + got]
        self.position += got
        return got

    def __enter__(self) -> _Span:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def _write_all(f: _Sink, data: memoryview) -> None:
    while data:
        written = f.write(data)
        data = data[written if written is not None else len(data) :]


# --- writing --------------------------------------------------------------------------------------


class StreamWriter(StorageWriter):
    """DCP `StorageWriter` of format 2 at `url` (a path or fsspec URL)."""

    def __init__(
        self,
        url: str,
        *,
        threads: int = DEFAULT_THREADS,
        sync_files: bool = True,
        **storage_options: object,
    ):
        super().__init__()
        self.url = url.rstrip("/")
        self.threads = max(1, threads)
        self.sync_files = sync_files
        self.storage_options = storage_options
        self.files = _Files(self.url, storage_options)
        self.save_id = uuid.uuid4().hex
        # on the coordinator, once `finish` wrote the metadata: the manifest entries of the
        # metadata (size, hash) and of every data file (size) for the step's COMMITTED
        self.written: dict[str, FileEntry] | None = None

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id:
            self.url = str(checkpoint_id).rstrip("/")
            self.files = _Files(self.url, self.storage_options)
        self.save_id = uuid.uuid4().hex
        self.written = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: object, **kwargs: object) -> None:
        pass  # the global plan names each rank's files

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self.files.fs.makedirs(self.files.root, exist_ok=True)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [dataclasses.replace(plan, storage_data=f"__{i}_") for i, plan in enumerate(plans)]

    def write_data(
        self, plan: SavePlan, planner: SavePlanner
    ) -> torch.futures.Future[list[WriteResult]]:
        buckets = _balanced(plan.items, self.threads)
        names = [f"{plan.storage_data}{i}{SUFFIX}" for i in range(len(buckets))]
        lock = threading.Lock()

        def resolve(item: WriteItem) -> Any:
            with lock:  # planners are not written for threads
                return planner.resolve_data(item)

        with ThreadPoolExecutor(len(buckets), thread_name_prefix="llmtrain-ckpt-write") as pool:
            done = pool.map(
                lambda name, bucket: self._write_file(name, bucket, resolve), names, buckets
            )
            results = [result for file_results in done for result in file_results]
        future: torch.futures.Future[list[WriteResult]] = torch.futures.Future()
        future.set_result(results)
        return future

    def _write_file(
        self, name: str, items: list[WriteItem], resolve: Callable[[WriteItem], Any]
    ) -> list[WriteResult]:
        results, offset = [], 0
        owners = []  # what the written views point into, alive until the file is closed
        with naming_file(self.files.path(name)), self.files.create(name, _total(items)) as f:
            for item in items:
                data = resolve(item)
                if item.type == WriteItemType.BYTE_IO:
                    view, dtype, shape = data.getbuffer(), None, None
                else:
                    data = data.detach().to("cpu").contiguous()
                    view = _memory(data)
                    dtype, shape = str(data.dtype), tuple(data.shape)
                if not self.files.local:
                    owners.append(data)
                digest = xxhash.xxh3_64()
                for start in range(0, len(view), SLICE):
                    piece = view[start : start + SLICE]
                    digest.update(piece)
                    _write_all(f, piece)
                stored = StoredItem(name, offset, len(view), digest.intdigest(), dtype, shape)
                results.append(
                    WriteResult(index=item.index, size_in_bytes=len(view), storage_data=stored)
                )
                offset += len(view)
            if self.sync_files and self.files.local:
                os.fsync(f.fileno())
        return results

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.storage_data = {r.index: r.storage_data for rank in results for r in rank}
        written: dict[str, FileEntry] = {}
        for stored in metadata.storage_data.values():  # each file holds its items back to back
            end = stored.offset + stored.length
            written[stored.relative_path] = {"size": max(end, _size(written, stored))}
        data = pickle.dumps(metadata)
        path = self.files.path(METADATA_FILE)
        with naming_file(path), self.files.fs.open(path, "wb") as f:
            f.write(data)
            if self.sync_files and self.files.local:
                f.flush()
                os.fsync(f.fileno())
        self.written = {METADATA_FILE: file_entry(data), **written}

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.url, save_id=self.save_id)

    @property
    def checkpoint_id(self) -> str:
        return self.url

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return True


def _size(written: dict[str, FileEntry], stored: StoredItem) -> int:
    entry = written.get(stored.relative_path)
    return 0 if entry is None else entry["size"]


def _balanced(items: list[WriteItem], bins: int) -> list[list[WriteItem]]:
    """`items` in at most `bins` non-empty groups of about equal bytes (largest first into the
    lightest group); byte items spread round-robin."""
    tensors = sorted(
        (i for i in items if i.type != WriteItemType.BYTE_IO), key=_item_bytes, reverse=True
    )
    others = [i for i in items if i.type == WriteItemType.BYTE_IO]
    groups: list[list[WriteItem]] = [[] for _ in range(max(1, min(bins, len(items))))]
    sizes = [0] * len(groups)
    for item in tensors:
        lightest = sizes.index(min(sizes))
        groups[lightest].append(item)
        sizes[lightest] += _item_bytes(item)
    for n, item in enumerate(others):
        groups[n % len(groups)].append(item)
    return [g for g in groups if g] or [[]]


def _total(items: list[WriteItem]) -> int:
    return sum(_item_bytes(i) for i in items)


def _item_bytes(item: WriteItem) -> int:
    """A tensor item's bytes (0 for a pickled value: small)."""
    data = item.tensor_data
    if data is None:
        return 0
    numel = 1
    for size in data.size:
        numel *= size
    return numel * data.properties.dtype.itemsize


# --- reading --------------------------------------------------------------------------------------


class StreamReader(SafeFsspecReader):
    """DCP `StorageReader` of format 2 (and, through DCP's reader, format 1) at `url`, with the
    metadata checked against `manifest` (the step's COMMITTED manifest, when it has one) and
    unpickled through the allow-list. A damaged file is a `CorruptCheckpointError`."""

    def __init__(
        self,
        url: str,
        *,
        threads: int = DEFAULT_THREADS,
        manifest: dict[str, FileEntry] | None = None,
        **storage_options: object,
    ):
        super().__init__(url, **storage_options)
        self.url = url.rstrip("/")
        self.threads = max(1, threads)
        self.manifest = manifest
        self.files = _Files(self.url, storage_options)
        self._checked: bytes | None = None  # the metadata's bytes, once they passed the checks

    def read_metadata(self, *args: object, **kwargs: object) -> Metadata:
        if self._checked is not None:  # DCP reads it again: the same checked bytes
            return _finish_metadata(load_metadata(io.BytesIO(self._checked)), self.load_id)
        with reading(self.url, METADATA_FILE):
            data = self.files.fs.cat_file(self.files.path(METADATA_FILE))
            check_bytes(data, (self.manifest or {}).get(METADATA_FILE))
            if not data:
                raise Damage("is empty")
            try:
                loaded = load_metadata(io.BytesIO(data))
            except UnsafeCheckpointError:
                raise
            except Exception as exc:  # noqa: BLE001 - any failure to unpickle: damaged bytes
                raise Damage(f"is not checkpoint metadata (unpickling: {reason(exc)})") from None
            problem = metadata_problem(loaded)
            if problem is not None:
                raise Damage(f"is not checkpoint metadata ({problem})")
        self._checked = data
        return _finish_metadata(loaded, self.load_id)

    def check_sizes(self, metadata: Metadata, sizes: dict[str, int]) -> None:
        """Every data file the metadata names is in `sizes` (name -> bytes: the step directory's
        listing) and long enough for its items: found before a tensor is read."""
        needed: dict[str, tuple[int, str]] = {}
        for index, stored in metadata.storage_data.items():
            end = stored.offset + stored.length
            if end >= needed.get(stored.relative_path, (-1, ""))[0]:
                needed[stored.relative_path] = (end, index.fqn)
        for name in sorted(needed):
            end, fqn = needed[name]
            where = f"{self.url}/{name}"
            if name not in sizes:
                raise damaged(self.url, where, f"is missing (it holds {fqn!r})")
            if sizes[name] < end:
                raise damaged(
                    self.url,
                    where,
                    f"is truncated: {fqn!r} needs bytes up to {end}, the file has {sizes[name]}",
                )

    def verify_items(self, metadata: Metadata) -> None:
        """Every stored item's bytes against its hash, reading the whole step (format-1 items
        carry no hash of their own and are skipped)."""
        by_file: dict[str, list[tuple[str, StoredItem]]] = {}
        for index, stored in metadata.storage_data.items():
            if isinstance(stored, StoredItem):
                by_file.setdefault(stored.relative_path, []).append((index.fqn, stored))

        def verify(name: str) -> None:
            items = sorted(by_file[name], key=lambda item: item[1].offset)
            end = max(stored.offset + stored.length for _, stored in items)
            with reading(self.url, name), self.files.open(name, items[0][1].offset, end) as f:
                for fqn, stored in items:
                    _read_checked(f, stored, None, self.url, fqn)

        workers = max(1, min(self.threads, len(by_file)))
        with ThreadPoolExecutor(workers, thread_name_prefix="llmtrain-ckpt-verify") as pool:
            list(pool.map(verify, sorted(by_file)))

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future[None]:
        streamed: list[ReadItem] = []
        older: list[ReadItem] = []
        for req in plan.items:
            stored = self.storage_data[req.storage_index]
            (streamed if isinstance(stored, StoredItem) else older).append(req)
        if older:  # format 1: DCP's reader (torch.load with weights_only)
            try:
                super().read_data(dataclasses.replace(plan, items=older), planner).wait()
            except Exception as exc:
                if "GLOBAL" in str(exc):  # not damage: a value weights_only refused by name
                    raise
                names = sorted({self.storage_data[r.storage_index].relative_path for r in older})
                where = f"{self.url}/{names[0]}"
                others = f" (or another of its {len(names)} data files)" if len(names) > 1 else ""
                raise damaged(self.url, where, f"cannot be read{others}: {reason(exc)}") from exc
        # tensors by file, read by the pool; the small pickled values meanwhile in this thread
        # (their unpickling is CPU work that overlaps the pool's I/O instead of following it)
        tensors: dict[str, list[ReadItem]] = {}
        values: dict[str, list[ReadItem]] = {}
        for req in streamed:
            kind = values if req.type == LoadItemType.BYTE_IO else tensors
            kind.setdefault(self.storage_data[req.storage_index].relative_path, []).append(req)
        lock = threading.Lock()
        shared = _shared_storages(tensors.values(), planner)
        workers = max(1, min(self.threads, len(tensors)))
        with ThreadPoolExecutor(workers, thread_name_prefix="llmtrain-ckpt-read") as pool:
            reads = [
                pool.submit(self._read_file, name, reqs, planner, lock, shared)
                for name, reqs in tensors.items()
            ]
            for name, reqs in values.items():
                self._read_file(name, reqs, planner, lock)
            for read in reads:
                read.result()
        future: torch.futures.Future[None] = torch.futures.Future()
        future.set_result(None)
        return future

    def _read_file(
        self,
        name: str,
        reqs: Iterable[ReadItem],
        planner: LoadPlanner,
        lock: threading.Lock,
        shared: frozenset[int] = frozenset(),
    ) -> None:
        where = f"{self.url}/{name}"
        reqs = sorted(reqs, key=lambda r: self.storage_data[r.storage_index].offset)
        lowest, highest = (self.storage_data[r.storage_index] for r in (reqs[0], reqs[-1]))
        try:
            size = self.files.size(name)
            f = self.files.open(name, lowest.offset, min(size, highest.offset + highest.length))
        except FileNotFoundError:
            problem = f"is missing (it holds {reqs[0].storage_index.fqn!r})"
            raise damaged(self.url, where, problem) from None
        with f:
            for req in reqs:
                stored: StoredItem = self.storage_data[req.storage_index]
                fqn = req.storage_index.fqn
                if stored.offset + stored.length > size:
                    raise damaged(
                        self.url,
                        where,
                        f"is truncated: {fqn!r} needs bytes up to {stored.offset + stored.length}, "
                        f"the file has {size}",
                    )
                if req.type == LoadItemType.BYTE_IO:
                    buffer = bytearray(stored.length)
                    _read_checked(f, stored, memoryview(buffer), self.url, fqn)
                    with lock:
                        planner.load_bytes(req, io.BytesIO(buffer))
                    continue
                with lock:
                    target = planner.resolve_tensor(req).detach()
                private = target.untyped_storage().data_ptr() in shared
                source = _landing(target, req, stored, private)
                _read_checked(f, stored, _memory(source), self.url, fqn)
                if source is not target:
                    target.copy_(narrow_tensor_by_index(source, req.storage_offsets, req.lengths))
                with lock:
                    planner.commit_tensor(req, target)


def _shared_storages(groups: Iterable[list[ReadItem]], planner: LoadPlanner) -> frozenset[int]:
    """The storages (data pointers) that more than one stored item is read into: tied weights,
    one tensor under two names (an embedding and its output head), saved as two items that two
    threads may read at once. Such an item is read into a buffer of its own, so the hash checked
    is of its own bytes, not of the memory the other read is writing."""
    counts: dict[int, int] = {}
    for reqs in groups:
        for req in reqs:
            ptr = planner.resolve_tensor(req).untyped_storage().data_ptr()
            counts[ptr] = counts.get(ptr, 0) + 1
    return frozenset(ptr for ptr, n in counts.items() if n > 1)


def _landing(
    target: torch.Tensor, req: ReadItem, stored: StoredItem, private: bool = False
) -> torch.Tensor:
    """Where the stored chunk's bytes are read to: the destination itself when it is the whole
    chunk, on CPU, contiguous, of the stored dtype and `private` is false (no other item is
    read into its storage); else a buffer of the chunk."""
    dtype = _dtype(stored.dtype or "")
    if dtype is None:  # the metadata's check refuses such an item first
        raise CorruptCheckpointError(f"checkpoint metadata names an unknown dtype {stored.dtype!r}")
    whole = all(o == 0 for o in req.storage_offsets) and tuple(req.lengths) == stored.shape
    if whole and not private and target.is_cpu and target.is_contiguous() and target.dtype == dtype:
        return target
    return torch.empty(stored.shape or (), dtype=dtype)


def _read_checked(
    f: _Source, stored: StoredItem, into: memoryview | None, url: str, fqn: str
) -> None:
    """Read the item's bytes into `into` (None: only hash them), checking their length and hash
    (`url`: the step's)."""
    where = f"{url}/{stored.relative_path}"
    f.seek(stored.offset)
    digest, done = xxhash.xxh3_64(), 0
    # where the bytes go when they are only hashed (none needed when read into `into`)
    scratch = memoryview(bytearray(min(SLICE, stored.length) if into is None else 0))
    while done < stored.length:
        if into is None:
            piece = scratch[: min(SLICE, stored.length - done)]
        else:
            piece = into[done : min(done + SLICE, stored.length)]
        got = f.readinto(piece)
        if not got:
            raise damaged(
                url,
                where,
                f"is truncated: {fqn!r} ends at byte {stored.offset + done}, "
                f"{stored.length - done} bytes short",
            )
        digest.update(piece[:got])
        done += got
    if digest.intdigest() != stored.xxh3:
        raise damaged(
            url,
            where,
            f"does not match the checksum of {fqn!r} (XXH3 {digest.intdigest():016x}, written "
            f"{stored.xxh3:016x})",
        )


# --- the shape of checkpoint metadata -------------------------------------------------------------


def metadata_problem(metadata: object) -> str | None:
    """What makes an unpickled `.metadata` something other than checkpoint metadata (the
    allow-list admits its classes, not their contents), or None."""
    if not isinstance(metadata, Metadata):
        return f"a {type(metadata).__name__}, not Metadata"
    state = metadata.state_dict_metadata
    if not isinstance(state, dict) or not state:
        return "no saved values"
    for fqn, meta in state.items():
        problem = _value_problem(meta)
        if not isinstance(fqn, str) or problem is not None:
            return f"value {fqn!r}: {problem or 'not named by a string'}"
    items = metadata.storage_data
    if not isinstance(items, dict) or not items:
        return "no storage records"
    for index, stored in items.items():
        if not isinstance(index, MetadataIndex) or index.fqn not in state:
            return f"a storage record of {getattr(index, 'fqn', index)!r}, which is no saved value"
        problem = _stored_problem(stored)
        if problem is not None:
            return f"the storage record of {index.fqn!r}: {problem}"
    if not isinstance(metadata.storage_meta, StorageMeta | None):
        return "a storage_meta that is not one"
    return None


def _counts(values: object) -> bool:
    return isinstance(values, tuple | list) and all(type(v) is int and v >= 0 for v in values)


def _value_problem(meta: object) -> str | None:
    if isinstance(meta, BytesStorageMetadata):
        return None
    if not isinstance(meta, TensorStorageMetadata):
        return f"a {type(meta).__name__}"
    if not _counts(meta.size) or not isinstance(
        getattr(meta.properties, "dtype", None), torch.dtype
    ):
        return "a tensor without a shape or dtype"
    for chunk in meta.chunks if isinstance(meta.chunks, list) else [None]:
        if not isinstance(chunk, ChunkStorageMetadata) or not (
            _counts(chunk.offsets)
            and _counts(chunk.sizes)
            and len(chunk.offsets) == len(chunk.sizes) == len(meta.size)
        ):
            return "a chunk that does not fit its tensor"
    return None


def _stored_problem(stored: object) -> str | None:
    if not isinstance(stored, StoredItem | _StorageInfo):
        return f"a {type(stored).__name__}"
    if not plain_path(stored.relative_path) or "/" in stored.relative_path:
        return f"file {stored.relative_path!r}, which is not a file of the step"
    if type(stored.offset) is not int or type(stored.length) is not int:
        return "no byte range"
    if stored.offset < 0 or stored.length < 0:
        return "a negative byte range"
    if isinstance(stored, StoredItem):
        if type(stored.xxh3) is not int:
            return "no checksum"
        if stored.dtype is not None and _dtype(stored.dtype) is None:
            return f"an unknown dtype {stored.dtype!r}"
        if stored.shape is not None and not _counts(stored.shape):
            return f"shape {stored.shape!r}"
    return None
