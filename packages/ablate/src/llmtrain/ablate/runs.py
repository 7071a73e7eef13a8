"""Reading finished (or running) runs back: a run directory holds `config.yaml` (the resolved
config), `metrics.jsonl` and, once the run has ended, `summary.json`. `llmtrain compare` and
`llmtrain plot` take run directories, sweep directories (with `manifest.json`) or any folder of
runs; this module finds the runs, reads them and works out which settings differ.

Downstream evaluation logs `downstream/<task>/<metric>` (e.g. `downstream/hellaswag/acc_norm`),
an accuracy's standard error beside it as `<metric>_stderr`, on the steps it ran."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeGuard

import attrs
import yaml

from llmtrain.core_mesh.errors import UserError
from llmtrain.core_mesh.metric_names import better_of

# keys that name where a run lives, not what it does
PLACE_KEYS = ("name", "run_dir", "checkpoint.dir")
SEED_KEYS = ("seed", "data.seed")
DOWNSTREAM = "downstream/"
# what `llmtrain eval-tasks` writes into the run directory of the checkpoint it scored:
# {"format": 1, "evaluations": [{"step": N, "tasks": {"<task>": {"acc": .., "acc_stderr": ..,
# "items": .., "shots": .., ...}}}]}, one entry per step (rewritten whole, atomically)
EVAL_TASKS = "eval_tasks.json"
# how eval-tasks scored a task, recorded beside its scores (not metrics)
EVAL_TASKS_SETTINGS = ("shots", "seed", "limit", "max_len")
STDERR = "_stderr"  # `<metric>_stderr`: the standard error of `<metric>`, logged beside it
# logged beside a task's metrics, not results: items whose context was cut, time taken
BOOKKEEPING = ("truncated", "items", "seconds")


@attrs.frozen
class Run:
    path: Path
    config: dict[str, Any]
    metrics: list[dict[str, Any]]
    summary: dict[str, Any] | None

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def settings(self) -> dict[str, Any]:
        """The config flattened to dotted keys (lists by index). (Values typed Any: YAML values
        that the readers use as the numbers a swept key holds.)"""
        return flatten(self.config)

    def series(self, key: str, x: str = "step") -> tuple[list[float], list[float]]:
        """(x values, values) of one metric over the logged steps that have it. A line without
        `x` (a metric logged on a line of its own) takes it from a line of the same step."""
        at_step = {m["step"]: m[x] for m in self.metrics if x in m}
        xs: list[float] = []
        values: list[float] = []
        for m in self.metrics:
            if key in m:
                at = m.get(x, at_step.get(m["step"]))
                if at is not None:
                    xs.append(at)
                    values.append(m[key])
        return xs, values

    @property
    def status(self) -> str:
        if self.summary is not None:
            return str(self.summary.get("status", "unknown"))
        return "incomplete" if self.metrics else "not started"

    @property
    def finished(self) -> bool:
        return self.summary is not None and self.summary.get("status") == "finished"


def read_run(path: str | Path) -> Run:
    path = Path(path)
    config_file = path / "config.yaml"
    try:
        config = yaml.safe_load(config_file.read_text(encoding="utf-8")) or {}
    except OSError as exc:
        raise UserError(f"{path}: not a run directory (cannot read config.yaml: {exc})") from None
    except yaml.YAMLError as exc:
        raise UserError(f"{config_file}: not valid YAML ({exc})") from None
    metrics = read_metrics(path / "metrics.jsonl")
    return Run(path, config, with_eval_tasks(metrics, read_eval_tasks(path)), read_summary(path))


def read_eval_tasks(path: Path) -> list[dict[str, Any]]:
    """The scores `llmtrain eval-tasks` wrote into the run directory (`EVAL_TASKS`), as lines
    like the downstream callback's: `{"step": N, "downstream/<task>/<metric>": value, ...,
    "source": "eval-tasks"}`, one per evaluated step, in step order. A missing or unreadable
    file is no scores."""
    try:
        document = json.loads((path / EVAL_TASKS).read_text(encoding="utf-8"))
        evaluations = document["evaluations"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    lines = []
    for evaluation in evaluations if isinstance(evaluations, list) else []:
        if not isinstance(evaluation, dict) or not is_number(evaluation.get("step")):
            continue
        line: dict[str, Any] = {"step": evaluation["step"]}
        for task, scores in (evaluation.get("tasks") or {}).items():
            for metric, value in (scores if isinstance(scores, dict) else {}).items():
                if is_number(value) and metric not in EVAL_TASKS_SETTINGS:
                    line[f"{DOWNSTREAM}{task}/{metric}"] = value
        if len(line) > 1:
            lines.append({**line, "source": "eval-tasks"})
    return sorted(lines, key=lambda line: line["step"])


def with_eval_tasks(
    metrics: list[dict[str, Any]], scores: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The logged lines with eval-tasks' score lines among them in step order (each after the
    logged lines of its step). A score the run's own downstream callback logged at the same
    step is kept, and eval-tasks' value for it left out."""
    if not scores:
        return metrics
    logged: dict[object, set[str]] = {}
    for m in metrics:
        logged.setdefault(m["step"], set()).update(m)
    extra = []
    for line in scores:
        kept = {
            k: v for k, v in line.items() if k not in logged.get(line["step"], ()) or k == "step"
        }
        if any(k.startswith(DOWNSTREAM) for k in kept):
            extra.append(kept)
    out = list(metrics)
    for line in extra:  # in step order: each goes after the last logged line of its step
        at = len(out)
        while at > 0 and not _before(out[at - 1]["step"], line["step"]):
            at -= 1
        out.insert(at, line)
    return out


def _before(step: object, other: object) -> bool:
    """Whether a line of `step` goes before one of `other` (steps that are not numbers: yes)."""
    return not (is_number(step) and is_number(other)) or step <= other


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The logged lines in order; a half-written last line (a killed run) is left out."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and "step" in row:
            rows.append(row)
    return rows


def read_summary(path: Path) -> dict[str, Any] | None:
    try:
        summary: dict[str, Any] = json.loads((path / "summary.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return summary  # the JSON object train-loop writes


def find_runs(paths: Sequence[str | Path]) -> list[Run]:
    """The runs named by `paths`: a run directory, a sweep (its manifest's runs, in order), or
    a folder whose sub-folders are runs (sorted by name)."""
    runs: list[Run] = []
    seen: set[Path] = set()
    for given in paths:
        path = Path(given)
        if not path.is_dir():
            raise UserError(f"{path}: no such run or sweep directory")
        if (path / "config.yaml").exists():
            found = [path]
        elif (path / "manifest.json").exists():
            manifest = json.loads((path / "manifest.json").read_text(encoding="utf-8"))
            found = [path / run["id"] for run in manifest.get("runs", [])]
            found = [p for p in found if (p / "config.yaml").exists()]
        else:
            found = sorted(p for p in path.iterdir() if (p / "config.yaml").exists())
        if not found:
            raise UserError(
                f"{path}: holds no runs (a run directory has config.yaml; a sweep manifest.json)"
            )
        for run_path in found:
            if run_path.resolve() not in seen:
                seen.add(run_path.resolve())
                runs.append(read_run(run_path))
    return runs


def higher_is_better(metric: str, runs: Iterable[Run] = ()) -> bool:
    """Whether `metric` improves upwards: as the first of `runs` that recorded its direction
    says (summary.json's `better`, written by the run from where the metric was recorded),
    else by core-mesh's rule for the name (`better_of`: accuracies, F1, throughput, MFU up;
    losses, perplexity, bits per byte down)."""
    for run in runs:
        recorded = (run.summary or {}).get("better")
        said = recorded.get(metric) if isinstance(recorded, dict) else None
        if said in ("higher", "lower"):
            return bool(said == "higher")
    return better_of(metric) == "higher"


def is_number(value: object) -> TypeGuard[float]:  # int or float, not bool
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def eval_set_losses(runs: Sequence[Run]) -> list[str]:
    """The `eval/<name>/loss` of each named held-out set any of the runs logged, sorted (a run
    with `data.eval` as a list logs one per set)."""
    names = {
        key
        for run in runs
        for m in run.metrics
        for key, value in m.items()
        if key.startswith("eval/") and key.endswith("/loss") and is_number(value)
    }
    return sorted(names)


def downstream_metrics(runs: Sequence[Run]) -> list[str]:
    """The `downstream/<task>/<metric>` names any of the runs logged, sorted. Left out: the
    `_stderr` companions (they go beside their metric) and the bookkeeping (`BOOKKEEPING`,
    `downstream/seconds`)."""
    names = {
        key
        for run in runs
        for m in run.metrics
        for key, value in m.items()
        if key.startswith(DOWNSTREAM) and is_number(value) and _is_task_metric(key)
    }
    return sorted(names)


def _is_task_metric(key: str) -> bool:
    parts = key.split("/")
    return len(parts) >= 3 and parts[-1] not in BOOKKEEPING and not key.endswith(STDERR)


def flatten(value: object, prefix: str = "") -> dict[str, object]:
    """{"a": {"b": [1, {"c": 2}]}} -> {"a.b.0": 1, "a.b.1.c": 2}."""
    if isinstance(value, dict) and value:
        out: dict[str, object] = {}
        for key, sub in value.items():
            out.update(flatten(sub, f"{prefix}{key}."))
        return out
    if isinstance(value, list) and value:
        out = {}
        for i, sub in enumerate(value):
            out.update(flatten(sub, f"{prefix}{i}."))
        return out
    return {prefix[:-1]: value}


def varied_keys(runs: Sequence[Run]) -> list[str]:
    """Dotted keys whose value differs between the runs (where they live excluded), in config
    order, the seeds last."""
    flat = [run.settings for run in runs]
    keys = list(dict.fromkeys(k for f in flat for k in f))
    missing = object()
    varied = [
        k
        for k in keys
        if not k.startswith(PLACE_KEYS) and len({_key(f.get(k, missing)) for f in flat}) > 1
    ]
    return [k for k in varied if k not in SEED_KEYS] + [k for k in varied if k in SEED_KEYS]


def _key(value: object) -> str:
    return json.dumps(value, sort_keys=True, default=repr)


def short_keys(keys: Iterable[str]) -> dict[str, str]:
    """Each dotted key's shortest trailing part that no other key ends with:
    model.n_layers -> n_layers, but data.train.0.weight and data.train.1.weight keep 0./1."""
    keys = list(keys)
    short = {}
    for key in keys:
        parts = key.split(".")
        for n in range(1, len(parts) + 1):
            tail = ".".join(parts[-n:])
            if not any(
                other != key and (other == tail or other.endswith("." + tail)) for other in keys
            ):
                break
        short[key] = tail
    return short


def shown(value: object) -> str:
    """A compact text for a setting's value: 0.0003, 4, [0.2, 0.8] -> 0.2-0.8."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:g}" if math.isfinite(value) else str(value)
    if isinstance(value, (list, tuple)):
        return "-".join(shown(v) for v in value)
    if isinstance(value, dict):
        return "-".join(f"{k}:{shown(v)}" for k, v in value.items())
    return "null" if value is None else str(value)


def label(settings: Mapping[str, object], short: dict[str, str]) -> str:
    return " ".join(f"{short.get(k, k)}={shown(v)}" for k, v in settings.items()) or "base"


def group_by_settings(
    runs: Sequence[Run], keys: Sequence[str]
) -> list[tuple[dict[str, object], list[Run]]]:
    """Runs that differ only in their seeds, together (first-seen order)."""
    groups: dict[str, tuple[dict[str, object], list[Run]]] = {}
    for run in runs:
        flat = run.settings
        settings = {k: flat.get(k) for k in keys if k not in SEED_KEYS}
        groups.setdefault(_key(settings), (settings, []))[1].append(run)
    return list(groups.values())


_UNSAFE = re.compile(r"[^A-Za-z0-9._=+,-]+")


def safe_name(text: str) -> str:
    return _UNSAFE.sub("_", text).strip("_") or "base"
