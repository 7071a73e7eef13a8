"""The sampler: chunk-aware epoch orders, exact mixtures, batch plans over ranks, exact resume."""

from __future__ import annotations

import itertools
import tracemalloc
from fractions import Fraction

import numpy as np
import pytest

from llmtrain.core_mesh.errors import UserError
from llmtrain.data_pack.sampling import (
    BatchPlan,
    EpochOrder,
    Mixture,
    MixtureSchedule,
    Phase,
    Sampler,
    SourceShape,
    state,
)


def rd_expected_counts(weights: list[float], n: int) -> list[int]:
    """floor(C[d+1]*n) - floor(C[d]*n), C the cumulative normalised weights (exact fractions)."""
    exact = [Fraction(str(w)) for w in weights]
    total = sum(exact)
    cumulative = [sum(exact[:d], Fraction(0)) / total for d in range(len(exact) + 1)]
    floors = [c.numerator * n // c.denominator for c in cumulative]
    return [b - a for a, b in itertools.pairwise(floors)]


def rd_blocks_of(windows: np.ndarray, block: int) -> set[int]:
    return set((windows // block).tolist())


# -- EpochOrder ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "block", "pool"), [(1, 1, 1), (7, 3, 2), (100, 1, 8), (1000, 64, 8), (1003, 16, 3)]
)
def test_epoch_order_is_a_permutation_in_every_epoch(n, block, pool):
    order = EpochOrder(n, block_windows=block, pool_blocks=pool, seed=11)
    windows = order.windows(np.arange(4 * n))
    epochs = windows.reshape(4, n)
    for epoch in epochs:
        np.testing.assert_array_equal(np.sort(epoch), np.arange(n))
    if n >= 100:
        assert len({tuple(e) for e in epochs.tolist()}) == 4  # each epoch its own order
    # the same (seed, epoch) gives the same order in a fresh instance, queried per epoch
    fresh = EpochOrder(n, block_windows=block, pool_blocks=pool, seed=11)
    for epoch in (3, 0, 2, 1):
        np.testing.assert_array_equal(
            fresh.windows(np.arange(epoch * n, (epoch + 1) * n)), epochs[epoch]
        )


def test_epoch_order_depends_on_seed_and_source():
    def first_epoch(**key):
        return EpochOrder(500, block_windows=10, pool_blocks=4, **key).windows(np.arange(500))

    base = first_epoch(seed=1, source=0)
    np.testing.assert_array_equal(base, first_epoch(seed=1, source=0))
    assert not np.array_equal(base, first_epoch(seed=2, source=0))
    assert not np.array_equal(base, first_epoch(seed=1, source=1))
    assert not np.array_equal(base, np.arange(500))


def test_unshuffled_order_is_the_stored_order():
    order = EpochOrder(37, block_windows=4, pool_blocks=2, seed=5, shuffle=False)
    np.testing.assert_array_equal(order.windows(np.arange(200)), np.arange(200) % 37)
    np.testing.assert_array_equal(order.windows([80, 3, 36, 37]), [6, 3, 36, 0])


@pytest.mark.parametrize(("n_blocks", "block", "pool"), [(100, 16, 8), (45, 7, 4), (10, 1, 3)])
def test_aligned_spans_of_a_pool_are_whole_blocks(n_blocks, block, pool):
    """With whole blocks, positions [j*P*B, (j+1)*P*B) are exactly the windows of <= P blocks."""
    n = n_blocks * block
    windows = EpochOrder(n, block_windows=block, pool_blocks=pool, seed=3).windows(np.arange(n))
    span = pool * block
    for begin in range(0, n, span):
        part = windows[begin : begin + span]
        blocks = rd_blocks_of(part, block)
        assert len(blocks) == min(pool, -(-(n - begin) // block))
        expected = np.concatenate([np.arange(b * block, (b + 1) * block) for b in sorted(blocks)])
        np.testing.assert_array_equal(np.sort(part), expected)


def rd_runs(windows: np.ndarray, block: int, n: int) -> list[set[int]]:
    """Cut an order of distinct windows into minimal runs that hold whole blocks; the blocks of
    each run (the last run may be unfinished)."""
    runs: list[set[int]] = []
    blocks: set[int] = set()
    needed = count = 0
    for window in windows.tolist():
        b = window // block
        if b not in blocks:
            blocks.add(b)
            needed += min((b + 1) * block, n) - b * block
        count += 1
        if count == needed:
            runs.append(blocks)
            blocks, needed, count = set(), 0, 0
    if blocks:
        runs.append(blocks)
    return runs


@pytest.mark.parametrize(
    ("n", "block", "pool"), [(1000, 16, 8), (1003, 16, 4), (999, 10, 1), (5000, 7, 3)]
)
def test_each_epoch_is_a_sequence_of_pools_of_whole_blocks(n, block, pool):
    """Chunk-aware: an epoch is a run of shuffled pools, each holding at most P whole blocks."""
    order = EpochOrder(n, block_windows=block, pool_blocks=pool, seed=9)
    n_blocks = -(-n // block)
    for epoch in (0, 1):
        windows = order.windows(np.arange(epoch * n, (epoch + 1) * n))
        runs = rd_runs(windows, block, n)
        assert max(len(r) for r in runs) <= pool
        assert len(runs) >= -(-n_blocks // pool)
        assert sorted(b for r in runs for b in r) == list(range(n_blocks))
        if pool == 1:  # one block at a time, in shuffled block order, shuffled inside
            assert [len(r) for r in runs] == [1] * n_blocks
            assert [next(iter(r)) for r in runs] != list(range(n_blocks))


def test_order_is_well_mixed():
    n, block, pool = 200_000, 64, 8
    windows = EpochOrder(n, block_windows=block, pool_blocks=pool, seed=0).windows(np.arange(n))
    positions = np.arange(n)
    # Spearman's rho of a permutation against its positions: ranks are the values themselves
    rho = np.corrcoef(positions, windows)[0, 1]
    assert abs(rho) < 0.08
    steps = np.diff(windows)
    assert np.mean(steps == 1) < 0.02  # windows are shuffled inside the pool, not just blocks
    assert 0.45 < np.mean(steps > 0) < 0.55
    # the first and second half of an epoch cover the dataset evenly
    assert abs(np.mean(windows[: n // 2]) - (n - 1) / 2) < 0.05 * n


def test_huge_source_answers_without_linear_memory():
    n = 10**9
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        order = EpochOrder(n, block_windows=1024, pool_blocks=8, seed=4)
        positions = np.array([n - 1, n - 2, n - 5000, 0, 2 * n - 1, n + 12345])
        windows = order.windows(positions)
        retained, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert ((windows >= 0) & (windows < n)).all()
    n_blocks = -(-n // 1024)
    # O(blocks + pool): a few int64 arrays of n_blocks entries, never n (8 GB)
    assert peak - before < 12 * 8 * n_blocks
    assert retained - before < 6 * 8 * n_blocks + 16 * 8 * 1024 * 8
    # the same answers one at a time, from a fresh instance
    again = EpochOrder(n, block_windows=1024, pool_blocks=8, seed=4)
    for position, window in zip(positions, windows, strict=True):
        assert again.windows([position])[0] == window
    # the end of the epoch is still whole pools of at most 8 blocks, read backwards from the end
    tail = again.windows(np.arange(n - 1, n - 20 * 1024, -1))
    runs = rd_runs(tail, 1024, n)
    assert len(runs) >= 2 and max(len(r) for r in runs) <= 8


# -- Mixture ---------------------------------------------------------------------------------------

WEIGHT_SETS = [[0.7, 0.3], [1, 1, 1], [0.5, 0, 0.5], [0.2, 0.3, 0.5], [3, 1], [0.001, 1], [1]]


@pytest.mark.parametrize("weights", WEIGHT_SETS)
def test_mixture_counts_follow_the_weights_within_one_sample(weights):
    mixture = Mixture(weights)
    total = sum(Fraction(str(w)) for w in weights)
    for n in [*range(0, 3000), 10**6 + 7, 10**12 + 3, 2**61 - 1]:
        counts = mixture.counts(n)
        assert sum(counts) == n
        assert counts == rd_expected_counts(weights, n)
        for count, w in zip(counts, weights, strict=True):
            assert abs(count - Fraction(str(w)) / total * n) < 1
            if w == 0:
                assert count == 0


def test_mixture_keeps_a_small_positive_weight():
    """A weight of 2e-6 of the total is neither rounded away nor starved: at block boundaries its
    count is exact, and the block grows so that it is sampled in every block."""
    weights = [2e-6, 1]
    mixture = Mixture(weights)
    share = Fraction(str(weights[0])) / sum(Fraction(str(w)) for w in weights)
    assert mixture.block * share >= 1
    n = 3 * mixture.block
    counts = mixture.counts(n)
    assert abs(counts[0] - share * n) < 1
    sources, _ = mixture.assign(np.arange(n))
    assert np.bincount(sources, minlength=2).tolist() == counts
    for k in range(3):  # at least one sample of the small source in every block
        block = sources[k * mixture.block : (k + 1) * mixture.block]
        assert (block == 0).sum() >= 1


def test_mixture_refuses_a_weight_too_small_to_sample():
    with pytest.raises(UserError, match=r"below 1e-06.*raise its weight or leave it out"):
        Mixture([1e-7, 1])


def test_mixture_rejects_bad_weights():
    for weights in ([], [-1, 2], [0, 0], [0.0]):
        with pytest.raises(UserError, match=r"must be >= 0 with a positive sum"):
            Mixture(weights)


@pytest.mark.parametrize("weights", [[0.7, 0.3], [1, 1, 1], [0.5, 0, 0.5]])
@pytest.mark.parametrize("block", [64, 4096])
def test_mixture_local_indices_count_up_without_gaps(weights, block):
    mixture = Mixture(weights, seed=2, block=block)
    n = 3 * block + 17
    sources, local = mixture.assign(np.arange(n))
    assert set(sources.tolist()) <= {d for d, w in enumerate(weights) if w > 0}
    for d in range(len(weights)):
        np.testing.assert_array_equal(
            local[sources == d], np.arange(np.count_nonzero(sources == d))
        )
    for whole in range(block, n, block):  # at every block boundary the counts are exact
        assert np.bincount(sources[:whole], minlength=len(weights)).tolist() == mixture.counts(
            whole
        )


def test_mixture_is_exact_at_every_block_boundary_and_close_inside():
    """The documented contract: at every multiple n of the block, source d has had exactly
    counts(n)[d] samples (local indices 0..counts(n)[d]-1, in order); inside a block the counts
    differ from counts(n) by no more than the block's own shuffle allows."""
    for weights in ([0.7, 0.3], [1, 1, 1], [0.5, 0, 0.5]):
        mixture = Mixture(weights, seed=0)
        n = 3 * mixture.block + 100
        sources, local = mixture.assign(np.arange(n))
        seen = np.zeros(len(weights), dtype=np.int64)
        for i, source in enumerate(sources.tolist()):
            assert local[i] == seen[source]
            seen[source] += 1
            if (i + 1) % mixture.block == 0:
                assert seen.tolist() == mixture.counts(i + 1)
            else:
                assert np.abs(seen - np.array(mixture.counts(i + 1))).max() <= mixture.block
        # and the shuffle inside a block is not just "all of source 0 first"
        first = sources[: mixture.block]
        if len(set(first.tolist())) > 1:
            assert (np.diff(first) != 0).sum() > len(weights)


def test_mixture_is_deterministic_however_it_is_queried():
    weights = [0.2, 0.5, 0.3]
    n = 3 * 4096 + 501
    whole = Mixture(weights, seed=8).assign(np.arange(n))
    pieces = Mixture(weights, seed=8)
    small = [pieces.assign(np.arange(i, min(i + 97, n))) for i in range(0, n, 97)]
    np.testing.assert_array_equal(np.concatenate([s for s, _ in small]), whole[0])
    np.testing.assert_array_equal(np.concatenate([loc for _, loc in small]), whole[1])
    shuffled = np.random.default_rng(0).permutation(n)
    sources, local = Mixture(weights, seed=8).assign(shuffled)
    np.testing.assert_array_equal(sources, whole[0][shuffled])
    np.testing.assert_array_equal(local, whole[1][shuffled])
    other = Mixture(weights, seed=9).assign(np.arange(n))
    assert not np.array_equal(other[0], whole[0])
    assert np.bincount(other[0][:4096]).tolist() == np.bincount(whole[0][:4096]).tolist()


# -- Sampler ---------------------------------------------------------------------------------------


def test_single_source_sampler_is_its_epoch_order():
    sampler = Sampler([SourceShape(123, 10)], seed=6, pool_blocks=3)
    samples = np.arange(500)
    sources, windows = sampler.lookup(samples)
    assert (sources == 0).all()
    expected = EpochOrder(123, block_windows=10, pool_blocks=3, seed=6, source=0)
    np.testing.assert_array_equal(windows, expected.windows(samples))
    assert sampler.mixture is None
    plain = Sampler([SourceShape(123, 10)], shuffle=False)
    np.testing.assert_array_equal(plain.lookup(samples)[1], samples % 123)


def test_mixture_sampler_maps_each_sample_through_its_source_order():
    shapes = [SourceShape(50, 4), SourceShape(300, 16), SourceShape(7, 1)]
    weights = [0.25, 0.5, 0.25]
    sampler = Sampler(shapes, weights=weights, seed=12, pool_blocks=2)
    samples = np.arange(9000)
    sources, windows = sampler.lookup(samples)
    labels, local = Mixture(weights, seed=12).assign(samples)
    np.testing.assert_array_equal(sources, labels)
    for d, shape in enumerate(shapes):
        order = EpochOrder(
            shape.n_windows, block_windows=shape.block_windows, pool_blocks=2, seed=12, source=d
        )
        np.testing.assert_array_equal(windows[sources == d], order.windows(local[sources == d]))
        assert ((windows[sources == d] >= 0) & (windows[sources == d] < shape.n_windows)).all()
    # the same in a fresh sampler, asked in reverse
    again = Sampler(shapes, weights=weights, seed=12, pool_blocks=2)
    back = again.lookup(samples[::-1])
    np.testing.assert_array_equal(back[0], sources[::-1])
    np.testing.assert_array_equal(back[1], windows[::-1])


def test_sampler_equal_weights_by_default_and_errors():
    shapes = [SourceShape(10, 2), SourceShape(20, 2)]
    sampler = Sampler(shapes, seed=1)
    assert sampler.mixture.counts(8192) == [4096, 4096]
    np.testing.assert_array_equal(
        sampler.lookup(np.arange(8192))[0], Mixture([1, 1], seed=1).assign(np.arange(8192))[0]
    )
    with pytest.raises(UserError, match="3 mixture weights for 2 datasets"):
        Sampler(shapes, weights=[1, 1, 1])
    with pytest.raises(UserError, match="no data sources"):
        Sampler([])


def test_epochs_at():
    single = Sampler([SourceShape(40, 4)])
    assert single.epochs_at(0) == [0.0]
    assert single.epochs_at(100) == [2.5]
    shapes = [SourceShape(40, 4), SourceShape(25, 5), SourceShape(10, 1)]
    weights = [0.7, 0.3, 0]
    mixed = Sampler(shapes, weights=weights)
    for samples in (0, 1, 99, 1000, 123457):
        counts = rd_expected_counts(weights, samples)
        assert mixed.epochs_at(samples) == [
            c / s.n_windows for c, s in zip(counts, shapes, strict=True)
        ]
    assert mixed.epochs_at(1000) == [700 / 40, 300 / 25, 0.0]


# -- BatchPlan and resume --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("global_batch", "world", "micro"),
    [(8, 1, None), (8, 2, None), (8, 4, 1), (12, 3, 2), (16, 2, 4)],
)
def test_batch_plan_splits_each_step_over_ranks(global_batch, world, micro):
    plans = [BatchPlan(global_batch, world, rank, micro) for rank in range(world)]
    per_rank = global_batch // world
    for step in (0, 1, 5, 1000):
        shares = []
        for plan in plans:
            micros = plan.step(step)
            assert plan.per_rank == per_rank
            assert plan.micro == (micro or per_rank)
            assert len(micros) == plan.accumulation == per_rank // plan.micro
            assert all(len(m) == plan.micro and m.dtype == np.int64 for m in micros)
            shares.append(np.concatenate(micros))
        together = np.concatenate(shares)
        assert len(set(together.tolist())) == global_batch  # ranks never share a sample
        np.testing.assert_array_equal(
            together, np.arange(step * global_batch, (step + 1) * global_batch)
        )
        for plan in plans:
            assert plan.step_at(step * global_batch) == step


def test_batch_plan_errors_say_what_to_do():
    with pytest.raises(UserError, match=r"global batch of 10 samples does not divide over 4"):
        BatchPlan(10, 4)
    with pytest.raises(
        UserError, match=r"6 samples per rank per step do not split into micro-batches of 4"
    ):
        BatchPlan(12, 2, 0, 4)
    with pytest.raises(
        UserError, match=r"4 samples per rank per step do not split into micro-batches of 8"
    ):
        BatchPlan(8, 2, 1, 8)
    with pytest.raises(UserError, match=r"rank 2 is outside 0\.\.1"):
        BatchPlan(8, 2, 2)
    with pytest.raises(UserError, match=r"rank -1 is outside 0\.\.1"):
        BatchPlan(8, 2, -1)
    for bad in ((0, 1), (8, 0), (-8, 1)):
        with pytest.raises(UserError, match="must be positive"):
            BatchPlan(*bad)
    with pytest.raises(UserError, match=r"resuming at 20 samples.*global batches of 8"):
        BatchPlan(8).step_at(20)


def test_batch_plan_refuses_a_negative_micro_batch():
    with pytest.raises(UserError):
        BatchPlan(8, 1, 0, -2)


def test_state_is_plain_numbers():
    assert state(np.int64(64), BatchPlan(16, 2, 1), 3) == {
        "consumed": 64,
        "global_batch": 16,
        "seed": 3,
    }
    assert type(state(np.int64(64), BatchPlan(16), np.int64(3))["consumed"]) is int


RD_SHAPES = [SourceShape(37, 5), SourceShape(50, 8)]


def rd_run(world: int, start_step: int, stop_step: int, micro: int | None = 2) -> list[list]:
    """(source, window) of each step's global batch, ranks in order, from a fresh sampler."""
    sampler = Sampler(RD_SHAPES, weights=[0.6, 0.4], seed=21, pool_blocks=2)
    plans = [BatchPlan(8, world, rank, micro) for rank in range(world)]
    steps = []
    for step in range(start_step, stop_step):
        pairs = []
        for plan in plans:
            for samples in plan.step(step):
                sources, windows = sampler.lookup(samples)
                pairs.extend(zip(sources.tolist(), windows.tolist(), strict=True))
        steps.append(pairs)
    return steps


def test_every_world_size_reads_the_same_samples_at_every_step():
    reference = rd_run(1, 0, 40)
    assert sum(len(s) for s in reference) == 320  # several epochs of both sources
    assert {p[0] for s in reference for p in s} == {0, 1}
    for world in (2, 4):
        assert rd_run(world, 0, 40) == reference
        assert rd_run(world, 0, 40, micro=1) == reference


@pytest.mark.parametrize("saved_world", [1, 2, 4])
@pytest.mark.parametrize("resumed_world", [1, 2, 4])
def test_resume_from_consumed_continues_the_uninterrupted_run(saved_world, resumed_world):
    uninterrupted = rd_run(saved_world, 0, 30)
    for stopped in (0, 1, 7, 13, 29):
        consumed = stopped * 8
        plan = BatchPlan(8, resumed_world, resumed_world - 1, 2)
        start = plan.step_at(state(consumed, plan, 21)["consumed"])
        assert start == stopped
        assert rd_run(resumed_world, start, 30) == uninterrupted[stopped:]


def test_mixture_schedule_phases_mix_their_own_weights_and_sources_read_on():
    """Each phase is exact to its own weights, and a source's stream positions go on across a
    boundary: every source reads positions 0, 1, 2, ... once each over the whole schedule."""
    phases = [Phase((0.8, 0.2, 0.0), end=12_000), Phase((0.1, 0.3, 0.6))]
    schedule = MixtureSchedule(phases, seed=4)
    n = 30_000
    sources, local = schedule.assign(np.arange(n))
    first = Mixture((0.8, 0.2, 0.0), seed=4).assign(np.arange(12_000))
    np.testing.assert_array_equal(sources[:12_000], first[0])  # phase 0: as without phases
    np.testing.assert_array_equal(local[:12_000], first[1])
    # inside each phase: exact at its own block boundaries
    assert np.bincount(sources[:8192], minlength=3).tolist() == Mixture((0.8, 0.2, 0)).counts(8192)
    second = sources[12_000 : 12_000 + 8192]
    assert np.bincount(second, minlength=3).tolist() == Mixture((0.1, 0.3, 0.6)).counts(8192)
    for d in range(3):
        mine = np.sort(local[sources == d])
        np.testing.assert_array_equal(mine, np.arange(len(mine)))  # no position twice, none skipped
    # counts agree with what assign gave, across the boundary
    for m in (12_000, 12_000 + 8192):
        assert schedule.counts(m) == np.bincount(sources[:m], minlength=3).tolist()
    # any subset, in any order, maps the same (what a resume at any step reads)
    picked = np.arange(n)[::-7][:500]
    again = MixtureSchedule(phases, seed=4).assign(picked)
    np.testing.assert_array_equal(again[0], sources[picked])
    np.testing.assert_array_equal(again[1], local[picked])


def test_mixture_schedule_boundary_inside_a_block_and_the_sampler():
    """A phase that ends inside a block of its mixture hands on the exact counts of its labels."""
    phases = [Phase((0.5, 0.5), end=1000), Phase((0.9, 0.1), end=5000), Phase((0.2, 0.8))]
    schedule = MixtureSchedule(phases, seed=1)
    sources, local = schedule.assign(np.arange(9000))
    for d in range(2):
        mine = np.sort(local[sources == d])
        np.testing.assert_array_equal(mine, np.arange(len(mine)))
    assert schedule.before[1] == np.bincount(sources[:1000], minlength=2).tolist()
    assert schedule.before[2] == np.bincount(sources[:5000], minlength=2).tolist()
    shapes = [SourceShape(70, 8), SourceShape(90, 8)]
    sampler = Sampler(shapes, phases=phases, seed=1, pool_blocks=2)
    got, windows = sampler.lookup(np.arange(9000))
    np.testing.assert_array_equal(got, sources)
    for d, shape in enumerate(shapes):
        order = EpochOrder(shape.n_windows, block_windows=8, pool_blocks=2, seed=1, source=d)
        np.testing.assert_array_equal(windows[got == d], order.windows(local[got == d]))
    epochs = sampler.epochs_at(5000)
    assert epochs == [c / s.n_windows for c, s in zip(schedule.counts(5000), shapes, strict=True)]


def test_mixture_schedule_refuses_bad_phases():
    with pytest.raises(UserError, match="needs its end"):
        MixtureSchedule([Phase((1, 1)), Phase((1, 2))])
    with pytest.raises(UserError, match="needs its end"):
        MixtureSchedule([Phase((1, 1), end=10), Phase((1, 2), end=20)])
    with pytest.raises(UserError, match="increasing order"):
        MixtureSchedule([Phase((1, 1), end=10), Phase((1, 1), end=10), Phase((1, 2))])
    with pytest.raises(UserError, match="different numbers"):
        MixtureSchedule([Phase((1, 1), end=10), Phase((1, 2, 3))])
    with pytest.raises(UserError, match="weights or mixture phases"):
        Sampler([SourceShape(5, 1)] * 2, weights=[1, 1], phases=[Phase((1, 1))])
    with pytest.raises(UserError, match="weights 3 of 2"):
        Sampler([SourceShape(5, 1)] * 2, phases=[Phase((1, 1, 1))])
