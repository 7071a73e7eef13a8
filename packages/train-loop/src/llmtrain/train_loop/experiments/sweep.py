"""`llmtrain sweep`: an ablation as one command.

A base config, with `KEY=VALUE` overrides applied as `llmtrain run` applies them, and axes
(`--grid KEY=V1,V2` crossed with each other, `--zip KEY=V1,V2` stepped together, `--seeds N`,
`--ladder`: model sizes and steps from compute budgets, see `ladder.py`, and `--mixtures N`:
data mixtures drawn from a Dirichlet distribution, see `mixtures.py`) expand into runs.
Every run gets its own resolved config in `<dir>/<sweep>/<run-id>/config.yaml` (reproducible
alone: `llmtrain run` on it resumes or repeats it) and the sweep a `manifest.json`. All
configs are checked before anything runs. Then the runs go one after another here, or their
torchrun commands are printed, or a SLURM job-array script is written. A run whose
`summary.json` says finished is skipped; one with checkpoints resumes. A run started here dies
with the sweep (`lifetime.py`), so a killed sweep run again resumes its unfinished runs.

This module is the command; the runs are planned and written by `sweep_plan.py` and launched by
`sweep_launch.py`.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

import yaml

from llmtrain.ablate.files import write_atomically
from llmtrain.core_mesh.cli import Context
from llmtrain.core_mesh.cli_conventions import main_object
from llmtrain.core_mesh.config import parse_override
from llmtrain.core_mesh.errors import UserError
from llmtrain.core_mesh.plugins import PluginManager
from llmtrain.train_loop.experiments import ladder
from llmtrain.train_loop.experiments.ladder_branches import (
    Branched,
    branches,
    check_decay,
    checkpoints_of,
)
from llmtrain.train_loop.experiments.ladder_shapes import compact
from llmtrain.train_loop.experiments.mixtures import Mixtures, mixtures_from
from llmtrain.train_loop.experiments.sweep_launch import (
    CPUS_PER_PROCESS,
    failure,
    finished,
    run_command,
    run_here,
    slurm_script,
)
from llmtrain.train_loop.experiments.sweep_plan import (
    Axis,
    PlannedRun,
    axes_from,
    check_sweep_dir,
    expand,
    plan,
    run_ids,
    write,
)
from llmtrain.train_loop.model_source import load_run_config
from llmtrain.train_loop.run_config import (
    RunConfig,
    resolved,
)


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
        "--params",
        default=None,
        metavar="N1,N2,...",
        help="--ladder by size, instead of --budgets: one model shape per size (non-embedding "
        "parameters), trained at every --tokens-per-param",
    )
    parser.add_argument(
        "--branch-decays",
        type=float,
        default=None,
        metavar="F",
        help="--ladder with a wsd base: the rungs of a shape share the longest one's stable "
        "phase, each other rung branching off its checkpoint to decay over its last F of steps "
        "(e.g. 0.2; see train-loop's README, 'Decay branches')",
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
            f"{name}: --budgets {','.join(compact(c) for c in p.budgets)} "
            f"--tokens-per-param {','.join(compact(r) for r in p.ratios)} "
            f"--aspect-ratio {','.join(compact(a) for a in p.aspect)}, {p.about}"
            for name, p in sorted(ladder.PRESETS.items())
        )
        + " (default: none)",
    )
    parser.add_argument(
        "--mixtures",
        type=int,
        default=None,
        metavar="N",
        help="a data-mixture study: N runs whose data.train weights are drawn from a Dirichlet "
        "distribution (run ids mix=000, ...; crossed with --grid/--zip/--seeds/--ladder)",
    )
    parser.add_argument(
        "--alpha",
        default=None,
        metavar="A[,A2,...]",
        help="--mixtures: the Dirichlet concentration, one for every dataset or one per dataset "
        "(default 1: every mixture equally likely; below 1: most weight on one dataset)",
    )
    parser.add_argument(
        "--mixture-seed",
        type=int,
        default=None,
        metavar="S",
        help="--mixtures: the seed of the draw (default 0); mixture k depends on S, alpha and "
        "k only, so more mixtures keep the first ones",
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
        help="check and list the runs (--ladder: print its table; --mixtures: each run's "
        "weights); write and run nothing",
    )


def run(args: argparse.Namespace, ctx: Context) -> int:
    _check_launch_flags(args)
    axes = axes_from(args.grid, args.zip, args.seeds)
    name = args.name or _base_name(args.config, args.overrides)
    if not name or "/" in name:
        raise UserError(f"--name must be a name without '/', got {name!r}")
    sweep_dir = (Path(args.dir) / name).resolve()
    world = args.nproc_per_node * args.nodes
    mixtures = mixtures_from(
        args.mixtures,
        args.alpha,
        args.mixture_seed,
        base=args.config,
        overrides=args.overrides,
        axes=axes,
    )
    if mixtures is not None:
        axes = [mixtures.axis(), *axes]
    rungs = _ladder_rungs(args, axes, ctx, world)
    if rungs:
        axes = [_ladder_axis(rungs), *axes]
    branched = _branches(args, axes, sweep_dir, ctx)
    planned = plan(
        args.config,
        axes,
        name=name,
        sweep_dir=sweep_dir,
        plugins=ctx.plugins,
        world_size=world,
        overrides=args.overrides,
        extra={
            run_id: ("--branch-decays", overrides)
            for run_id, overrides in branched.overrides.items()
        },
    )
    # a trunk runs before the branches that start from its checkpoints
    planned.sort(key=lambda run: branched.branch(run.id).trunk is not None)
    # dry runs write nothing: the places only must not be taken by files
    check_sweep_dir(planned, sweep_dir, f"--dir {args.dir}", writable=not args.dry_run)

    _say(f"sweep {name}: {len(planned)} runs in {sweep_dir}")
    if rungs:
        ladder_table = ladder.table(
            [(run.id, _rung_of(run, rungs), branched.branch(run.id)) for run in planned]
        )
        print(ladder_table, file=sys.stdout if args.dry_run else sys.stderr, flush=True)
    if args.dry_run:
        if mixtures is not None:
            print(mixtures.table(planned), end="")
        elif not rungs:
            for run in planned:
                print(run.id)
        return 0
    write(planned, sweep_dir, _manifest_meta(args, name, axes, rungs, mixtures, branched))
    pending = [r for r in planned if not finished(r.path(sweep_dir))]
    if args.launch != "here":  # here, they run again at once and say how it went
        _report_failures(pending, sweep_dir)
    if args.launch == "print":
        return _print_commands(planned, pending, sweep_dir, world)
    if args.launch == "slurm":
        return _write_slurm_scripts(args, name, planned, pending, sweep_dir, branched)
    return _run_here(name, planned, sweep_dir, args.nproc_per_node)


def _check_launch_flags(args: argparse.Namespace) -> None:
    """The process counts, and the flags that only a SLURM launch takes."""
    if args.nproc_per_node < 1 or args.nodes < 1:
        raise UserError("--nproc-per-node and --nodes must be at least 1")
    if args.nodes > 1 and args.launch != "slurm":
        raise UserError("--nodes > 1 needs --launch slurm (a run here or printed is one node)")
    if args.gpus_per_node is not None and args.launch != "slurm":
        raise UserError("--gpus-per-node is for --launch slurm (what the job script asks for)")
    if args.gpus_per_node is not None and args.gpus_per_node < 0:
        raise UserError(f"--gpus-per-node must be 0 (a CPU job) or more, got {args.gpus_per_node}")


def _manifest_meta(
    args: argparse.Namespace,
    name: str,
    axes: Sequence[Axis],
    rungs: Sequence[ladder.Rung],
    mixtures: Mixtures | None,
    branched: Branched,
) -> dict[str, object]:
    """What manifest.json says of the sweep besides its runs: base, overrides, command, axes,
    the ladder's rungs and decay branches, and the mixtures' draw."""
    meta: dict[str, object] = {
        "name": name,
        "base": str(Path(args.config).resolve()),
        "overrides": list(args.overrides),
        "command": shlex.join(_command_of(args)),
        "axes": [{"keys": list(a.keys), "values": [list(r) for r in a.rows]} for a in axes],
    }
    if rungs:
        meta["ladder"] = [{"label": r.label, **r.record()} for r in rungs]
    if branched.decay is not None:
        meta["branch_decays"] = branched.decay
        meta["branches"] = branched.record()
    if mixtures is not None:
        meta["mixtures"] = mixtures.record()
    return meta


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _report_failures(pending: Sequence[PlannedRun], sweep_dir: Path) -> None:
    """The runs whose last attempt failed (under a SLURM job array, or here), with why."""
    failed = [(run.id, why) for run in pending if (why := failure(run.path(sweep_dir)))]
    if failed:
        runs = "1 run" if len(failed) == 1 else f"{len(failed)} runs"
        _say(f"{runs} failed on the last attempt (launched again with the others):")
        for run_id, why in failed:
            _say(f"  {run_id}: {why}")


def _print_commands(
    planned: Sequence[PlannedRun], pending: Sequence[PlannedRun], sweep_dir: Path, world: int
) -> int:
    """--launch print: the command of each run still to go, on stdout."""
    for run in pending:
        print(shlex.join(run_command(run.path(sweep_dir) / "config.yaml", world, executable=False)))
    _say(f"{len(planned) - len(pending)} finished, {len(pending)} to run")
    return 0


def _write_slurm_scripts(
    args: argparse.Namespace,
    name: str,
    planned: Sequence[PlannedRun],
    pending: Sequence[PlannedRun],
    sweep_dir: Path,
    branched: Branched,
) -> int:
    """--launch slurm: a job-array script of the runs still to go, and the command to submit
    it. A ladder's decay branches go in a second array (`branches.sbatch`) that starts once
    the first has finished (`--dependency=afterok`): they start from its trunks' checkpoints."""
    if not pending:
        _say("every run has finished; no script written")
        return 0
    first = [r for r in pending if branched.branch(r.id).trunk is None]
    later = [r for r in pending if branched.branch(r.id).trunk is not None]
    scripts = [
        _write_slurm_script(args, job, runs, sweep_dir / file)
        for job, runs, file in (
            (name, first, "sweep.sbatch"),
            (f"{name}-branches", later, "branches.sbatch"),
        )
        if runs
    ]
    _say(f"{len(pending)} runs to go ({len(planned) - len(pending)} finished); submit with:")
    if len(scripts) == 1:
        print(f"sbatch {shlex.quote(str(scripts[0]))}")
    else:
        print(
            f"job=$(sbatch --parsable {shlex.quote(str(scripts[0]))}) && "
            f"sbatch --dependency=afterok:${{job%%;*}} {shlex.quote(str(scripts[1]))}"
        )
    return 0


def _write_slurm_script(
    args: argparse.Namespace, name: str, runs: Sequence[PlannedRun], script: Path
) -> Path:
    """One job array of `runs`, written to `script`."""
    write_atomically(
        script,
        slurm_script(
            name,
            [r.path(script.parent) / "config.yaml" for r in runs],
            nodes=args.nodes,
            nproc=args.nproc_per_node,
            gpus_per_node=(
                args.nproc_per_node if args.gpus_per_node is None else args.gpus_per_node
            ),
            options=args.slurm,
            max_parallel=args.max_parallel,
            sweep_dir=script.parent,
        ),
    )
    return script


def _run_here(name: str, planned: Sequence[PlannedRun], sweep_dir: Path, nproc: int) -> int:
    """--launch here: every unfinished run, one after another; 1 if any failed."""
    failed = run_here(planned, sweep_dir, nproc)
    done = len(planned) - len(failed)
    if failed:
        _say(f"sweep {name}: {done} of {len(planned)} runs finished; {len(failed)} failed:")
        for run_id, why in failed:
            _say(f"  {run_id}: {why}")
        _say("fix the cause and run the same `llmtrain sweep` again: finished runs are skipped")
        return 1
    _say(
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
    flags["--params"] = args.params
    flags["--branch-decays"] = args.branch_decays
    if not args.ladder:
        given = [flag for flag, value in flags.items() if value is not None]
        if given:
            raise UserError(f"{', '.join(given)} size a model ladder: add --ladder")
        return []
    if args.params is not None and args.budgets is not None:
        raise UserError(
            "--budgets and --params each size the rungs (by compute, or by model size): give one"
        )
    preset = ladder.PRESETS.get(args.preset) if args.preset else None
    if args.params is not None:
        budgets = []
    elif preset is not None and args.budgets is None:
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
    if args.params is not None:
        return ladder.ladder_by_size(
            base,
            ctx.plugins,
            sizes=ladder.parse_positive_list(args.params, "--params", "50e3,200e3"),
            ratios=ratios,
            aspect=aspect,
            world=world,
        )
    return ladder.ladder(
        base,
        ctx.plugins,
        budgets=budgets,
        ratios=ratios,
        aspect=aspect,
        world=world,
        source=args.config,
    )


def _branches(
    args: argparse.Namespace, axes: Sequence[Axis], sweep_dir: Path, ctx: Context
) -> Branched:
    """--branch-decays: each run's trunk and start (none without the flag)."""
    if args.branch_decays is None:
        return Branched()
    base = ladder_base(args.config, ctx.plugins, args.overrides)
    options = check_decay(args.branch_decays, base, ctx.plugins)
    ids = run_ids(expand(axes, labelled=True))
    runs = list(zip(ids, expand(axes), strict=True))
    return Branched(
        args.branch_decays,
        branches(runs, options),
        checkpoints_of(ids, sweep_dir, base.checkpoint.dir),
    )


def ladder_base(path: str, plugins: PluginManager, overrides: Sequence[str] = ()) -> RunConfig:
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
        for flag in ("budgets", "params", "tokens_per_param", "aspect_ratio"):
            if getattr(args, flag) is not None:
                words += [f"--{flag.replace('_', '-')}", getattr(args, flag)]
        if args.branch_decays is not None:
            words += ["--branch-decays", f"{args.branch_decays:g}"]
    if args.mixtures is not None:
        words += ["--mixtures", str(args.mixtures)]
    if args.alpha is not None:
        words += ["--alpha", args.alpha]
    if args.mixture_seed is not None:
        words += ["--mixture-seed", str(args.mixture_seed)]
    if args.name:
        words += ["--name", args.name]
    return [*words, "--dir", args.dir]


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
