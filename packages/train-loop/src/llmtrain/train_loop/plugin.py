"""train-loop's plugin (entry point `train_loop`): the run-level commands (`run`, `eval`,
`generate`, `quickstart`, `config`, `sweep`, `estimate`, `mup-check`, `which`), the optimizers,
lr schedules, loggers and the `loss_spike` callback. Loading it imports no torch. The commands that read runs back (`compare`, `plot`,
`profile`, `ranks`) are llmtrain-ablate's."""

from __future__ import annotations

import argparse

import yaml

from llmtrain.core_mesh.cli import Command, Context
from llmtrain.core_mesh.cli_conventions import main_object
from llmtrain.core_mesh.config import (
    ConfigError,
    ConfigValueError,
    Problem,
    make_converter,
    unstructure,
)
from llmtrain.core_mesh.mesh import MeshError
from llmtrain.core_mesh.plugins import Register, hookimpl
from llmtrain.core_mesh.redact import redact
from llmtrain.train_loop import (
    commands,
    downstream_eval,
    ema,
    eval_tasks,
    loggers,
    loss_spike,
    objectives,
    optim,
    schedules,
)
from llmtrain.train_loop.experiments import estimate, mup_check, quickstart, sweep, which
from llmtrain.train_loop.model_source import load_run_config
from llmtrain.train_loop.run_config import resolved


def _configure(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    for name, text in (
        ("validate", "check a run config without running it"),
        ("show", "print the resolved run config (defaults filled, overrides applied)"),
    ):
        action = actions.add_parser(name, help=text, description=text)
        main_object(action, "file", metavar="CONFIG", help="the run config (YAML)")
        action.add_argument(
            "overrides", nargs="*", metavar="KEY=VALUE", help="e.g. model.n_layers=4"
        )
        action.add_argument(
            "--world-size",
            type=int,
            default=None,
            help="also check the mesh and batch against this many processes (default: none)",
        )


def _run(args: argparse.Namespace, ctx: Context) -> int:
    # validate also checks that the run's paths are not taken by files or directories of the
    # wrong kind (not that they are writable: a config may be checked on another machine)
    validate = args.action == "validate"
    config = load_run_config(
        args.file,
        ctx.plugins,
        args.overrides,
        paths="exist" if validate else None,
        world_size=args.world_size if validate else None,
    )
    config = resolved(config, ctx.plugins)
    if not validate and args.world_size is not None:
        try:
            dp = config.mesh.resolve(args.world_size).dp
        except MeshError as exc:
            raise ConfigError([Problem(("mesh",), str(exc), args.file)], args.file) from None
        try:
            config.data.batch_sizes(dp)
        except ConfigValueError as exc:
            problem = Problem(("data", *exc.path), str(exc), args.file)
            raise ConfigError([problem], args.file) from None
    if args.action == "show":
        # as config.yaml has it: without credentials (terminals are shared and scrolled back)
        plain = redact(unstructure(config, converter=make_converter(ctx.plugins)))
        print(yaml.safe_dump(plain, sort_keys=False), end="")
    else:
        print(f"{args.file}: ok")
    return 0


@hookimpl
def llmtrain_commands(register: Register) -> None:
    register(
        "config",
        lambda _: Command(help="validate or show a run config", configure=_configure, run=_run),
    )
    register(
        "run",
        lambda _: Command(
            help="train from a run config (one process or under torchrun)",
            configure=commands.configure_run,
            run=commands.run_run,
        ),
    )
    register(
        "eval",
        lambda _: Command(
            help="loss and perplexity of a checkpoint on a packed dataset, as JSON (the whole "
            "set unless --batches; a run's eval_loss is over its first data.eval.batches "
            "batches)",
            configure=commands.configure_eval,
            run=commands.run_eval,
        ),
    )
    register(
        "eval-tasks",
        lambda _: Command(
            help="downstream task scores of a checkpoint (HellaSwag, ARC, MMLU-style, ...)",
            configure=eval_tasks.configure,
            run=eval_tasks.run,
        ),
    )
    register(
        "generate",
        lambda _: Command(
            help="sample text from a checkpoint",
            configure=commands.configure_generate,
            run=commands.run_generate,
        ),
    )
    register(
        "quickstart",
        lambda _: Command(
            help="make data, pack it, train a tiny model on CPU, evaluate and sample",
            configure=quickstart.configure,
            run=quickstart.run,
        ),
    )
    register(
        "sweep",
        lambda _: Command(
            help="an ablation: expand a grid of overrides into runs and run them (or print / "
            "write a SLURM array)",
            configure=sweep.configure,
            run=sweep.run,
        ),
    )
    register(
        "estimate",
        lambda _: Command(
            help="memory per rank for a config and world size, without allocating it",
            configure=estimate.configure,
            run=estimate.run,
        ),
    )
    register(
        "mup-check",
        lambda _: Command(
            help="µP's coordinate check: activation sizes against width, a few steps on CPU",
            configure=mup_check.configure,
            run=mup_check.run,
        ),
    )
    register(
        "which",
        lambda _: Command(
            help="the documents a step of a run trained on (dataset, file, line or row, id)",
            configure=which.configure,
            run=which.run,
        ),
    )


@hookimpl
def llmtrain_optimizers(register: Register) -> None:
    register("adamw", optim.adamw, options=optim.AdamOptions, help="AdamW (fused on CUDA)")
    register("adam", optim.adam, options=optim.AdamOptions, help="Adam, L2 weight decay")
    register("sgd", optim.sgd, options=optim.SGDOptions, help="SGD with (Nesterov) momentum")
    register(
        "muon",
        optim.muon,
        options=optim.MuonOptions,
        help="Muon for hidden matrices, AdamW for the rest",
    )


@hookimpl
def llmtrain_lr_schedulers(register: Register) -> None:
    register(
        "constant", schedules.constant, options=schedules.WarmupOptions, help="warmup, then flat"
    )
    register(
        "cosine", schedules.cosine, options=schedules.WarmupOptions, help="warmup + cosine decay"
    )
    register(
        "linear", schedules.linear, options=schedules.WarmupOptions, help="warmup + linear decay"
    )
    register("wsd", schedules.wsd, options=schedules.WSDOptions, help="warmup-stable-decay")


@hookimpl
def llmtrain_loggers(register: Register) -> None:
    register("console", loggers.ConsoleSink, options=loggers.ConsoleOptions, help="progress line")
    register("jsonl", loggers.JsonlSink, options=loggers.JsonlOptions, help="metrics.jsonl")


@hookimpl
def llmtrain_objectives(register: Register) -> None:
    register(
        "cross_entropy",
        objectives.cross_entropy,
        options=objectives.CrossEntropyOptions,
        help="summed cross-entropy with an optional z-loss (the default)",
    )


@hookimpl
def llmtrain_callbacks(register: Register) -> None:
    loss_spike.register_callbacks(register)
    downstream_eval.register_callbacks(register)
    ema.register_callbacks(register)
