"""Provenance: the documents of a token range tile it exactly, each named by the record it came
from (JSONL line, Parquet row, id), through small chunks that windows and documents cross."""

from __future__ import annotations

import itertools
import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest

from llmtrain.data_pack.errors import DatasetError
from llmtrain.data_pack.loader import open_windows
from llmtrain.data_pack.pack import pack
from llmtrain.data_pack.provenance import documents_in, sample_documents
from llmtrain.data_pack.store import PackedDataset
from llmtrain.data_pack.tokenizer import BytesTokenizer

CHUNK = 64  # tokens per chunk: most windows and many documents cross chunks
SEQ_LEN = 40


def _texts(rng: random.Random, corpus, n: int) -> list[str]:
    """Documents from 1 byte to several chunks long."""
    texts = corpus(n, seed=rng.randint(0, 1 << 30), max_words=40)
    return [t[: rng.choice([1, 3, 10, 60, 200, 1000])] or "x" for t in texts]


@pytest.fixture(scope="module")
def jsonl_records(tmp_path_factory, corpus):
    """Two JSONL files with blank lines, empty texts (skipped) and records without an id between
    the documents; returns (dataset url, {(file name, line): (text, id)} of the packed records)."""
    rng = random.Random(5)
    directory = tmp_path_factory.mktemp("jsonl")
    kept = {}
    for name, texts in (("docs.jsonl", 150), ("more.jsonl", 40)):
        lines = []
        for i, text in enumerate(_texts(rng, corpus, texts)):
            roll = rng.random()
            if roll < 0.05:
                lines.append("")
            elif roll < 0.1:
                lines.append(json.dumps({"id": f"empty-{i}", "text": ""}))
            record = {"text": text} if roll > 0.9 else {"id": f"{name}-{i}-é", "text": text}
            lines.append(json.dumps(record, ensure_ascii=False))
            kept[name, len(lines)] = (text, record.get("id", ""))
        (directory / name).write_text("\n".join(lines) + "\n", encoding="utf-8")
    url = str(directory / "docs.zarr")
    inputs = [str(directory / "docs.jsonl"), str(directory / "more.jsonl")]
    # small tasks: line numbers carried across several of them
    pack(inputs, url, {"kind": "bytes"}, workers=1, chunk_tokens=CHUNK, split_bytes=2000)
    return url, kept


@pytest.fixture(scope="module")
def parquet_records(tmp_path_factory, corpus):
    """A Parquet file of two row groups; returns (dataset url, {row: (text, id)})."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(6)
    directory = tmp_path_factory.mktemp("parquet")
    texts = _texts(rng, corpus, 80)
    ids = [f"row-{i}" for i in range(len(texts))]
    source = directory / "docs.parquet"
    pq.write_table(pa.table({"id": ids, "text": texts}), source, row_group_size=50)
    url = str(directory / "docs.zarr")
    pack([str(source)], url, {"kind": "bytes"}, workers=1, chunk_tokens=CHUNK)
    return url, {("docs.parquet", row): (text, ids[row]) for row, text in enumerate(texts)}


def expected_spans(dataset: PackedDataset, start: int, stop: int) -> list[tuple[int, int, int]]:
    """(document, start, stop) of each document overlapping [start, stop), from every offset."""
    offsets = np.asarray(dataset.doc_offsets[:])
    return [
        (k, max(int(a), start), min(int(b), stop))
        for k, (a, b) in enumerate(itertools.pairwise(offsets))
        if a < stop and b > start
    ]


def check_range(dataset: PackedDataset, start: int, stop: int, records: dict) -> None:
    spans = documents_in(dataset, start, stop)
    assert [(s.document, s.start, s.stop) for s in spans] == expected_spans(dataset, start, stop)
    tokens = np.concatenate([dataset.read(s.start, s.stop) for s in spans])
    np.testing.assert_array_equal(tokens, dataset.read(start, stop))
    tokenizer = BytesTokenizer()
    for span in spans:
        assert span.offset == span.start - start
        assert (span.cut_start, span.cut_end) == (span.doc_start < start, span.doc_stop > stop)
        text, record_id = records[Path(span.url).name, span.number]
        assert tokenizer.decode(dataset.document(span.document)) == text, span.where
        assert span.id == record_id, span.where


def test_every_window_s_documents_tile_it_and_name_their_jsonl_line(jsonl_records):
    url, records = jsonl_records
    dataset = PackedDataset(url)
    assert dataset.has_origins and dataset.n_chunks > 20
    assert {Path(s["url"]).name for s in dataset.meta["sources"]} == {"docs.jsonl", "more.jsonl"}
    n_windows = (dataset.n_tokens - 1) // SEQ_LEN
    for window in range(n_windows):
        check_range(dataset, window * SEQ_LEN, window * SEQ_LEN + SEQ_LEN + 1, records)
    first = documents_in(dataset, 0, 1)[0]
    assert first.where == f"{first.url}:{first.number}" and first.unit == "line"


def test_any_range_matches_the_documents_found_from_every_offset(jsonl_records):
    url, records = jsonl_records
    dataset = PackedDataset(url)
    rng = random.Random(1)
    n = dataset.n_tokens
    ranges = [(0, n), (n - 1, n), (0, 1), (CHUNK - 1, CHUNK + 1), (CHUNK, CHUNK + 1)]
    for _ in range(200):
        start = rng.randrange(n)
        ranges.append((start, min(n, start + rng.choice([1, 2, 63, 64, 65, 500]))))
    for start, stop in ranges:
        check_range(dataset, start, stop, records)


def test_parquet_documents_are_named_by_row(parquet_records):
    url, records = parquet_records
    dataset = PackedDataset(url)
    for start in range(0, dataset.n_tokens - SEQ_LEN, SEQ_LEN):
        check_range(dataset, start, start + SEQ_LEN + 1, records)
    first = documents_in(dataset, 0, 1)[0]
    assert (first.unit, first.number, first.id) == ("row", 0, "row-0")
    assert first.where == f"{first.url}, row 0"


def test_samples_list_the_documents_of_the_windows_a_mixture_reads(jsonl_records, parquet_records):
    urls = [jsonl_records[0], parquet_records[0]]
    data = open_windows(urls, SEQ_LEN, weights=[0.6, 0.4], seed=11)
    samples = np.arange(37, 37 + 64)
    batch = data.read(samples)
    found = sample_documents(data, samples)
    assert [f.sample for f in found] == samples.tolist()
    assert [f.source for f in found] == batch["sources"].tolist()
    assert {f.source for f in found} == {0, 1}
    for got, tokens in zip(found, batch["tokens"], strict=True):
        dataset = data.sources[got.source].dataset
        assert (got.start, got.stop) == (got.window * SEQ_LEN, got.window * SEQ_LEN + SEQ_LEN + 1)
        spans = [dataset.read(d.start, d.stop) for d in got.documents]
        np.testing.assert_array_equal(np.concatenate(spans), tokens)
        records = (jsonl_records, parquet_records)[got.source][1]
        for document in got.documents:
            assert records[Path(document.url).name, document.number][1] == document.id


class _Recorded:
    """An array that remembers how many entries each read took."""

    def __init__(self, array):
        self.array, self.reads = array, []

    def __getitem__(self, key):
        got = np.asarray(self.array[key])
        self.reads.append(got.size)
        return got


def test_only_the_offsets_of_the_chunks_a_range_touches_are_read(jsonl_records):
    dataset = PackedDataset(jsonl_records[0])
    recorded = dataset.doc_offsets = _Recorded(dataset.doc_offsets)
    for start in range(0, dataset.n_tokens - SEQ_LEN, SEQ_LEN // 3):
        documents_in(dataset, start, start + SEQ_LEN + 1)
    most_per_chunk = int(np.diff(dataset.chunk_docs).max())
    # a window of 41 tokens touches at most 2 chunks of 64: their documents, one before, one end
    assert max(recorded.reads) <= 2 * most_per_chunk + 2 < dataset.n_documents // 4


def test_a_dataset_without_provenance_or_a_range_outside_it_is_an_error(jsonl_records, tmp_path):
    url = str(tmp_path / "bare.zarr")
    shutil.copytree(jsonl_records[0], url)
    shutil.rmtree(f"{url}/doc_row")
    dataset = PackedDataset(url)
    assert not dataset.has_origins
    with pytest.raises(DatasetError, match=r"bare\.zarr records no provenance.*pack it again"):
        documents_in(dataset, 0, 10)
    for start, stop in ((-1, 3), (5, 5), (0, dataset.n_tokens + 1)):
        with pytest.raises(IndexError, match="outside"):
            documents_in(dataset, start, stop)
