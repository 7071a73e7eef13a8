"""Every bad data input is one clear line and exit 2 through the real CLI, and nothing is lost.

A table of generated cases damages each kind of input a `llmtrain data ...` command reads: the
compressed inputs (.gz and .zst, JSONL and text) cut at random points, with a flipped byte, as
garbage, empty, plain, or with garbage after the end; Parquet and Arrow files cut short, flipped
or garbage; JSONL records that are binary, not UTF-8, not JSON or have no text; paths that name
nothing usable; the metadata (group and array `zarr.json`) and the small arrays of a packed
dataset (copies of one dataset packed once per module); tokenizer files (tokenizer.json and
.tiktoken ranks) cut, flipped, garbage, empty or other JSON; outputs that `--overwrite` must not
replace (a folder of the user's files, an input, another zarr group); and storage that cannot be
used (a missing bucket, an endpoint that does not answer, access denied; moto on 127.0.0.1).

For every case: exit 2, one `error:` line on stderr (log lines aside) naming the file, no
traceback and no "this is a bug", nothing committed that looks complete, and where `--overwrite`
was refused the user's files byte for byte as they were. Where a damage can leave the input
meaning the same (a flipped byte in a gzip header's time stamp, in a JSON string of metadata that
nothing reads, or in a tokenizer's vocabulary), exit 0 is allowed only if the result is exactly
what the intact input gives.
"""

from __future__ import annotations

import gc
import gzip
import hashlib
import json
import random
import re
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zarr
import zstandard

from llmtrain.data_pack.errors import DatasetError
from llmtrain.data_pack.loader import open_windows
from llmtrain.data_pack.pack import pack
from llmtrain.data_pack.store import PackedDataset

USER_ERROR = 2
BYTES = {"kind": "bytes"}
CHUNK_TOKENS = 128  # the module's dataset: ~100 token chunks, 2 chunks of chunk_heads
# a structlog console line a command may print before its error
LOG_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \S+ )?\[\s*(debug|info|warning)\s*\] ")
PACK = ("--tokenizer", "bytes", "--workers", "1", "--no-progress")
CHAT_TOKENIZER = (
    "--tokenizer",
    "bytes",
    "--tokenizer-option",
    'special_tokens=["<|endoftext|>","<|pad|>","<|im_start|>","<|im_end|>"]',
)
RNG = random.Random(36)


# -- the intact inputs, made once ------------------------------------------------------------------


@attrs.frozen
class Env:
    root: Path
    inputs: dict[str, Path]  # kind -> an intact input of that kind
    reference: dict[str, np.ndarray]  # kind -> the tokens its pack gives
    dataset: Path  # a packed dataset (bytes tokenizer, small chunks, provenance)
    arrays: dict[str, np.ndarray]  # its arrays as packed
    tokenizers: dict[str, Path]  # tokenizer.json, ranks.tiktoken
    chats: Path  # a JSONL of conversations (pack-chat)


def _zstd(data: bytes) -> bytes:
    # with the content checksum the zstd command line writes by default: a changed byte of the
    # content is then found, as gzip's CRC finds it
    return zstandard.ZstdCompressor(write_checksum=True).compress(data)


def _tokens(out: Path) -> np.ndarray:
    dataset = PackedDataset(str(out))
    return dataset.read(0, dataset.n_tokens)


@pytest.fixture(scope="module")
def env(tmp_path_factory, texts, tokenizer_json) -> Env:
    root = tmp_path_factory.mktemp("bad-inputs")
    docs = texts[:120]
    jsonl = "".join(json.dumps({"text": t, "id": f"d{i}"}) + "\n" for i, t in enumerate(docs))
    text = "\n\n".join(docs).encode()
    table = pa.table({"text": docs, "id": [f"d{i}" for i in range(len(docs))]})
    inputs = {
        "jsonl": root / "corpus.jsonl",
        "jsonl.gz": root / "corpus.jsonl.gz",
        "jsonl.zst": root / "corpus.jsonl.zst",
        "txt.gz": root / "document.txt.gz",
        "txt.zst": root / "document.txt.zst",
        "parquet": root / "corpus.parquet",
        "arrow": root / "corpus.arrow",
        "arrow-file": root / "corpus-file.arrow",
    }
    inputs["jsonl"].write_bytes(jsonl.encode())
    inputs["jsonl.gz"].write_bytes(gzip.compress(jsonl.encode(), mtime=0))
    inputs["jsonl.zst"].write_bytes(_zstd(jsonl.encode()))
    inputs["txt.gz"].write_bytes(gzip.compress(text, mtime=0))
    inputs["txt.zst"].write_bytes(_zstd(text))
    pq.write_table(table, inputs["parquet"], row_group_size=30, write_page_checksum=True)
    with pa.OSFile(str(inputs["arrow"]), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
        for batch in table.to_batches(max_chunksize=30):
            w.write_batch(batch)
    with pa.OSFile(str(inputs["arrow-file"]), "wb") as f, pa.ipc.new_file(f, table.schema) as w:
        for batch in table.to_batches(max_chunksize=30):
            w.write_batch(batch)
    reference = {}
    for kind, path in inputs.items():
        out = root / f"reference-{kind}.zarr"
        pack([str(path)], str(out), BYTES, workers=1)
        reference[kind] = _tokens(out)
    dataset = root / "dataset.zarr"
    pack([str(inputs["jsonl"])], str(dataset), BYTES, workers=1, chunk_tokens=CHUNK_TOKENS)
    packed = PackedDataset(str(dataset))
    arrays = {
        "tokens": packed.read(0, packed.n_tokens),
        "doc_offsets": np.asarray(packed.doc_offsets[:]),
        "chunk_docs": packed.chunk_docs,
        "chunk_heads": np.asarray(packed.chunk_heads[:]),
    }
    assert packed.n_chunks > 64 and packed.checksummed  # chunk_heads: 2 chunks of 64 rows
    ranks = root / "ranks.tiktoken"
    pieces = [bytes([b]) for b in range(256)] + [b"th", b"he", b" t", b"the", b"in"]
    ranks.write_text("".join(f"{_b64(p)} {rank}\n" for rank, p in enumerate(pieces)))
    chats = root / "chats.jsonl"
    chats.write_text(
        json.dumps(
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "hello"},
                ]
            }
        )
        + "\n"
    )
    return Env(
        root,
        inputs,
        reference,
        dataset,
        arrays,
        {"tokenizer.json": tokenizer_json, "tiktoken": ranks},
        chats,
    )


def _b64(data: bytes) -> str:
    import base64

    return base64.b64encode(data).decode()


# -- what every case checks ------------------------------------------------------------------------


def refused(run_cli, *argv: object, names: tuple[str, ...] = ()) -> str:
    """Run `llmtrain ARGV`: exit 2, one error line (log lines aside) that names `names`, no
    traceback, no "this is a bug"; returns the line."""
    code, _, err = run_cli(*argv)
    return one_line(code, err, names)


def one_line(code: int, err: str, names: tuple[str, ...] = ()) -> str:
    lines = [line for line in err.splitlines() if line.strip() and not LOG_LINE.match(line)]
    assert code == USER_ERROR, f"exit {code}: {err}"
    assert "Traceback" not in err and "this is a bug" not in err, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for name in names:
        assert name in lines[0], (name, lines[0])
    return lines[0]


def nothing_committed(out: Path) -> None:
    """No dataset (and no staging directory) where a refused command would have written one."""
    assert not out.exists(), sorted(p.name for p in out.iterdir()) if out.is_dir() else out
    assert [p.name for p in out.parent.iterdir() if p.name.startswith(f"{out.name}.")] == []
    with pytest.raises(DatasetError):
        PackedDataset(str(out))


def tree(path: Path) -> dict[str, str]:
    """Every file under `path` (or the file itself) with the hash of its bytes."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {
        str(p.relative_to(path.parent)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files
    }


def _flip(data: bytes, position: int, bit: int) -> bytes:
    damaged = bytearray(data)
    damaged[position] ^= 1 << bit
    return bytes(damaged)


@attrs.frozen
class Case:
    id: str
    run: Callable[[Env, Path, Any], None]


CASES: list[Case] = []


def case(name: str) -> Callable[[Callable[[Env, Path, Any], None]], None]:
    def add(run: Callable[[Env, Path, Any], None]) -> None:
        CASES.append(Case(name, run))

    return add


# -- compressed, columnar and JSONL inputs ---------------------------------------------------------


def _pack_damaged(
    kind: str, damage: Callable[[bytes], bytes], *, may_mean_the_same: bool
) -> Callable:
    """A case that packs a damaged copy of the intact input of `kind`: refused naming it (or,
    where allowed, exit 0 with exactly the intact input's tokens)."""

    def run(env: Env, tmp_path: Path, run_cli) -> None:
        source = env.inputs[kind]
        damaged = tmp_path / source.name
        damaged.write_bytes(damage(source.read_bytes()))
        out = tmp_path / "out.zarr"
        code, _, err = run_cli("data", "pack", damaged, "-o", out, *PACK)
        if may_mean_the_same and code == 0:
            assert np.array_equal(_tokens(out), env.reference[kind]), err
            return
        one_line(code, err, names=(str(damaged),))
        nothing_committed(out)

    return run


def _cut_at(fraction: float) -> Callable[[bytes], bytes]:
    return lambda data: data[: int(len(data) * fraction)]


def _flip_at(fraction: float, bit: int) -> Callable[[bytes], bytes]:
    return lambda data: _flip(data, min(len(data) - 1, int(len(data) * fraction)), bit)


def damage_family(
    kind: str,
    make: Callable[[str, Callable[[bytes], bytes], bool], Callable],
    *,
    cuts: int,
    flips: int,
    garbage_seed: int,
    last_byte: bool = True,
) -> None:
    """The damages every file of `kind` gets, each a case `make(kind, damage, tolerated)`:
    `cuts` truncations at random points (and the last byte cut), `flips` random bit flips
    (tolerated: a flip may leave a file meaning the same), random bytes of the same length
    and an empty file."""
    for fraction in sorted(RNG.random() for _ in range(cuts)):
        case(f"{kind}-cut-at-{fraction:.3f}")(make(kind, _cut_at(fraction), False))
    if last_byte:
        case(f"{kind}-last-byte-cut")(make(kind, lambda data: data[:-1], False))
    for _ in range(flips):
        fraction, bit = RNG.random(), RNG.randrange(8)
        case(f"{kind}-flipped-at-{fraction:.3f}-bit-{bit}")(
            make(kind, _flip_at(fraction, bit), True)
        )
    garbage = lambda data: random.Random(garbage_seed).randbytes(len(data))  # noqa: E731
    case(f"{kind}-garbage")(make(kind, garbage, False))
    case(f"{kind}-empty")(make(kind, lambda data: b"", False))


def _packed(kind: str, damage: Callable[[bytes], bytes], tolerated: bool) -> Callable:
    return _pack_damaged(kind, damage, may_mean_the_same=tolerated)


for _kind in ("jsonl.gz", "jsonl.zst", "txt.gz", "txt.zst"):
    damage_family(_kind, _packed, cuts=6, flips=4, garbage_seed=1)
    case(f"{_kind}-not-compressed")(
        _pack_damaged(
            _kind,
            lambda data, k=_kind: (
                gzip.decompress(data)
                if k.endswith("gz")
                else zstandard.ZstdDecompressor().decompress(data)
            ),
            may_mean_the_same=False,
        )
    )
    case(f"{_kind}-garbage-after-the-end")(
        _pack_damaged(_kind, lambda data: data + b"trailing garbage\n", may_mean_the_same=False)
    )

# Parquet pages carry checksums, so a flipped bit is found; Arrow IPC has none to find it by
for _kind, _flips in (("parquet", 4), ("arrow", 0), ("arrow-file", 0)):
    damage_family(_kind, _packed, cuts=4, flips=_flips, garbage_seed=2)

BAD_RECORDS = {
    "binary-line": (b"\x00\x01\x02\xff\xfe binary", "invalid UTF-8"),
    "invalid-utf8": (b'{"text": "caf\xe9"}', "invalid UTF-8"),
    "invalid-json": (b'{"text": "unterminated', "malformed JSON"),
    "text-is-a-number": (b'{"text": 12}', "field is int, not a string"),
    "text-is-a-list": (b'{"text": ["a", "b"]}', "field is list, not a string"),
    "text-is-null": (b'{"text": null}', "field is NoneType, not a string"),
    "text-is-an-object": (b'{"text": {"a": 1}}', "field is dict, not a string"),
    "no-text-field": (b'{"body": "x"}', "no field 'text'"),
    "record-is-an-array": (b'["text", "x"]', "no field 'text'"),
    "unpaired-surrogate": (b'{"text": "a\\ud800b"}', "unpaired surrogate"),
    "nested-too-deeply": (
        b'{"text": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        "nested too deeply",
    ),
}


def _bad_record(line: bytes, reason: str, compression: str) -> Callable:
    """A JSONL file with one bad record at a random line: refused at `file:line` (the
    documented default); with --on-bad-line skip it is counted, and every other record packed."""

    def run(env: Env, tmp_path: Path, run_cli) -> None:
        lines = env.inputs["jsonl"].read_bytes().splitlines(keepends=True)
        at = random.Random(reason + compression).randrange(len(lines))
        data = b"".join([*lines[:at], line + b"\n", *lines[at:]])
        damaged = tmp_path / f"records.jsonl{compression}"
        damaged.write_bytes(
            {"": data, ".gz": gzip.compress(data), ".zst": _zstd(data)}[compression]
        )
        out = tmp_path / "out.zarr"
        message = refused(
            run_cli, "data", "pack", damaged, "-o", out, *PACK, names=(f"{damaged}:{at + 1}: ",)
        )
        assert reason in message
        nothing_committed(out)
        code, _, err = run_cli("data", "pack", damaged, "-o", out, *PACK, "--on-bad-line", "skip")
        assert code == 0, err
        packed = PackedDataset(str(out))
        assert packed.meta["counts"]["bad_lines"] == 1
        assert [b.get("line") for b in packed.meta["bad_lines"]] == [at + 1]
        assert np.array_equal(_tokens(out), env.reference["jsonl"])

    return run


for _name, (_line, _reason) in BAD_RECORDS.items():
    case(f"record-{_name}")(_bad_record(_line, _reason, ""))
for _name in ("binary-line", "invalid-json", "text-is-a-number"):
    case(f"record-{_name}-in-gz")(_bad_record(*BAD_RECORDS[_name], ".gz"))
    case(f"record-{_name}-in-zst")(_bad_record(*BAD_RECORDS[_name], ".zst"))


@case("input-a-directory-without-inputs")
def _(env: Env, tmp_path: Path, run_cli) -> None:
    folder = tmp_path / "folder"
    (folder / "sub").mkdir(parents=True)
    (folder / "notes.md").write_text("not an input")
    refused(
        run_cli, "data", "pack", folder, "-o", tmp_path / "out.zarr", *PACK, names=(str(folder),)
    )
    nothing_committed(tmp_path / "out.zarr")


@case("input-an-empty-glob")
def _(env: Env, tmp_path: Path, run_cli) -> None:
    pattern = f"{tmp_path}/nothing-*.jsonl"
    refused(run_cli, "data", "pack", pattern, "-o", tmp_path / "out.zarr", *PACK, names=(pattern,))
    nothing_committed(tmp_path / "out.zarr")


@case("input-missing")
def _(env: Env, tmp_path: Path, run_cli) -> None:
    missing = tmp_path / "missing.jsonl.gz"
    refused(
        run_cli,
        "data",
        "train-tokenizer",
        missing,
        "-o",
        tmp_path / "t.json",
        "--vocab-size",
        "300",
        names=(str(missing),),
    )
    assert not (tmp_path / "t.json").exists()


@case("output-below-a-file")
def _(env: Env, tmp_path: Path, run_cli) -> None:
    out = env.inputs["jsonl"] / "out.zarr"
    refused(
        run_cli,
        "data",
        "pack",
        env.inputs["jsonl"],
        "-o",
        out,
        *PACK,
        names=(str(env.inputs["jsonl"]),),
    )
    assert env.inputs["jsonl"].is_file()


@case("train-tokenizer-output-below-a-file")
def _(env: Env, tmp_path: Path, run_cli) -> None:
    out = env.inputs["jsonl"] / "tokenizer.json"
    refused(
        run_cli,
        "data",
        "train-tokenizer",
        env.inputs["jsonl"],
        "-o",
        out,
        "--vocab-size",
        "300",
        names=(str(env.inputs["jsonl"]),),
    )


@case("log-dir-a-file")
def _(env: Env, tmp_path: Path, run_cli) -> None:
    refused(
        run_cli,
        "data",
        "inspect",
        env.dataset,
        "--log-dir",
        env.inputs["jsonl"],
        names=(str(env.inputs["jsonl"]),),
    )


for _kind in ("jsonl.gz", "jsonl.zst"):
    for _fraction in (0.3, 0.8):

        def _train_on_cut(
            env: Env, tmp_path: Path, run_cli, kind=_kind, fraction=_fraction
        ) -> None:
            source = env.inputs[kind]
            damaged = tmp_path / source.name
            damaged.write_bytes(_cut_at(fraction)(source.read_bytes()))
            out = tmp_path / "tokenizer.json"
            message = refused(
                run_cli,
                "data",
                "train-tokenizer",
                damaged,
                "-o",
                out,
                "--vocab-size",
                "300",
                names=(str(damaged),),
            )
            assert "cut short" in message and "--on-bad-line" not in message
            assert not out.exists()

        case(f"train-tokenizer-{_kind}-cut-at-{_fraction}")(_train_on_cut)


# -- a packed dataset's metadata and small arrays --------------------------------------------------


def _damaged_dataset(
    file: str,
    damage: Callable[[bytes], bytes],
    *,
    must_refuse_on_open: bool,
    verify: bool = False,
) -> Callable:
    """A case that damages one file of a copy of the module's dataset, then inspects it (with
    `--verify` if asked) and merges it: refused naming the dataset or the file, nothing merged.
    `must_refuse_on_open`: opening it (what a run does) must refuse it; otherwise exit 0 is
    allowed where the dataset still reads exactly as packed."""

    def run(env: Env, tmp_path: Path, run_cli) -> None:
        import shutil

        copy = tmp_path / "dataset.zarr"
        shutil.copytree(env.dataset, copy)
        target = copy / file
        target.write_bytes(damage(target.read_bytes()))
        code, _, err = run_cli("data", "inspect", copy, *(("--verify",) if verify else ()))
        if not must_refuse_on_open and code == 0:
            _reads_as_packed(copy, env)
            return
        message = one_line(code, err, names=(str(copy),))
        assert any(hint in message for hint in WHAT_TO_DO), message
        if must_refuse_on_open:
            with pytest.raises(DatasetError):
                PackedDataset(str(copy))
            with pytest.raises(DatasetError):
                open_windows([str(copy)], 32)
        merged = tmp_path / "merged.zarr"
        refused(run_cli, "data", "merge", copy, "-o", merged, names=(str(copy),))
        nothing_committed(merged)

    return run


# what a refused dataset's line says to do: pack it again, or what it is instead
WHAT_TO_DO = ("pack it again", "not a packed dataset", "not a complete", "upgrade")


def _reads_as_packed(path: Path, env: Env) -> None:
    dataset = PackedDataset(str(path))
    assert np.array_equal(dataset.read(0, dataset.n_tokens), env.arrays["tokens"])
    assert np.array_equal(np.asarray(dataset.doc_offsets[:]), env.arrays["doc_offsets"])
    assert np.array_equal(dataset.chunk_docs, env.arrays["chunk_docs"])
    assert np.array_equal(np.asarray(dataset.chunk_heads[:]), env.arrays["chunk_heads"])


def _edit_json(edit: Callable[[dict], Any]) -> Callable[[bytes], bytes]:
    def damage(data: bytes) -> bytes:
        meta = json.loads(data)
        edit(meta)
        return json.dumps(meta).encode()

    return damage


def _ours(edit: Callable[[dict], Any]) -> Callable[[bytes], bytes]:
    """Edit the llmtrain attributes of the group metadata."""
    return _edit_json(lambda meta: edit(meta["attributes"]["llmtrain"]))


def _set(path: str, value: Any) -> Callable[[dict], None]:
    def edit(meta: dict) -> None:
        *parents, last = path.split(".")
        for key in parents:
            meta = meta[key]
        if value is _DELETE:
            del meta[last]
        elif callable(value):
            meta[last] = value(meta[last])
        else:
            meta[last] = value

    return edit


_DELETE = object()

for _file in (
    "zarr.json",
    "tokens/zarr.json",
    "doc_offsets/zarr.json",
    "chunk_docs/zarr.json",
    "chunk_heads/zarr.json",
):
    _short = _file.replace("/zarr.json", "") if "/" in _file else "group"
    for _fraction in sorted(RNG.random() for _ in range(3)):
        case(f"{_short}-metadata-cut-at-{_fraction:.3f}")(
            _damaged_dataset(_file, _cut_at(_fraction), must_refuse_on_open=True)
        )
    for _ in range(3):
        _fraction, _bit = RNG.random(), RNG.randrange(8)
        case(f"{_short}-metadata-flipped-at-{_fraction:.3f}-bit-{_bit}")(
            _damaged_dataset(_file, _flip_at(_fraction, _bit), must_refuse_on_open=False)
        )
    case(f"{_short}-metadata-garbage")(
        _damaged_dataset(
            _file, lambda data: random.Random(3).randbytes(len(data)), must_refuse_on_open=True
        )
    )
    case(f"{_short}-metadata-empty")(
        _damaged_dataset(_file, lambda data: b"", must_refuse_on_open=True)
    )
    case(f"{_short}-metadata-other-json")(
        _damaged_dataset(_file, lambda data: b'{"model": {"vocab": {}}}', must_refuse_on_open=True)
    )
    case(f"{_short}-metadata-a-json-list")(
        _damaged_dataset(_file, lambda data: b"[1, 2]", must_refuse_on_open=True)
    )

for _array in ("tokens", "doc_offsets", "chunk_docs", "chunk_heads"):
    for _delta in (-1, 1, 1000):
        case(f"{_array}-shape-{_delta:+d}")(
            _damaged_dataset(
                f"{_array}/zarr.json",
                _edit_json(_set("shape", lambda shape, d=_delta: [shape[0] + d, *shape[1:]])),
                must_refuse_on_open=True,
            )
        )
    case(f"{_array}-shape-scalar")(
        _damaged_dataset(
            f"{_array}/zarr.json",
            _edit_json(
                lambda meta: meta.update(
                    shape=[], chunk_grid={"name": "regular", "configuration": {"chunk_shape": []}}
                )
            ),
            must_refuse_on_open=True,
        )
    )
    case(f"{_array}-chunk-shape-halved")(
        _damaged_dataset(
            f"{_array}/zarr.json",
            _edit_json(
                _set(
                    "chunk_grid.configuration.chunk_shape",
                    lambda shape: [max(1, shape[0] // 2), *shape[1:]],
                )
            ),
            must_refuse_on_open=True,
        )
    )
    case(f"{_array}-key-encoding-changed")(
        _damaged_dataset(
            f"{_array}/zarr.json",
            _edit_json(_set("chunk_key_encoding.configuration.separator", ".")),
            must_refuse_on_open=True,
        )
    )
for _array in ("tokens", "chunk_heads"):
    case(f"{_array}-data-type-changed")(
        _damaged_dataset(
            f"{_array}/zarr.json", _edit_json(_set("data_type", "uint32")), must_refuse_on_open=True
        )
    )

for _name, _edit in {
    "counts-tokens-plus-one": _set("counts.tokens", lambda n: n + 1),
    "counts-documents-minus-one": _set("counts.documents", lambda n: n - 1),
    "counts-tokens-a-string": _set("counts.tokens", "many"),
    "counts-missing": _set("counts", _DELETE),
    "tokenizer-missing": _set("tokenizer", _DELETE),
    "eod-beyond-the-vocab": _set("tokenizer.eod_id", 10**6),
    "dtype-unknown": _set("dtype", "float32"),
    "sources-not-a-list": _set("sources", "corpus.jsonl"),
    "integrity-entry-not-a-pair": _set("integrity.chunks.tokens", lambda c: {k: "x" for k in c}),
    "integrity-crc-changed": _set(
        "integrity.chunks.doc_offsets", lambda c: {k: [s, crc ^ 1] for k, (s, crc) in c.items()}
    ),
    "integrity-size-changed": _set(
        "integrity.chunks.tokens", lambda c: {k: [s + 1, crc] for k, (s, crc) in c.items()}
    ),
    "not-complete": _set("complete", False),
    "newer-format": _set("version", 99),
}.items():
    case(f"group-metadata-{_name}")(
        _damaged_dataset("zarr.json", _ours(_edit), must_refuse_on_open=True)
    )

for _array, _chunks in (("doc_offsets", 1), ("chunk_docs", 1), ("chunk_heads", 2)):
    for _ in range(3):
        _chunk, _fraction, _bit = RNG.randrange(_chunks), RNG.random(), RNG.randrange(8)
        _key = f"c/{_chunk}" + ("/0" if _array == "chunk_heads" else "")
        case(f"{_array}-{_key.replace('/', '.')}-flipped-at-{_fraction:.3f}-bit-{_bit}")(
            _damaged_dataset(
                f"{_array}/{_key}", _flip_at(_fraction, _bit), must_refuse_on_open=True
            )
        )
for _ in range(3):
    _chunk, _fraction, _bit = RNG.randrange(50), RNG.random(), RNG.randrange(8)
    case(f"tokens-c.{_chunk}-flipped-at-{_fraction:.3f}-bit-{_bit}-verify")(
        _damaged_dataset(
            f"tokens/c/{_chunk}", _flip_at(_fraction, _bit), must_refuse_on_open=False, verify=True
        )
    )


# -- --overwrite of something that is not a dataset ------------------------------------------------


def _user_folder(root: Path) -> Path:
    folder = root / "results"
    (folder / "plots").mkdir(parents=True)
    (folder / "notes.txt").write_text("my notes")
    (folder / "plots" / "loss.png").write_bytes(b"\x89PNG...")
    return folder


def _foreign_zarr(root: Path) -> Path:
    folder = root / "other.zarr"
    group = zarr.open_group(str(folder), mode="w", zarr_format=3, attributes={"owner": "someone"})
    group.create_array("tokens", shape=(4,), dtype="uint16")[:] = [1, 2, 3, 4]
    return folder


def _garbage_zarr(root: Path) -> Path:
    folder = root / "mystery"
    folder.mkdir()
    (folder / "zarr.json").write_bytes(b"\x00garbage")
    (folder / "data.bin").write_bytes(b"precious")
    return folder


def _an_input(root: Path) -> Path:
    path = root / "mine.jsonl"
    path.write_text('{"text": "a document of mine"}\n')
    return path


def _a_config(root: Path) -> Path:
    path = root / "config.json"
    path.write_text('{"model_type": "llama", "hidden_size": 64}')
    return path


TARGETS = {
    "a-folder-of-files": _user_folder,
    "another-zarr-group": _foreign_zarr,
    "a-folder-with-garbage-zarr-json": _garbage_zarr,
    "an-input-file": _an_input,
    "a-json-file": _a_config,
}


def _overwrite(command: str, make_target: Callable[[Path], Path]) -> Callable:
    def run(env: Env, tmp_path: Path, run_cli) -> None:
        target = make_target(tmp_path)
        before = tree(target)
        argv = {
            "pack": ("data", "pack", env.inputs["jsonl"], *PACK),
            "pack-chat": (
                "data",
                "pack-chat",
                env.chats,
                "--seq-len",
                "64",
                "--workers",
                "1",
                "--no-progress",
                *CHAT_TOKENIZER,
            ),
            "merge": ("data", "merge", env.dataset),
            "train-tokenizer": (
                "data",
                "train-tokenizer",
                env.inputs["jsonl"],
                "--vocab-size",
                "300",
                "--no-progress",
            ),
        }[command]
        message = refused(run_cli, *argv, "-o", target, "--overwrite", names=(str(target),))
        assert "nothing was" in message
        assert tree(target) == before
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(f"{target.name}.")] == []

    return run


for _command in ("pack", "pack-chat", "merge", "train-tokenizer"):
    for _target, _make in TARGETS.items():
        case(f"{_command}-overwrite-{_target}")(_overwrite(_command, _make))


@case("pack-overwrite-its-own-input-folder")
def _(env: Env, tmp_path: Path, run_cli) -> None:
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.jsonl").write_bytes(env.inputs["jsonl"].read_bytes())
    before = tree(folder)
    refused(
        run_cli, "data", "pack", folder, "-o", folder, "--overwrite", *PACK, names=(str(folder),)
    )
    assert tree(folder) == before


@case("pack-overwrite-a-dataset-replaces-it")  # what --overwrite is for still works
def _(env: Env, tmp_path: Path, run_cli) -> None:
    import shutil

    out = tmp_path / "dataset.zarr"
    shutil.copytree(env.dataset, out)
    code, _, err = run_cli("data", "pack", env.inputs["jsonl.gz"], "-o", out, "--overwrite", *PACK)
    assert code == 0, err
    assert np.array_equal(_tokens(out), env.reference["jsonl.gz"])


# -- tokenizer files -------------------------------------------------------------------------------


def _damaged_tokenizer(
    kind: str, damage: Callable[[bytes], bytes], *, may_still_load: bool
) -> Callable:
    """Pack with a damaged copy of a tokenizer file: refused naming it before anything is
    written (or, where allowed, a valid tokenizer after all: a complete dataset)."""

    def run(env: Env, tmp_path: Path, run_cli) -> None:
        source = env.tokenizers[kind]
        damaged = tmp_path / source.name
        damaged.write_bytes(damage(source.read_bytes()))
        out = tmp_path / "out.zarr"
        code, _, err = run_cli(
            "data",
            "pack",
            env.inputs["jsonl"],
            "-o",
            out,
            "--tokenizer",
            damaged,
            "--workers",
            "1",
            "--no-progress",
        )
        if may_still_load and code == 0:
            assert PackedDataset(str(out)).n_documents == 120, err
            return
        one_line(code, err, names=(str(damaged),))
        nothing_committed(out)

    return run


def _tokenizer_damaged(kind: str, damage: Callable[[bytes], bytes], tolerated: bool) -> Callable:
    return _damaged_tokenizer(kind, damage, may_still_load=tolerated)


for _kind in ("tokenizer.json", "tiktoken"):
    damage_family(_kind, _tokenizer_damaged, cuts=5, flips=4, garbage_seed=4, last_byte=False)
    case(f"{_kind}-other-json")(
        _damaged_tokenizer(
            _kind, lambda data: b'{"model_type": "gpt2", "vocab_size": 50257}', may_still_load=False
        )
    )
case("tiktoken-a-line-twice")(
    _damaged_tokenizer(
        "tiktoken", lambda data: data + data.splitlines(keepends=True)[70], may_still_load=False
    )
)
case("tiktoken-a-rank-twice")(
    _damaged_tokenizer(
        "tiktoken", lambda data: data.replace(b" 258\n", b" 257\n"), may_still_load=False
    )
)
case("tokenizer.json-a-json-list")(
    _damaged_tokenizer("tokenizer.json", lambda data: b"[]", may_still_load=False)
)
case("tokenizer.json-a-sentencepiece-model")(
    _damaged_tokenizer(
        "tokenizer.json",
        lambda data: b"\n\x0b\n\x05<unk>\x15\x00\x00\x00\x00\x18\x02",
        may_still_load=False,
    )
)


@case("tokenizer-a-sentencepiece-model-by-name")
def _(env: Env, tmp_path: Path, run_cli) -> None:
    model = tmp_path / "tokenizer.model"
    model.write_bytes(b"\n\x0b\n\x05<unk>\x15\x00\x00\x00\x00\x18\x02")
    out = tmp_path / "out.zarr"
    refused(
        run_cli,
        "data",
        "pack",
        env.inputs["jsonl"],
        "-o",
        out,
        "--tokenizer",
        model,
        "--workers",
        "1",
        names=(str(model),),
    )
    nothing_committed(out)


@case("tokenizer-a-directory")
def _(env: Env, tmp_path: Path, run_cli) -> None:
    out = tmp_path / "out.zarr"
    folder = tmp_path / "model"
    folder.mkdir()
    refused(
        run_cli,
        "data",
        "pack",
        env.inputs["jsonl"],
        "-o",
        out,
        "--tokenizer",
        f"hf:{folder}",
        "--workers",
        "1",
        names=(str(folder),),
    )
    nothing_committed(out)


@pytest.mark.parametrize("bad", CASES, ids=lambda c: c.id)
def test_a_bad_data_input_is_one_line_and_nothing_is_lost(bad: Case, env, tmp_path, run_cli):
    bad.run(env, tmp_path, run_cli)


def test_the_table_is_large():
    assert len(CASES) > 150
    assert len({c.id for c in CASES}) == len(CASES)


# -- what the damaged inputs leave with --on-bad-line skip, and what intact ones still read --------


def test_skip_keeps_the_lines_before_the_cut_and_counts_the_file(env, tmp_path, run_cli):
    data = env.inputs["jsonl"].read_bytes()
    damaged = tmp_path / "cut.jsonl.gz"
    damaged.write_bytes(gzip.compress(data)[: len(gzip.compress(data)) * 2 // 3])
    out = tmp_path / "out.zarr"
    code, _, err = run_cli(
        "data", "pack", damaged, env.inputs["jsonl"], "-o", out, *PACK, "--on-bad-line", "skip"
    )
    assert code == 0, err
    packed = PackedDataset(str(out))
    [bad] = packed.meta["bad_lines"]
    assert bad["file"] == str(damaged) and bad["reason"].startswith("cut short")
    kept = packed.meta["sources"][0]["kept"]
    assert 0 < kept < 120 and f"after {kept} whole lines" in bad["reason"]
    assert packed.meta["sources"][0]["bad"] == 1
    reference = PackedDataset(str(env.root / "reference-jsonl.zarr"))
    assert np.array_equal(
        packed.read(0, int(packed.doc_offsets[kept])),
        reference.read(0, int(reference.doc_offsets[kept])),
    )


def test_concatenated_members_and_frames_read_whole(env, tmp_path):
    """gzip members and zstd frames one after the other (pigz, `cat a.gz b.gz`, pzstd) are one
    file: every line of every member is read, and zero padding after a gzip member is skipped."""
    lines = env.inputs["jsonl"].read_bytes().splitlines(keepends=True)
    first, second = b"".join(lines[:50]), b"".join(lines[50:])
    files = {
        "members.jsonl.gz": gzip.compress(first) + gzip.compress(second) + b"\0" * 16,
        "frames.jsonl.zst": _zstd(first) + zstandard.ZstdCompressor().compress(second),
    }
    for name, data in files.items():
        path = tmp_path / name
        path.write_bytes(data)
        out = tmp_path / f"{name}.zarr"
        pack([str(path)], str(out), BYTES, workers=1, split_bytes=4096)
        assert np.array_equal(_tokens(out), env.reference["jsonl"]), name


def test_a_cut_arrow_stream_is_refused_even_between_batches(env, tmp_path, run_cli):
    """An Arrow IPC stream cut where a record batch ends reads as fewer rows (pyarrow takes it):
    the stream's end-of-stream marker is required."""
    table = pa.ipc.open_stream(env.inputs["arrow"].read_bytes()).read_all()
    sink = pa.BufferOutputStream()
    writer = pa.ipc.new_stream(sink, table.schema)
    for batch in table.to_batches(max_chunksize=30)[:2]:
        writer.write_batch(batch)
    cut = tmp_path / "cut.arrow"
    cut.write_bytes(sink.getvalue().to_pybytes())  # two whole batches, not closed
    assert pa.ipc.open_stream(cut.read_bytes()).read_all().num_rows == 60
    message = refused(
        run_cli, "data", "pack", cut, "-o", tmp_path / "out.zarr", *PACK, names=(str(cut),)
    )
    assert "end-of-stream" in message
    nothing_committed(tmp_path / "out.zarr")


# -- storage that cannot be used -------------------------------------------------------------------


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


S3_CASES = [
    ("pack-output-in-a-missing-bucket", "missing-out", "bucket 'no-such-bucket' does not exist"),
    ("pack-input-in-a-missing-bucket", "missing-in", "bucket 'no-such-bucket' does not exist"),
    ("inspect-in-a-missing-bucket", "missing-inspect", "bucket 'no-such-bucket' does not exist"),
    (
        "train-tokenizer-output-in-a-missing-bucket",
        "missing-tokenizer",
        "bucket 'no-such-bucket' does not exist",
    ),
    ("pack-output-unreachable", "unreachable-out", "cannot reach the storage endpoint"),
    ("pack-input-unreachable", "unreachable-in", "cannot reach the storage endpoint"),
    ("inspect-unreachable", "unreachable-inspect", "cannot reach the storage endpoint"),
    ("merge-unreachable", "unreachable-merge", "cannot reach the storage endpoint"),
    (
        "train-tokenizer-output-unreachable",
        "unreachable-tokenizer",
        "cannot reach the storage endpoint",
    ),
    ("pack-output-denied", "denied-out", "access denied"),
    ("pack-input-denied", "denied-in", "access denied"),
    ("inspect-denied", "denied-inspect", "access denied"),
]


@pytest.mark.parametrize(("what", "how", "said"), S3_CASES, ids=[c[0] for c in S3_CASES])
def test_storage_that_cannot_be_used_is_one_line_naming_the_url(
    what, how, said, env, moto_s3, monkeypatch, tmp_path, run_cli
):
    import fsspec
    from moto.core.authorization import enable_iam_authentication

    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # one try: a closed port answers at once
    kind, command = how.split("-")
    bucket = "s3://no-such-bucket" if kind == "missing" else moto_s3
    options: tuple[str, ...] = ()
    if kind == "unreachable":
        options = ("--storage-option", f"endpoint_url=http://127.0.0.1:{_closed_port()}")
    elif kind == "denied":  # credentials the server does not know, with IAM checks on
        options = (
            "--storage-option",
            "key=AKIAIOSFODNN7BOGUSKEY",
            "--storage-option",
            "secret=nope",
        )
    url = f"{bucket}/data/out.zarr"
    argv = {
        "out": ("data", "pack", env.inputs["jsonl"], "-o", url, *PACK),
        "in": ("data", "pack", f"{bucket}/raw/corpus.jsonl", "-o", tmp_path / "out.zarr", *PACK),
        "inspect": ("data", "inspect", url),
        "merge": ("data", "merge", url, "-o", tmp_path / "out.zarr"),
        "tokenizer": (
            "data",
            "train-tokenizer",
            env.inputs["jsonl"],
            "-o",
            f"{bucket}/tok.json",
            "--vocab-size",
            "300",
            "--no-progress",
        ),
    }[command]
    gc.collect()  # s3fs sessions of earlier tests say they were not closed when collected
    if kind == "denied":
        with enable_iam_authentication():
            message = refused(run_cli, *argv, *options, names=(bucket,))
    else:
        message = refused(run_cli, *argv, *options, names=(bucket,))
    assert said in message
    assert not (tmp_path / "out.zarr").exists()
    if kind != "missing":
        assert fsspec.filesystem("s3").find(moto_s3.removeprefix("s3://")) == []  # nothing written


def test_a_run_on_an_unreachable_endpoint_is_refused_on_open(monkeypatch):
    """What `llmtrain run` meets when it opens data on storage it cannot reach: a DatasetError
    (exit 2) naming the URL, before anything else happens."""
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    options = {"endpoint_url": f"http://127.0.0.1:{_closed_port()}", "key": "a", "secret": "b"}
    with pytest.raises(
        DatasetError, match=r"^s3://bucket/data\.zarr/zarr\.json: cannot reach"
    ) as info:
        open_windows(["s3://bucket/data.zarr"], 32, storage_options=options)
    assert "\n" not in str(info.value) and "endpoint_url" in str(info.value)
