"""`llmtrain quickstart --mixture`: three data domains of llmtrain's own making for a mixture
study on a laptop CPU, with nothing downloaded.

- `prose`: sentences from the quickstart's small grammar;
- `code`: small functions of Python-like code (a signature, assignments, a return);
- `noise`: random characters, which no model can learn (each is one of 64, about 6 bits).

Each domain is packed (the `bytes` tokenizer: no training) with a held-out part, and a base
config `mixture.yaml` trains the tiny model on all three, evaluating each held-out part as a
named eval set (`eval/prose/loss`, ...). The next steps are printed: the proxy swarm (`sweep
--mixtures`), the fit of a target that weights prose and code (`fit --mixture`), and training
the predicted mixture against uniform weights (`compare`). The train-loop README's "Finding a
data mixture" walks through them.
"""

from __future__ import annotations

import argparse
import json
import random
import string
import sys
from collections.abc import Callable
from pathlib import Path

from llmtrain.core_mesh.cli import Context

DOMAINS = ("prose", "code", "noise")
NOISE_ALPHABET = string.ascii_letters + string.digits + "+-"  # 64 characters
TARGET = "eval/prose/loss=0.5,eval/code/loss=0.5"
STEPS = 120
DOCUMENTS = 1500


def prose(rng: random.Random) -> str:
    from llmtrain.train_loop.experiments.quickstart import sentence

    return " ".join(sentence(rng) for _ in range(rng.randint(2, 8)))


NAMES = ["count", "total", "item", "value", "size", "index", "left", "right", "step", "rate"]
NAMES += ["width", "height", "node", "key", "score", "limit", "offset", "delta", "start", "end"]


def code(rng: random.Random) -> str:
    """A small function of Python-like code: a signature, assignments, a return."""
    args = rng.sample(NAMES, rng.randint(1, 3))
    known = list(args)
    lines = [
        f"def {rng.choice(['get', 'make', 'find', 'update'])}_{rng.choice(NAMES)}({', '.join(args)}):"
    ]
    for _ in range(rng.randint(1, 5)):
        name = rng.choice(NAMES)
        op = rng.choice(["+", "-", "*", "//"])
        lines.append(f"    {name} = {rng.choice(known)} {op} {rng.randint(1, 99)}")
        known.append(name)
    lines.append(f"    return {rng.choice(known)}")
    return "\n".join(lines)


def noise(rng: random.Random) -> str:
    return "".join(rng.choice(NOISE_ALPHABET) for _ in range(rng.randint(60, 300)))


WRITERS: dict[str, Callable[[random.Random], str]] = {
    "prose": prose,
    "code": code,
    "noise": noise,
}


def write_domain(path: Path, domain: str, documents: int, seed: int) -> None:
    """JSONL documents of one domain (`{"id": ..., "text": ...}`)."""
    rng = random.Random(f"{domain}-{seed}")  # noqa: S311 - sample text, not secrets
    with path.open("w", encoding="utf-8") as f:
        for i in range(documents):
            f.write(json.dumps({"id": i, "text": WRITERS[domain](rng)}) + "\n")


def base_config(work: Path, steps: int) -> str:
    """The swarm's base: the tiny model on the three domains, each held-out part evaluated at
    the end (the value the fit reads) and a few times before."""
    every = max(steps // 4, 1)
    train = ", ".join(f"{{name: {d}, path: {work / f'{d}.zarr'}}}" for d in DOMAINS)
    evals = "\n".join(
        f"    - {{name: {d}, path: {work / f'{d}-valid.zarr'}, every: {every}, batches: 4}}"
        for d in DOMAINS
    )
    return f"""\
name: mixture
run_dir: {work / "runs"}
device: cpu
model: {{kind: tiny, vocab_size: 258, max_seq_len: 64, d_model: 64, n_layers: 2, n_heads: 2}}
data:
  train: [{train}]
  eval:
{evals}
  seq_len: 64
  micro_batch: 16
optimizer: {{kind: adamw, lr: 3.0e-3, weight_decay: 0.1}}
lr_scheduler: {{kind: cosine, warmup_steps: {max(steps // 20, 1)}, min_ratio: 0.1}}
training: {{steps: {steps}, log_every: {every}, checkpoint_every: {steps}}}
loggers: [{{kind: jsonl}}]
"""


def make(work: Path, documents: int, steps: int) -> Path:
    """The packed domains and the base config in `work`; returns the config's path."""
    from llmtrain.data_pack.pack import pack

    work.mkdir(parents=True, exist_ok=True)
    for i, domain in enumerate(DOMAINS):
        for split, count, seed in (("", documents, i), ("-valid", max(documents // 10, 40), 99)):
            jsonl = work / f"{domain}{split}.jsonl"
            write_domain(jsonl, domain, count, seed)
            pack(
                [str(jsonl)],
                str(work / f"{domain}{split}.zarr"),
                {"kind": "bytes"},
                overwrite=True,
                workers=1,
            )
    config = work / "mixture.yaml"
    config.write_text(base_config(work, steps), encoding="utf-8")
    return config


def run(args: argparse.Namespace, ctx: Context) -> int:
    """`quickstart --mixture`: make the domains and the base config, print the recipe."""
    from llmtrain.core_mesh.logs import configure_logging
    from llmtrain.train_loop.experiments.quickstart import q

    configure_logging(console=sys.stderr)  # stdout stays empty
    work = Path(args.dir).resolve()
    documents = DOCUMENTS if args.documents is None else args.documents
    print(f"[quickstart --mixture] domains {', '.join(DOMAINS)} -> {work}", file=sys.stderr)
    config = make(work, documents, STEPS if args.steps is None else args.steps)
    sweeps = work / "sweeps"
    lines = [
        f"llmtrain sweep {q(config)} --mixtures 16 --dir {q(sweeps)} --name swarm"
        "   # 16 proxy runs on Dirichlet mixtures",
        f"llmtrain fit {q(sweeps / 'swarm')} --mixture --target '{TARGET}'"
        "   # the predicted best mixture",
        f"llmtrain report {q(sweeps / 'swarm')} --target '{TARGET}'   # the mixture report",
    ]
    print(f"base config: {config}\nnext steps:", file=sys.stderr)
    print("\n".join(f"  {line}" for line in lines), file=sys.stderr, flush=True)
    return 0
