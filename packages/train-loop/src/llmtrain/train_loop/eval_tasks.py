"""`llmtrain eval-tasks`: downstream task scores of a checkpoint on one process.

    llmtrain eval-tasks runs/x/checkpoints --tasks hellaswag=val.jsonl,arc_easy=ARC-Easy-Test.jsonl

prints a table (value ± standard error per metric) and, with `-o/--output`, writes the same as
JSON (with every item's log-likelihoods and result under `--per-item`). `--steps` or `--last K`
score several committed steps one after another (the tasks read once), which is what
`llmtrain compare` measures each task's checkpoint-to-checkpoint noise from. A checkpoint inside
a run directory also gets its scores recorded there, in `eval_tasks.json` (`record_in_run`),
where `llmtrain compare --downstream` finds them; scores of `--weights ema` are recorded as the
task `<task>@ema`. Loading this module imports no torch.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from llmtrain.checkpoint.plugin import step_list
from llmtrain.core_mesh.cli import Context
from llmtrain.core_mesh.cli_conventions import deprecated_alias, positive_int
from llmtrain.core_mesh.config import Choice, structure
from llmtrain.core_mesh.errors import UserError
from llmtrain.core_mesh.plugins import TASK
from llmtrain.train_loop.commands import checkpoint_args
from llmtrain.train_loop.saved_model import load_model, tokenizer_of

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from llmtrain.core_mesh.interfaces import Task
    from llmtrain.downstream.evaluate import TaskResult


def configure(parser: argparse.ArgumentParser) -> None:
    checkpoint_args(parser)
    parser.add_argument(
        "--steps",
        type=step_list,
        default=None,
        metavar="N,N,...",
        help="score these committed steps, one after another (instead of --step)",
    )
    parser.add_argument(
        "--last",
        type=positive_int,
        default=None,
        metavar="K",
        help="score the newest K committed steps (instead of --step)",
    )
    parser.add_argument(
        "--tasks",
        required=True,
        help="NAME=PATH[,NAME=PATH...]: installed tasks (`llmtrain plugins`, kind task) and "
        "their files (local paths or fsspec URLs)",
    )
    parser.add_argument("--limit", type=int, default=None, help="the first N items of each task")
    parser.add_argument("--shots", type=int, default=0, help="few-shot examples per question")
    parser.add_argument("--seed", type=int, default=1234, help="seed of the few-shot draws")
    parser.add_argument(
        "--batch-size", type=int, default=16, help="rows (prompt + choice) per forward pass"
    )
    deprecated_alias(parser, "--batch-rows", "--batch-size")
    parser.add_argument(
        "--seq-len",
        type=int,
        default=None,
        help="tokens per row; longer requests keep their end (default: the training seq_len)",
    )
    deprecated_alias(parser, "--max-len", "--seq-len")
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="the tokenizer (default: the one the training data was packed with)",
    )
    parser.add_argument(
        "-o", "--output", default=None, metavar="FILE.json", help="also write the results as JSON"
    )
    parser.add_argument(
        "--per-item", action="store_true", help="with --output: every item's result too"
    )


def tasks_of(spec: str, args: argparse.Namespace, ctx: Context) -> list[Task]:
    """`name=path,...` as tasks, their options checked like a config's `tasks:` list. `--shots`
    goes to every task that takes examples (perplexity tasks take none)."""
    tasks = []
    for i, part in enumerate(p for p in spec.split(",") if p.strip()):
        name, sep, path = part.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise UserError(f"--tasks: {part!r} is not NAME=PATH")
        options: dict[str, object] = {"kind": name.strip(), "path": path.strip()}
        options |= {"limit": args.limit, "seed": args.seed}
        task = _build(options, i, ctx)
        if args.shots and task.scoring != "perplexity":
            task = _build({**options, "shots": args.shots}, i, ctx)
        tasks.append(task)
    names = [task.name for task in tasks]
    if not names:
        raise UserError("--tasks: name at least one task as NAME=PATH")
    if len(set(names)) != len(names):
        raise UserError(f"--tasks: each task may appear once, got {names}")
    return tasks


def _build(options: dict[str, object], index: int, ctx: Context) -> Task:
    choice = structure(options, Choice.of("task"), plugins=ctx.plugins, source=f"--tasks[{index}]")
    return ctx.plugins.build(TASK, choice)


def run(args: argparse.Namespace, ctx: Context) -> int:
    steps = steps_of(args)
    tasks = tasks_of(args.tasks, args, ctx)
    for task in tasks:
        task.items()  # every file read and checked before the model loads
    reports = [_score(args, ctx, tasks, step, several=len(steps) > 1) for step in steps]
    if args.output:
        document = reports[0] if len(reports) == 1 else {"evaluations": reports}
        with open(args.output, "w", encoding="utf-8") as f:
            json.dump(document, f, indent=1)
    return 0


def steps_of(args: argparse.Namespace) -> Sequence[int | None]:
    """The steps to score: `--step`, or the `--steps` / newest `--last` K committed ones (as
    `llmtrain average` chooses them); [None]: the newest."""
    chosen = [args.step is not None, args.steps is not None, args.last is not None]
    if sum(chosen) > 1:
        raise UserError("--step, --steps and --last each choose the steps: give one of them")
    if args.steps is None and args.last is None:
        return [args.step]
    from llmtrain.checkpoint.average import chosen_steps
    from llmtrain.checkpoint.manager import Checkpointer

    source = Checkpointer(str(args.checkpoint))
    return chosen_steps(source, last=args.last, steps=args.steps, at_least=1)


def _score(
    args: argparse.Namespace, ctx: Context, tasks: list[Task], step: int | None, *, several: bool
) -> dict[str, object]:
    """One checkpoint's scores: printed, recorded in its run, and returned as the JSON report."""
    import torch

    from llmtrain.downstream.evaluate import evaluate_task
    from llmtrain.downstream.scoring import Batching, module_runner

    model, info, step = load_model(args.checkpoint, step, ctx.plugins, weights=args.weights)
    tokenizer = tokenizer_of(info, args.tokenizer, ctx.plugins)
    max_len = args.seq_len or info.get("data", {}).get("seq_len")
    if max_len is None:
        raise UserError("the checkpoint does not record its seq_len; pass --seq-len")
    runner = module_runner(model)
    results = []
    for task in tasks:
        started = time.perf_counter()
        result = evaluate_task(
            task,
            tokenizer,
            runner,
            max_len=max_len,
            batching=Batching(rows=args.batch_size),
            device=torch.device("cpu"),
        )
        seconds = time.perf_counter() - started
        print(f"{task.name}: {len(result.items)} items in {seconds:.1f} s", file=sys.stderr)
        results.append(result)
    averaged = " (the ema callback's moving average)" if args.weights == "ema" else ""
    # one table alone, as it always was; several, each under the step it scores
    heading = f"step {step}{averaged}\n" if several else ""
    print(heading + render(results), end="\n" if several else "")
    run_dir = run_dir_of(str(args.checkpoint))
    if run_dir is not None:
        settings = {"shots": args.shots, "seed": args.seed, "limit": args.limit, "max_len": max_len}
        suffix = "" if args.weights == "model" else f"@{args.weights}"
        scores = {f"{r.name}{suffix}": {**r.summary(), **settings} for r in results}
        path = record_in_run(run_dir, step, scores)
        print(f"scores of step {step} -> {path} (llmtrain compare --downstream)", file=sys.stderr)
    return {
        "checkpoint": str(args.checkpoint),
        "step": step,
        "weights": args.weights,
        "max_len": max_len,
        "shots": args.shots,
        "seed": args.seed,
        "tasks": {
            r.name: {**r.summary(), **({"per_item": r.items} if args.per_item else {})}
            for r in results
        },
    }


# the file of a run directory that holds the scores eval-tasks gave its checkpoints, which
# `llmtrain compare --downstream` (llmtrain.ablate.runs.EVAL_TASKS) reads beside the scores the
# run's downstream callback logged: {"format": 1, "evaluations": [{"step": N, "tasks": {"<task>":
# {"scoring", "items", "truncated", "<metric>", "<metric>_stderr", "shots", "seed", "limit",
# "max_len", "evaluated"}}}]}, one entry per step in step order
RUN_SCORES = "eval_tasks.json"


def run_dir_of(checkpoint: str) -> Path | None:
    """The run directory a local checkpoint lies in (`<run>/checkpoints`, or one of its
    `step-N`, beside `<run>/config.yaml`); None for a checkpoint elsewhere (`checkpoint.dir`,
    object storage, an exported copy)."""
    if "://" in checkpoint:
        return None
    path = Path(checkpoint).resolve()
    for run_dir in (path.parent, path.parent.parent):
        if (run_dir / "config.yaml").is_file() and (
            path == run_dir / "checkpoints" or path.parent == run_dir / "checkpoints"
        ):
            return run_dir
    return None


def record_in_run(run_dir: Path, step: int, scores: Mapping[str, Mapping[str, object]]) -> Path:
    """Add `scores` (per task) as step `step`'s to `<run_dir>/eval_tasks.json`: a task scored
    again at that step replaces its earlier scores. The file is rewritten whole under a lock
    (`.lock` beside it), through a temporary file renamed over it, so a reader never sees half
    of it and two eval-tasks at once both land."""
    import fcntl
    import os
    import tempfile

    path = run_dir / RUN_SCORES
    evaluated = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            document = json.loads(path.read_text(encoding="utf-8"))
            evaluations = [e for e in document["evaluations"] if isinstance(e, dict)]
        except (OSError, ValueError, KeyError, TypeError):
            evaluations = []
        entry = next((e for e in evaluations if e.get("step") == step), None)
        if entry is None:
            entry = {"step": step, "tasks": {}}
            evaluations.append(entry)
        for name, task_scores in scores.items():
            entry.setdefault("tasks", {})[name] = {**task_scores, "evaluated": evaluated}
        evaluations.sort(key=lambda e: e.get("step", 0))
        text = json.dumps({"format": 1, "evaluations": evaluations}, indent=1) + "\n"
        fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=run_dir)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide the scores from other readers
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return path


def render(results: list[TaskResult]) -> str:
    """One line per task and metric: `value ± stderr` where the metric has a standard error."""
    header = ["task", "items", "truncated", "metric", "value"]
    body = []
    for result in results:
        first = True
        for name, value in result.metrics.items():
            if name.endswith("_stderr"):
                continue
            stderr = result.metrics.get(f"{name}_stderr")
            shown = f"{value:.4f}" + (f" ± {stderr:.4f}" if stderr is not None else "")
            lead = (
                [result.name, str(len(result.items)), str(result.truncated)] if first else [""] * 3
            )
            body.append([*lead, name, shown])
            first = False
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
        for row in [header, *body]
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines) + "\n"
