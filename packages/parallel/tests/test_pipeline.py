"""Pipeline parallelism without processes: cutting blocks into stages, placing stages on ranks,
trimming a model into stage modules."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from llmtrain.parallel.options import PIPELINE_SCHEDULES, SINGLE_STAGE_SCHEDULES, V_SCHEDULES
from llmtrain.parallel.pipeline import build_stage_modules, split_blocks, stages_of_rank


def stage_cost(stage: int, n_stages: int, blocks: int, first: float, last: float) -> float:
    extra = (first if stage == 0 else 0.0) + (last if stage == n_stages - 1 else 0.0)
    return blocks + extra


def brute_force_best(n_blocks: int, n_stages: int, first: float, last: float) -> float:
    """The smallest possible largest stage cost, over every way to cut the blocks."""
    best = float("inf")
    for cuts in itertools.combinations(range(1, n_blocks), n_stages - 1):
        bounds = (0, *cuts, n_blocks)
        worst = max(
            stage_cost(s, n_stages, bounds[s + 1] - bounds[s], first, last) for s in range(n_stages)
        )
        best = min(best, worst)
    return best


def assert_partition(ranges: list[range], n_blocks: int, n_stages: int) -> None:
    assert len(ranges) == n_stages
    assert all(isinstance(r, range) and r.step == 1 and len(r) > 0 for r in ranges)
    assert ranges[0].start == 0 and ranges[-1].stop == n_blocks
    for a, b in itertools.pairwise(ranges):
        assert a.stop == b.start  # contiguous and in order
    assert [i for r in ranges for i in r] == list(range(n_blocks))  # each block exactly once


@settings(max_examples=300, deadline=None)
@given(
    n_blocks=st.integers(1, 10),
    data=st.data(),
    first=st.sampled_from([0.0, 0.5, 1.0, 1.5, 2.0, 3.0]),
    last=st.sampled_from([0.0, 0.5, 1.0, 2.5, 4.0]),
)
def test_split_blocks_covers_every_block_once_with_the_smallest_largest_stage(
    n_blocks, data, first, last
):
    n_stages = data.draw(st.integers(1, n_blocks), label="n_stages")
    ranges = split_blocks(n_blocks, n_stages, first, last)
    assert_partition(ranges, n_blocks, n_stages)
    worst = max(stage_cost(s, n_stages, len(r), first, last) for s, r in enumerate(ranges))
    assert worst == pytest.approx(brute_force_best(n_blocks, n_stages, first, last))


def test_split_blocks_exhaustive_for_small_models_with_default_weights():
    for n_blocks in range(1, 9):
        for n_stages in range(1, n_blocks + 1):
            ranges = split_blocks(n_blocks, n_stages)
            assert_partition(ranges, n_blocks, n_stages)
            worst = max(stage_cost(s, n_stages, len(r), 1, 1) for s, r in enumerate(ranges))
            assert worst == brute_force_best(n_blocks, n_stages, 1, 1), (n_blocks, n_stages)


def test_split_blocks_examples():
    # without extra weights: balanced, the spare block on an earlier stage
    assert split_blocks(8, 4, 0, 0) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert split_blocks(5, 2, 0, 0) == [range(0, 3), range(3, 5)]
    # the embedding weighs 2 blocks and the head 1: the first stage gets one block, and ties
    # leave the spare ones on the earlier stages (costs 3, 3, 3, 2)
    heavy_first = split_blocks(8, 4, first_weight=2.0, last_weight=1.0)
    assert [len(r) for r in heavy_first] == [1, 3, 3, 1]
    # a heavy head pushes blocks off the last stage
    heavy_last = split_blocks(8, 4, first_weight=0.0, last_weight=2.0)
    assert len(heavy_last[-1]) == 1 and sum(map(len, heavy_last)) == 8
    # one stage holds everything
    assert split_blocks(3, 1, 5.0, 5.0) == [range(0, 3)]
    # as many stages as blocks: one each, whatever the weights
    assert split_blocks(4, 4, 9.0, 9.0) == [range(i, i + 1) for i in range(4)]


def test_weights_move_blocks_away_from_the_end_stages():
    plain = split_blocks(12, 4, 0.0, 0.0)
    weighted = split_blocks(12, 4, 2.0, 2.0)
    assert [len(r) for r in plain] == [3, 3, 3, 3]
    assert len(weighted[0]) < 3 and len(weighted[-1]) < 3
    assert len(weighted[1]) > 3 or len(weighted[2]) > 3


@pytest.mark.parametrize(("n_blocks", "n_stages"), [(3, 4), (4, 0), (0, 1), (2, -1)])
def test_split_blocks_rejects_impossible_splits(n_blocks, n_stages):
    with pytest.raises(ValueError, match=f"cannot split {n_blocks} blocks into {n_stages}"):
        split_blocks(n_blocks, n_stages)


@pytest.mark.parametrize("schedule", [s for s in PIPELINE_SCHEDULES if s not in V_SCHEDULES])
@pytest.mark.parametrize("pp", [1, 2, 3, 4])
def test_loop_placement(schedule, pp):
    per_rank = 1 if schedule in SINGLE_STAGE_SCHEDULES else 3
    placement = {r: stages_of_rank(r, pp, per_rank, schedule) for r in range(pp)}
    for rank, stages in placement.items():
        assert stages == [rank + pp * i for i in range(per_rank)]
        assert all(s % pp == rank for s in stages)
    owned = sorted(s for stages in placement.values() for s in stages)
    assert owned == list(range(pp * per_rank))  # every stage on exactly one rank


def test_loop_placement_examples():
    assert stages_of_rank(0, 4, 2, "Interleaved1F1B") == [0, 4]
    assert stages_of_rank(3, 4, 2, "Interleaved1F1B") == [3, 7]
    assert stages_of_rank(1, 2, 1, "1F1B") == [1]


@pytest.mark.parametrize("schedule", V_SCHEDULES)
@pytest.mark.parametrize("pp", [1, 2, 3, 4, 8])
def test_v_placement(schedule, pp):
    placement = {r: stages_of_rank(r, pp, 2, schedule) for r in range(pp)}
    for rank, stages in placement.items():
        assert stages == [rank, 2 * pp - 1 - rank]
    owned = sorted(s for stages in placement.values() for s in stages)
    assert owned == list(range(2 * pp))
    # the V keeps the first and the last stage on rank 0, and the middle two on the last rank
    assert placement[0] == [0, 2 * pp - 1]
    assert placement[pp - 1] == [pp - 1, pp]


def test_build_stage_modules_trims_copies_that_chain_to_the_whole_model(make_toy, toy_batch):
    model = make_toy(n_layers=4)
    reference = copy.deepcopy(model)
    ranges = split_blocks(4, 3)
    seen = []

    def trim(module, block_ids, first, last):
        seen.append((list(block_ids), first, last))
        type(module).trim_to_stage(module, block_ids, first, last)

    parts = build_stage_modules(model, trim, [0, 1, 2], ranges)
    assert seen == [
        (list(ranges[0]), True, False),
        (list(ranges[1]), False, False),
        (list(ranges[2]), False, True),
    ]
    assert parts[-1] is model  # the last stage reuses the module; earlier ones are copies
    assert parts[0] is not model and parts[1] is not model
    for part, blocks in zip(parts, ranges, strict=True):
        assert list(part.blocks) == [str(i) for i in blocks]
    assert parts[0].tok_emb is not None and parts[0].head is None
    assert parts[1].tok_emb is None and parts[1].norm is None
    assert parts[2].tok_emb is None and parts[2].head is not None
    # the stage state dicts are disjoint and together the whole model's
    keys = [set(p.state_dict()) for p in parts]
    assert set.union(*keys) == set(reference.state_dict())
    assert sum(map(len, keys)) == len(reference.state_dict())

    tokens, _ = toy_batch(2, 8)
    h = tokens
    for part in parts:
        h = part(h)
    torch.testing.assert_close(h, reference(tokens))


def test_build_stage_modules_for_a_v_rank(make_toy):
    model = make_toy(n_layers=4)
    ranges = split_blocks(4, 4)
    # rank 0 of a 2-rank V holds stages 0 and 3: the embedding and the head
    parts = build_stage_modules(model, type(model).trim_to_stage, [0, 3], ranges)
    assert [list(p.blocks) for p in parts] == [["0"], ["3"]]
    assert parts[0].tok_emb is not None and parts[0].head is None
    assert parts[1].tok_emb is None and parts[1].head is not None
