"""What a run tells about itself while it runs: profiler windows, memory per rank, a hang
watchdog, per-rank step times, NCCL's flight recorder and the determinism switch."""

from __future__ import annotations

import faulthandler
import os
import random
import resource
import statistics
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import structlog
import torch

from llmtrain.core_mesh.errors import UserError
from llmtrain.train_loop.run_config import DebugConfig, ProfileConfig, WatchdogConfig

if TYPE_CHECKING:
    from torch.profiler import profile

log = structlog.get_logger("llmtrain.train_loop")


# --- memory ---
def memory_mib(device: torch.device) -> dict[str, float]:
    """peak / active / reserved memory of this process: the CUDA caching allocator's numbers on
    a GPU; on CPU peak and current resident set size (no reserved)."""
    if device.type == "cuda":
        return {
            "peak_memory_mib": torch.cuda.max_memory_allocated(device) / 2**20,
            "active_memory_mib": torch.cuda.memory_allocated(device) / 2**20,
            "reserved_memory_mib": torch.cuda.memory_reserved(device) / 2**20,
        }
    current = _current_rss_mib()
    if current is None:
        return {"peak_memory_mib": _peak_rss_mib()}
    # the kernel updates the peak lazily; the current size can be a page or two ahead
    return {"peak_memory_mib": max(_peak_rss_mib(), current), "active_memory_mib": current}


def _peak_rss_mib() -> float:
    """This process's peak resident set. Linux: VmHWM of its own address space (ru_maxrss
    carries the parent's peak across fork and exec, so a small run started from a big
    process would report the parent's size)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024  # bytes on macOS, else KiB


def _current_rss_mib() -> float | None:
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def start_memory_history(device: torch.device, debug: DebugConfig) -> None:
    if device.type == "cuda" and debug.memory_history:
        torch.cuda.memory._record_memory_history(max_entries=100_000)


def dump_memory_snapshot(path: Path) -> Path | None:
    """The CUDA allocator's state (and allocation stacks if recorded) for pytorch.org/memory_viz."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # torch leaves _dump_snapshot unannotated
        torch.cuda.memory._dump_snapshot(str(path))  # type: ignore[no-untyped-call]
    except Exception as exc:  # noqa: BLE001 - best effort while handling an OOM
        log.warning("memory.snapshot_failed", error=str(exc))
        return None
    return path


def out_of_memory_error(
    exc: BaseException,
    device: torch.device,
    run_dir: Path,
    step: int,
    rank: int,
    debug: DebugConfig,
) -> UserError:
    """What a rank that ran out of memory in `step` tells the user; on CUDA it first writes the
    allocator's snapshot beside the run and names the file."""
    where = ""
    if device.type == "cuda":
        path = run_dir / "memory" / f"oom-step{step}-rank{rank}.pickle"
        if dump_memory_snapshot(path) is not None:
            where = f" A memory snapshot is in {path} (drag it into https://pytorch.org/memory_viz"
            if not debug.memory_history:
                where += "; set debug.memory_history: true to record where each block was allocated"
            where += ")."
    return UserError(
        f"rank {rank}: out of memory in step {step} ({exc}).{where} "
        "Lower data.micro_batch, turn on parallel.activation_checkpointing, shard more "
        "(mesh.dp_shard, tp), and compare with `llmtrain estimate`"
    )


# --- per-rank numbers, gathered at log steps ---
def gather_floats(
    values: list[float], device: torch.device, *, all_gather: Any = None
) -> list[list[float]]:
    """Every rank's `values` (same length on all ranks), in rank order."""
    import torch.distributed as dist

    mine = torch.tensor(values, dtype=torch.float64, device=device)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [values]
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    (all_gather or dist.all_gather)(out, mine)
    return [t.tolist() for t in out]


# --- stragglers: when each rank arrives at its collectives ---
COLLECTIVES = (
    "all_gather_single",
    "reduce_scatter_single",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "all_to_all_single",
)


class CollectiveClock:
    """Times when this rank calls torch.distributed's collectives (FSDP's gathers and
    reduce-scatters, DDP's and the trainer's all-reduces), relative to the end of the last
    per-rank gather, which all ranks leave together. Every rank makes the same calls in the same
    order, so the rank whose arrival times sum highest is the one the others wait for:
    `lag(r) = sum_r - min over ranks`, in seconds per window. Costs a clock read per call."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.originals: dict[str, Any] = {}
        self.calls = 0
        self.total = 0.0
        self.origin = time.perf_counter()

    def install(self) -> None:
        """Wrap the collectives; the first window starts as every rank leaves a barrier."""
        if self.dist.is_initialized():
            self.dist.barrier()
        self.origin = time.perf_counter()
        for name in COLLECTIVES:
            original = getattr(self.dist, name, None)
            if original is None or name in self.originals:
                continue
            self.originals[name] = original
            setattr(self.dist, name, self._timed(original))

    def _timed(self, original: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            self.total += time.perf_counter() - self.origin
            return original(*args, **kwargs)

        timed.__wrapped__ = original  # type: ignore[attr-defined]
        return timed

    def gather(self, values: list[float], device: torch.device) -> list[list[float]]:
        """Every rank's `values` plus (calls, summed arrival) of this window, in rank order;
        then a new window starts, at the same moment on every rank."""
        mine = [*values, float(self.calls), self.total]
        out = gather_floats(mine, device, all_gather=self.originals.get("all_gather"))
        self.calls, self.total, self.origin = 0, 0.0, time.perf_counter()
        return out

    def remove(self) -> None:
        for name, original in self.originals.items():
            setattr(self.dist, name, original)
        self.originals.clear()


def arrival_lag(ranks: list[list[float]]) -> list[float] | None:
    """Seconds each rank arrived later than the earliest at this window's collectives, from
    `CollectiveClock.gather`'s rows; None when the ranks made different calls (pipelines)."""
    calls = {row[-2] for row in ranks}
    if len(calls) != 1 or not calls.pop():
        return None
    earliest = min(row[-1] for row in ranks)
    return [row[-1] - earliest for row in ranks]


# --- determinism and NCCL's flight recorder (both before any CUDA work) ---
def seed_everything(seed: int, debug: DebugConfig) -> bool:
    """Seed Python, NumPy and torch; with `debug.deterministic` switch torch to deterministic
    algorithms. Returns the switch's previous state (for `restore_determinism`)."""
    previous = torch.are_deterministic_algorithms_enabled()
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if debug.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        log.info("debug.deterministic", message="deterministic algorithms on; every seed set")
    return previous


def restore_determinism(previous: bool) -> None:
    """Put the process-wide switch back (a program that runs several trainers in turn)."""
    if torch.are_deterministic_algorithms_enabled() != previous:
        torch.use_deterministic_algorithms(previous)


def flight_recorder_env(debug: DebugConfig, log_dir: Path) -> None:
    """NCCL keeps a ring of recent collectives per rank and writes it out when a collective
    times out (`logs/nccl_trace_rank_<k>`); users' own settings win."""
    if not debug.flight_recorder:
        return
    os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", str(log_dir / "nccl_trace_rank_"))


# --- the profiler ---
class StepProfiler:
    """Opens torch.profiler for `warmup + active` steps every `every` steps; otherwise costs
    one modulo per step."""

    def __init__(self, config: ProfileConfig | None, run_dir: Path, rank: int, device: Any):
        self.config = config
        self.run_dir = run_dir
        self.rank = rank
        self.device = device
        self.prof: profile | None = None
        self.left = 0
        self.enabled = config is not None and (config.ranks is None or rank in config.ranks)

    def before_step(self, step: int, last_step: int) -> None:
        """`step`: the 1-based number of the step about to run; a window that would not end by
        `last_step` is not opened."""
        c = self.config
        if not self.enabled or c is None or self.prof is not None or step % c.every:
            return
        if step + c.warmup + c.active - 1 > last_step:
            return
        from torch.profiler import ProfilerActivity, profile, schedule

        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        first = step + c.warmup
        last = first + c.active - 1
        self.prof = profile(
            activities=activities,
            schedule=schedule(wait=0, warmup=c.warmup, active=c.active, repeat=1),
            on_trace_ready=lambda prof: self._export(prof, first, last),
            record_shapes=c.record_shapes,
            profile_memory=c.profile_memory,
            with_stack=c.with_stack,
        )
        self.prof.start()
        self.left = c.warmup + c.active

    def after_step(self) -> None:
        if self.prof is None:
            return
        self.prof.step()
        self.left -= 1
        if self.left == 0:
            self.close()

    def _export(self, prof: profile, first: int, last: int) -> None:
        path = self.run_dir / "profiles" / f"step-{first}" / f"rank{self.rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        prof.export_chrome_trace(str(tmp))
        tmp.replace(path)
        log.info("profile.written", steps=f"{first}-{last}", trace=str(path))

    def close(self) -> None:
        if self.prof is not None:
            prof, self.prof = self.prof, None
            prof.stop()


# --- the hang watchdog ---
class Watchdog:
    """A thread that watches the current activity (a step, an eval, a save). One that runs past
    its limit gets every thread's Python stack written to `logs/stacks-rank<k>.txt` (faulthandler)
    and an error line in the rank's JSON log naming the file. Each activity is reported once."""

    def __init__(self, config: WatchdogConfig, log_dir: Path, rank: int):
        self.config = config
        self.file = log_dir / f"stacks-rank{rank}.txt"
        self.rank = rank
        self.recent: deque[float] = deque(maxlen=50)
        self.lock = threading.Lock()
        self.current: tuple[str, int, float, float] | None = None  # what, step, start, limit
        self.reported = False
        self.stalls = 0
        self.stop_event = threading.Event()
        self.thread = None
        if config.enabled:
            self.thread = threading.Thread(target=self._run, name="llmtrain-watchdog", daemon=True)
            self.thread.start()

    def limit(self, what: str) -> float:
        c = self.config
        if what != "step" or len(self.recent) < c.warmup_steps:
            return c.startup_seconds
        return max(c.min_seconds, c.multiple * statistics.median(self.recent))

    def start(self, what: str, step: int) -> None:
        with self.lock:
            self.current = (what, step, time.monotonic(), self.limit(what))
            self.reported = False

    def end(self) -> None:
        with self.lock:
            if self.current is not None and self.current[0] == "step":
                self.recent.append(time.monotonic() - self.current[2])
            self.current = None

    def _run(self) -> None:
        while not self.stop_event.wait(0.25):
            with self.lock:
                if self.current is None or self.reported:
                    continue
                what, step, start, limit = self.current
                elapsed = time.monotonic() - start
                if elapsed <= limit:
                    continue
                self.reported = True
                self.stalls += 1
            self._report(what, step, elapsed, limit)

    def _report(self, what: str, step: int, elapsed: float, limit: float) -> None:
        self.file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.file, "a") as f:
            f.write(
                f"=== rank {self.rank}: step {step} ({what}) running for {elapsed:.1f} s "
                f"(limit {limit:.1f} s) at {time.strftime('%Y-%m-%d %H:%M:%S')} ===\n"
            )
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
            f.write("\n")
        median = statistics.median(self.recent) if self.recent else None
        log.error(
            "watchdog.stall",
            message=f"rank {self.rank}: {what} of step {step} has run {elapsed:.1f} s, over its "
            f"limit of {limit:.1f} s; every thread's stack is in {self.file}",
            step=step,
            activity=what,
            seconds=round(elapsed, 3),
            limit_s=round(limit, 3),
            median_step_s=None if median is None else round(median, 6),
            stacks=str(self.file),
        )

    def close(self) -> None:
        self.stop_event.set()
        if self.thread is not None:
            self.thread.join(timeout=2)
