"""Items to token rows as lm-evaluation-harness builds them: context/continuation split, the
continuation's tokens as the whole's minus the context's, the end-of-document token before an
empty context, left truncation, and disjoint rolling windows for perplexity."""

from __future__ import annotations

import random

import pytest

from llmtrain.core_mesh.interfaces import TaskItem
from llmtrain.data_pack.tokenizer import HFOptions, HFTokenizer, train_bpe
from llmtrain.downstream.requests import (
    Request,
    option_requests,
    requests_of,
    rolling_requests,
    split_context,
)

EOD = 256  # the bytes tokenizer's end-of-document id


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> HFTokenizer:
    """A byte-level BPE trained on a few sentences: " Paris" and " capital" are single tokens,
    and a lone trailing space is a token of its own."""
    corpus = [
        "The capital of France is Paris.",
        "Paris is in France.",
        "I went to Paris today.",
        "The capital of Italy is Rome.",
    ] * 30
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    path.write_text(train_bpe(corpus, 300), encoding="utf-8")
    return HFTokenizer(HFOptions(str(path)))


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode_batch([text])[0]


@pytest.mark.parametrize(
    ("context", "continuation", "expected"),
    [
        ("The capital is ", "Paris", ("The capital is", " Paris")),
        ("Answer:  \t ", "B", ("Answer:", "  \t B")),
        ("Answer:", " B", ("Answer:", " B")),
        ("", "x", ("", "x")),
        ("   ", "x", ("", "   x")),
    ],
)
def test_split_context_moves_trailing_spaces(context, continuation, expected):
    assert split_context(context, continuation) == expected
    assert "".join(expected) == context + continuation


def test_byte_rows(byte_tokenizer):
    items = [
        TaskItem(("Question: hi\nAnswer:",), ("yes", "no"), gold=1),
        TaskItem(("A b", "A c"), ("end.",)),  # Winogrande's shape: a context per option
        TaskItem(("Say ",), ("é",), delimiter=""),
    ]
    requests = option_requests(items, byte_tokenizer, max_len=64)
    context = list(b"Question: hi\nAnswer:")
    assert requests == [
        Request(0, 0, tuple(context + list(b" yes")), scored=4),
        Request(0, 1, tuple(context + list(b" no")), scored=3),
        Request(1, 0, tuple(b"A b end."), scored=5),
        Request(1, 1, tuple(b"A c end."), scored=5),
        Request(2, 0, tuple(b"Say \xc3\xa9"), scored=3),  # the space joins the answer
    ]


def test_continuation_is_the_whole_minus_the_context(bpe):
    """The context's trailing space is scored with the answer, as in running text: " Paris" is
    one token, and not " " + "Paris" (which the naive split would give)."""
    context, answer = "The capital of France is ", "Paris"
    (request,) = option_requests([TaskItem((context,), (answer,), delimiter="")], bpe, max_len=64)
    whole = encode(bpe, context + answer)
    prefix = encode(bpe, context.rstrip())
    assert request.tokens == tuple(whole)
    assert request.scored == len(whole) - len(prefix) == 1
    assert bpe.decode(request.tokens[-1:]) == " Paris"
    assert encode(bpe, context) + encode(bpe, answer) != whole  # the naive split differs
    # the delimiter form gives the same row
    (same,) = option_requests([TaskItem((context.rstrip(),), (answer,))], bpe, max_len=64)
    assert same == request


def test_bpe_rows_of_several_items(bpe):
    items = [
        TaskItem(("The capital of France is",), ("Paris.", "Rome.")),
        TaskItem(("I went to",), ("Paris today.",)),
    ]
    requests = option_requests(items, bpe, max_len=64)
    for request in requests:
        item = items[request.item]
        context = item.context(request.option)
        whole = encode(bpe, context + " " + item.choice(request.option))
        assert request.tokens == tuple(whole)
        assert request.scored == len(whole) - len(encode(bpe, context))
        assert bpe.decode(request.tokens[-request.scored :]) == " " + item.choice(request.option)
    assert [(r.item, r.option) for r in requests] == [(0, 0), (0, 1), (1, 0)]


def test_one_batch_through_the_tokenizer(byte_tokenizer):
    calls = []

    class Counting:
        eod_id = byte_tokenizer.eod_id

        def encode_batch(self, texts):
            calls.append(list(texts))
            return byte_tokenizer.encode_batch(texts)

    items = [TaskItem(("same",), ("a", "b", "c")), TaskItem(("same",), ("d",))]
    requests = option_requests(items, Counting(), max_len=64)
    assert len(calls) == 1
    assert calls[0].count("same") == 1  # a shared context is encoded once
    assert [r.tokens for r in requests] == [tuple(b"same " + c) for c in (b"a", b"b", b"c", b"d")]


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
def test_empty_context_is_the_end_of_document_token(byte_tokenizer, bpe, tokenizer):
    tok = byte_tokenizer if tokenizer == "bytes" else bpe
    (request,) = option_requests([TaskItem(("",), ("Paris today.",))], tok, max_len=64)
    answer = encode(tok, " Paris today.")
    assert request.tokens == (tok.eod_id, *answer)
    assert request.scored == len(answer)
    assert not request.truncated


def test_left_truncation(byte_tokenizer):
    context = "".join(chr(ord("a") + k % 26) for k in range(100))
    items = [
        TaskItem((context,), ("xyz",)),
        TaskItem((context[:13],), ("xyz",)),  # exactly max_len + 1 tokens: not cut
        TaskItem((context[:14],), ("xyz",)),  # one more: cut
        TaskItem(("ab",), ("x" * 40,)),  # an answer longer than the model: its tail is scored
    ]
    requests = option_requests(items, byte_tokenizer, max_len=16)
    full = list((context + " xyz").encode())
    assert requests[0].tokens == tuple(full[-17:])
    assert (requests[0].scored, requests[0].truncated) == (4, True)
    assert requests[1].tokens == tuple((context[:13] + " xyz").encode())
    assert (requests[1].scored, requests[1].truncated) == (4, False)
    assert requests[2].tokens == tuple((context[1:14] + " xyz").encode())
    assert (requests[2].scored, requests[2].truncated) == (4, True)
    assert requests[3].tokens == tuple(b"x" * 17)
    assert (requests[3].scored, requests[3].truncated) == (16, True)
    assert all(len(r.tokens) <= 17 for r in requests)


def test_rolling_windows_by_hand(byte_tokenizer):
    """The document "abcdefghij" at max_len 4: [eod a b c d] scores a-d; [d e f g h] scores
    e-h; the last window keeps max_len tokens of input, [f g h i j], and scores i-j."""
    item = TaskItem(("",), ("abcdefghij",), delimiter="")
    requests = rolling_requests([item], byte_tokenizer, max_len=4)
    assert [(r.tokens, r.scored) for r in requests] == [
        ((EOD, *b"abcd"), 4),
        (tuple(b"defgh"), 4),
        (tuple(b"fghij"), 2),
    ]
    assert [(r.item, r.option) for r in requests] == [(0, 0), (0, 1), (0, 2)]


def harness_windows(tokens: list[int], prefix: int, max_len: int) -> list[tuple[list[int], int]]:
    """lm-evaluation-harness's loglikelihood_rolling rows, written from its definition with
    context_len=1: the first window predicts up to max_len tokens after the prefix token; each
    next window predicts up to max_len more, its input the max_len tokens before its end; the
    disjoint form keeps the context tokens not predicted. Returns (row, scored) pairs."""
    rows: list[tuple[list[int], int]] = []
    if not tokens:
        return rows
    first = min(max_len, len(tokens))
    rows.append(([prefix, *tokens[:first]], first))
    predicted = first
    while predicted < len(tokens):
        count = min(len(tokens) - predicted, max_len)
        end = predicted + count
        inputs = tokens[end - max_len - 1 : end - 1]
        targets = tokens[end - count : end]
        context = inputs[: len(inputs) - (len(targets) - 1)]
        rows.append((context + targets, count))
        predicted = end
    return rows


@pytest.mark.parametrize("max_len", [1, 2, 3, 7, 16])
def test_rolling_windows_match_the_harness(byte_tokenizer, max_len):
    rng = random.Random(max_len)
    texts = ["".join(rng.choice("abcdefgh ") for _ in range(n)) for n in (1, 5, 16, 17, 33, 64)]
    items = [TaskItem(("",), (t,), delimiter="") for t in texts]
    requests = rolling_requests(items, byte_tokenizer, max_len)
    for i, text in enumerate(texts):
        ids = list(text.encode())
        mine = [r for r in requests if r.item == i]
        assert [(list(r.tokens), r.scored) for r in mine] == harness_windows(ids, EOD, max_len)
        assert [r.option for r in mine] == list(range(len(mine)))
        assert all(len(r.tokens) <= max_len + 1 and 0 < r.scored < len(r.tokens) for r in mine)
        # every token is scored exactly once, in order
        assert [t for r in mine for t in r.tokens[len(r.tokens) - r.scored :]] == ids
    assert requests_of("perplexity", items, byte_tokenizer, max_len) == requests


def test_empty_document_has_no_windows(byte_tokenizer):
    items = [TaskItem(("",), ("",), delimiter=""), TaskItem(("",), ("ab",), delimiter="")]
    assert rolling_requests(items, byte_tokenizer, 8) == [Request(1, 0, (EOD, *b"ab"), 2)]


def test_requests_of_chooses_by_scoring(byte_tokenizer):
    items = [TaskItem(("Q",), ("yes",))]
    for scoring in ("multiple_choice", "cloze"):
        assert requests_of(scoring, items, byte_tokenizer, 8) == [Request(0, 0, tuple(b"Q yes"), 4)]
