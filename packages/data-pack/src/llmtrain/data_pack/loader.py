"""Batches for training: windows of one dataset or a weighted mixture, this rank's share, resumable.

`WindowDataset` is map-style and keyed by global sample index, and `StepBatches` yields each
micro-batch's indices, so torch's DataLoader (workers, spawn) can drive them as `dataset=` and
`batch_sampler=` without this package importing torch. `WindowLoader` is the same without torch:
plain numpy batches and a `state_dict()` of one number.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from llmtrain.core_mesh.errors import UserError
from llmtrain.data_pack.errors import DatasetError
from llmtrain.data_pack.sampling import BatchPlan, Phase, Sampler, SourceShape
from llmtrain.data_pack.windows import DEFAULT_CACHE_BYTES, TokenWindows


class WindowDataset:
    """Global sample index -> {"tokens": (seq_len+1,) int64, "doc_starts": (seq_len,) bool,
    "loss_mask": (seq_len+1,) bool}. The loss mask comes when any source is a chat dataset
    (`loss_mask=None`) or when asked for; a source without one counts every token."""

    def __init__(
        self,
        sources: Sequence[TokenWindows],
        sampler: Sampler,
        *,
        doc_starts: bool = False,
        loss_mask: bool | None = None,
    ):
        self.sources = list(sources)
        self.sampler = sampler
        self.doc_starts = doc_starts
        if loss_mask is None:
            loss_mask = any(s.dataset.loss_mask is not None for s in self.sources)
        self.loss_mask = loss_mask

    @property
    def seq_len(self) -> int:
        return self.sources[0].seq_len

    def __len__(self) -> int:
        return sum(len(s) for s in self.sources)

    def read(self, samples: Sequence[int] | np.ndarray) -> dict[str, np.ndarray]:
        """A batch: tokens (n, seq_len+1), optional doc_starts (n, seq_len) and loss_mask
        (n, seq_len+1), the sample indices and which source each came from."""
        samples = np.asarray(samples, dtype=np.int64)
        sources, windows = self.sampler.lookup(samples)
        n, length = len(samples), self.seq_len + 1
        tokens = np.empty((n, length), dtype=np.int64)
        starts = np.zeros((n, length - 1), dtype=bool) if self.doc_starts else None
        mask = np.empty((n, length), dtype=bool) if self.loss_mask else None
        for source in np.unique(sources):
            rows = np.flatnonzero(sources == source)
            got, got_starts = self.sources[int(source)].read(
                windows[rows], doc_starts=self.doc_starts
            )
            tokens[rows] = got
            if starts is not None:
                starts[rows] = got_starts
            if mask is not None:
                mask[rows] = self.sources[int(source)].read_mask(windows[rows])
        batch = {"tokens": tokens, "samples": samples, "sources": sources}
        if starts is not None:
            batch["doc_starts"] = starts
        if mask is not None:
            batch["loss_mask"] = mask
        return batch

    def __getitem__(self, sample: int) -> dict[str, np.ndarray]:
        return {k: v[0] for k, v in self.read([sample]).items()}

    def __getitems__(self, samples: Sequence[int]) -> list[dict[str, np.ndarray]]:
        batch = self.read(samples)
        return [{k: v[i] for k, v in batch.items()} for i in range(len(samples))]


@attrs.frozen
class StepBatches:
    """Micro-batches of global sample indices for this rank, from `start_step` on (a batch
    sampler for torch's DataLoader; endless unless `steps` is given)."""

    plan: BatchPlan
    start_step: int = 0
    steps: int | None = None

    def __iter__(self) -> Iterator[list[int]]:
        stop = None if self.steps is None else self.start_step + self.steps
        for step in itertools.islice(
            itertools.count(self.start_step), None, stop and stop - self.start_step
        ):
            for micro in self.plan.step(step):
                yield micro.tolist()

    def __len__(self) -> int:
        if self.steps is None:
            raise TypeError("an endless batch sampler has no length")
        return self.steps * self.plan.accumulation


class WindowLoader:
    """Iterate (step, micro-batch index, batch) for this rank; resumable from `consumed`."""

    def __init__(self, dataset: WindowDataset, plan: BatchPlan, *, consumed: int = 0):
        self.dataset, self.plan = dataset, plan
        self.consumed = consumed
        self.step = plan.step_at(consumed)

    def __iter__(self) -> Iterator[tuple[int, int, dict[str, np.ndarray]]]:
        while True:
            step = self.step
            micros = self.plan.step(step)
            for i, micro in enumerate(micros):
                batch = self.dataset.read(micro)
                if (
                    i == len(micros) - 1
                ):  # the step is fully read: a state saved now resumes after it
                    self.step = step + 1
                    self.consumed = self.step * self.plan.global_batch
                yield step, i, batch

    def state_dict(self) -> dict[str, int]:
        return {"consumed": self.consumed, "global_batch": self.plan.global_batch}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        if int(state["global_batch"]) != self.plan.global_batch:
            raise UserError(
                f"the data state was saved with a global batch of {state['global_batch']} "
                f"samples, this run uses {self.plan.global_batch}: the sample order would differ"
            )
        self.consumed = int(state["consumed"])
        self.step = self.plan.step_at(self.consumed)


def open_windows(
    urls: Sequence[str],
    seq_len: int,
    *,
    weights: Sequence[float] | None = None,
    phases: Sequence[Phase] | None = None,
    seed: int = 0,
    doc_starts: bool = False,
    shuffle: bool = True,
    pool_blocks: int = 8,
    cache_bytes: int | None = None,
    tokenizer: Any = None,
    storage_options: Mapping[str, Any] | None = None,
) -> WindowDataset:
    """One dataset or a weighted mixture of several (or a mixture schedule: `phases`), as a
    WindowDataset. All must share one tokenizer (and match `tokenizer`, if given); the cache
    holds at least a pool of chunks.
    A chat dataset needs `seq_len` to be a multiple of its block, so no window cuts a
    conversation; its windows carry their loss mask."""
    sources: list[TokenWindows] = []
    for url in urls:
        windows = TokenWindows(url, seq_len, cache_bytes=1, storage_options=storage_options)
        block = windows.dataset.block
        if block is not None and seq_len % block:
            raise DatasetError(
                f"{url} holds conversations packed for seq_len {block} (none crosses a block of "
                f"{block} tokens), but windows of {seq_len} would cut them; use a seq_len that "
                f"is a multiple of {block}, or pack the data again with --seq-len {seq_len}"
            )
        if tokenizer is not None:
            windows.dataset.check_tokenizer(tokenizer)
        if sources and windows.dataset.fingerprint != sources[0].dataset.fingerprint:
            raise DatasetError(
                f"{url} and {sources[0].dataset.url} were packed with different tokenizers "
                f"({windows.dataset.meta['tokenizer']['name']} vs "
                f"{sources[0].dataset.meta['tokenizer']['name']}); a mixture needs one tokenizer"
            )
        # a pool of P blocks touches up to 2P chunks (each block's last window reaches one token
        # into the next chunk); document starts and loss masks are cached beside the tokens
        itemsize = windows.dataset.dtype.itemsize + (windows.dataset.loss_mask is not None)
        chunk_bytes = windows.dataset.chunk_tokens * itemsize
        needed = int((2 * pool_blocks + 2) * chunk_bytes * 1.25)
        windows.cache.max_bytes = max(cache_bytes or DEFAULT_CACHE_BYTES, needed)
        windows.cache_bytes = windows.cache.max_bytes
        sources.append(windows)
    sampler = Sampler(
        [SourceShape(len(s), s.windows_per_chunk) for s in sources],
        weights=weights,
        phases=phases,
        seed=seed,
        pool_blocks=pool_blocks,
        shuffle=shuffle,
    )
    return WindowDataset(sources, sampler, doc_starts=doc_starts)
