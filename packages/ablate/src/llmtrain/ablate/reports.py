"""Reading what a run wrote about itself: `llmtrain profile RUN` (the top operators of a
profiler trace by self time) and `llmtrain ranks RUN` (per-rank step time, data wait and memory
from the ranks' JSON logs, and which rank is the slowest)."""

from __future__ import annotations

import argparse
import json
import re
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

import attrs

from llmtrain.core_mesh.cli import Context
from llmtrain.core_mesh.errors import UserError

OP_CATEGORIES = ("cpu_op", "kernel", "gpu_memcpy", "gpu_memset", "user_annotation")
STEP_MARK = re.compile(r"^ProfilerStep#\d+$")


@attrs.frozen
class OpTime:
    name: str
    device: str  # cpu or gpu
    calls: int
    self_us: float
    total_us: float


def top_ops(trace: dict[str, Any]) -> list[OpTime]:
    """Operators of a Chrome trace (torch.profiler's export) by self time, largest first. Self
    time is the duration less that of the events nested in it on the same thread."""
    events = [
        e
        for e in trace.get("traceEvents", [])
        if e.get("ph") == "X"
        and e.get("cat") in OP_CATEGORIES
        and "dur" in e
        and not STEP_MARK.match(str(e.get("name", "")))
    ]
    by_thread: dict[tuple, list[dict]] = defaultdict(list)
    for e in events:  # host ops nest on their thread; device events on their stream
        by_thread[(e.get("pid"), e.get("tid"), _device(e))].append(e)
    self_time: dict[int, float] = {}
    for thread in by_thread.values():
        thread.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[dict] = []
        for e in thread:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
                stack.pop()
            self_time[id(e)] = e["dur"]
            if stack:
                parent = stack[-1]
                self_time[id(parent)] -= min(e["dur"], parent["ts"] + parent["dur"] - e["ts"])
            stack.append(e)
    totals: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for e in events:
        row = totals[(e["name"], _device(e))]
        row[0] += 1
        row[1] += max(self_time[id(e)], 0.0)
        row[2] += e["dur"]
    ops = [OpTime(name, dev, int(n), s, t) for (name, dev), (n, s, t) in totals.items()]
    return sorted(ops, key=lambda op: op.self_us, reverse=True)


def _device(event: dict[str, Any]) -> str:
    return "cpu" if event["cat"] in ("cpu_op", "user_annotation") else "gpu"


def find_trace(run: Path, step: int | None, rank: int) -> Path:
    profiles = run / "profiles"
    windows = sorted(
        (int(p.name.split("-", 1)[1]), p)
        for p in profiles.glob("step-*")
        if p.name.split("-", 1)[1].isdigit()
    )
    if not windows:
        raise UserError(
            f"{run}: no profiler traces in {profiles}; add `profile: {{every: N, active: K}}` "
            "to the run config and run it"
        )
    if step is None:
        window = windows[-1][1]
    else:
        found = [p for s, p in windows if s == step]
        if not found:
            steps = ", ".join(str(s) for s, _ in windows)
            raise UserError(f"{run}: no trace starting at step {step}; traces start at {steps}")
        window = found[0]
    trace = window / f"rank{rank}.json"
    if not trace.exists():
        ranks = sorted(p.stem for p in window.glob("rank*.json"))
        raise UserError(f"{trace} does not exist; this window has {', '.join(ranks) or 'none'}")
    return trace


def configure_profile(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", help="a run directory, or a trace file (.json)")
    parser.add_argument("--step", type=int, default=None, help="the window (default: the newest)")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--top", type=int, default=20, help="how many operators")


def run_profile(args: argparse.Namespace, ctx: Context) -> int:
    path = Path(args.run)
    trace_file = path if path.is_file() else find_trace(path, args.step, args.rank)
    try:
        trace = json.loads(trace_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UserError(f"{trace_file}: not a readable Chrome trace ({exc})") from None
    ops = top_ops(trace)
    if not ops:
        raise UserError(f"{trace_file}: holds no operator events")
    total = sum(op.self_us for op in ops) or 1.0
    print(f"{trace_file}: top {min(args.top, len(ops))} of {len(ops)} operators by self time")
    width = min(max(len(op.name) for op in ops[: args.top]), 60)
    print(
        f"{'operator':<{width}}  {'device':<6}  {'calls':>7}  {'self ms':>10}  {'self %':>6}  {'total ms':>10}"
    )
    for op in ops[: args.top]:
        name = op.name if len(op.name) <= width else op.name[: width - 1] + "…"
        print(
            f"{name:<{width}}  {op.device:<6}  {op.calls:>7}  {op.self_us / 1e3:>10.3f}  "
            f"{100 * op.self_us / total:>5.1f}%  {op.total_us / 1e3:>10.3f}"
        )
    return 0


# --- stragglers ---
@attrs.frozen
class RankStats:
    rank: int
    windows: int
    step_time_s: float  # median over logged windows
    step_time_p90_s: float
    data_wait: float  # mean share of the time
    sync_wait: float  # mean share spent waiting for the other ranks at the step's first collective
    arrival_lag: float | None  # mean share of the time the others waited for this rank
    peak_memory_mib: float | None


def rank_stats(run: Path, skip_first: bool = True) -> list[RankStats]:
    """Per rank, from `logs/rank<k>.jsonl`'s step lines (each logged window of steps)."""
    files = sorted(
        (run / "logs").glob("rank*.jsonl"), key=lambda p: int(re.sub(r"\D", "", p.stem) or 0)
    )
    if not files:
        raise UserError(f"{run}: no rank logs in {run / 'logs'}")
    stats = []
    for f in files:
        rows = []
        for line in f.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if row.get("event") == "step" and "step_time_s" in row:
                rows.append(row)
        if skip_first and len(rows) > 1:
            rows = rows[1:]  # the first window holds start-up (compile, first allocations)
        if not rows:
            continue
        times = sorted(r["step_time_s"] for r in rows)
        peaks = [r["peak_memory_mib"] for r in rows if "peak_memory_mib" in r]
        stats.append(
            RankStats(
                rank=int(rows[0].get("rank", re.sub(r"\D", "", f.stem) or 0)),
                windows=len(rows),
                step_time_s=statistics.median(times),
                step_time_p90_s=times[min(len(times) - 1, int(0.9 * len(times)))],
                data_wait=statistics.fmean(r.get("data_wait", 0.0) for r in rows),
                sync_wait=statistics.fmean(r.get("sync_wait", 0.0) for r in rows),
                arrival_lag=(
                    statistics.fmean(r["arrival_lag"] for r in rows)
                    if all("arrival_lag" in r for r in rows)
                    else None
                ),
                peak_memory_mib=max(peaks) if peaks else None,
            )
        )
    if not stats:
        raise UserError(f"{run}: the rank logs hold no step lines yet")
    return stats


def configure_ranks(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", help="a run directory")


def slowest_rank(stats: list[RankStats]) -> RankStats:
    """Ranks step together, so their step times match; the slowest is the rank the others wait
    for: the one arriving last at the collectives, or (pipelines, where ranks make different
    calls) the one that waits least at the step's first collective."""
    if all(s.arrival_lag is not None for s in stats):
        return max(stats, key=lambda s: s.arrival_lag)
    return min(stats, key=lambda s: s.sync_wait)


def run_ranks(args: argparse.Namespace, ctx: Context) -> int:
    stats = rank_stats(Path(args.run))
    slowest = slowest_rank(stats)
    print(
        f"{'rank':>4}  {'windows':>7}  {'step s (median)':>15}  {'p90':>9}  "
        f"{'data wait':>9}  {'sync wait':>9}  {'late by':>8}  {'peak MiB':>9}"
    )
    for s in stats:
        mark = "  <- slowest" if s is slowest and len(stats) > 1 else ""
        peak = "" if s.peak_memory_mib is None else f"{s.peak_memory_mib:,.0f}"
        late = "" if s.arrival_lag is None else f"{100 * s.arrival_lag:.2f}%"
        print(
            f"{s.rank:>4}  {s.windows:>7}  {s.step_time_s:>15.4f}  {s.step_time_p90_s:>9.4f}  "
            f"{100 * s.data_wait:>8.2f}%  {100 * s.sync_wait:>8.2f}%  {late:>8}  {peak:>9}{mark}"
        )
    if len(stats) > 1:
        if slowest.arrival_lag is not None:
            why = (
                f"the others wait for it {100 * slowest.arrival_lag:.1f}% of the time "
                "(it arrives last at the collectives)"
            )
        else:
            others = statistics.fmean(s.sync_wait for s in stats if s is not slowest)
            why = f"the others spend {100 * others:.1f}% of their time waiting for it"
        print(
            f"slowest: rank {slowest.rank}; {why}; its data wait is {100 * slowest.data_wait:.2f}%"
        )
    return 0
