"""Long documents. A text longer than PIECE_CHARS is encoded a piece at a time, cut only where
the pre-tokenizer splits anyway, and gives the ids of the whole text. One 50 MB JSONL line packs
in bounded memory. `--max-doc-bytes` refuses documents above it (naming file:line), or skips and
counts them with `--on-bad-line skip`.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from llmtrain.data_pack.store import PackedDataset
from llmtrain.data_pack.tokenizer import (
    HFOptions,
    HFTokenizer,
    TiktokenOptions,
    TiktokenTokenizer,
    cut_places,
    pieces_match,
    text_pieces,
)
from llmtrain.data_pack.tokenizer import pieces as pieces_module
from llmtrain.data_pack.tokenizer.fast_bpe import bytes_to_unicode

CLI = "import sys; from llmtrain.core_mesh.cli import main; sys.exit(main())"
GIB = 1 << 30
# The 50 MiB line below is 55 MB of JSON, 38 M characters (a str of 4 bytes a character: the
# corpus has emoji) and 32 M tokens of the test BPE. Encoded whole it peaked at 9.4 GiB (HF's
# encoder keeps ~100 bytes a token, and the fast encoder's check ran it on the whole line); in
# pieces the process tree peaks at 0.5 GiB with 1 worker and 0.6 GiB with 2 (0.6 GiB with the
# reference encoder). What still grows with the document is the line and its text (~0.2 GB),
# and its ids: 4 bytes a token while encoded, 2 as stored, in the worker and, with 2 workers,
# again in the parent that receives them. 1.5 GiB leaves over twice the measured peak for other
# allocators and versions, and is a sixth of the whole-document peak.
PEAK_RSS_BOUND = 1.5 * GIB
# a cl100k-style split regex: its punctuation pre-tokens take the newlines after them
CL100K_STYLE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _ordinary_text(corpus, n: int, seed: int) -> str:
    """The test corpus run together: words of many scripts, punctuation before newlines, runs of
    spaces, tabs, CRLF, emoji."""
    return "\n".join(
        f"{a} {b}." for a, b in zip(corpus(n, seed=seed), corpus(n, seed=seed + 1), strict=True)
    )


# -- where pieces are cut --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "places"),
    [
        ("one two", [3]),
        ("a  b", [1]),  # before a run of spaces, never inside it
        ("word\nnext", [4]),
        ("word.\nnext", []),  # cl100k's ".\n" is one pre-token
        ("x_\ny", []),
        ("12\n34 5", [2, 5]),
        ("tab\t x", []),
        ("e\u0301 ok", [2]),
        ("end ", [3]),
        (" lead", []),
    ],
)
def test_cut_places(text, places):
    assert list(cut_places(text)) == places


def test_text_pieces_cover_the_text(corpus):
    text = _ordinary_text(corpus, 300, seed=3)
    pieces = list(text_pieces(text, 500))
    assert "".join(pieces) == text
    assert len(pieces) > 20
    assert all(len(p) >= 500 for p in pieces[:-1])
    places = set(cut_places(text))
    ends = np.cumsum([len(p) for p in pieces[:-1]])
    assert set(ends.tolist()) <= places
    assert list(text_pieces("x" * 100, 10)) == ["x" * 100]  # no place to cut: kept whole


# -- pieces give the whole text's ids --------------------------------------------------------------


def _ranks(tokenizer_json: Path) -> Path:
    """The test BPE's vocabulary as a .tiktoken ranks file."""
    import base64

    spec = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    added = {t["content"] for t in spec["added_tokens"]}
    lines = [
        f"{base64.b64encode(bytes(byte_of[c] for c in token)).decode()} {i}"
        for token, i in spec["model"]["vocab"].items()
        if token not in added
    ]
    path = tokenizer_json.parent / "ranks.tiktoken"
    path.write_text("\n".join(lines) + "\n", encoding="ascii")
    return path


ENCODERS = [
    "hf reference",
    "hf fast",
    "hf split regex",
    "tiktoken gpt2",
    "tiktoken cl100k_base",
    "tiktoken o200k_base",
]


def _encoder(name: str, tokenizer_json: Path, tmp_path: Path, corpus, split_regex_bpe):
    """(tokenizer, its whole-text encoder: a list of texts to a list of ids)."""
    kind, _, variant = name.partition(" ")
    if kind == "hf":
        path = tokenizer_json
        if variant == "split regex":
            path = tmp_path / "split.json"
            path.write_text(split_regex_bpe(corpus(1000, seed=1), 400, CL100K_STYLE), "utf-8")
        tok = HFTokenizer(HFOptions(str(path), fast="on" if variant == "fast" else "off"))
        whole = tok._fast_whole if variant == "fast" else tok._hf_whole
        return tok, whole
    encoding = None if variant == "gpt2" else variant
    tok = TiktokenTokenizer(TiktokenOptions(str(_ranks(tokenizer_json)), encoding=encoding))
    return tok, tok._whole_arrays


@pytest.mark.parametrize("name", ENCODERS)
def test_pieces_give_the_whole_text_ids(
    name, tokenizer_json, tmp_path, corpus, split_regex_bpe, monkeypatch
):
    """Cut at every place at once, and through the public API with small pieces: the ids of
    the whole text."""
    tok, whole = _encoder(name, tokenizer_json, tmp_path, corpus, split_regex_bpe)
    assert tok.pieces_safe
    text = _ordinary_text(corpus, 400, seed=11)
    assert len(list(cut_places(text))) > 3000
    assert pieces_match(whole, text)

    texts = [text, "short", _ordinary_text(corpus, 50, seed=12), ""]
    expected = [[int(i) for i in ids] for ids in whole(texts)]
    monkeypatch.setattr(pieces_module, "PIECE_CHARS", 300)
    assert tok.encode_batch(texts) == expected
    assert [a.tolist() for a in tok.encode_batch_arrays(texts)] == expected


def _tiktoken(tokenizer_json: Path, **options) -> TiktokenTokenizer:
    return TiktokenTokenizer(TiktokenOptions(str(_ranks(tokenizer_json)), **options))


def _hf_with(tmp_path: Path, tokenizer_json: Path, **changes) -> HFTokenizer:
    spec = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    spec.update(changes)
    path = tmp_path / "changed.json"
    path.write_text(json.dumps(spec), encoding="utf-8")
    return HFTokenizer(HFOptions(str(path), fast="off"))


def test_tokenizers_that_cuts_could_change_encode_whole(tokenizer_json, tmp_path, monkeypatch):
    """No pieces where a cut could change the ids: a split pattern whose pre-tokens span
    spaces (the probe text finds it), a normalizer, an added token that takes the whitespace
    beside it, a special token with a space that the text may spell."""
    added = json.loads(tokenizer_json.read_text(encoding="utf-8"))["added_tokens"]
    unsafe = [
        _tiktoken(tokenizer_json, pattern=r"\S+ \S+|\S+|\s+"),
        _tiktoken(
            tokenizer_json,
            special_tokens={"<|end of text|>": 500},
            eod_token="<|end of text|>",
            parse_special=True,
        ),
        _hf_with(tmp_path, tokenizer_json, normalizer={"type": "Prepend", "prepend": "_"}),
        _hf_with(
            tmp_path,
            tokenizer_json,
            added_tokens=[
                *added,
                {**added[0], "id": 400, "content": "<x>", "special": False, "rstrip": True},
            ],
        ),
    ]
    text = "alpha beta gamma delta " * 40
    monkeypatch.setattr(pieces_module, "PIECE_CHARS", 16)
    for tok in unsafe:
        assert not tok.pieces_safe
        whole = tok._whole_arrays if isinstance(tok, TiktokenTokenizer) else tok._hf_whole
        assert tok.encode_batch([text]) == [[int(i) for i in whole([text])[0]]]
    # special tokens read as plain text (the default) take nothing from the text around them
    plain = _tiktoken(
        tokenizer_json, special_tokens={"<|end of text|>": 500}, eod_token="<|end of text|>"
    )
    assert plain.pieces_safe
    assert _hf_with(
        tmp_path, tokenizer_json, added_tokens=[{**added[0], "rstrip": True}]
    ).pieces_safe


# -- packing ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_mb_text(corpus) -> str:
    return _ordinary_text(corpus, 8000, seed=21)[: 2 << 20]


@pytest.fixture(scope="module")
def two_mb_ids(two_mb_text, tokenizer_json) -> list[int]:
    """The tokenizers library's own ids for the whole 2 MB text (special-token text as text)."""
    import tokenizers

    tok = tokenizers.Tokenizer.from_file(str(tokenizer_json))
    tok.encode_special_tokens = True
    return tok.encode(two_mb_text, add_special_tokens=False).ids


@pytest.mark.parametrize("fast", ["on", "off"])
def test_packed_long_document_has_the_whole_text_ids(
    fast, run_cli, tmp_path, write_jsonl, tokenizer_json, two_mb_text, two_mb_ids, monkeypatch
):
    """A 2 MB document packed in 16 Ki-character pieces (130 of them) gives the ids the
    tokenizers library gives the whole text, with the fast encoder and with the reference."""
    monkeypatch.setattr(pieces_module, "PIECE_CHARS", 1 << 14)
    assert len(list(text_pieces(two_mb_text, 1 << 14))) > 100
    data = write_jsonl("long.jsonl", ["before", two_mb_text, "after"])
    out = tmp_path / "out.zarr"
    code, _, err = run_cli(
        "data", "pack", data, "-o", out, "--tokenizer", tokenizer_json, "--tokenizer-option",
        f"fast={fast}", "--workers", "1", "--no-progress",
    )  # fmt: skip
    assert code == 0, err
    dataset = PackedDataset(str(out))
    assert dataset.n_documents == 3
    assert dataset.document(1).tolist() == two_mb_ids
    tok = HFTokenizer(HFOptions(str(tokenizer_json)))
    assert [dataset.document(i).tolist() for i in (0, 2)] == tok.encode_batch(["before", "after"])


@pytest.fixture(scope="module")
def fifty_mb_line(tmp_path_factory, corpus) -> tuple[Path, str]:
    """A JSONL file of one line whose text is 50 MiB of the test corpus (as UTF-8)."""
    texts = corpus(20000, seed=7)
    parts, size = [], 0
    while size < 50 << 20:
        for text in texts:
            parts.append(text)
            size += len(text.encode("utf-8")) + 1
    text = " ".join(parts)
    path = tmp_path_factory.mktemp("long") / "one-line.jsonl"
    path.write_text(json.dumps({"text": text}, ensure_ascii=False) + "\n", encoding="utf-8")
    return path, text


def _tree_rss(process: psutil.Process) -> int:
    total = 0
    try:
        members = [process, *process.children(recursive=True)]
    except psutil.Error:
        return 0
    for member in members:
        try:
            total += member.memory_info().rss
        except psutil.Error:  # ended between the listing and the reading
            pass
    return total


def _run_measured(argv: list[str], logs: Path) -> tuple[int, int, str]:
    """Run `argv`; (exit code, peak RSS of its whole process tree, its stderr), the tree polled
    every 20 ms."""
    with open(logs / "stdout", "wb") as out, open(logs / "stderr", "wb") as err:
        popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err)
        process = psutil.Process(popen.pid)
        peak = 0
        deadline = time.monotonic() + 300
        while popen.poll() is None and time.monotonic() < deadline:
            peak = max(peak, _tree_rss(process))
            time.sleep(0.02)
        if popen.poll() is None:
            popen.kill()
        code = popen.wait()
    return code, peak, (logs / "stderr").read_text(encoding="utf-8", errors="replace")


@pytest.mark.parametrize("workers", [1, 2])
def test_a_50mb_line_packs_in_bounded_memory(workers, tmp_path, fifty_mb_line, tokenizer_json):
    path, text = fifty_mb_line
    out = tmp_path / "out.zarr"
    argv = [sys.executable, "-c", CLI, "data", "pack", str(path), "-o", str(out)]
    argv += ["--tokenizer", str(tokenizer_json), "--workers", str(workers), "--no-progress"]
    code, peak, stderr = _run_measured(argv, tmp_path)
    assert code == 0, stderr[-3000:]
    assert "encoder=fast" in stderr
    assert peak < PEAK_RSS_BOUND, f"peak RSS {peak / GIB:.2f} GiB"

    # the ids at both ends are those of the text's first and last pieces, encoded on their own
    dataset = PackedDataset(str(out))
    assert dataset.n_documents == 1
    tok = HFTokenizer(HFOptions(str(tokenizer_json), fast="on"))
    head = next(text_pieces(text, 1 << 16))
    tail = text[next(cut_places(text, len(text) - (1 << 16))) :]
    head_ids, tail_ids = tok.encode_batch([head, tail])
    n = dataset.n_tokens
    assert dataset.read(0, len(head_ids)).tolist() == head_ids
    assert dataset.read(n - 1 - len(tail_ids), n).tolist() == [*tail_ids, tok.eod_id]


# -- --max-doc-bytes -------------------------------------------------------------------------------


def _pack(run_cli, data: Path, out: Path, *options: object) -> tuple[int, str]:
    code, _, err = run_cli(
        "data", "pack", data, "-o", out, "--tokenizer", "bytes", "--workers", "1",
        "--no-progress", *options,
    )  # fmt: skip
    return code, err.strip().splitlines()[-1] if err.strip() else ""


def test_max_doc_bytes_refuses_naming_file_and_line(run_cli, tmp_path, write_jsonl):
    data = write_jsonl("docs.jsonl", ["short", "x" * 2000, "é" * 600, "é" * 500, "fine"])
    code, line = _pack(run_cli, data, tmp_path / "a.zarr", "--max-doc-bytes", "1000")
    assert code == 2
    assert line == (
        f"error: {data}:2: a document of 2,000 bytes, above --max-doc-bytes 1,000; fix the "
        "line, or pass --on-bad-line skip to skip and count such lines"
    )
    assert not (tmp_path / "a.zarr").exists()


def test_max_doc_bytes_skips_and_counts(run_cli, tmp_path, write_jsonl):
    """Bytes are UTF-8 bytes: 600 "é" are 1,200, above the limit; 500 are 1,000, at it."""
    data = write_jsonl("docs.jsonl", ["short", "x" * 2000, "é" * 600, "é" * 500, "fine"])
    out = tmp_path / "b.zarr"
    code, _ = _pack(run_cli, data, out, "--max-doc-bytes", "1000", "--on-bad-line", "skip")
    assert code == 0
    dataset = PackedDataset(str(out))
    assert dataset.n_documents == 3
    assert dataset.document(1).tolist() == list(("é" * 500).encode())
    assert dataset.meta["counts"]["bad_lines"] == 2
    assert dataset.meta["bad_lines"] == [
        {"file": str(data), "line": 2, "reason": "a document of 2,000 bytes, above --max-doc-bytes 1,000"},
        {"file": str(data), "line": 3, "reason": "a document of 1,200 bytes, above --max-doc-bytes 1,000"},
    ]  # fmt: skip
    assert dataset.meta["sources"][0]["bad"] == 2

    code, _ = _pack(run_cli, data, tmp_path / "c.zarr", "--max-doc-bytes", "0")
    assert code == 0
    assert PackedDataset(str(tmp_path / "c.zarr")).n_documents == 5  # 0: no limit


def test_max_doc_bytes_for_text_files_and_parquet_rows(run_cli, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    books = tmp_path / "books"
    books.mkdir()
    (books / "a.txt").write_text("a short book", encoding="utf-8")
    (books / "b.txt").write_text("long " * 400, encoding="utf-8")
    code, line = _pack(run_cli, books, tmp_path / "t.zarr", "--max-doc-bytes", "1000")
    assert code == 2
    assert line == (
        f"error: {books / 'b.txt'}: a document of 2,000 bytes, above --max-doc-bytes 1,000; "
        "pass --skip-bad to skip and count such rows and files"
    )
    code, _ = _pack(run_cli, books, tmp_path / "t.zarr", "--max-doc-bytes", "1000", "--skip-bad")
    assert code == 0
    assert PackedDataset(str(tmp_path / "t.zarr")).n_documents == 1

    rows = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"text": ["fine", "y" * 1001, "also fine"]}), rows)
    code, line = _pack(run_cli, rows, tmp_path / "p.zarr", "--max-doc-bytes", "1000")
    assert code == 2
    assert line.startswith(f"error: {rows}, row 1: a document of 1,001 bytes, above")


def test_max_doc_bytes_must_not_be_negative(run_cli, tmp_path, write_jsonl):
    data = write_jsonl("docs.jsonl", ["short"])
    code, line = _pack(run_cli, data, tmp_path / "n.zarr", "--max-doc-bytes", "-1")
    assert code == 2
    assert line == "error: --max-doc-bytes -1: give 0 (no limit) or more bytes"
