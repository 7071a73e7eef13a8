"""What every `llmtrain data ...` command shares: where its log file goes (nowhere unless
`--log-dir` names a folder)."""

from __future__ import annotations

import json
from pathlib import Path

from llmtrain.data_pack.store import PackedDataset


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
