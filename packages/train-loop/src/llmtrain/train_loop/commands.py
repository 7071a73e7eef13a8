"""The run-level commands: `llmtrain run`, `llmtrain eval`, `llmtrain generate` (`--chat`)."""

from __future__ import annotations

import argparse
import contextlib
import errno
import math
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmtrain.checkpoint.plugin import weights_option
from llmtrain.core_mesh.cli import Context
from llmtrain.core_mesh.cli_conventions import deprecated_alias, main_object
from llmtrain.core_mesh.config import run_paths
from llmtrain.core_mesh.errors import UserError
from llmtrain.core_mesh.interfaces import LanguageModel, ModelOptions, Tokenizer
from llmtrain.core_mesh.world import World
from llmtrain.train_loop.lifetime import die_with_the_sweep
from llmtrain.train_loop.model_source import load_run_config
from llmtrain.train_loop.saved_model import load_model, tokenizer_of

if TYPE_CHECKING:
    from llmtrain.data_pack.chat import ChatTemplate
    from llmtrain.train_loop.run_config import RunConfig


# --- llmtrain run ---
def configure_run(parser: argparse.ArgumentParser) -> None:
    main_object(parser, "config", metavar="CONFIG", help="the run config (YAML)")
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
    # first thing: SIGTERM/SIGUSR1 during the imports and setup below (seconds to minutes on
    # a large model) then stop the run before its first step, with its summary, not kill it
    from llmtrain.checkpoint.preemption import Preemption

    preemption = Preemption()
    # a run a sweep started stops when the sweep ends (lifetime.py); nothing otherwise
    die_with_the_sweep()
    try:
        from llmtrain.train_loop.trainer import Trainer

        # the places the run writes and the layout of this launch are checked with the rest of
        # the config, before it starts
        config = load_run_config(
            args.config,
            ctx.plugins,
            args.overrides,
            paths="writable",
            world_size=World.from_env().world_size,
        )
        with _run_paths_named(args.config, config):
            trainer = Trainer(config, ctx.plugins, resume=args.resume, preemption=preemption)
            try:
                step = trainer.train()
            finally:
                trainer.close()
    finally:
        # a rank that fails waits in the CLI for torchrun's SIGTERM to end it (see cli.py):
        # from here on a signal ends the process again
        preemption.restore()
    if trainer.world.is_main:
        print(f"{config.name}: {step} steps; run directory {trainer.run_dir}", file=sys.stderr)
    return 0


# what the file system answers a run whose directories cannot be (a path made impossible after
# the config was checked, a file system that refuses): the user's to fix, not a bug
_PATH_ERRNOS = frozenset(
    (
        errno.EACCES,
        errno.EPERM,
        errno.EROFS,
        errno.ENOTDIR,
        errno.EISDIR,
        errno.EEXIST,
        errno.ENOENT,
    )
)


@contextlib.contextmanager
def _run_paths_named(config_file: str, config: RunConfig) -> Iterator[None]:
    """An OSError about a path under the run directory, a local checkpoint.dir or a logger's
    path becomes one line naming the config key and the path."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in _PATH_ERRNOS or not exc.filename:
            raise
        key = _key_of_path(config, Path(os.fsdecode(exc.filename)))
        if key is None:
            raise
        raise UserError(f"{config_file}: {key}: {exc.filename}: {exc.strerror}") from exc


def _key_of_path(config: RunConfig, path: Path) -> str | None:
    """The config key whose place holds `path` (the innermost), or whose place `path` was on
    the way to (a directory that could not be made); None when `path` is none of the run's."""
    run = Path(config.run_dir) / config.name
    places = [("run_dir", run)]
    checkpoint = config.checkpoint.dir
    if checkpoint and ("://" not in checkpoint or checkpoint.startswith("file://")):
        places.append(("checkpoint.dir", Path(checkpoint.removeprefix("file://"))))
    for i, choice in enumerate(config.loggers):
        places += [
            (f"loggers[{i}].{key}", run / value) for key, _, value in run_paths(choice.options)
        ]
    path = path.absolute()
    inside, above = [], []
    for key, place in places:
        place = place.absolute()
        if path == place or place in path.parents:
            inside.append((len(place.parts), key))
        elif path in place.parents:
            above.append((len(path.parts), key))
    found = inside or above
    return max(found)[1] if found else None


def checkpoint_args(parser: argparse.ArgumentParser) -> None:
    """The main object of `eval`, `generate` and `eval-tasks`: a checkpoint, positional (the
    `--checkpoint DIR` of 0.1 still works, with a deprecation line), which step of it, and
    which of its weights (`--weights ema`: the `ema` callback's moving average)."""
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
    weights_option(parser)


# --- llmtrain generate ---
def configure_generate(parser: argparse.ArgumentParser) -> None:
    checkpoint_args(parser)
    parser.add_argument(
        "--prompt", default=None, help="the text to continue (with --chat: a user turn)"
    )
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=100,
        help="at most this many tokens after the prompt (fewer at the end of the document)",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.8,
        help="sampling temperature: lower is more predictable, 0 is greedy",
    )
    parser.add_argument(
        "--top-k",
        type=int,
        default=None,
        metavar="K",
        help="sample only among the K likeliest tokens (default: all)",
    )
    parser.add_argument(
        "--top-p",
        type=float,
        default=0.95,
        metavar="P",
        help="nucleus sampling: only among the likeliest tokens that make up probability P",
    )
    parser.add_argument("--seed", type=int, default=0, help="the sampling seed")
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="the tokenizer (bytes, hf:PATH, a tokenizer.json, ...; default: the one the "
        "training data was packed with)",
    )
    chat = parser.add_argument_group("chat (--chat)")
    chat.add_argument(
        "--chat",
        action="store_true",
        help="the prompt is a user turn: render it with the chat template, print the reply "
        "(which stops at the end of the turn)",
    )
    chat.add_argument("--system", default=None, help="a system message before the prompt")
    chat.add_argument(
        "--messages",
        default=None,
        metavar="JSON",
        help="earlier turns: a JSON file with a list of {role, content} messages (or "
        '{"messages": [...]}); --prompt, if given, is added as the next user turn',
    )
    chat.add_argument(
        "--template",
        default=None,
        help="default: the template the training data was packed with; or chatml, a "
        "tokenizer_config.json, a .jinja file",
    )
    chat.add_argument("--template-name", default=None, help="which of several named templates")
    chat.add_argument(
        "--stop", action="append", default=[], metavar="TOKEN", help="end-of-turn token(s)"
    )


def _continue(
    model: LanguageModel, tokenizer: Tokenizer, ids: list[int], **sampling: Any
) -> list[int]:
    """The new token ids after `ids` (at most max_new_tokens; the stop token is included)."""
    import torch

    from llmtrain.models.generate import generate

    seed = sampling.pop("seed", 0)
    out = generate(
        model,
        torch.tensor([ids]),
        sampling.pop("max_new_tokens", 100),
        eod_id=tokenizer.eod_id,
        vocab_size=tokenizer.vocab_size,
        generator=torch.Generator().manual_seed(seed),
        **sampling,
    )
    return out[0, len(ids) :].tolist()


def sample_text(
    model: LanguageModel,
    tokenizer: Tokenizer,
    prompt: str,
    *,
    max_new_tokens: int = 100,
    temperature: float = 0.8,
    top_k: int | None = None,
    top_p: float | None = 0.95,
    seed: int = 0,
) -> str:
    """The prompt and its continuation, stopping at the end of the document."""
    ids = tokenizer.encode_batch([prompt])[0]
    if not ids:
        raise UserError("--prompt encodes to no tokens")
    new = _continue(
        model,
        tokenizer,
        ids,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
    )
    return prompt + tokenizer.decode([t for t in new if t != tokenizer.eod_id])


def chat_template_of(
    info: dict[str, Any], given: str | None, *, stop: Sequence[str] = (), name: str | None = None
) -> ChatTemplate:
    """The template given on the command line, else the one the training data was packed with."""
    from llmtrain.data_pack.chat import ChatTemplate

    if given:
        return ChatTemplate.load(given, stop=stop, name=name)
    chat = info.get("data", {}).get("chat")
    if chat is None:
        raise UserError(
            "the checkpoint was not trained on chat data (`llmtrain data pack-chat`), so it "
            "records no chat template; pass --template (chatml, a tokenizer_config.json or a "
            ".jinja file)"
        )
    template = ChatTemplate.from_meta(chat["template"])
    return template if not stop else ChatTemplate.from_meta({**chat["template"], "stop": stop})


def chat_reply(
    model: LanguageModel,
    tokenizer: Tokenizer,
    template: ChatTemplate,
    messages: list[dict[str, str]],
    **sampling: Any,
) -> str:
    """The assistant's reply to `messages`: the template's generation prompt is rendered after
    them, and sampling stops at the template's end of turn (or the end of document)."""
    from llmtrain.data_pack.chat import Encoder, RenderError

    stop_ids = template.check_tokenizer(tokenizer)
    try:
        text = template.render(messages, add_generation_prompt=True)
    except RenderError as exc:
        raise UserError(str(exc)) from None
    ids = Encoder(tokenizer, template).encode([text])[0]
    new = _continue(model, tokenizer, ids, stop_ids=stop_ids, **sampling)
    if new and (new[-1] in stop_ids or new[-1] == tokenizer.eod_id):
        new = new[:-1]
    return tokenizer.decode(new)


def _earlier_turns(path: str) -> list[dict[str, str]]:
    """The messages of a --messages file, checked: a list of {role, content} strings."""
    import json

    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except OSError as exc:
        raise UserError(f"--messages {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from None
    messages = value.get("messages") if isinstance(value, dict) else value
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in messages
    ):
        raise UserError(
            f"{path}: expected a list of {{role, content}} messages (strings), or "
            '{"messages": [...]}'
        )
    return messages


def run_generate(args: argparse.Namespace, ctx: Context) -> int:
    model, info, _ = load_model(args.checkpoint, args.step, ctx.plugins, weights=args.weights)
    tokenizer = tokenizer_of(info, args.tokenizer, ctx.plugins)
    sampling = {
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "seed": args.seed,
    }
    if args.chat:
        template = chat_template_of(info, args.template, stop=args.stop, name=args.template_name)
        messages = [{"role": "system", "content": args.system}] if args.system else []
        messages += _earlier_turns(args.messages) if args.messages else []
        if args.prompt is not None:
            messages.append({"role": "user", "content": args.prompt})
        if not messages:
            raise UserError("--chat needs --prompt or --messages")
        print(chat_reply(model, tokenizer, template, messages, **sampling))
        return 0
    if args.system or args.template or args.stop or args.messages:
        raise UserError("--system, --messages, --template and --stop go with --chat")
    if args.prompt is None:
        raise UserError("--prompt is required (with --chat, --messages may give the turns)")
    print(sample_text(model, tokenizer, args.prompt, **sampling))
    return 0


# --- llmtrain eval ---
def configure_eval(parser: argparse.ArgumentParser) -> None:
    checkpoint_args(parser)
    parser.add_argument("--data", required=True, help="a packed dataset (zarr; path or URL)")
    parser.add_argument(
        "--seq-len",
        type=int,
        default=None,
        help="tokens per window (default: the training seq_len)",
    )
    parser.add_argument("--batch-size", type=int, default=8, help="windows (rows) per forward pass")
    deprecated_alias(parser, "--batch", "--batch-size")
    parser.add_argument(
        "--batches",
        type=int,
        default=None,
        help="evaluate the first N batches only (default: the whole dataset). A run's in-loop "
        "eval_loss is over the first data.eval.batches global batches of the held-out set, not "
        "all of it: --batches data.eval.batches --batch-size GLOBAL_BATCH (micro_batch x "
        "grad_accum x data ranks) reads the same windows and gives the same number",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print JSON instead of text; eval prints its one JSON object either way, so the "
        "flag changes nothing (default: off)",
    )


def run_eval(args: argparse.Namespace, ctx: Context) -> int:
    import json

    import numpy as np
    import torch

    from llmtrain.data_pack.loader import open_windows
    from llmtrain.train_loop.loss import IGNORE, bits_per_byte, cross_entropy_sum

    for flag, value in (("--batch-size", args.batch_size), ("--batches", args.batches)):
        if value is not None and value < 1:
            raise UserError(f"{flag} {value}: must be at least 1; see llmtrain eval --help")
    model, info, step = load_model(args.checkpoint, args.step, ctx.plugins, weights=args.weights)
    seq_len = args.seq_len or info.get("data", {}).get("seq_len")
    if seq_len is None:
        raise UserError("the checkpoint does not record its seq_len; pass --seq-len")
    options: ModelOptions = model.options
    data = open_windows([args.data], seq_len, shuffle=False, doc_starts=options.doc_masking)
    fingerprint = info.get("data", {}).get("fingerprint")
    if fingerprint is not None and data.sources[0].dataset.fingerprint != fingerprint:
        raise UserError(
            f"{args.data} was packed with another tokenizer than the checkpoint's training data "
            f"({data.sources[0].dataset.fingerprint} vs {fingerprint})"
        )
    n = len(data) if args.batches is None else min(len(data), args.batches * args.batch_size)
    loss_fn = cross_entropy_sum()
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, n, args.batch_size):
            batch = data.read(np.arange(start, min(start + args.batch_size, n)))
            tokens = torch.from_numpy(batch["tokens"])
            targets = tokens[:, 1:]
            if "loss_mask" in batch:  # chat data: only the counted targets
                targets = targets.masked_fill(~torch.from_numpy(batch["loss_mask"][:, 1:]), IGNORE)
            # document starts only to a model with doc_masking (`LanguageModel`)
            doc = batch.get("doc_starts")
            inputs = {"doc_starts": torch.from_numpy(doc)} if doc is not None else {}
            total += loss_fn(model(tokens[:, :-1], **inputs), targets).item()
            count += int((targets != IGNORE).sum())
    loss = total / count
    result = {"step": step, "loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": count}
    bpb = bits_per_byte(loss, data.sources[0].dataset)
    if bpb is not None:  # datasets packed before bytes were counted have none
        result["bits_per_byte"] = bpb
    print(json.dumps(result))
    return 0
