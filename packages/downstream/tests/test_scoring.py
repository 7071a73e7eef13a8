"""Scoring: every request's log-likelihood and greedy flag equal a plain forward of its row
alone, whatever the batching; the task metrics follow from them as lm-evaluation-harness
computes them; rows reach the runner once each, in batches, and come back in order."""

from __future__ import annotations

import math
import statistics
import threading

import pytest
import torch

from llmtrain.core_mesh.interfaces import TaskItem
from llmtrain.downstream import scoring
from llmtrain.downstream.evaluate import evaluate_task
from llmtrain.downstream.requests import Request, option_requests
from llmtrain.downstream.scoring import (
    IGNORE,
    Batching,
    DataSplit,
    module_runner,
    parallel_runner,
    row_scores,
    score,
)

MAX_LEN = 64
EOD = 256
BATCHINGS = [
    Batching(rows=1),
    Batching(rows=3),
    Batching(rows=64),
    Batching(rows=4, length=MAX_LEN),
    Batching(rows=5, multiple=8),
]
LONG = "".join(chr(ord("a") + (7 * k) % 26) for k in range(90))
CHOICE_ITEMS = [
    TaskItem(("Question: What colour is the sky?\nAnswer:",), ("blue", "green", "a dark red"), 0),
    TaskItem(("The cat sat on the", "The dog sat on the"), ("mat.",), 1),
    TaskItem(("",), ("hello", "world!"), 1),
    TaskItem((LONG,), ("x", "yz"), 0),  # cut from the left
    TaskItem(("Short",), ("é", "ab", "abc", "a longer choice"), 2),
    TaskItem(("Pick:",), ("café", "cafe"), 1),
]


def hand_row(context: str, continuation: str) -> tuple[list[int], int]:
    """The byte row of one option and how many of its tokens are scored, built from the text."""
    answer = list(continuation.encode())
    tokens = (list(context.encode()) if context else [EOD]) + answer
    tokens = tokens[-(MAX_LEN + 1) :]
    return tokens, min(len(answer), len(tokens) - 1)


def hand_choice_scores(model, by_hand, items):
    """Per item: each option's (log-likelihood, greedy, scored tokens) by a plain forward."""
    out = []
    for item in items:
        rows = [hand_row(item.context(o), " " + item.choice(o)) for o in range(item.n_options)]
        out.append([(*by_hand(model, tokens, scored), scored) for tokens, scored in rows])
    return out


def first_max(values):
    best = 0
    for i, v in enumerate(values):
        if v > values[best]:
            best = i
    return best


@pytest.mark.parametrize("batching", BATCHINGS, ids=str)
def test_loglikelihoods_equal_a_plain_forward(
    tiny_model, byte_tokenizer, by_hand, list_task, batching
):
    model = tiny_model(seed=3)
    expected = hand_choice_scores(model, by_hand, CHOICE_ITEMS)
    result = evaluate_task(
        list_task("multiple_choice", CHOICE_ITEMS),
        byte_tokenizer,
        module_runner(model),
        max_len=MAX_LEN,
        batching=batching,
        device="cpu",
    )
    assert len(result.items) == len(CHOICE_ITEMS)
    for item, want, got in zip(CHOICE_ITEMS, expected, result.items, strict=True):
        assert got["loglikelihoods"] == pytest.approx([w[0] for w in want], rel=1e-6, abs=1e-5)
        assert got["greedy"] == [w[1] for w in want]
        assert got["tokens"] == [w[2] for w in want]
        assert (got["gold"], got["where"]) == (item.gold, item.where)
    assert result.truncated == 1


def test_choice_metrics_by_hand(tiny_model, byte_tokenizer, by_hand, list_task):
    model = tiny_model(seed=5)
    expected = hand_choice_scores(model, by_hand, CHOICE_ITEMS)
    result = evaluate_task(
        list_task("multiple_choice", CHOICE_ITEMS),
        byte_tokenizer,
        module_runner(model),
        max_len=MAX_LEN,
        batching=Batching(rows=7),
        device="cpu",
    )
    columns: dict[str, list[float]] = {"acc": [], "acc_norm": [], "acc_norm_tokens": []}
    for item, want, got in zip(CHOICE_ITEMS, expected, result.items, strict=True):
        lls = [w[0] for w in want]
        chars = [len(item.choice(o)) for o in range(item.n_options)]
        tokens = [w[2] for w in want]
        picks = {
            "acc": first_max(lls),
            "acc_norm": first_max([ll / n for ll, n in zip(lls, chars, strict=True)]),
            "acc_norm_tokens": first_max([ll / n for ll, n in zip(lls, tokens, strict=True)]),
        }
        for name, pick in picks.items():
            assert got[name] == float(pick == item.gold), (item, name)
            columns[name].append(float(pick == item.gold))
    n = len(CHOICE_ITEMS)
    for name, values in columns.items():
        mean = sum(values) / n
        stderr = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) / math.sqrt(n)
        assert result.metrics[name] == pytest.approx(mean, abs=1e-12)
        assert result.metrics[f"{name}_stderr"] == pytest.approx(stderr, abs=1e-12)
    assert result.summary() == {
        "scoring": "multiple_choice",
        "items": n,
        "truncated": 1,
        **result.metrics,
    }


def space_costly_runner(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A runner whose log-likelihood is minus one per scored token and minus three per scored
    space, so each option's score is known from its text; every token counts as greedy."""
    counted = targets != IGNORE
    cost = torch.where(targets == ord(" "), 3.0, 1.0) * counted
    return torch.stack([-cost.sum(1), torch.zeros(targets.size(0))], dim=1)


def test_the_three_accuracies_pick_differently(byte_tokenizer, list_task):
    """Continuations " éééééé" (6 chars, 13 tokens): ll -15; " abcd" (4 chars, 5 tokens):
    -7; " abcdefgh" (8 chars, 9 tokens): -11. acc picks abcd (-7), acc_norm picks abcdefgh
    (-11/8 > -15/6, -7/4), acc_norm_tokens picks éééééé (-15/13 > -7/5, -11/9)."""
    choices = ("éééééé", "abcd", "abcdefgh")
    golds = [0, 1, 1, 2, 2, 2]
    items = [TaskItem(("Q",), choices, gold) for gold in golds]
    result = evaluate_task(
        list_task("multiple_choice", items),
        byte_tokenizer,
        space_costly_runner,
        max_len=MAX_LEN,
        batching=Batching(rows=4),
        device="cpu",
    )
    assert result.items[0]["loglikelihoods"] == [-15.0, -7.0, -11.0]
    assert result.items[0]["tokens"] == [13, 5, 9]
    assert [r["acc"] for r in result.items] == [0, 1, 1, 0, 0, 0]
    assert [r["acc_norm"] for r in result.items] == [0, 0, 0, 1, 1, 1]
    assert [r["acc_norm_tokens"] for r in result.items] == [1, 0, 0, 0, 0, 0]
    assert result.metrics["acc"] == pytest.approx(2 / 6)
    assert result.metrics["acc_norm"] == pytest.approx(3 / 6)
    assert result.metrics["acc_norm_tokens"] == pytest.approx(1 / 6)
    # sample std / sqrt(n): for k ones of n, sqrt(k (n - k) / (n (n - 1))) / sqrt(n)
    for name, k in (("acc", 2), ("acc_norm", 3), ("acc_norm_tokens", 1)):
        expected = math.sqrt(k * (6 - k) / (6 * 5)) / math.sqrt(6)
        assert result.metrics[f"{name}_stderr"] == pytest.approx(expected, rel=1e-12)


class NextByte(torch.nn.Module):
    """A rigged model: after byte b it puts logit 10 on byte b + 1 and 0 on every other id."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(*tokens.shape, 257)
        logits.scatter_(2, ((tokens + 1) % 257).unsqueeze(-1), 10.0)
        return logits


HIT = 10.0 - math.log(math.exp(10.0) + 256)  # log p of the rigged model's favourite
MISS = -math.log(math.exp(10.0) + 256)


def test_cloze_greedy_accuracy_and_perplexity(byte_tokenizer, list_task):
    items = [
        TaskItem(("x`",), ("abc",), delimiter=""),  # ` a b c: every token the favourite
        TaskItem(("x`",), ("abd",), delimiter=""),  # d after b is not
        TaskItem(("x",), ("yz",), delimiter=""),  # y after x, z after y
        TaskItem(("",), ("\x00",), delimiter=""),  # after eod (256) the favourite is 0
    ]
    result = evaluate_task(
        list_task("cloze", items),
        byte_tokenizer,
        module_runner(NextByte()),
        max_len=MAX_LEN,
        batching=Batching(rows=3),
        device="cpu",
    )
    lls = [3 * HIT, 2 * HIT + MISS, 2 * HIT, HIT]
    assert [r["loglikelihood"] for r in result.items] == pytest.approx(lls, abs=1e-5)
    assert [r["acc"] for r in result.items] == [1.0, 0.0, 1.0, 1.0]
    assert [r["tokens"] for r in result.items] == [3, 3, 2, 1]
    assert result.metrics["acc"] == pytest.approx(0.75)
    assert result.metrics["acc_stderr"] == pytest.approx(statistics.stdev([1, 0, 1, 1]) / 2)
    assert result.metrics["perplexity"] == pytest.approx(math.exp(-sum(lls) / 4), rel=1e-4)
    got = [r["loglikelihood"] for r in result.items]
    assert result.metrics["perplexity"] == pytest.approx(math.exp(-sum(got) / 4), rel=1e-12)


def test_cloze_with_a_model(tiny_model, byte_tokenizer, by_hand, list_task):
    model = tiny_model(seed=11)
    items = [
        TaskItem(("It was a dark and stormy",), ("night",)),
        TaskItem(("Once upon a",), ("time",)),
        TaskItem(("",), ("alone",)),
    ]
    result = evaluate_task(
        list_task("cloze", items),
        byte_tokenizer,
        module_runner(model),
        max_len=MAX_LEN,
        batching=Batching(rows=2),
        device="cpu",
    )
    hand = [by_hand(model, *hand_row(i.contexts[0], " " + i.choices[0])) for i in items]
    lls = [ll for ll, _ in hand]
    assert [r["loglikelihood"] for r in result.items] == pytest.approx(lls, rel=1e-6, abs=1e-5)
    assert [r["acc"] for r in result.items] == [float(g) for _, g in hand]
    assert result.metrics["perplexity"] == pytest.approx(math.exp(-sum(lls) / 3), rel=1e-5)


def test_perplexity_task_by_hand(tiny_model, byte_tokenizer, by_hand, list_task):
    """Bits per byte = -sum ll / (bytes ln 2) over the documents; the long one is scored in two
    windows: [eod w00 ... 64 bytes] and the 65 bytes ending the document (55 scored)."""
    model = tiny_model(seed=2)
    long = " ".join(f"w{k:02d}" for k in range(30))  # 119 bytes, 30 words
    docs = ["the cat sat on the mat", long, "naïve café\n"]
    items = [TaskItem(("",), (d,), delimiter="") for d in docs]
    result = evaluate_task(
        list_task("perplexity", items),
        byte_tokenizer,
        module_runner(model),
        max_len=MAX_LEN,
        batching=Batching(rows=2),
        device="cpu",
    )
    ids = list(long.encode())
    assert len(ids) == 119
    per_doc = [
        by_hand(model, [EOD, *docs[0].encode()], 22)[0],
        by_hand(model, [EOD, *ids[:64]], 64)[0] + by_hand(model, ids[54:], 55)[0],
        by_hand(model, [EOD, *docs[2].encode()], 13)[0],
    ]
    assert [r["loglikelihood"] for r in result.items] == pytest.approx(per_doc, abs=1e-4)
    assert [r["tokens"] for r in result.items] == [22, 119, 13]
    assert [r["bytes"] for r in result.items] == [22, 119, 13]
    assert [r["words"] for r in result.items] == [6, 30, 3]  # re.split(r"\s+"): "" after "\n"
    assert result.metrics["bits_per_byte"] == pytest.approx(
        -sum(per_doc) / (154 * math.log(2)), abs=1e-5
    )
    # the formulas, exactly, from the scored log-likelihoods
    total = sum(r["loglikelihood"] for r in result.items)
    assert result.metrics["bits_per_byte"] == pytest.approx(-total / (154 * math.log(2)), rel=1e-12)
    assert result.metrics["byte_perplexity"] == pytest.approx(math.exp(-total / 154), rel=1e-12)
    assert result.metrics["word_perplexity"] == pytest.approx(math.exp(-total / 39), rel=1e-12)


def test_unknown_scoring_is_refused(byte_tokenizer, list_task):
    with pytest.raises(ValueError, match="scoring 'generate' is not one of"):
        evaluate_task(
            list_task("generate", [TaskItem(("a",), ("b",))]),
            byte_tokenizer,
            space_costly_runner,
            max_len=MAX_LEN,
            batching=Batching(),
            device="cpu",
        )


# --- rows, batches and order -------------------------------------------------------------------


def test_row_scores_by_hand():
    logits = torch.tensor([[[0.0, 1.0, 2.0], [3.0, 0.0, 0.0]], [[1.0, 1.0, 1.0], [0.0, 0.0, 5.0]]])
    targets = torch.tensor([[2, 1], [IGNORE, IGNORE]])
    logz0 = math.log(1 + math.e + math.e**2)
    logz1 = math.log(math.e**3 + 2)
    out = row_scores(logits, targets).flatten().tolist()
    assert out == pytest.approx([2.0 - logz0 + 0.0 - logz1, 1.0, 0.0, 0.0], rel=1e-6)


class RecordingRunner:
    """A fake model: a row's log-likelihood is the sum of its scored target ids, and a target
    is 'missed' when it is odd. Records each batch's tokens and targets."""

    def __init__(self) -> None:
        self.batches: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __call__(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        self.batches.append((tokens.clone(), targets.clone()))
        counted = targets != IGNORE
        picked = torch.where(counted, targets, 0)
        odd = (picked % 2 == 1) & counted
        return torch.stack([picked.sum(1).double(), odd.sum(1).double()], dim=1)

    def rows(self) -> list[tuple[int, ...]]:
        """Every non-empty row a batch held, as its input tokens and last target."""
        out = []
        for tokens, targets in self.batches:
            for b in range(tokens.size(0)):
                scored = (targets[b] != IGNORE).nonzero()[:, 0]
                if len(scored):
                    end = int(scored[-1]) + 1
                    out.append((*tokens[b, :end].tolist(), int(targets[b, end - 1])))
        return out


def some_requests(n: int = 23) -> list[Request]:
    requests = []
    for k in range(n):
        length = 3 + (k * 7) % 19
        tokens = tuple((k + 2 * j) % 250 for j in range(length))
        requests.append(Request(k // 3, k % 3, tokens, scored=1 + k % (length - 1)))
    return requests


@pytest.mark.parametrize("batching", BATCHINGS, ids=str)
def test_every_request_once_and_in_order(batching):
    requests = some_requests()
    runner = RecordingRunner()
    scores = score(requests, runner, batching, "cpu")
    assert len(scores) == len(requests)
    for request, result in zip(requests, scores, strict=True):
        tail = request.tokens[len(request.tokens) - request.scored :]
        assert result.loglikelihood == sum(tail)
        assert result.greedy == all(t % 2 == 0 for t in tail)
        assert result.tokens == request.scored
    assert sorted(runner.rows()) == sorted(r.tokens for r in requests)  # each row once
    assert len(runner.batches) == -(-len(requests) // batching.rows)
    for tokens, targets in runner.batches:
        assert tokens.shape == targets.shape
        assert tokens.size(0) == batching.rows
        if batching.length:
            assert tokens.size(1) == batching.length
        else:
            assert tokens.size(1) % batching.multiple == 0
    # longest rows first, so a batch's padding is small
    lengths = [len(row) for row in runner.rows()]
    assert lengths == sorted(lengths, reverse=True)


def test_no_requests():
    runner = RecordingRunner()
    assert score([], runner, Batching(), "cpu") == []
    assert runner.batches == []


class ThreadedGroup:
    """`torch.distributed` for data ranks that are threads of this process: just the two
    collectives scoring uses. The process group a rank passes is its rank."""

    ReduceOp = torch.distributed.ReduceOp

    def __init__(self, world: int) -> None:
        self.world = world
        self.barrier = threading.Barrier(world, timeout=60)
        self.slots: dict[int, object] = {}

    def _exchange(self, rank: int, value: object) -> list:
        self.slots[rank] = value
        self.barrier.wait()
        values = [self.slots[r] for r in range(self.world)]
        self.barrier.wait()
        return values

    def all_reduce(self, tensor, op=None, group=None):
        assert op == self.ReduceOp.MAX
        tensor.copy_(torch.stack(self._exchange(group, tensor.clone())).max(0).values)

    def all_gather_object(self, out, obj, group=None):
        out[:] = self._exchange(group, obj)


def test_data_ranks_score_their_share(monkeypatch):
    """Two data ranks (threads): each scores only the options of its items (item % world),
    both run the same number of batches (FSDP's collectives need it: the rank with less to do
    runs a batch of empty rows), and both get every score back in order, as one rank would."""
    requests = some_requests(31)  # items 0-10: rank 0 has 16 options (4 batches of 5), rank 1 15
    batching = Batching(rows=5)
    alone = score(requests, RecordingRunner(), batching, "cpu")
    group = ThreadedGroup(2)
    monkeypatch.setattr(scoring, "dist", group)
    runners = [RecordingRunner(), RecordingRunner()]
    results: list = [None, None]
    errors: list = []

    def rank(r: int) -> None:
        try:
            split = DataSplit(rank=r, world=2, group=r)
            results[r] = score(requests, runners[r], batching, "cpu", split)
        except BaseException as exc:  # surfaced below
            errors.append(exc)
            group.barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert results[0] == results[1] == alone
    for r, runner in enumerate(runners):
        share = sorted(q.tokens for q in requests if q.item % 2 == r)
        assert len(share) == (16, 15)[r]
        assert sorted(runner.rows()) == share
    assert len(runners[0].batches) == len(runners[1].batches) == 4
    _, last_targets = runners[1].batches[-1]
    assert bool((last_targets == IGNORE).all())


def test_parallel_runner_keeps_rows_of_every_micro_batch():
    """A one-process stand-in for a laid-out model: `evaluate` hands the loss function two
    micro-batches (as a pipeline's last stage does); the runner returns the rows in order."""

    class Laid:
        def __init__(self, last_stage: bool) -> None:
            self.last_stage = last_stage

        def size(self, dim: str) -> int:
            return 1

        def evaluate(self, tokens, targets, loss_fn):
            if self.last_stage:
                for part in (slice(0, 2), slice(2, None)):
                    logits = NextByte()(tokens[part])
                    loss_fn(logits, targets[part])

    tokens = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    targets = torch.tensor([[2, 3, 4], [IGNORE, 7, 7], [IGNORE, IGNORE, 10]])
    out = parallel_runner(Laid(True))(tokens, targets)
    expected = [3 * HIT, 0, HIT + MISS, 1, HIT, 0]
    assert out.flatten().tolist() == pytest.approx(expected, abs=1e-5)
    assert parallel_runner(Laid(False))(tokens, targets).tolist() == [[0.0, 0.0]] * 3


def test_requests_through_option_requests_keep_their_items(byte_tokenizer):
    """`score` maps results back by position; evaluate_task groups them by `item`."""
    items = [TaskItem(("ab",), ("c", "dd")), TaskItem(("",), ("e",))]
    requests = option_requests(items, byte_tokenizer, MAX_LEN)
    scores = score(requests, RecordingRunner(), Batching(rows=2), "cpu")
    assert [(r.item, r.option) for r in requests] == [(0, 0), (0, 1), (1, 0)]
    assert [s.loglikelihood for s in scores] == [32 + 99, 32 + 100 + 100, 32 + 101]
