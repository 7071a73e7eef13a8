"""Reading what a run wrote about itself: `llmtrain profile RUN` (the top operators of a
profiler trace by self time; on a CUDA trace the GPU time each operator launched and the top
kernels) and `llmtrain ranks RUN` (per-rank step time, data wait and memory from the ranks' JSON
logs, and which rank is the slowest)."""

from __future__ import annotations

import argparse
import bisect
import json
import re
import statistics
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, TypedDict, cast

import attrs

from llmtrain.core_mesh.cli import Context
from llmtrain.core_mesh.errors import UserError
from llmtrain.core_mesh.json_types import JSON

OP_CATEGORIES = ("cpu_op", "kernel", "gpu_memcpy", "gpu_memset", "user_annotation")
HOST_CATEGORIES = ("cpu_op", "user_annotation")
# what runs on the GPU: kernels, copies and sets (not "gpu_user_annotation", the GPU-side span of
# a record_function, which covers kernels already counted)
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
# host-side calls that enqueue GPU work (cudaLaunchKernel, cuLaunchKernelEx, cudaMemcpyAsync, ...)
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver", "privateuse1_runtime", "privateuse1_driver")
STEP_MARK = re.compile(r"^ProfilerStep#\d+$")


class TraceEvent(TypedDict, total=False):
    """An event of a Chrome trace (the keys read here): complete events ("ph": "X") have `ts`
    and `dur` (microseconds), flow events ("s", "f") an `id`."""

    name: str
    cat: str
    ph: str
    ts: float
    dur: float
    pid: int | str
    tid: int | str
    id: int | str
    args: dict[str, JSON]


class Trace(TypedDict, total=False):
    """A Chrome trace, as torch.profiler exports it."""

    traceEvents: list[TraceEvent]


# where an event ran: (process, thread or stream)
_Thread = tuple[int | str | None, int | str | None]


@attrs.frozen
class OpTime:
    name: str
    device: str  # cpu or gpu
    calls: int
    self_us: float
    total_us: float


def top_ops(trace: Trace) -> list[OpTime]:
    """Operators of a Chrome trace (torch.profiler's export) by self time, largest first. Self
    time is the duration less that of the events nested in it on the same thread."""
    events = [e for e in _complete(trace) if e.get("cat") in OP_CATEGORIES and not _step_mark(e)]
    self_time, _ = _nesting(events)
    totals: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for e in events:
        row = totals[(e["name"], _device(e))]
        row[0] += 1
        row[1] += max(self_time[id(e)], 0.0)
        row[2] += e["dur"]
    ops = [OpTime(name, dev, int(n), s, t) for (name, dev), (n, s, t) in totals.items()]
    return sorted(ops, key=lambda op: op.self_us, reverse=True)


def _complete(trace: Trace) -> list[TraceEvent]:
    """The trace's complete events ("ph": "X") that have a start and a duration."""
    return [
        e
        for e in trace.get("traceEvents", [])
        if isinstance(e, dict) and e.get("ph") == "X" and "dur" in e and "ts" in e
    ]


def _step_mark(event: TraceEvent) -> bool:
    return bool(STEP_MARK.match(str(event.get("name", ""))))


def _nesting(
    events: list[TraceEvent],
) -> tuple[dict[int, float], dict[int, TraceEvent | None]]:
    """Self time and enclosing event (by `id`) of each event: host events nest on their thread,
    device events on their stream."""
    by_thread: dict[tuple[int | str | None, int | str | None, str], list[TraceEvent]] = defaultdict(
        list
    )
    for e in events:
        by_thread[(e.get("pid"), e.get("tid"), _device(e))].append(e)
    self_time: dict[int, float] = {}
    parent: dict[int, TraceEvent | None] = {}
    for thread in by_thread.values():
        thread.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[TraceEvent] = []
        for e in thread:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
                stack.pop()
            self_time[id(e)] = e["dur"]
            parent[id(e)] = stack[-1] if stack else None
            if stack:
                up = stack[-1]
                self_time[id(up)] -= min(e["dur"], up["ts"] + up["dur"] - e["ts"])
            stack.append(e)
    return self_time, parent


# --- GPU time on CUDA traces ---
@attrs.frozen
class OpGpuTime:
    """One host operator (by name) of a CUDA trace."""

    name: str
    calls: int
    gpu_us: float  # GPU time of the kernels, copies and sets it launched itself
    gpu_total_us: float  # and those launched by the operators nested in it
    cpu_self_us: float
    cpu_total_us: float


@attrs.frozen
class KernelTime:
    """One GPU kernel, copy or set (by name) of a CUDA trace."""

    name: str
    kind: str  # the trace category: kernel, gpu_memcpy or gpu_memset
    calls: int
    gpu_us: float
    launched_by: str | None  # the operator that launched the most of its time (None: none did)


@attrs.define
class _KernelTally:
    calls: int = 0
    gpu_us: float = 0.0
    launched_by: Counter[str] = attrs.Factory(Counter)  # GPU time by launching operator


@attrs.frozen
class GpuProfile:
    ops: list[OpGpuTime]  # by GPU time, then by CPU self time
    kernels: list[KernelTime]  # by GPU time
    gpu_us: float  # all kernels, copies and sets (summed over streams)
    unattributed_us: float  # launched outside any operator (or its launch is not in the trace)
    streams: int


def gpu_profile(trace: Trace) -> GpuProfile | None:
    """GPU time of a CUDA trace (torch.profiler with ProfilerActivity.CUDA), None for a trace
    without kernels, copies or sets.

    Each GPU activity is linked to the host call that launched it (`cudaLaunchKernel`,
    `cuLaunchKernelEx`, `cudaMemcpyAsync`, ...) through their shared `args.correlation` (or,
    where an activity has none, the "ac2g" flow event pair: "s" at the launch on the host
    thread, "f" at the activity on its stream, one id). It counts for the innermost operator
    (`cpu_op` or `user_annotation`, not the ProfilerStep mark) whose span on the launching
    thread holds the launch, and in `gpu_total_us` for the operators around that one. An
    activity whose launch is not in the trace, or in no operator's span, falls back to the
    operator with its `External id` (kineto's link to the operator that launched it)."""
    events = _complete(trace)
    gpu = [e for e in events if e.get("cat") in GPU_CATEGORIES]
    if not gpu:
        return None
    host = [e for e in events if e.get("cat") in HOST_CATEGORIES and not _step_mark(e)]
    self_time, parent = _nesting(host)
    threads: dict[_Thread, list[TraceEvent]] = defaultdict(list)
    for e in host:
        threads[(e.get("pid"), e.get("tid"))].append(e)
    starts: dict[_Thread, list[float]] = {}
    for key, spans in threads.items():
        spans.sort(key=lambda e: (e["ts"], -e["dur"]))
        starts[key] = [e["ts"] for e in spans]

    def innermost(pid: int | str | None, tid: int | str | None, ts: float) -> TraceEvent | None:
        """The innermost operator on the thread whose span holds `ts`."""
        key = (pid, tid)
        i = bisect.bisect_right(starts.get(key, []), ts) - 1
        span = threads[key][i] if i >= 0 else None
        while span is not None and span["ts"] + span["dur"] <= ts:
            span = parent[id(span)]
        return span

    # the launch point (pid, tid, ts) of each correlation id: the runtime call, else a flow start
    # correlation id: (pid, tid, ts); Any: a flow start without a ts is passed on as one
    launches: dict[JSON, tuple[int | str | None, int | str | None, Any]] = {}
    flow_ends: dict[tuple[int | str | None, int | str | None, float | None], JSON] = {}
    for e in trace.get("traceEvents", []):
        if not isinstance(e, dict) or e.get("cat") != "ac2g" or "id" not in e:
            continue
        if e.get("ph") == "s":
            launches.setdefault(e["id"], (e.get("pid"), e.get("tid"), e.get("ts")))
        elif e.get("ph") == "f":
            flow_ends[(e.get("pid"), e.get("tid"), e.get("ts"))] = e["id"]
    for e in events:
        correlation = _args(e).get("correlation")
        if e.get("cat") in LAUNCH_CATEGORIES and correlation is not None:
            launches[correlation] = (e.get("pid"), e.get("tid"), e["ts"])
    by_external = {
        _args(e)["External id"]: e for e in host if _args(e).get("External id") not in (None, 0)
    }

    gpu_self: dict[int, float] = defaultdict(float)
    gpu_total: dict[int, float] = defaultdict(float)
    kernels: dict[tuple[str, str], _KernelTally] = {}
    unattributed = 0.0
    for e in gpu:
        correlation = _args(e).get("correlation")
        if correlation is None:
            correlation = flow_ends.get((e.get("pid"), e.get("tid"), e["ts"]))
        point = launches.get(correlation) if correlation is not None else None
        owner = innermost(*point) if point is not None else None
        if owner is None:
            owner = by_external.get(_args(e).get("External id"))
        tally = kernels.setdefault((e["name"], e["cat"]), _KernelTally())
        tally.calls += 1
        tally.gpu_us += e["dur"]
        if owner is None:
            unattributed += e["dur"]
            continue
        # a Counter of microseconds (typeshed counts in ints)
        tally.launched_by[owner["name"]] += e["dur"]  # type: ignore[assignment]
        gpu_self[id(owner)] += e["dur"]
        span: TraceEvent | None = owner
        while span is not None:
            gpu_total[id(span)] += e["dur"]
            span = parent[id(span)]

    ops: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0.0, 0.0])
    for e in host:
        row = ops[e["name"]]
        row[0] += 1
        row[1] += gpu_self[id(e)]
        row[2] += gpu_total[id(e)]
        row[3] += max(self_time[id(e)], 0.0)
        row[4] += e["dur"]
    op_rows = [OpGpuTime(name, int(n), g, gt, s, t) for name, (n, g, gt, s, t) in ops.items()]
    op_rows.sort(key=lambda op: (-op.gpu_us, -op.cpu_self_us, op.name))
    kernel_rows = [
        KernelTime(name, cat, t.calls, t.gpu_us, _most_time(t.launched_by))
        for (name, cat), t in kernels.items()
    ]
    kernel_rows.sort(key=lambda k: (-k.gpu_us, k.name))
    streams = {(e.get("pid"), e.get("tid")) for e in gpu}
    return GpuProfile(
        ops=op_rows,
        kernels=kernel_rows,
        gpu_us=sum(e["dur"] for e in gpu),
        unattributed_us=unattributed,
        streams=len(streams),
    )


def _most_time(by: Counter[str]) -> str | None:
    return by.most_common(1)[0][0] if by else None


def _args(event: TraceEvent) -> dict[str, JSON]:
    args = event.get("args")
    return args if isinstance(args, dict) else {}


def _device(event: TraceEvent) -> str:
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
    parser.add_argument("run", metavar="RUN", help="a run directory, or a trace file (.json)")
    parser.add_argument("--step", type=int, default=None, help="the window (default: the newest)")
    parser.add_argument("--rank", type=int, default=0, help="whose trace (default: 0)")
    parser.add_argument(
        "--top", type=int, default=20, help="how many operators (and kernels) (default: 20)"
    )
    parser.add_argument(
        "--json", action="store_true", help="print JSON instead of text (the tables)"
    )
    parser.add_argument(
        "--sort",
        choices=("gpu", "cpu"),
        default="gpu",
        help="a CUDA trace's operators by the GPU time they launched (default) or by CPU self time",
    )


def run_profile(args: argparse.Namespace, ctx: Context) -> int:
    path = Path(args.run)
    trace_file = path if path.is_file() else find_trace(path, args.step, args.rank)
    try:
        loaded = json.loads(trace_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UserError(f"{trace_file}: not a readable Chrome trace ({exc})") from None
    if not isinstance(loaded, dict):
        raise UserError(f"{trace_file}: not a Chrome trace (no traceEvents object)")
    trace = cast(Trace, loaded)  # a JSON object, read as torch.profiler writes traces
    gpu = gpu_profile(trace)
    if gpu is not None and args.json:
        ops = sorted(gpu.ops, key=lambda op: -(op.cpu_self_us if args.sort == "cpu" else op.gpu_us))
        document = {**attrs.asdict(gpu), "ops": [attrs.asdict(op) for op in ops[: args.top]]}
        document["kernels"] = document["kernels"][: args.top]
        print(json.dumps({"trace": str(trace_file), "gpu": document}, indent=1))
        return 0
    if gpu is not None:
        _print_gpu_profile(trace_file, gpu, args.top, args.sort)
        return 0
    top = top_ops(trace)
    if not top:
        raise UserError(f"{trace_file}: holds no operator events")
    if args.json:
        listed = [attrs.asdict(op) for op in top[: args.top]]
        print(json.dumps({"trace": str(trace_file), "ops": listed}, indent=1))
        return 0
    total = sum(op.self_us for op in top) or 1.0
    print(f"{trace_file}: top {min(args.top, len(top))} of {len(top)} operators by self time")
    width = min(max(len(op.name) for op in top[: args.top]), 60)
    print(
        f"{'operator':<{width}}  {'device':<6}  {'calls':>7}  {'self ms':>10}  {'self %':>6}  {'total ms':>10}"
    )
    for op in top[: args.top]:
        print(
            f"{_cut(op.name, width):<{width}}  {op.device:<6}  {op.calls:>7}  "
            f"{op.self_us / 1e3:>10.3f}  {100 * op.self_us / total:>5.1f}%  "
            f"{op.total_us / 1e3:>10.3f}"
        )
    return 0


def _cut(name: str, width: int) -> str:
    return name if len(name) <= width else name[: width - 1] + "…"


def _print_gpu_profile(trace_file: Path, gpu: GpuProfile, top: int, sort: str) -> None:
    """Two tables: host operators with the GPU time each launched, then the GPU kernels."""
    total = gpu.gpu_us or 1.0
    ops = gpu.ops
    if sort == "cpu":
        ops = sorted(ops, key=lambda op: (-op.cpu_self_us, op.name))
    shown = ops[:top]
    by = "GPU time launched" if sort == "gpu" else "CPU self time"
    print(
        f"{trace_file}: top {len(shown)} of {len(ops)} operators by {by} (CUDA trace: "
        f"{gpu.gpu_us / 1e3:.3f} ms of GPU time on {gpu.streams} stream(s), each kernel, copy "
        "and set counted for the operator that launched it)"
    )
    if shown:
        width = min(max(len("operator"), *(len(op.name) for op in shown)), 60)
        print(
            f"{'operator':<{width}}  {'device':<6}  {'calls':>7}  {'gpu ms':>10}  {'gpu %':>6}  "
            f"{'gpu total ms':>12}  {'cpu self ms':>11}  {'cpu total ms':>12}"
        )
        for op in shown:
            print(
                f"{_cut(op.name, width):<{width}}  {'cpu':<6}  {op.calls:>7}  "
                f"{op.gpu_us / 1e3:>10.3f}  {100 * op.gpu_us / total:>5.1f}%  "
                f"{op.gpu_total_us / 1e3:>12.3f}  {op.cpu_self_us / 1e3:>11.3f}  "
                f"{op.cpu_total_us / 1e3:>12.3f}"
            )
    if gpu.unattributed_us:
        print(
            f"launched outside any operator: {gpu.unattributed_us / 1e3:.3f} ms "
            f"({100 * gpu.unattributed_us / total:.1f}% of the GPU time)"
        )
    print()
    kernels = gpu.kernels[:top]
    print(f"top {len(kernels)} of {len(gpu.kernels)} GPU kernels, copies and sets by GPU time")
    width = min(max(len("kernel"), *(len(k.name) for k in kernels)), 80)
    print(
        f"{'kernel':<{width}}  {'device':<6}  {'calls':>7}  {'gpu ms':>10}  {'gpu %':>6}  "
        f"{'mean us':>10}  launched by"
    )
    for k in kernels:
        print(
            f"{_cut(k.name, width):<{width}}  {'gpu':<6}  {k.calls:>7}  "
            f"{k.gpu_us / 1e3:>10.3f}  {100 * k.gpu_us / total:>5.1f}%  "
            f"{k.gpu_us / k.calls:>10.1f}  {_cut(k.launched_by or '-', 60)}"
        )


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
    parser.add_argument("run", metavar="RUN", help="a run directory")
    parser.add_argument(
        "--json", action="store_true", help="print JSON instead of text (the table)"
    )


def slowest_rank(stats: list[RankStats]) -> RankStats:
    """Ranks step together, so their step times match; the slowest is the rank the others wait
    for: the one arriving last at the collectives, or (pipelines, where ranks make different
    calls) the one that waits least at the step's first collective."""
    lags = [(s.arrival_lag, s) for s in stats if s.arrival_lag is not None]
    if len(lags) == len(stats):
        return max(lags, key=lambda lag: lag[0])[1]  # the first of equals, as max(stats)
    return min(stats, key=lambda s: s.sync_wait)


def run_ranks(args: argparse.Namespace, ctx: Context) -> int:
    stats = rank_stats(Path(args.run))
    slowest = slowest_rank(stats)
    if args.json:
        document = {"ranks": [attrs.asdict(s) for s in stats], "slowest": slowest.rank}
        print(json.dumps(document, indent=1))
        return 0
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
