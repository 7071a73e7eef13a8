"""A sweep's runs: axes (`--grid`, `--zip`, `--seeds`, a ladder's rungs) expanded into run ids and
settings, every run's resolved config checked before anything is written, and the sweep's
directory written (each run's config.yaml and `manifest.json`)."""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import yaml

from llmtrain.ablate.files import write_atomically
from llmtrain.ablate.runs import flatten, safe_name, short_keys, shown
from llmtrain.core_mesh.config import (
    ConfigError,
    ConfigValueError,
    PathParts,
    Problem,
    apply_overrides,
    dump_config,
    key_path,
    make_converter,
    parse_override,
    parse_yaml,
    read_config_text,
    set_value,
    structure,
)
from llmtrain.core_mesh.errors import UserError
from llmtrain.core_mesh.mesh import MeshError
from llmtrain.core_mesh.plugins import PluginManager
from llmtrain.core_mesh.redact import redact, redacted_paths, refuse_redacted
from llmtrain.train_loop.model_source import with_model_source
from llmtrain.train_loop.run_config import (
    RunConfig,
    place_problem,
    resolved,
    run_path_problems,
)

WEIGHTS = "data.weights"  # one list per run: the weight of each dataset in data.train, in order
MAX_ID = 100


@attrs.frozen
class Axis:
    """Keys that step together (one key for --grid, all --zip keys for the zip axis, a ladder
    rung's shape and steps)."""

    keys: tuple[str, ...]
    rows: list[tuple[object, ...]]
    flags: tuple[str, ...]  # the command-line text of each key, for errors
    # what run ids show of each row instead of its keys' values (a ladder rung: `C=1e15,r=20`)
    labels: list[dict[str, object]] | None = None


@attrs.frozen
class PlannedRun:
    id: str
    settings: dict[str, object]
    config: RunConfig
    text: str  # the resolved config as written

    def path(self, sweep_dir: Path) -> Path:
        return sweep_dir / self.id


def parse_axis_values(text: str, flag: str, *, distinct: bool = True) -> tuple[str, list[object]]:
    """`model.n_layers=2,4,8` -> ("model.n_layers", [2, 4, 8]). Values are YAML, so lists and
    quoted strings work: `data.weights=[0.2,0.8],[0.5,0.5]`."""
    key, sep, values = text.partition("=")
    key = key.strip()
    where = f"{flag} {text!r}"
    if not sep or not key or not values.strip():
        raise UserError(f"{where}: write it as key.path=value1,value2,...")
    if any(part == "" for part in key.split(".")):
        raise UserError(f"{where}: empty key in the dotted path")
    try:
        parsed = parse_yaml(f"[{values}]", where)
    except ConfigError as exc:
        raise UserError(
            f"{where}: the values are not a YAML list ({exc.problems[0].message})"
        ) from None
    if not isinstance(parsed, list) or not parsed:
        raise UserError(f"{where}: give at least one value after '='")
    if distinct and len(_distinct(parsed)) < len(parsed):
        raise UserError(f"{where}: a value is given twice")
    return key, [_plain(v) for v in parsed]


def _distinct(values: Sequence[object]) -> set[str]:
    return {json.dumps(v, sort_keys=True, default=repr) for v in values}


def _plain(value: object) -> object:
    """Parsed YAML (dict/list subclasses that remember lines) as plain data."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def axes_from(grid: Sequence[str], zipped: Sequence[str], seeds: int | None) -> list[Axis]:
    axes, keys = [], set()

    def claim(key: str, flag: str) -> None:
        if key in keys:
            raise UserError(f"{flag}: {key} is swept twice")
        keys.add(key)

    for text in grid:
        key, values = parse_axis_values(text, "--grid")
        claim(key, f"--grid {text!r}")
        axes.append(Axis((key,), [(v,) for v in values], (f"--grid {text!r}",)))
    if zipped:
        # one list may repeat a value; the zipped rows may not
        parsed = [parse_axis_values(text, "--zip", distinct=False) for text in zipped]
        lengths = {len(values) for _, values in parsed}
        if len(lengths) > 1:
            sizes = ", ".join(f"{key} has {len(values)}" for key, values in parsed)
            raise UserError(f"--zip: the zipped lists must have the same length: {sizes}")
        for (key, _), text in zip(parsed, zipped, strict=True):
            claim(key, f"--zip {text!r}")
        rows = list(zip(*(values for _, values in parsed), strict=True))
        if len(_distinct([list(r) for r in rows])) < len(rows):
            raise UserError("--zip: two zipped rows are the same run")
        axes.append(
            Axis(
                tuple(key for key, _ in parsed),
                rows,
                tuple(f"--zip {text!r}" for text in zipped),
            )
        )
    if seeds is not None:
        if seeds < 1:
            raise UserError(f"--seeds must be at least 1, got {seeds}")
        claim("seed", "--seeds")
        axes.append(Axis(("seed",), [(s,) for s in range(seeds)], (f"--seeds {seeds}",)))
    return axes


def expand(axes: Sequence[Axis], *, labelled: bool = False) -> list[dict[str, object]]:
    """The product of the axes, the last varying fastest: one {key: value} per run.
    `labelled`: what each run's id shows instead (an axis's labels where it has them)."""
    runs = []
    for combo in itertools.product(*(range(len(axis.rows)) for axis in axes)):
        settings: dict[str, object] = {}
        for axis, i in zip(axes, combo, strict=True):
            if labelled and axis.labels is not None:
                settings.update(axis.labels[i])
            else:
                settings.update(zip(axis.keys, axis.rows[i], strict=True))
        runs.append(settings)
    return runs


def run_ids(runs: Sequence[Mapping[str, object]]) -> list[str]:
    """Readable ids from what varies (`n_layers=4,lr=0.001,seed=0`); long or clashing ones get
    a hash of their settings."""
    keys = list(dict.fromkeys(k for settings in runs for k in settings))
    short = short_keys(keys)
    ids = []
    for settings in runs:
        text = ",".join(f"{short[k]}={shown(v)}" for k, v in settings.items())
        ids.append(safe_name(text) if text else "base")
    clashing = {run_id for run_id in ids if ids.count(run_id) > 1}
    for i, (run_id, settings) in enumerate(zip(list(ids), runs, strict=True)):
        if len(run_id) > MAX_ID or run_id in clashing:
            digest = hashlib.sha256(
                json.dumps(settings, sort_keys=True, default=repr).encode()
            ).hexdigest()[:8]
            ids[i] = f"{run_id[: MAX_ID - 9]}-{digest}"
    return ids


def plan(
    base: str,
    axes: Sequence[Axis],
    *,
    name: str,
    sweep_dir: Path,
    plugins: PluginManager,
    world_size: int,
    overrides: Sequence[str] = (),
    extra: Mapping[str, tuple[str, Mapping[str, object]]] | None = None,
) -> list[PlannedRun]:
    """Every run's resolved config, all checked; one ConfigError lists every problem.
    `overrides` (`KEY=VALUE`, as `llmtrain run` takes them) change the base before the axes;
    `extra`: by run id, (the flag that sets them, keys set after its settings) that are no
    setting of the run (not in its id or the manifest's settings: a ladder's decay branches)."""
    flags = {key: flag for axis in axes for key, flag in zip(axis.keys, axis.flags, strict=True)}
    _check_not_swept(overrides, flags)
    base_raw, base_overridden = read_base(base, overrides)
    refuse_redacted(base_raw, base)
    all_settings = expand(axes)
    ids = run_ids(expand(axes, labelled=True))
    converter = make_converter(plugins)
    problems: dict[str, Problem] = {}
    planned = []
    for run_id, settings in zip(ids, all_settings, strict=True):
        raw = copy.deepcopy(base_raw)
        overridden: dict[PathParts, str] = dict(base_overridden)
        try:
            for key, value in settings.items():
                for path, item in _assignments(raw, key, value, flags[key]):
                    set_value(raw, path, copy.deepcopy(item), where=flags[key])
                    overridden[path] = flags[key]
            flag, keys = (extra or {}).get(run_id, ("", {}))
            for key, value in keys.items():
                set_value(raw, key_path(key), copy.deepcopy(value), where=flag)
                overridden[key_path(key)] = flag
            _refuse_credentials(raw, base)
            _place(raw, run_id, sweep_dir)
            expanded = with_model_source(raw, plugins, base)
            config = structure(
                expanded,
                RunConfig,
                plugins=plugins,
                source=base,
                overridden=overridden,
                check=lambda config: _place_problems(config, plugins),
            )
            config = resolved(config, plugins)
            _check_layout(config, world_size, base)
        except ConfigError as exc:
            for problem in exc.problems:
                problems.setdefault(str(problem), problem)
            continue
        planned.append(
            PlannedRun(run_id, settings, config, dump_config(config, converter=converter))
        )
    if problems:
        raise ConfigError(list(problems.values()), f"sweep {name} (base {base})")
    return planned


def read_base(
    base: str, overrides: Sequence[str] = ()
) -> tuple[dict[str, object], dict[PathParts, str]]:
    """The base config as parsed YAML with the overrides applied, and where each overridden path
    was set."""
    base_raw = parse_yaml(read_config_text(base), base) or {}
    if not isinstance(base_raw, dict):
        raise ConfigError([Problem((), "a run config is a mapping")], base)
    _, overridden = apply_overrides(base_raw, overrides)  # a mapping: set in place
    return base_raw, overridden


def _place_problems(config: RunConfig, plugins: PluginManager) -> list[Problem]:
    """What is wrong with where a run of the sweep writes, but its directory (the sweep's, which
    `check_sweep_dir` checks against --dir): a logger's path, a local checkpoint.dir."""
    problems = run_path_problems(config, plugins, writable=False)
    return [p for p in problems if p.path[:1] not in (("run_dir",), ("name",))]


def check_sweep_dir(
    planned: Sequence[PlannedRun], sweep_dir: Path, flag: str, *, writable: bool
) -> None:
    """The sweep's directory and each run's directory in it can be (and, `writable`, can be
    written here), before anything is written."""
    for path in (sweep_dir, *(run.path(sweep_dir) for run in planned)):
        message = place_problem(path, "directory", writable=writable)
        if message is not None:
            raise UserError(f"{flag}: {message}")


def _refuse_credentials(raw: Mapping[str, object], source: str) -> None:
    """Credentials in a run's config are refused: the sweep writes each run's config.yaml and
    the run reads it back, but a config.yaml never holds credentials (the run writes it again
    redacted, and a resumed or requeued run would find the marker)."""
    found = redacted_paths(redact(raw))
    if found:
        raise UserError(
            f"{source}: {', '.join(found)}: a sweep cannot carry credentials in its runs' "
            "configs; pass them through the environment (AWS_ACCESS_KEY_ID, "
            "AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN or AWS_PROFILE for S3) and delete these "
            "keys"
        )


def _check_not_swept(overrides: Sequence[str], flags: dict[str, str]) -> None:
    """An override of a key that an axis sets would be replaced in every run: refused."""
    swept = {key_path(key): flag for key, flag in flags.items()}
    for text in overrides:
        path, _ = parse_override(text)
        if WEIGHTS in flags and _is_dataset_weight(path):
            path = key_path(WEIGHTS)  # data.weights sets each data.train entry's weight
        if path in swept:
            raise UserError(
                f"{text!r} sets a key that {swept[path]} sweeps: drop the override or the axis"
            )


def _is_dataset_weight(path: PathParts) -> bool:
    """`data.train.<i>.weight`: a weight that `data.weights` sets."""
    return len(path) == 4 and path[:2] == ("data", "train") and path[3] == "weight"


def _assignments(
    raw: dict[str, Any], key: str, value: object, flag: str
) -> list[tuple[PathParts, object]]:
    """(path, value) pairs a swept key sets; `data.weights` sets each dataset's weight."""
    if key != WEIGHTS:
        return [(key_path(key), value)]
    train = raw.get("data", {}).get("train") if isinstance(raw.get("data"), dict) else None
    if not isinstance(train, list) or not train:
        raise ConfigError([Problem(("data", "train"), "no dataset list to weight", flag)])
    if not isinstance(value, list) or len(value) != len(train):
        raise ConfigError(
            [
                Problem(
                    ("data", "weights"),
                    f"each value must list {len(train)} weights (one per data.train entry), "
                    f"got {value!r}",
                    flag,
                )
            ]
        )
    return [(("data", "train", i, "weight"), weight) for i, weight in enumerate(value)]


def _place(raw: dict[str, object], run_id: str, sweep_dir: Path) -> None:
    """Each run lives in <sweep dir>/<run id>; a shared checkpoint.dir gets the same suffix."""
    raw["name"] = run_id
    raw["run_dir"] = str(sweep_dir)
    checkpoint = raw.get("checkpoint")
    if isinstance(checkpoint, dict) and checkpoint.get("dir"):
        checkpoint["dir"] = run_checkpoint_dir(str(checkpoint["dir"]), run_id, sweep_dir)


def run_checkpoint_dir(shared_dir: str, run_id: str, sweep_dir: Path) -> str:
    """A run's checkpoint directory under a `checkpoint.dir` the sweep's runs share."""
    return f"{shared_dir.rstrip('/')}/{sweep_dir.name}/{run_id}"


def _check_layout(config: RunConfig, world_size: int, source: str) -> None:
    try:
        dp = config.mesh.resolve(world_size).dp
    except MeshError as exc:
        raise ConfigError([Problem(("mesh",), str(exc), source)], source) from None
    try:
        config.data.batch_sizes(dp)
    except ConfigValueError as exc:
        raise ConfigError([Problem(("data", exc.field), str(exc), source)], source) from None


def write(planned: Sequence[PlannedRun], sweep_dir: Path, meta: Mapping[str, object]) -> None:
    """Each run's config.yaml (kept if the run exists with the same config; a run that exists
    with another config is an error, before anything is written) and manifest.json."""
    clashes = []
    for run in planned:
        existing = run.path(sweep_dir) / "config.yaml"
        if existing.exists():
            old = flatten(yaml.safe_load(existing.read_text(encoding="utf-8")) or {})
            new = flatten(yaml.safe_load(run.text))
            changed = [k for k in dict.fromkeys([*old, *new]) if old.get(k) != new.get(k)]
            if changed:
                clashes.append(f"{run.id} (differs in {', '.join(changed[:5])})")
    if clashes:
        raise UserError(
            f"sweep {sweep_dir} already has runs with other configs: {'; '.join(clashes)}. "
            "The base config or a value changed since; give the sweep another --name, or delete "
            "those runs"
        )
    sweep_dir.mkdir(parents=True, exist_ok=True)
    for run in planned:
        path = run.path(sweep_dir)
        path.mkdir(exist_ok=True)
        if not (path / "config.yaml").exists():
            write_atomically(path / "config.yaml", run.text)
    manifest_file = sweep_dir / "manifest.json"
    entries: dict[str, dict[str, Any]] = {}
    if manifest_file.exists():
        for entry in json.loads(manifest_file.read_text(encoding="utf-8")).get("runs", []):
            entries[entry["id"]] = entry
    for run in planned:
        entries[run.id] = {"id": run.id, "settings": run.settings}
    varied = list(dict.fromkeys(k for e in entries.values() for k in e["settings"]))
    manifest = {**meta, "varied": varied, "runs": list(entries.values())}
    write_atomically(manifest_file, json.dumps(manifest, indent=1) + "\n")
