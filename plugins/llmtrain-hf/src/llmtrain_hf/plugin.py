"""The `llmtrain hf` command (entry point `hf`): `hf export` and `hf import`; and the `hf` weight
format, so a run can start from a transformers directory (`init: {from: DIR}`).

Loaded on every `llmtrain` start, so it imports neither torch nor transformers: `run` and the
format's `load` do.
"""

from __future__ import annotations

import argparse
import sys

from llmtrain.checkpoint.plugin import export_arguments, output_option
from llmtrain.core_mesh.cli import Command, Context
from llmtrain.core_mesh.cli_conventions import main_object
from llmtrain.core_mesh.plugins import Register, hookimpl
from llmtrain_hf.architectures import ARCHITECTURES
from llmtrain_hf.weights import HFWeights


def configure(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    text = "write a checkpoint as a transformers model directory (the flags of `llmtrain export`)"
    export = actions.add_parser("export", help=text, description=text)
    export_arguments(export)
    export.add_argument(
        "--architecture",
        default=None,
        choices=ARCHITECTURES,
        help="the transformers class to write (default: the first that computes the model)",
    )
    tokenizer = export.add_mutually_exclusive_group()
    tokenizer.add_argument(
        "--tokenizer",
        default=None,
        metavar="TOKENIZER_JSON",
        help="the training tokenizer.json, when it moved from the path the checkpoint records "
        "(default: that path)",
    )
    tokenizer.add_argument(
        "--no-tokenizer", action="store_true", help="write the model without tokenizer files"
    )

    text = "read a transformers model directory into an llmtrain checkpoint (step 0)"
    imp = actions.add_parser("import", help=text, description=text)
    main_object(imp, "hf_dir", metavar="HF_DIR", help="a directory with config.json and weights")
    output_option(imp, help="the checkpoint directory to create")


def run(args: argparse.Namespace, ctx: Context) -> int:
    # transformers is imported where a step needs it (config.json, the tokenizer files), not
    # here: a refused argument or a missing checkpoint answers without it
    from llmtrain_hf.transfer import export_checkpoint, import_hf

    if args.action == "export":
        report = export_checkpoint(
            args.checkpoints,
            args.output,
            step=args.step,
            dtype=args.dtype or "float32",
            architecture=args.architecture,
            tokenizer=args.tokenizer,
            with_tokenizer=not args.no_tokenizer,
            overwrite=args.overwrite,
            plugins=ctx.plugins,
            weights=args.weights,
        )
    else:
        report = import_hf(args.hf_dir, args.output, plugins=ctx.plugins)
    for note in report.notes:
        print(f"note: {note}", file=sys.stderr)
    print(
        f"{report.output}: {report.architecture}, {report.parameters:,} parameters from "
        f"{report.source} ({', '.join(report.files)})"
    )
    return 0


@hookimpl
def llmtrain_commands(register: Register) -> None:
    register(
        "hf",
        lambda _: Command(
            help="Hugging Face interop: export a checkpoint as a transformers model, import one",
            configure=configure,
            run=run,
        ),
    )


@hookimpl
def llmtrain_weight_formats(register: Register) -> None:
    register(
        "hf",
        lambda _: HFWeights(),
        help="a transformers model directory (config.json + safetensors): Llama, Mistral, Qwen2, "
        "Qwen3, OLMo-2, Gemma 2, Gemma 3 or GPT-2",
    )
