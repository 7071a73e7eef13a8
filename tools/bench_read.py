"""Random-window tokens/s of a packed zarr dataset vs np.memmap, from S3, and a loader's peak RSS: python tools/bench_read.py [--quick].

A JSONL corpus (bench_pack.py's generator) is packed with the `bytes` tokenizer (or a trained
BPE) into a local zarr dataset; the same tokens are also written as a flat .bin. Windows are
seq_len+1 tokens, batches of `batch` windows, int64 like the loader returns; tokens/s counts
batch * seq_len per batch. Rounds are interleaved and medians reported:
- memmap: np.memmap over the .bin, uniformly random window starts, batch built with np.stack;
- loader: our WindowLoader (WindowDataset.read over consecutive global samples, shuffled
  chunk-aware order), a fresh dataset each round, starting where the last round stopped;
- random: our TokenWindows.read with uniformly random window indices (most windows miss the
  chunk cache: the worst case, for honesty).
Then S3: the dataset uploaded to moto's S3 server on 127.0.0.1, read by one loader process.
Then peak RSS of a loader process going through a whole epoch with a cache 1/10 of the dataset.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from bench_pack import train_tokenizer, write_corpus  # tools/ is this script's directory

from llmtrain.core_mesh.logs import configure_logging

GOAL = 0.5


# ---------------------------------------------------------------- dataset
def make_dataset(args, work: Path) -> tuple[str, Path]:
    """(zarr dataset path, flat .bin of the same tokens)."""
    from llmtrain.data_pack.pack import pack
    from llmtrain.data_pack.store import PackedDataset

    corpus = work / "corpus.jsonl"
    write_corpus(corpus, int(args.corpus_mb * 1e6))
    tokenizer = {"kind": "bytes"}
    if args.tokenizer == "bpe":
        train_tokenizer(corpus, work / "tokenizer.json", 8192, 8_000_000)
        tokenizer = {"kind": "hf", "path": str(work / "tokenizer.json")}
    url = str(work / "dataset")
    pack([str(corpus)], url, tokenizer, chunk_tokens=args.chunk_tokens)
    corpus.unlink()
    flat = work / "tokens.bin"
    ds = PackedDataset(url)
    step = 64 * ds.chunk_tokens
    with open(flat, "wb") as f:
        for start in range(0, ds.n_tokens, step):
            ds.read(start, min(start + step, ds.n_tokens)).tofile(f)
    return url, flat


def disk_bytes(path: str) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


# ---------------------------------------------------------------- local readers
def memmap_rate(flat: Path, dtype, seq: int, batch: int, n: int, seed: int) -> float:
    tokens = np.memmap(flat, dtype=dtype, mode="r")
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    for _ in range(n):
        starts = rng.integers(0, len(tokens) - seq - 1, batch)
        np.stack([tokens[s : s + seq + 1] for s in starts]).astype(np.int64)
    return n * batch * seq / (time.perf_counter() - t0)


def loader_rate(url: str, seq: int, batch: int, n: int, first_step: int, **options) -> dict:
    """Tokens/s of WindowLoader over n batches from `first_step`, opening time included."""
    from llmtrain.data_pack.loader import WindowLoader, open_windows
    from llmtrain.data_pack.sampling import BatchPlan

    t0 = time.perf_counter()
    ds = open_windows([url], seq, seed=0, **options)
    plan = BatchPlan(global_batch=batch)
    loader = iter(WindowLoader(ds, plan, consumed=first_step * batch))
    t1 = time.perf_counter()
    next(loader)
    t2 = time.perf_counter()
    for _ in range(n - 1):
        next(loader)
    t3 = time.perf_counter()
    return {
        "tokens_per_s": n * batch * seq / (t3 - t0),
        "open_s": t1 - t0,
        "first_batch_s": t2 - t1,
        "chunk_reads": ds.sources[0].cache.reads,
    }


def random_rate(url: str, seq: int, batch: int, n: int, seed: int) -> dict:
    from llmtrain.data_pack.loader import open_windows

    windows = open_windows([url], seq).sources[0]
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    for _ in range(n):
        windows.read(rng.integers(0, len(windows), batch))
    seconds = time.perf_counter() - t0
    return {
        "tokens_per_s": n * batch * seq / seconds,
        "chunk_reads": windows.cache.reads,
        "cache_bytes": windows.cache.max_bytes,
    }


# ---------------------------------------------------------------- subprocesses
def _in_child(queue, function, *args, **kwargs) -> None:
    queue.put(function(*args, **kwargs))


def in_child(function, *args, **kwargs):
    """Run function in a fresh spawned process (its own memory and caches); return its result."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_in_child, args=(queue, function, *args), kwargs=kwargs)
    child.start()
    result = queue.get()
    child.join()
    return result


def peak_rss() -> int:
    """This process's peak RSS in bytes. VmHWM, not ru_maxrss: Linux keeps ru_maxrss across
    exec, so a spawned child would report its parent's size at the fork."""
    try:
        with open("/proc/self/status") as f:
            line = next(x for x in f if x.startswith("VmHWM:"))
        return int(line.split()[1]) * 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def epoch_rss(url: str, seq: int, batch: int, cache_bytes: int) -> dict:
    """Peak RSS of this (fresh) process reading every window of one epoch in loader order."""
    import psutil

    from llmtrain.data_pack.loader import WindowLoader, open_windows
    from llmtrain.data_pack.sampling import BatchPlan

    ds = open_windows([url], seq, seed=0, cache_bytes=cache_bytes)
    loader = iter(WindowLoader(ds, BatchPlan(global_batch=batch)))
    next(loader)
    baseline = psutil.Process().memory_info().rss
    t0 = time.perf_counter()
    n = len(ds) // batch
    for _ in range(n - 1):
        next(loader)
    cache = ds.sources[0].cache
    return {
        "batches": n,
        "seconds": time.perf_counter() - t0,
        "rss_after_first_batch": baseline,
        "peak_rss": peak_rss(),
        "cache_max_bytes": cache.max_bytes,
        "chunk_reads": cache.reads,
    }


def s3_rates(local: str, seq: int, batch: int, n: int, rounds: int) -> dict:
    """Upload the dataset to a moto S3 server on 127.0.0.1; tokens/s of one loader process."""
    import fsspec
    from moto.server import ThreadedMotoServer
    from s3fs import S3FileSystem

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # else it logs every request
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        os.environ.update(
            AWS_ENDPOINT_URL=f"http://{host}:{port}",  # spawned loaders inherit these
            AWS_ACCESS_KEY_ID="bench",
            AWS_SECRET_ACCESS_KEY="bench",
            AWS_DEFAULT_REGION="us-east-1",
        )
        S3FileSystem.clear_instance_cache()
        fs = fsspec.filesystem("s3")
        fs.mkdir("bench")
        t0 = time.perf_counter()
        fs.put(local, "bench/dataset", recursive=True)
        upload = time.perf_counter() - t0
        url = "s3://bench/dataset"
        runs = [in_child(loader_rate, url, seq, batch, n, r * n) for r in range(rounds)]
    finally:
        server.stop()
    return {"upload_s": upload, "runs": runs}


# ---------------------------------------------------------------- harness
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--corpus-mb", type=float, default=250.0, help="JSONL to generate and pack")
    p.add_argument("--tokenizer", choices=["bytes", "bpe"], default="bytes")
    p.add_argument("--chunk-tokens", type=int, default=1 << 20, help="pack's chunk size")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--batches", type=int, default=256, help="batches per round, local readers")
    p.add_argument("--random-batches", type=int, default=64, help="per round, uniform random")
    p.add_argument("--s3-batches", type=int, default=128, help="batches per round from S3")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-s3", action="store_true")
    p.add_argument("--workdir", help="keep files here (default: a temporary directory)")
    p.add_argument("--quick", action="store_true", help="a small smoke run")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    configure_logging(
        level="WARNING"
    )  # pack's and the S3 server's info lines would drown the table
    if args.quick:
        args.corpus_mb, args.chunk_tokens = (
            min(args.corpus_mb, 16.0),
            min(args.chunk_tokens, 1 << 16),
        )
        args.batches, args.s3_batches = min(args.batches, 64), min(args.s3_batches, 32)
        args.random_batches = min(args.random_batches, 32)
    with tempfile.TemporaryDirectory(prefix="bench_read-", dir=args.workdir) as tmp:
        results = bench(args, Path(tmp))
    if args.json:
        print(json.dumps({"args": vars(args), "results": results}, indent=2))


def bench(args, work: Path) -> dict:
    from llmtrain.data_pack.store import PackedDataset

    t0 = time.perf_counter()
    url, flat = make_dataset(args, work)
    ds = PackedDataset(url)
    token_bytes = ds.n_tokens * ds.dtype.itemsize
    seq, batch, n = args.seq, args.batch, args.batches
    print(
        f"dataset: {ds.n_tokens:,} tokens ({args.tokenizer}, {ds.dtype}, {token_bytes / 1e6:.0f} MB "
        f"decoded, {disk_bytes(url) / 1e6:.0f} MB zarr on disk, chunks of {ds.chunk_tokens:,} "
        f"tokens; made in {time.perf_counter() - t0:.0f}s); seq {seq}, batch {batch}, "
        f"{n} batches x {args.rounds} rounds, load average {os.getloadavg()[0]:.1f}"
    )
    rates: dict[str, list[float]] = {"memmap": [], "loader": [], "random": []}
    reads: dict[str, list[int]] = {"loader": [], "random": []}
    for r in range(args.rounds):
        rates["memmap"].append(memmap_rate(flat, ds.dtype, seq, batch, n, seed=r))
        for name, got in (
            ("loader", loader_rate(url, seq, batch, n, first_step=r * n)),
            ("random", random_rate(url, seq, batch, args.random_batches, seed=r)),
        ):
            rates[name].append(got["tokens_per_s"])
            reads[name].append(got["chunk_reads"])
    random_cache = got["cache_bytes"]
    res: dict = {"tokens": ds.n_tokens, "token_bytes": token_bytes, "rounds": rates}
    tps = res["tokens_per_s"] = {k: statistics.median(v) for k, v in rates.items()}
    res["ratio"] = tps["loader"] / tps["memmap"]
    row = "{:<34} {:>14}  {}"
    print(row.format("reader", "tokens/s", "ratio to memmap / note"))
    print(row.format("memmap (random starts, np.stack)", f"{tps['memmap']:,.0f}", "reference"))
    print(
        row.format(
            "loader (chunk-aware order)",
            f"{tps['loader']:,.0f}",
            f"{res['ratio']:.3f} (goal >= {GOAL} {'ok' if res['ratio'] >= GOAL else 'MISS'}); "
            f"{statistics.median(reads['loader']):.0f} chunk reads per {n} batches "
            f"({ds.n_chunks} chunks in the dataset)",
        )
    )
    print(
        row.format(
            "reader (uniform random windows)",
            f"{tps['random']:,.0f}",
            f"{tps['random'] / tps['memmap']:.3f}; {statistics.median(reads['random']):.0f} chunk "
            f"reads per {args.random_batches} batches, cache {random_cache / 2**20:.0f} MiB = "
            f"{random_cache / token_bytes:.0%} of the dataset",
        )
    )
    if not args.no_s3:
        s3 = res["s3"] = s3_rates(url, seq, batch, args.s3_batches, args.rounds)
        s3_tps = statistics.median(r["tokens_per_s"] for r in s3["runs"])
        first = statistics.median(r["open_s"] + r["first_batch_s"] for r in s3["runs"])
        print(
            row.format(
                "S3 loader, 1 process (moto)",
                f"{s3_tps:,.0f}",
                f"{s3_tps / tps['memmap']:.3f}; {args.s3_batches} batches per round, open + first "
                f"batch {first:.2f}s, {s3['runs'][0]['chunk_reads']} chunk reads; upload "
                f"{s3['upload_s']:.1f}s",
            )
        )
    cache = max(token_bytes // 10, 1)
    rss = res["rss"] = in_child(epoch_rss, url, seq, batch, cache)
    mb = 1 / 2**20
    print(
        f"peak RSS of a loader over one epoch ({rss['batches']:,} batches, {rss['chunk_reads']} "
        f"chunk reads, {rss['seconds']:.1f}s): {rss['peak_rss'] * mb:.0f} MiB; after its first "
        f"batch {rss['rss_after_first_batch'] * mb:.0f} MiB; cache {rss['cache_max_bytes'] * mb:.0f}"
        f" MiB; dataset {token_bytes * mb:.0f} MiB decoded "
        f"({token_bytes / rss['cache_max_bytes']:.1f}x the cache)"
    )
    return res


if __name__ == "__main__":
    sys.exit(main())
