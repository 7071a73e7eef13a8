"""checkpoint's plugin (entry point `checkpoint`): the `llmtrain export` and `llmtrain
checkpoints` commands. Importing it is cheap; torch loads when a command runs."""

from __future__ import annotations

import argparse
import json

from llmtrain.core_mesh.cli import Command, Context
from llmtrain.core_mesh.plugins import hookimpl


def _export_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoints", help="the checkpoint directory (path or URL)")
    parser.add_argument("-o", "--output", required=True, help="the directory to write")
    parser.add_argument("--step", type=int, default=None, help="default: the newest committed")
    parser.add_argument("--prefix", default=None, help="key prefix of the model tensors")
    parser.add_argument("--overwrite", action="store_true")


def _export(args: argparse.Namespace, ctx: Context) -> int:
    from llmtrain.checkpoint.export import export

    done = export(
        args.checkpoints, args.output, step=args.step, prefix=args.prefix, overwrite=args.overwrite
    )
    print(
        f"{done['output']}: {done['tensors']} tensors, {done['parameters']:,} parameters from "
        f"{done['source']}"
    )
    return 0


def _list_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoints", help="the checkpoint directory (path or URL)")
    parser.add_argument("--json", action="store_true")


def _list(args: argparse.Namespace, ctx: Context) -> int:
    from llmtrain.checkpoint.manager import Checkpointer

    dirs = Checkpointer(args.checkpoints)._step_dirs()
    if args.json:
        print(json.dumps([{"step": s, "committed": c} for s, c in dirs.items()]))
    else:
        for step, committed in dirs.items():
            print(f"step-{step}  {'committed' if committed else 'unfinished (ignored)'}")
        if not dirs:
            print(f"no checkpoints in {args.checkpoints}")
    return 0


@hookimpl
def llmtrain_commands(register):
    register(
        "export",
        Command(
            help="write a committed checkpoint's model weights as safetensors + config.json",
            configure=_export_args,
            run=_export,
        ),
    )
    register(
        "checkpoints",
        Command(
            help="list a checkpoint directory's steps and whether each is committed",
            configure=_list_args,
            run=_list,
        ),
    )
