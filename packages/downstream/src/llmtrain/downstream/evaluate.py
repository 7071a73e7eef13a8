"""Evaluating one task on a model: its items become requests, the requests are scored, and the
scores become per-item results and the task's metrics.

`evaluate_task` is what `llmtrain eval-tasks`, the `downstream` callback and the lm-eval
adapter call; the runner decides how rows reach the model (one process or a parallel layout).
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Any

import attrs

from llmtrain.core_mesh.interfaces import TASK_SCORINGS, Task, Tokenizer
from llmtrain.downstream.metrics import choice_result, cloze_result, document_result, task_metrics
from llmtrain.downstream.requests import requests_of
from llmtrain.downstream.scoring import Batching, DataSplit, PackedRunner, Runner, Score, score

if TYPE_CHECKING:
    import torch


@attrs.frozen
class TaskResult:
    """A task's metrics, its items' results (in file order) and how many items had their
    context cut from the left to fit the model."""

    name: str
    scoring: str
    metrics: dict[str, float]
    items: list[dict[str, Any]]
    truncated: int

    def summary(self) -> dict[str, object]:
        return {
            "scoring": self.scoring,
            "items": len(self.items),
            "truncated": self.truncated,
            **self.metrics,
        }


def evaluate_task(
    task: Task,
    tokenizer: Tokenizer,
    runner: Runner | PackedRunner,
    *,
    max_len: int,
    batching: Batching,
    device: torch.device | str,
    split: DataSplit = DataSplit(),
) -> TaskResult:
    if task.scoring not in TASK_SCORINGS:
        raise ValueError(
            f"task {task.name!r}: scoring {task.scoring!r} is not one of {TASK_SCORINGS}"
        )
    items = task.items()
    requests = requests_of(task.scoring, items, tokenizer, max_len)
    scores = score(requests, runner, batching, device, split, max_len=max_len)
    per_item: dict[int, list[Score]] = defaultdict(list)
    for request, result in zip(requests, scores, strict=True):
        per_item[request.item].append(result)
    results = []
    for i, item in enumerate(items):
        found = per_item[i]
        if task.scoring == "multiple_choice":
            results.append(
                choice_result(
                    item,
                    [s.loglikelihood for s in found],
                    [s.tokens for s in found],
                    [s.greedy for s in found],
                )
            )
        elif task.scoring == "cloze":
            (s,) = found
            results.append(cloze_result(item, s.loglikelihood, s.tokens, s.greedy))
        else:
            results.append(
                document_result(
                    item, sum(s.loglikelihood for s in found), sum(s.tokens for s in found)
                )
            )
    truncated = len({r.item for r in requests if r.truncated})
    return TaskResult(
        task.name,
        task.scoring,
        task_metrics(task.scoring, results),
        results,
        truncated,
    )
