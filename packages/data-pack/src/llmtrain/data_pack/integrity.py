"""Per-chunk integrity: a packed dataset never reads a missing or damaged chunk as data.

The metadata's "integrity" records every stored chunk's size and CRC-32 as written
(`RecordingStore`). Opening a dataset lists its objects once and refuses a recorded chunk that is
missing or of another size; a read never turns a missing chunk into zeros, and a chunk read whole
must match its recorded checksum (`CheckedStore`); a chunk that does not decode is an error naming
it (`CheckedArray`). `PackedDataset.verify()` reads every chunk against its checksum. Datasets
packed before the record existed are checked for the presence of every chunk of their core arrays
instead.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import attrs
import numpy as np
import zarr
from fsspec.core import url_to_fs
from zarr.abc.store import ByteRequest, Store
from zarr.core.buffer import Buffer, BufferPrototype
from zarr.core.metadata import ArrayV3Metadata
from zarr.storage import WrapperStore

from llmtrain.core_mesh.storage_errors import storage_errors
from llmtrain.data_pack.errors import DatasetError

# the chunk record: {"checksum": "crc32", "chunks": {array: {chunk key: [bytes, crc32]}}}. Older
# readers ignore the attribute, so it needs no new format version.
INTEGRITY_KEY = "integrity"
# CRC-32 (zlib, in the standard library; data-pack has no faster hash among its dependencies)
# finds every burst of flipped bits up to 32 long and runs at memory speed: enough to tell a
# damaged chunk from an intact one, which is all it is for here (not an attacker).
CHECKSUM = "crc32"
# arrays in which no stored chunk holds only zeros, so every chunk of their grid exists: zarr
# skips writing a chunk that is all fill value, which the loss mask and provenance arrays may be
CORE_ARRAYS = ("tokens", "doc_offsets", "chunk_docs", "chunk_heads")
REPACK = "(the dataset is damaged; pack it again)"
UNDECODABLE = "cannot be decoded (cut short or corrupt)"
VERIFY_BATCH_BYTES = 64 << 20  # chunks read at once by verify (concurrently on object storage)


@attrs.frozen
class ChunkDamage:
    """One stored chunk that is not what was written: `key` is its name inside the array's
    folder (`c/2`), `problem` reads after it ("is missing")."""

    array: str
    key: str
    problem: str


class DamagedDatasetError(DatasetError):
    """Stored chunks that are missing, cut short or corrupt; names the first and counts the rest."""

    def __init__(self, url: str, damage: list[ChunkDamage]):
        self.url = url
        self.damage = list(damage)
        first = damage[0]
        more = ""
        if len(damage) > 1:
            names = ", ".join(f"{d.array} {d.key}" for d in damage[1:4])
            etc = ", ..." if len(damage) > 4 else ""
            more = f", and {len(damage) - 1} more damaged chunk(s) ({names}{etc})"
        super().__init__(f"{url}: {first.array} chunk {first.key} {first.problem}{more} {REPACK}")

    def __reduce__(
        self,
    ) -> tuple[
        type[DamagedDatasetError], tuple[str, list[ChunkDamage]]
    ]:  # DataLoader workers send it back to the main process pickled
        return type(self), (self.url, self.damage)


class RecordingStore(WrapperStore[Store]):
    """Notes the size and CRC-32 of every chunk written through it: the dataset's integrity
    record, computed from the bytes as they are stored, so a pack reads nothing back."""

    def __init__(self, store: Store, record: dict[str, list[int]]):
        super().__init__(store)
        self.record = record

    def _with_store(self, store: Store) -> RecordingStore:
        return type(self)(store, self.record)

    async def set(self, key: str, value: Buffer) -> None:
        await self._store.set(key, value)
        if not key.endswith("zarr.json"):  # array metadata is rewritten at every resize
            data = value.as_numpy_array()
            self.record[key] = [int(data.nbytes), zlib.crc32(data.data)]

    async def _set_many(self, values: Iterable[tuple[str, Buffer]]) -> None:
        for key, value in values:
            await self.set(key, value)

    async def delete(self, key: str) -> None:  # zarr deletes a chunk that became all fill value
        await self._store.delete(key)
        self.record.pop(key, None)


def chunk_order(key: str) -> tuple[int, ...]:
    return tuple(int(part) for part in key.split("/") if part.isdigit())


class CheckedStore(WrapperStore[Store]):
    """The store a dataset is read through. zarr reads a chunk that is not there as its fill
    value; here a chunk the dataset needs that is missing, or that a whole read finds with
    another size or CRC-32 than recorded, is a DamagedDatasetError naming it, also when it is
    damaged after the open.

    Only whole-object reads are checksummed: a byte range (sharded arrays read their chunks and
    the shard index that way) cannot be checked against the CRC of the whole object, so those
    reads are left to the open's size check and to `verify()`. The CRC costs about 0.5 ms per
    2 MiB chunk, once per chunk: the readers cache decoded chunks."""

    def __init__(
        self, store: Store, url: str, expected: dict[str, tuple[int, int] | None] | None = None
    ):
        super().__init__(store)
        self.url = url
        # "array/key" -> recorded (size, crc32) (None: not recorded); filled in place once the
        # arrays are open, so copies zarr makes of this store see it too
        self.expected = {} if expected is None else expected

    def _with_store(self, store: Store) -> CheckedStore:
        return type(self)(store, self.url, self.expected)

    async def get(
        self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None = None
    ) -> Buffer | None:
        with storage_errors(f"{self.url}/{key}", error=DatasetError):
            found = await self._store.get(key, prototype, byte_range)
        self._check(key, found, whole=byte_range is None)
        return found

    async def get_partial_values(
        self, prototype: BufferPrototype, key_ranges: Iterable[tuple[str, ByteRequest | None]]
    ) -> list[Buffer | None]:
        key_ranges = list(key_ranges)
        with storage_errors(self.url, error=DatasetError):
            found = await self._store.get_partial_values(prototype, key_ranges)
        for (key, _), value in zip(key_ranges, found, strict=True):
            self._check(key, value, whole=False)
        return found

    def _check(self, key: str, found: Buffer | None, *, whole: bool) -> None:
        if key not in self.expected:
            return
        recorded = self.expected[key]
        if found is None:
            problem = size_problem(None, None)
        elif whole and recorded is not None:
            problem = content_problem(found.as_numpy_array(), *recorded)
        else:
            problem = None
        if problem is not None:
            array, _, chunk = key.partition("/")
            raise DamagedDatasetError(self.url, [ChunkDamage(array, chunk, problem)])


def size_problem(found: int | None, recorded: int | None) -> str | None:
    """What is wrong with a stored chunk of `found` bytes (None: absent), or None."""
    if found is None:
        return "is missing"
    if recorded is not None and found != recorded:
        return f"holds {found:,} bytes, not the {recorded:,} written (cut short or overwritten)"
    return None


def content_problem(data: Any, size: int, crc: int) -> str | None:
    """What is wrong with a chunk read back whole (its bytes, in any contiguous buffer, or the
    error reading it), or None."""
    if isinstance(data, FileNotFoundError):
        return "is missing"
    if isinstance(data, BaseException):
        raise data  # not damage: the storage could not be read (network, permissions)
    problem = size_problem(memoryview(data).nbytes, size)
    if problem is not None:
        return problem
    found = zlib.crc32(data)
    if found != crc:
        return f"does not match its checksum ({CHECKSUM} {found:08x}, {crc:08x} written)"
    return None


def _rows(selection: Any, length: int) -> tuple[int, int]:
    """The rows [start, stop) of the first axis that a selection touches (all when unsure)."""
    first = selection[0] if isinstance(selection, tuple) and selection else selection
    if isinstance(first, (int, np.integer)):
        row = int(first) + length if first < 0 else int(first)
        return row, row + 1
    if isinstance(first, slice) and first.step in (None, 1):
        start, stop, _ = first.indices(length)
        return start, max(start, stop)
    return 0, length


class CheckedArray:
    """A stored array whose reads raise a DamagedDatasetError naming the chunk file when a chunk
    does not decode, instead of zarr's internal error; everything else is the zarr array's."""

    def __init__(self, array: zarr.Array[Any], name: str, url: str):
        self._array = array
        self.name = name
        self.url = url
        # rows of the first axis in one stored object: a shard when sharded, else a chunk
        self.unit_rows = int((array.shards or array.chunks)[0])

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("_"):
            raise AttributeError(attr)
        return getattr(self._array, attr)

    def __len__(self) -> int:  # zarr's Array has no len(): the length of its first axis
        return int(self._array.shape[0])

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return np.asarray(self[...], dtype=dtype)

    def __getitem__(self, selection: Any) -> Any:
        try:
            return self._array[selection]
        except (ValueError, RuntimeError) as exc:  # what zarr's codecs raise on bad bytes
            first, stop = _rows(selection, self._array.shape[0])
            for unit in range(first // self.unit_rows, -(-stop // self.unit_rows)):
                problem = self.unit_problem(unit)
                if problem is not None:
                    damage = ChunkDamage(self.name, self.key(unit), problem)
                    raise DamagedDatasetError(self.url, [damage]) from exc
            raise  # every chunk decodes on its own: not damage

    @property
    def n_units(self) -> int:
        return -(-int(self._array.shape[0]) // self.unit_rows)

    def key(self, unit: int) -> str:
        """The name of stored object `unit` in the array's folder, e.g. c/2."""
        coords = (unit,) + (0,) * (self._array.ndim - 1)
        metadata = self._array.metadata
        if not isinstance(metadata, ArrayV3Metadata):  # datasets are written as zarr v3 only
            raise DatasetError(f"{self.url}: {self.name} is not a zarr v3 array {REPACK}")
        return metadata.chunk_key_encoding.encode_chunk_key(coords)

    def keys(self) -> list[str]:
        """Every stored object of the grid (the other axes are never split here)."""
        return [self.key(unit) for unit in range(self.n_units)]

    def unit_problem(self, unit: int) -> str | None:
        """Read stored object `unit` whole: what is wrong with it, or None."""
        try:
            self._array[unit * self.unit_rows : (unit + 1) * self.unit_rows]
        except DamagedDatasetError as exc:
            return exc.damage[0].problem
        except (ValueError, RuntimeError):
            return UNDECODABLE
        return None


def stored_sizes(url: str, storage_options: Mapping[str, Any]) -> dict[str, int]:
    """Every object of a dataset ("tokens/c/0") with its size: one listing, not one request per
    chunk (on object storage a paginated listing of the prefix)."""
    fs, root = url_to_fs(url, **storage_options)
    fs.invalidate_cache(root)  # a listing cached before the dataset changed would hide damage
    prefix = root.rstrip("/") + "/"
    found = fs.find(root, detail=True)
    return {path.removeprefix(prefix): int(info["size"]) for path, info in found.items()}


def batches(
    items: list[tuple[str, str, int, int]], limit: int
) -> Iterator[list[tuple[str, str, int, int]]]:
    """Consecutive runs of (array, key, size, crc) items of at most `limit` bytes (one item at
    least)."""
    batch: list[tuple[str, str, int, int]] = []
    total = 0
    for item in items:
        if batch and total + item[2] > limit:
            yield batch
            batch, total = [], 0
        batch.append(item)
        total += item[2]
    if batch:
        yield batch
