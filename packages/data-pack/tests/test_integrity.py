"""Damaged datasets are refused, never read as zeros: real packs whose chunk files are deleted,
cut short or changed, and whose metadata files are damaged, checked on open (one listing:
presence and recorded sizes), on read (a chunk read whole against its checksum), and by
`llmtrain data inspect --verify` (every chunk against its checksum), locally and on S3; and the
temporaries of killed packs are removed by the next pack of the same output, those of running
packs kept."""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import fsspec
import numpy as np
import pytest

from llmtrain.data_pack import staging
from llmtrain.data_pack.errors import DatasetError
from llmtrain.data_pack.integrity import INTEGRITY_KEY, DamagedDatasetError
from llmtrain.data_pack.loader import open_windows
from llmtrain.data_pack.merge import merge
from llmtrain.data_pack.pack import pack
from llmtrain.data_pack.staging import OWNER_FILE, remove_stale_temporaries
from llmtrain.data_pack.store import Output, PackedDataset
from llmtrain.data_pack.windows import TokenWindows

BYTES = {"kind": "bytes"}
CHUNK_TOKENS = 512  # uint16 tokens: 1,024-byte chunks, dozens of them
DAMAGED = "(the dataset is damaged; pack it again)"


@pytest.fixture
def dataset(tmp_path: Path, write_jsonl, texts) -> Path:
    """A packed dataset (bytes tokenizer, small chunks, provenance) of the 300-text corpus."""
    source = write_jsonl("corpus.jsonl", texts)
    out = tmp_path / "ds.zarr"
    pack([str(source)], str(out), BYTES, workers=1, chunk_tokens=CHUNK_TOKENS)
    assert PackedDataset(str(out)).n_chunks >= 8
    return out


def _chunks(ds: Path, array: str = "tokens") -> list[Path]:
    return sorted((ds / array / "c").iterdir(), key=lambda p: int(p.name))


def _missing(ds: Path, array: str, key: str) -> str:
    return f"{ds}: {array} chunk {key} is missing {DAMAGED}"


def _flip_byte(path: Path, offset: int = 100) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _forget_integrity(ds: Path) -> None:
    """Make the dataset look packed before chunk sizes and checksums were recorded."""
    group = ds / "zarr.json"
    meta = json.loads(group.read_text())
    del meta["attributes"]["llmtrain"][INTEGRITY_KEY]
    group.write_text(json.dumps(meta))


def _all_tokens(ds: Path) -> np.ndarray:
    dataset = PackedDataset(str(ds))
    return dataset.read(0, dataset.n_tokens)


# -- what the pack records ------------------------------------------------------------------------


def test_the_pack_records_every_chunk_it_wrote(dataset):
    record = PackedDataset(str(dataset)).meta[INTEGRITY_KEY]
    assert record["checksum"] == "crc32"
    for array, chunks in record["chunks"].items():
        stored = {
            str(p.relative_to(dataset / array)): p.stat().st_size
            for p in (dataset / array).rglob("*")
            if p.is_file() and p.name != "zarr.json"
        }
        assert {key: size for key, (size, _) in chunks.items()} == stored, array
    assert len(record["chunks"]["tokens"]) == PackedDataset(str(dataset)).n_chunks
    assert not (dataset / OWNER_FILE).exists()  # the staging marker is not committed


def test_an_intact_dataset_verifies(dataset, run_cli):
    record = PackedDataset(str(dataset)).meta[INTEGRITY_KEY]["chunks"]
    n = sum(len(chunks) for chunks in record.values())
    code, out, err = run_cli("data", "inspect", dataset, "--verify")
    assert code == 0, err
    assert f"all {n:,} chunks verified" in out
    code, out, err = run_cli("data", "inspect", dataset, "--verify", "--json")
    assert code == 0, err
    assert json.loads(out)["verified"] == {"chunks": n, "checked": "size and crc32"}


def test_a_merge_records_its_chunks_too(dataset, tmp_path, run_cli):
    merged = tmp_path / "merged.zarr"
    merge([str(dataset), str(dataset)], str(merged))
    code, out, err = run_cli("data", "inspect", merged, "--verify")
    assert code == 0, err
    assert "chunks verified" in out
    _chunks(merged)[3].unlink()
    with pytest.raises(DatasetError, match=re.escape(_missing(merged, "tokens", "c/3"))):
        PackedDataset(str(merged))


# -- refused on open ------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["middle", "last"])
def test_a_missing_tokens_chunk_is_refused_on_open(dataset, run_cli, which):
    chunks = _chunks(dataset)
    victim = chunks[2] if which == "middle" else chunks[-1]
    victim.unlink()
    message = _missing(dataset, "tokens", f"c/{victim.name}")
    with pytest.raises(DatasetError, match=re.escape(message)):
        PackedDataset(str(dataset))
    code, out, err = run_cli("data", "inspect", dataset)
    assert code == 2
    assert err.strip().splitlines()[-1] == f"error: {message}"
    assert "this is a bug" not in err and out == ""


def test_a_missing_doc_offsets_chunk_is_refused(dataset):
    (dataset / "doc_offsets" / "c" / "0").unlink()
    with pytest.raises(DatasetError, match=re.escape(_missing(dataset, "doc_offsets", "c/0"))):
        PackedDataset(str(dataset))


def test_several_missing_chunks_are_counted(dataset):
    for chunk in _chunks(dataset)[1:7]:
        chunk.unlink()
    with pytest.raises(DamagedDatasetError) as caught:
        PackedDataset(str(dataset))
    assert [d.key for d in caught.value.damage] == [f"c/{k}" for k in range(1, 7)]
    assert "tokens chunk c/1 is missing, and 5 more damaged chunk(s) (tokens c/2," in str(
        caught.value
    )
    assert len(str(caught.value).splitlines()) == 1


def test_a_truncated_chunk_is_refused_on_open_and_by_verify(dataset, run_cli):
    victim = _chunks(dataset)[4]
    size = victim.stat().st_size
    victim.write_bytes(victim.read_bytes()[: size // 2])
    message = (
        f"{dataset}: tokens chunk c/4 holds {size // 2:,} bytes, not the {size:,} written "
        f"(cut short or overwritten) {DAMAGED}"
    )
    with pytest.raises(DatasetError, match=re.escape(message)):
        PackedDataset(str(dataset))
    code, _, err = run_cli("data", "inspect", dataset, "--verify")
    assert code == 2
    assert err.strip().splitlines()[-1] == f"error: {message}"


def test_a_flipped_byte_is_refused_on_read_and_found_by_verify(dataset, run_cli):
    _flip_byte(_chunks(dataset)[5])  # same size: the open's listing cannot tell
    checksum = (
        rf"{re.escape(str(dataset))}: tokens chunk c/5 does not match its checksum "
        rf"\(crc32 [0-9a-f]{{8}}, [0-9a-f]{{8}} written\) {re.escape(DAMAGED)}"
    )
    opened = PackedDataset(str(dataset))
    np.testing.assert_array_equal(opened.read_chunk(4), opened.read(4 * 512, 5 * 512))
    with pytest.raises(DamagedDatasetError, match=f"^{checksum}$"):
        opened.read_chunk(5)
    with pytest.raises(DamagedDatasetError, match=f"^{checksum}$"):
        opened.read(0, opened.n_tokens)
    windows = open_windows([str(dataset)], 64)  # the training path
    with pytest.raises(DamagedDatasetError, match=f"^{checksum}$"):
        windows.read(np.arange(len(windows)))
    code, out, err = run_cli("data", "inspect", dataset, "--verify")
    assert code == 2 and "verified" not in out
    line = err.strip().splitlines()[-1]
    assert re.fullmatch(f"error: {checksum}", line), line


def test_a_flipped_byte_in_a_dataset_without_the_record_still_reads(dataset):
    """No checksum recorded: nothing to compare a whole read with (pack it again to have one)."""
    expected = _all_tokens(dataset)
    _forget_integrity(dataset)
    _flip_byte(_chunks(dataset)[5])
    assert (_all_tokens(dataset) != expected).sum() == 1


def test_a_flipped_byte_in_another_array_is_named(dataset):
    _flip_byte(dataset / "doc_offsets" / "c" / "0", offset=8)
    with pytest.raises(DamagedDatasetError, match="doc_offsets chunk c/0 does not match"):
        PackedDataset(str(dataset)).verify()


@pytest.mark.parametrize("array", ["tokens", "chunk_heads", "chunk_docs"])
@pytest.mark.parametrize("damage", ["truncated", "empty", "not an array"])
def test_damaged_array_metadata_is_refused_naming_the_file(dataset, run_cli, array, damage):
    meta = dataset / array / "zarr.json"
    text = meta.read_text()
    if damage == "truncated":
        meta.write_text(text[: len(text) // 2])
    elif damage == "empty":
        meta.write_text("")
    else:
        meta.write_text(json.dumps({**json.loads(text), "data_type": "no-such-type"}))
    start = f"{meta} cannot be read as zarr array metadata ("
    with pytest.raises(DatasetError) as caught:
        PackedDataset(str(dataset))
    assert str(caught.value).startswith(start) and str(caught.value).endswith(DAMAGED)
    code, out, err = run_cli("data", "inspect", dataset)
    assert code == 2 and out == ""
    assert "this is a bug" not in err
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"error: {start}") and line.endswith(DAMAGED), line


@pytest.mark.parametrize(
    "content",
    [
        '{"zarr_format": 3, "node_',
        "[]",
        '{"zarr_format": 3, "node_type": "group", "attributes": []}',
    ],
)
def test_damaged_group_metadata_is_refused_naming_the_file(dataset, run_cli, content):
    (dataset / "zarr.json").write_text(content)
    code, out, err = run_cli("data", "inspect", dataset)
    assert code == 2 and out == ""
    assert "this is a bug" not in err
    line = err.strip().splitlines()[-1]
    start = f"error: {dataset / 'zarr.json'} cannot be read as zarr group metadata ("
    assert line.startswith(start) and line.endswith(DAMAGED), line


# -- refused on read ------------------------------------------------------------------------------


def test_a_chunk_lost_after_the_open_is_not_read_as_zeros(dataset):
    opened = PackedDataset(str(dataset))
    _chunks(dataset)[3].unlink()
    with pytest.raises(DatasetError, match=re.escape(_missing(dataset, "tokens", "c/3"))):
        opened.read_chunk(3)
    np.testing.assert_array_equal(opened.read_chunk(2), opened.read(2 * 512, 3 * 512))


def test_windows_on_a_damaged_dataset_are_refused(dataset):
    """The training path: train-loop opens its data through open_windows."""
    windows = TokenWindows(str(dataset), 64)  # opened while intact
    (dataset / "doc_offsets" / "c" / "0").unlink()
    with pytest.raises(DatasetError, match="doc_offsets chunk c/0 is missing"):
        windows.read(np.arange(len(windows)), doc_starts=True)
    with pytest.raises(DatasetError, match=re.escape(_missing(dataset, "doc_offsets", "c/0"))):
        open_windows([str(dataset)], 64, doc_starts=True)


# -- datasets packed before the record -------------------------------------------------------------


def test_a_dataset_without_the_record_still_opens_and_verifies(dataset, run_cli):
    expected = _all_tokens(dataset)
    _forget_integrity(dataset)
    opened = PackedDataset(str(dataset))
    assert not opened.checksummed
    np.testing.assert_array_equal(opened.read(0, opened.n_tokens), expected)
    code, out, err = run_cli("data", "inspect", dataset, "--verify")
    assert code == 0, err
    assert re.search(r"all [\d,]+ chunks verified \(each one decodes; no checksums", out)


def test_an_empty_dataset_without_the_record_opens(tmp_path, write_jsonl, run_cli):
    """Its offsets and chunk index hold a single 0 each, a chunk zarr does not store."""
    out = tmp_path / "empty.zarr"
    pack([str(write_jsonl("blank.jsonl", [""]))], str(out), BYTES, workers=1)
    _forget_integrity(out)
    assert PackedDataset(str(out)).n_tokens == 0
    code, out, err = run_cli("data", "inspect", out, "--verify")
    assert code == 0, err


@pytest.mark.parametrize(("array", "which"), [("tokens", 2), ("tokens", -1), ("doc_offsets", 0)])
def test_a_dataset_without_the_record_still_refuses_a_missing_chunk(dataset, array, which):
    _forget_integrity(dataset)
    victim = _chunks(dataset, array)[which]
    victim.unlink()
    with pytest.raises(DatasetError, match=re.escape(_missing(dataset, array, f"c/{victim.name}"))):
        PackedDataset(str(dataset))


def test_a_dataset_without_the_record_names_a_chunk_that_does_not_decode(dataset, run_cli):
    _forget_integrity(dataset)
    victim = _chunks(dataset)[4]
    victim.write_bytes(victim.read_bytes()[:300])
    message = f"{dataset}: tokens chunk c/4 cannot be decoded (cut short or corrupt) {DAMAGED}"
    opened = PackedDataset(str(dataset))  # no sizes to compare: found when read
    with pytest.raises(DatasetError, match=re.escape(message)):
        opened.read(0, opened.n_tokens)
    with pytest.raises(DatasetError, match=re.escape(message)):
        TokenWindows(opened, 100).read(np.arange(40))
    code, _, err = run_cli("data", "inspect", dataset, "--verify")
    assert code == 2
    assert err.strip().splitlines()[-1] == f"error: {message}"
    assert "this is a bug" not in err


# -- object storage -------------------------------------------------------------------------------


def test_damage_on_s3_is_refused_and_found(moto_s3, write_jsonl, texts, run_cli):
    url = f"{moto_s3}/packed/ds"
    source = write_jsonl("corpus.jsonl", texts)
    pack([str(source)], url, BYTES, workers=1, chunk_tokens=CHUNK_TOKENS, compression="zstd")
    n = PackedDataset(url).verify()
    assert n > 8
    fs = fsspec.filesystem("s3")
    root = url.removeprefix("s3://")
    flipped = f"{root}/tokens/c/3"
    data = bytearray(fs.cat_file(flipped))
    data[len(data) // 2] ^= 0x10
    fs.pipe_file(flipped, bytes(data))
    with pytest.raises(DamagedDatasetError, match="tokens chunk c/3 does not match its checksum"):
        PackedDataset(url).verify()
    fs.rm(f"{root}/tokens/c/5")
    with pytest.raises(DatasetError, match=re.escape(_missing(url, "tokens", "c/5"))):
        PackedDataset(url)
    code, _, err = run_cli("data", "inspect", url, "--verify")
    assert code == 2
    assert err.strip().splitlines()[-1] == f"error: {_missing(url, 'tokens', 'c/5')}"


# -- temporaries of killed packs ------------------------------------------------------------------


def _temporaries(out: Path) -> list[Path]:
    return sorted(out.parent.glob(f"{out.name}.tmp-*"))


def _start_pack(tmp_path: Path, texts: list[str], out: Path) -> subprocess.Popen:
    """`llmtrain data pack` in a child process, in a session of its own so that killing its
    process group kills its workers too, on an input that takes seconds to pack."""
    data = tmp_path / "big.jsonl"
    block = "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()
    data.write_bytes(block * (48 * (1 << 20) // len(block)))
    script = "from llmtrain.core_mesh.cli import main; raise SystemExit(main())"
    args = ["data", "pack", data, "-o", out, "--tokenizer", "bytes", "--workers", 1]
    args += ["--no-progress", "--chunk-tokens", 4096]
    return subprocess.Popen(
        [sys.executable, "-c", script, *map(str, args)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=tmp_path,
        start_new_session=True,
    )


def _kill_once_staging(proc: subprocess.Popen, out: Path, skip: Path, timeout: float = 120) -> Path:
    """SIGKILL the pack (and its workers) once it has written chunks into its temporary (the
    one that is not `skip`)."""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            assert proc.poll() is None, "the pack ended before it could be killed"
            for found in _temporaries(out):
                if found != skip and any(found.glob("tokens/c/*")):
                    return found
            time.sleep(0.01)
        raise AssertionError(f"no temporary of {out} after {timeout} s")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)  # reaped: a zombie's pid still answers os.kill(pid, 0)


def test_the_next_pack_removes_a_killed_packs_temporary(tmp_path, texts, write_jsonl, run_cli):
    out = tmp_path / "ds.zarr"
    running = Output(str(out), overwrite=False)  # a pack of this test's process, still running
    live = Path(running.staging)
    try:
        proc = _start_pack(tmp_path, texts, out)
        stale = _kill_once_staging(proc, out, skip=live)
        assert not out.exists()
        assert _temporaries(out) == sorted([stale, live])
        small = write_jsonl("small.jsonl", texts[:20])
        code, _, err = run_cli("data", "pack", small, "-o", out, "--tokenizer", "bytes")
        assert code == 0, err
        assert not stale.exists()
        assert live.is_dir() and (live / OWNER_FILE).exists()
        assert "output.stale_temporary_removed" in err and str(stale) in err
        assert "output.temporary_kept" in err and "is still running" in err
        assert PackedDataset(str(out)).n_documents == 20
    finally:
        running.abort()
    assert _temporaries(out) == []


def test_an_owner_record_that_cannot_be_written_leaves_no_temporary(tmp_path, monkeypatch):
    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(staging.json, "dump", no_space)
    out = tmp_path / "ds.zarr"
    with pytest.raises(OSError, match="No space left"):
        Output(str(out), overwrite=False)
    assert _temporaries(out) == []


def test_only_temporaries_of_gone_packs_are_removed(tmp_path):
    out = tmp_path / "ds.zarr"
    reused = Output(str(out), overwrite=False)  # its pid will stand for another process
    elsewhere = Output(str(out), overwrite=False)  # will be a pack on another machine
    owner_file = Path(reused.staging) / OWNER_FILE
    owner = json.loads(owner_file.read_text())
    if owner["started"] is None:
        pytest.skip("no /proc start times to tell a reused pid apart")
    owner_file.write_text(json.dumps({**owner, "started": owner["started"] + 1}))
    owner_file = Path(elsewhere.staging) / OWNER_FILE
    owner_file.write_text(json.dumps({**owner, "host": owner["host"] + "-other"}))
    unowned = tmp_path / "ds.zarr.tmp-0123abcd"  # no owner record: an older llmtrain's
    unowned.mkdir()
    unrelated = [tmp_path / "ds.zarr.tmp-notes", tmp_path / "other.zarr.tmp-0123abcd"]
    for path in unrelated:
        path.mkdir()
    assert remove_stale_temporaries(str(out)) == [reused.staging]
    assert sorted(_temporaries(out)) == sorted([Path(elsewhere.staging), unowned, unrelated[0]])
    assert unrelated[1].is_dir()
