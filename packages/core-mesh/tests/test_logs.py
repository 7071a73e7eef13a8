"""Logging: human console on rank 0, warnings only elsewhere, JSON lines per rank, stdlib routed."""

from __future__ import annotations

import io
import json
import logging

import structlog

from llmtrain.core_mesh.logs import configure_logging


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_rank0_console_and_json_file(tmp_path):
    console = io.StringIO()
    path = configure_logging(rank=0, world_size=2, run_id="r1", log_dir=tmp_path, console=console)
    structlog.get_logger("llmtrain.test").info("step done", step=3, loss=1.5)
    logging.getLogger("torch.distributed").warning("stdlib says hi")
    logging.getLogger("llmtrain.noisy").debug("file only")
    logging.getLogger("botocore.endpoint").debug("another library's debug: kept out")
    assert path == tmp_path / "rank0.jsonl"
    text = console.getvalue()
    assert "step done" in text and "step=3" in text and "stdlib says hi" in text
    assert "file only" not in text and "kept out" not in text
    records = _records(path)
    assert [r["event"] for r in records] == ["step done", "stdlib says hi", "file only"]
    first = records[0]
    assert (first["rank"], first["world_size"], first["run_id"], first["step"], first["level"]) == (
        0,
        2,
        "r1",
        3,
        "info",
    )
    assert records[1]["logger"] == "torch.distributed" and records[1]["level"] == "warning"


def test_other_ranks_show_only_warnings_on_console(tmp_path):
    console = io.StringIO()
    path = configure_logging(rank=3, world_size=4, log_dir=tmp_path, console=console)
    log = structlog.get_logger()
    log.info("quiet")
    log.warning("loud")
    assert "quiet" not in console.getvalue() and "loud" in console.getvalue()
    assert path.name == "rank3.jsonl"
    assert [r["event"] for r in _records(path)] == ["quiet", "loud"]
    assert all(r["rank"] == 3 for r in _records(path))


def test_reconfiguring_replaces_handlers(tmp_path):
    first, second = io.StringIO(), io.StringIO()
    configure_logging(console=first)
    configure_logging(console=second, log_dir=tmp_path)
    structlog.get_logger().info("once")
    assert "once" not in first.getvalue() and second.getvalue().count("once") == 1
    ours = [h for h in logging.getLogger().handlers if getattr(h, "_llmtrain", False)]
    assert len(ours) == 2
