"""checkpoint's plugin (entry point `checkpoint`): the `llmtrain export`, `llmtrain checkpoints`
and `llmtrain average` commands. Importing it is cheap; torch loads when a command runs."""

from __future__ import annotations

import argparse
import json

from llmtrain.core_mesh.cli import Command, Context
from llmtrain.core_mesh.cli_conventions import (
    deprecated_alias,
    json_option,
    main_object,
    positive_int,
)
from llmtrain.core_mesh.plugins import Register, hookimpl

# what --dtype accepts, for `export` and `hf export` alike
DTYPES = ("float32", "bfloat16", "float16")
# what --weights accepts: `llmtrain.checkpoint.export.WEIGHTS`' keys (not imported: torch)
WEIGHTS = ("model", "ema")


def export_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags `llmtrain export` and `llmtrain hf export` (llmtrain-hf) share: the same
    source, output, step, precision and overwrite options for both."""
    main_object(
        parser,
        "checkpoints",
        metavar="CHECKPOINT",
        help="checkpoint directory (runs/<name>/checkpoints), path or URL",
    )
    output_option(parser, help="the directory to write")
    parser.add_argument(
        "--step", type=int, default=None, help="the step to export (default: the newest committed)"
    )
    parser.add_argument(
        "--dtype", default=None, choices=DTYPES, help="floating-point weights in this precision "
        "(default: float32)",
    )  # fmt: skip
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier export")
    weights_option(parser)


def weights_option(parser: argparse.ArgumentParser) -> None:
    """`--weights`: the model's own weights or the exponential moving average that train-loop's
    `ema` callback saved beside them (`export`, `hf export`, `eval-tasks`)."""
    parser.add_argument(
        "--weights", default="model", choices=WEIGHTS, help="which weights of the checkpoint: "
        "the model's, or the moving average of the run's `ema` callback (default: model)",
    )  # fmt: skip


def output_option(parser: argparse.ArgumentParser, *, help: str) -> None:
    """`-o/--output`, required; `--out` (0.1's other spelling) as a deprecated alias."""
    parser.add_argument("-o", "--output", required=True, metavar="DIR", help=help)
    deprecated_alias(parser, "--out", "--output")


def _export_args(parser: argparse.ArgumentParser) -> None:
    export_arguments(parser)
    parser.add_argument(
        "--prefix", default=None, help="key prefix of the model tensors (default: none)"
    )


def _export(args: argparse.Namespace, ctx: Context) -> int:
    from llmtrain.checkpoint.export import export

    done = export(
        args.checkpoints,
        args.output,
        step=args.step,
        prefix=args.prefix,
        dtype=args.dtype or "float32",
        overwrite=args.overwrite,
        weights=args.weights,
    )
    print(
        f"{done['output']}: {done['tensors']} tensors, {done['parameters']:,} parameters from "
        f"{done['source']} (llmtrain's format; `llmtrain hf export` of llmtrain-hf writes a "
        "transformers directory)"
    )
    return 0


def _list_args(parser: argparse.ArgumentParser) -> None:
    main_object(
        parser,
        "checkpoints",
        metavar="CHECKPOINT",
        help="checkpoint directory (runs/<name>/checkpoints), path or URL",
    )
    json_option(parser)
    parser.add_argument(
        "--verify", action="store_true", help="also check every byte of each committed step "
        "against its hashes (reads the whole checkpoint); exit 2 if one is damaged",
    )  # fmt: skip


def _list(args: argparse.Namespace, ctx: Context) -> int:
    from llmtrain.checkpoint.manager import Checkpointer, CheckpointError

    checkpoints = Checkpointer(args.checkpoints)
    dirs = checkpoints._step_dirs(existing=args.verify)  # --verify: it must be one
    # each committed step's files against its commit (sizes and the small files' hashes; with
    # --verify every byte): a damaged step is shown, never removed
    damage = {s: checkpoints.damage(s, full=args.verify) for s, done in dirs.items() if done}
    what = {s: f"{d.file} {d.problem}" for s, d in damage.items() if d is not None}
    if args.json:
        print(
            json.dumps(
                [{"step": s, "committed": c, "damaged": what.get(s)} for s, c in dirs.items()]
            )
        )
    else:
        for step, committed in dirs.items():
            state = "committed" if committed else "unfinished (ignored)"
            print(f"step-{step}  {state}{f', DAMAGED: {what[step]}' if step in what else ''}")
        if not dirs:
            print(f"no checkpoints in {args.checkpoints}")
        if what:
            newest = max(what)
            print(
                "damaged steps are left as they are; a resume takes the newest committed step, "
                f"so rename a damaged one (e.g. step-{newest} to step-{newest}.damaged) to resume "
                "from the step before it"
            )
    if what and args.verify:
        steps = ", ".join(f"step-{s}" for s in sorted(what))
        raise CheckpointError(f"{checkpoints.url}: damaged: {steps} (see the list above)")
    return 0


def step_list(text: str) -> list[int]:
    """`--steps 100,200,300` (argparse's `type`: a bad list is one line naming the option)."""
    steps: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        if not part.isascii() or not part.isdigit():
            raise argparse.ArgumentTypeError(f"{part!r} is not a step number (N,N,...)")
        steps.append(int(part))
    if len(set(steps)) != len(steps):
        raise argparse.ArgumentTypeError(f"{text!r} names a step twice; name each step once")
    return steps


def _average_args(parser: argparse.ArgumentParser) -> None:
    main_object(
        parser,
        "checkpoints",
        metavar="CHECKPOINT",
        help="checkpoint directory (runs/<name>/checkpoints), path or URL",
    )
    # a new command: -o/--output without 0.1's --out
    parser.add_argument(
        "-o",
        "--output",
        required=True,
        metavar="DIR",
        help="the checkpoint directory to write the averaged step to (not the source)",
    )
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "--last", type=positive_int, metavar="K", help="average the newest K committed steps"
    )
    which.add_argument(
        "--steps", type=step_list, metavar="N,N,...", help="average these committed steps"
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace a checkpoint the output already holds"
    )
    json_option(parser)


def _average(args: argparse.Namespace, ctx: Context) -> int:
    import sys

    from llmtrain.checkpoint.average import average
    from llmtrain.core_mesh.logs import configure_logging

    # stdout carries only the summary (or its JSON); the checkpointer's info lines are noise here
    configure_logging(console=sys.stderr, level="WARNING")

    done = average(
        args.checkpoints,
        args.output,
        last=args.last,
        steps=args.steps,
        overwrite=args.overwrite,
    )
    if args.json:
        print(json.dumps(done))
        return 0
    steps = done["steps"]
    assert isinstance(steps, list)
    print(
        f"{done['checkpoint']}: the mean of steps {', '.join(map(str, steps))} of "
        f"{done['source']}: {done['tensors']} tensors, {done['parameters']:,} parameters "
        "(model weights only: for eval, eval-tasks, generate and export, not for resuming "
        "training)"
    )
    return 0


@hookimpl
def llmtrain_commands(register: Register) -> None:
    register(
        "export",
        lambda _: Command(
            help="write a committed checkpoint's model weights as safetensors + the model options "
            "(llmtrain's format; a transformers directory: `llmtrain hf export`)",
            configure=_export_args,
            run=_export,
        ),
    )
    register(
        "checkpoints",
        lambda _: Command(
            help="list a checkpoint directory's steps and whether each is committed",
            configure=_list_args,
            run=_list,
        ),
    )
    register(
        "average",
        lambda _: Command(
            help="write a checkpoint whose weights are the mean of several committed steps' "
            "(for evaluation and export; it holds no optimizer state to resume from)",
            configure=_average_args,
            run=_average,
        ),
    )
