"""The GPU kit's steps, in the order runner.py runs them: each a list of commands, a time
budget, and where its figures come from; every step has a GPU form and a CPU dry-run form."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import side_by_side as sbs
import yaml

GOAL_RATIO = 0.97  # tokens/s of `llmtrain run` against the bare loop
GOAL_MOE_RATIO = 0.6  # MoE MFU against a dense model of equal active FLOPs (issue 39)
# plugins bundle.sh leaves out (their third-party stacks serve no GPU check); keep in step
LEFT_OUT_PLUGINS = {"llmtrain-lmeval", "llmtrain-wandb"}
HERE = Path(__file__).resolve().parent


@dataclass
class Context:
    root: Path
    work: Path
    python: str
    dry: bool
    out: Path | None = None  # the report's folder: what a step leaves there comes back
    bundle: Path | None = None
    gpus: int = 0  # CUDA devices on this machine (a multi-GPU step is skipped with fewer)

    site = property(lambda self: self.work / "site")
    logs = property(lambda self: self.work / "logs")
    configs = property(lambda self: self.work / "configs")
    runs = property(lambda self: self.work / "runs")
    data = property(lambda self: self.work / "data" / "train.zarr")


@dataclass
class Step:
    name: str
    measures: str
    commands: list[list[str]]
    budget_s: int
    figures: Callable[[], dict] | None = None
    skip: str = ""
    # where set, the commands are checks only (a dry run that cannot start the step here): once
    # they pass the step is reported skipped, with this reason
    checks_only: str = ""
    keep: list[Path] = field(default_factory=list)  # files copied to <out>/<step>/ once it ran


def bundled_plugins() -> list[Path]:
    root = Path(__file__).resolve().parents[2]
    folders = sorted(p.parent for p in (root / "plugins").glob("*/pyproject.toml"))
    return [p for p in folders if p.name not in LEFT_OUT_PLUGINS]


def broken(step: Step) -> Step:
    """The step with a first command that fails: how the tests check that a failure is reported
    with its tail and costs the steps after it nothing."""
    fail = [
        "python3",
        "-c",
        f"import sys; print('{step.name} made to fail by --break'); sys.exit(3)",
    ]
    return replace(step, commands=[fail, *step.commands], skip="")


# ------------------------------------------------------------------------------ run configs
def run_config(ctx: Context, name: str, model: dict, shape: tuple[int, int, int], **extra) -> dict:
    """`shape`: (steps, seq_len, micro_batch); one process, no eval, no checkpoints."""
    steps, seq_len, micro_batch = shape
    return {
        "name": name,
        "seed": 0,
        "run_dir": str(ctx.runs),
        "device": "cpu" if ctx.dry and name.startswith("cpu-") else "cuda",
        "model": {**model, "max_seq_len": seq_len},
        "data": {
            "train": [{"path": str(ctx.data)}],
            "seq_len": seq_len,
            "micro_batch": micro_batch,
        },
        "optimizer": {"kind": "adamw", "lr": 3e-4},
        "training": {"steps": steps, "log_every": max(1, min(10, steps // 4))},
        "checkpoint": {"resume": "never"},
        "loggers": [{"kind": "console"}, {"kind": "jsonl"}],
        **extra,
    }


def write_config(ctx: Context, config: dict) -> Path:
    path = ctx.configs / f"{config['name']}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def bf16(compile_: bool = True, **options) -> dict:
    return {
        "parallel": {"kind": "default", "compile": compile_, "param_dtype": "bfloat16", **options}
    }


TINY = {"kind": "tiny", "vocab_size": 320}
CPU_SHAPE = (2, 32, 2)


def llmtrain_run(ctx: Context, name: str, model: dict, shape, cpu_model: dict, **extra) -> list:
    """GPU: run the config. Dry run: validate the GPU config as written, then run two steps of
    a tiny model on CPU through the same command (the GPU-only options dropped)."""
    gpu = write_config(ctx, run_config(ctx, name, model, shape, **extra))
    llmtrain = [ctx.python, "-m", "llmtrain"]
    if not ctx.dry:
        return [[*llmtrain, "run", str(gpu)]]
    cpu_extra = {k: v for k, v in extra.items() if k != "parallel"}
    cpu = write_config(ctx, run_config(ctx, f"cpu-{name}", cpu_model, CPU_SHAPE, **cpu_extra))
    return [[*llmtrain, "config", "validate", str(gpu)], [*llmtrain, "run", str(cpu)]]


def run_figures(ctx: Context, name: str) -> Callable[[], dict]:
    """From the run's metrics.jsonl: median tokens/s and MFU over the logged windows after the
    first (compilation happens in it), the last loss; for the side-by-side also their means
    over the windows TorchTitan's summary averages (ending at step >= 20), peak allocated and
    reserved memory."""

    def read() -> dict:
        run = f"cpu-{name}" if ctx.dry else name
        lines = (ctx.runs / run / "metrics.jsonl").read_text().splitlines()
        metrics = [m for m in map(json.loads, lines) if "tokens_per_s" in m]
        timed = metrics[1:] or metrics
        figures = {"tokens_per_s": statistics.median(m["tokens_per_s"] for m in timed)}
        if all("mfu" in m for m in timed):
            figures["mfu"] = statistics.median(m["mfu"] for m in timed)
        steady = [m for m in metrics if m["step"] >= sbs.STEADY_FROM] or timed
        figures["steady_tokens_per_s"] = statistics.mean(m["tokens_per_s"] for m in steady)
        if all("mfu" in m for m in steady):
            figures["steady_mfu"] = statistics.mean(m["mfu"] for m in steady)
        for key, figure in (
            ("peak_memory_mib", "peak_gib"),
            ("reserved_memory_mib", "reserved_gib"),
        ):
            if any(key in m for m in metrics):
                figures[figure] = max(m.get(key, 0) for m in metrics) / 1024
        figures.update(last_loss=metrics[-1].get("loss"), windows=len(timed))
        summary = ctx.runs / run / "summary.json"
        if summary.is_file():  # what the MFU counts: the active parameters' FLOPs per token
            done = json.loads(summary.read_text())
            figures.update(flops_per_token=done.get("flops_per_token"), params=done.get("params"))
        return figures

    return read


def json_figures(path: Path, pick: Callable[[dict], dict]) -> Callable[[], dict]:
    return lambda: pick(json.loads(path.read_text()))


def printed_json(log: Path, pick: Callable[[dict], dict]) -> Callable[[], dict]:
    """The JSON a script printed after its table (bench_model.py --json)."""

    def read() -> dict:
        text = log.read_text()
        start = text.index("\n{") + 1
        return pick(json.JSONDecoder().raw_decode(text[start:])[0])

    return read


def bench_model_figures(doc: dict) -> dict:
    """Per config: our ratio to the plain-PyTorch reference, and our MFU on CUDA."""
    figures = {}
    for row in doc["results"]:
        figures[f"{row['config']}_ratio"] = row.get("ratio")
        if "mfu" in row:
            figures[f"{row['config']}_mfu"] = row["mfu"]["ours"]
    return figures


def bench_parallel_figures(doc: dict) -> dict:
    """Per layout row (the bare loop and fsdp1): tokens/s, ratio, MFU, or its error."""
    keys = ("tokens_per_s", "ratio", "mfu", "error")
    return {f"{row['name']}_{k}": row[k] for row in doc["results"] for k in keys if k in row}


# ------------------------------------------------------------------------------ the steps
def plan(ctx: Context, install: list[str], bundle: str) -> list[Step]:
    return [
        Step("install", f"installs the bundle ({bundle}) into {ctx.site}", [install], 180),
        data_step(ctx),
        gpu_tests(ctx),
        bench_model(ctx),
        bench_parallel(ctx),
        gpt2_run(ctx),
        # the cost of the host reads a step made before (debug.host_syncs), small model first
        gpt2_run(ctx, syncs=True),
        float8_run(ctx),
        moe_run(ctx),
        # MoE at a realistic shape against a dense model of the same active FLOPs per token
        moe_olmoe(ctx),
        dense_olmoe_active(ctx),
        moe_ep2(ctx),
        deterministic(ctx),
        # the side-by-side with TorchTitan (side_by_side.ROWS): each of our runs comes after
        # the TorchTitan run it is compared with, and the b4 variants after plain b4
        torchtitan(ctx, 4),
        llama_side(ctx, 4),
        llama_side(ctx, 4, "docmask"),
        llama_side(ctx, 4, "float8"),
        llama_side(ctx, 4, "syncs"),
        torchtitan(ctx, 8),
        llama_side(ctx, 8),
        # long context (issue 50), each variant after the run its ratio is taken against
        llama_long(ctx),
        llama_long(ctx, window=True),
        llama_cp2(ctx),
        llama_cp2(ctx, doc_masking=True),
        bare_loop(ctx),
        profile_side(ctx),
    ]


def data_step(ctx: Context) -> Step:
    """A generated corpus packed with the bytes tokenizer: the GPU machine has no network."""
    corpus = ctx.data.with_name("corpus.jsonl")
    documents = "300" if ctx.dry else "6000"
    make = [
        ctx.python,
        str(ctx.root / "tools" / "make_corpus.py"),
        str(corpus),
        "--documents",
        documents,
    ]
    pack = [ctx.python, "-m", "llmtrain", "data", "pack", str(corpus), "-o", str(ctx.data)]
    pack += ["--tokenizer", "bytes", "--overwrite", "--no-progress", "--workers", "2"]
    return Step("data", "a generated corpus packed with the bytes tokenizer", [make, pack], 240)


def gpu_tests(ctx: Context) -> Step:
    pytest = [
        ctx.python,
        "-m",
        "pytest",
        "integration_tests",
        "-m",
        "gpu",
        "-q",
        "-p",
        "no:cacheprovider",
    ]
    pytest += ["--basetemp", str(ctx.work / "pytest")]
    if ctx.dry:
        pytest.append("--collect-only")
    return Step(
        "gpu-tests",
        "the gpu-marked tests: nccl mesh, bf16 layouts, OOM snapshot, CUDA memory metrics, profiles",
        [pytest],
        360,
    )


def bench_model(ctx: Context) -> Step:
    script = [ctx.python, str(ctx.root / "tools" / "bench_model.py"), "--json"]
    if ctx.dry:
        script += [
            "--device",
            "cpu",
            "--config",
            "smoke",  # parses and starts: a 2-layer model, not gpt2-small's 17 s on CPU
            "--steps",
            "1",
            "--warmup",
            "1",
            "--rounds",
            "1",
        ]
    else:
        script += ["--device", "cuda", "--dtype", "bf16", "--compile", "--config", "large"]
    return Step(
        "bench-model",
        "forward+backward tokens/s of our Transformer vs a plain-PyTorch one (gpt2-124m, llama-1b; goal >= 0.97), MFU",
        [script],
        240,
        printed_json(ctx.logs / "bench-model.log", bench_model_figures),
    )


def bench_parallel(ctx: Context) -> Step:
    out = ctx.work / "bench_parallel.json"
    script = [
        ctx.python,
        str(ctx.root / "tools" / "bench_parallel.py"),
        "--layouts",
        "fsdp1",
        "--json",
        str(out),
    ]
    if ctx.dry:
        script += [
            "--device",
            "cpu",
            "--model",
            "tiny",
            "--seq-len",
            "32",
            "--batch",
            "2",
            "--steps",
            "1",
            "--warmup",
            "1",
        ]
    else:
        script += [
            "--device",
            "cuda",
            "--model",
            "llama-1b",
            "--compile",
            "--dtype",
            "bf16",
            "--seq-len",
            "2048",
            "--batch",
            "4",
        ]
    return Step(
        "bench-parallel",
        "a whole training step of llama-1b, fsdp1 + compile + bf16, vs a bare loop (goal: MFU >= 45%)",
        [script],
        330,
        json_figures(out, bench_parallel_figures),
    )


def gpt2_run(ctx: Context, syncs: bool = False) -> Step:
    """gpt2-124m, where a step's launch overhead weighs most; `syncs`: with `debug.host_syncs`,
    the host reads each step made before it kept its numbers on the device (side-by-side row)."""
    name = "gpt2-syncs" if syncs else "gpt2-bf16"
    extra = {"debug": {"host_syncs": True}} if syncs else {}
    commands = llmtrain_run(
        ctx, name, {"kind": "gpt2-124m"}, (60, 1024, 16), TINY, **bf16(), **extra
    )
    return Step(
        name if syncs else "gpt2-run",
        "`llmtrain run` gpt2-124m, bf16 + compile"
        + (", debug.host_syncs (a step's reads as before)" if syncs else "")
        + ": tokens/s and MFU from metrics.jsonl",
        [with_env(our_env(ctx), c) for c in commands],
        300,
        run_figures(ctx, name),
        keep=[ctx.runs / (f"cpu-{name}" if ctx.dry else name) / "metrics.jsonl"],
    )


def float8_run(ctx: Context) -> Step:
    commands = llmtrain_run(
        ctx, "gpt2-float8", {"kind": "gpt2-124m"}, (60, 1024, 16), TINY, **bf16(float8=True)
    )
    if ctx.dry:  # float8 cannot start on CPU: the config validates and the module loads
        probe = "from llmtrain.parallel.float8 import float8_problem; print(float8_problem('cuda'))"
        commands = [commands[0], [ctx.python, "-c", probe]]
    return Step(
        "float8-run",
        "the same gpt2-124m run with parallel.float8 (torchao)",
        commands,
        300,
        None if ctx.dry else run_figures(ctx, "gpt2-float8"),
    )


def moe_run(ctx: Context) -> Step:
    model = {"kind": "moe-small", "expert_matmul": "grouped"}
    tiny = {"kind": "moe-tiny", "expert_matmul": "loop"}
    commands = llmtrain_run(ctx, "moe-grouped", model, (40, 1024, 8), tiny, **bf16(compile_=False))
    return Step(
        "moe-run",
        "llmtrain-moe's moe-small on the grouped-matmul path (bf16)",
        commands,
        300,
        run_figures(ctx, "moe-grouped"),
    )


# OLMoE-1B-7B's layer (d_model 2048, 16 heads, 64 experts of SwiGLU hidden 1024, top-8, vocab
# 50304) at 4 of its 16 layers: with fp32 AdamW states the whole model (6.9B parameters, ~110
# GB) fits no 80 GB H100; 4 layers are 1.9B parameters, which `llmtrain estimate` puts at 40 GiB
# at seq 2048 x 4 (7 GiB of activations). The dense model has the same attention, embeddings and
# layers, and one SwiGLU MLP of hidden top_k x 1024 = 8192: the same active FLOPs per token (the
# router's d_model x 64 per layer aside, 0.2% of them).
OLMOE_LAYERS = 4
OLMOE = {"kind": "olmoe-1b-7b", "n_layers": OLMOE_LAYERS, "expert_matmul": "grouped"}
DENSE_OLMOE = {
    "kind": "transformer",
    "vocab_size": 50304,
    "d_model": 2048,
    "n_layers": OLMOE_LAYERS,
    "n_heads": 16,
    "n_kv_heads": 16,
    "mlp": "swiglu",
    "mlp_hidden": 8 * 1024,
    "positions": "rope",
    "norm": "rmsnorm",
    "bias": False,
    "qk_norm": True,
    "qk_norm_scope": "all_heads",
    "tied_embeddings": False,
}
# the same pair at CPU size: olmoe-tiny (d 64, 4 heads, 16 experts of hidden 32, top-4)
OLMOE_TINY = {"kind": "olmoe-tiny", "expert_matmul": "loop"}
DENSE_OLMOE_TINY = {
    **DENSE_OLMOE,
    "vocab_size": 320,
    "d_model": 64,
    "n_layers": 2,
    "n_heads": 4,
    "n_kv_heads": 4,
    "mlp_hidden": 4 * 32,
}
OLMOE_SHAPE = (40, 2048, 4)  # steps, seq_len, micro-batch: logged every 10, 3 timed windows
# the dry run's CPU runs log an MFU against a nominal peak, so the report's ratio is computed
CPU_PEAK_TFLOPS = 1.0


def olmoe_step(ctx: Context, name: str, model: dict, cpu_model: dict, measures: str) -> Step:
    commands = llmtrain_run(ctx, name, model, OLMOE_SHAPE, cpu_model, **bf16())
    if ctx.dry:
        nominal_peak(ctx, f"cpu-{name}")
    return Step(
        name,
        measures,
        [with_env(our_env(ctx), c) for c in commands],
        {"moe-olmoe": 300, "dense-olmoe-active": 210}[name],
        run_figures(ctx, name),
        keep=[ctx.runs / (f"cpu-{name}" if ctx.dry else name) / "metrics.jsonl"],
    )


def nominal_peak(ctx: Context, name: str) -> None:
    """Give a written CPU config `training.peak_tflops`, so its run logs an MFU."""
    path = ctx.configs / f"{name}.yaml"
    config = yaml.safe_load(path.read_text())
    config["training"]["peak_tflops"] = CPU_PEAK_TFLOPS
    path.write_text(yaml.safe_dump(config, sort_keys=False))


def moe_olmoe(ctx: Context) -> Step:
    return olmoe_step(
        ctx,
        "moe-olmoe",
        OLMOE,
        OLMOE_TINY,
        f"llmtrain-moe's olmoe-1b-7b at {OLMOE_LAYERS} of its 16 layers (the whole model with "
        "fp32 AdamW states fits no 80 GB GPU), grouped experts, bf16 + compile, one process, "
        "seq 2048 x 4: tokens/s and MFU on active parameters",
    )


def dense_olmoe_active(ctx: Context) -> Step:
    return olmoe_step(
        ctx,
        "dense-olmoe-active",
        DENSE_OLMOE,
        DENSE_OLMOE_TINY,
        "a dense transformer with moe-olmoe's active FLOPs per token (its layers, attention and "
        "embeddings; one SwiGLU MLP of hidden top-8 x 1024 = 8192), bf16 + compile: MFU, the "
        f"reference of moe-olmoe's (goal: MoE MFU >= {GOAL_MOE_RATIO} of it)",
    )


def two_rank_commands(
    ctx: Context, gpu: Path, cpu_model: dict, name: str, mesh: dict
) -> list[list[str]]:
    """`llmtrain run` of the config at `gpu` under torchrun on 2 GPUs; in the dry run, that
    config validated and `cpu_model` run the same way on CPU (gloo, 2 processes)."""
    torchrun = [ctx.python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    llmtrain = [*torchrun, "-m", "llmtrain"]
    if not ctx.dry:
        return [with_env(our_env(ctx), [*llmtrain, "run", str(gpu)])]
    cpu = run_config(ctx, f"cpu-{name}", cpu_model, CPU_SHAPE, mesh=mesh)
    cpu["training"]["peak_tflops"] = CPU_PEAK_TFLOPS
    validate = [ctx.python, "-m", "llmtrain", "config", "validate", str(gpu)]
    run = [*llmtrain, "run", str(write_config(ctx, cpu))]
    return [validate, with_env({"OMP_NUM_THREADS": 1}, run)]


def moe_ep2(ctx: Context) -> Step:
    """moe-olmoe with expert parallelism over 2 GPUs (mesh dp_shard 2, ep 2: each rank holds 32
    of every layer's 64 experts) under torchrun; skipped on a machine with fewer GPUs. The dry
    run starts olmoe-tiny that way on CPU (gloo, 2 processes)."""
    name = "moe-ep2"
    mesh = {"dp_shard": 2, "ep": 2}
    gpu = write_config(ctx, run_config(ctx, name, OLMOE, OLMOE_SHAPE, mesh=mesh, **bf16()))
    commands = two_rank_commands(ctx, gpu, OLMOE_TINY, name, mesh)
    skip = ""
    if not ctx.dry and ctx.gpus < 2:
        skip = f"expert parallelism needs 2 GPUs; this machine has {ctx.gpus}"
    return Step(
        name,
        "moe-olmoe's model with expert parallelism, mesh dp_shard 2 x ep 2 (32 experts of 64 "
        "per GPU), torchrun on 2 GPUs, bf16 + compile: tokens/s and MFU per GPU",
        commands,
        300,
        run_figures(ctx, name),
        skip=skip,
        keep=[ctx.runs / (f"cpu-{name}" if ctx.dry else name) / "metrics.jsonl"],
    )


def deterministic(ctx: Context) -> Step:
    """Two runs of one config with debug.deterministic: bitwise the same losses."""
    model = {"kind": "gpt2-124m", "n_layers": 4}
    names = ("deterministic-a", "deterministic-b")
    commands = []
    for name in names:
        commands += llmtrain_run(
            ctx,
            name,
            model,
            (10, 512, 8),
            TINY,
            debug={"deterministic": True},
            **bf16(compile_=False),
        )
    run = "cpu-{}" if ctx.dry else "{}"
    dirs = [str(ctx.runs / run.format(n)) for n in names]
    commands.append([ctx.python, str(Path(__file__).with_name("same_losses.py")), *dirs])
    return Step(
        "deterministic", "debug.deterministic: two runs give bitwise the same losses", commands, 300
    )


# the side-by-side's workload: 40 steps of seq 2048, as llama3_1b.toml's; logged every 10 steps
SIDE_STEPS = 40
LLAMA_SHAPE = (SIDE_STEPS, sbs.SEQ_LEN, 4)  # steps, seq_len, batch: what the bare loop repeats


def with_env(env: dict, command: list) -> list:
    """The command under `env`, so the report's command line shows what it was given."""
    return ["env", *(f"{k}={v}" for k, v in env.items()), *command]


def our_env(ctx: Context) -> dict:
    """One Inductor and Triton cache for all our runs: the b4 variants share the b4 shapes and
    start warmer (compilation is outside the timed windows either way); the allocator setting
    is the one run_tt.sh gives TorchTitan, so peak memory compares like with like."""
    return {
        "TORCHINDUCTOR_CACHE_DIR": ctx.work / "inductor-cache",
        "TRITON_CACHE_DIR": ctx.work / "triton-cache",
        "PYTORCH_ALLOC_CONF": "expandable_segments:True",
    }


def llama_side(ctx: Context, batch: int, variant: str = "") -> Step:
    """Our llama-1b (tied, bf16 + per-block compile) on the side-by-side's shape at `batch`;
    `variant` "docmask" adds model.doc_masking, "float8" parallel.float8, "syncs"
    debug.host_syncs (the host reads each step made before it kept its numbers on the device)."""
    name = f"llama-b{batch}" + (f"-{variant}" if variant else "")
    model, cpu_model, parallel = {"kind": "llama-1b"}, TINY, bf16()
    if variant == "docmask":
        model, cpu_model = {**model, "doc_masking": True}, {**TINY, "doc_masking": True}
    elif variant == "float8":
        parallel = bf16(float8=True)
    extra = {"debug": {"host_syncs": True}} if variant == "syncs" else {}
    shape = (SIDE_STEPS, sbs.SEQ_LEN, batch)
    commands = llmtrain_run(ctx, name, model, shape, cpu_model, **parallel, **extra)
    if ctx.dry and variant == "float8":  # float8 cannot start on CPU: validate, load the module
        probe = "from llmtrain.parallel.float8 import float8_problem; print(float8_problem('cuda'))"
        commands = [commands[0], [ctx.python, "-c", probe]]
    run = f"cpu-{name}" if ctx.dry else name
    described = {
        "": "",
        "docmask": ", model.doc_masking",
        "float8": ", parallel.float8",
        "syncs": ", debug.host_syncs",
    }[variant]
    return Step(
        name,
        f"`llmtrain run` llama-1b, batch {batch}{described}, seq 2048, bf16 + compile, "
        f"{SIDE_STEPS} steps: tokens/s, MFU, peak memory (side-by-side)",
        [with_env(our_env(ctx), c) for c in commands],
        {4: 240, 8: 270}[batch],
        None if ctx.dry and variant == "float8" else run_figures(ctx, name),
        keep=[ctx.runs / run / "metrics.jsonl"],
    )


# long context (issue 50): llama-1b at seq 8192, every block local (window 1024) against full
# causal attention on one GPU, and context parallelism over 2 GPUs with document masking against
# without. Micro-batch 2 is llama-b8's 16,384 tokens a step, which measured 38.6 GiB reserved on
# an H100 (flash and FlexAttention keep no T x T scores, so seq 8192 x 2 takes about what
# 2048 x 8 does); `llmtrain estimate`, which overcounts (43 GiB for llama-b4's 28.6 measured),
# puts it at 68 GiB, a cp rank at 35 GiB. 40 steps, logged every 10, as the side-by-side's.
LONG_SEQ = 8192
WINDOW = 1024
LONG_SHAPE = (SIDE_STEPS, LONG_SEQ, 2)  # steps, seq_len, micro-batch
CPU_WINDOW = 8  # the dry run's window: a quarter of its seq 32
# the report's long-context ratios (runner.long_context): (label, step, its reference)
LONG_PAIRS = (
    (
        f"window {WINDOW} / full causal (seq {LONG_SEQ}, one GPU)",
        "llama-window-8k",
        "llama-causal-8k",
    ),
    (
        f"cp=2 doc masking / cp=2 causal (seq {LONG_SEQ}, 2 GPUs)",
        "llama-cp2-docmask",
        "llama-cp2-8k",
    ),
)


def llama_long(ctx: Context, window: bool = False) -> Step:
    """llama-1b at seq 8192 x 2, bf16 + per-block compile, one process; `window`: every block
    local, `model.attention: {window: 1024}`. Dry run: the tiny model at seq 32 (window 8), a
    nominal peak so its MFU is logged."""
    name = "llama-window-8k" if window else "llama-causal-8k"
    model, cpu_model = {"kind": "llama-1b"}, dict(TINY)
    if window:
        model["attention"] = {"window": WINDOW}
        cpu_model["attention"] = {"window": CPU_WINDOW}
    commands = llmtrain_run(ctx, name, model, LONG_SHAPE, cpu_model, **bf16())
    if ctx.dry:
        nominal_peak(ctx, f"cpu-{name}")
    attention = f"every block local, window {WINDOW}" if window else "full causal attention"
    return Step(
        name,
        f"`llmtrain run` llama-1b, {attention}, seq {LONG_SEQ} x 2, bf16 + compile, "
        f"{SIDE_STEPS} steps, one GPU: tokens/s, MFU (the model's FLOPs: a local block counts "
        f"min(T, window) keys per query), peak memory"
        + ("; ratio to llama-causal-8k" if window else ""),
        [with_env(our_env(ctx), c) for c in commands],
        180,
        run_figures(ctx, name),
        keep=[ctx.runs / (f"cpu-{name}" if ctx.dry else name) / "metrics.jsonl"],
    )


def llama_cp2(ctx: Context, doc_masking: bool = False) -> Step:
    """llama-1b at seq 8192 x 2 with context parallelism, `mesh: {cp: 2}` (each rank holds 4096
    tokens of every sequence), under torchrun on 2 GPUs, bf16 + compile; `doc_masking`: with
    model.doc_masking. Skipped on a machine with fewer GPUs. The dry run starts the tiny model
    that way on CPU (gloo, 2 processes, seq 32)."""
    name = "llama-cp2-docmask" if doc_masking else "llama-cp2-8k"
    model, cpu_model = {"kind": "llama-1b"}, dict(TINY)
    if doc_masking:
        model["doc_masking"] = cpu_model["doc_masking"] = True
    mesh = {"cp": 2}
    gpu = write_config(ctx, run_config(ctx, name, model, LONG_SHAPE, mesh=mesh, **bf16()))
    commands = two_rank_commands(ctx, gpu, cpu_model, name, mesh)
    skip = ""
    if not ctx.dry and ctx.gpus < 2:
        skip = f"context parallelism over 2 GPUs; this machine has {ctx.gpus}"
    return Step(
        name,
        f"`llmtrain run` llama-1b, mesh cp 2, {'model.doc_masking' if doc_masking else 'causal'}"
        f", seq {LONG_SEQ} x 2, torchrun on 2 GPUs, bf16 + compile, {SIDE_STEPS} steps: "
        "tokens/s, MFU per GPU, peak memory" + ("; ratio to llama-cp2-8k" if doc_masking else ""),
        commands,
        240,
        run_figures(ctx, name),
        skip=skip,
        keep=[ctx.runs / (f"cpu-{name}" if ctx.dry else name) / "metrics.jsonl"],
    )


# what run_tt.sh needs of the Python that runs it (it installs with pip and imports triton
# first); the GPU image has them all, a CPU dry run needs a Python that has them too (TT_PYTHON)
TT_PYTHON_NEEDS = ("pip", "torch", "triton", "numpy", "pandas", "pyarrow", "tokenizers", "einops")


def lacking(python: str, modules: tuple[str, ...]) -> list[str]:
    probe = (
        "import importlib.util as u, sys; print(*[m for m in sys.argv[1:] if not u.find_spec(m)])"
    )
    proc = subprocess.run([python, "-c", probe, *modules], capture_output=True, text=True)
    return proc.stdout.split() if proc.returncode == 0 else [f"a working {python}"]


def torchtitan(ctx: Context, batch: int, name: str = "", more: tuple[str, ...] = ()) -> Step:
    """TorchTitan 0.2.2 on our llama-1b shape, tied (TT_TIE=1), seq 2048 x `batch`, 40 steps,
    through the anchor's run_tt.sh from the bundle; its tt.log and tt_full.log land in
    <out>/<name>/ (name: torchtitan-b<batch>); `more`: further TorchTitan overrides (GPU only).
    Dry run: TorchTitan's own loop on CPU (cpu_smoke_train.py), the tiny flavor, seq 256 x 2,
    two steps, compile off (compiling it on CPU takes minutes)."""
    name = name or f"torchtitan-b{batch}"
    bundled = (ctx.bundle or ctx.root / ".gpu-bundle") / "torchtitan"
    out = (ctx.out or ctx.work) / name
    python = os.environ.get("TT_PYTHON", ctx.python) if ctx.dry else ctx.python
    check = [ctx.python, str(HERE / "side_by_side.py"), "check-torchtitan", str(bundled)]
    knobs = {
        "TT_TIE": "1",
        "TT_WORK": ctx.work / name,  # run_tt.sh empties it first
        "TT_SITE": ctx.work / "tt-site",
        "OUT": out,
        "PYTHON": python,
    }
    overrides = ["--training.local_batch_size", str(batch), "--training.seq_len"]
    overrides += [str(sbs.SEQ_LEN), "--training.steps", str(SIDE_STEPS), *more]
    commands = [check]
    folder = bundled
    if ctx.dry:
        # the bundle is for the GPU machine's Python 3.12: a copy whose wheels install here
        folder = ctx.work / "tt-stage"
        commands.append(
            [python, str(HERE / "side_by_side.py"), "stage-torchtitan", str(bundled), str(folder)]
        )
        knobs["TT_ENTRY"] = folder / "cpu_smoke_train.py"
        overrides = ["--model.flavor", "tiny", "--training.local_batch_size", "2"]
        overrides += ["--training.seq_len", "256", "--training.steps", "2"]
        overrides += ["--metrics.log_freq", "1", "--compile.no-enable"]
    commands.append(with_env(knobs, ["bash", str(HERE / "torchtitan.sh"), str(folder), *overrides]))
    skip = checks_only = ""
    if not bundled.is_dir():
        skip = f"{bundled} is missing: nox -s gpu-bundle builds it from ../shared/torchtitan-anchor"
    elif ctx.dry and (missing := lacking(python, TT_PYTHON_NEEDS)):
        checks_only = (
            f"files checked; TorchTitan not started: {python} lacks {', '.join(missing)} "
            "(TT_PYTHON names a Python that has them; tools/README.md)"
        )
        commands = [check]
    return Step(
        name,
        f"TorchTitan 0.2.2, llama-1b shape tied, batch {batch}, seq 2048, bf16 autocast + "
        f"compile, {SIDE_STEPS} steps: tokens/s, MFU, peak memory from its log (side-by-side)",
        commands,
        {4: 280, 8: 300}[batch],
        lambda: sbs.torchtitan_figures(out / "tt.log", ctx.dry),
        skip=skip,
        checks_only=checks_only,
    )


PROFILED_STEP = 20  # the step both sides trace: compiled, warm, before the run's end


def profile_side(ctx: Context) -> Step:
    """Where the side-by-side's difference goes: one step of TorchTitan's b4 and of our
    llama-b4 under torch.profiler (step 20 of 40 on both), each trace read by `llmtrain
    profile`: GPU kernel time per operator and the top kernels, one after the other in
    <out>/profile-b4/profile-b4.log. The dry run traces our tiny CPU run only."""
    name = "profile-b4"
    tt_name = "torchtitan-profile-b4"
    every = {"every": PROFILED_STEP, "active": 1, "warmup": 1}
    profile = [ctx.python, "-m", "llmtrain", "profile", "--top", "25"]
    if ctx.dry:
        cpu = run_config(
            ctx, f"cpu-{name}", TINY, CPU_SHAPE, profile={"every": 1, "active": 1, "warmup": 0}
        )
        commands = [[ctx.python, "-m", "llmtrain", "run", str(write_config(ctx, cpu))]]
        commands.append([*profile, str(ctx.runs / f"cpu-{name}")])
    else:
        more = ("--profiling.enable_profiling", "--profiling.profile_freq", str(PROFILED_STEP))
        more += ("--profiling.profiler_active", "1")
        titan = torchtitan(ctx, 4, tt_name, more)
        # TorchTitan names the folder for the profiler's step count: take the one it wrote
        traces = ctx.work / tt_name / "out" / "profile_traces"
        newest = f'{" ".join(profile)} "$(ls -d {traces}/iteration_*/rank0_trace.json | tail -1)"'
        shape = (SIDE_STEPS, sbs.SEQ_LEN, 4)
        config = run_config(ctx, name, {"kind": "llama-1b"}, shape, profile=every, **bf16())
        ran = [ctx.python, "-m", "llmtrain", "run", str(write_config(ctx, config))]
        commands = [*titan.commands, ["bash", "-c", newest]]
        commands += [with_env(our_env(ctx), ran), [*profile, str(ctx.runs / name)]]
    return Step(
        name,
        "one step of TorchTitan b4 and of llmtrain b4 under torch.profiler: GPU time per "
        "operator and top kernels of each (`llmtrain profile`), in the step's log",
        commands,
        420,
        keep=[ctx.logs / f"{name}.log"],
    )


def bare_loop(ctx: Context) -> Step:
    out = ctx.work / "bare_loop.json"
    script = [
        ctx.python,
        str(Path(__file__).with_name("bare_loop.py")),
        "--data",
        str(ctx.data),
        "--json",
        str(out),
    ]
    if ctx.dry:
        script += ["--model", "tiny", "--set", "vocab_size=320", "--seq-len", "32", "--batch", "2"]
        script += ["--steps", "1", "--warmup", "1", "--device", "cpu", "--dtype", "fp32"]
    else:
        steps, seq_len, batch = LLAMA_SHAPE
        # timed like the run's windows after its first (10 steps, compilation included)
        script += ["--model", "llama-1b", "--seq-len", str(seq_len), "--batch", str(batch)]
        script += [
            "--steps",
            str(steps - 10),
            "--warmup",
            "10",
            "--device",
            "cuda",
            "--dtype",
            "bf16",
            "--compile",
        ]
    return Step(
        "bare-loop",
        "the same llama-1b, steps and data in a bare PyTorch loop (compile, bf16, fused AdamW)",
        [script],
        300,
        json_figures(out, dict),
    )
