"""The GPU kit's steps, in the order runner.py runs them: each a list of commands, a time
budget, and where its figures come from; every step has a GPU form and a CPU dry-run form."""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

GOAL_RATIO = 0.97  # tokens/s of `llmtrain run` against the bare loop
# plugins bundle.sh leaves out (their third-party stacks serve no GPU check); keep in step
LEFT_OUT_PLUGINS = {"llmtrain-lmeval", "llmtrain-wandb"}
TORCHTITAN = (
    "not run: TorchTitan 0.3.0's wheel would bundle, but it trains on a Hugging Face dataset and "
    "tokenizer it downloads (the GPU machine has no network) and needs wandb and datasets "
    "(~25 MiB more); a local-data TorchTitan config is still owed"
)


@dataclass
class Context:
    root: Path
    work: Path
    python: str
    dry: bool

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
    return Step(step.name, step.measures, [fail, *step.commands], step.budget_s, step.figures)


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
    """Median tokens/s and MFU over the logged windows after the first (compilation happens
    in it), and the last loss, from the run's metrics.jsonl."""

    def read() -> dict:
        run = f"cpu-{name}" if ctx.dry else name
        lines = (ctx.runs / run / "metrics.jsonl").read_text().splitlines()
        metrics = [m for m in map(json.loads, lines) if "tokens_per_s" in m]
        timed = metrics[1:] or metrics
        figures = {"tokens_per_s": statistics.median(m["tokens_per_s"] for m in timed)}
        if all("mfu" in m for m in timed):
            figures["mfu"] = statistics.median(m["mfu"] for m in timed)
        return {**figures, "last_loss": metrics[-1].get("loss"), "windows": len(timed)}

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
        float8_run(ctx),
        moe_run(ctx),
        deterministic(ctx),
        llama_run(ctx),
        bare_loop(ctx),
        Step(
            "torchtitan",
            "TorchTitan on the same model and steps (goal: ours >= 1.0 of it)",
            [],
            0,
            skip=TORCHTITAN,
        ),
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
            "gpt2-small",
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


def gpt2_run(ctx: Context) -> Step:
    commands = llmtrain_run(ctx, "gpt2-bf16", {"kind": "gpt2-124m"}, (60, 1024, 16), TINY, **bf16())
    return Step(
        "gpt2-run",
        "`llmtrain run` gpt2-124m, bf16 + compile: tokens/s and MFU from metrics.jsonl",
        commands,
        300,
        run_figures(ctx, "gpt2-bf16"),
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


LLAMA_SHAPE = (40, 2048, 4)  # steps, seq_len, batch: the side-by-side's workload


def llama_run(ctx: Context) -> Step:
    commands = llmtrain_run(ctx, "llama-1b", {"kind": "llama-1b"}, LLAMA_SHAPE, TINY, **bf16())
    return Step(
        "llama-run",
        "`llmtrain run` llama-1b, bf16 + compile, 40 steps: our side of the side-by-side",
        commands,
        360,
        run_figures(ctx, "llama-1b"),
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
