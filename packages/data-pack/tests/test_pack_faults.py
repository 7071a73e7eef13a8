"""Bad input and failures: exact file:line errors, skip-and-count, missing inputs, and worker
processes that die or a pack that is interrupted — never a hang, never a committed dataset."""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import psutil
import pytest

from llmtrain.core_mesh.errors import UserError
from llmtrain.data_pack.errors import DatasetError
from llmtrain.data_pack.pack import MAX_RECORDED_BAD_LINES, PackError, pack
from llmtrain.data_pack.sources import InputError, parse_record
from llmtrain.data_pack.store import PackedDataset

BYTES = {"kind": "bytes"}

BAD_LINES = {
    "malformed": (b'{"text": "unterminated', "malformed JSON (Unterminated string starting at"),
    "truncated": (b'{"text": "a"', "malformed JSON (Expecting ',' delimiter at column 13)"),
    "utf8": (b'{"text": "\xff\xfe"}', "invalid UTF-8 at byte 10"),
    "missing": (b'{"body": "no text here"}', "no field 'text'"),
    "not_object": (b'["text", "a list"]', "no field 'text'"),
    "number": (b'{"text": 5}', "field is int, not a string"),
    "null": (b'{"text": null}', "field is NoneType, not a string"),
    "list": (b'{"text": ["a"]}', "field is list, not a string"),
}


def _corpus_lines(texts: list[str]) -> list[bytes]:
    return [json.dumps({"text": t}, ensure_ascii=False).encode() for t in texts]


def _write_lines(path, lines: list[bytes], compress: bool = False) -> None:
    data = b"".join(line + b"\n" for line in lines)
    if compress:
        import gzip

        data = gzip.compress(data)
    path.write_bytes(data)


def _assert_nothing_written(tmp_path, out) -> None:
    assert not out.exists()
    assert [n for n in os.listdir(tmp_path) if n.startswith(out.name)] == []
    with pytest.raises(DatasetError, match="not a packed dataset"):
        PackedDataset(str(out))


def _spawned_workers() -> list[psutil.Process]:
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if any("spawn_main" in part for part in child.cmdline()):
                found.append(child)
        except psutil.NoSuchProcess:
            pass
    return found


@pytest.mark.parametrize("kind", sorted(BAD_LINES))
def test_bad_line_names_file_and_absolute_line(tmp_path, texts, kind):
    line, reason = BAD_LINES[kind]
    lines = _corpus_lines(texts)
    # blank lines count as lines; the bad one lies many 2000-byte ranges into the file
    lines[10:10] = [b"", b"   "]
    lines.insert(250, line)
    data = tmp_path / "corpus.jsonl"
    _write_lines(data, lines)
    assert data.stat().st_size > 15 * 2000
    out = tmp_path / "ds"
    with pytest.raises(PackError) as info:
        pack([str(data)], str(out), BYTES, workers=1, split_bytes=2000)
    message = str(info.value)
    assert message.startswith(f"{data}:251: {reason}")
    assert message.endswith(
        "; fix the line, or pass --on-bad-line skip to skip and count such lines"
    )
    _assert_nothing_written(tmp_path, out)


# valid JSON syntax, still bad input: a text that is no Unicode (a lone surrogate escape) and a
# record nested deeper than the JSON parser recurses
UNREADABLE = {
    "surrogate": b'{"text": "bad \\ud800 text"}',
    "deep": b'{"text": "x", "deep": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
}


@pytest.mark.parametrize("kind", sorted(UNREADABLE))
@pytest.mark.parametrize("tokenizer", ["bytes", "hf"])
def test_unreadable_text_is_a_bad_line(tmp_path, texts, tokenizer_json, kind, tokenizer):
    lines = _corpus_lines(texts[:40])
    lines.insert(30, UNREADABLE[kind])
    data = tmp_path / "corpus.jsonl"
    _write_lines(data, lines)
    spec = BYTES if tokenizer == "bytes" else {"kind": "hf", "path": str(tokenizer_json)}
    out = tmp_path / "ds"
    with pytest.raises(PackError, match=rf"^{re.escape(str(data))}:31: "):
        pack([str(data)], str(out), spec, workers=1)
    _assert_nothing_written(tmp_path, out)
    summary = pack([str(data)], str(out), spec, workers=1, on_bad_line="skip")
    assert (summary.documents, summary.bad_lines) == (40, 1)
    assert PackedDataset(str(out)).meta["bad_lines"][0]["line"] == 31


def test_bad_line_with_workers_and_compressed_input(tmp_path, texts):
    lines = _corpus_lines(texts)
    lines.insert(280, BAD_LINES["utf8"][0])
    lines.insert(290, BAD_LINES["missing"][0])  # only the first bad line is reported
    plain, packed = tmp_path / "corpus.jsonl", tmp_path / "corpus.jsonl.gz"
    _write_lines(plain, lines)
    _write_lines(packed, lines, compress=True)

    out = tmp_path / "ds"
    with pytest.raises(
        PackError, match=rf"^{re.escape(str(plain))}:281: invalid UTF-8 at byte 10; "
    ):
        pack([str(plain)], str(out), BYTES, workers=2, split_bytes=1000)
    _assert_nothing_written(tmp_path, out)
    # the worker processes are gone once the error is raised
    assert _spawned_workers() == []

    with pytest.raises(
        PackError, match=rf"^{re.escape(str(packed))}:281: invalid UTF-8 at byte 10; "
    ):
        pack([str(packed)], str(out), BYTES, workers=1, split_bytes=1000)
    _assert_nothing_written(tmp_path, out)


def test_bad_line_in_second_file_counts_lines_of_that_file(tmp_path, texts):
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    _write_lines(first, _corpus_lines(texts[:150]))
    lines = _corpus_lines(texts[150:])
    lines.insert(99, BAD_LINES["number"][0])
    _write_lines(second, lines)
    with pytest.raises(
        PackError, match=rf"^{re.escape(str(second))}:100: field is int, not a string"
    ):
        pack([str(first), str(second)], str(tmp_path / "ds"), BYTES, workers=1, split_bytes=3000)
    _assert_nothing_written(tmp_path, tmp_path / "ds")


def test_bad_dotted_field(tmp_path):
    data = tmp_path / "nested.jsonl"
    _write_lines(data, [b'{"meta": {"body": "ok"}}', b'{"meta": "flat"}'])
    with pytest.raises(PackError, match=rf"^{re.escape(str(data))}:2: no field 'meta.body'"):
        pack([str(data)], str(tmp_path / "ds"), BYTES, field="meta.body", workers=1)


def test_skip_bad_lines_counts_and_records_them(tmp_path, texts):
    good = texts[:200]
    lines = _corpus_lines(good)
    inserted = {}  # line number -> reason
    lines.insert(150, b'{"text": ""}')
    for number, kind in [(3, "malformed"), (57, "utf8"), (120, "missing"), (199, "null")]:
        lines.insert(number - 1, BAD_LINES[kind][0])
    lines.append(BAD_LINES["list"][0])
    for number, line in enumerate(lines, 1):
        for kind, (bad, reason) in BAD_LINES.items():
            if line == bad:
                inserted[number] = (kind, reason)
    data = tmp_path / "corpus.jsonl"
    _write_lines(data, lines)
    out = tmp_path / "ds"
    summary = pack([str(data)], str(out), BYTES, workers=1, on_bad_line="skip", split_bytes=1500)
    assert (summary.documents, summary.bad_lines, summary.empty_documents) == (200, 5, 1)
    ds = PackedDataset(str(out))
    tokens, offsets = ds.read(0, ds.n_tokens), np.asarray(ds.doc_offsets[:])
    assert [
        bytes(tokens[a : b - 1].tolist()).decode() for a, b in itertools.pairwise(offsets)
    ] == good
    assert ds.meta["counts"]["bad_lines"] == 5
    assert ds.meta["counts"]["empty_documents"] == 1
    recorded = ds.meta["bad_lines"]
    assert [r["line"] for r in recorded] == sorted(inserted)
    assert [r["line"] for r in recorded] == [3, 57, 120, 199, 206]
    for r in recorded:
        assert r["file"] == str(data)
        assert r["reason"].startswith(inserted[r["line"]][1])


def test_skip_records_only_the_first_bad_lines(tmp_path):
    lines = []
    for i in range(150):
        lines += [json.dumps({"text": f"doc {i}"}).encode(), b"{oops"]
    data = tmp_path / "noisy.jsonl"
    _write_lines(data, lines)
    summary = pack(
        [str(data)], str(tmp_path / "ds"), BYTES, workers=1, on_bad_line="skip", split_bytes=700
    )
    assert (summary.documents, summary.bad_lines) == (150, 150)
    recorded = PackedDataset(str(tmp_path / "ds")).meta["bad_lines"]
    assert len(recorded) == MAX_RECORDED_BAD_LINES
    assert [r["line"] for r in recorded] == list(range(2, 2 * MAX_RECORDED_BAD_LINES + 1, 2))


def test_empty_documents_are_skipped_and_counted(tmp_path):
    data = tmp_path / "corpus.jsonl"
    _write_lines(data, [b'{"text": ""}', b'{"text": "a"}', b'{"text": ""}', b'{"text": " "}'])
    summary = pack([str(data)], str(tmp_path / "ds"), BYTES, workers=1)
    assert (summary.documents, summary.empty_documents, summary.bad_lines) == (2, 2, 0)
    ds = PackedDataset(str(tmp_path / "ds"))
    np.testing.assert_array_equal(ds.read(0, ds.n_tokens), [97, 256, 32, 256])


def test_damaged_or_foreign_datasets_are_refused(tmp_path):
    data = tmp_path / "corpus.jsonl"
    _write_lines(data, [b'{"text": "a"}'])
    out = tmp_path / "ds"
    pack([str(data)], str(out), BYTES, workers=1)
    group = out / "zarr.json"
    original = json.loads(group.read_text())

    def with_meta(**changes):
        meta = json.loads(json.dumps(original))
        meta["attributes"]["llmtrain"].update(changes)
        group.write_text(json.dumps(meta))

    with_meta(version=3)
    with pytest.raises(DatasetError, match="format version 3 is newer than this llmtrain reads"):
        PackedDataset(str(out))
    with_meta(complete=False)
    with pytest.raises(DatasetError, match="not a complete llmtrain-tokens dataset"):
        PackedDataset(str(out))
    with_meta(format="something-else")
    with pytest.raises(DatasetError, match="not a complete llmtrain-tokens dataset"):
        PackedDataset(str(out))
    group.write_text(json.dumps(original))
    assert PackedDataset(str(out)).n_documents == 1
    shutil.rmtree(out / "doc_offsets")
    with pytest.raises(DatasetError, match="not a packed dataset"):
        PackedDataset(str(out))
    group.unlink()
    with pytest.raises(DatasetError, match="not a packed dataset"):
        PackedDataset(str(out))


def test_failed_overwrite_keeps_the_old_local_dataset(tmp_path):
    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    _write_lines(good, [b'{"text": "kept"}'])
    _write_lines(bad, [b'{"text": "new"}', b"{broken"])
    out = tmp_path / "ds"
    pack([str(good)], str(out), BYTES, workers=1)
    with pytest.raises(PackError, match=":2: malformed JSON"):
        pack([str(bad)], str(out), BYTES, workers=1, overwrite=True)
    ds = PackedDataset(str(out))
    np.testing.assert_array_equal(ds.read(0, ds.n_tokens), [*b"kept", 256])
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl", "ds", "good.jsonl"]


def test_bad_on_bad_line_value(tmp_path):
    data = tmp_path / "corpus.jsonl"
    _write_lines(data, [b'{"text": "a"}'])
    with pytest.raises(UserError, match="on_bad_line 'ignore': use error or skip"):
        pack([str(data)], str(tmp_path / "ds"), BYTES, workers=1, on_bad_line="ignore")
    assert not (tmp_path / "ds").exists()


def test_missing_inputs(tmp_path):
    present = tmp_path / "present.jsonl"
    _write_lines(present, [b'{"text": "a"}'])
    out = tmp_path / "ds"
    missing = tmp_path / "missing.jsonl"
    with pytest.raises(InputError, match=rf"^{re.escape(str(missing))}: no such file$"):
        pack([str(present), str(missing)], str(out), BYTES, workers=1)
    pattern = tmp_path / "nothing-*.jsonl"
    with pytest.raises(InputError, match=rf"^{re.escape(str(pattern))}: no file matches$"):
        pack([str(pattern)], str(out), BYTES, workers=1)
    folder = tmp_path / "folder"
    folder.mkdir()
    with pytest.raises(InputError, match="a directory with no input files"):
        pack([str(folder)], str(out), BYTES, workers=1)
    _assert_nothing_written(tmp_path, out)


def test_cli_bad_line_and_missing_input(tmp_path, run_cli, texts):
    lines = _corpus_lines(texts[:50])
    lines.insert(41, b"{nope")
    data = tmp_path / "corpus.jsonl"
    _write_lines(data, lines)
    out = tmp_path / "ds"
    logs = tmp_path / "logs"
    argv = ["data", "pack", data, "-o", out, "--tokenizer", "bytes", "--workers", 1]
    code, stdout, stderr = run_cli(*argv, "--log-dir", logs)
    assert code == 2
    assert stdout == ""
    assert f"error: {data}:42: malformed JSON (" in stderr
    assert "pass --on-bad-line skip" in stderr
    _assert_nothing_written(tmp_path, out)

    code, stdout, _ = run_cli(*argv, "--on-bad-line", "skip", "--log-dir", logs)
    assert code == 0
    assert ", 1 bad records skipped) in " in stdout
    assert PackedDataset(str(out)).n_documents == 50

    code, _, stderr = run_cli(*argv[:2], tmp_path / "gone.jsonl", *argv[3:], "--log-dir", logs)
    assert code == 2
    assert f"error: {tmp_path / 'gone.jsonl'}: no such file" in stderr


@pytest.mark.parametrize(
    ("option", "names"),
    [
        pytest.param(["--chunk-tokens", "0"], "chunk", id="chunk-tokens=0"),
        pytest.param(["--chunk-tokens", "-5"], "chunk", id="chunk-tokens=-5"),
        pytest.param(["--shard-chunks", "-1"], "shard", id="shard-chunks=-1"),
        pytest.param(["--compression", "zstd:x"], "compression", id="compression=zstd:x"),
        pytest.param(["--compression", "zstd:99"], "compression", id="compression=zstd:99"),
    ],
)
def test_cli_bad_option_values_are_user_errors(tmp_path, run_cli, option, names):
    """A bad option value is the user's error (exit 2, a message naming the option), not a
    crash reported as a bug in llmtrain (exit 1)."""
    data = tmp_path / "corpus.jsonl"
    _write_lines(data, [b'{"text": "a"}'])
    out = tmp_path / "ds"
    code, _, stderr = run_cli(
        "data", "pack", data, "-o", out, "--tokenizer", "bytes", "--workers", 1, *option,
        "--log-dir", tmp_path / "logs",
    )  # fmt: skip
    assert "this is a bug" not in stderr
    assert code == 2
    assert names in stderr.lower()
    _assert_nothing_written(tmp_path, out)


def _big_input(path, texts: list[str], megabytes: int) -> None:
    block = b"".join(line + b"\n" for line in _corpus_lines(texts))
    with open(path, "wb") as f:
        for _ in range(megabytes * (1 << 20) // len(block) + 1):
            f.write(block)


def _start_pack(tmp_path, tokenizer_json, texts, megabytes: int) -> tuple[subprocess.Popen, list]:
    """`llmtrain data pack` in a child process (2 workers, small ranges, the slower reference
    encoder) on a big input, so it runs for several seconds."""
    data = tmp_path / "big.jsonl"
    _big_input(data, texts, megabytes)
    # Ctrl-C as in a terminal: a job started in the background by a shell (as CI may be)
    # inherits SIGINT ignored, and the interrupt test would then test nothing
    # (SIGUSR1 prints every thread's stack: what a hang was waiting on)
    script = (
        "import faulthandler, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "faulthandler.register(signal.SIGUSR1, all_threads=True); "
        "from llmtrain.core_mesh.cli import main; raise SystemExit(main())"
    )
    args = [
        data, "-o", tmp_path / "ds", "--tokenizer", tokenizer_json, "--tokenizer-option", "fast=off",
        "--workers", 2, "--split-mb", 0.1, "--no-progress", "--log-dir", tmp_path / "logs",
    ]  # fmt: skip
    stdout = open(tmp_path / "stdout.txt", "wb")  # closed by _finish
    stderr = open(tmp_path / "stderr.txt", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-c", script, "data", "pack", *map(str, args)],
        stdout=stdout,
        stderr=stderr,
        cwd=tmp_path,
    )
    return proc, [stdout, stderr]


def _wait_for_busy_workers(proc: subprocess.Popen, n: int, timeout: float) -> list[psutil.Process]:
    """The pack's worker processes, once n of them have started tokenizing."""
    parent = psutil.Process(proc.pid)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the pack ended before its workers could be stopped"
        workers = []
        for child in parent.children(recursive=True):
            try:
                if any("spawn_main" in part for part in child.cmdline()):
                    workers.append(child)
            except psutil.NoSuchProcess:
                pass
        try:
            busy = [w for w in workers if sum(w.cpu_times()[:2]) > 0.8]
        except psutil.NoSuchProcess:
            busy = []
        if len(workers) == n and busy:
            return workers
        time.sleep(0.05)
    raise AssertionError(f"no {n} busy workers after {timeout} s")


def _finish(proc: subprocess.Popen, files: list, tmp_path) -> tuple[int, str]:
    try:
        code = proc.wait(timeout=600)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGUSR1)
        time.sleep(2)
        proc.kill()
        proc.wait()
        stacks = (tmp_path / "stderr.txt").read_text(errors="replace")[-6000:]
        raise AssertionError(f"the pack hung after its worker stopped:\n{stacks}") from None
    finally:
        for f in files:
            f.close()
    return code, (tmp_path / "stderr.txt").read_text(errors="replace")


def _descendants(proc: subprocess.Popen) -> list[psutil.Process]:
    """Every process the pack has started (its workers, multiprocessing's helpers)."""
    try:
        return psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _assert_all_gone(processes: list[psutil.Process], timeout: float = 120) -> None:
    """Wait (generously: a loaded machine is slow) for processes the pack started to end: only
    then is what they did final. Fails on one that outlives the pack, killing it first."""
    _, alive = psutil.wait_procs(processes, timeout=timeout)
    for process in alive:  # so a failure leaves no orphans behind
        process.kill()
    assert alive == [], f"processes outlived the pack: {alive}"


def test_killed_worker_fails_the_pack(tmp_path, tokenizer_json, texts):
    proc, files = _start_pack(tmp_path, tokenizer_json, texts, megabytes=16)
    try:
        workers = _wait_for_busy_workers(proc, 2, timeout=300)
        started = _descendants(proc)
        victim = workers[0]
        victim.send_signal(signal.SIGKILL)
    except BaseException:
        proc.kill()
        raise
    code, stderr = _finish(proc, files, tmp_path)
    # no worker outlives the failed pack; what is on disk is judged once all are gone
    _assert_all_gone([*workers, *started])
    assert code == 2, stderr
    assert "error: a worker process died while tokenizing" in stderr
    assert "nothing was written" in stderr
    _assert_nothing_written(tmp_path, tmp_path / "ds")


def test_interrupted_pack_commits_nothing(tmp_path, tokenizer_json, texts):
    proc, files = _start_pack(tmp_path, tokenizer_json, texts, megabytes=16)
    try:
        workers = _wait_for_busy_workers(proc, 2, timeout=300)
        started = _descendants(proc)
        proc.send_signal(signal.SIGINT)
    except BaseException:
        proc.kill()
        raise
    code, stderr = _finish(proc, files, tmp_path)
    # the pack's process and every process it started are gone before the folder is listed:
    # what is left then stays (a staging directory among it is a pack's bug, not a slow one)
    _assert_all_gone([*workers, *started])
    assert code == 130, stderr
    assert "interrupted" in stderr
    _assert_nothing_written(tmp_path, tmp_path / "ds")


class _Interrupt(BaseException):
    """Stands for Ctrl-C in this process (a KeyboardInterrupt would stop pytest)."""


@pytest.fixture
def interrupt_main(monkeypatch):
    """interrupt_main() from any thread: _Interrupt is raised in the main thread at once, also
    while it waits (a real signal, delivered to the main thread)."""

    def handler(*_):
        raise _Interrupt

    previous = signal.signal(signal.SIGUSR2, handler)
    main = threading.main_thread().ident
    yield lambda: signal.pthread_kill(main, signal.SIGUSR2)
    signal.signal(signal.SIGUSR2, previous)


def test_a_write_under_way_at_an_interrupt_leaves_no_staging(
    tmp_path, texts, monkeypatch, interrupt_main
):
    """zarr writes chunks in threads of its own, which an interrupt of the main thread does not
    stop. A chunk write still running when the pack gives up must be waited for before staging
    is removed: finishing later, it would make the staging directory again (a chunk's parent
    directories are made on write) and leave it behind once the process is gone."""
    from zarr.storage import _local

    real_put = _local._put
    under_way, finished = threading.Event(), threading.Event()

    def slow_put(path, value, exclusive=False):
        if under_way.is_set() or "/c/" not in str(path):
            return real_put(path, value, exclusive=exclusive)
        under_way.set()
        interrupt_main()  # the pack is interrupted while this chunk is being written
        [staging] = [p for p in path.parents if ".tmp-" in p.name]
        deadline = time.monotonic() + 1  # give the pack time to remove staging, if it would
        while staging.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        try:
            return real_put(path, value, exclusive=exclusive)
        finally:
            finished.set()

    monkeypatch.setattr(_local, "_put", slow_put)
    data = tmp_path / "corpus.jsonl"
    _write_lines(data, _corpus_lines(texts))
    out = tmp_path / "ds"
    with pytest.raises(_Interrupt):
        pack([str(data)], str(out), BYTES, workers=1, chunk_tokens=1024)
    assert under_way.is_set()
    assert finished.wait(timeout=60)  # the write is over: what it did is on disk
    _assert_nothing_written(tmp_path, out)


def test_no_write_reaches_staging_after_the_pack_gave_up(tmp_path):
    import zarr

    from llmtrain.data_pack.staging import StagingClosedError
    from llmtrain.data_pack.store import Output

    out = Output(str(tmp_path / "ds"), overwrite=False)
    store = out.array_store("tokens")
    out.abort()
    with pytest.raises(StagingClosedError, match="a write after the pack ended"):
        zarr.create_array(store=store, shape=(4,), dtype="uint16", zarr_format=3)
    assert os.listdir(tmp_path) == []


def test_an_interrupt_between_the_commits_renames_keeps_the_old_dataset(
    tmp_path, texts, monkeypatch
):
    """Replacing a dataset takes two renames (the old one aside, the new one in). Interrupted
    between them, the old one is put back under its name; nothing else stays."""
    old_data, new_data = tmp_path / "old.jsonl", tmp_path / "new.jsonl"
    _write_lines(old_data, _corpus_lines(texts[:10]))
    _write_lines(new_data, _corpus_lines(texts[10:40]))
    out = tmp_path / "ds"
    pack([str(old_data)], str(out), BYTES, workers=1)
    real_rename = os.rename

    def rename_then_interrupt(src, dst, *args, **kwargs):
        real_rename(src, dst, *args, **kwargs)
        if ".old-" in os.fspath(dst):
            raise _Interrupt

    monkeypatch.setattr(os, "rename", rename_then_interrupt)
    with pytest.raises(_Interrupt):
        pack([str(new_data)], str(out), BYTES, workers=1, overwrite=True)
    monkeypatch.setattr(os, "rename", real_rename)
    assert sorted(os.listdir(tmp_path)) == ["ds", "new.jsonl", "old.jsonl"]
    assert PackedDataset(str(out)).n_documents == 10


@pytest.mark.parametrize(
    ("line", "value"),
    [
        (b'{"text": "x", "id": 123456789012345678901234567890}', 123456789012345678901234567890),
        (b'{"text": "x", "id": NaN}', "nan"),
        (b'{"text": "x", "id": "\\u00e9t\\u00e9"}', "\u00e9t\u00e9"),
        (b'{"text": "x", "id": 18446744073709551615}', 18446744073709551615),
        (b'{"text": "x", "id": -9223372036854775809}', -9223372036854775809),  # 19 digits
        (b'{"text": "x", "m": [{"n": [18446744073709551616]}]}', None),  # nested
        (b'{"text": "x", "id": 1e19}', 1e19),  # a float stays a float
    ],
)
def test_records_parse_as_json_does(line, value):
    """The fast parser's answers are json's, where they could differ."""
    record, why = parse_record(line)
    assert why is None
    assert json.dumps(record) == json.dumps(json.loads(line))
    if value is not None:
        assert (str(record["id"]) if value == "nan" else record["id"]) == value


@pytest.mark.parametrize("workers", [1, 2])
def test_a_full_disk_is_one_line_naming_the_output(
    tmp_path,
    run_cli,
    small_disk,
    texts,
    workers,
):
    """A real tmpfs that fills up under the pack: one line naming the output and "no space
    left", exit 2, and nothing left on the disk (the staging directory is given back)."""
    data = tmp_path / "big.jsonl"
    _big_input(data, texts, megabytes=4)
    disk = small_disk("1m")
    out = disk / "ds"
    code, _, stderr = run_cli(
        "data", "pack", data, "-o", out, "--tokenizer", "bytes", "--workers", workers,
        "--no-progress", "--log-dir", tmp_path / "logs",
    )  # fmt: skip
    assert code == 2, stderr
    assert "this is a bug" not in stderr
    [line] = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert line.startswith(f"error: {out}: no space left on device"), line
    assert line.endswith("nothing was written"), line
    assert list(disk.iterdir()) == []
