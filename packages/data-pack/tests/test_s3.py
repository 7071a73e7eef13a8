"""Packing from and to S3 (a real S3 API: moto's server on 127.0.0.1, reached through s3fs)."""

from __future__ import annotations

import itertools
import json
import os

import fsspec
import numpy as np
import pytest

from llmtrain.core_mesh.errors import UserError
from llmtrain.data_pack.errors import DatasetError
from llmtrain.data_pack.merge import merge
from llmtrain.data_pack.pack import PackError, pack
from llmtrain.data_pack.report import inspect_dataset
from llmtrain.data_pack.sources import InputError
from llmtrain.data_pack.store import PackedDataset
from llmtrain.data_pack.tokenizer import HFOptions, HFTokenizer
from llmtrain.data_pack.train_tokenizer import train_tokenizer

BYTES = {"kind": "bytes"}


def _upload(local, url: str) -> None:
    with fsspec.open(url, "wb") as f:
        f.write(local.read_bytes())


def _documents(ds: PackedDataset) -> list[list[int]]:
    """Every document's tokens (without eod), from two reads: S3 requests are slow."""
    tokens = ds.read(0, ds.n_tokens).tolist()
    offsets = np.asarray(ds.doc_offsets[:]).tolist()
    return [tokens[a : b - 1] for a, b in itertools.pairwise(offsets)]


def _same(a: PackedDataset, b: PackedDataset) -> None:
    np.testing.assert_array_equal(a.read(0, a.n_tokens), b.read(0, b.n_tokens))
    np.testing.assert_array_equal(np.asarray(a.doc_offsets[:]), np.asarray(b.doc_offsets[:]))
    np.testing.assert_array_equal(a.chunk_docs, b.chunk_docs)
    assert a.dtype == b.dtype
    assert a.meta["counts"] == b.meta["counts"]
    assert a.fingerprint == b.fingerprint


def test_pack_s3_glob_to_s3_matches_local(tmp_path, moto_s3, write_jsonl, corpus, tokenizer_json):
    parts = [corpus(60, seed=s) for s in range(3)]
    local = [write_jsonl(f"part-{i}.jsonl", docs) for i, docs in enumerate(parts)]
    local.append(write_jsonl("part-3.jsonl.gz", corpus(40, seed=3)))
    for path in local:
        _upload(path, f"{moto_s3}/in/{path.name}")
    _upload(local[0], f"{moto_s3}/in/ignored.txt")
    tokenizer = {"kind": "hf", "path": str(tokenizer_json)}

    out = f"{moto_s3}/packed/ds"
    summary = pack(
        [f"{moto_s3}/in/part-*"], out, tokenizer, workers=2, split_bytes=1500, chunk_tokens=2048
    )
    assert summary.documents == 220
    pack([str(p) for p in local], str(tmp_path / "local"), tokenizer, workers=1, chunk_tokens=2048)
    remote = PackedDataset(out)
    _same(remote, PackedDataset(str(tmp_path / "local")))
    assert [{"url": s["url"], "bytes": s["bytes"]} for s in remote.meta["sources"]] == [
        {"url": f"{moto_s3}/in/{p.name}", "bytes": p.stat().st_size} for p in local
    ]
    tok = HFTokenizer(HFOptions(str(tokenizer_json)))
    everything = [t for docs in parts for t in docs] + corpus(40, seed=3)
    assert [tok.decode(doc) for doc in _documents(remote)] == everything
    np.testing.assert_array_equal(remote.document(219), tok.encode_batch(everything[219:])[0])
    # the dataset is plain objects under its prefix, group metadata included
    fs = fsspec.filesystem("s3")
    assert sorted(p.rsplit("/", 1)[1] for p in fs.ls(out.removeprefix("s3://"))) == [
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

    report = json.loads(inspect_dataset(out, as_json=True, window=32))
    assert report["counts"] == remote.meta["counts"]
    assert report["sample"]["text"] == tok.decode(report["sample"]["ids"])
    assert len(report["sample"]["ids"]) == 32


def test_inspect_and_merge_on_s3_through_the_cli(tmp_path, moto_s3, run_cli, write_jsonl, texts):
    data = write_jsonl("corpus.jsonl", texts)
    _upload(data, f"{moto_s3}/corpus.jsonl")
    logs = tmp_path / "logs"
    code, stdout, stderr = run_cli(
        "data", "pack", f"{moto_s3}/corpus.jsonl", "-o", f"{moto_s3}/a", "--tokenizer", "bytes",
        "--workers", 1, "--split-mb", 0.003, "--log-dir", logs,
    )  # fmt: skip
    assert code == 0, stderr
    assert stdout.startswith(f"{moto_s3}/a: 300 documents, ")
    code, stdout, _ = run_cli("data", "inspect", f"{moto_s3}/a", "--log-dir", logs)
    assert code == 0
    assert f"{moto_s3}/a\n  documents   300 (" in stdout
    assert "  tokenizer   bytes (vocab 258, eod 256, " in stdout

    code, stdout, stderr = run_cli(
        "data", "merge", f"{moto_s3}/a", f"{moto_s3}/a", "-o", f"{moto_s3}/twice", "--log-dir", logs
    )
    assert code == 0, stderr
    once, twice = PackedDataset(f"{moto_s3}/a"), PackedDataset(f"{moto_s3}/twice")
    assert (twice.n_documents, twice.n_tokens) == (600, 2 * once.n_tokens)
    np.testing.assert_array_equal(twice.document(300), once.document(0))
    np.testing.assert_array_equal(twice.document(599), once.document(299))


def test_storage_options_on_the_command_line(tmp_path, monkeypatch, moto_s3, run_cli, write_jsonl):
    endpoint = os.environ["AWS_ENDPOINT_URL"]
    data = write_jsonl("corpus.jsonl", ["one", "two"])
    _upload(data, f"{moto_s3}/corpus.jsonl")
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    options = ["--storage-option", f"endpoint_url={endpoint}"]
    code, _, stderr = run_cli(
        "data", "pack", f"{moto_s3}/corpus.jsonl", "-o", f"{moto_s3}/ds", "--tokenizer", "bytes",
        "--workers", 2, *options, "--log-dir", tmp_path / "logs",
    )  # fmt: skip
    assert code == 0, stderr
    ds = PackedDataset(f"{moto_s3}/ds", storage_options={"endpoint_url": endpoint})
    assert [bytes(doc).decode() for doc in _documents(ds)] == ["one", "two"]
    code, stdout, _ = run_cli(
        "data", "inspect", f"{moto_s3}/ds", "--json", *options, "--log-dir", tmp_path / "logs"
    )
    assert code == 0
    assert json.loads(stdout)["counts"]["documents"] == 2


def test_missing_s3_inputs(moto_s3):
    with pytest.raises(InputError, match=f"^{moto_s3}/nope.jsonl: no such file$"):
        pack([f"{moto_s3}/nope.jsonl"], f"{moto_s3}/ds", BYTES, workers=1)
    with pytest.raises(InputError, match=r"no file matches$"):
        pack([f"{moto_s3}/in/*.jsonl"], f"{moto_s3}/ds", BYTES, workers=1)
    assert not fsspec.filesystem("s3", skip_instance_cache=True).exists(f"{moto_s3}/ds")


def test_failed_pack_commits_nothing_on_s3(moto_s3, write_jsonl, texts):
    lines = [json.dumps({"text": t}) for t in texts]
    lines.insert(200, '{"text": 1}')
    url = f"{moto_s3}/bad.jsonl"
    with fsspec.open(url, "w") as f:
        f.write("\n".join(lines) + "\n")
    out = f"{moto_s3}/ds"
    with pytest.raises(PackError, match=f"^{url}:201: field is int, not a string"):
        pack([url], out, BYTES, workers=1, split_bytes=2000, chunk_tokens=4096)
    with pytest.raises(DatasetError, match="not a packed dataset"):
        PackedDataset(out)
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    assert not fs.exists(out)


def test_overwrite_on_s3(tmp_path, moto_s3, write_jsonl, corpus):
    big = write_jsonl("big.jsonl", corpus(60, seed=1))
    small = write_jsonl("small.jsonl", corpus(10, seed=2))
    for path in (big, small):
        _upload(path, f"{moto_s3}/{path.name}")
    out = f"{moto_s3}/ds"
    pack([f"{moto_s3}/big.jsonl"], out, BYTES, workers=1, chunk_tokens=1024)
    n_chunks = PackedDataset(out).n_chunks
    with pytest.raises(UserError, match="already exists; pass --overwrite"):
        pack([f"{moto_s3}/small.jsonl"], out, BYTES, workers=1, chunk_tokens=1024)
    assert PackedDataset(out).n_documents == 60

    pack([f"{moto_s3}/small.jsonl"], out, BYTES, workers=1, chunk_tokens=1024, overwrite=True)
    ds = PackedDataset(out)
    assert ds.n_documents == 10
    assert [bytes(doc).decode() for doc in _documents(ds)] == corpus(10, seed=2)
    pack([str(small)], str(tmp_path / "local"), BYTES, workers=1, chunk_tokens=1024)
    _same(ds, PackedDataset(str(tmp_path / "local")))
    # no chunk of the old, larger dataset is left behind
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    chunks = fs.find(f"{out.removeprefix('s3://')}/tokens/c")
    assert len(chunks) == ds.n_chunks < n_chunks


def test_failed_overwrite_on_s3_leaves_no_dataset(moto_s3, write_jsonl):
    good = write_jsonl("good.jsonl", ["fine"])
    bad = write_jsonl("bad.jsonl", ["fine", {"text": None}])
    for path in (good, bad):
        _upload(path, f"{moto_s3}/{path.name}")
    out = f"{moto_s3}/ds"
    pack([f"{moto_s3}/good.jsonl"], out, BYTES, workers=1)
    with pytest.raises(PackError, match=r"bad\.jsonl:2: field is NoneType"):
        pack([f"{moto_s3}/bad.jsonl"], out, BYTES, workers=1, overwrite=True)
    # object storage cannot swap atomically: the old dataset went first, and nothing half-written
    # looks complete
    with pytest.raises(DatasetError):
        PackedDataset(out)


def test_merge_into_one_of_its_inputs_on_s3(moto_s3, write_jsonl):
    """`merge s3://.../a s3://.../b -o s3://.../a --overwrite` (append b to a) must either work as
    it does locally or refuse, leaving a intact; never lose a or commit a corrupt dataset."""
    a = write_jsonl("a.jsonl", ["first", "second"])
    b = write_jsonl("b.jsonl", ["third"])
    for path in (a, b):
        _upload(path, f"{moto_s3}/{path.name}")
    pack([f"{moto_s3}/a.jsonl"], f"{moto_s3}/a", BYTES, workers=1)
    pack([f"{moto_s3}/b.jsonl"], f"{moto_s3}/b", BYTES, workers=1)
    try:
        merge([f"{moto_s3}/a", f"{moto_s3}/b"], f"{moto_s3}/a", overwrite=True)
        expected = ["first", "second", "third"]
    except UserError:
        expected = ["first", "second"]
    ds = PackedDataset(f"{moto_s3}/a")
    assert [bytes(doc).decode() for doc in _documents(ds)] == expected
    assert ds.meta["counts"]["tokens"] == ds.n_tokens == int(ds.doc_offsets[ds.n_documents])


def test_tokenizer_and_training_on_s3(tmp_path, moto_s3, write_jsonl, corpus):
    data = write_jsonl("corpus.jsonl", corpus(300, seed=5))
    _upload(data, f"{moto_s3}/corpus.jsonl")
    tokenizer_url = f"{moto_s3}/tok/tokenizer.json"
    reached = train_tokenizer([f"{moto_s3}/*.jsonl"], tokenizer_url, vocab_size=300)
    assert reached == 300
    out = f"{moto_s3}/ds"
    pack([f"{moto_s3}/corpus.jsonl"], out, {"kind": "hf", "path": tokenizer_url}, workers=1)
    ds = PackedDataset(out)
    assert ds.meta["tokenizer"]["spec"]["path"] == tokenizer_url
    tok = HFTokenizer(HFOptions(tokenizer_url))
    assert ds.fingerprint == tok.fingerprint
    assert [tok.decode(doc) for doc in _documents(ds)] == corpus(300, seed=5)
    with pytest.raises(UserError, match="is one of the inputs"):
        merge([out], out)
