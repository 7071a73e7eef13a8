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
file and the tensor. Format-1 items in a checkpoint are read by DCP's own reader.
"""

from __future__ import annotations

import ctypes
import dataclasses
import io
import os
import pickle
import threading
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import xxhash
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
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

from llmtrain.checkpoint.safe_io import METADATA_FILE, SafeFsspecReader
from llmtrain.core_mesh.errors import UserError, naming_file

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


class CorruptCheckpointError(UserError):
    """A checkpoint file that is missing, truncated or holds other bytes than were written."""


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


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise CorruptCheckpointError(f"checkpoint metadata names an unknown dtype {name!r}")
    return dtype


class _Files:
    """Opening the checkpoint's files: plain unbuffered files on a local disk, fsspec files
    elsewhere."""

    def __init__(self, url: str, storage_options: dict[str, Any]):
        self.fs, self.root = url_to_fs(url, **storage_options)
        # the plain local filesystem only: a subclass may change how files open
        self.local = type(self.fs) is LocalFileSystem

    def path(self, name: str) -> str:
        return f"{self.root.rstrip('/')}/{name}"

    def create(self, name: str, size: int):
        if self.local:
            return open(self.path(name), "wb", buffering=0)
        if size <= REMOTE_WHOLE:
            return _WholeUpload(self.fs, self.path(name))
        return self.fs.open(self.path(name), "wb", block_size=REMOTE_BLOCK)

    def open(self, name: str, start: int, end: int):
        """The file, for reads of bytes start..end (a local file, one ranged request's bytes, or
        an fsspec file that requests each read)."""
        if self.local:
            return open(self.path(name), "rb", buffering=0)
        if end - start <= REMOTE_WHOLE:
            return _Span(self.fs.cat_file(self.path(name), start=start, end=end), start)
        return self.fs.open(self.path(name), "rb", block_size=REMOTE_BLOCK, cache_type="none")

    def size(self, name: str) -> int:
        return int(self.fs.size(self.path(name)))


class _WholeUpload:
    """A remote file written as one request at close: the pieces written (views of the tensors'
    memory, which the caller keeps alive and unchanged until then) are joined once."""

    def __init__(self, fs: Any, path: str):
        self.fs, self.path, self.pieces = fs, path, []

    def write(self, piece: memoryview) -> int:
        self.pieces.append(piece)
        return len(piece)

    def __enter__(self) -> _WholeUpload:
        return self

    def __exit__(self, kind: Any, *rest: Any) -> None:
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

    def __exit__(self, *exc: Any) -> None:
        pass


def _write_all(f: Any, data: memoryview) -> None:
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
        **storage_options: Any,
    ):
        super().__init__()
        self.url = url.rstrip("/")
        self.threads = max(1, threads)
        self.sync_files = sync_files
        self.storage_options = storage_options
        self.files = _Files(self.url, storage_options)
        self.save_id = uuid.uuid4().hex

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self.url = str(checkpoint_id).rstrip("/")
            self.files = _Files(self.url, self.storage_options)
        self.save_id = uuid.uuid4().hex

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass  # the global plan names each rank's files

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self.files.fs.makedirs(self.files.root, exist_ok=True)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [dataclasses.replace(plan, storage_data=f"__{i}_") for i, plan in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> torch.futures.Future:
        buckets = _balanced(plan.items, self.threads)
        names = [f"{plan.storage_data}{i}{SUFFIX}" for i in range(len(buckets))]
        lock = threading.Lock()

        def resolve(item: WriteItem) -> Any:
            with lock:  # planners are not written for threads
                return planner.resolve_data(item)

        with ThreadPoolExecutor(len(buckets), thread_name_prefix="llmtrain-ckpt-write") as pool:
            done = pool.map(
                lambda job: self._write_file(*job, resolve), zip(names, buckets, strict=True)
            )
            results = [result for file_results in done for result in file_results]
        future: torch.futures.Future = torch.futures.Future()
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
        path = self.files.path(METADATA_FILE)
        with naming_file(path), self.files.fs.open(path, "wb") as f:
            pickle.dump(metadata, f)
            if self.sync_files and self.files.local:
                f.flush()
                os.fsync(f.fileno())

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.url, save_id=self.save_id)

    @property
    def checkpoint_id(self) -> str:
        return self.url

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return True


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
    return numel * torch._utils._element_size(data.properties.dtype)


# --- reading --------------------------------------------------------------------------------------


class StreamReader(SafeFsspecReader):
    """DCP `StorageReader` of format 2 (and, through DCP's reader, format 1) at `url`, with the
    metadata through the allow-listed unpickler."""

    def __init__(self, url: str, *, threads: int = DEFAULT_THREADS, **storage_options: Any):
        super().__init__(url, **storage_options)
        self.url = url.rstrip("/")
        self.threads = max(1, threads)
        self.files = _Files(self.url, storage_options)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future:
        streamed, older = [], []
        for req in plan.items:
            stored = self.storage_data[req.storage_index]
            (streamed if isinstance(stored, StoredItem) else older).append(req)
        if older:  # format 1: DCP's reader (torch.load with weights_only)
            super().read_data(dataclasses.replace(plan, items=older), planner).wait()
        # tensors by file, read by the pool; the small pickled values meanwhile in this thread
        # (their unpickling is CPU work that overlaps the pool's I/O instead of following it)
        tensors: dict[str, list[ReadItem]] = {}
        values: dict[str, list[ReadItem]] = {}
        for req in streamed:
            kind = values if req.type == LoadItemType.BYTE_IO else tensors
            kind.setdefault(self.storage_data[req.storage_index].relative_path, []).append(req)
        lock = threading.Lock()
        workers = max(1, min(self.threads, len(tensors)))
        with ThreadPoolExecutor(workers, thread_name_prefix="llmtrain-ckpt-read") as pool:
            reads = [pool.submit(self._read_file, *job, planner, lock) for job in tensors.items()]
            for name, reqs in values.items():
                self._read_file(name, reqs, planner, lock)
            for read in reads:
                read.result()
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(None)
        return future

    def _read_file(
        self, name: str, reqs: Iterable[ReadItem], planner: LoadPlanner, lock: threading.Lock
    ) -> None:
        where = f"{self.url}/{name}"
        reqs = sorted(reqs, key=lambda r: self.storage_data[r.storage_index].offset)
        lowest, highest = (self.storage_data[r.storage_index] for r in (reqs[0], reqs[-1]))
        try:
            size = self.files.size(name)
            f = self.files.open(name, lowest.offset, min(size, highest.offset + highest.length))
        except FileNotFoundError:
            raise CorruptCheckpointError(
                f"{where} is missing; it holds {reqs[0].storage_index.fqn!r} (the checkpoint is "
                "incomplete)"
            ) from None
        with f:
            for req in reqs:
                stored: StoredItem = self.storage_data[req.storage_index]
                fqn = req.storage_index.fqn
                if stored.offset + stored.length > size:
                    raise CorruptCheckpointError(
                        f"{where} is truncated: {fqn!r} needs bytes {stored.offset}.."
                        f"{stored.offset + stored.length}, the file has {size}"
                    )
                if req.type == LoadItemType.BYTE_IO:
                    buffer = bytearray(stored.length)
                    _read_checked(f, stored, memoryview(buffer), where, fqn)
                    with lock:
                        planner.load_bytes(req, io.BytesIO(buffer))
                    continue
                with lock:
                    target = planner.resolve_tensor(req).detach()
                source = _landing(target, req, stored)
                _read_checked(f, stored, _memory(source), where, fqn)
                if source is not target:
                    target.copy_(narrow_tensor_by_index(source, req.storage_offsets, req.lengths))
                with lock:
                    planner.commit_tensor(req, target)


def _landing(target: torch.Tensor, req: ReadItem, stored: StoredItem) -> torch.Tensor:
    """Where the stored chunk's bytes are read to: the destination itself when it is the whole
    chunk, on CPU, contiguous and of the stored dtype; else a buffer of the chunk."""
    dtype = _dtype(stored.dtype or "")
    whole = all(o == 0 for o in req.storage_offsets) and tuple(req.lengths) == stored.shape
    if whole and target.is_cpu and target.is_contiguous() and target.dtype == dtype:
        return target
    return torch.empty(stored.shape or (), dtype=dtype)


def _read_checked(f: Any, stored: StoredItem, into: memoryview, where: str, fqn: str) -> None:
    """Read the item's bytes into `into`, checking their length and hash."""
    f.seek(stored.offset)
    digest, done = xxhash.xxh3_64(), 0
    while done < stored.length:
        piece = into[done : min(done + SLICE, stored.length)]
        got = f.readinto(piece)
        if not got:
            raise CorruptCheckpointError(
                f"{where} is truncated: {fqn!r} ends at byte {stored.offset + done}, "
                f"{stored.length - done} bytes short"
            )
        digest.update(piece[:got])
        done += got
    if digest.intdigest() != stored.xxh3:
        raise CorruptCheckpointError(
            f"{where}: {fqn!r} does not match its checksum (XXH3 {digest.intdigest():016x}, "
            f"written {stored.xxh3:016x}): the file was damaged after the save"
        )
