"""The loader: batches of real packed windows for this rank, exact resume, mixtures, tokenizers."""

from __future__ import annotations

import itertools
import json
import pickle
from fractions import Fraction

import numpy as np
import pytest

from llmtrain.core_mesh.errors import UserError
from llmtrain.data_pack.errors import DatasetError
from llmtrain.data_pack.loader import StepBatches, WindowLoader, open_windows
from llmtrain.data_pack.pack import pack
from llmtrain.data_pack.sampling import BatchPlan
from llmtrain.data_pack.tokenizer import BytesOptions, BytesTokenizer

EOD = 256
THREE_SPECIALS = ["<|endoftext|>", "<|pad|>", "<|x|>"]


def rd_texts(seed: int, n_docs: int, alphabet: str) -> list[str]:
    rng = np.random.default_rng(seed)
    return [
        "".join(rng.choice(list(alphabet), size=int(rng.integers(1, 200)))) for _ in range(n_docs)
    ]


def rd_stream(texts: list[str]) -> np.ndarray:
    ids: list[int] = []
    for text in texts:
        ids.extend(text.encode("utf-8"))
        ids.append(EOD)
    return np.asarray(ids, dtype=np.int64)


def rd_pack(directory, name, texts, chunk_tokens, tokenizer=None) -> str:
    jsonl = directory / f"{name}.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    out = str(directory / name)
    pack(
        [str(jsonl)],
        out,
        tokenizer or {"kind": "bytes"},
        workers=1,
        chunk_tokens=chunk_tokens,
        compression="zstd:1",
    )
    return out


@pytest.fixture(scope="module")
def rd_data(tmp_path_factory):
    """Two corpora with disjoint alphabets (so a window shows where it came from), and the first
    corpus again under a bytes tokenizer with one more special token."""
    directory = tmp_path_factory.mktemp("loader")
    lower = rd_texts(1, 150, "abcdefghijklm ")
    upper = rd_texts(2, 60, "NOPQRSTUVWXYZ.")
    return {
        "a": (rd_pack(directory, "a", lower, 128), rd_stream(lower)),
        "b": (rd_pack(directory, "b", upper, 200), rd_stream(upper)),
        "a3": (
            rd_pack(
                directory, "a3", lower, 128, {"kind": "bytes", "special_tokens": THREE_SPECIALS}
            ),
            rd_stream(lower),
        ),
    }


def rd_window(stream: np.ndarray, window: int, seq_len: int) -> np.ndarray:
    return stream[window * seq_len : window * seq_len + seq_len + 1]


def rd_starts(stream: np.ndarray, window: int, seq_len: int) -> np.ndarray:
    positions = window * seq_len + np.arange(seq_len)
    return (stream[np.maximum(positions - 1, 0)] == EOD) | (positions == 0)


def rd_take(loader: WindowLoader, count: int) -> list[tuple[int, int, dict]]:
    return list(itertools.islice(iter(loader), count))


def rd_same(got: list, expected: list) -> None:
    assert [(s, i) for s, i, _ in got] == [(s, i) for s, i, _ in expected]
    for (_, _, a), (_, _, b) in zip(got, expected, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])


def test_loader_batches_are_this_ranks_windows(rd_data):
    url, stream = rd_data["a"]
    seq_len = 32
    dataset = open_windows([url], seq_len, doc_starts=True, seed=1)
    assert dataset.seq_len == seq_len and len(dataset) == (len(stream) - 1) // seq_len
    plan = BatchPlan(8, world_size=2, rank=1, micro_batch=2)
    got = rd_take(WindowLoader(dataset, plan), 12)
    assert [(s, i) for s, i, _ in got] == [(s, i) for s in range(6) for i in range(2)]
    for step, i, batch in got:
        assert batch.keys() == {"tokens", "doc_starts", "samples", "sources"}
        assert batch["tokens"].shape == (2, seq_len + 1) and batch["tokens"].dtype == np.int64
        assert batch["doc_starts"].shape == (2, seq_len) and batch["doc_starts"].dtype == np.bool_
        np.testing.assert_array_equal(batch["samples"], plan.step(step)[i])
        np.testing.assert_array_equal(batch["samples"], step * 8 + 4 + 2 * i + np.arange(2))
        assert (batch["sources"] == 0).all()
        _, windows = dataset.sampler.lookup(batch["samples"])
        for row, window in enumerate(windows):
            np.testing.assert_array_equal(batch["tokens"][row], rd_window(stream, window, seq_len))
            np.testing.assert_array_equal(
                batch["doc_starts"][row], rd_starts(stream, window, seq_len)
            )
    without = rd_take(WindowLoader(open_windows([url], seq_len, seed=1), plan), 12)
    for (_, _, a), (_, _, b) in zip(without, got, strict=True):
        assert "doc_starts" not in a
        np.testing.assert_array_equal(a["tokens"], b["tokens"])


def test_unshuffled_loader_reads_the_stored_order(rd_data):
    url, stream = rd_data["a"]
    dataset = open_windows([url], 50, shuffle=False)
    n = len(dataset)
    batches = rd_take(WindowLoader(dataset, BatchPlan(16)), -(-2 * n // 16))
    tokens = np.concatenate([b["tokens"] for _, _, b in batches])
    for sample, row in enumerate(tokens):
        np.testing.assert_array_equal(row, rd_window(stream, sample % n, 50))


@pytest.mark.parametrize(("world", "micro"), [(1, None), (1, 2), (2, 1)])
def test_state_dict_resume_gives_the_same_following_batches(rd_data, world, micro):
    """Save after k whole steps (k * accumulation micro-batches), resume, get step k next."""
    url, _ = rd_data["a"]
    plan = BatchPlan(8, world, world - 1, micro)
    uninterrupted = rd_take(
        WindowLoader(open_windows([url], 16, seed=4), plan), 10 * plan.accumulation
    )
    for k in (1, 3, 7):
        first = WindowLoader(open_windows([url], 16, seed=4), plan)
        rd_same(rd_take(first, k * plan.accumulation), uninterrupted[: k * plan.accumulation])
        saved = first.state_dict()
        assert saved == {"consumed": k * 8, "global_batch": 8}
        resumed = WindowLoader(open_windows([url], 16, seed=4), plan)
        resumed.load_state_dict(saved)
        rd_same(
            rd_take(resumed, (10 - k) * plan.accumulation), uninterrupted[k * plan.accumulation :]
        )


def test_resume_from_consumed_with_another_world_size(rd_data):
    url, _ = rd_data["a"]
    reference = rd_take(WindowLoader(open_windows([url], 16, seed=4), BatchPlan(8)), 12)
    for world in (2, 4):
        per_rank = []
        for rank in range(world):
            loader = WindowLoader(open_windows([url], 16, seed=4), BatchPlan(8, world, rank))
            loader.load_state_dict({"consumed": 5 * 8, "global_batch": 8})
            per_rank.append(rd_take(loader, 7))
        for step in range(5, 12):
            together = [per_rank[r][step - 5] for r in range(world)]
            assert all(s == step for s, _, _ in together)
            for key in ("tokens", "samples", "sources"):
                np.testing.assert_array_equal(
                    np.concatenate([b[key] for _, _, b in together]), reference[step][2][key]
                )
        direct = WindowLoader(open_windows([url], 16, seed=4), BatchPlan(8, world, 0), consumed=40)
        rd_same(rd_take(direct, 7), per_rank[0])


def test_resume_with_another_global_batch_is_refused(rd_data):
    url, _ = rd_data["a"]
    dataset = open_windows([url], 16)
    loader = WindowLoader(dataset, BatchPlan(8))
    with pytest.raises(UserError, match=r"global batch of 16 samples, this run uses 8"):
        loader.load_state_dict({"consumed": 32, "global_batch": 16})
    assert loader.state_dict() == {"consumed": 0, "global_batch": 8}
    with pytest.raises(UserError, match=r"resuming at 12 samples"):
        loader.load_state_dict({"consumed": 12, "global_batch": 8})
    with pytest.raises(UserError, match=r"resuming at 12 samples"):
        WindowLoader(dataset, BatchPlan(8), consumed=12)


def test_mixture_follows_its_weights_and_reads_the_right_windows(rd_data):
    (url_a, stream_a), (url_b, stream_b) = rd_data["a"], rd_data["b"]
    seq_len, weights = 16, [0.75, 0.25]
    dataset = open_windows([url_a, url_b], seq_len, weights=weights, seed=3, doc_starts=True)
    lengths = [(len(stream_a) - 1) // seq_len, (len(stream_b) - 1) // seq_len]
    assert len(dataset) == sum(lengths)
    batches = rd_take(WindowLoader(dataset, BatchPlan(64, micro_batch=32)), 256)
    sources = np.concatenate([b["sources"] for _, _, b in batches])
    n = len(sources)
    assert n == 8192
    expected = [int(Fraction(3, 4) * n), n - int(Fraction(3, 4) * n)]
    assert np.bincount(sources).tolist() == expected
    assert n * 0.25 > 4 * lengths[1]  # source b wraps over several epochs
    streams = [stream_a, stream_b]
    alphabets = [set(b"abcdefghijklm ") | {EOD}, set(b"NOPQRSTUVWXYZ.") | {EOD}]
    windows = np.concatenate([dataset.sampler.lookup(b["samples"])[1] for _, _, b in batches])
    tokens = np.concatenate([b["tokens"] for _, _, b in batches])
    starts = np.concatenate([b["doc_starts"] for _, _, b in batches])
    for row in range(n):
        source, window = int(sources[row]), int(windows[row])
        assert 0 <= window < lengths[source]
        np.testing.assert_array_equal(tokens[row], rd_window(streams[source], window, seq_len))
        np.testing.assert_array_equal(starts[row], rd_starts(streams[source], window, seq_len))
    for source in (0, 1):
        assert set(np.unique(tokens[sources == source]).tolist()) <= alphabets[source]
        # every window of each source is read in its first epoch
        first_epoch = windows[sources == source][: lengths[source]]
        np.testing.assert_array_equal(np.sort(first_epoch), np.arange(lengths[source]))


def test_open_windows_refuses_mixed_or_other_tokenizers(rd_data):
    url, url3 = rd_data["a"][0], rd_data["a3"][0]
    with pytest.raises(DatasetError, match=r"packed with different tokenizers"):
        open_windows([url, url3], 16)
    with pytest.raises(DatasetError, match=r"packed with different tokenizers"):
        open_windows([url3, url], 16)
    three = BytesTokenizer(BytesOptions(special_tokens=THREE_SPECIALS))
    with pytest.raises(DatasetError, match=rf"fingerprint {three.fingerprint}"):
        open_windows([url], 16, tokenizer=three)
    with pytest.raises(DatasetError, match=r"use the same tokenizer or pack the data again"):
        open_windows([url3], 16, tokenizer=BytesTokenizer())
    assert len(open_windows([url], 16, tokenizer=BytesTokenizer())) > 0
    same = open_windows([url3], 16, tokenizer=three, shuffle=False)
    np.testing.assert_array_equal(same.read([0])["tokens"][0], rd_window(rd_data["a3"][1], 0, 16))


def test_getitem_and_getitems_agree_with_read(rd_data):
    dataset = open_windows(
        [rd_data["a"][0], rd_data["b"][0]], 24, weights=[1, 2], seed=5, doc_starts=True
    )
    samples = np.random.default_rng(0).integers(0, 10**6, size=40).tolist()
    batch = dataset.read(samples)
    items = dataset.__getitems__(samples)
    assert len(items) == 40
    assert set(batch["sources"].tolist()) == {0, 1}
    for row, sample in enumerate(samples):
        single = dataset[sample]
        for item in (single, items[row]):
            assert item.keys() == batch.keys()
            for key in batch:
                np.testing.assert_array_equal(item[key], batch[key][row])
        assert single["tokens"].shape == (25,) and single["doc_starts"].shape == (24,)
        assert int(single["samples"]) == sample


def test_window_dataset_pickles_for_spawned_workers(rd_data):
    dataset = open_windows([rd_data["a"][0], rd_data["b"][0]], 24, seed=5, cache_bytes=10**6)
    samples = list(range(100, 180))
    before = dataset.read(samples)
    copy = pickle.loads(pickle.dumps(dataset))
    assert [s.cache.max_bytes for s in copy.sources] == [10**6, 10**6]
    after = copy.read(samples)
    for key in before:
        np.testing.assert_array_equal(after[key], before[key])


def test_open_windows_cache_holds_at_least_a_pool_of_chunks(rd_data):
    url = rd_data["a"][0]
    # a pool of P blocks touches up to 2P chunks (+2 at the ends), plus a quarter for doc starts
    chunk_bytes = 128 * 2
    assert open_windows([url], 16, cache_bytes=1).sources[0].cache.max_bytes == int(
        (2 * 8 + 2) * chunk_bytes * 1.25
    )
    assert open_windows([url], 16, cache_bytes=1, pool_blocks=3).sources[0].cache_bytes == int(
        (2 * 3 + 2) * chunk_bytes * 1.25
    )
    assert open_windows([url], 16, cache_bytes=10**6).sources[0].cache.max_bytes == 10**6


def test_step_batches_are_the_plans_micro_batches():
    plan = BatchPlan(12, world_size=3, rank=2, micro_batch=2)
    batches = StepBatches(plan, start_step=5, steps=4)
    assert len(batches) == 8
    expected = [m.tolist() for step in range(5, 9) for m in plan.step(step)]
    assert list(batches) == expected
    assert list(batches) == expected  # iterable again
    assert expected[0] == [68, 69]
    assert list(StepBatches(plan, 0, 0)) == [] and list(StepBatches(plan, 3, 0)) == []
    endless = StepBatches(plan, start_step=2)
    assert list(itertools.islice(endless, 100)) == [
        m.tolist() for step in range(2, 52) for m in plan.step(step)
    ]
    with pytest.raises(TypeError, match="endless"):
        len(endless)
