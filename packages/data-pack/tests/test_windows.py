"""Token windows: exact slices of the packed token stream, document starts, the chunk cache."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest

from llmtrain.data_pack.errors import DatasetError
from llmtrain.data_pack.loader import open_windows
from llmtrain.data_pack.pack import pack
from llmtrain.data_pack.store import PackedDataset
from llmtrain.data_pack.windows import ChunkCache, TokenWindows

EOD = 256  # the bytes tokenizer's end-of-document id


def rd_texts(seed: int, n_docs: int, max_len: int = 300) -> list[str]:
    """Documents of random length, some with multi-byte UTF-8 characters."""
    rng = np.random.default_rng(seed)
    alphabet = [*"abcdefghijklmnopqrstuvwxyz .,\n", "é", "日本", "🙂"]
    return [
        "".join(rng.choice(alphabet, size=int(rng.integers(1, max_len)))) for _ in range(n_docs)
    ]


def rd_stream(texts: list[str]) -> np.ndarray:
    """The token stream a pack with the bytes tokenizer must hold: UTF-8 bytes, eod after each."""
    ids: list[int] = []
    for text in texts:
        ids.extend(text.encode("utf-8"))
        ids.append(EOD)
    return np.asarray(ids, dtype=np.int64)


def rd_pack(directory, name: str, texts: list[str], chunk_tokens: int, **options) -> str:
    jsonl = directory / f"{name}.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    out = str(directory / name)
    options.setdefault("compression", "none")
    pack([str(jsonl)], out, {"kind": "bytes"}, workers=1, chunk_tokens=chunk_tokens, **options)
    return out


def rd_expected_starts(stream: np.ndarray, windows: np.ndarray, seq_len: int) -> np.ndarray:
    """True at input position t of window i where the stream's previous token is eod (or t is 0)."""
    positions = windows[:, None] * seq_len + np.arange(seq_len)[None, :]
    previous = stream[np.maximum(positions - 1, 0)]
    return (previous == EOD) | (positions == 0)


@pytest.fixture(scope="module")
def rd_corpus(tmp_path_factory):
    """One corpus packed with several chunk sizes (zstd, and many small pack tasks)."""
    directory = tmp_path_factory.mktemp("windows")
    texts = rd_texts(0, 160)
    urls = {
        chunk: rd_pack(directory, f"c{chunk}", texts, chunk, compression="zstd:1", split_bytes=3000)
        for chunk in (40, 100, 256, 1000)
    }
    return texts, rd_stream(texts), urls


@pytest.fixture(scope="module")
def rd_boundary_corpus(tmp_path_factory):
    """Documents that start exactly on chunk boundaries, and documents spanning several chunks."""
    directory = tmp_path_factory.mktemp("boundaries")
    lengths = [99, 99, 49, 49, 349, 0, 150, 98, 1, 1, 97, 250, 99, 3, 2, 1, 199]
    texts = ["q" * max(n, 1) for n in lengths]
    url = rd_pack(directory, "b", texts, 100, split_bytes=200)
    return texts, rd_stream(texts), url


@pytest.mark.parametrize(
    ("chunk", "seq_len"), [(100, 64), (40, 64), (256, 32), (1000, 64), (100, 100), (1000, 7)]
)
def test_every_window_is_its_slice_of_the_stream(rd_corpus, chunk, seq_len):
    _, stream, urls = rd_corpus
    windows = TokenWindows(urls[chunk], seq_len)
    n = (len(stream) - 1) // seq_len
    assert len(windows) == n
    assert windows.dataset.n_tokens == len(stream)
    assert windows.dataset.chunk_tokens == chunk

    expected = np.stack([stream[i * seq_len : i * seq_len + seq_len + 1] for i in range(n)])
    tokens, starts = windows.read(np.arange(n), doc_starts=True)
    assert tokens.dtype == np.int64 and tokens.shape == (n, seq_len + 1)
    assert starts.dtype == np.bool_ and starts.shape == (n, seq_len)
    np.testing.assert_array_equal(tokens, expected)
    np.testing.assert_array_equal(starts, rd_expected_starts(stream, np.arange(n), seq_len))

    # in a shuffled order with repeats, one window at a time, and without doc_starts
    order = np.random.default_rng(chunk + seq_len).integers(0, n, size=3 * n)
    tokens, none = windows.read(order)
    assert none is None
    np.testing.assert_array_equal(tokens, expected[order])
    for i in order[:50]:
        np.testing.assert_array_equal(windows.window(int(i)), expected[i])


def test_windows_spanning_chunk_boundaries_are_exact(rd_corpus):
    _, stream, urls = rd_corpus
    seq_len = 64
    windows = TokenWindows(urls[100], seq_len)
    spanning = [i for i in range(len(windows)) if (i * seq_len) // 100 != (i * seq_len + 64) // 100]
    assert len(spanning) > len(windows) // 2
    got, starts = windows.read(spanning, doc_starts=True)
    for row, i in enumerate(spanning):
        np.testing.assert_array_equal(got[row], stream[i * seq_len : i * seq_len + 65])
    np.testing.assert_array_equal(starts, rd_expected_starts(stream, np.asarray(spanning), seq_len))


@pytest.mark.parametrize("seq_len", [1, 2, 50, 99, 100, 101, 230])
def test_doc_starts_at_chunk_boundaries_and_long_documents(rd_boundary_corpus, seq_len):
    texts, stream, url = rd_boundary_corpus
    doc_starts = np.concatenate(([0], np.cumsum([len(t) + 1 for t in texts])[:-1]))
    assert np.count_nonzero(doc_starts % 100 == 0) >= 4  # the corpus tests what it claims
    windows = TokenWindows(url, seq_len)
    n = (len(stream) - 1) // seq_len
    assert len(windows) == n
    tokens, starts = windows.read(np.arange(n)[::-1], doc_starts=True)
    expected = np.stack([stream[i * seq_len : i * seq_len + seq_len + 1] for i in range(n)])
    np.testing.assert_array_equal(tokens, expected[::-1])
    np.testing.assert_array_equal(starts, rd_expected_starts(stream, np.arange(n)[::-1], seq_len))
    # every document start in the stream shows up in exactly one window's inputs
    assert starts.sum() == np.count_nonzero(doc_starts < n * seq_len)


def test_chunk_documents_match_document_offsets(rd_boundary_corpus):
    texts, stream, url = rd_boundary_corpus
    dataset = PackedDataset(url)
    doc_starts = np.concatenate(([0], np.cumsum([len(t) + 1 for t in texts])[:-1]))
    assert dataset.n_documents == len(texts)
    assert dataset.n_chunks == -(-len(stream) // 100)
    for chunk in range(dataset.n_chunks):
        tokens, starts = dataset.read_chunk(chunk), dataset.chunk_doc_starts(chunk)
        np.testing.assert_array_equal(tokens, stream[chunk * 100 : chunk * 100 + 100])
        inside = doc_starts[(doc_starts >= chunk * 100) & (doc_starts < chunk * 100 + 100)]
        np.testing.assert_array_equal(starts, inside - chunk * 100)


def test_window_count_boundary_and_too_small_dataset(tmp_path):
    url = rd_pack(tmp_path, "tiny", ["abcdefg"], 4)  # 8 tokens
    for seq_len in (1, 2, 3, 6, 7):
        assert len(TokenWindows(url, seq_len)) == 7 // seq_len
    np.testing.assert_array_equal(TokenWindows(url, 7).window(0), [*b"abcdefg", EOD])
    with pytest.raises(DatasetError, match=r"8 tokens: not enough for one window of seq_len 8"):
        TokenWindows(url, 8)
    with pytest.raises(DatasetError, match="not enough"):
        open_windows([url], 100)
    with pytest.raises(ValueError, match="seq_len must be at least 1"):
        TokenWindows(url, 0)


def test_index_out_of_range(rd_corpus):
    windows = TokenWindows(rd_corpus[2][100], 64)
    n = len(windows)
    for bad in ([n], [-1], [0, n + 5], [n - 1, -3]):
        with pytest.raises(IndexError, match=rf"window index out of range 0\.\.{n - 1}"):
            windows.read(bad)
    with pytest.raises(IndexError):
        windows.window(n)
    tokens, starts = windows.read([], doc_starts=True)
    assert tokens.shape == (0, 65) and starts.shape == (0, 64)
    assert windows.read([n - 1])[0].shape == (1, 65)


def test_chunk_cache_counts_reads_and_evicts_least_recently_used(rd_corpus):
    dataset = PackedDataset(rd_corpus[2][100])
    sizes = {
        c: sum(a.nbytes for a in (dataset.read_chunk(c), dataset.chunk_doc_starts(c)))
        for c in range(5)
    }
    cache = ChunkCache(dataset, max_bytes=sizes[0] + sizes[1] + sizes[2])
    for chunk in (0, 1, 0, 0, 1):
        tokens, _ = cache.get(chunk)
        np.testing.assert_array_equal(tokens, dataset.read_chunk(chunk))
    assert cache.reads == 2
    assert cache.nbytes == sizes[0] + sizes[1]
    cache.get(2)
    assert cache.reads == 3 and cache.nbytes == sizes[0] + sizes[1] + sizes[2]
    cache.get(1)  # most recent now: 0 is the oldest
    cache.get(3)
    assert cache.nbytes <= cache.max_bytes
    reads = cache.reads
    cache.get(1)
    assert cache.reads == reads  # still cached
    cache.get(0)
    assert cache.reads == reads + 1  # was evicted first


def test_chunk_cache_keeps_one_chunk_larger_than_its_budget(rd_corpus):
    dataset = PackedDataset(rd_corpus[2][1000])
    cache = ChunkCache(dataset, max_bytes=1)
    for chunk in (0, 1, 1, 2, 0):
        cache.tokens(chunk)
        assert cache.nbytes == dataset.read_chunk(chunk).nbytes
    assert cache.reads == 4


@pytest.mark.parametrize("budget_chunks", [1, 3, 10])
def test_cache_stays_within_budget_while_reading_everything(rd_corpus, budget_chunks):
    _, stream, urls = rd_corpus
    seq_len = 64
    windows = TokenWindows(urls[100], seq_len, cache_bytes=budget_chunks * 100 * 2)
    dataset = windows.dataset
    largest_chunk = max(
        sum(a.nbytes for a in (dataset.read_chunk(c), dataset.chunk_doc_starts(c)))
        for c in range(dataset.n_chunks)
    )
    order = np.random.default_rng(budget_chunks).permutation(len(windows))
    held = 0
    for begin in range(0, len(order), 7):
        batch = order[begin : begin + 7]
        tokens, _ = windows.read(batch, doc_starts=True)
        held = max(held, windows.cache.nbytes)
        assert windows.cache.nbytes <= max(windows.cache.max_bytes, largest_chunk)
        positions = batch[:, None] * seq_len + np.arange(seq_len + 1)
        np.testing.assert_array_equal(tokens, stream[positions])
    assert held > (budget_chunks - 1) * 200  # the budget is used, not just respected
    assert windows.cache.reads >= dataset.n_chunks


@pytest.mark.parametrize(("chunk", "seq_len"), [(256, 32), (1000, 50)])
def test_chunk_aware_order_reads_each_chunk_about_twice_per_epoch(rd_corpus, chunk, seq_len):
    """The loader's own cache (open_windows' minimum) over one epoch in sampler order.

    Chunks hold whole blocks of windows here; each chunk is needed by its own block and by the
    last window of the block before it (one token), so two reads per chunk per epoch suffice."""
    _, stream, urls = rd_corpus
    dataset = open_windows([urls[chunk]], seq_len, cache_bytes=1, seed=3)
    source = dataset.sources[0]
    n, n_chunks = len(source), source.dataset.n_chunks
    seen = []
    for begin in range(0, n, 16):
        batch = dataset.read(np.arange(begin, min(begin + 16, n)))
        assert source.cache.nbytes <= source.cache.max_bytes
        _, windows = dataset.sampler.lookup(batch["samples"])
        starts = windows[:, None] * seq_len + np.arange(seq_len + 1)
        np.testing.assert_array_equal(batch["tokens"], stream[starts])
        seen.append(windows)
    np.testing.assert_array_equal(np.sort(np.concatenate(seen)), np.arange(n))
    assert source.cache.reads <= 2 * n_chunks, (
        f"{source.cache.reads} chunk reads for {n_chunks} chunks in one epoch"
    )


def test_token_windows_and_dataset_pickle_round_trip(rd_corpus):
    _, stream, urls = rd_corpus
    windows = TokenWindows(urls[100], 64, cache_bytes=5000)
    before = windows.read(np.arange(len(windows)), doc_starts=True)
    assert windows.cache.nbytes > 3000
    data = pickle.dumps(windows)
    assert len(data) < 2000  # the URL travels, not the cached chunks
    again = pickle.loads(data)
    assert again.seq_len == 64 and len(again) == len(windows)
    assert again.cache_bytes == 5000 and again.cache.max_bytes == 5000
    assert again.cache.reads == 0 and again.cache.nbytes == 0
    after = again.read(np.arange(len(again)), doc_starts=True)
    np.testing.assert_array_equal(after[0], before[0])
    np.testing.assert_array_equal(after[1], before[1])

    dataset = PackedDataset(urls[40])
    copy = pickle.loads(pickle.dumps(dataset))
    assert copy.url == dataset.url and copy.meta == dataset.meta
    assert (copy.n_tokens, copy.chunk_tokens, copy.dtype) == (len(stream), 40, np.uint16)
    np.testing.assert_array_equal(copy.read(0, copy.n_tokens), stream)
    np.testing.assert_array_equal(copy.chunk_docs, dataset.chunk_docs)


def test_windows_reaching_into_the_next_chunk_read_its_stored_head(tmp_path):
    """A window that needs only the first tokens of the next chunk takes them from
    `chunk_heads`: the next chunk is not decoded, and the window is still exact."""
    from llmtrain.data_pack.pack import pack

    data = tmp_path / "d.jsonl"
    data.write_text("".join(f'{{"text": "document {i} ' + "x" * 50 + '"}\n' for i in range(400)))
    pack([str(data)], str(tmp_path / "ds"), {"kind": "bytes"}, workers=1, chunk_tokens=256)
    dataset = PackedDataset(str(tmp_path / "ds"))
    stream = dataset.read(0, dataset.n_tokens)
    assert dataset.head_tokens == 256
    np.testing.assert_array_equal(dataset.read_heads(0)[1], stream[256:512])
    windows = TokenWindows(dataset, 32, cache_bytes=1 << 20)
    # window 7 is tokens [224, 257): all of chunk 0 but one token of chunk 1
    got, _ = windows.read([7])
    np.testing.assert_array_equal(got[0], stream[224:257])
    assert ("tokens", 1) not in windows.cache._items
    assert windows.cache.reads == 1
    everything, _ = windows.read(np.arange(len(windows)))
    for i, row in enumerate(everything):
        np.testing.assert_array_equal(row, stream[i * 32 : i * 32 + 33])
