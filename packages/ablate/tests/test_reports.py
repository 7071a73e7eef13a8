"""Reading what a run wrote about itself: a profiler trace's operators by self time
(`llmtrain profile`) and per-rank step times from the ranks' JSON logs (`llmtrain ranks`), on
hand-made files (the real traces and logs are checked in integration_tests/test_observe.py)."""

from __future__ import annotations

import json

import pytest

from llmtrain.ablate import reports


# --- trace reading ---
def test_top_ops_self_time_subtracts_nested_events():
    def op(name, ts, dur, tid=1, cat="cpu_op"):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid}

    trace = {
        "traceEvents": [
            op("ProfilerStep#3", 0, 1000, cat="user_annotation"),  # the step marker is left out
            op("aten::linear", 10, 100),
            op("aten::addmm", 20, 60),  # inside linear
            op("aten::copy_", 30, 10),  # inside addmm
            op("aten::linear", 200, 50),
            op("aten::mul", 210, 20, tid=2),  # another thread: not nested in linear
            op("kernel_x", 5, 40, cat="kernel"),
            {"ph": "M", "name": "thread_name"},
        ]
    }
    ops = {(o.name, o.device): o for o in reports.top_ops(trace)}
    assert ops[("aten::linear", "cpu")].self_us == pytest.approx(40 + 50)
    assert ops[("aten::linear", "cpu")].calls == 2
    assert ops[("aten::linear", "cpu")].total_us == 150
    assert ops[("aten::addmm", "cpu")].self_us == pytest.approx(50)
    assert ops[("aten::copy_", "cpu")].self_us == 10
    assert ops[("aten::mul", "cpu")].self_us == 20
    assert ops[("kernel_x", "gpu")].self_us == 40
    assert ("ProfilerStep#3", "cpu") not in ops
    assert next(o.name for o in reports.top_ops(trace)) == "aten::linear"


def test_profile_command_errors(tmp_path, run_cli):
    (tmp_path / "run").mkdir()
    code, _, err = run_cli("profile", tmp_path / "run")
    assert code == 2 and "profile: {every: N, active: K}" in err
    window = tmp_path / "run" / "profiles" / "step-5"
    window.mkdir(parents=True)
    (window / "rank0.json").write_text("{not json")
    code, _, err = run_cli("profile", tmp_path / "run", "--step", "7")
    assert code == 2 and "traces start at 5" in err
    code, _, err = run_cli("profile", tmp_path / "run", "--rank", "1")
    assert code == 2 and "this window has rank0" in err
    code, _, err = run_cli("profile", tmp_path / "run")
    assert code == 2 and "not a readable Chrome trace" in err


# --- stragglers from the rank logs ---
def write_rank_log(path, rank, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"event": "run.start", "rank": rank})]
    lines += [json.dumps({"event": "step", "rank": rank, **row}) for row in rows]
    path.write_text("\n".join(lines) + "\n{torn")


def test_rank_stats_and_the_slowest_rank(tmp_path, run_cli):
    for rank, sync in ((0, 0.30), (1, 0.02), (2, 0.28)):
        rows = [
            {"step": s, "step_time_s": 0.1 + 0.01 * s, "data_wait": 0.01 * rank, "sync_wait": sync}
            for s in range(1, 6)
        ]
        rows[0]["step_time_s"] = 9.0  # start-up window: left out
        for row in rows:
            row["peak_memory_mib"] = 100.0 + rank
        write_rank_log(tmp_path / "logs" / f"rank{rank}.jsonl", rank, rows)
    stats = reports.rank_stats(tmp_path)
    assert [s.rank for s in stats] == [0, 1, 2]
    assert stats[0].windows == 4
    assert stats[0].step_time_s == pytest.approx(0.135)  # median of 0.12..0.15
    assert stats[2].data_wait == pytest.approx(0.02)
    assert stats[1].peak_memory_mib == 101.0
    assert reports.slowest_rank(stats).rank == 1
    code, out, _ = run_cli("ranks", tmp_path)
    assert code == 0
    row1 = next(line for line in out.splitlines() if line.strip().startswith("1 "))
    assert row1.endswith("<- slowest")
    assert "slowest: rank 1; the others spend 29.0% of their time waiting for it" in out
    code, out, _ = run_cli("ranks", tmp_path, "--json")  # the same numbers, machine-readable
    document = json.loads(out)
    assert code == 0 and document["slowest"] == 1
    assert [r["step_time_s"] for r in document["ranks"]] == [s.step_time_s for s in stats]

    # with arrival lags (every rank made the same collectives) the latest rank is the slowest
    for rank, lag in ((0, 0.0), (1, 0.01), (2, 0.4)):
        rows = [
            {"step": s, "step_time_s": 0.1, "sync_wait": 0.3 - rank / 10, "arrival_lag": lag}
            for s in range(1, 4)
        ]
        write_rank_log(tmp_path / "logs" / f"rank{rank}.jsonl", rank, rows)
    stats = reports.rank_stats(tmp_path)
    assert [s.arrival_lag for s in stats] == [0.0, 0.01, 0.4]
    assert reports.slowest_rank(stats).rank == 2
    code, out, _ = run_cli("ranks", tmp_path)
    assert "slowest: rank 2; the others wait for it 40.0% of the time" in out
