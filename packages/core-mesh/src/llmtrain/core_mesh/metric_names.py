"""The names a dashboard logger (the `tensorboard` and `wandb` plugins) gives the metrics of a
logged step: one mapping, so both show the same charts under the same names.

TensorBoard and W&B group charts by the part of a name before its first `/` and order groups and
charts by name. The names put the loss first: `loss/train`, `loss/eval`, `loss/eval_ppl` and
`loss/eval_bpb` are the first section, and every other metric llmtrain logs has its own section
after it (named held-out sets keep their `eval/<name>/...` names, a section of their own):

    loss/      train, eval, eval_ppl, eval_bpb
    memory/    peak_mib, active_mib, reserved_mib
    optim/     lr, grad_norm, loss_spike, loss_spike_ratio, loss_spikes
    perf/      tokens_per_s, step_time_s, mfu, data_wait, sync_wait, data_wait_max, slowest_rank
    progress/  tokens, loss_tokens
    tasks/     <task>/<metric> (the `downstream` callback's `downstream/<task>/<metric>`)

A name that already has a `/` (a callback's `moe/...`, a metric recorded with
`record_metric("optim/...", ...)`) keeps its section, so a new metric needs no entry here; any
other name goes to `other/<name>`. metrics.jsonl keeps the names the run logs (`loss`,
`eval_loss`, ...): these are the dashboards' names only.

Which way a metric improves is said where it is recorded (`record_metric(..., better=...)`) and
written to `summary.json`; `better_of` is the rule for metrics recorded without it (and runs
written before directions were recorded): accuracies, F1, throughput and MFU improve upwards,
every other metric (losses, perplexity, bits per byte) downwards.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

LOSS_SECTION = "loss"

# every metric llmtrain itself logs without a section (train-loop's Trainer, its built-in
# callbacks and `loss_spike`), by the section it is shown in
DASHBOARD_NAMES: dict[str, str] = {
    "loss": "loss/train",
    "eval_loss": "loss/eval",
    "eval_ppl": "loss/eval_ppl",
    "eval_bpb": "loss/eval_bpb",
    "peak_memory_mib": "memory/peak_mib",
    "active_memory_mib": "memory/active_mib",
    "reserved_memory_mib": "memory/reserved_mib",
    "lr": "optim/lr",
    "grad_norm": "optim/grad_norm",
    "loss_spike": "optim/loss_spike",
    "loss_spike_ratio": "optim/loss_spike_ratio",
    "loss_spikes": "optim/loss_spikes",
    "tokens_per_s": "perf/tokens_per_s",
    "step_time_s": "perf/step_time_s",
    "mfu": "perf/mfu",
    "data_wait": "perf/data_wait",
    "sync_wait": "perf/sync_wait",
    "data_wait_max": "perf/data_wait_max",
    "slowest_rank": "perf/slowest_rank",
    "tokens": "progress/tokens",
    "loss_tokens": "progress/loss_tokens",
}

# sections renamed so that none of llmtrain's own sorts before `loss/`
RENAMED_SECTIONS = {"downstream/": "tasks/"}


def dashboard_name(metric: str) -> str:
    """The dashboard name of a metric: `loss` -> `loss/train`, `eval_loss` -> `loss/eval`,
    `lr` -> `optim/lr`, ... (`DASHBOARD_NAMES`); `downstream/x` -> `tasks/x`; another name with a
    `/` is kept (it chose its own section); anything else -> `other/<name>`."""
    if metric in DASHBOARD_NAMES:
        return DASHBOARD_NAMES[metric]
    for old, new in RENAMED_SECTIONS.items():
        if metric.startswith(old):
            return new + metric.removeprefix(old)
    if "/" in metric:
        return metric
    return "other/" + metric


def dashboard_metrics(metrics: Mapping[str, float]) -> dict[str, float]:
    """A logged step's metrics under their dashboard names, the loss section first and the rest
    in name order (the order a logger that lists keys as it gets them shows them in)."""
    named = {dashboard_name(name): value for name, value in metrics.items()}
    first = LOSS_SECTION + "/"
    return {k: named[k] for k in sorted(named, key=lambda k: (not k.startswith(first), k))}


# a metric improves upwards when its last part starts with one of these (acc, acc_norm, f1, ...)
HIGHER_IS_BETTER = ("acc", "f1", "exact_match", "mcc", "mfu", "tokens_per_s")


def better_of(metric: str) -> Literal["higher", "lower"]:
    """`downstream/hellaswag/acc_norm`: higher; `eval_loss`, `downstream/wiki/bits_per_byte`:
    lower (the rule for metrics recorded without a direction)."""
    return "higher" if metric.rsplit("/", 1)[-1].startswith(HIGHER_IS_BETTER) else "lower"
