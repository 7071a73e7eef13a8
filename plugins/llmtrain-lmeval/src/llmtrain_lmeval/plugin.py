"""The `llmtrain lm-eval` command (entry point `lmeval`): lm-evaluation-harness on a checkpoint,
the same as `lm_eval --model llmtrain --model_args checkpoint=DIR ...`.

    llmtrain lm-eval runs/x/checkpoints -- --tasks hellaswag --batch_size 32

Loaded on every `llmtrain` start, so it imports neither lm-eval nor torch: the harness runs in a
child process (`python -m lm_eval`), whose exit code the command returns.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from llmtrain.core_mesh.cli import Command, Context
from llmtrain.core_mesh.cli_conventions import main_object, passthrough
from llmtrain.core_mesh.errors import UserError
from llmtrain.core_mesh.plugins import Register, hookimpl


def configure(parser: argparse.ArgumentParser) -> None:
    main_object(
        parser,
        "checkpoint",
        metavar="CHECKPOINT",
        help="checkpoint directory (runs/<name>/checkpoints), path or URL",
        old="--checkpoint",
    )
    parser.add_argument(
        "--step", type=int, default=None, help="the step to load (default: the newest committed)"
    )
    parser.add_argument(
        "--model-args",
        default="",
        metavar="K=V,...",
        help="more of the model's arguments: max_length, dtype, tokenizer, max_gen_toks "
        "(default: none)",
    )
    passthrough(
        parser,
        "harness",
        metavar="LM_EVAL_OPTIONS",
        help="lm_eval's own options (--tasks, --batch_size, --num_fewshot, --output_path, ...)",
    )


def harness_argv(args: argparse.Namespace) -> list[str]:
    """`python -m lm_eval run ...` for the command's arguments."""
    harness = args.harness
    if not harness:
        raise UserError("give lm_eval's options after --, at least --tasks")
    if any(a == "--model" or a.startswith("--model=") for a in harness):
        raise UserError("llmtrain lm-eval runs the `llmtrain` model; leave out --model")
    if any(a == "--model_args" or a.startswith("--model_args=") for a in harness):
        raise UserError("give the model's arguments as --model-args K=V,... before lm_eval's")
    model_args = [f"checkpoint={args.checkpoint}"]
    if args.step is not None:
        model_args.append(f"step={args.step}")
    model_args += [part for part in args.model_args.split(",") if part.strip()]
    return [
        sys.executable,
        "-m",
        "lm_eval",
        "run",
        "--model",
        "llmtrain",
        "--model_args",
        ",".join(model_args),
        *harness,
    ]


def run(args: argparse.Namespace, ctx: Context) -> int:
    return subprocess.run(harness_argv(args), check=False).returncode


@hookimpl
def llmtrain_commands(register: Register) -> None:
    register(
        "lm-eval",
        lambda _: Command(
            help="lm-evaluation-harness on a checkpoint (`lm_eval --model llmtrain`)",
            configure=configure,
            run=run,
        ),
    )
