"""Per-item results and task metrics from request scores, as lm-evaluation-harness defines
them:

- multiple choice: `acc` (the option with the highest log-likelihood is the gold one),
  `acc_norm` (log-likelihood divided by the answer's length in characters, the harness's
  acc_norm) and `acc_norm_tokens` (divided by its length in tokens); each with `_stderr`, the
  standard error of the mean over items (sample standard deviation / sqrt(n)).
- cloze: `acc` (every answer token is the greedy choice) and `perplexity` (exp of minus the
  mean log-likelihood of the answers).
- perplexity: `word_perplexity`, `byte_perplexity` and `bits_per_byte` over all documents
  (bits per byte compares models with different tokenizers).

Loading this module imports no torch.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Sequence
from typing import Any

from llmtrain.core_mesh.interfaces import TaskItem


def _first_max(values: Sequence[float]) -> int:
    return max(range(len(values)), key=lambda i: (values[i], -i))


def choice_result(
    item: TaskItem, lls: list[float], tokens: list[int], greedy: list[bool]
) -> dict[str, Any]:
    chars = [max(1, len(item.choice(o))) for o in range(item.n_options)]
    pred = _first_max(lls)
    pred_norm = _first_max([ll / n for ll, n in zip(lls, chars, strict=True)])
    pred_tokens = _first_max([ll / max(1, n) for ll, n in zip(lls, tokens, strict=True)])
    return {
        "where": item.where,
        "gold": item.gold,
        "loglikelihoods": lls,
        "tokens": tokens,
        "greedy": greedy,
        "acc": float(pred == item.gold),
        "acc_norm": float(pred_norm == item.gold),
        "acc_norm_tokens": float(pred_tokens == item.gold),
    }


def cloze_result(item: TaskItem, ll: float, tokens: int, greedy: bool) -> dict[str, Any]:
    return {
        "where": item.where,
        "loglikelihood": ll,
        "tokens": tokens,
        "acc": float(greedy),
    }


def document_result(item: TaskItem, ll: float, tokens: int) -> dict[str, Any]:
    text = item.choices[0]
    return {
        "where": item.where,
        "loglikelihood": ll,
        "tokens": tokens,
        "words": len(re.split(r"\s+", text)),
        "bytes": len(text.encode("utf-8")),
    }


def mean_with_stderr(name: str, values: Sequence[float]) -> dict[str, float]:
    out = {name: statistics.fmean(values)}
    if len(values) > 1:
        out[f"{name}_stderr"] = statistics.stdev(values) / math.sqrt(len(values))
    return out


def task_metrics(scoring: str, results: Sequence[dict[str, Any]]) -> dict[str, float]:
    """The task's metrics over its items' results (see the module docstring)."""
    if scoring == "multiple_choice":
        metrics: dict[str, float] = {}
        for name in ("acc", "acc_norm", "acc_norm_tokens"):
            metrics.update(mean_with_stderr(name, [r[name] for r in results]))
        return metrics
    if scoring == "cloze":
        lls = [r["loglikelihood"] for r in results]
        metrics = mean_with_stderr("acc", [r["acc"] for r in results])
        metrics["perplexity"] = math.exp(min(-statistics.fmean(lls), 700.0))
        return metrics
    ll = sum(r["loglikelihood"] for r in results)
    words = sum(r["words"] for r in results)
    n_bytes = sum(r["bytes"] for r in results)
    return {
        "word_perplexity": math.exp(min(-ll / max(1, words), 700.0)),
        "byte_perplexity": math.exp(min(-ll / max(1, n_bytes), 700.0)),
        "bits_per_byte": -ll / max(1, n_bytes) / math.log(2),
    }
