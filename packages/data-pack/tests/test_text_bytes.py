"""The dataset's `counts.bytes` (`PackedDataset.n_bytes`): the UTF-8 bytes of exactly the text
that was tokenized, so that evaluation can turn nats per token into bits per byte. It leaves out
what the pack did not keep (bad lines, records the filter dropped, documents over the size limit,
blank lines), JSON's escapes and line ends; a dataset packed before it was counted opens with
None; merge sums it when every input has it and leaves it out otherwise; the metadata check
refuses a count that is not one; `inspect`, `pack` and `merge` show it."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest

from llmtrain.data_pack.documents import UTF8_PIECE_CHARS, utf8_size
from llmtrain.data_pack.errors import DatasetError
from llmtrain.data_pack.merge import merge
from llmtrain.data_pack.pack import pack
from llmtrain.data_pack.report import inspect_dataset
from llmtrain.data_pack.store import PackedDataset

BYTES = {"kind": "bytes"}
MAX_DOC_BYTES = 1000


def _utf8(texts: list[str]) -> int:
    return sum(len(t.encode("utf-8")) for t in texts)


def _texts(ds: PackedDataset) -> list[str]:
    """The documents of a dataset packed with the bytes tokenizer, decoded."""
    tokens, offsets = ds.read(0, ds.n_tokens), ds.doc_offsets[:].tolist()
    return [
        tokens[a : b - 1].astype("uint8").tobytes().decode() for a, b in itertools.pairwise(offsets)
    ]


def _edit_counts(ds: Path, edit) -> None:
    """Edit the counts in a dataset's group metadata (as a dataset packed before `bytes` reads)."""
    group = ds / "zarr.json"
    meta = json.loads(group.read_text())
    edit(meta["attributes"]["llmtrain"]["counts"])
    group.write_text(json.dumps(meta))


def _forget_bytes(ds: Path, *also: str) -> Path:
    def edit(counts: dict) -> None:
        for key in ("bytes", *also):
            del counts[key]

    _edit_counts(ds, edit)
    return ds


@pytest.fixture
def mixed(tmp_path, corpus) -> tuple[Path, list[str]]:
    """A JSONL file (non-ASCII text, some of it \\u-escaped) whose lines are kept, dropped by
    `--where keep`, bad (malformed, no text, a number for text, a field the filter lacks), too
    long, empty or blank; and the texts a pack with --where keep and --skip-bad keeps, in order."""
    rng = random.Random(3)
    lines, kept = [], []
    for k, text in enumerate(corpus(240, seed=9)):
        keep = rng.random() < 0.7
        lines.append(json.dumps({"text": text, "keep": keep}, ensure_ascii=k % 2 == 0))
        if keep:
            kept.append(text)
        if k % 17 == 0:
            lines += [
                '{"text": "cut short',  # malformed
                json.dumps({"keep": True}),  # no text
                json.dumps({"text": 5, "keep": True}),  # not a string
                json.dumps({"text": "no keep field"}),  # the filter cannot judge it
                json.dumps({"text": "é" * (MAX_DOC_BYTES // 2 + 1), "keep": True}),  # too long
                json.dumps({"text": "", "keep": True}),  # empty
                "   ",  # blank
            ]
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert len(kept) > 100 and any(not t.isascii() for t in kept)
    return path, kept


@pytest.mark.parametrize(("workers", "split_bytes"), [(1, 1 << 20), (2, 4000)])
def test_bytes_are_the_utf8_of_the_documents_kept(tmp_path, mixed, workers, split_bytes):
    path, kept = mixed
    out = tmp_path / "ds"
    summary = pack(
        [str(path)], str(out), BYTES, workers=workers, split_bytes=split_bytes,
        where=["keep"], on_bad_line="skip", max_doc_bytes=MAX_DOC_BYTES,
    )  # fmt: skip
    ds = PackedDataset(str(out))
    assert _texts(ds) == kept
    expected = _utf8(kept)
    assert ds.n_bytes == ds.meta["counts"]["bytes"] == summary.n_bytes == expected
    # one token a byte plus each document's eod: the bytes tokenizer agrees
    assert ds.n_tokens - ds.n_documents == expected
    # bytes, not characters, escapes or the file's size
    assert expected > sum(map(len, kept))
    assert expected < path.stat().st_size
    counts = ds.meta["counts"]
    assert counts["bad_lines"] == 5 * 15 and counts["dropped"] == 240 - len(kept)
    assert (counts["empty_documents"], counts["blank_lines"]) == (15, 15)


def test_utf8_size_of_long_and_odd_texts():
    texts = ["", "ascii", "naïve café 日本語 😀", "\ud800 lone", "é" * (UTF8_PIECE_CHARS + 3)]
    texts.append("😀" * (2 * UTF8_PIECE_CHARS + 1))
    for text in texts:
        assert utf8_size(text) == len(text.encode("utf-8", "surrogatepass"))


def test_a_dataset_packed_before_bytes_were_counted(tmp_path, write_jsonl, texts):
    data = write_jsonl("a.jsonl", texts[:50])
    pack([str(data)], str(tmp_path / "new"), BYTES, workers=1)
    pack([str(data)], str(tmp_path / "old"), BYTES, workers=1)
    new, old = (
        PackedDataset(str(tmp_path / "new")),
        PackedDataset(str(_forget_bytes(tmp_path / "old"))),
    )
    assert new.n_bytes == _utf8(texts[:50])
    assert old.n_bytes is None and "bytes" not in old.meta["counts"]
    assert (old.n_tokens, old.n_documents) == (new.n_tokens, new.n_documents)
    assert _texts(old) == texts[:50]

    report = json.loads(inspect_dataset(str(old.url), as_json=True))
    assert report["bytes_per_token"] is None
    assert "  text        bytes not counted (packed, or merged from" in inspect_dataset(old.url)
    report = json.loads(inspect_dataset(new.url, as_json=True))
    assert report["bytes_per_token"] == new.n_bytes / new.n_tokens
    assert report["counts"]["bytes"] == new.n_bytes


@pytest.mark.parametrize("value", [-1, "many", 1.5, True, None])
def test_a_bytes_count_that_is_not_one_is_refused(tmp_path, write_jsonl, value):
    data = write_jsonl("a.jsonl", ["hello", "wörld"])
    out = tmp_path / "ds"
    pack([str(data)], str(out), BYTES, workers=1)
    assert PackedDataset(str(out)).n_bytes == 11
    _edit_counts(out, lambda counts: counts.update(bytes=value))
    with pytest.raises(DatasetError, match=f"count 'bytes' is {json.dumps(value)}, not a count"):
        PackedDataset(str(out))


def test_merge_sums_the_bytes(tmp_path, run_cli, write_jsonl, texts):
    parts = [texts[:100], texts[100:130], texts[130:]]
    for k, part in enumerate(parts):
        pack([str(write_jsonl(f"{k}.jsonl", part))], str(tmp_path / f"p{k}"), BYTES, workers=1)
    out = tmp_path / "merged"
    code, stdout, stderr = run_cli(
        "data", "merge", *(tmp_path / f"p{k}" for k in range(3)), "-o", out,
        "--log-dir", tmp_path / "l",
    )  # fmt: skip
    assert code == 0, stderr
    merged = PackedDataset(str(out))
    expected = _utf8(texts)
    assert merged.n_bytes == merged.meta["counts"]["bytes"] == expected
    assert merged.n_tokens - merged.n_documents == expected
    per_token = expected / merged.n_tokens
    assert stdout == (
        f"{out}: 300 documents, {merged.n_tokens} tokens, {expected:,} bytes of text, "
        f"{per_token:.2f} bytes a token\n"
    )


@pytest.mark.parametrize("old_first", [False, True])
def test_merge_of_old_and_new_datasets_leaves_the_bytes_out(
    tmp_path, run_cli, write_jsonl, texts, old_first
):
    pack([str(write_jsonl("a.jsonl", texts[:120]))], str(tmp_path / "new"), BYTES, workers=1)
    pack([str(write_jsonl("b.jsonl", texts[120:]))], str(tmp_path / "old"), BYTES, workers=1)
    _forget_bytes(tmp_path / "old", "dropped")  # from before filters, too
    new, old = PackedDataset(str(tmp_path / "new")), PackedDataset(str(tmp_path / "old"))
    inputs = (
        [tmp_path / "old", tmp_path / "new"] if old_first else [tmp_path / "new", tmp_path / "old"]
    )
    out = tmp_path / "merged"
    code, stdout, stderr = run_cli("data", "merge", *inputs, "-o", out, "--log-dir", tmp_path / "l")
    assert code == 0, stderr
    assert stdout == f"{out}: 300 documents, {new.n_tokens + old.n_tokens} tokens\n"
    merged = PackedDataset(str(out))
    assert merged.n_bytes is None
    assert merged.meta["counts"] == {
        "documents": 300,
        "tokens": new.n_tokens + old.n_tokens,
        "empty_documents": 0,
        "blank_lines": 0,
        "bad_lines": 0,
    }
    # the Python API says the same
    summary = merge([str(p) for p in inputs], str(tmp_path / "again"))
    assert (summary.documents, summary.n_bytes) == (300, None)


def test_pack_and_inspect_show_the_bytes(tmp_path, run_cli, write_jsonl, texts):
    data = write_jsonl("corpus.jsonl", texts)
    out = tmp_path / "ds"
    logs = tmp_path / "logs"
    code, stdout, stderr = run_cli(
        "data", "pack", data, "-o", out, "--tokenizer", "bytes", "--workers", 1, "--no-progress",
        "--log-dir", logs,
    )  # fmt: skip
    assert code == 0, stderr
    expected = _utf8(texts)
    n_tokens = expected + 300
    line = f"; {expected:,} bytes of text, {expected / n_tokens:.2f} bytes a token\n"
    assert stdout.startswith(f"{out}: 300 documents, {n_tokens} tokens (0 empty skipped) in ")
    assert stdout.endswith(line)
    events = [json.loads(line) for line in (logs / "rank0.jsonl").read_text().splitlines()]
    assert [e["utf8_bytes"] for e in events if e["event"] == "pack.done"] == [expected]
    code, stdout, stderr = run_cli("data", "inspect", out, "--log-dir", logs)
    assert code == 0, stderr
    lines = stdout.splitlines()
    assert lines[2].startswith(f"  tokens      {n_tokens:,} ")
    assert lines[3] == (
        f"  text        {expected:,} bytes of text, {expected / n_tokens:.2f} bytes a token"
    )
