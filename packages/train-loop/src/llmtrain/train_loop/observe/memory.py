"""Memory per rank: the numbers logged at each log step, the CUDA allocator's history and
snapshot, and what a rank that ran out of memory tells the user."""

from __future__ import annotations

import os
import resource
import sys
from pathlib import Path

import structlog
import torch

from llmtrain.core_mesh.errors import UserError
from llmtrain.train_loop.run_config import DebugConfig

log = structlog.get_logger("llmtrain.train_loop")


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
