"""Checkpoint save/load GB/s vs dd-style sequential I/O, and async-save blocking time: python tools/bench_checkpoint.py [--quick] [--json].

One process, local disk (--dir, default a temp dir under /tmp). The state is a model of a few big
float32 tensors plus its AdamW moments (`--state params`: the parameters only), saved through
`llmtrain.checkpoint` (ModelState + Values, a Checkpointer per repetition, each in a new
directory). In every repetition, in an order that rotates from one repetition to the next:
- write: a sync `Checkpointer.save` vs `dd if=/dev/zero bs=16M conv=fsync` and a Python loop of
  16 MiB writes + os.fsync, of the same bytes to new files on the same disk (DCP fsyncs as well);
- read: `Checkpointer.load` into the state vs 16 MiB sequential reads of the reference file, both
  warm (the pages the writes just left in the page cache) and cold (each file dropped from the
  page cache first with posix_fadvise(DONTNEED); a VM's host may still cache the disk);
- async: time spent inside an async `save()` (it returns once the state is staged in host
  memory) vs the whole sync save, and the time until that async save is committed (`wait()`),
  in a run's steady state (the third save of one checkpointer: its staging buffers exist);
  beside it, the floor of any staging: one copy of the state's tensors into buffers allocated
  before (torch's copy_, all threads).
- object storage (`--s3-size-mb`, 0 to skip): a moto S3 server on 127.0.0.1 through s3fs; save and
  load of a smaller state vs s3fs putting and getting the same number of bytes as plain objects,
  one per writer thread, with the same concurrency (`--io-threads`).
GB/s counts the state's tensor bytes (1 GB = 1e9 bytes); ratios use the faster reference.
Medians over repetitions are reported.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import logging
import math
import os
import pstats
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import structlog
import torch
from torch import nn

from llmtrain.checkpoint.manager import Checkpointer, KeepPolicy
from llmtrain.checkpoint.state import ModelState, Values
from llmtrain.checkpoint.stream_storage import DEFAULT_THREADS

GOAL_THROUGHPUT = 0.7
GOAL_BLOCKING = 0.1
COLS = 4096
CHUNK = 16 * 2**20
GB = 1e9


# ---------------------------------------------------------------- the state
def build_state(nbytes: int, tensors: int, kind: str) -> dict:
    """A ModelState of `tensors` float32 matrices (+ AdamW moments) totalling about `nbytes`."""
    per_copy = nbytes // 3 if kind == "adamw" else nbytes
    rows = max(1, per_copy // (tensors * COLS * 4))
    torch.manual_seed(0)
    model = nn.ParameterList(nn.Parameter(torch.rand(rows, COLS)) for _ in range(tensors))
    optimizers = []
    if kind == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for p in model.parameters():
            p.grad = torch.full_like(p, 1e-3)
        opt.step()  # creates the exp_avg / exp_avg_sq state
        model.zero_grad(set_to_none=True)
        optimizers.append(opt)
    return {"model": ModelState(model, optimizers), "progress": Values(step=0, tokens=0)}


def state_tensors(state: dict) -> list[torch.Tensor]:
    """Every tensor of the model part's state dict (parameters and optimizer moments)."""
    found: list[torch.Tensor] = []

    def visit(value) -> None:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, dict):
            for v in value.values():
                visit(v)
        elif isinstance(value, list | tuple):
            for v in value:
                visit(v)

    visit(state["model"].state_dict())
    return found


def tensor_bytes(state: dict) -> int:
    return sum(t.numel() * t.element_size() for t in state_tensors(state))


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


# ---------------------------------------------------------------- references
def dd_write(path: Path, nbytes: int) -> tuple[float, int]:
    count = math.ceil(nbytes / CHUNK)
    cmd = ["dd", "if=/dev/zero", f"of={path}", "bs=16M", f"count={count}", "conv=fsync"]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True)
    return time.perf_counter() - t0, count * CHUNK


def python_write(path: Path, nbytes: int, buf: bytes) -> tuple[float, int]:
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        left = nbytes
        while left > 0:
            left -= f.write(memoryview(buf)[: min(left, len(buf))])
        os.fsync(f.fileno())
    return time.perf_counter() - t0, nbytes


def python_read(path: Path, buf: bytearray) -> tuple[float, int]:
    view, total = memoryview(buf), 0
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(view):
            total += n
    return time.perf_counter() - t0, total


def drop_from_page_cache(root: Path) -> None:
    """Evict clean pages of every file under `root` (no root needed; they were fsynced)."""
    files = [root] if root.is_file() else [f for f in root.rglob("*") if f.is_file()]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# ---------------------------------------------------------------- ours
IO_THREADS = DEFAULT_THREADS  # set from --io-threads


def sync_save(root: Path | str, state: dict, step: int) -> float:
    ckpt = Checkpointer(str(root), keep=KeepPolicy(last=100), io_threads=IO_THREADS)
    t0 = time.perf_counter()
    ckpt.save(step, state, blocking=True)
    elapsed = time.perf_counter() - t0
    ckpt.close()
    return elapsed


def async_save(root: Path, state: dict, step: int) -> tuple[float, float]:
    """(seconds inside save(), seconds until committed) of an async save in the steady state of a
    run: the checkpointer's staging buffers exist, from two saves before the timed one."""
    ckpt = Checkpointer(
        str(root), keep=KeepPolicy(last=100), async_save=True, io_threads=IO_THREADS
    )
    for earlier in range(2):
        ckpt.save(3 * step + earlier, state)
        ckpt.wait()
    t0 = time.perf_counter()
    ckpt.save(3 * step + 2, state)
    blocked = time.perf_counter() - t0
    ckpt.wait()
    committed = time.perf_counter() - t0
    ckpt.close()
    return blocked, committed


def load(root: Path | str, state: dict) -> float:
    ckpt = Checkpointer(str(root), io_threads=IO_THREADS)
    t0 = time.perf_counter()
    step = ckpt.load(state)
    elapsed = time.perf_counter() - t0
    if step is None:
        raise SystemExit(f"nothing to load under {root}: the benchmark's save did not commit")
    ckpt.close()
    return elapsed


# ---------------------------------------------------------------- harness
def fresh(work: Path, name: str) -> Path:
    path = work / name
    if path.exists():
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    return path


def rotated(items: list, r: int) -> list:
    """Round r starts at item r: over len(items) rounds each takes every position once."""
    k = r % len(items)
    return items[k:] + items[:k]


def one_round(work: Path, state: dict, nbytes: int, r: int, use_dd: bool) -> dict[str, float]:
    """One repetition; returns GB/s figures and seconds."""
    buf = os.urandom(CHUNK)
    out: dict[str, float] = {}
    for p in ("dd.bin", "py.bin", "sync", "async"):
        fresh(work, p)
    os.sync()  # deletions and their discards settle before anything is timed

    writes: list[tuple[str, Callable[[], tuple[float, int]]]] = [
        ("save", lambda: (sync_save(work / "sync", state, r), nbytes)),
        ("python write", lambda: python_write(work / "py.bin", nbytes, buf)),
    ]
    if use_dd:
        writes.append(("dd write", lambda: dd_write(work / "dd.bin", nbytes)))
    for name, action in rotated(writes, r):
        seconds, n = action()
        out[f"{name} GB/s"] = n / seconds / GB
        if name == "save":
            out["sync save s"] = seconds
    out["checkpoint bytes on disk"] = dir_bytes(work / "sync" / f"step-{r}")

    read_buf = bytearray(CHUNK)
    for temp in ("warm", "cold"):
        reads: list[tuple[str, Callable[[], tuple[float, int]]]] = [
            ("load", lambda: (load(work / "sync", state), nbytes)),
            ("read", lambda: python_read(work / "py.bin", read_buf)),
        ]
        for name, action in rotated(reads, r):
            if temp == "cold":
                drop_from_page_cache(work / ("sync" if name == "load" else "py.bin"))
            seconds, n = action()
            out[f"{name} {temp} GB/s"] = n / seconds / GB

    out["async blocked s"], out["async committed s"] = async_save(work / "async", state, r)
    out["copy floor s"] = copy_floor(state)
    return out


def copy_floor(state: dict) -> float:
    """Seconds of one copy of the state's tensors into buffers that already exist: what any
    staging costs at least."""
    tensors = state_tensors(state)
    buffers = [torch.empty_like(t) for t in tensors]
    for b, t in zip(buffers, tensors, strict=True):
        b.copy_(t)  # fault the pages in first, as a reused staging buffer would be
    t0 = time.perf_counter()
    for b, t in zip(buffers, tensors, strict=True):
        b.copy_(t)
    return time.perf_counter() - t0


# ---------------------------------------------------------------- object storage
def s3_rounds(nbytes_wanted: int, tensors: int, kind: str, rounds: int) -> list[dict[str, float]]:
    """Save and load GB/s on a moto S3 server vs s3fs putting / getting plain objects of the same
    bytes with the same concurrency."""
    from concurrent.futures import ThreadPoolExecutor

    from moto.server import ThreadedMotoServer
    from s3fs import S3FileSystem

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    os.environ.update(
        AWS_ENDPOINT_URL=f"http://{host}:{port}",
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
    )
    try:
        fs = S3FileSystem()
        fs.mkdir("bench")
        state = build_state(nbytes_wanted, tensors, kind)
        nbytes = tensor_bytes(state)
        part = math.ceil(nbytes / IO_THREADS)
        blobs = [os.urandom(min(part, nbytes - i * part)) for i in range(IO_THREADS)]
        pool = ThreadPoolExecutor(IO_THREADS)

        def put(r: int) -> float:
            t0 = time.perf_counter()
            list(
                pool.map(
                    lambda i: fs.pipe_file(f"bench/plain-{r}/{i}", blobs[i]), range(IO_THREADS)
                )
            )
            return time.perf_counter() - t0

        def get(r: int) -> float:
            t0 = time.perf_counter()
            list(pool.map(lambda i: fs.cat_file(f"bench/plain-{r}/{i}"), range(IO_THREADS)))
            return time.perf_counter() - t0

        sync_save("s3://bench/warmup", state, 0)  # first-call costs
        results = []
        for r in range(rounds):
            out = {}
            pairs = [
                ("s3 save", lambda r=r: sync_save(f"s3://bench/ckpt-{r}", state, r)),
                ("s3 put", lambda r=r: put(r)),
            ]
            for name, action in rotated(pairs, r):
                out[f"{name} GB/s"] = nbytes / action() / GB
            pairs = [
                ("s3 load", lambda r=r: load(f"s3://bench/ckpt-{r}", state)),
                ("s3 get", lambda r=r: get(r)),
            ]
            for name, action in rotated(pairs, r):
                out[f"{name} GB/s"] = nbytes / action() / GB
            out["s3 bytes"] = nbytes
            results.append(out)
        pool.shutdown()
        return results
    finally:
        server.stop()


def profiled(label: str, action: Callable[[], object], top: int) -> None:
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.runcall(action)
    seconds = time.perf_counter() - t0
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    print(f"--- {label}: {seconds:.3f} s, {faults:,} minor page faults (4 KiB each)")
    pstats.Stats(prof, stream=sys.stdout).strip_dirs().sort_stats("tottime").print_stats(top)


def profile_once(work: Path, state: dict, top: int) -> None:
    """Where the time goes: cProfile's top entries (own time) of one save, load and async save."""
    fresh(work, "profile")
    profiled("sync save", lambda: sync_save(work / "profile", state, 0), top)
    profiled("load (page cache)", lambda: load(work / "profile", state), top)
    ckpt = Checkpointer(str(work / "profile"), keep=KeepPolicy(last=100), async_save=True)
    profiled("async save(): the blocking part", lambda: ckpt.save(1, state), top)
    ckpt.close()


def warm_up(work: Path, tensors: int, kind: str) -> None:
    """Import and first-call costs of DCP, on a small state of the same structure."""
    small = build_state(8 * 2**20, tensors, kind)
    sync_save(work / "warmup", small, 0)
    load(work / "warmup", small)
    async_save(work / "warmup-async", small, 0)
    for p in ("warmup", "warmup-async"):
        shutil.rmtree(work / p)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", help="where to write (default: a temp dir under /tmp)")
    p.add_argument("--size-mb", type=float, default=1000, help="state size in MB (1e6 bytes)")
    p.add_argument("--tensors", type=int, default=8, help="parameter tensors in the model")
    p.add_argument("--state", choices=["adamw", "params"], default="adamw")
    p.add_argument("--rounds", type=int, default=6, help="a multiple of 3 balances the order")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument(
        "--io-threads", type=int, default=DEFAULT_THREADS, help="the checkpointer's I/O threads"
    )
    p.add_argument("--s3-size-mb", type=float, default=200, help="object-storage state; 0: skip")
    p.add_argument("--quick", action="store_true", help="~100 MB state, 3 rounds")
    p.add_argument("--no-dd", action="store_true", help="skip the dd reference")
    p.add_argument("--profile", action="store_true", help="also cProfile one of each, after")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.quick:
        args.size_mb, args.rounds, args.s3_size_mb = 100, 3, min(args.s3_size_mb, 50)
    torch.set_num_threads(args.threads)
    global IO_THREADS
    IO_THREADS = args.io_threads
    # the checkpointer's per-save log lines and DCP's single-process warning would bury the table
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    use_dd = not args.no_dd and shutil.which("dd") is not None

    base = Path(args.dir) if args.dir else Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench_checkpoint-", dir=base))
    try:
        state = build_state(int(args.size_mb * 1e6), args.tensors, args.state)
        nbytes = tensor_bytes(state)
        warm_up(work, args.tensors, args.state)
        load_before = os.getloadavg()[0]
        rounds = [one_round(work, state, nbytes, r, use_dd) for r in range(args.rounds)]
        if args.s3_size_mb > 0:
            s3 = s3_rounds(int(args.s3_size_mb * 1e6), args.tensors, args.state, args.rounds)
            rounds = [{**a, **b} for a, b in zip(rounds, s3, strict=True)]
        load_after = os.getloadavg()[0]
        med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
        report(args, work, nbytes, med, use_dd)
        print(
            f"1-minute load average {load_before:.1f} before, {load_after:.1f} after "
            f"({os.cpu_count()} CPUs): other work on the machine disturbs these figures"
        )
        if args.profile:
            profile_once(work, state, top=12)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps({"args": vars(args), "median": med, "rounds": rounds}, indent=2))


def report(args, work: Path, nbytes: int, med: dict[str, float], use_dd: bool) -> None:
    params = nbytes // 3 if args.state == "adamw" else nbytes
    print(
        f"state={args.state} ({args.tensors} float32 tensors, {params / GB:.3f} GB of parameters"
        f"{' + AdamW moments' if args.state == 'adamw' else ''}: {nbytes / GB:.3f} GB of "
        f"tensors, {med['checkpoint bytes on disk'] / GB:.3f} GB on disk) dir={work.parent} "
        f"threads={args.threads} io_threads={args.io_threads} rounds={args.rounds} (medians)"
    )
    row = "{:<22} {:>9}  {:<34} {:>6}  {}"
    print(row.format("measure", "ours", "reference", "ratio", "goal"))

    def throughput(label: str, ours: float, refs: dict[str, float]) -> None:
        best = max(refs.values())
        text = " / ".join(f"{k} {v:.2f}" for k, v in refs.items())
        ratio = ours / best
        verdict = "ok" if ratio >= GOAL_THROUGHPUT else "MISS"
        print(
            row.format(
                label, f"{ours:.2f}", text, f"{ratio:.2f}", f">= {GOAL_THROUGHPUT} {verdict}"
            )
        )

    writes = {"python": med["python write GB/s"]}
    if use_dd:
        writes["dd"] = med["dd write GB/s"]
    throughput("save GB/s", med["save GB/s"], writes)
    throughput("load GB/s (page cache)", med["load warm GB/s"], {"read": med["read warm GB/s"]})
    throughput("load GB/s (cold)", med["load cold GB/s"], {"read": med["read cold GB/s"]})
    sync_s, blocked = med["sync save s"], med["async blocked s"]
    ratio = blocked / sync_s
    verdict = "ok" if ratio <= GOAL_BLOCKING else "MISS"
    print(
        row.format(
            "async save blocks s",
            f"{blocked:.3f}",
            f"sync save {sync_s:.3f} s",
            f"{ratio:.3f}",
            f"<= {GOAL_BLOCKING} {verdict}",
        )
    )
    floor = med["copy floor s"]
    print(
        row.format(
            "  staging floor s",
            f"{floor:.3f}",
            f"one copy of the state: {floor / sync_s:.3f} of a sync save",
            "",
            "",
        )
    )
    print(row.format("async commit s", f"{med['async committed s']:.3f}", "", "", ""))
    if "s3 save GB/s" in med:
        size = f"{med['s3 bytes'] / GB:.2f} GB"
        throughput(f"S3 save GB/s ({size})", med["s3 save GB/s"], {"put": med["s3 put GB/s"]})
        throughput(f"S3 load GB/s ({size})", med["s3 load GB/s"], {"get": med["s3 get GB/s"]})


if __name__ == "__main__":
    main()
