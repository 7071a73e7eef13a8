"""The run-level commands: `llmtrain run`, `llmtrain eval`, `llmtrain generate`."""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

from llmtrain.core_mesh.cli import Context
from llmtrain.core_mesh.config import load_config, structure
from llmtrain.core_mesh.errors import UserError
from llmtrain.core_mesh.plugins import PluginManager
from llmtrain.train_loop.run_config import RunConfig


# --- llmtrain run ---
def configure_run(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="the run config (YAML)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="e.g. optimizer.lr=1e-3")
    resume = parser.add_mutually_exclusive_group()
    resume.add_argument(
        "--resume",
        dest="resume",
        action="store_const",
        const=True,
        help="continue from the newest committed checkpoint (the default: checkpoint.resume)",
    )
    resume.add_argument(
        "--no-resume",
        dest="resume",
        action="store_const",
        const=False,
        help="refuse to start if the run already has checkpoints",
    )


def run_run(args: argparse.Namespace, ctx: Context) -> int:
    from llmtrain.train_loop.trainer import Trainer

    config = load_config(args.config, RunConfig, plugins=ctx.plugins, overrides=args.overrides)
    trainer = Trainer(config, ctx.plugins, resume=args.resume)
    try:
        step = trainer.train()
    finally:
        trainer.close()
    if trainer.world.is_main:
        print(f"{config.name}: {step} steps; run directory {trainer.run_dir}", file=sys.stderr)
    return 0


# --- shared: a model from a checkpoint ---
def load_model(checkpoint: str, step: int | None, plugins: PluginManager) -> tuple[Any, dict, int]:
    """The whole model (one process, CPU) with the weights of a committed checkpoint."""
    import torch

    from llmtrain.checkpoint.export import load_model_weights
    from llmtrain.core_mesh.config import Choice

    weights, record, step = load_model_weights(checkpoint, step=step)
    info = record.get("info", {})
    if "model" not in info:
        raise UserError(f"{checkpoint}: the checkpoint does not say which model it holds")
    raw = dict(info["model"])
    choice = structure(raw, Choice.of("model"), plugins=plugins, source=f"{checkpoint} (model)")
    model = plugins.registry("model").get(choice.kind).target(choice.options)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    missing = [k for k in missing if not k.endswith(("rope_cos", "rope_sin"))]
    if missing or unexpected:
        raise UserError(
            f"{checkpoint} step {step} does not fit its model: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    model.to(torch.float32).eval()
    return model, info, step


def tokenizer_of(info: dict, given: str | None, plugins: PluginManager):
    from llmtrain.data_pack.tokenizer import build_tokenizer, tokenizer_choice, tokenizer_from_raw

    if given:
        return build_tokenizer(tokenizer_choice(given, plugins), plugins)
    spec = info.get("data", {}).get("tokenizer", {}).get("spec")
    if spec is None:
        raise UserError("the checkpoint does not record its tokenizer; pass --tokenizer")
    return tokenizer_from_raw(spec, plugins)


def _checkpoint_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--checkpoint", required=True, help="checkpoint directory (runs/<name>/checkpoints)"
    )
    parser.add_argument("--step", type=int, default=None, help="default: the newest")


# --- llmtrain generate ---
def configure_generate(parser: argparse.ArgumentParser) -> None:
    _checkpoint_args(parser)
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=100)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--tokenizer", default=None, help="default: the one the data was packed with"
    )


def sample_text(
    model: Any,
    tokenizer: Any,
    prompt: str,
    *,
    max_new_tokens: int = 100,
    temperature: float = 0.8,
    top_k: int | None = None,
    top_p: float | None = 0.95,
    seed: int = 0,
) -> str:
    """The prompt and its continuation, stopping at the end of the document."""
    import torch

    from llmtrain.models.generate import generate

    ids = tokenizer.encode_batch([prompt])[0]
    if not ids:
        raise UserError("--prompt encodes to no tokens")
    out = generate(
        model,
        torch.tensor([ids]),
        max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        eod_id=tokenizer.eod_id,
        vocab_size=tokenizer.vocab_size,
        generator=torch.Generator().manual_seed(seed),
    )
    new = [t for t in out[0, len(ids) :].tolist() if t != tokenizer.eod_id]
    return prompt + tokenizer.decode(new)


def run_generate(args: argparse.Namespace, ctx: Context) -> int:
    model, info, _ = load_model(args.checkpoint, args.step, ctx.plugins)
    tokenizer = tokenizer_of(info, args.tokenizer, ctx.plugins)
    print(
        sample_text(
            model,
            tokenizer,
            args.prompt,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
        )
    )
    return 0


# --- llmtrain eval ---
def configure_eval(parser: argparse.ArgumentParser) -> None:
    _checkpoint_args(parser)
    parser.add_argument("--data", required=True, help="a packed dataset (zarr)")
    parser.add_argument("--seq-len", type=int, default=None, help="default: the training seq_len")
    parser.add_argument("--batch", type=int, default=8, help="sequences per forward")
    parser.add_argument("--batches", type=int, default=None, help="default: the whole dataset")


def run_eval(args: argparse.Namespace, ctx: Context) -> int:
    import json

    import numpy as np
    import torch

    from llmtrain.data_pack.loader import open_windows
    from llmtrain.train_loop.loss import cross_entropy_sum

    model, info, step = load_model(args.checkpoint, args.step, ctx.plugins)
    seq_len = args.seq_len or info.get("data", {}).get("seq_len")
    if seq_len is None:
        raise UserError("the checkpoint does not record its seq_len; pass --seq-len")
    data = open_windows([args.data], seq_len, shuffle=False)
    fingerprint = info.get("data", {}).get("fingerprint")
    if fingerprint is not None and data.sources[0].dataset.fingerprint != fingerprint:
        raise UserError(
            f"{args.data} was packed with another tokenizer than the checkpoint's training data "
            f"({data.sources[0].dataset.fingerprint} vs {fingerprint})"
        )
    n = len(data) if args.batches is None else min(len(data), args.batches * args.batch)
    loss_fn = cross_entropy_sum()
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, n, args.batch):
            batch = data.read(np.arange(start, min(start + args.batch, n)))
            tokens = torch.from_numpy(batch["tokens"])
            total += loss_fn(model(tokens[:, :-1]), tokens[:, 1:]).item()
            count += tokens[:, 1:].numel()
    loss = total / count
    print(
        json.dumps(
            {"step": step, "loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": count}
        )
    )
    return 0
