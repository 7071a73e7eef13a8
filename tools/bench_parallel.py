"""Training-step tokens/s and peak memory per rank of llmtrain.parallel layouts vs a bare PyTorch loop: python tools/bench_parallel.py [--layouts fsdp1,ddp,fsdp,fsdp+ac,tp,pp] [--json PATH].

The reference runs first, in this process: the same model in plain PyTorch (forward, summed
cross-entropy / target count, backward, clip to norm 1, AdamW). Then each layout runs as its own
torchrun job of this script (`--worker`): the model built on the meta device, checked and laid out
by DefaultStrategy, materialized, trained on the same global batch with the same loss and
optimizer, each rank reading its data-parallel share. Each step after the warmup is timed (the
slowest rank's time counts); tokens/s are global: batch x seq_len over the median step time.

A layout is `<kind>[world][+ac]`: kind fsdp (dp_shard), ddp (dp_replicate), tp or pp (1F1B over
--microbatches); world defaults to --nproc; `+ac` checkpoints every block. `fsdp1` is the
library on one process (a world of one shards nothing): its ratio is the library's overhead.
Peak memory per rank: peak RSS on CPU, torch.cuda.max_memory_allocated on CUDA.
GPU: --device cuda --dtype bf16 --compile also prints MFU against the GPU's peak bf16 FLOPs.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import re
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

LR, MAX_NORM = 3e-4, 1.0
GOAL_MFU = 0.45  # llama-1b, fsdp1 (one GPU), bf16, compile
DEFAULT_LAYOUTS = "fsdp1,ddp,fsdp,fsdp+ac,tp,pp"
# a preset's shape for this benchmark unless --set says otherwise
PRESET_OVERRIDES = {"tiny": dict(n_layers=4, vocab_size=512, max_seq_len=256)}
LAYOUT_NAME = re.compile(r"(?P<kind>fsdp|ddp|tp|pp)(?P<world>\d*)(?P<ac>\+ac)?")


# ---------------------------------------------------------------- shared by both sides
def model_config(args):
    from llmtrain.models.presets import preset_config

    return preset_config(args.model, **model_overrides(args))


def model_overrides(args) -> dict:
    overrides = dict(PRESET_OVERRIDES.get(args.model, {}))
    for item in args.set:
        key, _, text = item.partition("=")
        try:
            overrides[key] = json.loads(text)
        except json.JSONDecodeError:
            overrides[key] = text  # a bare word: norm=layernorm
    return overrides


def global_batch(args, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same fixed batch in every process: (batch, seq_len) tokens and their next tokens."""
    g = torch.Generator().manual_seed(1234)
    data = torch.randint(0, vocab_size, (args.batch, args.seq_len + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def time_steps(step, args, device: torch.device, barrier=lambda: None):
    """Run the warmup, then time each step; (seconds of each timed step, the last step's result)."""
    for _ in range(args.warmup):
        step()
    sync(device)
    barrier()
    seconds = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        result = step()
        sync(device)
        seconds.append(time.perf_counter() - t0)
    barrier()
    return seconds, result


# ---------------------------------------------------------------- reference (plain PyTorch)
def bare(args, device: torch.device) -> dict:
    from llmtrain.models.transformer import build_model

    base = peak_memory_mib(device)
    cfg = model_config(args)
    torch.manual_seed(0)
    with device:
        model = build_model(cfg)
    model.init_weights()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    forward = torch.compile(model) if args.compile else model
    autocast = contextlib.nullcontext
    if args.dtype == "bf16":
        autocast = lambda: torch.autocast(device.type, dtype=torch.bfloat16)  # noqa: E731
    tokens, targets = (t.to(device) for t in global_batch(args, cfg.vocab_size))
    count = targets.numel()
    seen: dict[str, str] = {}

    def step() -> torch.Tensor:
        with autocast():
            logits = forward(tokens)
        seen.setdefault("compute_dtype", dtype_name(logits.dtype))
        loss = loss_sum(logits, targets) / count
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds, loss = time_steps(step, args, device)
    return {
        "step_s": seconds,
        "base_mib": [base],
        "peak_mib": [peak_memory_mib(device)],
        "loss": loss.item(),
        **seen,
    }


# ---------------------------------------------------------------- a layout (under torchrun)
def parse_layout(name: str, args) -> dict:
    m = LAYOUT_NAME.fullmatch(name)
    if not m:
        raise ValueError(f"unknown layout {name!r}: expected <fsdp|ddp|tp|pp>[world][+ac]")
    kind, world = m["kind"], int(m["world"] or args.nproc)
    layout = {"options": {}, "microbatches": 1}
    if kind == "fsdp":
        layout["mesh"] = {"dp_shard": world}
    elif kind == "ddp":
        layout["mesh"] = {"dp_replicate": world, "dp_shard": 1}
    elif kind == "tp":
        layout["mesh"] = {"tp": world, "dp_shard": 1}
    else:
        layout["mesh"] = {"pp": world, "dp_shard": 1}
        layout["options"]["pipeline"] = {"schedule": "1F1B"}
        layout["microbatches"] = args.microbatches
    if m["ac"]:
        layout["options"]["activation_checkpointing"] = {"mode": "full"}
    if args.compile:
        layout["options"]["compile"] = True
    if args.dtype == "bf16":
        layout["options"]["param_dtype"] = "bfloat16"
    threads = max(1, args.threads // world)
    return {"name": f"{kind}{world}{m['ac'] or ''}", "world": world, "threads": threads, **layout}


def describe_layout(layout: dict) -> str:
    mesh = " ".join(f"{k}={v}" for k, v in layout["mesh"].items())
    if "pipeline" in layout["options"]:
        mesh += f" {layout['options']['pipeline']['schedule']} x{layout['microbatches']} mb"
    return mesh


def train_layout(args, layout: dict, world_size: int, device: torch.device) -> dict:
    """Lay the model out, train it, and return this rank's figures (plain data: the mesh, the
    model and the optimizer are gone once this returns)."""
    from llmtrain.core_mesh.config import structure
    from llmtrain.core_mesh.mesh import MeshSpec, build_device_mesh
    from llmtrain.models.transformer import build_model
    from llmtrain.parallel.options import ParallelOptions
    from llmtrain.parallel.strategy import DefaultStrategy

    base = peak_memory_mib(device)
    cfg = model_config(args)
    microbatches = layout["microbatches"]
    with torch.device("meta"):
        model = build_model(cfg)
    strategy = DefaultStrategy(structure(layout["options"], ParallelOptions))
    spec = strategy.check(
        MeshSpec(**layout["mesh"]),
        world_size,
        model.describe(),
        seq_len=args.seq_len,
        device_type=args.device,
        microbatches=microbatches,
    )
    mesh = build_device_mesh(spec, args.device)
    torch.manual_seed(0)
    par = strategy.parallelize(model.describe(), mesh, device, microbatches=microbatches)
    par.materialize(lambda part: part.init_weights())
    opt = torch.optim.AdamW(par.parameters(), lr=LR)

    if args.batch % par.data_world:
        raise ValueError(f"--batch {args.batch} does not split over {par.data_world} ranks")
    per_rank = args.batch // par.data_world
    rows = slice(par.data_rank * per_rank, (par.data_rank + 1) * per_rank)
    tokens, targets = (t[rows].to(device) for t in global_batch(args, cfg.vocab_size))
    scale = 1.0 / (args.batch * args.seq_len)
    seen: dict[str, str] = {}

    def loss_fn(logits: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        seen.setdefault("compute_dtype", dtype_name(logits.dtype))
        return loss_sum(logits, tgt)

    def step() -> torch.Tensor:
        local = par.forward_backward(tokens, targets, loss_fn, scale=scale)
        par.clip_grad_norm_(MAX_NORM)
        opt.step()
        opt.zero_grad()
        return local

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds, local = time_steps(step, args, device, torch.distributed.barrier)
    return {
        "spec": str(par.spec),
        "step_s": seconds,
        "base_mib": base,
        "peak_mib": peak_memory_mib(device),
        "loss": (par.sum_over_data(local) * scale).item(),
        **seen,
    }


def worker(args, layout: dict) -> None:
    """One rank of a layout (under torchrun); rank 0 writes every rank's figures to --out."""
    from llmtrain.core_mesh.world import World, init_distributed, shutdown_distributed

    world = World.from_env()
    try:
        if args.device == "cpu":
            torch.set_num_threads(layout["threads"])
        device = init_distributed(world, args.device, timeout_s=args.timeout)
        mine = train_layout(args, layout, world.world_size, device)
        ranks: list[dict] = [{}] * world.world_size
        torch.distributed.all_gather_object(ranks, mine)
        if world.is_main:
            dtypes = {r["compute_dtype"] for r in ranks if "compute_dtype" in r}
            result = {
                "spec": mine["spec"],
                # ranks wait for each other in every step; the slowest one's time counts
                "step_s": [max(step) for step in zip(*(r["step_s"] for r in ranks), strict=True)],
                "base_mib": [r["base_mib"] for r in ranks],
                "peak_mib": [r["peak_mib"] for r in ranks],
                "loss": mine["loss"],
                "compute_dtype": ",".join(sorted(dtypes)),
            }
            Path(args.out).write_text(json.dumps(result))
        shutdown_distributed()
        # gloo process groups that reference cycles (the device mesh's) keep until interpreter
        # exit sometimes abort it there ("terminate called without an active exception")
        gc.collect()
    except BaseException:
        # torchrun's own report buries the exception; the parent shows this file instead
        Path(f"{args.out}.rank{world.rank}.error").write_text(traceback.format_exc())
        raise


def forwarded_flags(args) -> list[str]:
    """The flags a worker needs to build the same model, batch and steps."""
    flags = [
        f"--model={args.model}",
        f"--seq-len={args.seq_len}",
        f"--batch={args.batch}",
        f"--steps={args.steps}",
        f"--warmup={args.warmup}",
        f"--device={args.device}",
        f"--dtype={args.dtype}",
        f"--timeout={args.timeout}",
    ]
    flags += [f"--set={item}" for item in args.set]
    return flags + (["--compile"] if args.compile else [])


def launch(layout: dict, args, workdir: Path) -> dict:
    """Run one layout under torchrun; its rank-0 result, or {"error": ...}."""
    out = workdir / f"{layout['name']}.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={layout['world']}",
        __file__,
        f"--worker={json.dumps(layout)}",
        f"--out={out}",
        *forwarded_flags(args),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(layout["threads"])}
    # a session of its own, so a timeout ends torchrun and every rank it started
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        log, _ = proc.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        return {"error": f"timed out after {args.timeout} s", "log": log}
    if proc.returncode == 0 and out.exists():
        return json.loads(out.read_text())
    errors = sorted(workdir.glob(f"{out.name}.rank*.error"))
    if errors:
        trace = errors[0].read_text().strip().splitlines()
        # the exception line and what follows it (a LayoutError lists its problems below)
        tops = [i for i, line in enumerate(trace) if not line.startswith((" ", "Traceback"))]
        start = tops[-1] if tops else 0
        message = " ".join(line.strip() for line in trace[start:])
        message = re.sub(r"^[\w.]+\.(?=\w+: )", "", message)  # LayoutError, not its module path
        return {"error": message, "log": errors[0].read_text()}
    return {"error": f"torchrun exited {proc.returncode}", "log": log}


# ---------------------------------------------------------------- report
def peak_flops(args) -> float | None:
    """--peak-tflops, else the GPU's peak dense bf16 FLOP/s as training's MFU takes it."""
    from llmtrain.train_loop.builtin_callbacks import peak_flops as known_peak

    return known_peak(args.peak_tflops or None, torch.device("cuda"))


def finish(row: dict, args, reference: dict, fpt: float, peak: float | None) -> dict:
    """Add tokens/s, the ratio to the reference and MFU to a result that ran."""
    if "error" in row:
        return row
    row["tokens_per_s"] = args.batch * args.seq_len / statistics.median(row["step_s"])
    if "tokens_per_s" in reference:
        row["ratio"] = row["tokens_per_s"] / reference["tokens_per_s"]
    if peak:
        row["mfu"] = fpt * row["tokens_per_s"] / (row["world"] * peak)
    return row


def memory_cell(peaks: list[float], unit: float) -> str:
    values = [round(p / unit) if unit == 1 else round(p / unit, 1) for p in peaks]
    if len(values) <= 4:
        return " / ".join(str(v) for v in values)
    return f"{min(values)} - {max(values)}"


def note_for(row: dict, args) -> str:
    notes = []
    if args.dtype == "bf16" and row.get("compute_dtype", "bfloat16") != "bfloat16":
        notes.append(f"bf16 requested, logits in {row['compute_dtype']}")
    if args.device == "cpu" and row["world"] > args.threads:
        notes.append(f"{row['world']} processes on {args.threads} cores")
    return "; ".join(notes)


def table_cells(row: dict, args, unit: float) -> list[str]:
    """The row's cells, the last one (mesh, notes or the error) free-width."""
    cuda = args.device == "cuda"
    if "error" in row:
        return [
            row["name"],
            str(row["world"]),
            *["-"] * (5 if cuda else 4),
            f"FAILED: {row['error']}",
        ]
    cells = [
        row["name"],
        str(row["world"]),
        f"{row['tokens_per_s']:,.0f}",
        f"{row['ratio']:.3f}" if "ratio" in row else "-",
        memory_cell(row["peak_mib"], unit),
        f"{row['loss']:.4f}",
    ]
    if cuda:
        cells.append(f"{row['mfu']:.1%}" if "mfu" in row else "-")
    return [*cells, "; ".join(filter(None, [row.get("detail", ""), note_for(row, args)]))]


def print_table(rows: list[dict], args) -> None:
    cuda = args.device == "cuda"
    unit, mem_label = (1024, "peak GiB/rank") if cuda else (1, "peak MiB/rank")
    head = ["layout", "world", "tokens/s", "ratio", mem_label, "loss"]
    head += ["MFU", "mesh / note"] if cuda else ["mesh / note"]
    lines = [head, *(table_cells(row, args, unit) for row in rows)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(head) - 1)]
    for line in lines:
        fixed = [line[0].ljust(widths[0])]
        fixed += [cell.rjust(width) for cell, width in zip(line[1:-1], widths[1:], strict=True)]
        print("  ".join([*fixed, line[-1]]))
    goal = next((r for r in rows if r["name"] == "fsdp1" and "mfu" in r), None)
    if goal and args.model == "llama-1b" and args.dtype == "bf16" and args.compile:
        verdict = "ok" if goal["mfu"] >= GOAL_MFU else "MISS"
        print(f"goal: fsdp1 MFU >= {GOAL_MFU:.0%}: {goal['mfu']:.1%} {verdict}")
    bases = [base for row in rows for base in row.get("base_mib", [])]
    if bases and not cuda:
        print(
            f"peak RSS includes what a process holds before the model (python, torch, process "
            f"group): {min(bases):.0f}-{max(bases):.0f} MiB here"
        )


# ---------------------------------------------------------------- main
def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layouts", default=DEFAULT_LAYOUTS, help="comma-separated, see above")
    p.add_argument("--nproc", type=int, default=2, help="world size of a layout without one")
    p.add_argument("--microbatches", type=int, default=4, help="per step, pipeline layouts")
    p.add_argument("--model", default="tiny", help="a preset of llmtrain.models")
    p.add_argument("--set", action="append", default=[], help="model option, e.g. n_layers=8")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=8, help="global batch, in sequences")
    p.add_argument("--steps", type=int, default=10, help="timed steps, after the warmup")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="CPU: in all")
    p.add_argument("--peak-tflops", type=float, help="for MFU (default: by GPU name)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per layout")
    p.add_argument("--json", help="also write the results to this file")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # a layout, as JSON: run it (torchrun)
    p.add_argument("--out", help=argparse.SUPPRESS)  # where the worker's rank 0 writes
    args = p.parse_args()
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    return args


def main() -> int:
    args = parse_args()
    if args.worker:
        worker(args, json.loads(args.worker))
        return 0
    try:
        layouts = [parse_layout(name.strip(), args) for name in args.layouts.split(",")]
    except ValueError as e:
        sys.exit(f"--layouts: {e}")
    if any(layout["mesh"].get("pp", 1) > 1 for layout in layouts):
        # a pipeline cannot cut an output layer that shares the embedding's weight; every layout
        # and the reference get the same model
        if "tied_embeddings" not in model_overrides(args):
            args.set.append("tied_embeddings=false")

    from llmtrain.models.transformer import build_model

    with torch.device("meta"):
        described = build_model(model_config(args)).describe()
    fpt = described.flops_per_token(args.seq_len)
    peak = peak_flops(args) if args.device == "cuda" else None
    overrides = ", ".join(f"{k}={v}" for k, v in model_overrides(args).items())
    print(
        f"model={args.model} ({overrides}) params={described.n_params:,} seq_len={args.seq_len} "
        f"batch={args.batch} steps={args.steps} after {args.warmup} warmup"
    )
    threads = (
        f" threads={args.threads} (split over a layout's ranks)" if args.device == "cpu" else ""
    )
    flops = f" peak={peak / 1e12:.0f} TFLOP/s" if peak else ""
    print(f"device={args.device} dtype={args.dtype} compile={args.compile}{threads}{flops}")
    if args.device == "cuda" and not peak:
        print(f"MFU: no peak FLOP/s known for {torch.cuda.get_device_name()}; pass --peak-tflops")

    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    reference = {"name": "bare", "world": 1, "detail": "plain PyTorch, one process"}
    try:
        reference.update(bare(args, device))
    except (RuntimeError, ValueError) as e:  # out of memory, compile errors, a bad shape
        reference["error"] = f"{type(e).__name__}: {e}"
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the layouts share this GPU; hand back what the reference held
    rows = [finish(reference, args, reference, fpt, peak)]
    failed = "error" in reference
    with tempfile.TemporaryDirectory(prefix="bench_parallel_") as tmp:
        for layout in layouts:
            row = {"name": layout["name"], "world": layout["world"]}
            row["detail"] = describe_layout(layout)
            gpus = torch.cuda.device_count() if args.device == "cuda" else None
            if gpus is not None and layout["world"] > gpus:
                row["error"] = f"needs {layout['world']} GPUs, {gpus} visible"
            else:
                row.update(launch(layout, args, Path(tmp)))
            if "error" in row:
                failed = True
                print(f"--- {row['name']} failed:\n{row.get('log', '')[-4000:]}", file=sys.stderr)
            rows.append(finish(row, args, reference, fpt, peak))
    print_table(rows, args)
    if args.json:
        for row in rows:
            row.pop("log", None)
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": rows}, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
