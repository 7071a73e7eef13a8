"""Packed rows: an item's options that share their context are scored after one copy of it,
and every score equals the one the option's own row gives, whatever the batching, the row
limit or the data ranks; options with other contexts, empty answers and rolling windows too."""

from __future__ import annotations

import pytest
import torch

from llmtrain.core_mesh.interfaces import TaskItem
from llmtrain.downstream.packing import packed_batch, packed_rows
from llmtrain.downstream.requests import Request, option_requests, rolling_requests
from llmtrain.downstream.scoring import (
    Batching,
    PackedRunner,
    layout_runner,
    module_runner,
    row_scores,
    score,
)

MAX_LEN = 48

ITEMS = [
    # four options after one context (HellaSwag's shape)
    TaskItem(("A man is washing a car. He",), (" rinses it.", " eats it", " sings", " runs off.")),
    TaskItem(("Q: 2+2?\nA:",), ("4", "22", "four")),
    # two contexts, one answer (Winogrande's shape): rows of their own
    TaskItem(
        ("The cup fell off the table because the", "The table held the cup because the"), ("x",)
    ),
    # a context longer than MAX_LEN: cut from the left, each option's row its own
    TaskItem(("".join(chr(97 + k % 26) for k in range(70)),), ("end", "stop")),
    # an empty choice encodes to nothing: it scores 0 and predicts nothing
    TaskItem(("Say",), ("", " something"), delimiter=""),
]


def row_runner(model):
    """Scores one row per request: the reference the packed rows must equal."""

    @torch.no_grad()
    def run(tokens, targets):
        return row_scores(model(tokens), targets)

    return run


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model(seed=21)


@pytest.fixture(scope="module")
def requests(byte_tokenizer):
    return option_requests(ITEMS, byte_tokenizer, MAX_LEN)


def test_module_runner_packs_for_llmtrain_transformers(model):
    assert isinstance(module_runner(model), PackedRunner)

    class Plain(torch.nn.Module):
        def forward(self, tokens):
            return tokens

    assert not isinstance(module_runner(Plain()), PackedRunner)

    class Undeclared(torch.nn.Module):
        # takes the keywords but does not declare them: the contract is declared, not inspected
        def forward(self, tokens, positions=None, attention_mask=None, logits_at=None):
            return tokens

    assert not isinstance(module_runner(Undeclared()), PackedRunner)


class Laid:
    """A one-process stand-in for a model laid out over the mesh: `evaluate` runs its one
    part with the further inputs and hands the logits to the loss function."""

    def __init__(self, model, tp=1):
        self.parts, self.tp = [model], tp

    def size(self, dim):
        return self.tp if dim == "tp" else 1

    def evaluate(self, tokens, targets, loss_fn, *, inputs=None):
        return loss_fn(self.parts[0](tokens, **(inputs or {})), targets)


def test_a_layout_that_splits_nothing_packs_through_its_evaluate(model, requests):
    runner = layout_runner(Laid(model))
    assert isinstance(runner, PackedRunner)
    reference = score(requests, row_runner(model), Batching(rows=4), "cpu")
    packed = score(requests, runner, Batching(rows=3), "cpu", max_len=MAX_LEN)
    assert [s.loglikelihood for s in packed] == pytest.approx(
        [s.loglikelihood for s in reference], rel=1e-5, abs=1e-5
    )
    # a tensor-parallel layout scores one row per request, through the layout's loss function
    assert not isinstance(layout_runner(Laid(model, tp=2)), PackedRunner)


@pytest.mark.parametrize(
    ("batching", "max_len"),
    [
        (Batching(rows=1), None),
        (Batching(rows=3), MAX_LEN),
        (Batching(rows=16), 20),  # a row limit that splits the four options over rows
        (Batching(rows=2, length=64), 64),
        (Batching(rows=4, multiple=8), MAX_LEN),
    ],
    ids=str,
)
def test_packed_scores_equal_one_row_per_request(model, requests, batching, max_len):
    reference = score(requests, row_runner(model), Batching(rows=4), "cpu")
    packed = score(requests, module_runner(model), batching, "cpu", max_len=max_len)
    assert [(s.tokens, s.greedy) for s in packed] == [(s.tokens, s.greedy) for s in reference]
    got = [s.loglikelihood for s in packed]
    assert got == pytest.approx([s.loglikelihood for s in reference], rel=1e-5, abs=1e-5)
    empty = next(i for i, r in enumerate(requests) if r.scored == 0)
    assert packed[empty].loglikelihood == 0.0 and packed[empty].tokens == 0


def test_rolling_windows_score_as_their_own_rows(model, byte_tokenizer):
    docs = [TaskItem(("",), (" ".join(f"w{k}" for k in range(40)),), delimiter="")]
    windows = rolling_requests(docs, byte_tokenizer, MAX_LEN)
    assert len(windows) == 4
    reference = score(windows, row_runner(model), Batching(rows=2), "cpu")
    packed = score(windows, module_runner(model), Batching(rows=2), "cpu", max_len=MAX_LEN)
    assert [s.loglikelihood for s in packed] == pytest.approx(
        [s.loglikelihood for s in reference], rel=1e-5, abs=1e-5
    )


def test_rows_group_shared_contexts_and_respect_the_limit(requests):
    everything = range(len(requests))
    first = [r for r in requests if r.item == 0]
    packed_length = len(first[0].tokens) - first[0].scored + sum(r.scored - 1 for r in first)
    rows = packed_rows(requests, everything, packed_length)
    # items 0, 1 and 4 share a context each; item 2's two contexts and item 3's two cut
    # contexts make rows of their own: 1 + 1 + 2 + 2 + 1 rows
    assert sorted(len(r.requests) for r in rows) == [1, 1, 1, 1, 2, 3, 4]
    # a token fewer: item 0's last option goes to a second row, with the context again
    fewer = packed_rows(requests, everything, packed_length - 1)
    assert sorted(len(r.requests) for r in fewer) == [1, 1, 1, 1, 1, 2, 3, 3]
    assert sorted(i for r in rows for i in r.requests) == list(everything)
    four = next(r for r in rows if len(r.requests) == 4)
    context = requests[four.requests[0]].tokens[: -requests[four.requests[0]].scored]
    assert four.tokens[: len(context)] == context
    answers = [requests[i].tokens[len(context) :] for i in four.requests]
    assert len(four.tokens) == len(context) + sum(len(a) - 1 for a in answers)
    # each answer's tokens sit at the positions they have right after the context
    start = len(context)
    for answer in answers:
        end = start + len(answer) - 1
        assert four.tokens[start:end] == answer[:-1]
        assert four.positions[start:end] == tuple(
            range(len(context), len(context) + len(answer) - 1)
        )
        start = end
    for limit in (20, 30):
        for row in packed_rows(requests, everything, limit):
            alone = max(len(requests[i].tokens) - 1 for i in row.requests)
            assert len(row.tokens) <= max(limit, alone)


def test_the_mask_keeps_continuations_apart():
    shared = Request(0, 0, (5, 6, 7, 1, 2), scored=2)
    other = Request(0, 1, (5, 6, 7, 3, 4, 9), scored=3)
    (row,) = packed_rows([shared, other], [0, 1], 16)
    assert row.tokens == (5, 6, 7, 1, 3, 4)
    assert row.positions == (0, 1, 2, 3, 3, 4)
    batch = packed_batch([row], 2, 8, "cpu")
    mask = batch.attention_mask[0].int().tolist()
    assert mask[:6] == [
        [1, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0, 0],  # the first answer's token: the context and itself
        [1, 1, 1, 0, 1, 0, 0, 0],  # the second's: the context and its own, not the first's
        [1, 1, 1, 0, 1, 1, 0, 0],
    ]
    assert mask[6] == [1, 1, 1, 0, 0, 0, 1, 0]  # padding sees the context, never empty
    # the context's last token predicts both answers' first tokens
    assert batch.at[0].nonzero()[:, 0].tolist() == [2, 3, 4, 5]
    assert batch.gather.tolist() == [0, 1, 0, 2, 3]
    assert batch.targets.tolist() == [1, 2, 3, 4, 9]
    assert batch.owner.tolist() == [0, 0, 1, 1, 1]
    assert bool(batch.attention_mask[1].diagonal().all())  # a padding row sees itself
