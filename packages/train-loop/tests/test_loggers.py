"""Logger plugins: `jsonl` (metrics.jsonl, trimmed on resume) and `console` (tqdm or plain lines)."""

from __future__ import annotations

import io
import json
import math
import sys

import pytest

from llmtrain.core_mesh.interfaces import RunInfo
from llmtrain.train_loop.loggers import ConsoleOptions, ConsoleSink, JsonlOptions, JsonlSink


def run_info(tmp_path, start_step: int = 0, total_steps: int = 100) -> RunInfo:
    return RunInfo(
        name="unit",
        run_dir=str(tmp_path),
        total_steps=total_steps,
        start_step=start_step,
        config={},
    )


def lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_jsonl_writes_one_object_per_logged_step(tmp_path):
    sink = JsonlSink(JsonlOptions(), run_info(tmp_path))
    sink.log(10, {"loss": 2.5, "lr": 3e-4})
    sink.log(20, {"loss": 2.25, "lr": 1.5e-4, "eval_loss": 2.4, "nan_seen": math.nan})
    written = lines(tmp_path / "metrics.jsonl")  # flushed per line: readable before close
    sink.close()
    assert written[0] == {"step": 10, "loss": 2.5, "lr": 3e-4}
    assert written[1]["step"] == 20 and written[1]["eval_loss"] == 2.4
    assert math.isnan(written[1]["nan_seen"])
    assert list(written[1]) == ["step", "loss", "lr", "eval_loss", "nan_seen"]


def test_jsonl_file_option_is_relative_to_the_run_dir(tmp_path):
    sink = JsonlSink(JsonlOptions(file="metrics/train.jsonl"), run_info(tmp_path))
    sink.log(1, {"loss": 1.0})
    sink.close()
    assert lines(tmp_path / "metrics" / "train.jsonl") == [{"step": 1, "loss": 1.0}]


def write_steps(path, steps) -> None:
    path.write_text("".join(json.dumps({"step": s, "loss": 10.0 - s}) + "\n" for s in steps))


def test_jsonl_on_resume_drops_lines_past_the_resumed_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write_steps(path, range(1, 11))  # the run got to step 10; its newest checkpoint is step 6
    sink = JsonlSink(JsonlOptions(), run_info(tmp_path, start_step=6))
    assert [line["step"] for line in lines(path)] == [1, 2, 3, 4, 5, 6]
    sink.log(7, {"loss": 0.5})
    sink.close()
    assert [line["step"] for line in lines(path)] == [1, 2, 3, 4, 5, 6, 7]
    assert lines(path)[-1]["loss"] == 0.5
    assert lines(path)[5]["loss"] == 4.0  # the kept lines are untouched


def test_jsonl_fresh_run_starts_an_empty_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write_steps(path, [1, 2, 3])
    JsonlSink(JsonlOptions(), run_info(tmp_path, start_step=0)).close()
    assert path.read_text() == ""
    assert not (tmp_path / "metrics.tmp").exists()


def test_jsonl_resume_after_a_crash_mid_line(tmp_path):
    """A killed run can leave half a line at the end; resuming drops it like any line past the
    resumed step instead of failing to parse it."""
    path = tmp_path / "metrics.jsonl"
    write_steps(path, [1, 2, 3, 4])
    with path.open("a") as f:
        f.write('{"step": 5, "loss": 4.')
    sink = JsonlSink(JsonlOptions(), run_info(tmp_path, start_step=4))
    sink.log(5, {"loss": 4.5})
    sink.close()
    assert [line["step"] for line in lines(path)] == [1, 2, 3, 4, 5]


METRICS = {
    "loss": 2.3456789,
    "eval_loss": 2.5,
    "lr": 3e-4,
    "grad_norm": 0.5,
    "tokens_per_s": 12345.6,
    "mfu": 0.1234,
    "data_wait": 0.01,  # not shown
}
SHOWN = "loss=2.346 eval_loss=2.5 lr=3.00e-04 grad_norm=0.5 tokens_per_s=12,346 mfu=12.3%"


def test_console_prints_a_plain_line_when_not_a_terminal(tmp_path, capsys):
    assert not sys.stderr.isatty()
    sink = ConsoleSink(ConsoleOptions(), run_info(tmp_path))
    assert sink.bar is None
    sink.log(5, METRICS)
    sink.log(10, {"loss": math.inf, "lr": 1e-3})
    sink.close()
    out, err = capsys.readouterr()
    assert (out + err).splitlines() == [f"step 5 {SHOWN}", "step 10 loss=inf lr=1.00e-03"]


def test_console_shows_each_named_eval_sets_loss_beside_eval_loss(tmp_path, capsys):
    sink = ConsoleSink(ConsoleOptions(), run_info(tmp_path))
    metrics = {"loss": 2.5, "eval/web/loss": 2.25, "eval/web/bpb": 1.5, "eval/code/loss": 1.75}
    sink.log(5, {**metrics, "lr": 1e-3})
    sink.close()
    _, err = capsys.readouterr()
    assert err.splitlines() == ["step 5 loss=2.5 code_loss=1.75 web_loss=2.25 lr=1.00e-03"]


def test_console_progress_goes_to_stderr(tmp_path, capsys):
    """Progress is chosen by whether stderr is a terminal and belongs there: stdout carries a
    command's output (quickstart's sample), which progress lines must not mix into."""
    sink = ConsoleSink(ConsoleOptions(), run_info(tmp_path))
    sink.log(5, METRICS)
    sink.close()
    out, err = capsys.readouterr()
    assert out == ""
    assert err == f"step 5 {SHOWN}\n"


def test_console_bar_on_a_terminal(tmp_path, monkeypatch):
    stream = io.StringIO()
    stream.isatty = lambda: True  # type: ignore[method-assign]
    monkeypatch.setattr(sys, "stderr", stream)
    sink = ConsoleSink(ConsoleOptions(), run_info(tmp_path, start_step=20, total_steps=50))
    assert sink.bar is not None and sink.bar.n == 20  # a resumed run starts the bar where it is
    sink.log(30, METRICS)
    assert sink.bar.n == 30
    sink.close()
    text = stream.getvalue()
    assert "unit" in text and "30/50" in text and "loss=2.346" in text


def test_console_without_bar_on_a_terminal_prints_lines(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    sink = ConsoleSink(ConsoleOptions(progress_bar=False), run_info(tmp_path))
    assert sink.bar is None
    sink.log(1, {"loss": 1.0})
    out, err = capsys.readouterr()
    assert "step 1 loss=1" in out + err


@pytest.mark.parametrize("kind", ["console", "jsonl"])
def test_registered_as_plugins(installed, tmp_path, kind):
    entry = installed.registry("logger").get(kind)
    sink = entry.target(entry.options(), run_info(tmp_path))
    sink.log(1, {"loss": 1.0})
    sink.close()
