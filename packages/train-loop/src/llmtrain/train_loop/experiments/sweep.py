"""`llmtrain sweep`: an ablation as one command.

A base config, with `KEY=VALUE` overrides applied as `llmtrain run` applies them, and axes
(`--grid KEY=V1,V2` crossed with each other, `--zip KEY=V1,V2` stepped together, `--seeds N`,
and `--ladder`: model sizes and steps from compute budgets, see `ladder.py`) expand into runs.
Every run gets its own resolved config in `<dir>/<sweep>/<run-id>/config.yaml` (reproducible
alone: `llmtrain run` on it resumes or repeats it) and the sweep a `manifest.json`. All
configs are checked before anything runs. Then the runs go one after another here, or their
torchrun commands are printed, or a SLURM job-array script is written. A run whose
`summary.json` says finished is skipped; one with checkpoints resumes. A run started here dies
with the sweep (`lifetime.py`), so a killed sweep run again resumes its unfinished runs.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import hashlib
import itertools
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

import attrs
import yaml

from llmtrain.ablate.files import write_atomically
from llmtrain.ablate.runs import flatten, read_metrics, read_summary, safe_name, short_keys, shown
from llmtrain.core_mesh.cli import Context
from llmtrain.core_mesh.cli_conventions import main_object
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
from llmtrain.core_mesh.redact import redact, redacted_paths, refuse_redacted
from llmtrain.train_loop import lifetime
from llmtrain.train_loop.experiments import ladder
from llmtrain.train_loop.model_source import load_run_config, with_model_source
from llmtrain.train_loop.run_config import (
    RunConfig,
    place_problem,
    resolved,
    run_path_problems,
)

WEIGHTS = "data.weights"  # one list per run: the weight of each dataset in data.train, in order
MAX_ID = 100
# the CPU cores a SLURM task asks for per process: its own thread, data prefetch, checkpoint writes
CPUS_PER_PROCESS = 4
# the #SBATCH options that ask for GPUs or CPUs another way: given with --slurm, they replace
# what the script would ask for
GPU_OPTIONS = frozenset({"gpus-per-node", "gpus", "gpus-per-task", "gpus-per-socket", "gres"})
CPU_OPTIONS = frozenset({"cpus-per-task", "cpus-per-gpu", "mincpus"})


@attrs.frozen
class Axis:
    """Keys that step together (one key for --grid, all --zip keys for the zip axis, a ladder
    rung's shape and steps)."""

    keys: tuple[str, ...]
    rows: list[tuple[Any, ...]]
    flags: tuple[str, ...]  # the command-line text of each key, for errors
    # what run ids show of each row instead of its keys' values (a ladder rung: `C=1e15,r=20`)
    labels: list[dict[str, Any]] | None = None


@attrs.frozen
class PlannedRun:
    id: str
    settings: dict[str, Any]
    config: RunConfig
    text: str  # the resolved config as written

    def path(self, sweep_dir: Path) -> Path:
        return sweep_dir / self.id


def parse_axis_values(text: str, flag: str, *, distinct: bool = True) -> tuple[str, list[Any]]:
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


def _distinct(values: list[Any]) -> set[str]:
    return {json.dumps(v, sort_keys=True, default=repr) for v in values}


def _plain(value: Any) -> Any:
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


def expand(axes: Sequence[Axis], *, labelled: bool = False) -> list[dict[str, Any]]:
    """The product of the axes, the last varying fastest: one {key: value} per run.
    `labelled`: what each run's id shows instead (an axis's labels where it has them)."""
    runs = []
    for combo in itertools.product(*(range(len(axis.rows)) for axis in axes)):
        settings: dict[str, Any] = {}
        for axis, i in zip(axes, combo, strict=True):
            if labelled and axis.labels is not None:
                settings.update(axis.labels[i])
            else:
                settings.update(zip(axis.keys, axis.rows[i], strict=True))
        runs.append(settings)
    return runs


def run_ids(runs: Sequence[dict[str, Any]]) -> list[str]:
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
    plugins: Any,
    world_size: int,
    overrides: Sequence[str] = (),
) -> list[PlannedRun]:
    """Every run's resolved config, all checked; one ConfigError lists every problem.
    `overrides` (`KEY=VALUE`, as `llmtrain run` takes them) change the base before the axes."""
    base_raw = parse_yaml(read_config_text(base), base) or {}
    if not isinstance(base_raw, dict):
        raise ConfigError([Problem((), "a run config is a mapping")], base)
    flags = {key: flag for axis in axes for key, flag in zip(axis.keys, axis.flags, strict=True)}
    _check_not_swept(overrides, flags)
    base_raw, base_overridden = apply_overrides(base_raw, overrides)
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
            _refuse_credentials(raw, base)
            _place(raw, run_id, sweep_dir)
            raw = with_model_source(raw, plugins, base)
            config = structure(
                raw,
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


def _place_problems(config: RunConfig, plugins: Any) -> list[Problem]:
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


def _refuse_credentials(raw: dict[str, Any], source: str) -> None:
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
        if path in swept:
            raise UserError(
                f"{text!r} sets a key that {swept[path]} sweeps: drop the override or the axis"
            )


def _assignments(
    raw: dict[str, Any], key: str, value: Any, flag: str
) -> list[tuple[PathParts, Any]]:
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


def _place(raw: dict[str, Any], run_id: str, sweep_dir: Path) -> None:
    """Each run lives in <sweep dir>/<run id>; a shared checkpoint.dir gets the same suffix."""
    raw["name"] = run_id
    raw["run_dir"] = str(sweep_dir)
    checkpoint = raw.get("checkpoint")
    if isinstance(checkpoint, dict) and checkpoint.get("dir"):
        checkpoint["dir"] = f"{str(checkpoint['dir']).rstrip('/')}/{sweep_dir.name}/{run_id}"


def _check_layout(config: RunConfig, world_size: int, source: str) -> None:
    try:
        dp = config.mesh.resolve(world_size).dp
    except MeshError as exc:
        raise ConfigError([Problem(("mesh",), str(exc), source)], source) from None
    try:
        config.data.batch_sizes(dp)
    except ConfigValueError as exc:
        raise ConfigError([Problem(("data", exc.field), str(exc), source)], source) from None


# --- writing the sweep ---


def write(planned: Sequence[PlannedRun], sweep_dir: Path, meta: dict[str, Any]) -> None:
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


# --- launching ---


def run_command(config: Path, nproc: int, *, executable: bool) -> list[str]:
    """`llmtrain run CONFIG --resume`, under torchrun for several processes. `executable`: with
    this Python (`-m`), for running here; else the console scripts, for printing."""
    if nproc == 1:
        head = [sys.executable, "-m", "llmtrain"] if executable else ["llmtrain"]
    else:
        torchrun = [sys.executable, "-m", "torch.distributed.run"] if executable else ["torchrun"]
        head = [*torchrun, "--standalone", f"--nproc-per-node={nproc}", "-m", "llmtrain"]
    return [*head, "run", str(config), "--resume"]


def slurm_script(
    name: str,
    configs: Sequence[Path],
    *,
    nodes: int,
    nproc: int,
    gpus_per_node: int,
    options: Sequence[str],
    max_parallel: int | None,
    sweep_dir: Path,
) -> str:
    """A job array: task i runs configs[i] with torchrun on `nodes` nodes, one task per node
    with `gpus_per_node` GPUs (0: none) and CPUS_PER_PROCESS cores per process; `--slurm`
    options that ask for GPUs or CPUs themselves replace those. Preempted or requeued tasks
    resume from their checkpoints."""
    throttle = f"%{max_parallel}" if max_parallel else ""
    given = {option.partition("=")[0].lstrip("-") for option in options}
    resources = []
    if gpus_per_node and not given & GPU_OPTIONS:
        resources.append(f"#SBATCH --gpus-per-node={gpus_per_node}")
    if not given & CPU_OPTIONS:
        resources.append(f"#SBATCH --cpus-per-task={nproc * CPUS_PER_PROCESS}")
    lines = [
        "#!/bin/bash",
        f"# llmtrain sweep {name}: {len(configs)} runs, one array task each",
        f"#SBATCH --job-name={name}",
        f"#SBATCH --array=0-{len(configs) - 1}{throttle}",
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=1",
        *resources,
        f"#SBATCH --output={sweep_dir}/slurm-%A_%a.out",
        "#SBATCH --signal=B:USR1@300",
        "#SBATCH --requeue",
    ]
    for option in options:
        key, sep, value = option.partition("=")
        lines.append(f"#SBATCH --{key.lstrip('-')}{'=' + value if sep else ''}")
    lines += [
        "set -euo pipefail",
        f"cd {shlex.quote(str(Path.cwd()))}",
        "CONFIGS=(",
        *(f"  {shlex.quote(str(c))}" for c in configs),
        ")",
        'CONFIG="${CONFIGS[$SLURM_ARRAY_TASK_ID]}"',
        'nodes=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))',
        'head="${nodes[0]}"',
        "# 5 minutes before the time limit: SIGTERM reaches every rank through srun and torchrun,",
        "# each finishes its step, saves and exits; the task is requeued and resumes from there",
        "on_usr1() {",
        '    kill -TERM "$pid"; wait "$pid" || true',
        '    scontrol requeue "${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}"',
        "}",
        "trap on_usr1 USR1",
        "# srun (Slurm 22.05 and later) does not pass the job's cpus-per-task on to its task",
        "srun --kill-on-bad-exit=1 "
        '${SLURM_CPUS_PER_TASK:+--cpus-per-task="$SLURM_CPUS_PER_TASK"} \\',
        "    torchrun \\",
        f'    --nnodes="$SLURM_NNODES" --nproc-per-node={nproc} \\',
        '    --rdzv-backend=c10d --rdzv-endpoint="$head:29500" \\',
        '    --rdzv-id="${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}" \\',
        '    -m llmtrain run "$CONFIG" --resume &',
        "pid=$!",
        'wait "$pid"',
    ]
    return "\n".join(lines) + "\n"


def _last_error(log_file: Path) -> str:
    try:
        lines = [ln.strip() for ln in log_file.read_text(errors="replace").splitlines()]
    except OSError:
        return "no output"
    lines = [ln for ln in lines if ln]
    for line in reversed(lines):
        if line.startswith("error:"):
            return line[len("error:") :].strip()
    return lines[-1] if lines else "no output"


def _ends_mid_line(path: Path) -> bool:
    """Whether a file ends without a newline (a process killed mid-write)."""
    try:
        with path.open("rb") as f:
            f.seek(-1, os.SEEK_END)
            return f.read(1) != b"\n"
    except (FileNotFoundError, OSError):  # none yet, or empty (seek before the start)
        return False


def run_here(planned: Sequence[PlannedRun], sweep_dir: Path, nproc: int) -> list[tuple[str, str]]:
    """Run the unfinished runs one after another; returns (run id, why) of the failed ones."""
    failed = []

    def say(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    for i, run in enumerate(planned, 1):
        path = run.path(sweep_dir)
        prefix = f"[{i}/{len(planned)}] {run.id}"
        summary = read_summary(path)
        if summary is not None and summary.get("status") == "finished":
            say(f"{prefix}: finished before, skipped")
            continue
        resuming = _has_checkpoints(run)
        log_file = path / "output.log"
        say(f"{prefix}: {'resuming' if resuming else 'running'} (output: {log_file})")
        started = time.perf_counter()
        command = run_command(path / "config.yaml", nproc, executable=True)
        cut = _ends_mid_line(log_file)
        with log_file.open("a", encoding="utf-8") as out:
            # a killed run may have left half a line: the header starts a line of its own
            out.write(("\n" if cut else "") + f"# {time.strftime('%Y-%m-%d %H:%M:%S')} ")
            out.write(f"{shlex.join(command)}\n")
            out.flush()
            # the run stays in the sweep's process group and, on Linux, gets SIGTERM when the
            # sweep ends: it never trains on alone (lifetime.py)
            proc = subprocess.Popen(
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=lifetime.child_environment(),
                # calls only prctl and signal, both looked up before the fork
                preexec_fn=lifetime.child_preexec(),
            )
            try:
                with _signals_interrupt():
                    code = proc.wait()
            except KeyboardInterrupt:
                # the run saves a checkpoint on SIGTERM; the next `llmtrain sweep` resumes it
                say(f"{prefix}: interrupted; stopping the run (it saves, then exits)")
                proc.send_signal(signal.SIGTERM)  # torchrun passes it on to its ranks
                proc.wait()
                raise
        seconds = time.perf_counter() - started
        summary = read_summary(path)
        if code == 0 and summary is not None and summary.get("status") == "finished":
            say(f"{prefix}: finished in {seconds:.0f} s{_result(path)}")
        else:
            why = (summary or {}).get("error") or _last_error(log_file)
            if summary is None or summary.get("status") != "failed":
                # failed before training started (or killed): say so where compare looks
                record = {"status": "failed", "step": 0, "error": why, "exit_code": code}
                write_atomically(path / "summary.json", json.dumps(record, indent=1) + "\n")
            failed.append((run.id, f"exit code {code}: {why}"))
            say(f"{prefix}: FAILED (exit code {code}) after {seconds:.0f} s: {why}")
    return failed


@contextlib.contextmanager
def _signals_interrupt() -> Iterator[None]:
    """SIGTERM and SIGHUP stop the sweep like Ctrl-C, so the running run is stopped with it
    (with SIGTERM: it saves, then exits; it ignores the terminal's SIGINT)."""

    def interrupt(signum: int, frame: FrameType | None) -> NoReturn:
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _has_checkpoints(run: PlannedRun) -> bool:
    from fsspec.core import url_to_fs

    checkpoint = run.config.checkpoint
    url = checkpoint.dir or str(Path(run.config.run_dir) / run.id / "checkpoints")
    try:
        fs, root = url_to_fs(url, **checkpoint.storage_options)
        return any(fs.exists(f"{d}/COMMITTED") for d in fs.ls(root, detail=False))
    except (OSError, ValueError):
        return False


def _result(path: Path) -> str:
    evals = [m["eval_loss"] for m in read_metrics(path / "metrics.jsonl") if "eval_loss" in m]
    return f", eval loss {evals[-1]:.4f}" if evals else ""


# --- the command ---


def configure(parser: argparse.ArgumentParser) -> None:
    main_object(parser, "config", metavar="CONFIG", help="the base run config (YAML)")
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="set in the base config before the axes, as `llmtrain run` takes them, e.g. "
        "data.global_batch=64",
    )
    parser.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="KEY=V1,V2,...",
        help="sweep a key over values; several --grid are crossed (data.weights=[..],[..] sets "
        "the mixture weights)",
    )
    parser.add_argument(
        "--zip",
        action="append",
        default=[],
        metavar="KEY=V1,V2,...",
        help="keys stepped together (same number of values), crossed with the --grid axes",
    )
    parser.add_argument("--seeds", type=int, default=None, help="repeat each run with seeds 0..N-1")
    parser.add_argument(
        "--ladder",
        action="store_true",
        help="a model ladder: one run per --budgets x --tokens-per-param, its model shape and "
        "steps sized from the base config (crossed with --grid/--zip/--seeds)",
    )
    parser.add_argument(
        "--budgets", default=None, metavar="C1,C2,...", help="--ladder: compute budgets in FLOPs"
    )
    parser.add_argument(
        "--tokens-per-param",
        default=None,
        metavar="R1,R2,...",
        help="--ladder: training tokens per non-embedding parameter (20: Chinchilla)",
    )
    parser.add_argument(
        "--aspect-ratio",
        default=None,
        metavar="MIN,MAX",
        help="--ladder: the band of d_model / n_layers (default 32,128)",
    )
    parser.add_argument(
        "--preset",
        choices=sorted(ladder.PRESETS),
        default=None,
        help="--ladder: the budgets, ratios and aspect band of a preset, for what --budgets, "
        "--tokens-per-param and --aspect-ratio leave unset; "
        + "; ".join(
            f"{name}: --budgets {','.join(ladder.compact(c) for c in p.budgets)} "
            f"--tokens-per-param {','.join(ladder.compact(r) for r in p.ratios)} "
            f"--aspect-ratio {','.join(ladder.compact(a) for a in p.aspect)}, {p.about}"
            for name, p in sorted(ladder.PRESETS.items())
        )
        + " (default: none)",
    )
    parser.add_argument("--name", default=None, help="sweep name (default: the base config's name)")
    parser.add_argument("--dir", default="sweeps", help="where sweeps go (default: sweeps)")
    parser.add_argument(
        "--launch",
        choices=("here", "print", "slurm"),
        default="here",
        help="here: run one after another in this shell (default); print: print the commands; "
        "slurm: write a job-array script",
    )
    parser.add_argument(
        "--nproc-per-node", type=int, default=1, help="processes per run (torchrun when > 1)"
    )
    parser.add_argument("--nodes", type=int, default=1, help="nodes per run (slurm)")
    parser.add_argument(
        "--gpus-per-node",
        type=int,
        default=None,
        metavar="N",
        help="slurm: GPUs each node asks for (#SBATCH --gpus-per-node; default: --nproc-per-node; "
        f"0: a CPU job); each run also asks for {CPUS_PER_PROCESS} CPU cores per process "
        "(#SBATCH --cpus-per-task). A --slurm option for GPUs or CPUs (gres=gpu:a100:4, "
        "cpus-per-task=32, ...) replaces these",
    )
    parser.add_argument(
        "--slurm",
        action="append",
        default=[],
        metavar="OPTION=VALUE",
        help="an extra #SBATCH line, e.g. --slurm partition=gpu --slurm time=04:00:00",
    )
    parser.add_argument(
        "--max-parallel", type=int, default=None, help="slurm: at most this many runs at once"
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="check and list the runs (--ladder: print its table); write and run nothing",
    )


def run(args: argparse.Namespace, ctx: Context) -> int:
    if args.nproc_per_node < 1 or args.nodes < 1:
        raise UserError("--nproc-per-node and --nodes must be at least 1")
    if args.nodes > 1 and args.launch != "slurm":
        raise UserError("--nodes > 1 needs --launch slurm (a run here or printed is one node)")
    if args.gpus_per_node is not None and args.launch != "slurm":
        raise UserError("--gpus-per-node is for --launch slurm (what the job script asks for)")
    if args.gpus_per_node is not None and args.gpus_per_node < 0:
        raise UserError(f"--gpus-per-node must be 0 (a CPU job) or more, got {args.gpus_per_node}")
    axes = axes_from(args.grid, args.zip, args.seeds)
    name = args.name or _base_name(args.config, args.overrides)
    if not name or "/" in name:
        raise UserError(f"--name must be a name without '/', got {name!r}")
    sweep_dir = (Path(args.dir) / name).resolve()
    world = args.nproc_per_node * args.nodes
    rungs = _ladder_rungs(args, axes, ctx, world)
    if rungs:
        axes = [_ladder_axis(rungs), *axes]
    planned = plan(
        args.config,
        axes,
        name=name,
        sweep_dir=sweep_dir,
        plugins=ctx.plugins,
        world_size=world,
        overrides=args.overrides,
    )
    # dry runs write nothing: the places only must not be taken by files
    check_sweep_dir(planned, sweep_dir, f"--dir {args.dir}", writable=not args.dry_run)

    def say(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    say(f"sweep {name}: {len(planned)} runs in {sweep_dir}")
    if rungs:
        ladder_table = ladder.table([(run.id, _rung_of(run, rungs)) for run in planned])
        print(ladder_table, file=sys.stdout if args.dry_run else sys.stderr, flush=True)
    if args.dry_run:
        if not rungs:
            for run in planned:
                print(run.id)
        return 0
    meta = {
        "name": name,
        "base": str(Path(args.config).resolve()),
        "overrides": list(args.overrides),
        "command": shlex.join(_command_of(args)),
        "axes": [{"keys": list(a.keys), "values": [list(r) for r in a.rows]} for a in axes],
    }
    if rungs:
        meta["ladder"] = [{"label": r.label, **r.record()} for r in rungs]
    write(planned, sweep_dir, meta)
    pending = [r for r in planned if not _finished(r.path(sweep_dir))]
    if args.launch == "print":
        for run in pending:
            print(
                shlex.join(
                    run_command(run.path(sweep_dir) / "config.yaml", world, executable=False)
                )
            )
        say(f"{len(planned) - len(pending)} finished, {len(pending)} to run")
        return 0
    if args.launch == "slurm":
        if not pending:
            say("every run has finished; no script written")
            return 0
        script = sweep_dir / "sweep.sbatch"
        write_atomically(
            script,
            slurm_script(
                name,
                [r.path(sweep_dir) / "config.yaml" for r in pending],
                nodes=args.nodes,
                nproc=args.nproc_per_node,
                gpus_per_node=(
                    args.nproc_per_node if args.gpus_per_node is None else args.gpus_per_node
                ),
                options=args.slurm,
                max_parallel=args.max_parallel,
                sweep_dir=sweep_dir,
            ),
        )
        say(f"{len(pending)} runs to go ({len(planned) - len(pending)} finished); submit with:")
        print(f"sbatch {shlex.quote(str(script))}")
        return 0
    failed = run_here(planned, sweep_dir, args.nproc_per_node)
    done = len(planned) - len(failed)
    if failed:
        say(f"sweep {name}: {done} of {len(planned)} runs finished; {len(failed)} failed:")
        for run_id, why in failed:
            say(f"  {run_id}: {why}")
        say("fix the cause and run the same `llmtrain sweep` again: finished runs are skipped")
        return 1
    say(
        f"sweep {name}: all {len(planned)} runs finished; compare with: llmtrain compare {sweep_dir}"
    )
    return 0


def _ladder_rungs(
    args: argparse.Namespace, axes: Sequence[Axis], ctx: Context, world: int
) -> list[ladder.Rung]:
    """The ladder's rungs when --ladder is given (none otherwise), checked against the other
    axes; the ladder's flags without --ladder are refused."""
    flags = {"--budgets": args.budgets, "--tokens-per-param": args.tokens_per_param}
    flags["--aspect-ratio"] = args.aspect_ratio
    flags["--preset"] = args.preset
    if not args.ladder:
        given = [flag for flag, value in flags.items() if value is not None]
        if given:
            raise UserError(f"{', '.join(given)} size a model ladder: add --ladder")
        return []
    preset = ladder.PRESETS.get(args.preset) if args.preset else None
    if preset is not None and args.budgets is None:
        budgets = list(preset.budgets)
    else:
        budgets = ladder.parse_positive_list(args.budgets, "--budgets", "1e15,3e15,1e16")
    if preset is not None and args.tokens_per_param is None:
        ratios = list(preset.ratios)
    else:
        ratios = ladder.parse_positive_list(args.tokens_per_param, "--tokens-per-param", "10,20,40")
    if preset is not None and args.aspect_ratio is None:
        aspect = preset.aspect
    else:
        aspect = ladder.parse_aspect(args.aspect_ratio)
    # before the base is read: whether a key is refused never depends on the base
    ladder.refuse_keys(
        args.overrides,
        [(key, flag) for axis in axes for key, flag in zip(axis.keys, axis.flags, strict=True)],
    )
    base = ladder_base(args.config, ctx.plugins, args.overrides)
    return ladder.ladder(
        base,
        ctx.plugins,
        budgets=budgets,
        ratios=ratios,
        aspect=aspect,
        world=world,
        source=args.config,
    )


def ladder_base(path: str, plugins: Any, overrides: Sequence[str] = ()) -> RunConfig:
    """The base config as a run reads it (overrides applied, the model's options with their
    defaults)."""
    return resolved(load_run_config(path, plugins, overrides), plugins)


def _ladder_axis(rungs: Sequence[ladder.Rung]) -> Axis:
    """The rungs as one axis of the sweep: every rung sets the same keys."""
    keys = tuple(rungs[0].overrides())
    rows = [tuple(rung.overrides()[key] for key in keys) for rung in rungs]
    return Axis(keys, rows, tuple("--ladder" for _ in keys), labels=[r.label for r in rungs])


def _rung_of(run: PlannedRun, rungs: Sequence[ladder.Rung]) -> ladder.Rung:
    return next(r for r in rungs if r.overrides().items() <= run.settings.items())


def _command_of(args: argparse.Namespace) -> list[str]:
    """The sweep's own command line, from its parsed arguments (for the manifest)."""
    words = ["llmtrain", "sweep", args.config, *args.overrides]
    for flag in ("grid", "zip"):
        for text in getattr(args, flag):
            words += [f"--{flag}", text]
    if args.seeds is not None:
        words += ["--seeds", str(args.seeds)]
    if args.ladder:
        words.append("--ladder")
        if args.preset is not None:
            words += ["--preset", args.preset]
        for flag in ("budgets", "tokens_per_param", "aspect_ratio"):
            if getattr(args, flag) is not None:
                words += [f"--{flag.replace('_', '-')}", getattr(args, flag)]
    if args.name:
        words += ["--name", args.name]
    return [*words, "--dir", args.dir]


def _finished(path: Path) -> bool:
    summary = read_summary(path)
    return summary is not None and summary.get("status") == "finished"


def _base_name(config: str, overrides: Sequence[str]) -> str:
    """The base config's `name` (a `name=...` override included), else the file's stem."""
    try:
        raw = yaml.safe_load(Path(config).read_text(encoding="utf-8"))
    except (OSError, ValueError, yaml.YAMLError):  # plan() names what is wrong with the file
        raw = None
    name = raw.get("name") if isinstance(raw, dict) else None
    for text in overrides:
        path, value = parse_override(text)
        name = value if path == ("name",) else name
    return str(name) if name else Path(config).stem
