"""Inputs other than JSONL: Parquet (globs, directory trees, row groups), Arrow (IPC files and
`datasets.save_to_disk` directories) and plain text pack to exactly the tokens JSONL gives, each
document named by its file and row or line; `--where` keeps exactly the rows pyarrow.compute
keeps; damaged or unfitting inputs are one-line errors naming file, row group or row and column,
or with --skip-bad are counted per file; a killed pack leaves nothing that opens."""

from __future__ import annotations

import glob
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import datasets
import numpy as np
import psutil
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from llmtrain.core_mesh.errors import UserError
from llmtrain.data_pack.errors import DatasetError
from llmtrain.data_pack.pack import PackError, pack
from llmtrain.data_pack.sources import InputError
from llmtrain.data_pack.store import PackedDataset
from llmtrain.data_pack.train_tokenizer import train_tokenizer

BYTES = {"kind": "bytes"}
SKIP_HINT = "; pass --skip-bad to skip and count such rows and files"


def _hf(path) -> dict:
    return {"kind": "hf", "path": str(path)}


def _arrays(ds: PackedDataset) -> tuple[np.ndarray, np.ndarray]:
    return ds.read(0, ds.n_tokens), np.asarray(ds.doc_offsets[:])


def _texts(ds: PackedDataset) -> list[str]:
    """The documents of a dataset packed with the bytes tokenizer, decoded."""
    tokens, offsets = _arrays(ds)
    return [
        tokens[a : b - 1].astype(np.uint8).tobytes().decode("utf-8")
        for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True)
    ]


def _origins(ds: PackedDataset) -> list[tuple[str, int, str]]:
    """(file, row or line, id) of every document."""
    o = ds.origins(0, ds.n_documents)
    urls = [s["url"] for s in ds.meta["sources"]]
    return [
        (urls[s], r, i) for s, r, i in zip(o.sources.tolist(), o.rows.tolist(), o.ids, strict=True)
    ]


def _tally(ds: PackedDataset) -> list[tuple[int, int, int]]:
    """(kept, dropped, bad) of every input file."""
    return [(s["kept"], s["dropped"], s["bad"]) for s in ds.meta["sources"]]


def _jsonl(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


# -- the same records in every format ----------------------------------------------------------


class Corpus:
    """One corpus written in every input format, each file with the (file, number, id) of every
    record, in pack order."""

    def __init__(self, root: Path, texts: list[str]):
        self.root = root
        self.texts = texts
        self.ids = [f"doc-{i:03d}" for i in range(len(texts))]
        n = len(texts)
        records = [
            {"text": t, "id": i, "meta": {"body": t, "lang": "en"}}
            for t, i in zip(texts, self.ids, strict=True)
        ]
        self.table = pa.Table.from_pylist(records)
        self.jsonl = _jsonl(root / "corpus.jsonl", records)
        self.origins = {"jsonl": [(str(self.jsonl), k + 1, self.ids[k]) for k in range(n)]}

        # a directory tree as crawls publish it, each file several row groups
        parts = [("CC-MAIN-2024-10", "part-000", 0, 60), ("CC-MAIN-2024-10", "part-001", 60, 95)]
        parts.append(("CC-MAIN-2024-18", "part-000", 95, n))
        self.tree = root / "data"
        expected = []
        for crawl, name, begin, end in parts:
            path = self.tree / crawl / f"{name}.parquet"
            path.parent.mkdir(parents=True, exist_ok=True)
            pq.write_table(self.table.slice(begin, end - begin), path, row_group_size=16)
            assert pq.ParquetFile(path).metadata.num_row_groups > 1
            expected += [(str(path), k - begin, self.ids[k]) for k in range(begin, end)]
        self.origins["parquet"] = expected

        large = pa.table(
            {
                "text": pa.array(texts, pa.large_string()),
                "id": pa.array(self.ids, pa.large_string()),
            }
        )
        self.large_parquet = root / "large.parquet"
        pq.write_table(large, self.large_parquet, row_group_size=40)
        self.arrow_file = root / "corpus.arrow"
        with pa.ipc.new_file(self.arrow_file, large.schema) as writer:
            for batch in large.to_batches(max_chunksize=25):
                writer.write_batch(batch)
        for name, path in (("large_parquet", self.large_parquet), ("arrow_file", self.arrow_file)):
            self.origins[name] = [(str(path), k, self.ids[k]) for k in range(n)]

        # the published layout: state.json naming .arrow stream files
        self.arrow_dataset = root / "hf"
        dataset = datasets.Dataset.from_dict({"text": texts, "id": self.ids})
        dataset.save_to_disk(str(self.arrow_dataset), num_shards=2)
        state = json.loads((self.arrow_dataset / "state.json").read_text())
        expected = []
        done = 0
        for entry in state["_data_files"]:
            path = self.arrow_dataset / entry["filename"]
            with pa.memory_map(str(path)) as f:
                rows = pa.ipc.open_stream(f).read_all().num_rows
            expected += [(str(path), k, self.ids[done + k]) for k in range(rows)]
            done += rows
        assert done == n and len(state["_data_files"]) == 2
        self.origins["arrow_dataset"] = expected

        self.text_dir = root / "txt"
        self.text_dir.mkdir()
        for k, text in enumerate(texts):
            (self.text_dir / f"{k:03d}.txt").write_bytes(text.encode("utf-8"))
        self.origins["text_files"] = [
            (str(self.text_dir / f"{k:03d}.txt"), None, "") for k in range(n)
        ]

        # one document per line: no line breaks inside, CRLF line ends, a blank line that
        # counts as a line
        self.flat = [t.replace("\r", " ").replace("\n", " ") for t in texts]
        self.flat_jsonl = _jsonl(root / "flat.jsonl", [{"text": t} for t in self.flat])
        lines = [*self.flat[:10], "", *self.flat[10:]]
        self.lines = root / "lines.txt"
        self.lines.write_bytes("".join(line + "\r\n" for line in lines).encode("utf-8"))
        self.origins["text_lines"] = [(str(self.lines), k + 1 + (k >= 10), "") for k in range(n)]


@pytest.fixture(scope="module")
def formats(tmp_path_factory, corpus, tokenizer_json) -> dict:
    """The corpus in every format, and the reference packs of its JSONL."""
    root = tmp_path_factory.mktemp("formats")
    c = Corpus(root, corpus(150, seed=7))
    refs = {}
    for name, path in (("text", c.jsonl), ("flat", c.flat_jsonl)):
        pack([str(path)], str(root / f"ref-{name}"), _hf(tokenizer_json), workers=1)
        refs[name] = PackedDataset(str(root / f"ref-{name}"))
    return {"corpus": c, "refs": refs}


# name: (inputs, pack options, workers, the origins to expect, the reference pack)
FORMATS = {
    "parquet-glob": (lambda c: [f"{c.tree}/*/*.parquet"], {}, 2, "parquet", "text"),
    "parquet-directory": (lambda c: [str(c.tree)], {}, 1, "parquet", "text"),
    "parquet-struct-field": (
        lambda c: [str(c.tree)],
        {"field": "meta.body"},
        1,
        "parquet",
        "text",
    ),
    "parquet-large-string": (lambda c: [str(c.large_parquet)], {}, 1, "large_parquet", "text"),
    "arrow-file-large-string": (lambda c: [str(c.arrow_file)], {}, 1, "arrow_file", "text"),
    "arrow-dataset": (lambda c: [str(c.arrow_dataset)], {}, 2, "arrow_dataset", "text"),
    "text-files": (lambda c: [str(c.text_dir)], {}, 2, "text_files", "text"),
    "text-lines": (lambda c: [str(c.lines)], {"text_per_line": True}, 1, "text_lines", "flat"),
}


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_every_format_packs_the_tokens_jsonl_gives(formats, tokenizer_json, tmp_path, name):
    inputs, options, workers, origins, ref = FORMATS[name]
    c = formats["corpus"]
    out = tmp_path / "ds"
    summary = pack(
        inputs(c), str(out), _hf(tokenizer_json), workers=workers, split_bytes=2000, **options
    )
    ds, reference = PackedDataset(str(out)), formats["refs"][ref]
    assert summary.documents == ds.n_documents == len(c.texts)
    tokens, offsets = _arrays(ds)
    ref_tokens, ref_offsets = _arrays(reference)
    assert tokens.dtype == ref_tokens.dtype
    np.testing.assert_array_equal(tokens, ref_tokens)
    np.testing.assert_array_equal(offsets, ref_offsets)
    got = _origins(ds)
    expected = c.origins[origins]
    if name == "text-files":  # a whole file is the document: no row to name
        got = [(url, None, i) for url, _, i in got]
    assert got == expected
    files = sorted({url for url, _, _ in expected}, key=[u for u, _, _ in expected].index)
    assert [s["url"] for s in ds.meta["sources"]] == files
    assert sum(s["kept"] for s in ds.meta["sources"]) == len(c.texts)
    assert ds.meta["counts"]["blank_lines"] == (1 if name == "text-lines" else 0)
    # the text tokenized, in UTF-8: not the file's bytes (CRLF line ends, Parquet's encoding)
    texts = c.flat if ref == "flat" else c.texts
    assert ds.n_bytes == summary.n_bytes == reference.n_bytes == sum(len(t.encode()) for t in texts)


def test_jsonl_origins_are_one_based_lines(formats):
    assert _origins(formats["refs"]["text"]) == formats["corpus"].origins["jsonl"]


def test_a_null_struct_is_a_null_text_whatever_its_child_holds(tmp_path):
    # StructArray.field() ignores the struct's own nulls: row 1's child still holds "hidden"
    bodies = pa.array(["first", "hidden", "third"])
    meta = pa.StructArray.from_arrays([bodies], names=["body"], mask=pa.array([False, True, False]))
    table = pa.table({"meta": meta})
    path = tmp_path / "nested.arrow"
    with pa.ipc.new_file(path, table.schema) as writer:
        writer.write_table(table)
    out = tmp_path / "ds"
    with pytest.raises(PackError, match=rf"^{path}, row 1: column 'meta.body' is null{SKIP_HINT}$"):
        pack([str(path)], str(out), BYTES, field="meta.body", workers=1)
    summary = pack([str(path)], str(out), BYTES, field="meta.body", workers=1, on_bad_line="skip")
    ds = PackedDataset(str(out))
    assert _texts(ds) == ["first", "third"]
    assert summary.bad_lines == 1
    assert ds.meta["bad_lines"] == [
        {"file": str(path), "row": 1, "reason": "column 'meta.body' is null"}
    ]


def test_categorical_string_columns_are_text(tmp_path):
    texts = ["alpha", "beta", "alpha", "gamma"]
    path = tmp_path / "categories.parquet"
    pq.write_table(pa.table({"text": pa.array(texts).dictionary_encode()}), path)
    assert pa.types.is_dictionary(pq.ParquetFile(path).schema_arrow.field("text").type)
    pack([str(path)], str(tmp_path / "ds"), BYTES, workers=1)
    assert _texts(PackedDataset(str(tmp_path / "ds"))) == texts


def test_globs_and_directory_trees(tmp_path):
    """A glob of directories reads each; a tree holds Parquet, JSONL and save_to_disk datasets
    (read as datasets, their bookkeeping .json never as JSONL), even below a hidden directory,
    but no hidden or underscore files (Spark's _SUCCESS) inside it."""
    root = tmp_path / ".cache" / "tree"
    files = []
    for crawl in ("b-crawl", "a-crawl"):
        path = root / crawl / "x.parquet"
        path.parent.mkdir(parents=True)
        pq.write_table(pa.table({"text": [f"{crawl} {k}" for k in range(3)]}), path)
        files.insert(0, str(path))
    (root / "a-crawl" / "_SUCCESS").write_text("")
    pq.write_table(pa.table({"text": ["hidden"]}), root / "a-crawl" / ".x.parquet")
    hf = root / "c-hf"
    datasets.Dataset.from_dict({"text": ["d0", "d1", "d2", "d3"]}).save_to_disk(
        str(hf), num_shards=2
    )
    _jsonl(root / "d" / "e.jsonl", [{"text": "from jsonl"}])
    out = tmp_path / "ds"
    pack([str(root)], str(out), BYTES, workers=1)
    ds = PackedDataset(str(out))
    assert [s["url"] for s in ds.meta["sources"]] == [
        *files,
        str(hf / "data-00000-of-00002.arrow"),
        str(hf / "data-00001-of-00002.arrow"),
        str(root / "d" / "e.jsonl"),
    ]
    assert [s.get("dataset") for s in ds.meta["sources"]] == [None, None, str(hf), str(hf), None]
    assert _texts(ds) == [
        *(f"a-crawl {k}" for k in range(3)),
        *(f"b-crawl {k}" for k in range(3)),
        "d0",
        "d1",
        "d2",
        "d3",
        "from jsonl",
    ]
    pack([str(root / "?-crawl")], str(out), BYTES, workers=1, overwrite=True)
    assert [s["url"] for s in PackedDataset(str(out)).meta["sources"]] == files


# -- filters -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def scored(tmp_path_factory, corpus) -> dict:
    """400 records with ints, floats, strings and a struct, each with nulls, as two Parquet and
    two JSONL files (250 + 150 records)."""
    import random

    rng = random.Random(5)
    root = tmp_path_factory.mktemp("scored")

    def maybe(value, p=0.15):
        return None if rng.random() < p else value

    texts = [f"{k}: {t}" for k, t in enumerate(corpus(400, seed=4))]
    records = [
        {
            "text": t,
            "id": k,
            "score": maybe(rng.randint(0, 5)),
            "quality": maybe(round(rng.random(), 3)),
            "lang": maybe(rng.choice(["en", "de", "fr"])),
            "meta": maybe(
                {
                    "source": maybe(rng.choice(["web", "books"])),
                    "year": maybe(rng.randint(2015, 2024)),
                },
                0.1,
            ),
        }
        for k, t in enumerate(texts)
    ]
    schema = pa.schema(
        [
            ("text", pa.string()),
            ("id", pa.int64()),
            ("score", pa.int64()),
            ("quality", pa.float64()),
            ("lang", pa.string()),
            ("meta", pa.struct([("source", pa.string()), ("year", pa.int32())])),
        ]
    )
    table = pa.Table.from_pylist(records, schema)
    parts = {"parquet": [], "jsonl": []}
    for name, begin, end in (("a", 0, 250), ("b", 250, 400)):
        path = root / f"{name}.parquet"
        pq.write_table(table.slice(begin, end - begin), path, row_group_size=64)
        parts["parquet"].append(path)
        parts["jsonl"].append(_jsonl(root / f"{name}.jsonl", records[begin:end]))
    return {"table": table, "files": parts, "bounds": [(0, 250), (250, 400)]}


# expressions and the same filter in pyarrow.compute (`&`, `|`: and_kleene, or_kleene)
FILTERS = {
    "int": (["score >= 3"], pc.field("score") >= 3),
    "float-and-string": (
        ["quality > 0.5", "lang != 'fr'"],
        (pc.field("quality") > 0.5) & (pc.field("lang") != "fr"),
    ),
    "in-or": (
        ["lang in ['en', 'de'] or score == 5"],
        ((pc.field("lang") == "en") | (pc.field("lang") == "de")) | (pc.field("score") == 5),
    ),
    "struct": (
        ["meta.source == 'web' and meta.year >= 2020"],
        (pc.field("meta", "source") == "web") & (pc.field("meta", "year") >= 2020),
    ),
    "not-and-nulls": (
        ["not (lang == 'fr')", "score == null or score < 2"],
        ~(pc.field("lang") == "fr") & (pc.field("score").is_null() | (pc.field("score") < 2)),
    ),
    "null-struct": (
        ["meta == null or meta.year != 2018"],
        pc.field("meta").is_null() | (pc.field("meta", "year") != 2018),
    ),
}


@pytest.mark.parametrize("kind", ["parquet", "jsonl"])
@pytest.mark.parametrize("name", sorted(FILTERS))
def test_filters_keep_exactly_the_rows_pyarrow_keeps(scored, tmp_path, kind, name):
    where, expression = FILTERS[name]
    table, files = scored["table"], scored["files"][kind]
    out = tmp_path / "ds"
    summary = pack(
        [str(f) for f in files], str(out), BYTES, workers=1, where=where, split_bytes=3000
    )
    ds = PackedDataset(str(out))
    kept = table.filter(expression)
    assert 0 < kept.num_rows < table.num_rows
    assert _texts(ds) == kept.column("text").to_pylist()
    assert summary.documents == kept.num_rows
    assert ds.n_bytes == sum(len(t.encode()) for t in kept.column("text").to_pylist())
    assert summary.dropped == ds.meta["counts"]["dropped"] == table.num_rows - kept.num_rows
    assert ds.meta["filter"] == {"where": where}
    tally = []
    for begin, end in scored["bounds"]:
        n = table.slice(begin, end - begin).filter(expression).num_rows
        tally.append((n, end - begin - n, 0))
    assert _tally(ds) == tally
    # each kept document is named by its own row (Parquet, from 0) or line (JSONL, from 1)
    first = 1 if kind == "jsonl" else 0
    expected = []
    for k in kept.column("id").to_pylist():
        part = 0 if k < 250 else 1
        expected.append((str(files[part]), k - scored["bounds"][part][0] + first, str(k)))
    assert _origins(ds) == expected


# -- bad input -----------------------------------------------------------------------------------


@pytest.fixture
def parquet_file(tmp_path, corpus):
    """300 records in 6 row groups of 50, snappy-compressed without dictionaries (so a data page
    holds the compressed strings themselves); returns (path, texts)."""
    texts = corpus(300, seed=9)
    table = pa.table({"text": texts, "id": range(300), "score": [k % 6 for k in range(300)]})
    path = tmp_path / "good.parquet"
    pq.write_table(table, path, row_group_size=50, use_dictionary=False, compression="snappy")
    return path, texts


def _damage_page(path: Path, group: int, column: int, damage) -> Path:
    """A copy of the file whose first data page of one column chunk has its middle third
    replaced by damage(bytes) (the page header and the footer stay intact)."""
    chunk = pq.ParquetFile(path).metadata.row_group(group).column(column)
    start = chunk.data_page_offset
    end = (chunk.dictionary_page_offset or start) + chunk.total_compressed_size
    data = bytearray(path.read_bytes())
    a, b = start + (end - start) // 3, start + 2 * (end - start) // 3
    data[a:b] = damage(bytes(data[a:b]))
    damaged = path.with_name(f"damaged-{group}-{column}-{path.name}")
    damaged.write_bytes(bytes(data))
    return damaged


def test_truncated_parquet_file(tmp_path, parquet_file):
    good, texts = parquet_file
    truncated = tmp_path / "truncated.parquet"
    data = good.read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    out = tmp_path / "ds"
    with pytest.raises(InputError) as info:
        pack([str(good), str(truncated)], str(out), BYTES, workers=1)
    message = str(info.value)
    assert message.startswith(f"{truncated}: not a readable Parquet file (")
    assert message.endswith(
        "; it may be truncated or corrupt: download it again, or pass --skip-bad to leave it out"
    )
    assert "\n" not in message
    assert not out.exists()
    summary = pack([str(good), str(truncated)], str(out), BYTES, workers=1, on_bad_line="skip")
    ds = PackedDataset(str(out))
    assert _texts(ds) == texts
    assert summary.bad_lines == ds.meta["counts"]["bad_lines"] == 1
    assert _tally(ds) == [(300, 0, 0), (0, 0, 1)]
    [entry] = ds.meta["bad_lines"]
    assert entry["file"] == str(truncated)
    assert (
        entry["reason"].startswith("not a readable Parquet file (")
        and "skip-bad" not in entry["reason"]
    )


def test_truncated_parquet_file_skipped_with_the_fast_encoder(
    tmp_path, parquet_file, tokenizer_json
):
    """The fast encoder's sample check reads the start of each input: an unreadable one is left
    to the pack, which skips and counts it."""
    good, texts = parquet_file
    truncated = tmp_path / "truncated.parquet"
    truncated.write_bytes(good.read_bytes()[:100])
    out = tmp_path / "ds"
    summary = pack(
        [str(good), str(truncated)], str(out), _hf(tokenizer_json), workers=1, on_bad_line="skip"
    )
    assert (summary.documents, summary.bad_lines, summary.encoder) == (len(texts), 1, "fast")


def test_bad_text_file_among_others_is_counted_against_itself(tmp_path):
    folder = tmp_path / "books"
    folder.mkdir()
    for k in range(4):
        (folder / f"{k}.txt").write_bytes(b"doc \xff" if k == 2 else f"doc {k}".encode())
    out = tmp_path / "ds"
    pack([str(folder)], str(out), BYTES, workers=1, on_bad_line="skip")
    ds = PackedDataset(str(out))
    assert _texts(ds) == ["doc 0", "doc 1", "doc 3"]
    assert _tally(ds) == [(1, 0, 0), (1, 0, 0), (0, 0, 1), (1, 0, 0)]
    assert ds.meta["bad_lines"] == [
        {
            "file": str(folder / "2.txt"),
            "reason": "invalid UTF-8 at byte 4; plain text inputs must be UTF-8",
        }
    ]
    assert ds.origins(0, 3).rows.tolist() == [0, 0, 0]  # a whole file is document 0 of it


@pytest.mark.parametrize("column", ["text", "score"])
def test_a_row_group_that_cannot_be_decoded(tmp_path, parquet_file, column):
    good, texts = parquet_file
    index = ["text", "id", "score"].index(column)
    corrupt = _damage_page(good, 3, index, lambda b: b"\xff" * len(b))
    out = tmp_path / "ds"
    where = ["score >= 0"] if column == "score" else []
    if column == "score":  # a column the pack does not read cannot stop it
        pack([str(corrupt)], str(out), BYTES, workers=1)
        assert _texts(PackedDataset(str(out))) == texts
    prefix = (
        f"{corrupt}, row 150: column '{column}' of row group 3 (rows 150-199) cannot be decoded: "
    )
    with pytest.raises(PackError) as info:
        pack([str(corrupt)], str(out), BYTES, workers=1, where=where, overwrite=True)
    message = str(info.value)
    assert message.startswith(prefix) and message.endswith(SKIP_HINT) and "\n" not in message
    summary = pack(
        [str(corrupt), str(good)],
        str(out),
        BYTES,
        workers=2,
        where=where,
        on_bad_line="skip",
        overwrite=True,
    )
    ds = PackedDataset(str(out))
    assert _texts(ds) == texts[:150] + texts[200:] + texts
    assert summary.bad_lines == ds.meta["counts"]["bad_lines"] == 50
    assert _tally(ds) == [(250, 0, 50), (300, 0, 0)]
    [entry] = ds.meta["bad_lines"]
    assert (entry["file"], entry["row"]) == (str(corrupt), 150)
    assert f"{entry['file']}, row {entry['row']}: {entry['reason']}{SKIP_HINT}" == message
    # the rows after the bad group keep their own numbers
    assert [r for _, r, _ in _origins(ds)[145:155]] == [
        145,
        146,
        147,
        148,
        149,
        200,
        201,
        202,
        203,
        204,
    ]


def test_page_checksums_catch_damage_that_still_decodes(tmp_path):
    texts = [f"document {k}: " + "lorem ipsum dolor " * 4 for k in range(200)]
    path = tmp_path / "checked.parquet"
    pq.write_table(
        pa.table({"text": texts}),
        path,
        row_group_size=50,
        use_dictionary=False,
        compression="none",
        write_page_checksum=True,
    )
    damaged = _damage_page(path, 1, 0, lambda b: b.replace(b"o", b"0"))
    # the damage is in the text only: read without the checksums, the text is silently wrong
    changed = pq.read_table(damaged).column("text").to_pylist()
    assert changed != texts and changed[:50] == texts[:50]
    with pytest.raises(
        PackError,
        match=rf"^{damaged}, row 50: column 'text' of row group 1 \(rows 50-99\) cannot be decoded: .*checksum",
    ):
        pack([str(damaged)], str(tmp_path / "ds"), BYTES, workers=1)


def test_text_column_missing_or_not_strings(tmp_path, parquet_file):
    good, _ = parquet_file
    table = pq.read_table(good)
    missing, numbers = tmp_path / "missing.parquet", tmp_path / "numbers.parquet"
    pq.write_table(table.drop_columns(["text"]), missing)
    pq.write_table(table.drop_columns(["text"]).append_column("text", table.column("id")), numbers)
    expected = {
        missing: f"{missing}: no column 'text' (columns: id, score); pass --field with the text column (a dotted path for a struct field)",
        numbers: f"{numbers}: column 'text' is int64, not a string; pass --field with the text column",
    }
    for path, message in expected.items():
        for mode in ("error", "skip"):  # a wrong --field is no bad row to skip
            with pytest.raises(InputError) as info:
                pack(
                    [str(good), str(path)], str(tmp_path / "ds"), BYTES, workers=1, on_bad_line=mode
                )
            assert str(info.value) == message
            assert not (tmp_path / "ds").exists()


def test_null_texts(tmp_path, parquet_file):
    good, texts = parquet_file
    table = pq.read_table(good)
    nulls = [None if k in (7, 120, 121) else t for k, t in enumerate(texts)]
    path = tmp_path / "nulls.parquet"
    pq.write_table(table.set_column(0, "text", pa.array(nulls)), path, row_group_size=50)
    out = tmp_path / "ds"
    with pytest.raises(PackError) as info:
        pack([str(path)], str(out), BYTES, workers=1)
    assert str(info.value) == f"{path}, row 7: column 'text' is null{SKIP_HINT}"
    summary = pack([str(path)], str(out), BYTES, workers=1, on_bad_line="skip", split_bytes=1)
    ds = PackedDataset(str(out))
    assert _texts(ds) == [t for t in nulls if t is not None]
    assert summary.bad_lines == 3
    assert _tally(ds) == [(297, 0, 3)]
    assert [(e["row"], e["reason"]) for e in ds.meta["bad_lines"]] == [
        (k, "column 'text' is null") for k in (7, 120, 121)
    ]


def test_arrow_directories_that_are_no_dataset(tmp_path):
    incomplete = tmp_path / "incomplete"
    datasets.Dataset.from_dict({"text": ["a", "b", "c"]}).save_to_disk(
        str(incomplete), num_shards=2
    )
    (incomplete / "state.json").unlink()
    with pytest.raises(InputError) as info:
        pack([str(incomplete)], str(tmp_path / "ds"), BYTES, workers=1, on_bad_line="skip")
    assert str(info.value) == (
        f"{incomplete}: .arrow files without the state.json that datasets.save_to_disk writes "
        "beside them (an incomplete save?); save the dataset again, or give the .arrow files "
        "themselves"
    )
    splits = tmp_path / "tree" / "splits"
    split = datasets.Dataset.from_dict({"text": ["a"]})
    datasets.DatasetDict({"train": split, "test": split}).save_to_disk(str(splits))
    message = (
        f"{splits}: a DatasetDict with splits test, train; give one split's directory, e.g. "
        f"{splits}/test"
    )
    for given in (splits, tmp_path / "tree"):  # itself, or inside a tree: never every split
        with pytest.raises(InputError) as info:
            pack([str(given)], str(tmp_path / "ds"), BYTES, workers=1)
        assert str(info.value) == message
    pack([str(splits / "train")], str(tmp_path / "ds"), BYTES, workers=1)
    assert _texts(PackedDataset(str(tmp_path / "ds"))) == ["a"]


def test_a_filter_on_a_column_parquet_lacks_is_refused_before_any_row(
    tmp_path, parquet_file, monkeypatch
):
    from llmtrain.data_pack import columnar

    def no_rows(*args, **kwargs):
        raise AssertionError("rows were read")

    monkeypatch.setattr(columnar, "read_batches", no_rows)
    good, _ = parquet_file
    nested = tmp_path / "nested.parquet"
    pq.write_table(pa.table({"text": ["a"], "meta": [{"year": 2020}]}), nested)
    cases = {
        (
            good,
            "scor >= 3",
        ): f"{good}: --where 'scor >= 3' names column 'scor', which it lacks (columns: id, score, text; did you mean 'score'?)",
        (
            nested,
            "meta.yeer > 1",
        ): f"{nested}: --where 'meta.yeer > 1' names field 'meta.yeer', which struct 'meta' lacks (its fields: year)",
        (
            nested,
            "text.x == 1",
        ): f"{nested}: --where 'text.x == 1' names field 'text.x', but 'text' is string, not a struct",
    }
    for (path, where), message in cases.items():
        with pytest.raises(UserError) as info:
            pack(
                [str(path)],
                str(tmp_path / "ds"),
                BYTES,
                workers=1,
                where=[where],
                on_bad_line="skip",
            )
        assert str(info.value) == message
        assert not (tmp_path / "ds").exists()


def test_a_filter_on_a_field_jsonl_lacks_names_the_record(tmp_path):
    path = _jsonl(tmp_path / "a.jsonl", [{"text": "x", "score": 1}, {"text": "y"}])
    with pytest.raises(PackError) as info:
        pack([str(path)], str(tmp_path / "ds"), BYTES, workers=1, where=["score >= 1"])
    assert str(info.value) == (
        f"{path}:2: --where 'score >= 1': field 'score' is missing; fix the line, or pass "
        "--on-bad-line skip to skip and count such lines"
    )


def test_a_filter_comparing_a_string_with_a_number(tmp_path, parquet_file):
    good, texts = parquet_file
    with pytest.raises(PackError) as info:
        pack([str(good)], str(tmp_path / "ds"), BYTES, workers=1, where=["score == 'high'"])
    assert str(info.value) == (
        f"{good}, row 0: --where \"score == 'high'\": field 'score' is a number (0), compared "
        f"with a string{SKIP_HINT}"
    )
    records = [{"text": t, "score": k if k != 5 else "five"} for k, t in enumerate(texts[:20])]
    path = _jsonl(tmp_path / "a.jsonl", records)
    out = tmp_path / "ds"
    with pytest.raises(
        PackError,
        match=rf"^{path}:6: --where 'score >= 3': field 'score' is a string \('five'\), compared with a number; fix the line",
    ):
        pack([str(path)], str(out), BYTES, workers=1, where=["score >= 3"])
    summary = pack(
        [str(path)], str(out), BYTES, workers=1, where=["score >= 3"], on_bad_line="skip"
    )
    ds = PackedDataset(str(out))
    assert _texts(ds) == texts[3:5] + texts[6:20]
    assert (summary.documents, summary.dropped, summary.bad_lines) == (16, 3, 1)
    assert _tally(ds) == [(16, 3, 1)]
    assert ds.meta["bad_lines"][0]["line"] == 6


def test_a_text_file_that_is_not_utf8(tmp_path):
    folder = tmp_path / "txt"
    folder.mkdir()
    for k in range(4):
        (folder / f"{k}.txt").write_bytes(b"bad \xff" if k == 2 else f"doc {k}".encode())
    with pytest.raises(InputError) as info:
        pack([str(folder)], str(tmp_path / "ds"), BYTES, workers=1)
    assert str(info.value) == (
        f"{folder}/2.txt: invalid UTF-8 at byte 4; plain text inputs must be UTF-8; pass "
        "--skip-bad to skip and count such files"
    )


def test_a_killed_pack_leaves_nothing_that_opens(tmp_path, corpus, tokenizer_json):
    """SIGKILL the parent once its first chunks are written: no cleanup runs, and still nothing
    at the output opens; a new pack to the same output works."""
    table = pa.table({"text": corpus(300, seed=0) * 24})  # ~8 s of packing; killed after ~3
    (tmp_path / "data").mkdir()
    for k in range(4):
        pq.write_table(table, tmp_path / "data" / f"part-{k}.parquet", row_group_size=200)
    out = tmp_path / "ds"
    script = "from llmtrain.core_mesh.cli import main; raise SystemExit(main())"
    args = [
        tmp_path / "data", "-o", out, "--tokenizer", tokenizer_json, "--tokenizer-option", "fast=off",
        "--workers", 2, "--chunk-tokens", 4096, "--split-mb", 0.01, "--no-progress",
        "--log-dir", tmp_path / "logs",
    ]  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-c", script, "data", "pack", *map(str, args)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=tmp_path,
    )
    workers = []
    try:
        deadline = time.monotonic() + 300
        while not glob.glob(f"{out}.tmp-*/tokens/c/*"):
            assert proc.poll() is None, "the pack ended before it could be killed"
            assert time.monotonic() < deadline, "no chunk written after 300 s"
            time.sleep(0.02)
        workers = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=10) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # the workers notice their parent is gone and end (generous: a loaded machine is slow)
    deadline = time.monotonic() + 120
    alive = workers
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        time.sleep(0.1)
    for process in alive:  # so a failure leaves no orphans behind
        process.kill()
    assert alive == [], "workers outlived the killed pack"
    assert not out.exists()
    [staging] = glob.glob(f"{out}.tmp-*")
    for path in (out, Path(staging)):
        with pytest.raises(DatasetError, match="not a packed dataset"):
            PackedDataset(str(path))
    pack([str(tmp_path / "data" / "part-0.parquet")], str(out), BYTES, workers=1)
    assert PackedDataset(str(out)).n_documents == table.num_rows


# -- train-tokenizer and the CLI -----------------------------------------------------------------


def test_train_tokenizer_reads_parquet(formats, tmp_path):
    c = formats["corpus"]
    trained = {}
    for name, inputs in (("jsonl", [str(c.jsonl)]), ("parquet", [str(c.tree)])):
        out = tmp_path / f"{name}.json"
        train_tokenizer(inputs, str(out), vocab_size=320, min_frequency=1)
        trained[name] = out.read_text(encoding="utf-8")
    assert trained["parquet"] == trained["jsonl"]
    assert len(json.loads(trained["parquet"])["model"]["vocab"]) == 320


def test_cli_pack_with_filter_and_skip_bad_then_inspect(tmp_path, run_cli, corpus):
    texts = corpus(40, seed=2)
    scores = [k % 5 for k in range(40)]
    table = pa.table(
        {"text": [None if k == 9 else t for k, t in enumerate(texts)], "score": scores}
    )
    path = tmp_path / "x.parquet"
    pq.write_table(table, path, row_group_size=10)
    out = tmp_path / "out"
    code, stdout, stderr = run_cli(
        "data", "pack", path, "-o", out, "--tokenizer", "bytes", "--where", "score >= 3",
        "--skip-bad", "--workers", 1, "--no-progress", "--log-dir", tmp_path / "logs",
    )  # fmt: skip
    assert code == 0, stderr
    kept = [t for k, t in enumerate(texts) if scores[k] >= 3 and k != 9]
    dropped = sum(s < 3 for s in scores)
    assert scores[9] >= 3  # row 9 passes the filter, then has no text: a bad row
    assert f"{out}: {len(kept)} documents, " in stdout
    assert f"1 bad records skipped, {dropped} dropped by --where" in stdout
    ds = PackedDataset(str(out))
    assert _texts(ds) == kept
    n_bytes = sum(len(t.encode()) for t in kept)  # neither the dropped rows nor the bad one
    assert ds.n_bytes == n_bytes == ds.n_tokens - ds.n_documents
    assert stdout.endswith(
        f"; {n_bytes:,} bytes of text, {n_bytes / ds.n_tokens:.2f} bytes a token\n"
    )
    code, stdout, stderr = run_cli("data", "inspect", out, "--json", "--log-dir", tmp_path / "logs")
    assert code == 0, stderr
    report = json.loads(stdout)
    assert report["counts"]["dropped"] == dropped
    assert report["counts"]["documents"] == len(kept)
    assert report["filter"] == {"where": ["score >= 3"]}
    assert report["bad_lines"] == [{"file": str(path), "row": 9, "reason": "column 'text' is null"}]
    code, stdout, stderr = run_cli("data", "inspect", out, "--log-dir", tmp_path / "logs")
    assert code == 0, stderr
    assert f"{dropped:,} records dropped" in stdout
