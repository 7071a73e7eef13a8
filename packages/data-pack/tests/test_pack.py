"""`pack`, `inspect` and `merge` on generated corpora: exact round trips, deterministic order,
the on-disk layout (dtype, chunks, shards, compression) and the dataset metadata."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from llmtrain.core_mesh.errors import UserError
from llmtrain.data_pack.errors import DatasetError
from llmtrain.data_pack.merge import merge
from llmtrain.data_pack.pack import pack
from llmtrain.data_pack.report import inspect_dataset, length_histogram
from llmtrain.data_pack.store import PackedDataset
from llmtrain.data_pack.tokenizer import (
    ENDOFTEXT,
    BytesOptions,
    BytesTokenizer,
    HFOptions,
    HFTokenizer,
)

BYTES = {"kind": "bytes"}


def _hf(path, **options) -> dict:
    return {"kind": "hf", "path": str(path), **options}


def _arrays(dataset: PackedDataset) -> tuple[np.ndarray, np.ndarray]:
    return dataset.read(0, dataset.n_tokens), np.asarray(dataset.doc_offsets[:])


def _same_dataset(a: PackedDataset, b: PackedDataset) -> None:
    tokens_a, offsets_a = _arrays(a)
    tokens_b, offsets_b = _arrays(b)
    assert tokens_a.dtype == tokens_b.dtype
    np.testing.assert_array_equal(tokens_a, tokens_b)
    np.testing.assert_array_equal(offsets_a, offsets_b)
    np.testing.assert_array_equal(a.chunk_docs, b.chunk_docs)


def _documents(ds: PackedDataset) -> list[list[int]]:
    """Every document's tokens without its eod (two reads; `document(i)` reads twice per call)."""
    tokens, offsets = _arrays(ds)
    return [tokens[a : b - 1].tolist() for a, b in itertools.pairwise(offsets.tolist())]


def _expected_tokens(ids: list[list[int]], eod: int) -> np.ndarray:
    return np.asarray([t for doc in ids for t in [*doc, eod]], dtype=np.int64)


def _leftovers(folder) -> list[str]:
    return sorted(n for n in os.listdir(folder) if ".tmp-" in n or ".old-" in n)


def test_round_trip_bytes(tmp_path, write_jsonl, texts):
    data = write_jsonl("corpus.jsonl", texts)
    out = tmp_path / "ds"
    summary = pack([str(data)], str(out), BYTES, workers=1, split_bytes=2000, chunk_tokens=4096)
    ds = PackedDataset(str(out))
    lengths = [len(t.encode("utf-8")) + 1 for t in texts]
    assert (summary.documents, summary.tokens) == (300, sum(lengths))
    assert (ds.n_documents, ds.n_tokens) == (300, sum(lengths))
    assert ds.dtype == np.uint16
    assert summary.encoder == "reference"
    tokens, offsets = _arrays(ds)
    np.testing.assert_array_equal(offsets, np.concatenate([[0], np.cumsum(lengths)]))
    # the eod id (256) is no byte: it appears exactly once per document, as its last token
    assert int((tokens == 256).sum()) == 300
    assert (tokens[offsets[1:] - 1] == 256).all()
    tok = BytesTokenizer()
    assert [tok.decode(doc) for doc in _documents(ds)] == texts
    for i in (0, 1, 150, 299):
        assert tok.decode(ds.document(i)) == texts[i]
    with pytest.raises(IndexError):
        ds.document(300)


def test_fast_encoder_that_differs_is_not_used(tmp_path, write_jsonl, texts, tokenizer_json):
    """The workers start with the fast encoder while the sample check runs; when the check finds
    other ids, nothing they made is written and the pack starts over with the reference."""
    data = write_jsonl("corpus.jsonl", texts)
    reference = pack([str(data)], str(tmp_path / "ref"), _hf(tokenizer_json, fast="off"), workers=1)
    real = HFTokenizer._fast_arrays

    def off_by_one(self, batch):  # a fast encoder that is wrong on every text
        return [ids + 1 for ids in real(self, batch)]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(HFTokenizer, "_fast_arrays", off_by_one)
        summary = pack([str(data)], str(tmp_path / "auto"), _hf(tokenizer_json), workers=1)
    assert summary.encoder == "reference"
    assert (summary.documents, summary.tokens) == (reference.documents, reference.tokens)
    _same_dataset(PackedDataset(str(tmp_path / "auto")), PackedDataset(str(tmp_path / "ref")))


def test_round_trip_hf(tmp_path, write_jsonl, texts, tokenizer_json):
    data = write_jsonl("corpus.jsonl", texts)
    fast = pack([str(data)], str(tmp_path / "fast"), _hf(tokenizer_json), workers=1)
    assert fast.encoder == "fast"
    reference = pack([str(data)], str(tmp_path / "ref"), _hf(tokenizer_json, fast="off"), workers=1)
    assert reference.encoder == "reference"
    ds = PackedDataset(str(tmp_path / "fast"))
    _same_dataset(ds, PackedDataset(str(tmp_path / "ref")))

    tok = HFTokenizer(HFOptions(str(tokenizer_json), fast="off"))
    np.testing.assert_array_equal(
        ds.read(0, ds.n_tokens), _expected_tokens(tok.encode_batch(texts), 0)
    )
    assert [tok.decode(doc) for doc in _documents(ds)] == texts
    assert ds.fingerprint == tok.fingerprint
    assert (ds.eod_id, ds.vocab_size) == (0, 400)


def test_fast_path_never_changes_pack_ids(tmp_path, write_jsonl, corpus, crafted_tokenizer):
    """A BPE whose fast path differs from the reference only on "abc", which the first file lacks:
    the packed ids must still be the reference ids."""
    first = corpus(200, seed=21)
    second = ["abc", "xabc abc", *corpus(5, seed=22)]
    assert not any("abc" in t for t in first)
    a = write_jsonl("a.jsonl", first)
    b = write_jsonl("b.jsonl", second)
    out = tmp_path / "ds"
    pack([str(a), str(b)], str(out), _hf(crafted_tokenizer), workers=1)
    reference = HFTokenizer(HFOptions(str(crafted_tokenizer), fast="off"))
    expected = _expected_tokens(reference.encode_batch(first + second), reference.eod_id)
    ds = PackedDataset(str(out))
    np.testing.assert_array_equal(ds.read(0, ds.n_tokens), expected)


def test_determinism_across_workers_and_splits(tmp_path, write_jsonl, texts, tokenizer_json):
    data = write_jsonl("corpus.jsonl", texts)
    raw = data.read_bytes()
    assert len(raw) > 20_000
    # the small ranges really cut lines in the middle
    assert sum(raw[k - 1 : k] != b"\n" for k in range(2000, len(raw), 2000)) >= 5
    runs = [(1, 16 << 20), (1, 2000), (2, 2000), (3, 777)]
    datasets = []
    for workers, split in runs:
        out = tmp_path / f"w{workers}-s{split}"
        pack([str(data)], str(out), _hf(tokenizer_json), workers=workers, split_bytes=split)
        datasets.append(PackedDataset(str(out)))
    for other in datasets[1:]:
        _same_dataset(datasets[0], other)
    tok = HFTokenizer(HFOptions(str(tokenizer_json)))
    assert [tok.decode(doc) for doc in _documents(datasets[-1])] == texts


def test_line_ends_and_range_edges(tmp_path):
    """Ranges that start exactly at a line start, on the newline itself, or inside a long line;
    a file without a final newline."""
    lines = ["a" * 10, "b" * 3000, "", "c", "d" * 9]
    data = tmp_path / "edges.jsonl"
    data.write_bytes("\n".join(json.dumps({"text": t}) for t in lines).encode())
    for split in (1, 2, 14, 15, 16, 17, 1000, 10_000):
        out = tmp_path / f"s{split}"
        summary = pack([str(data)], str(out), BYTES, workers=1, split_bytes=split)
        ds = PackedDataset(str(out))
        docs = [bytes(doc).decode() for doc in _documents(ds)]
        assert docs == ["a" * 10, "b" * 3000, "c", "d" * 9], split
        assert summary.empty_documents == 1


@pytest.mark.parametrize("suffix", [".jsonl.gz", ".jsonl.zst"])
def test_compressed_inputs_match_plain(tmp_path, write_jsonl, texts, suffix):
    plain = write_jsonl("corpus.jsonl", texts)
    packed = write_jsonl(f"corpus{suffix}", texts)
    assert packed.read_bytes() != plain.read_bytes()
    pack([str(plain)], str(tmp_path / "plain"), BYTES, workers=1, split_bytes=1500)
    pack([str(packed)], str(tmp_path / "packed"), BYTES, workers=1, split_bytes=1500)
    ds = PackedDataset(str(tmp_path / "packed"))
    _same_dataset(PackedDataset(str(tmp_path / "plain")), ds)
    assert _files(ds.meta["sources"]) == [{"url": str(packed), "bytes": packed.stat().st_size}]


def test_globs_and_several_files_keep_sorted_order(tmp_path, write_jsonl, corpus):
    parts = {name: corpus(20, seed=i) for i, name in enumerate(["part-2", "part-10", "part-1"])}
    paths = {name: write_jsonl(f"in/{name}.jsonl", docs) for name, docs in parts.items()}
    other = write_jsonl("extra/other.jsonl", corpus(5, seed=99))
    out = tmp_path / "ds"
    # a glob is sorted (as strings); patterns keep their given order; a repeated file counts once
    pack(
        [str(tmp_path / "in" / "part-*.jsonl"), str(other), str(paths["part-2"])],
        str(out),
        BYTES,
        workers=1,
    )
    ds = PackedDataset(str(out))
    order = ["part-1", "part-10", "part-2"]
    expected = [t for name in order for t in parts[name]] + corpus(5, seed=99)
    assert [bytes(doc).decode() for doc in _documents(ds)] == expected
    assert _files(ds.meta["sources"]) == [
        {"url": str(p), "bytes": p.stat().st_size} for p in [*(paths[n] for n in order), other]
    ]


def test_dotted_field(tmp_path, write_jsonl, texts):
    records = [{"text": "decoy", "meta": {"body": t, "id": i}} for i, t in enumerate(texts)]
    data = write_jsonl("nested.jsonl", records)
    out = tmp_path / "ds"
    pack([str(data)], str(out), BYTES, field="meta.body", workers=1)
    ds = PackedDataset(str(out))
    assert [bytes(doc).decode() for doc in _documents(ds)] == texts
    assert ds.meta["field"] == "meta.body"


def _many_specials(n: int) -> dict:
    return {"kind": "bytes", "special_tokens": [ENDOFTEXT, *(f"<s{i}>" for i in range(n - 1))]}


def test_token_dtype(tmp_path, write_jsonl):
    data = write_jsonl("small.jsonl", ["héllo wörld", "x"])
    fits = pack([str(data)], str(tmp_path / "fits"), _many_specials(65280), workers=1)
    ds = PackedDataset(str(tmp_path / "fits"))
    assert (ds.vocab_size, ds.dtype, ds.meta["dtype"]) == (65536, np.uint16, "uint16")
    assert fits.tokens == 16

    pack([str(data)], str(tmp_path / "big"), _many_specials(65281), workers=1)
    big = PackedDataset(str(tmp_path / "big"))
    assert (big.vocab_size, big.dtype, big.meta["dtype"]) == (65537, np.uint32, "uint32")
    np.testing.assert_array_equal(big.read(0, big.n_tokens), ds.read(0, ds.n_tokens))

    forced = pack([str(data)], str(tmp_path / "forced"), BYTES, workers=1, dtype="uint32")
    assert forced.tokens == 16
    assert PackedDataset(str(tmp_path / "forced")).dtype == np.uint32


@pytest.mark.parametrize(
    ("dtype", "message"),
    [
        ("uint16", "the tokenizer has 65537 ids, more than uint16 holds (max 65535); use uint32"),
        ("int32", "token dtype 'int32': use uint16 or uint32"),
    ],
)
def test_token_dtype_errors_before_any_output(tmp_path, write_jsonl, dtype, message):
    data = write_jsonl("small.jsonl", ["x"])
    out = tmp_path / "ds"
    with pytest.raises(UserError) as info:
        pack([str(data)], str(out), _many_specials(65281), dtype=dtype, workers=2)
    assert message in str(info.value)
    assert not out.exists()
    assert _leftovers(tmp_path) == []


def test_sparse_token_ids_choose_the_dtype_by_the_largest_id(tmp_path, write_jsonl, tokenizer_json):
    """A tokenizer.json with its eod at id 70000 but only 400 entries needs uint32 tokens."""
    spec = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    spec["added_tokens"][0]["id"] = 70000
    spec["model"]["vocab"][ENDOFTEXT] = 70000
    sparse = tmp_path / "sparse.json"
    sparse.write_text(json.dumps(spec), encoding="utf-8")
    data = write_jsonl("corpus.jsonl", ["hello world", "second"])
    out = tmp_path / "ds"
    pack([str(data)], str(out), _hf(sparse), workers=1)
    ds = PackedDataset(str(out))
    assert ds.dtype == np.uint32
    assert ds.eod_id == 70000
    assert ds.vocab_size > 70000
    tokens, offsets = _arrays(ds)
    assert tokens[offsets[1:] - 1].tolist() == [70000, 70000]


def test_chunk_docs_index(tmp_path, write_jsonl, corpus):
    # short documents and some spanning several 64-token chunks
    short, long = corpus(150, seed=4, max_words=3), corpus(10, seed=5, max_words=100)
    docs = [d for pair in zip(short[:10], long, strict=True) for d in pair] + short[10:]
    data = write_jsonl("corpus.jsonl", docs)
    out = tmp_path / "ds"
    pack([str(data)], str(out), BYTES, workers=1, chunk_tokens=64, split_bytes=500)
    ds = PackedDataset(str(out))
    tokens, offsets = _arrays(ds)
    starts = offsets[:-1]
    assert ds.chunk_tokens == 64
    assert ds.n_chunks == -(-ds.n_tokens // 64)
    assert len(ds.chunk_docs) == ds.n_chunks + 1
    assert ds.chunk_docs[-1] == ds.n_documents
    empty_chunks = 0
    for c in range(ds.n_chunks):
        chunk, in_chunk = ds.read_chunk(c), ds.chunk_doc_starts(c)
        np.testing.assert_array_equal(chunk, tokens[c * 64 : (c + 1) * 64])
        expected = starts[(starts >= c * 64) & (starts < (c + 1) * 64)] - c * 64
        np.testing.assert_array_equal(in_chunk, expected)
        assert ds.chunk_docs[c] == int(np.searchsorted(starts, c * 64))
        empty_chunks += len(in_chunk) == 0
    assert empty_chunks >= 5  # chunks inside long documents are covered too


@pytest.mark.parametrize(
    ("shard_chunks", "compression"), [(0, "none"), (4, "zstd"), (4, "none"), (0, "zstd:3")]
)
def test_sharding_and_compression_read_back_identically(
    tmp_path, write_jsonl, texts, shard_chunks, compression
):
    data = write_jsonl("corpus.jsonl", texts[:80])
    pack([str(data)], str(tmp_path / "ref"), BYTES, workers=1, chunk_tokens=128)
    out = tmp_path / "ds"
    pack(
        [str(data)],
        str(out),
        BYTES,
        workers=1,
        chunk_tokens=128,
        shard_chunks=shard_chunks,
        compression=compression,
    )
    ds = PackedDataset(str(out))
    _same_dataset(PackedDataset(str(tmp_path / "ref")), ds)
    assert ds.tokens.chunks == (128,)
    assert ds.tokens.shards == ((512,) if shard_chunks else None)
    codecs = [type(c).__name__ for c in ds.tokens.compressors]
    assert codecs == ([] if compression == "none" else ["ZstdCodec"])
    stored = [f for _, _, files in os.walk(out / "tokens" / "c") for f in files]
    n_chunks = ds.n_chunks
    assert len(stored) == (-(-n_chunks // 4) if shard_chunks else n_chunks)
    for c in range(n_chunks):
        np.testing.assert_array_equal(ds.read_chunk(c), ds.read(c * 128, (c + 1) * 128))


def test_bad_compression_name(tmp_path, write_jsonl):
    data = write_jsonl("corpus.jsonl", ["x"])
    with pytest.raises(UserError, match="compression 'lz4': use none, zstd or zstd:LEVEL"):
        pack([str(data)], str(tmp_path / "ds"), BYTES, workers=1, compression="lz4")
    assert not (tmp_path / "ds").exists()
    assert _leftovers(tmp_path) == []


def test_metadata(tmp_path, texts, tokenizer_json):
    body = [json.dumps({"text": t}) for t in texts[:10]]
    lines = [
        body[0],
        "",
        body[1],
        '{"text": ""}',
        "   ",
        *body[2:5],
        '{"text": ""}',
        "\t",
        *body[5:],
    ]
    data = tmp_path / "corpus.jsonl"
    data.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "ds"
    summary = pack([str(data)], str(out), _hf(tokenizer_json), workers=1)
    ds = PackedDataset(str(out))
    tok = HFTokenizer(HFOptions(str(tokenizer_json)))
    n_tokens = sum(len(ids) + 1 for ids in tok.encode_batch(texts[:10]))
    meta = ds.meta
    assert meta["counts"] == {
        "documents": 10,
        "tokens": n_tokens,
        "empty_documents": 2,
        "blank_lines": 3,
        "bad_lines": 0,
        "dropped": 0,
        "bytes": sum(len(t.encode("utf-8")) for t in texts[:10]),  # not the file's \u escapes
    }
    assert ds.n_bytes == summary.n_bytes == meta["counts"]["bytes"] < data.stat().st_size
    assert meta["bad_lines"] == []
    assert meta["sources"] == [
        {
            "url": str(data),
            "bytes": data.stat().st_size,
            "format": "jsonl",
            "unit": "line",
            "kept": 10,
            "dropped": 0,
            "bad": 0,
        }
    ]
    assert meta["filter"] is None
    assert meta["tokenizer"] == {
        "name": "hf:tokenizer.json",
        "fingerprint": tok.fingerprint,
        "vocab_size": 400,
        "eod_id": 0,
        "spec": {"kind": "hf", "path": str(tokenizer_json)},
    }
    assert (meta["format"], meta["version"], meta["complete"]) == ("llmtrain-tokens", 1, True)
    assert (meta["dtype"], meta["field"]) == ("uint16", "text")
    assert (summary.documents, summary.tokens, summary.empty_documents) == (10, n_tokens, 2)
    assert (summary.blank_lines, summary.bad_lines) == (3, 0)
    assert summary.input_bytes == data.stat().st_size
    assert summary.tokens_per_second > 0


def test_relative_tokenizer_path_is_stored_absolute(
    tmp_path, monkeypatch, write_jsonl, tokenizer_json
):
    data = write_jsonl("corpus.jsonl", ["some text"])
    monkeypatch.chdir(tokenizer_json.parent)
    pack([str(data)], str(tmp_path / "ds"), _hf("tokenizer.json"), workers=1)
    monkeypatch.chdir(tmp_path)
    spec = PackedDataset(str(tmp_path / "ds")).meta["tokenizer"]["spec"]
    assert spec["path"] == str(tokenizer_json)
    report = json.loads(inspect_dataset(str(tmp_path / "ds"), as_json=True))
    assert report["sample"]["text"] == "some text<|endoftext|>"


def test_empty_input(tmp_path):
    data = tmp_path / "blank.jsonl"
    data.write_text('\n{"text": ""}\n\n', encoding="utf-8")
    out = tmp_path / "ds"
    summary = pack([str(data)], str(out), BYTES, workers=1)
    assert (summary.documents, summary.tokens, summary.empty_documents) == (0, 0, 1)
    assert summary.blank_lines == 2
    ds = PackedDataset(str(out))
    assert (ds.n_documents, ds.n_tokens, ds.n_chunks) == (0, 0, 0)
    np.testing.assert_array_equal(np.asarray(ds.doc_offsets[:]), [0])
    np.testing.assert_array_equal(ds.chunk_docs, [0])
    report = json.loads(inspect_dataset(str(out), as_json=True))
    assert report["document_lengths"] == {}
    assert report["sample"] == {"start": 0, "ids": [], "text": "", "note": None}


def test_existing_output_refused_or_replaced(tmp_path, write_jsonl, corpus):
    first = write_jsonl("first.jsonl", corpus(30, seed=1))
    second = write_jsonl("second.jsonl", corpus(7, seed=2))
    out = tmp_path / "ds"
    pack([str(first)], str(out), BYTES, workers=1)
    before = _arrays(PackedDataset(str(out)))
    with pytest.raises(UserError, match="already exists; pass --overwrite"):
        pack([str(second)], str(out), BYTES, workers=1)
    ds = PackedDataset(str(out))
    assert ds.n_documents == 30
    np.testing.assert_array_equal(_arrays(ds)[0], before[0])

    pack([str(second)], str(out), BYTES, workers=1, overwrite=True)
    ds = PackedDataset(str(out))
    assert ds.n_documents == 7
    expected = corpus(7, seed=2)
    assert [bytes(doc).decode() for doc in _documents(ds)] == expected
    assert _leftovers(tmp_path) == []
    assert sorted(os.listdir(out)) == [
        "chunk_docs",
        "chunk_heads",
        "doc_id_bytes",
        "doc_id_offsets",
        "doc_offsets",
        "doc_row",
        "doc_source",
        "tokens",
        "zarr.json",
    ]


def test_inspect(tmp_path, run_cli, write_jsonl, corpus):
    data = write_jsonl("corpus.jsonl", [*corpus(50, max_words=5), "", "x" * 300])
    out = tmp_path / "ds"
    pack([str(data)], str(out), BYTES, workers=1, chunk_tokens=512, on_bad_line="skip")
    ds = PackedDataset(str(out))
    tokens, offsets = _arrays(ds)
    lengths = np.diff(offsets)
    buckets: dict[str, int] = {}
    for n in sorted(lengths):
        b = int(n).bit_length() - 1
        key = f"{1 << b}-{(1 << (b + 1)) - 1}"
        buckets[key] = buckets.get(key, 0) + 1

    code, stdout, _ = run_cli(
        "data", "inspect", out, "--json", "--window", 16, "--seed", 3, "--log-dir", tmp_path / "l"
    )
    assert code == 0
    report = json.loads(stdout)
    assert report["counts"] == ds.meta["counts"]
    assert report["counts"]["documents"] == 51
    assert report["counts"]["empty_documents"] == 1
    assert (report["dtype"], report["chunk_tokens"]) == ("uint16", 512)
    assert report["tokenizer"] == {
        "name": "bytes",
        "fingerprint": BytesTokenizer().fingerprint,
        "vocab_size": 258,
        "eod_id": 256,
    }
    assert report["document_lengths"] == buckets
    assert report["document_lengths"] == length_histogram(ds)
    assert report["document_lengths"]["256-511"] == 1  # the 300-byte document
    sample = report["sample"]
    start = int(np.random.default_rng(3).integers(0, ds.n_tokens - 16))
    assert sample["start"] == start
    assert sample["ids"] == tokens[start : start + 16].tolist()
    assert sample["text"] == BytesTokenizer().decode(sample["ids"])
    assert sample["note"] is None
    assert _files(report["sources"]) == [{"url": str(data), "bytes": data.stat().st_size}]

    code, stdout, _ = run_cli("data", "inspect", out, "--log-dir", tmp_path / "l")
    assert code == 0
    assert f"  documents   51 ({ds.n_tokens / 51:,.1f} tokens each on average)" in stdout
    assert f"  tokens      {ds.n_tokens:,} (uint16, chunks of 512)" in stdout
    assert "  skipped     1 empty documents, 0 bad records, 0 blank lines" in stdout
    assert f"  tokenizer   bytes (vocab 258, eod 256, fingerprint {ds.fingerprint})" in stdout
    assert f"  sources     1 file(s), {data.stat().st_size:,} bytes" in stdout
    assert f"256-511           1  {'#' * round(40 / max(buckets.values()))}" in stdout
    assert "  sample at token " in stdout


def test_inspect_with_another_tokenizer_notes_the_mismatch(
    tmp_path, run_cli, write_jsonl, tokenizer_json
):
    data = write_jsonl("corpus.jsonl", ["hello"])
    out = tmp_path / "ds"
    pack([str(data)], str(out), BYTES, workers=1)
    code, stdout, _ = run_cli(
        "data", "inspect", out, "--json", "--tokenizer", tokenizer_json, "--log-dir", tmp_path / "l"
    )
    assert code == 0
    sample = json.loads(stdout)["sample"]
    assert sample["text"] is None
    assert sample["ids"] == [104, 101, 108, 108, 111, 256]
    assert sample["note"].startswith("cannot decode the sample: ")
    assert BytesTokenizer().fingerprint in sample["note"]
    assert HFTokenizer(HFOptions(str(tokenizer_json))).fingerprint in sample["note"]


def test_inspect_when_the_tokenizer_file_is_gone(tmp_path, write_jsonl, tokenizer_json):
    data = write_jsonl("corpus.jsonl", ["hello"])
    moved = tmp_path / "tokenizer.json"
    moved.write_bytes(tokenizer_json.read_bytes())
    pack([str(data)], str(tmp_path / "ds"), _hf(moved), workers=1)
    moved.unlink()
    report = json.loads(inspect_dataset(str(tmp_path / "ds"), as_json=True))
    assert report["sample"]["text"] is None
    assert report["sample"]["note"] == f"cannot decode the sample: {moved}: no such tokenizer file"
    assert report["counts"]["documents"] == 1
    text = inspect_dataset(str(tmp_path / "ds"))
    assert text.endswith(f"    cannot decode the sample: {moved}: no such tokenizer file")


def test_inspect_missing_dataset(tmp_path, run_cli):
    code, _, stderr = run_cli("data", "inspect", tmp_path / "nope", "--log-dir", tmp_path / "l")
    assert code == 2
    assert f"error: {tmp_path / 'nope'}: not a packed dataset" in stderr


def test_merge(tmp_path, run_cli, write_jsonl, texts):
    a = write_jsonl("a.jsonl", texts[:100])
    b = write_jsonl("b.jsonl", texts[100:])
    pack([str(a)], str(tmp_path / "a"), BYTES, workers=1, chunk_tokens=100)
    pack([str(b)], str(tmp_path / "b"), BYTES, workers=1, chunk_tokens=300, dtype="uint32")
    pack([str(a), str(b)], str(tmp_path / "all"), BYTES, workers=1, chunk_tokens=100)
    ds_a, ds_b = PackedDataset(str(tmp_path / "a")), PackedDataset(str(tmp_path / "b"))
    out = tmp_path / "merged"
    code, stdout, _ = run_cli(
        "data", "merge", tmp_path / "a", tmp_path / "b", "-o", out, "--log-dir", tmp_path / "l"
    )
    assert code == 0
    n_tokens = ds_a.n_tokens + ds_b.n_tokens
    n_bytes = sum(len(t.encode("utf-8")) for t in texts)
    assert stdout == (
        f"{out}: 300 documents, {n_tokens} tokens, {n_bytes:,} bytes of text, "
        f"{n_bytes / n_tokens:.2f} bytes a token\n"
    )
    merged = PackedDataset(str(out))
    assert (merged.n_documents, merged.n_tokens) == (300, n_tokens)
    assert merged.dtype == np.uint32  # the widest of the inputs
    assert merged.chunk_tokens == 100
    assert int(merged.doc_offsets[100]) == ds_a.n_tokens
    for i in (0, 99, 100, 150, 299):
        source = ds_a.document(i) if i < 100 else ds_b.document(i - 100)
        np.testing.assert_array_equal(merged.document(i), source)
    whole = PackedDataset(str(tmp_path / "all"))
    np.testing.assert_array_equal(_arrays(merged)[0], _arrays(whole)[0])
    np.testing.assert_array_equal(_arrays(merged)[1], _arrays(whole)[1])
    np.testing.assert_array_equal(merged.chunk_docs, whole.chunk_docs)
    counts = merged.meta["counts"]
    assert counts == {k: ds_a.meta["counts"][k] + ds_b.meta["counts"][k] for k in counts}
    assert merged.meta["sources"] == ds_a.meta["sources"] + ds_b.meta["sources"]
    assert merged.meta["merged_from"] == [str(tmp_path / "a"), str(tmp_path / "b")]
    assert merged.n_bytes == ds_a.n_bytes + ds_b.n_bytes == n_bytes
    assert merged.fingerprint == ds_a.fingerprint

    code, _, stderr = run_cli(
        "data", "merge", tmp_path / "a", tmp_path / "b", "-o", out, "--log-dir", tmp_path / "l"
    )
    assert code == 2
    assert "already exists; pass --overwrite" in stderr


@pytest.mark.parametrize("older_first", [False, True])
def test_merge_leaves_out_a_count_an_input_lacks(tmp_path, write_jsonl, older_first):
    """A dataset packed before a count was recorded (`dropped`, from before filters) merges with
    newer ones: the counts all of them record are summed, the others left out, not guessed."""
    pack([str(write_jsonl("a.jsonl", ["one", "two", ""]))], str(tmp_path / "new"), BYTES, workers=1)
    pack([str(write_jsonl("b.jsonl", ["three"]))], str(tmp_path / "older"), BYTES, workers=1)
    group = tmp_path / "older" / "zarr.json"
    meta = json.loads(group.read_text())
    del meta["attributes"]["llmtrain"]["counts"]["dropped"]
    group.write_text(json.dumps(meta))
    inputs = [str(tmp_path / "new"), str(tmp_path / "older")]
    merge(inputs[::-1] if older_first else inputs, str(tmp_path / "merged"))
    counts = PackedDataset(str(tmp_path / "merged")).meta["counts"]
    assert "dropped" not in counts
    assert {k: counts[k] for k in ("documents", "tokens", "empty_documents")} == {
        "documents": 3,
        "tokens": 3 + 3 + 5 + 3,  # bytes and an eod each
        "empty_documents": 1,
    }


def test_merge_into_one_of_its_inputs_locally(tmp_path, write_jsonl):
    a = write_jsonl("a.jsonl", ["first", "second"])
    b = write_jsonl("b.jsonl", ["third"])
    pack([str(a)], str(tmp_path / "a"), BYTES, workers=1)
    pack([str(b)], str(tmp_path / "b"), BYTES, workers=1)
    merge([str(tmp_path / "a"), str(tmp_path / "b")], str(tmp_path / "a"), overwrite=True)
    ds = PackedDataset(str(tmp_path / "a"))
    docs = [bytes(doc).decode() for doc in _documents(ds)]
    assert docs == ["first", "second", "third"]
    assert ds.meta["counts"]["tokens"] == ds.n_tokens == 19
    assert _leftovers(tmp_path) == []


def test_merge_refuses_different_tokenizers(tmp_path, write_jsonl, tokenizer_json):
    data = write_jsonl("a.jsonl", ["hello", "world"])
    pack([str(data)], str(tmp_path / "bytes"), BYTES, workers=1)
    pack([str(data)], str(tmp_path / "hf"), _hf(tokenizer_json), workers=1)
    out = tmp_path / "merged"
    with pytest.raises(UserError, match="merged datasets must share one tokenizer") as info:
        merge([str(tmp_path / "bytes"), str(tmp_path / "hf")], str(out))
    message = str(info.value)
    assert BytesTokenizer().fingerprint in message
    assert HFTokenizer(HFOptions(str(tokenizer_json))).fingerprint in message
    assert "hf:tokenizer.json" in message
    assert not out.exists()
    assert _leftovers(tmp_path) == []


def test_check_tokenizer(tmp_path, write_jsonl, tokenizer_json):
    data = write_jsonl("a.jsonl", ["hello"])
    out = tmp_path / "ds"
    pack([str(data)], str(out), BYTES, workers=1)
    ds = PackedDataset(str(out))
    ds.check_tokenizer(BytesTokenizer())
    other = BytesTokenizer(BytesOptions(["</s>"]))
    with pytest.raises(DatasetError) as info:
        ds.check_tokenizer(other)
    message = str(info.value)
    assert f"packed with tokenizer bytes (fingerprint {ds.fingerprint})" in message
    assert f"this run uses bytes (fingerprint {other.fingerprint})" in message
    with pytest.raises(DatasetError, match=r"hf:tokenizer\.json"):
        ds.check_tokenizer(HFTokenizer(HFOptions(str(tokenizer_json))))


def test_pack_cli(tmp_path, run_cli, write_jsonl, texts):
    data = write_jsonl("corpus.jsonl", [*texts, ""])
    out = tmp_path / "ds"
    logs = tmp_path / "logs"
    code, stdout, _ = run_cli(
        "data", "pack", data, "-o", out, "--tokenizer", "bytes", "--workers", 1,
        "--split-mb", 0.002, "--chunk-tokens", 128, "--shard-chunks", 2, "--compression", "none",
        "--no-progress", "--log-dir", logs,
    )  # fmt: skip
    assert code == 0
    ds = PackedDataset(str(out))
    n_tokens = sum(len(t.encode()) + 1 for t in texts)
    assert stdout.startswith(f"{out}: 300 documents, {n_tokens} tokens (1 empty skipped) in ")
    assert ds.tokens.shards == (256,)
    pack([str(data)], str(tmp_path / "api"), BYTES, workers=1)
    api = PackedDataset(str(tmp_path / "api"))
    np.testing.assert_array_equal(_arrays(ds)[0], _arrays(api)[0])
    np.testing.assert_array_equal(_arrays(ds)[1], _arrays(api)[1])
    events = [json.loads(line) for line in (logs / "rank0.jsonl").read_text().splitlines()]
    by_name = {e["event"]: e for e in events}
    assert by_name["pack.start"]["workers"] == 1
    assert by_name["pack.start"]["tokenizer"] == "bytes"
    assert by_name["pack.done"]["documents"] == 300
    assert by_name["pack.done"]["tokens"] == n_tokens
    assert by_name["pack.done"]["empty_documents"] == 1


def test_pack_imports_no_torch(tmp_path, write_jsonl, texts, tokenizer_json):
    data = write_jsonl("corpus.jsonl", texts)
    script = textwrap.dedent(
        f"""
        import sys
        from llmtrain.core_mesh.cli import main
        code = main(["data", "pack", {str(data)!r}, "-o", {str(tmp_path / "ds")!r},
                     "--tokenizer", {str(tokenizer_json)!r}, "--workers", "2",
                     "--split-mb", "0.005", "--log-dir", {str(tmp_path / "logs")!r}])
        import llmtrain.data_pack.loader, llmtrain.data_pack.sampling, llmtrain.data_pack.windows
        assert code == 0, code
        assert "torch" not in sys.modules, "data-pack imported torch"
        print("ok")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=600, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.endswith("ok\n")
    assert PackedDataset(str(tmp_path / "ds")).n_documents == 300


@pytest.mark.parametrize("fast", ["auto", "off"])
def test_special_token_text_in_a_document_is_not_an_eod(
    tmp_path, write_jsonl, tokenizer_json, fast
):
    texts = ["before <|endoftext|> after", "plain", "<|endoftext|>"]
    data = write_jsonl("special.jsonl", texts)
    pack([str(data)], str(tmp_path / "ds"), _hf(tokenizer_json, fast=fast), workers=1)
    ds = PackedDataset(str(tmp_path / "ds"))
    tokens = ds.read(0, ds.n_tokens)
    assert int((tokens == ds.eod_id).sum()) == ds.n_documents == 3
    tok = HFTokenizer(HFOptions(str(tokenizer_json)))
    assert [tok.decode(ds.document(i).tolist()) for i in range(3)] == texts


def _files(sources: list[dict]) -> list[dict]:
    """The url and size of each source in a dataset's metadata."""
    return [{"url": s["url"], "bytes": s["bytes"]} for s in sources]


def test_inspect_shows_the_filter_and_each_file(tmp_path, run_cli, write_jsonl):
    first = write_jsonl("a.jsonl", [{"text": f"doc {i}", "score": i} for i in range(10)])
    second = write_jsonl("b.jsonl", [{"text": f"doc {i}", "score": i % 3} for i in range(9)])
    out = tmp_path / "ds"
    summary = pack([str(first), str(second)], str(out), BYTES, workers=1, where=["score >= 2"])
    assert (summary.documents, summary.dropped) == (8 + 3, 2 + 6)
    code, stdout, _ = run_cli("data", "inspect", out, "--log-dir", tmp_path / "l")
    assert code == 0
    assert "  filter      score >= 2: 8 records dropped" in stdout
    assert f"    {first}: 8 kept, 2 dropped, 0 bad" in stdout
    assert f"    {second}: 3 kept, 6 dropped, 0 bad" in stdout
    assert "(jsonl); provenance recorded" in stdout


def test_a_worker_imports_neither_zarr_nor_the_plugins(tokenizer_json):
    """What a spawned worker imports to run a task, in a fresh interpreter: the worker side and
    unpickling the tokenizer. zarr, logging and the plugins' modules stay out (they would make
    every worker start slowly)."""
    code = textwrap.dedent(
        """
        import pickle, sys
        import llmtrain.data_pack.pack_worker
        pickle.loads(sys.stdin.buffer.read())
        heavy = ("zarr", "structlog", "rich", "torch", "jinja2", "llmtrain.train_loop")
        print(sorted({m.split(".")[0] for m in sys.modules if m.startswith(heavy)}))
        """
    )
    import pickle

    tokenizer = pickle.dumps(HFTokenizer(HFOptions(str(tokenizer_json))))
    done = subprocess.run(
        [sys.executable, "-c", code], input=tokenizer, capture_output=True, timeout=300, check=True
    )
    assert done.stdout.decode().strip() == "[]"


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ([("a.jsonl", 3 << 20, None, "jsonl")], 3),  # cut by size: three tasks, three workers
        ([("a.jsonl", 10, None, "jsonl"), ("b.txt", 10, None, "text-lines")], 2),
        ([("a.jsonl", 10, None, "jsonl")], 1),  # one task runs in the pack's own process
        ([("a.jsonl.gz", 10, "gzip", "jsonl")], 4),  # may hold any amount of text
        ([("a.parquet", 10, None, "parquet")], 4),
    ],
)
def test_no_more_workers_than_tasks(files, expected):
    from llmtrain.data_pack.pack import _workers_for
    from llmtrain.data_pack.sources import Source

    sources = [Source(url, size, compression, kind) for url, size, compression, kind in files]
    assert _workers_for(sources, 1 << 20, 4) == expected
