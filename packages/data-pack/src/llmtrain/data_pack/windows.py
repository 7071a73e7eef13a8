"""Token windows read from a packed dataset through a bounded cache of whole chunks.

A zarr read costs about half a millisecond however small it is, so reading one window per call
would be ~100x too slow. Windows are cut from whole decoded chunks held in an LRU cache with a byte
budget; the chunk-aware sampler (`sampling.py`) keeps the chunks a batch needs few and nearby, so
nearly every window comes from memory and memory stays bounded whatever the dataset size.

Window i is tokens [i*seq_len, i*seq_len + seq_len + 1) of the continuous stream (documents back
to back, each ended by eod): inputs are its first seq_len tokens, targets its last seq_len.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from llmtrain.data_pack.errors import DatasetError
from llmtrain.data_pack.store import PackedDataset

DEFAULT_CACHE_BYTES = 128 << 20


class ChunkCache:
    """Decoded chunks of one dataset (tokens, and document starts when asked for), least recently
    used first out, within a byte budget."""

    def __init__(self, dataset: PackedDataset, max_bytes: int = DEFAULT_CACHE_BYTES):
        self.dataset = dataset
        self.max_bytes = max_bytes
        self._items: collections.OrderedDict[tuple[str, int], np.ndarray] = (
            collections.OrderedDict()
        )
        self._bytes = 0
        self.reads = 0

    def _get(self, kind: str, chunk: int, load: Callable[[int], np.ndarray]) -> np.ndarray:
        key = (kind, chunk)
        found = self._items.get(key)
        if found is not None:
            self._items.move_to_end(key)
            return found
        found = load(chunk)
        self._items[key] = found
        self._bytes += found.nbytes
        while self._bytes > self.max_bytes and len(self._items) > 1:
            _, dropped = self._items.popitem(last=False)
            self._bytes -= dropped.nbytes
        return found

    def tokens(self, chunk: int) -> np.ndarray:
        if ("tokens", chunk) not in self._items:
            self.reads += 1
        return self._get("tokens", chunk, self.dataset.read_chunk)

    def head(self, chunk: int, need: int) -> np.ndarray | None:
        """The first `need` tokens of a chunk without decoding it, when they are stored apart
        and the chunk itself is not cached; None otherwise."""
        dataset = self.dataset
        heads = dataset.chunk_heads
        if heads is None or need > dataset.head_tokens or ("tokens", chunk) in self._items:
            return None
        rows = heads.chunks[0]
        if 4 * rows * dataset.head_tokens * dataset.dtype.itemsize > self.max_bytes:
            return None  # a block of heads would crowd out the chunks themselves
        block = self._get("heads", chunk // rows, dataset.read_heads)
        return block[chunk % rows, :need]

    def doc_starts(self, chunk: int) -> np.ndarray:
        return self._get("starts", chunk, self.dataset.chunk_doc_starts)

    def loss_mask(self, chunk: int) -> np.ndarray:
        return self._get("mask", chunk, self.dataset.read_mask_chunk)

    def get(self, chunk: int) -> tuple[np.ndarray, np.ndarray]:
        return self.tokens(chunk), self.doc_starts(chunk)

    @property
    def nbytes(self) -> int:
        return self._bytes


class TokenWindows:
    """The windows of `seq_len + 1` tokens of one packed dataset: `window(i)`, batched
    `read(indices)` and, for chat datasets, `read_mask(indices)`.

    Picklable (for DataLoader workers started with spawn): only the URL travels; each process
    opens the dataset and keeps its own cache.
    """

    def __init__(
        self,
        dataset: PackedDataset | str,
        seq_len: int,
        *,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        storage_options: Mapping[str, Any] | None = None,
    ):
        if isinstance(dataset, str):
            dataset = PackedDataset(dataset, storage_options=storage_options)
        if seq_len < 1:
            raise ValueError("seq_len must be at least 1")
        self.dataset = dataset
        self._seq_len = seq_len
        self.cache_bytes = cache_bytes
        self.cache = ChunkCache(dataset, cache_bytes)
        self._len = max(0, (dataset.n_tokens - 1) // seq_len)
        if self._len == 0:
            raise DatasetError(
                f"{dataset.url} has {dataset.n_tokens} tokens: not enough for one window of "
                f"seq_len {seq_len} (+1); pack more data or use a shorter sequence"
            )

    def __getstate__(self) -> dict[str, Any]:
        return {"dataset": self.dataset, "seq_len": self._seq_len, "cache_bytes": self.cache_bytes}

    def __setstate__(self, state: dict[str, Any]) -> None:
        type(self).__init__(
            self, state["dataset"], state["seq_len"], cache_bytes=state["cache_bytes"]
        )

    @property
    def seq_len(self) -> int:
        return self._seq_len

    def __len__(self) -> int:
        return self._len

    @property
    def windows_per_chunk(self) -> int:
        return max(1, self.dataset.chunk_tokens // self._seq_len)

    def window(self, index: int) -> np.ndarray:
        return self.read([index])[0][0, :]

    def read(
        self, indices: Sequence[int] | np.ndarray, *, doc_starts: bool = False
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """Windows as a (n, seq_len + 1) int64 array, and optionally a (n, seq_len) bool array
        that is True where a document starts at that input position."""
        indices = np.asarray(indices, dtype=np.int64)
        if len(indices) and (indices.min() < 0 or indices.max() >= self._len):
            raise IndexError(f"window index out of range 0..{self._len - 1}")
        length = self._seq_len + 1
        tokens = np.empty((len(indices), length), dtype=np.int64)
        starts = np.zeros((len(indices), self._seq_len), dtype=bool) if doc_starts else None
        chunk_tokens = self.dataset.chunk_tokens
        # visit windows in order of their first chunk so each chunk is fetched once per call
        for row in np.argsort(indices, kind="stable"):
            begin = int(indices[row]) * self._seq_len
            end = begin + length
            position = begin
            while position < end:
                chunk = position // chunk_tokens
                base = chunk * chunk_tokens
                chunk_ids = None
                if position == base and position > begin:  # only the start of the next chunk
                    chunk_ids = self.cache.head(chunk, end - position)
                if chunk_ids is None:
                    chunk_ids = self.cache.tokens(chunk)
                stop = min(end, base + len(chunk_ids))
                tokens[row, position - begin : stop - begin] = chunk_ids[
                    position - base : stop - base
                ]
                if starts is not None:
                    chunk_starts = self.cache.doc_starts(chunk)
                    lo, hi = np.searchsorted(
                        chunk_starts, [position - base, min(stop, end - 1) - base]
                    )
                    starts[row, chunk_starts[lo:hi] + base - begin] = True
                position = stop
        return tokens, starts

    def read_mask(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """The loss mask of windows, (n, seq_len + 1) bool beside `read`'s tokens: True where the
        token is a target the loss counts (all True for a dataset without a mask)."""
        indices = np.asarray(indices, dtype=np.int64)
        length = self._seq_len + 1
        if self.dataset.loss_mask is None:
            return np.ones((len(indices), length), dtype=bool)
        mask = np.empty((len(indices), length), dtype=bool)
        chunk_tokens = self.dataset.chunk_tokens
        for row in np.argsort(indices, kind="stable"):
            begin = int(indices[row]) * self._seq_len
            position, end = begin, begin + length
            while position < end:
                chunk = position // chunk_tokens
                base = chunk * chunk_tokens
                values = self.cache.loss_mask(chunk)
                stop = min(end, base + len(values))
                mask[row, position - begin : stop - begin] = values[position - base : stop - base]
                position = stop
        return mask
