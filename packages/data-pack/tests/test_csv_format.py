"""CSV and TSV inputs (the `csv` and `tsv` formats, added through the format registry alone): plain
and compressed files, cut into tasks after whole records, pack to exactly the tokens JSONL gives
for the same documents, each named by the line it starts on; quoted fields hold delimiters,
quotes and newlines; a missing column, a malformed row or header is one line naming `file:line`
and what to do (exit 2 from the command line), or with --skip-bad is counted."""

from __future__ import annotations

import csv
import gzip
import io
import itertools
import json

import numpy as np
import pytest
import zstandard

from llmtrain.data_pack.formats import installed_formats
from llmtrain.data_pack.pack import pack
from llmtrain.data_pack.sources import InputError, expand_inputs, plan_tasks
from llmtrain.data_pack.store import PackedDataset

BYTES = {"kind": "bytes"}
SKIP_LINES = "; fix the line, or pass --on-bad-line skip to skip and count such lines"


def _errors(stderr: str) -> list[str]:
    """The error lines of a command's stderr (its log lines go there too)."""
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def _texts(ds: PackedDataset) -> list[str]:
    tokens, offsets = ds.read(0, ds.n_tokens), ds.doc_offsets[:].tolist()
    return [
        tokens[a : b - 1].astype(np.uint8).tobytes().decode("utf-8")
        for a, b in itertools.pairwise(offsets)
    ]


def _origins(ds: PackedDataset) -> list[tuple[int, int, str]]:
    o = ds.origins(0, ds.n_documents)
    return list(zip(o.sources.tolist(), o.rows.tolist(), o.ids, strict=True))


def _delimited(records: list[dict[str, str]], delimiter: str) -> tuple[bytes, list[int]]:
    """The records written by Python's csv writer (a header, then a row each, CRLF line ends,
    quoting where needed), and the line each record starts on."""
    out = io.StringIO(newline="")
    writer = csv.DictWriter(out, fieldnames=list(records[0]), delimiter=delimiter)
    writer.writeheader()
    starts = []
    for record in records:
        starts.append(out.getvalue().count("\n") + 1)
        writer.writerow(record)
    return out.getvalue().encode("utf-8"), starts


@pytest.fixture(scope="module")
def records(corpus) -> list[dict[str, str]]:
    """Varied documents (newlines, CRLF, tabs, quotes, commas, control characters) with ids."""
    texts = corpus(240, seed=11)
    assert any("\n" in t for t in texts) and any("\t" in t for t in texts)
    assert any('"' in t for t in texts) and any("," in t for t in texts)
    return [
        {"id": f"doc-{k}", "text": t, "lang": "en" if k % 3 else "de"} for k, t in enumerate(texts)
    ]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, records) -> PackedDataset:
    """The same documents as JSONL, packed."""
    root = tmp_path_factory.mktemp("csv-ref")
    path = root / "same.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    pack([str(path)], str(root / "ds"), BYTES, workers=1)
    return PackedDataset(str(root / "ds"))


@pytest.mark.parametrize(
    ("name", "delimiter", "compress"),
    [
        ("corpus.csv", ",", None),
        ("corpus.tsv", "\t", None),
        ("corpus.csv.gz", ",", gzip.compress),
        ("corpus.tsv.zst", "\t", zstandard.ZstdCompressor().compress),
    ],
)
def test_csv_and_tsv_pack_the_tokens_of_the_same_jsonl(
    tmp_path, records, reference, name, delimiter, compress
):
    data, starts = _delimited(records, delimiter)
    path = tmp_path / name
    path.write_bytes(compress(data) if compress else data)
    split = 3000  # many tasks, cut after whole records: their fields hold newlines
    sources = expand_inputs([str(path)])
    assert [(s.format.name, s.compression) for s in sources] == [
        (name.split(".")[1], {".gz": "gzip", ".zst": "zstd"}.get(path.suffix))
    ]
    tasks = list(plan_tasks(sources, split))
    assert len(tasks) > 10
    assert [t.first_line for t in tasks] == sorted({t.first_line for t in tasks})
    assert {t.first_line for t in tasks} <= set(starts)  # every task starts at a record

    summary = pack([str(path)], str(tmp_path / "ds"), BYTES, workers=2, split_bytes=split)
    ds = PackedDataset(str(tmp_path / "ds"))
    assert summary.documents == ds.n_documents == len(records)
    assert ds.n_bytes == reference.n_bytes == sum(len(r["text"].encode()) for r in records)
    np.testing.assert_array_equal(ds.read(0, ds.n_tokens), reference.read(0, reference.n_tokens))
    np.testing.assert_array_equal(ds.doc_offsets[:], reference.doc_offsets[:])
    assert _origins(ds) == [(0, line, r["id"]) for line, r in zip(starts, records, strict=True)]
    [source] = ds.meta["sources"]
    assert (source["format"], source["unit"], source["kept"]) == (
        name.split(".")[1], "line", len(records)
    )  # fmt: skip


def test_quoted_fields_hold_delimiters_quotes_newlines_and_long_text(tmp_path):
    long = "word " * 40_000  # longer than the csv module's default field limit (128 Ki)
    data = (
        'id,text\r\n1,"He said ""hi"", then\nleft.\n"\r\n2,plain\r\n\r\n3,"a,b"\r\n'
        f'4,"{long}"\r\n5,last without a line end'
    )
    texts = ['He said "hi", then\nleft.\n', "plain", "a,b", long, "last without a line end"]
    for name, encoded in (("q.csv", data.encode()), ("q.csv.gz", gzip.compress(data.encode()))):
        out = tmp_path / f"{name}.zarr"
        (tmp_path / name).write_bytes(encoded)
        # a task a record: every cut falls after a record, never inside a quoted field
        summary = pack([str(tmp_path / name)], str(out), BYTES, workers=2, split_bytes=1)
        ds = PackedDataset(str(out))
        assert _texts(ds) == texts
        assert [(row, i) for _, row, i in _origins(ds)] == [
            (2, "1"), (5, "2"), (7, "3"), (8, "4"), (9, "5")
        ]  # fmt: skip
        assert summary.blank_lines == 1


def test_a_tsv_without_its_suffix_is_read_by_name_and_a_bom_is_no_part_of_the_header(
    tmp_path, run_cli
):
    path = tmp_path / "export"
    path.write_bytes("\ufefftext\tid\nfirst\ta\nsecond, with a comma\tb\n".encode())
    argv = ["data", "pack", path, "-o", tmp_path / "ds", "--tokenizer", "bytes"]
    assert run_cli(*argv, "--input-format", "tsv")[0] == 0
    ds = PackedDataset(str(tmp_path / "ds"))
    assert _texts(ds) == ["first", "second, with a comma"]
    assert [i for _, _, i in _origins(ds)] == ["a", "b"]


def test_where_and_ids_read_the_other_columns(tmp_path, records):
    data, starts = _delimited(records, ",")
    (tmp_path / "c.csv").write_bytes(data)
    pack([str(tmp_path / "c.csv")], str(tmp_path / "ds"), BYTES, where=["lang == 'de'"], workers=1)
    ds = PackedDataset(str(tmp_path / "ds"))
    kept = [(line, r) for line, r in zip(starts, records, strict=True) if r["lang"] == "de"]
    assert _texts(ds) == [r["text"] for _, r in kept]
    assert _origins(ds) == [(0, line, r["id"]) for line, r in kept]
    assert ds.meta["sources"][0]["dropped"] == len(records) - len(kept)


def test_a_missing_column_names_file_line_and_what_to_pass(tmp_path, run_cli):
    path = tmp_path / "notes.csv"
    path.write_text("id,body\n1,hello\n2,world\n")
    argv = ["data", "pack", path, "-o", tmp_path / "ds", "--tokenizer", "bytes"]
    code, _, err = run_cli(*argv)
    assert code == 2
    assert _errors(err) == [
        f"error: {path}:1: no column 'text' in the header (columns: id, body); pass --field "
        "with the column that holds the text"
    ]
    assert not (tmp_path / "ds").exists()
    assert run_cli(*argv, "--field", "body")[0] == 0
    assert _texts(PackedDataset(str(tmp_path / "ds"))) == ["hello", "world"]


@pytest.mark.parametrize(
    ("row", "why"),
    [
        ("2,two,extra", "3 fields where the header has 2 (a delimiter inside a field that is "
         "not quoted?)"),
        ('2,"quoted"then', "malformed CSV (',' expected after '\"')"),
        ("2,caf\xe9", "invalid UTF-8 at byte 5"),
        ('2,"never closed', "malformed CSV (unexpected end of data)"),
    ],
)  # fmt: skip
def test_a_bad_row_is_one_line_naming_its_line_or_is_counted(tmp_path, run_cli, row, why):
    path = tmp_path / "bad.csv"
    closing = "" if "never" in row else "\n3,three\n"
    path.write_bytes(b"id,text\n1,one\n" + row.encode("latin-1") + closing.encode())
    argv = ["data", "pack", path, "-o", tmp_path / "ds", "--tokenizer", "bytes"]
    code, _, err = run_cli(*argv)
    assert (code, _errors(err)) == (2, [f"error: {path}:3: {why}{SKIP_LINES}"])
    assert run_cli(*argv, "--on-bad-line", "skip")[0] == 0
    ds = PackedDataset(str(tmp_path / "ds"))
    assert _texts(ds) == (["one"] if "never" in row else ["one", "three"])
    assert ds.meta["bad_lines"] == [{"file": str(path), "line": 3, "reason": why}]
    assert ds.meta["counts"]["bad_lines"] == ds.meta["sources"][0]["bad"] == 1


def test_a_malformed_header_stops_the_pack_or_leaves_the_file_out(tmp_path):
    bad, good = tmp_path / "a.csv", tmp_path / "b.csv"
    bad.write_text('"id,text\n1,x\n')  # the quote never closes: no header at all
    good.write_text("text\nkept\n")
    inputs, out = [str(bad), str(good)], str(tmp_path / "ds")
    reason = "line 1: a malformed header (unexpected end of data)"
    with pytest.raises(InputError) as info:
        pack(inputs, out, BYTES, workers=1)
    assert str(info.value) == (
        f"{bad}:1: a malformed header (unexpected end of data); fix the header, or pass "
        "--skip-bad to leave the file out"
    )
    assert not (tmp_path / "ds").exists()
    pack(inputs, out, BYTES, workers=1, on_bad_line="skip")
    ds = PackedDataset(out)
    assert _texts(ds) == ["kept"]
    assert ds.meta["bad_lines"] == [{"file": str(bad), "reason": reason}]


def test_csv_and_tsv_are_entries_of_the_registry():
    formats = installed_formats()
    assert (formats["csv"].suffixes, formats["tsv"].suffixes) == ((".csv",), (".tsv",))
    assert formats.for_file("s3://bucket/x.TSV.gz").name == "tsv"
    assert formats.claims("export/part-0.csv.zst")


def test_train_tokenizer_reads_csv(tmp_path, records):
    from llmtrain.data_pack.documents import text_batches

    data, _ = _delimited(records, "\t")
    (tmp_path / "c.tsv").write_bytes(data)
    sources = expand_inputs([str(tmp_path / "c.tsv")])
    assert len(list(plan_tasks(sources, 2000))) > 10
    read = [text for texts, _ in text_batches(sources, "text", split_bytes=2000) for text in texts]
    assert read == [r["text"] for r in records]


def test_a_compressed_csv_cut_short_keeps_the_records_before_the_damage(tmp_path, records):
    data, _ = _delimited(records, ",")
    whole = gzip.compress(data)
    path = tmp_path / "cut.csv.gz"
    path.write_bytes(whole[: len(whole) // 2])
    out = str(tmp_path / "ds")
    with pytest.raises(InputError, match=rf"^{path}: cut short: .* whole lines; the file is "):
        pack([str(path)], out, BYTES, workers=1, split_bytes=2000)
    pack([str(path)], out, BYTES, workers=1, split_bytes=2000, on_bad_line="skip")
    ds = PackedDataset(out)
    kept = _texts(ds)
    assert 0 < len(kept) < len(records)
    assert kept == [r["text"] for r in records[: len(kept)]]
    assert ds.n_bytes == sum(len(text.encode()) for text in kept)
    assert ds.meta["sources"][0]["bad"] == 1
