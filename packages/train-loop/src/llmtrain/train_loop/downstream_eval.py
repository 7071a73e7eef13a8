"""Downstream evaluation in the loop (callback kind `downstream`): every `every` steps (and
after the last), each task of `tasks` is scored on the model as it is laid out (any mix of
FSDP, TP, PP and CP; items split over the data-parallel ranks and gathered exactly), and its
metrics join the step's record as `downstream/<task>/<metric>` (metrics.jsonl, TensorBoard,
W&B), with `_stderr` next to each accuracy.

Task files are read and checked when the run starts, so a bad file stops the run before its
first step. Loading this module imports no torch.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import structlog

from llmtrain.core_mesh.config import Choice, ConfigValueError
from llmtrain.core_mesh.interfaces import Callback, Task, TrainingRun
from llmtrain.core_mesh.plugins import TASK, Register
from llmtrain.train_loop.run_config import _positive

log = structlog.get_logger("llmtrain.train")

METRIC_PREFIX = "downstream/"


@attrs.frozen(kw_only=True)
class DownstreamOptions:
    """`tasks`: the tasks to score (`{kind: hellaswag, path: ..., limit: ..., shots: ...}`).
    `every`: steps between evaluations; `at_end`: also after the last step. `batch_rows`: rows
    per batch (default: the run's per-rank batch; under pipelining it must split into the
    run's micro-batches). `pad_to_seq_len`: one batch shape, `data.seq_len` tokens (what
    compiled models want; always so under pipelining). `save_items`: rank 0 also writes every
    item's result to `<run_dir>/downstream/step-<N>/<task>.jsonl`."""

    tasks: list[Choice.of("task")]  # type: ignore[valid-type]
    every: int = attrs.field(default=1000, validator=_positive)
    at_end: bool = True
    batch_rows: int | None = attrs.field(default=None, validator=_positive)
    pad_to_seq_len: bool = False
    save_items: bool = False

    def __attrs_post_init__(self) -> None:
        if not self.tasks:
            raise ConfigValueError("tasks", "name at least one task")
        kinds = [task.kind for task in self.tasks]
        twice = sorted({kind for kind in kinds if kinds.count(kind) > 1})
        if twice:
            raise ConfigValueError("tasks", f"each task may appear once; twice: {twice}")


class DownstreamEvaluation(Callback):
    def __init__(self, options: DownstreamOptions):
        self.options = options
        self.tasks: list[Task] = []

    def on_run_start(self, run: TrainingRun) -> None:
        self.tasks = [run.plugins.build(TASK, choice) for choice in self.options.tasks]
        for task in self.tasks:
            task.items()  # read and check the files now, not at the first evaluation

    def after_step(self, run: TrainingRun, step: int, metrics: dict[str, Any]) -> None:
        due = step % self.options.every == 0 or (self.options.at_end and step == run.total_steps)
        if due:
            metrics.update(self.evaluate(run))

    def evaluate(self, run: TrainingRun) -> dict[str, float]:
        from llmtrain.downstream.evaluate import evaluate_task
        from llmtrain.downstream.scoring import Batching, DataSplit, layout_runner

        model = run.model
        seq_len = run.config.data.seq_len
        split = DataSplit(
            model.data_rank,
            model.data_world,
            model.dim("dp").get_group() if model.data_world > 1 else None,
        )
        fixed = self.options.pad_to_seq_len or model.size("pp") > 1
        batching = Batching(
            rows=self.options.batch_rows or run.global_batch // model.data_world,
            length=seq_len if fixed else None,
            multiple=2 * model.size("cp") * model.size("tp"),
        )
        started = time.perf_counter()
        metrics: dict[str, float] = {}
        model.train(False)
        try:
            for task in self.tasks:
                result = evaluate_task(
                    task,
                    run.tokenizer,
                    layout_runner(model),
                    max_len=seq_len,
                    batching=batching,
                    device=model.device,
                    split=split,
                )
                metrics.update(
                    {f"{METRIC_PREFIX}{task.name}/{k}": v for k, v in result.metrics.items()}
                )
                if result.truncated:
                    metrics[f"{METRIC_PREFIX}{task.name}/truncated"] = float(result.truncated)
                if self.options.save_items and run.world.is_main:
                    self._save_items(run, task.name, result.items)
        finally:
            model.train(True)
        seconds = time.perf_counter() - started
        metrics[f"{METRIC_PREFIX}seconds"] = seconds
        log.info("downstream.evaluated", step=run.step, seconds=round(seconds, 3))
        return metrics

    @staticmethod
    def _save_items(run: TrainingRun, name: str, items: Sequence[Mapping[str, object]]) -> None:
        directory = run.run_dir / "downstream" / f"step-{run.step}"
        directory.mkdir(parents=True, exist_ok=True)
        partial = directory / f"{name}.jsonl.partial"
        with open(partial, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(item) + "\n" for item in items)
        partial.replace(directory / f"{name}.jsonl")  # never a half-written file by that name


def register_callbacks(register: Register) -> None:
    register(
        "downstream",
        DownstreamEvaluation,
        options=DownstreamOptions,
        help="downstream task scores (HellaSwag, ARC, ...) every N steps, at any layout",
    )
