"""What every `llmtrain data ...` command shares: where its log file goes (nowhere unless
`--log-dir` names a folder) and how it reports progress (a bar on a terminal, log lines at an
interval otherwise), checked against the real command and a corpus of known size."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import threading
from pathlib import Path

from llmtrain.data_pack.store import PackedDataset

CLI = "import sys; from llmtrain.core_mesh.cli import main; sys.exit(main())"


def _tree(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_data_commands_write_no_log_files_unless_asked(
    tmp_path, monkeypatch, run_cli, write_jsonl, texts
):
    """Run from a working directory, the data commands leave nothing in it, and nothing beside
    their outputs but the outputs; `--log-dir` writes the JSON log there."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    data = write_jsonl("in/corpus.jsonl", texts)
    out = tmp_path / "out"
    out.mkdir()
    commands = [
        ["train-tokenizer", data, "-o", out / "tok.json", "--vocab-size", 300],
        ["pack", data, "-o", out / "ds", "--tokenizer", "bytes", "--workers", 1],
        ["merge", out / "ds", out / "ds", "-o", out / "twice"],
        ["inspect", out / "ds"],
        ["inspect", out / "ds", "--json"],
    ]
    for argv in commands:
        code, _, stderr = run_cli("data", *argv)
        assert code == 0, stderr
        assert _tree(cwd) == [], argv
    assert sorted(p.name for p in out.iterdir()) == ["ds", "tok.json", "twice"]
    assert PackedDataset(str(out / "twice")).n_documents == 2 * len(texts)

    logs = tmp_path / "logs"
    code, _, _ = run_cli("data", "pack", data, "-o", out / "again", "--tokenizer", "bytes",
                         "--workers", 1, "--log-dir", logs)  # fmt: skip
    assert code == 0
    events = [json.loads(line) for line in (logs / "rank0.jsonl").read_text().splitlines()]
    assert [e["documents"] for e in events if e["event"] == "pack.done"] == [len(texts)]
    assert _tree(cwd) == []


def test_log_dir_must_be_local(tmp_path, monkeypatch, run_cli, write_jsonl):
    monkeypatch.chdir(tmp_path)
    data = write_jsonl("corpus.jsonl", ["a document"])
    before = _tree(tmp_path)
    code, _, stderr = run_cli(
        "data", "pack", data, "-o", tmp_path / "ds", "--tokenizer", "bytes",
        "--log-dir", "s3://bucket/logs",
    )  # fmt: skip
    assert code == 2
    assert stderr == (
        "error: --log-dir s3://bucket/logs: the JSON log is written to a local folder; "
        "give a local path\n"
    )
    assert _tree(tmp_path) == before


def _events(stderr: str, name: str) -> list[dict[str, int]]:
    """The key=value fields of each console log line of event `name`, as integers."""
    lines = [line for line in stderr.splitlines() if re.search(rf"\] {re.escape(name)}\s", line)]
    return [{k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", line)} for line in lines]


def _three_files(write_jsonl, corpus) -> tuple[list[Path], list[int]]:
    counts = [40, 130, 75]
    paths = [write_jsonl(f"part{i}.jsonl", corpus(n, seed=20 + i)) for i, n in enumerate(counts)]
    return paths, counts


def test_train_tokenizer_logs_progress_when_stderr_is_not_a_terminal(tmp_path, write_jsonl, corpus):
    """With stderr a pipe, progress is a log line every --progress-every seconds (0: at each
    task): bytes and documents read so far, then the start of the training phase."""
    paths, counts = _three_files(write_jsonl, corpus)
    sizes = [p.stat().st_size for p in paths]
    argv = [sys.executable, "-c", CLI, "data", "train-tokenizer", *map(str, paths)]
    argv += ["-o", str(tmp_path / "tok.json"), "--vocab-size", "320"]
    result = subprocess.run(
        [*argv, "--progress-every", "0"], capture_output=True, text=True, timeout=600, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"{tmp_path / 'tok.json'}: byte-level BPE, 320 tokens\n"
    total = sum(sizes)
    assert _events(result.stderr, "tokenizer.reading") == [
        {"bytes_done": sum(sizes[: i + 1]), "bytes_total": total, "documents": sum(counts[: i + 1])}
        for i in range(3)
    ]
    training = {"documents": sum(counts), "bytes": total, "vocab_size": 320}
    assert _events(result.stderr, "tokenizer.training") == [training]
    assert "\r" not in result.stderr  # no bar: stderr is not a terminal

    result = subprocess.run(
        [*argv, "--overwrite", "--no-progress"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert _events(result.stderr, "tokenizer.reading") == []
    assert _events(result.stderr, "tokenizer.training") == [training]


def _run_in_terminal(argv: list[str], timeout: float) -> tuple[int, str, str]:
    """Run `argv` with stderr on a pseudo-terminal (120 columns); returns (exit code, stdout,
    what the terminal received, less colours and line clearing)."""
    main, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    received = bytearray()

    def drain() -> None:
        while True:
            try:
                data = os.read(main, 65536)
            except OSError:  # EIO: the terminal's last holder closed it
                return
            if not data:
                return
            received.extend(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        process = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=child
        )
    finally:
        os.close(child)
    stdout, _ = process.communicate(timeout=timeout)
    reader.join(timeout=timeout)
    os.close(main)
    terminal = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", received.decode("utf-8", "replace"))
    return process.returncode, stdout.decode(), terminal


def test_train_tokenizer_shows_bars_on_a_terminal(tmp_path, write_jsonl, corpus):
    """On a terminal: a bar while the corpus is read (its documents counted), then the
    tokenizers library's own bars for the training phase, and not its pre-processing bar (it
    counts documents against an unknown total, over the reading bar)."""
    paths, counts = _three_files(write_jsonl, corpus)
    out = tmp_path / "tok.json"
    argv = [sys.executable, "-c", CLI, "data", "train-tokenizer", *map(str, paths)]
    code, stdout, terminal = _run_in_terminal(
        [*argv, "-o", str(out), "--vocab-size", "320"], timeout=600
    )
    assert code == 0, terminal
    assert stdout == f"{out}: byte-level BPE, 320 tokens\n"
    final = [s for s in re.split(r"[\r\n]", terminal) if s.startswith("reading: 100%")]
    assert final and f"documents={sum(counts)}" in final[-1], terminal
    assert "Compute merges" in terminal
    assert "Pre-processing sequences" not in terminal
    assert re.search(rf"\] tokenizer\.training .*documents={sum(counts)} ", terminal)


def test_pack_logs_progress_when_stderr_is_not_a_terminal(tmp_path, run_cli, write_jsonl, texts):
    """pack reports through the same progress: with --progress-every 0 a line at each task, the
    last one at the whole input with every document and token."""
    data = write_jsonl("corpus.jsonl", texts)
    code, _, stderr = run_cli(
        "data", "pack", data, "-o", tmp_path / "ds", "--tokenizer", "bytes", "--workers", 1,
        "--split-mb", 0.004, "--progress-every", 0,
    )  # fmt: skip
    assert code == 0, stderr
    lines = _events(stderr, "pack.progress")
    size = data.stat().st_size
    assert len(lines) >= 3
    assert all(line["bytes_total"] == size for line in lines)
    done = [line["bytes_done"] for line in lines]
    assert done == sorted(done) and done[-1] == size
    n_tokens = sum(len(t.encode()) + 1 for t in texts)
    assert (lines[-1]["documents"], lines[-1]["tokens"]) == (len(texts), n_tokens)

    code, _, stderr = run_cli("data", "pack", data, "-o", tmp_path / "ds", "--overwrite",
                              "--tokenizer", "bytes", "--progress-every", -1)  # fmt: skip
    assert code == 2
    assert stderr == "error: --progress-every -1: give 0 or more seconds\n"
