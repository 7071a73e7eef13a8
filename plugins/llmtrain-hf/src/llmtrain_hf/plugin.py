"""The `llmtrain hf` command (entry point `hf`): `hf export` and `hf import`; and the `hf` weight
format, so a run can start from a transformers directory (`init: {from: DIR}`).

Loaded on every `llmtrain` start, so it imports neither torch nor transformers: `run` and the
format's `load` do.
"""

from __future__ import annotations

import argparse
import sys

from llmtrain.core_mesh.cli import Command, Context
from llmtrain.core_mesh.plugins import hookimpl
from llmtrain_hf.weights import HFWeights


def configure(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    text = "write a checkpoint as a transformers model directory (Llama or GPT-2)"
    export = actions.add_parser("export", help=text, description=text)
    export.add_argument(
        "--checkpoint", required=True, help="checkpoint directory (runs/<name>/checkpoints)"
    )
    export.add_argument("--step", type=int, default=None, help="default: the newest committed")
    export.add_argument("--out", required=True, help="the directory to write")
    export.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    tokenizer = export.add_mutually_exclusive_group()
    tokenizer.add_argument(
        "--tokenizer",
        default=None,
        metavar="TOKENIZER_JSON",
        help="the training tokenizer.json, when it moved from the path the checkpoint records",
    )
    tokenizer.add_argument(
        "--no-tokenizer", action="store_true", help="write the model without tokenizer files"
    )
    export.add_argument("--overwrite", action="store_true")

    text = "read a transformers Llama or GPT-2 directory into an llmtrain checkpoint (step 0)"
    imp = actions.add_parser("import", help=text, description=text)
    imp.add_argument("hf_dir", metavar="HF_DIR", help="a directory with config.json and weights")
    imp.add_argument("--out", required=True, help="the checkpoint directory to create")


def run(args: argparse.Namespace, ctx: Context) -> int:
    from transformers.utils import logging as hf_logging

    from llmtrain_hf.transfer import export_checkpoint, import_hf

    hf_logging.disable_progress_bar()
    if args.action == "export":
        report = export_checkpoint(
            args.checkpoint,
            args.out,
            step=args.step,
            dtype=args.dtype,
            tokenizer=args.tokenizer,
            with_tokenizer=not args.no_tokenizer,
            overwrite=args.overwrite,
            plugins=ctx.plugins,
        )
    else:
        report = import_hf(args.hf_dir, args.out, plugins=ctx.plugins)
    for note in report.notes:
        print(f"note: {note}", file=sys.stderr)
    print(
        f"{report.output}: {report.architecture}, {report.parameters:,} parameters from "
        f"{report.source} ({', '.join(report.files)})"
    )
    return 0


@hookimpl
def llmtrain_commands(register):
    register(
        "hf",
        Command(
            help="Hugging Face interop: export a checkpoint as a transformers model, import one",
            configure=configure,
            run=run,
        ),
    )


@hookimpl
def llmtrain_weight_formats(register):
    register(
        "hf",
        HFWeights(),
        help="a transformers Llama or GPT-2 directory (config.json + safetensors)",
    )
