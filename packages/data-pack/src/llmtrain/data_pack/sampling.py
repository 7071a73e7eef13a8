"""Which window each global sample is: deterministic, chunk-aware, resumable, mixable.

Global sample s (0, 1, 2, ... over the whole run) maps to a (source, window) pair by pure
functions of the seed, so:
- the order is the same on every machine and for any number of ranks;
- a run resumes exactly from one number, the count of global samples consumed;
- a rank reads its share of step k as positions [k*B + r*B/R, k*B + (r+1)*B/R), so changing the
  number of ranks R with the same global batch B changes who reads a sample, never which it is.

Within a source, an epoch's order is chunk-aware: windows are grouped in blocks that follow the
stored chunks, the blocks are shuffled, and windows are shuffled within pools of `pool_blocks`
consecutive blocks of that order. Reads stay on a handful of chunks at a time while the order is
well mixed. Memory is O(blocks + pool), independent of the number of windows.

A mixture is exact at block boundaries: of the first n samples, for n a multiple of the block
(4096, or more for very small weights), source d gets exactly floor(C[d+1]*n) - floor(C[d]*n),
C being the cumulative normalised weights. Within a block the sources are interleaved at random,
so a prefix that ends inside a block is off by at most that block's shuffle.

A mixture schedule is phases of mixtures one after another (an annealing mix, a curriculum), each
ending at a given global sample. Each phase is a mixture of its own, counted from the phase's
first sample, and each source's stream goes on where the phases before left it: a source reads
on through its epoch order across a phase boundary, never from its start again.
"""

from __future__ import annotations

import collections
import itertools
import math
from collections.abc import Callable, Hashable, Sequence
from fractions import Fraction
from typing import Any, Generic, TypeVar

import attrs
import numpy as np

from llmtrain.core_mesh.errors import UserError

_SALT_BLOCKS, _SALT_POOL, _SALT_MIX = 1, 2, 3
MIN_WEIGHT = 1e-6


def _rng(*key: int) -> np.random.Generator:
    return np.random.Generator(np.random.Philox(np.random.SeedSequence([int(k) for k in key])))


_K = TypeVar("_K", bound=Hashable)
_V = TypeVar("_V")


class _Lru(Generic[_K, _V]):
    def __init__(self, size: int):
        self.size = size
        self.items: collections.OrderedDict[_K, _V] = collections.OrderedDict()

    def get(self, key: _K, make: Callable[[], _V]) -> _V:
        if key in self.items:
            self.items.move_to_end(key)
            return self.items[key]
        value = self.items[key] = make()
        if len(self.items) > self.size:
            self.items.popitem(last=False)
        return value


class EpochOrder:
    """The window order of one source: a permutation of range(n_windows) per epoch, computed
    a pool at a time. `shuffle=False` gives the stored order (for evaluation)."""

    def __init__(
        self,
        n_windows: int,
        *,
        block_windows: int,
        pool_blocks: int = 8,
        seed: int = 0,
        source: int = 0,
        shuffle: bool = True,
    ):
        if n_windows < 1:
            raise ValueError("a source needs at least one window")
        self.n = n_windows
        self.block = max(1, block_windows)
        self.pool = max(1, pool_blocks)
        self.seed, self.source, self.shuffle = seed, source, shuffle
        self.n_blocks = -(-n_windows // self.block)
        self._epochs: _Lru[int, tuple[np.ndarray, np.ndarray]] = _Lru(2)
        self._pools: _Lru[tuple[int, int], np.ndarray] = _Lru(4)

    def _block_size(self, blocks: np.ndarray) -> np.ndarray:
        sizes: np.ndarray = np.minimum((blocks + 1) * self.block, self.n) - blocks * self.block
        return sizes

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        def make() -> tuple[np.ndarray, np.ndarray]:
            blocks = _rng(self.seed, self.source, epoch, _SALT_BLOCKS).permutation(self.n_blocks)
            sizes = self._block_size(blocks)
            pool_sizes = np.add.reduceat(sizes, np.arange(0, self.n_blocks, self.pool))
            return blocks, np.concatenate(([0], np.cumsum(pool_sizes)))

        return self._epochs.get(epoch, make)

    def _pool(self, epoch: int, pool: int) -> np.ndarray:
        def make() -> np.ndarray:
            blocks, _ = self._epoch(epoch)
            chosen = blocks[pool * self.pool : (pool + 1) * self.pool]
            windows = np.concatenate(
                [np.arange(b * self.block, min((b + 1) * self.block, self.n)) for b in chosen]
            )
            return windows[
                _rng(self.seed, self.source, epoch, pool, _SALT_POOL).permutation(len(windows))
            ]

        return self._pools.get((epoch, pool), make)

    def windows(self, positions: np.ndarray) -> np.ndarray:
        """Window indices at stream positions (epoch = position // n_windows)."""
        positions = np.asarray(positions, dtype=np.int64)
        if not self.shuffle:
            return positions % self.n
        out = np.empty(len(positions), dtype=np.int64)
        epochs, within = np.divmod(positions, self.n)
        for epoch in np.unique(epochs):
            here = epochs == epoch
            _, bounds = self._epoch(int(epoch))
            pools = np.searchsorted(bounds, within[here], side="right") - 1
            result = np.empty(int(here.sum()), dtype=np.int64)
            for pool in np.unique(pools):
                mine = pools == pool
                result[mine] = self._pool(int(epoch), int(pool))[within[here][mine] - bounds[pool]]
            out[here] = result
        return out


class Mixture:
    """Global sample -> (source, that source's own stream position), exact to the weights."""

    def __init__(
        self, weights: Sequence[float], *, seed: int = 0, block: int = 4096, phase: int = 0
    ):
        if not weights or any(w < 0 for w in weights) or sum(weights) <= 0:
            raise UserError(f"mixture weights {list(weights)} must be >= 0 with a positive sum")
        # the decimal the user wrote (0.7 is 7/10, not the nearest binary float); nothing rounded away
        fractions = [Fraction(repr(float(w))) for w in weights]
        total = sum(fractions)
        self.weights = [f / total for f in fractions]
        smallest = min(w for w in self.weights if w > 0)
        if smallest < MIN_WEIGHT:
            raise UserError(
                f"mixture weight {float(smallest):.3g} of the total is below {MIN_WEIGHT:g}: that "
                "dataset would be sampled less than once per million samples; raise its weight "
                "or leave it out"
            )
        # every positive weight gets at least one sample per block, so block counts never shrink
        block = max(block, math.ceil(1 / smallest))
        cumulative = [Fraction(0)]
        for w in self.weights:
            cumulative.append(cumulative[-1] + w)
        self._cumulative = cumulative
        self.seed, self.block = seed, block
        # phase 0 draws as a mixture without phases did, so adding a schedule keeps its first phase
        self._salt = (_SALT_MIX,) if phase == 0 else (_SALT_MIX, phase)
        self._blocks: _Lru[int, tuple[np.ndarray, np.ndarray]] = _Lru(4)

    def counts(self, n: int) -> list[int]:
        """How many of the first n global samples each source gets: exact when n is a multiple
        of `self.block`, within one block's shuffle otherwise."""
        floors = [c.numerator * n // c.denominator for c in self._cumulative]
        return [b - a for a, b in itertools.pairwise(floors)]

    def _block(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        def make() -> tuple[np.ndarray, np.ndarray]:
            before = self.counts(k * self.block)
            inside = [b - a for a, b in zip(before, self.counts((k + 1) * self.block), strict=True)]
            labels = np.repeat(np.arange(len(inside)), inside)
            labels = labels[_rng(self.seed, k, *self._salt).permutation(len(labels))]
            local = np.empty(len(labels), dtype=np.int64)
            for source, start in enumerate(before):
                mine = labels == source
                local[mine] = start + np.arange(int(mine.sum()))
            return labels, local

        return self._blocks.get(k, make)

    def taken(self, n: int) -> list[int]:
        """How many of the first n global samples each source gets, exactly (inside a block
        too: the block's own labels are counted)."""
        whole, rest = divmod(n, self.block)
        counts = self.counts(whole * self.block)
        if rest:
            labels, _ = self._block(whole)
            inside = np.bincount(labels[:rest], minlength=len(counts))
            counts = [c + int(i) for c, i in zip(counts, inside, strict=True)]
        return counts

    def assign(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        samples = np.asarray(samples, dtype=np.int64)
        sources = np.empty(len(samples), dtype=np.int64)
        local = np.empty(len(samples), dtype=np.int64)
        blocks, within = np.divmod(samples, self.block)
        for k in np.unique(blocks):
            here = blocks == k
            labels, positions = self._block(int(k))
            sources[here] = labels[within[here]]
            local[here] = positions[within[here]]
        return sources, local


@attrs.frozen
class Phase:
    """One phase of a mixture schedule: the weight of each source until global sample `end`
    (None: the last phase, which goes on to the end of the run)."""

    weights: tuple[float, ...]
    end: int | None = None


class MixtureSchedule:
    """Global sample -> (source, that source's own stream position) over phases of mixtures.

    Phase p covers global samples [start_p, end_p) and is a `Mixture` of its own weights over
    the samples counted from start_p; a source's stream position in phase p is the number of
    its samples in the phases before (exact, `Mixture.taken`) plus its position within p."""

    def __init__(self, phases: Sequence[Phase], *, seed: int = 0, block: int = 4096):
        if not phases:
            raise UserError("a mixture schedule needs at least one phase")
        ends = [p.end for p in phases]
        if ends[-1] is not None or any(end is None for end in ends[:-1]):
            raise UserError("every phase of a mixture schedule but the last needs its end")
        starts = [0, *(int(end) for end in ends[:-1] if end is not None)]
        if any(b <= a for a, b in itertools.pairwise(starts)):
            raise UserError(f"mixture phases must end in increasing order, got ends {ends[:-1]}")
        widths = {len(p.weights) for p in phases}
        if len(widths) > 1:
            raise UserError(f"mixture phases weight different numbers of sources: {widths}")
        self.mixtures = [
            Mixture(p.weights, seed=seed, block=block, phase=i) for i, p in enumerate(phases)
        ]
        self.starts = starts
        # each source's samples in the phases before each phase
        self.before = [[0] * widths.pop()]
        for mixture, (start, end) in zip(
            self.mixtures[:-1], itertools.pairwise(starts), strict=True
        ):
            took = mixture.taken(end - start)
            self.before.append([a + b for a, b in zip(self.before[-1], took, strict=True)])

    def _phase_of(self, samples: np.ndarray) -> np.ndarray:
        phases: np.ndarray = np.searchsorted(self.starts, samples, side="right") - 1
        return phases

    def counts(self, n: int) -> list[int]:
        """How many of the first n global samples each source gets, exactly across the phase
        boundaries (within a block's shuffle inside the last phase, as `Mixture.counts`)."""
        phase = int(self._phase_of(np.asarray([n]))[0])
        inside = self.mixtures[phase].counts(n - self.starts[phase])
        return [a + b for a, b in zip(self.before[phase], inside, strict=True)]

    def assign(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        samples = np.asarray(samples, dtype=np.int64)
        sources = np.empty(len(samples), dtype=np.int64)
        local = np.empty(len(samples), dtype=np.int64)
        phases = self._phase_of(samples)
        for phase in np.unique(phases):
            here = phases == phase
            got, position = self.mixtures[int(phase)].assign(samples[here] - self.starts[phase])
            sources[here] = got
            local[here] = position + np.asarray(self.before[int(phase)], np.int64)[got]
        return sources, local


@attrs.frozen
class SourceShape:
    """What the sampler needs to know about one source."""

    n_windows: int
    block_windows: int


class Sampler:
    """Global sample index -> (source index, window index), for one source or a weighted mix."""

    def __init__(
        self,
        sources: Sequence[SourceShape],
        *,
        weights: Sequence[float] | None = None,
        phases: Sequence[Phase] | None = None,
        seed: int = 0,
        pool_blocks: int = 8,
        shuffle: bool = True,
    ):
        """`weights` mix the sources for the whole run; `phases` (instead) change the mixture
        at given global samples."""
        if not sources:
            raise UserError("no data sources")
        if weights is not None and phases is not None:
            raise UserError("give mixture weights or mixture phases, not both")
        if weights is not None and len(weights) != len(sources):
            raise UserError(f"{len(weights)} mixture weights for {len(sources)} datasets")
        for phase in phases or ():
            if len(phase.weights) != len(sources):
                raise UserError(
                    f"a mixture phase weights {len(phase.weights)} of {len(sources)} datasets"
                )
        self.orders = [
            EpochOrder(
                s.n_windows,
                block_windows=s.block_windows,
                pool_blocks=pool_blocks,
                seed=seed,
                source=i,
                shuffle=shuffle,
            )
            for i, s in enumerate(sources)
        ]
        self.seed = seed
        self.mixture: Mixture | MixtureSchedule | None = None
        self.remix(weights=weights, phases=phases)

    def remix(
        self, *, weights: Sequence[float] | None = None, phases: Sequence[Phase] | None = None
    ) -> None:
        """Mix the same sources with other weights or phases (a resume that goes on with the
        schedule its checkpoint was trained on)."""
        if len(self.orders) == 1:
            self.mixture = None
        elif phases is not None:
            self.mixture = MixtureSchedule(phases, seed=self.seed)
        else:
            self.mixture = Mixture(weights or [1.0] * len(self.orders), seed=self.seed)

    def lookup(self, samples: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        samples = np.asarray(samples, dtype=np.int64)
        if self.mixture is None:
            return np.zeros(len(samples), np.int64), self.orders[0].windows(samples)
        sources, local = self.mixture.assign(samples)
        windows = np.empty(len(samples), dtype=np.int64)
        for source in np.unique(sources):
            mine = sources == source
            windows[mine] = self.orders[int(source)].windows(local[mine])
        return sources, windows

    def epochs_at(self, samples: int) -> list[float]:
        """How many passes over each source the first `samples` global samples make."""
        counts = self.mixture.counts(samples) if self.mixture else [samples]
        return [c / o.n for c, o in zip(counts, self.orders, strict=True)]


@attrs.frozen
class BatchPlan:
    """This rank's share of each global batch, as global sample indices; resumable by `consumed`.

    With micro_batch < global_batch / world_size, a step is several micro-batches (gradient
    accumulation); `consumed` always counts whole steps."""

    global_batch: int
    world_size: int = 1
    rank: int = 0
    micro_batch: int | None = None

    def __attrs_post_init__(self) -> None:
        if self.global_batch < 1 or self.world_size < 1:
            raise UserError("global batch and world size must be positive")
        if self.global_batch % self.world_size:
            raise UserError(
                f"the global batch of {self.global_batch} samples does not divide over "
                f"{self.world_size} data-parallel ranks; use a multiple of {self.world_size}"
            )
        if self.micro_batch is not None and self.micro_batch < 1:
            raise UserError(f"micro batch {self.micro_batch}: must be at least 1")
        if not 0 <= self.rank < self.world_size:
            raise UserError(f"rank {self.rank} is outside 0..{self.world_size - 1}")
        if self.per_rank % self.micro:
            raise UserError(
                f"{self.per_rank} samples per rank per step do not split into micro-batches "
                f"of {self.micro}"
            )

    @property
    def per_rank(self) -> int:
        return self.global_batch // self.world_size

    @property
    def micro(self) -> int:
        return self.micro_batch or self.per_rank

    @property
    def accumulation(self) -> int:
        return self.per_rank // self.micro

    def step(self, step: int) -> list[np.ndarray]:
        """The micro-batches (global sample indices) this rank reads at `step`."""
        first = step * self.global_batch + self.rank * self.per_rank
        mine = np.arange(first, first + self.per_rank, dtype=np.int64)
        return [mine[i : i + self.micro] for i in range(0, self.per_rank, self.micro)]

    def step_at(self, consumed: int) -> int:
        if consumed % self.global_batch:
            raise UserError(
                f"resuming at {consumed} samples, which is not a whole number of global batches "
                f"of {self.global_batch}; resume with the global batch the run was saved with"
            )
        return consumed // self.global_batch


def state(consumed: int, plan: BatchPlan, seed: int) -> dict[str, Any]:
    """The data position as plain numbers (what checkpoints store)."""
    return {"consumed": int(consumed), "global_batch": plan.global_batch, "seed": int(seed)}
