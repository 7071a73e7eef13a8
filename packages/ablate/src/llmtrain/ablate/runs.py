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
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeGuard

import attrs
import yaml

from llmtrain.core_mesh.errors import UserError
from llmtrain.core_mesh.metric_names import better_of

# keys that name where a run lives, not what it does
PLACE_KEYS = ("name", "run_dir", "checkpoint.dir", "checkpoint.steps")
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
# summary.json's numbers (train-loop's summary callback): each a number or null; any other value
# makes the run damaged (left out, named), not a crash in `compare` or `fit` later on
SUMMARY_NUMBERS = (
    "step",
    "total_steps",
    "tokens",
    "wall_time_s",
    "world_size",
    "params",
    "non_embedding_params",
    "flops_per_token",
)


class DamagedFile(UserError):
    """A run's or a sweep's file that cannot be read as what it should hold: `file`, and
    `problem`, what is wrong with it (a `UserError`: alone, its message is one clean line)."""

    def __init__(self, file: Path, problem: str) -> None:
        super().__init__(f"{file}: {problem}")
        self.file = file
        self.problem = problem


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
    """The run in `path`. A file that is there but cannot be read (not UTF-8, not YAML or JSON,
    a folder, the wrong shape: `read_config`, `read_metrics`, `checked_summary`) raises
    `DamagedFile` naming it."""
    path = Path(path)
    config = read_config(path)
    metrics = read_metrics(path / "metrics.jsonl")
    return Run(path, config, with_eval_tasks(metrics, read_eval_tasks(path)), checked_summary(path))


def read_config(path: Path) -> dict[str, Any]:
    """The run's config.yaml: a mapping (empty: {})."""
    config_file = path / "config.yaml"
    if not config_file.exists():
        raise UserError(f"{path}: not a run directory (it has no config.yaml)")
    try:
        config = yaml.safe_load(read_text(config_file)) or {}
    except yaml.YAMLError as exc:
        problem = " ".join(str(exc).split())  # one line
        raise DamagedFile(config_file, f"not valid YAML ({problem})") from None
    if not isinstance(config, dict):
        raise DamagedFile(config_file, f"holds {_kind(config)}, not a mapping of settings")
    return config


def read_text(file: Path) -> str:
    """`file`'s text (UTF-8); `DamagedFile` when it cannot be read (a folder, not UTF-8)."""
    try:
        return file.read_text(encoding="utf-8")
    except OSError as exc:
        raise DamagedFile(file, f"cannot be read ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        raise DamagedFile(file, f"not UTF-8 text (byte {exc.start})") from None


def read_json(file: Path) -> object:
    """`file`'s JSON document; `DamagedFile` when it cannot be read or is not JSON (cut short)."""
    text = read_text(file)
    try:
        return json.loads(text)
    except ValueError as exc:
        raise DamagedFile(file, f"not valid JSON, cut short? ({exc})") from None


def _kind(value: object) -> str:
    """'a list', 'a string', ...: what a JSON or YAML document holds instead."""
    kinds = {list: "a list", str: "a string", bool: "true/false", type(None): "null"}
    return kinds.get(type(value), "a number" if is_number(value) else type(value).__name__)


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
    """The logged lines in order; a half-written last line (a killed run) is left out, and so
    is a line that is not JSON (a resumed run appends after its half-written line). A file that
    cannot be read, or whose lines before the last are not UTF-8, raises `DamagedFile`."""
    if not path.exists():
        return []
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise DamagedFile(path, f"cannot be read ({exc.strerror or exc})") from None
    lines = data.splitlines()
    rows = []
    for at, raw in enumerate(lines):
        try:
            row = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as exc:
            if at == len(lines) - 1:
                continue  # cut in the middle of a character
            raise DamagedFile(path, f"not UTF-8 text (line {at + 1}, byte {exc.start})") from None
        except ValueError:
            continue
        if isinstance(row, dict) and "step" in row:
            rows.append(row)
    return rows


def read_summary(path: Path) -> dict[str, Any] | None:
    """`path`'s summary.json, None when absent or not a JSON object (lenient: for `sweep`,
    which reads whether a run finished; the analysis commands read `checked_summary`)."""
    try:
        summary = read_json(path / "summary.json")
    except DamagedFile:
        return None
    return summary if isinstance(summary, dict) else None


def checked_summary(path: Path) -> dict[str, Any] | None:
    """`path`'s summary.json, None when absent (running or killed); `DamagedFile` when it cannot
    be read, is not a JSON object or holds a non-number in one of `SUMMARY_NUMBERS`."""
    file = path / "summary.json"
    if not file.exists():
        return None
    summary = read_json(file)
    if not isinstance(summary, dict):
        raise DamagedFile(file, f"holds {_kind(summary)}, not a JSON object")
    wrong = [
        f"{key} {summary[key]!r}"
        for key in SUMMARY_NUMBERS
        if summary.get(key) is not None and not is_number(summary[key])
    ]
    if wrong:
        raise DamagedFile(file, f"not a number: {', '.join(wrong)}")
    return summary


def read_manifest(path: Path) -> list[str]:
    """The run ids of the sweep in `path`, in order: manifest.json's `runs`, each `{"id": ...}`.
    A manifest that cannot be read, or is not of that shape, is a `UserError`."""
    file = path / "manifest.json"
    try:
        manifest = read_json(file)
    except DamagedFile as exc:
        raise UserError(f"{exc}; the sweep's list of runs is lost: {_MANIFEST_FIX}") from None
    runs = manifest.get("runs", []) if isinstance(manifest, dict) else None
    if not isinstance(runs, list) or not all(
        isinstance(run, dict) and isinstance(run.get("id"), str) and run["id"] for run in runs
    ):
        raise UserError(
            f'{file}: not a sweep manifest ({{"runs": [{{"id": "<run>"}}, ...]}}): {_MANIFEST_FIX}'
        )
    return [run["id"] for run in runs]


_MANIFEST_FIX = "restore it, or give the run directories (or the sweep's folder without it)"


def find_runs(paths: Sequence[str | Path]) -> list[Run]:
    """The runs named by `paths`: a run directory, a sweep (its manifest's runs, in order), or
    a folder whose sub-folders are runs (sorted by name). A damaged run (a file of it that
    cannot be read: `DamagedFile`) is left out, and all of them named in one `warning:` line on
    stderr; none readable left, or a damaged manifest.json, is a `UserError`."""
    runs: list[Run] = []
    damaged: list[DamagedFile] = []
    seen: set[Path] = set()
    for given in paths:
        path = Path(given)
        if not path.is_dir():
            raise UserError(f"{path}: no such run or sweep directory")
        if (path / "config.yaml").exists():
            found = [path]
        elif (path / "manifest.json").exists():
            found = [path / run for run in read_manifest(path)]
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
                try:
                    runs.append(read_run(run_path))
                except DamagedFile as exc:
                    damaged.append(exc)
    if damaged and not runs:
        raise UserError(
            f"no readable run: {'; '.join(map(str, damaged))}; repair or remove these files "
            "(or re-run those runs)"
        )
    if damaged:
        left_out = "; ".join(map(str, damaged))
        print(f"warning: {len(damaged)} damaged run(s) left out: {left_out}", file=sys.stderr)
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
    flat = [_what_it_trains(run.settings) for run in runs]
    keys = list(dict.fromkeys(k for f in flat for k in f))
    missing = object()
    varied = [
        k
        for k in keys
        if not k.startswith(PLACE_KEYS) and len({_key(f.get(k, missing)) for f in flat}) > 1
    ]
    return [k for k in varied if k not in SEED_KEYS] + [k for k in varied if k in SEED_KEYS]


def _what_it_trains(settings: Mapping[str, object]) -> dict[str, object]:
    """A run's settings without where it went on from: a decay branch of a ladder
    (`init.state: all`) trains what its rung trained alone, so its `init` is no setting, and
    nor is a run's `init: null`."""
    branch = settings.get("init.state") == "all"
    return {
        k: v
        for k, v in settings.items()
        if not (k == "init" and v is None) and not (branch and k.startswith("init."))
    }


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
