"""Downstream scoring items/s of llmtrain's `evaluate_task` vs lm-evaluation-harness's transformers backend: python tools/bench_eval.py [--items 400] [--threads 2] [--profile].

One run builds everything offline in a temporary folder: a generated corpus, a byte-level BPE,
a Llama-style model trained one step through `llmtrain run`, its transformers export (llmtrain-
hf), and N generated items in HellaSwag's file layout. Both sides then score the same items
with the same weights, threads and rows per forward, the model already in memory:

- ours: `evaluate_task` of the built-in `hellaswag` task (reads the file, prompts, tokenizes,
  scores, metrics) with `module_runner` on one process;
- lm-eval: `simple_evaluate` with an `HFLM` of the export on a local copy of the harness's
  `hellaswag` task (`dataset_path: json`, its `process_docs`), no sample logging.

After a warmup of each (lm-eval's dataset cache is built there), rounds alternate and medians
are reported, with the time each side spends in its model calls (so the table shows where the
rest goes), and a check that both gave the same acc per item. Then the in-loop cost: a run of
the same model that trains and scores the items every `--every` steps with the `downstream`
callback (twice), its evaluation's seconds as a share of the training steps' between two
evaluations. `--profile` adds cProfile's top
entries of one round of each. Needs llmtrain-hf and lm-eval[hf] installed (as the plugin-lmeval
nox session has them).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GOAL = 2.0
MAX_SEQ_LEN = 256
TASK = "bench_hellaswag"
# the harness's hellaswag.yaml and utils.py, reading a local file
TASK_YAML = """\
task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    validation: {path}
output_type: multiple_choice
validation_split: validation
process_docs: !function bench_utils.process_docs
doc_to_text: "{{{{query}}}}"
doc_to_target: "{{{{label}}}}"
doc_to_choice: "choices"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""
TASK_UTILS = """\
import re


def preprocess(text):
    text = text.strip()
    text = text.replace(" [title]", ". ")
    text = re.sub("\\\\[.*?\\\\]", "", text)
    text = text.replace("  ", " ")
    return text


def process_docs(dataset):
    def _process_doc(doc):
        ctx = doc["ctx_a"] + " " + doc["ctx_b"].capitalize()
        return {
            "query": preprocess(doc["activity_label"] + ": " + ctx),
            "choices": [preprocess(ending) for ending in doc["endings"]],
            "gold": int(doc["label"]),
        }

    return dataset.map(_process_doc)
"""
ACTIVITIES = ["Making a sandwich", "Washing a car", "Playing the piano", "Painting a fence"]


def sentences(rng: random.Random, n: int) -> str:
    from llmtrain.train_loop.experiments.quickstart import sentence

    return " ".join(sentence(rng) for _ in range(n))


def hellaswag_items(n: int, seed: int = 0) -> list[dict]:
    """HellaSwag's rows: an activity, a two-part context, four endings, the label."""
    rng = random.Random(seed)
    return [
        {
            "ind": i,
            "activity_label": rng.choice(ACTIVITIES),
            "ctx_a": sentences(rng, rng.randint(2, 4)),
            "ctx_b": sentences(rng, 1).lower()[:-1],
            "endings": [sentences(rng, rng.randint(1, 2)) for _ in range(4)],
            "label": str(rng.randrange(4)),
            "split": "val",
        }
        for i in range(n)
    ]


def build(work: Path, args: argparse.Namespace) -> tuple[str, str, int]:
    """Train one step, export; (checkpoint dir, transformers dir, max_seq_len). A --dir that
    already holds them is reused."""
    from llmtrain_hf import export_checkpoint

    from llmtrain.data_pack.pack import pack
    from llmtrain.data_pack.tokenizer import train_bpe
    from llmtrain.train_loop.experiments.quickstart import write_corpus

    checkpoint, export = str(work / "runs" / "bench" / "checkpoints"), str(work / "hf")
    if (work / "hf" / "config.json").exists():
        return checkpoint, export, MAX_SEQ_LEN
    write_corpus(work / "train.jsonl", 400, seed=0)
    texts = [json.loads(line)["text"] for line in (work / "train.jsonl").open()]
    tokenizer = work / "tokenizer.json"
    tokenizer.write_text(train_bpe(texts, args.vocab, special_tokens=("<|endoftext|>",)))
    pack(
        [str(work / "train.jsonl")],
        str(work / "train.zarr"),
        {"kind": "hf", "path": str(tokenizer)},
        workers=1,
    )
    train(work, "bench", args, data={"seq_len": 128, "micro_batch": 2}, training={"steps": 1})
    export_checkpoint(checkpoint, export)
    return checkpoint, export, MAX_SEQ_LEN


def train(
    work: Path, name: str, args: argparse.Namespace, *, data: dict, training: dict, **more
) -> Path:
    """`llmtrain run` of the bench model on the packed corpus, afresh (`more`: further config
    sections); its metrics.jsonl."""
    import shutil

    import yaml

    model = {
        "kind": "tiny",
        "vocab_size": args.vocab,
        "max_seq_len": MAX_SEQ_LEN,
        "d_model": args.d_model,
        "n_layers": args.layers,
        "n_heads": args.d_model // 64,
        "n_kv_heads": max(1, args.d_model // 128),
        "tied_embeddings": False,
    }
    config = {
        "name": name,
        "seed": 0,
        "run_dir": str(work / "runs"),
        "device": "cpu",
        "model": model,
        "data": {"train": [{"path": str(work / "train.zarr")}], **data},
        "optimizer": {"kind": "adamw", "lr": 1e-3},
        "training": training,
        "loggers": [{"kind": "jsonl"}],
        **more,
    }
    shutil.rmtree(work / "runs" / name, ignore_errors=True)
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    llmtrain = Path(sys.executable).parent / "llmtrain"
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    subprocess.run([str(llmtrain), "run", str(path)], check=True, capture_output=True, env=env)
    return work / "runs" / name / "metrics.jsonl"


def in_loop_cost(work: Path, args: argparse.Namespace, items: Path) -> tuple[float, float]:
    """(seconds of one in-loop evaluation, seconds of one training step) of a run that trains
    `--micro-batch` x 256 tokens a step and scores the items every `--every` steps (twice):
    step times come from the log windows without an evaluation in them."""
    callback = {
        "kind": "downstream",
        "every": args.every,
        "at_end": False,
        "batch_rows": args.batch,
        "tasks": [{"kind": "hellaswag", "path": str(items)}],
    }
    metrics = train(
        work,
        "bench-loop",
        args,
        data={"seq_len": MAX_SEQ_LEN, "micro_batch": args.micro_batch},
        training={"steps": 2 * args.every, "log_every": 10},
        callbacks=[callback],
    )
    records = [json.loads(line) for line in metrics.open()]
    evaluations = [r["downstream/seconds"] for r in records if "downstream/seconds" in r]
    steps = [r["step_time_s"] for r in records if "downstream/seconds" not in r and r["step"] > 10]
    return statistics.median(evaluations), statistics.median(steps)


class Timed:
    """A callable that adds the seconds spent in `fn` to `seconds`."""

    def __init__(self, fn):
        self.fn, self.seconds = fn, 0.0
        self.__wrapped__ = fn  # inspect.signature sees fn's parameters

    def __call__(self, *a, **k):
        started = time.perf_counter()
        try:
            return self.fn(*a, **k)
        finally:
            self.seconds += time.perf_counter() - started


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--items", type=int, default=400)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=32, help="rows per forward, both sides")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--dir", default=None, help="work folder (default: a temporary one)")
    p.add_argument("--every", type=int, default=100, help="in-loop: steps between evaluations")
    p.add_argument("--micro-batch", type=int, default=8, help="in-loop: sequences per step")
    p.add_argument("--profile", action="store_true", help="cProfile one round of each")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    work = Path(args.dir or tempfile.mkdtemp(prefix="bench-eval-"))
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HOME", str(work / "hf-home"))

    import torch
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager
    from transformers.utils import logging as hf_logging

    from llmtrain.core_mesh.config import Choice, structure
    from llmtrain.core_mesh.plugins import PluginManager
    from llmtrain.downstream.evaluate import evaluate_task
    from llmtrain.downstream.scoring import Batching, module_runner
    from llmtrain.train_loop.saved_model import load_model, tokenizer_of

    hf_logging.set_verbosity_error()
    checkpoint, export, max_len = build(work, args)
    items = work / "hellaswag_val.jsonl"
    items.write_text("".join(json.dumps(r) + "\n" for r in hellaswag_items(args.items)))
    tasks = work / "tasks"
    tasks.mkdir(exist_ok=True)
    (tasks / f"{TASK}.yaml").write_text(TASK_YAML.format(task=TASK, path=items))
    (tasks / "bench_utils.py").write_text(TASK_UTILS)
    torch.set_num_threads(args.threads)

    plugins = PluginManager().load_entry_points()
    model, info, _ = load_model(checkpoint, None, plugins)
    tokenizer = tokenizer_of(info, None, plugins)
    choice = structure(
        {"kind": "hellaswag", "path": str(items)}, Choice.of("task"), plugins=plugins
    )
    hflm = HFLM(
        pretrained=export, dtype="float32", device="cpu", batch_size=args.batch, max_length=max_len
    )
    manager = TaskManager(include_path=str(tasks), include_defaults=False)
    hf_call = Timed(hflm._model_call)
    hflm._model_call = hf_call  # the forward passes, logits out

    our_call = Timed(model.forward)
    model.forward = our_call  # the forward passes, logits out

    def ours() -> tuple[dict, float]:
        our_call.seconds = 0.0
        result = evaluate_task(
            plugins.build("task", choice),
            tokenizer,
            module_runner(model),
            max_len=max_len,
            batching=Batching(rows=args.batch),
            device=torch.device("cpu"),
        )
        return {"acc": [r["acc"] for r in result.items], "metrics": result.metrics}, (
            our_call.seconds
        )

    def theirs() -> tuple[dict, float]:
        hf_call.seconds = 0.0
        out = simple_evaluate(
            model=hflm, tasks=[TASK], task_manager=manager, log_samples=True, verbosity="ERROR"
        )
        samples = sorted(out["samples"][TASK], key=lambda s: s["doc_id"])
        return {"acc": [float(s["acc"]) for s in samples], "metrics": out["results"][TASK]}, (
            hf_call.seconds
        )

    sides = {"ours": ours, "lm-eval hf": theirs}
    results = {name: fn()[0] for name, fn in sides.items()}  # warmup (lm-eval's dataset cache)
    rounds: dict[str, list[tuple[float, float]]] = {name: [] for name in sides}
    for r in range(args.rounds):
        for name in sides if r % 2 == 0 else reversed(list(sides)):
            started = time.perf_counter()
            _, model_s = sides[name]()
            rounds[name].append((time.perf_counter() - started, model_s))
    same = results["ours"]["acc"] == results["lm-eval hf"]["acc"]

    med = {
        name: (
            statistics.median(t for t, _ in got),
            statistics.median(m for _, m in got),
        )
        for name, got in rounds.items()
    }
    if args.json:
        print(json.dumps({"args": vars(args), "rounds": rounds, "median": med}, indent=2))
    n = args.items
    (ours_s, ours_model), (hf_s, hf_model) = med["ours"], med["lm-eval hf"]
    print(
        f"{n} HellaSwag-layout items ({4 * n} rows), model d={args.d_model} x {args.layers} layers, "
        f"vocab {args.vocab}, {args.threads} threads, {args.batch} rows per forward, "
        f"{args.rounds} rounds (medians)"
    )
    row = "{:<28} {:>10} {:>12} {:>8} {:>10}"
    print(row.format("measure", "ours", "lm-eval hf", "ratio", "goal"))
    verdict = "ok" if hf_s / ours_s >= GOAL else "MISS"
    print(
        row.format(
            "items/s", f"{n / ours_s:.1f}", f"{n / hf_s:.1f}", f"{hf_s / ours_s:.2f}",
            f">= {GOAL} {verdict}",
        )
    )  # fmt: skip
    print(row.format("seconds", f"{ours_s:.2f}", f"{hf_s:.2f}", "", ""))
    print(row.format("  in model calls", f"{ours_model:.2f}", f"{hf_model:.2f}", "", ""))
    print(row.format("  elsewhere", f"{ours_s - ours_model:.2f}", f"{hf_s - hf_model:.2f}", "", ""))
    print(
        f"same acc on every item: {same}; acc {results['ours']['metrics']['acc']:.4f} vs "
        f"{results['lm-eval hf']['metrics']['acc,none']:.4f}"
    )
    evaluation_s, step_s = in_loop_cost(work, args, items)
    print(
        f"in the loop (training {args.micro_batch} x {MAX_SEQ_LEN} tokens a step, the {n} items "
        f"every {args.every} steps): an evaluation {evaluation_s:.2f} s, a step {step_s:.3f} s; "
        f"{evaluation_s / (args.every * step_s):.1%} of the {args.every} steps' time"
    )
    if args.json:
        print(json.dumps({"in_loop": {"evaluation_s": evaluation_s, "step_s": step_s}}))
    if args.profile:
        for name, fn in sides.items():
            prof = cProfile.Profile()
            prof.enable()
            fn()
            prof.disable()
            print(f"--- {name}: cProfile, top 25 by cumulative time")
            pstats.Stats(prof, stream=sys.stdout).sort_stats("cumulative").print_stats(25)


if __name__ == "__main__":
    main()
