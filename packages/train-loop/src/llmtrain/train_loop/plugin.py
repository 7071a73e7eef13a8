"""train-loop's plugin (entry point `train_loop`): the `llmtrain config` commands."""

from __future__ import annotations

import argparse

from llmtrain.core_mesh.cli import Command, Context
from llmtrain.core_mesh.config import (
    ConfigError,
    Problem,
    dump_config,
    load_config,
    make_converter,
)
from llmtrain.core_mesh.mesh import MeshError
from llmtrain.core_mesh.plugins import hookimpl
from llmtrain.train_loop.run_config import RunConfig


def _configure(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    for name, text in (
        ("validate", "check a run config without running it"),
        ("show", "print the resolved run config (defaults filled, overrides applied)"),
    ):
        action = actions.add_parser(name, help=text, description=text)
        action.add_argument("file", help="the run config (YAML)")
        action.add_argument(
            "overrides", nargs="*", metavar="KEY=VALUE", help="e.g. model.n_layers=4"
        )
        action.add_argument(
            "--world-size",
            type=int,
            default=None,
            help="also check the mesh against this many processes",
        )


def _run(args: argparse.Namespace, ctx: Context) -> int:
    config = load_config(args.file, RunConfig, plugins=ctx.plugins, overrides=args.overrides)
    if args.world_size is not None:
        try:
            config.mesh.resolve(args.world_size)
        except MeshError as exc:
            raise ConfigError([Problem(("mesh",), str(exc), args.file)], args.file) from None
    if args.action == "show":
        print(dump_config(config, converter=make_converter(ctx.plugins)), end="")
    else:
        print(f"{args.file}: ok")
    return 0


@hookimpl
def llmtrain_commands(register):
    register(
        "config", Command(help="validate or show a run config", configure=_configure, run=_run)
    )
