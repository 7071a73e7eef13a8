"""`llmtrain quickstart`: the whole job on one CPU in a few minutes, with nothing downloaded.

Make a corpus (sentences from a small grammar, with numbers and non-ASCII words), train a BPE
tokenizer on it, pack it (and a held-out part) into zarr, train the `tiny` model, evaluate it,
sample text, and say where everything went and the commands to go on, each runnable as printed
(the first one puts `llmtrain` on the PATH when it runs from a virtual environment, as in
`nox -s quickstart`).
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import shutil
import sys
import sysconfig
from pathlib import Path

from llmtrain.core_mesh.cli import Context
from llmtrain.train_loop.experiments import mixture_demo

SUBJECTS = ["the cat", "a dog", "the model", "our team", "the river", "a student", "the city"]
VERBS = ["sees", "likes", "builds", "follows", "crosses", "reads", "trains"]
OBJECTS = ["the bridge", "a book", "the data", "a small boat", "the garden", "a long road"]
EXTRAS = ["today", "in the morning", "with care", "again", "near the café", "under 3 trees"]
LR, MIN_RATIO = 3.0e-3, 0.1  # the run's peak lr and the cosine schedule's floor


def sentence(rng: random.Random) -> str:
    words = [rng.choice(SUBJECTS), rng.choice(VERBS), rng.choice(OBJECTS)]
    if rng.random() < 0.5:
        words.append(rng.choice(EXTRAS))
    text = " ".join(words)
    return text[0].upper() + text[1:] + rng.choice([".", ".", "!", "?"])


def write_corpus(path: str | Path, documents: int, seed: int = 0) -> None:
    """JSONL documents of 2 to 12 sentences each (`{"id": ..., "text": ...}`)."""
    rng = random.Random(seed)  # noqa: S311 - sample text, not secrets
    with open(path, "w", encoding="utf-8") as f:
        for i in range(documents):
            text = " ".join(sentence(rng) for _ in range(rng.randint(2, 12)))
            f.write(json.dumps({"id": i, "text": text}, ensure_ascii=False) + "\n")


def run_config(work: Path, steps: int, vocab_size: int) -> str:
    eval_every = max(10, steps // 4 // 10 * 10)  # on logged steps (every 10)
    return f"""\
name: quickstart
run_dir: {work / "runs"}
device: cpu
model: {{kind: tiny, vocab_size: {vocab_size}, max_seq_len: 128}}
data:
  train: [{{path: {work / "train.zarr"}}}]
  eval: {{path: {work / "valid.zarr"}, every: {eval_every}, batches: 4}}
  seq_len: 128
  micro_batch: 16
optimizer: {{kind: adamw, lr: {LR}, weight_decay: 0.1}}
lr_scheduler: {{kind: cosine, warmup_steps: {max(steps // 20, 1)}, min_ratio: {MIN_RATIO}}}
training: {{steps: {steps}, log_every: 10, checkpoint_every: {max(steps // 2, 1)}}}
"""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dir", default="quickstart", help="where everything goes (default: quickstart)"
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="training steps (default: 600, a few minutes; with --mixture each proxy run's, "
        f"default {mixture_demo.STEPS})",
    )
    parser.add_argument(
        "--documents",
        type=int,
        default=None,
        help="documents in the generated corpus (default: 4000; with --mixture per domain, "
        f"default {mixture_demo.DOCUMENTS})",
    )
    parser.add_argument(
        "--mixture",
        action="store_true",
        help="make three data domains (prose, arith, noise) and a base config for a mixture "
        "study instead, and print its steps: the swarm, the fit, the report",
    )
    parser.add_argument(
        "--prompt", default="The cat", help="the text the sample goes on from (default: The cat)"
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a quickstart run in --dir that trained more steps than --steps (without "
        "it, such a run is refused; one that trained as many or fewer is replaced) "
        "(default: off)",
    )


def run(args: argparse.Namespace, ctx: Context) -> int:
    if args.mixture:
        return mixture_demo.run(args, ctx)
    args.steps = 600 if args.steps is None else args.steps
    args.documents = 4000 if args.documents is None else args.documents
    return _quickstart(args, ctx)


def trained_steps(run_dir: Path) -> int:
    """How many steps a run in `run_dir` trained: its newest committed checkpoint's step or
    its last logged step, whichever is larger (0 for a run that has neither)."""
    steps = [
        int(marker.parent.name.removeprefix("step-"))
        for marker in (run_dir / "checkpoints").glob("step-*/COMMITTED")
        if marker.parent.name.removeprefix("step-").isdigit()
    ]
    try:
        with open(run_dir / "metrics.jsonl", encoding="utf-8") as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue  # a line cut short by a killed run
                if isinstance(record, dict) and isinstance(record.get("step"), int):
                    steps.append(record["step"])
    except OSError:
        pass
    return max(steps, default=0)


def refuse_to_replace_longer(previous: Path, steps: int, overwrite: bool) -> None:
    """A quickstart run that trained more steps than asked is someone's work (`llmtrain run
    ... training.steps=1200` trains it on): it is replaced only with `--overwrite`."""
    from llmtrain.core_mesh.errors import UserError

    if overwrite or not previous.exists():
        return
    trained = trained_steps(previous)
    if trained > steps:
        raise UserError(
            f"{previous} holds a quickstart run that trained {trained} steps, more than --steps "
            f"{steps}; not replacing it: pass --overwrite to replace it, or use another --dir"
        )


def _quickstart(args: argparse.Namespace, ctx: Context) -> int:
    from llmtrain.core_mesh.config import load_config
    from llmtrain.core_mesh.logs import configure_logging
    from llmtrain.data_pack.pack import pack
    from llmtrain.data_pack.train_tokenizer import train_tokenizer
    from llmtrain.train_loop.commands import sample_text
    from llmtrain.train_loop.run_config import RunConfig
    from llmtrain.train_loop.saved_model import load_model, tokenizer_of
    from llmtrain.train_loop.trainer import Trainer

    configure_logging(console=sys.stderr)  # stdout carries only the sample
    work = Path(args.dir).resolve()
    # before anything is written (run.yaml and the data are the run's too)
    refuse_to_replace_longer(work / "runs" / "quickstart", args.steps, args.overwrite)
    work.mkdir(parents=True, exist_ok=True)

    def say(text: str) -> None:
        print(f"[quickstart] {text}", file=sys.stderr, flush=True)

    say(f"1/6 corpus: {args.documents} documents + a held-out 10% -> {work}")
    write_corpus(work / "train.jsonl", args.documents, seed=0)
    write_corpus(work / "valid.jsonl", max(args.documents // 10, 50), seed=1)
    say("2/6 tokenizer: byte-level BPE, 360 ids")
    tokenizer_file = work / "tokenizer.json"
    vocab = train_tokenizer(
        [str(work / "train.jsonl")], str(tokenizer_file), vocab_size=360, overwrite=True
    )
    say("3/6 pack: tokenize into zarr")
    spec = {"kind": "hf", "path": str(tokenizer_file)}
    for split in ("train", "valid"):
        pack(
            [str(work / f"{split}.jsonl")],
            str(work / f"{split}.zarr"),
            spec,
            overwrite=True,
            plugins=ctx.plugins,
        )
    config_file = work / "run.yaml"
    config_file.write_text(run_config(work, args.steps, vocab))
    say(f"4/6 train: the tiny model for {args.steps} steps on CPU ({config_file})")
    config = load_config(str(config_file), RunConfig, plugins=ctx.plugins)
    previous = work / "runs" / "quickstart"
    if previous.exists():
        say(
            f"    (replacing the previous quickstart run in {previous}, {trained_steps(previous)} steps)"
        )
        shutil.rmtree(previous)
    trainer = Trainer(config, ctx.plugins, resume=False)
    try:
        trainer.train()
        say("5/6 evaluate on the held-out data")
        metrics = trainer.evaluate()
    finally:
        trainer.close()
    say(f"    eval loss {metrics['eval_loss']:.3f}, perplexity {metrics['eval_ppl']:.2f}")
    say(f"6/6 sample: {args.prompt!r}")
    model, info, _ = load_model(str(trainer.checkpoints.url), None, ctx.plugins)
    tokenizer = tokenizer_of(info, None, ctx.plugins)
    print(sample_text(model, tokenizer, args.prompt, max_new_tokens=60, temperature=0.7))
    say(f"done. run directory: {trainer.run_dir} (config.yaml, metrics.jsonl, logs/, checkpoints/)")
    final_lr = LR * MIN_RATIO
    steps = [
        f"llmtrain generate {q(trainer.checkpoints.url)} --prompt 'A dog'   # sample",
        f"llmtrain eval {q(trainer.checkpoints.url)} --data {q(work / 'valid.zarr')}"
        "   # loss on the held-out data",
        # the run's cosine schedule has ended: more steps go on at its final lr (recomputing
        # the schedule for the new length would jump the lr back up; `llmtrain run` refuses
        # that unless told which)
        f"llmtrain run {q(config_file)} training.steps={args.steps * 2} training.on_extend=keep"
        f"   # {args.steps} more steps at the final lr, {final_lr:.2e}",
    ]
    on_path = put_on_path()
    if on_path is None:
        say("next steps:")
    else:
        line, scripts = on_path
        say(f"next steps (llmtrain is in {scripts}; the first line puts it on the PATH):")
        steps.insert(0, line)
    print("\n".join(f"  {step}" for step in steps), file=sys.stderr, flush=True)
    return 0


def q(path: str | Path) -> str:
    return shlex.quote(str(path))


def put_on_path() -> tuple[str, Path] | None:
    """(the shell line that puts this environment's `llmtrain` on the PATH, the directory it is
    in), for a virtual environment (a nox session's, which nothing activated in the user's
    shell); None outside one, where pip put `llmtrain` on the PATH already."""
    if sys.prefix == sys.base_prefix:
        return None
    scripts = Path(sysconfig.get_path("scripts"))
    activate = scripts / "activate"
    if activate.is_file():
        return f"source {q(activate)}", scripts
    return f'export PATH={q(scripts)}:"$PATH"', scripts
