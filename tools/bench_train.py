"""Overhead of `llmtrain run` against a bare PyTorch loop over the same model and batches.

    python tools/bench_train.py [--models tiny,30m] [--steps 30] [--seq-len 256] [--batch 8]

For each model both loops run in this process, on the same packed data (a synthetic corpus,
byte tokenizer) and the same device:
- the Trainer: the real `Trainer` from a run config, its steps timed by its own metrics (the
  loop's tokens/s, including waiting for data, over the steps after warm-up);
- bare: build the model, AdamW, then per step: forward, mean cross-entropy, backward,
  clip_grad_norm_, step, zero_grad, over the same batches already in memory.
Prints tokens/s of each, the ratio (goal: overhead <= 3%, ratio >= 0.97) and the Trainer's
data-wait share (goal < 1%).
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from llmtrain.core_mesh.config import load_config
from llmtrain.core_mesh.plugins import PluginManager
from llmtrain.data_pack.loader import open_windows
from llmtrain.data_pack.pack import pack
from llmtrain.data_pack.sampling import BatchPlan
from llmtrain.models.presets import preset_config
from llmtrain.models.transformer import build_model
from llmtrain.train_loop.experiments.quickstart import write_corpus
from llmtrain.train_loop.run_config import RunConfig
from llmtrain.train_loop.trainer import Trainer

MODELS = {
    "tiny": {"kind": "tiny", "vocab_size": 320},
    # about 30M parameters: 8 blocks of width 512
    "30m": {
        "kind": "tiny",
        "vocab_size": 320,
        "d_model": 512,
        "n_layers": 8,
        "n_heads": 8,
        "n_kv_heads": 8,
        "mlp_multiple_of": 256,
    },
}


def make_data(work: Path, plugins: PluginManager) -> str:
    corpus = work / "corpus.jsonl"
    write_corpus(corpus, 6000, seed=0)
    out = work / "corpus.zarr"
    pack([str(corpus)], str(out), {"kind": "bytes"}, overwrite=True, plugins=plugins)
    return str(out)


def config_text(work: Path, data: str, model: dict, args, steps: int, run: int = 0) -> str:
    model_yaml = ", ".join(f"{k}: {v}" for k, v in {**model, "max_seq_len": args.seq_len}.items())
    return f"""\
name: bench-{model["kind"]}-{model.get("d_model", 64)}-{run}
run_dir: {work / "runs"}
device: cpu
model: {{{model_yaml}}}
data: {{train: [{{path: {data}}}], seq_len: {args.seq_len}, micro_batch: {args.batch}}}
optimizer: {{kind: adamw, lr: 1.0e-3}}
training: {{steps: {steps}, log_every: {args.warmup}, max_grad_norm: 1.0}}
checkpoint: {{resume: never}}
loggers: [{{kind: jsonl}}]
"""


def trainer_run(
    work: Path, data: str, model: dict, args, plugins, run: int = 0
) -> tuple[float, float, int]:
    """(tokens/s, data-wait share) over the steps after warm-up, from the run's own metrics."""
    steps = args.warmup + args.steps
    path = work / f"{model.get('d_model', 64)}.yaml"
    path.write_text(config_text(work, data, model, args, steps, run))
    config = load_config(str(path), RunConfig, plugins=plugins)
    torch.manual_seed(0)
    trainer = Trainer(config, plugins, resume=False)
    params = sum(p.numel() for p in trainer.model.parameters())
    try:
        trainer.train()
    finally:
        trainer.close()
    lines = [json.loads(x) for x in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    # windows after the first (warm-up) one; the last may be shorter
    timed = [m for m in lines if m["step"] > args.warmup]
    tokens = sum(m["tokens_per_s"] * m["step_time_s"] * _steps(m, lines) for m in timed)
    seconds = sum(m["step_time_s"] * _steps(m, lines) for m in timed)
    wait = sum(m["data_wait"] * m["step_time_s"] * _steps(m, lines) for m in timed)
    return tokens / seconds, wait / seconds, params


def _steps(m: dict, lines: list[dict]) -> int:
    before = [x["step"] for x in lines if x["step"] < m["step"]]
    return m["step"] - (max(before) if before else 0)


def bare_run(data: str, model: dict, args) -> float:
    """tokens/s of the plain loop over the same batches (already in memory)."""
    options = {k: v for k, v in model.items() if k != "kind"}
    cfg = preset_config(model["kind"], **options, max_seq_len=args.seq_len)
    windows = open_windows([data], args.seq_len, seed=0)
    plan = BatchPlan(args.batch)
    batches = [
        torch.from_numpy(windows.read(np.concatenate(plan.step(s)))["tokens"])
        for s in range(args.warmup + args.steps)
    ]
    torch.manual_seed(0)
    net = build_model(cfg)
    net.init_weights()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, foreach=True)
    started = None
    for i, tokens in enumerate(batches):
        if i == args.warmup:
            started = time.perf_counter()
        logits = net(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()  # the trainer reads the loss every step too
    elapsed = time.perf_counter() - started
    return args.steps * args.batch * args.seq_len / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,30m")
    parser.add_argument("--steps", type=int, default=30, help="timed steps")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2, help="alternate runs; best of each")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    plugins = PluginManager().load_entry_points()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data = make_data(work, plugins)
        for name in args.models.split(","):
            model = MODELS[name]
            run, bare, waits = 0.0, 0.0, []
            for repeat in range(args.repeats):  # alternate: drift on a shared machine hits both
                tps, wait, params = trainer_run(work, data, model, args, plugins, repeat)
                run, waits = max(run, tps), [*waits, wait]
                bare = max(bare, bare_run(data, model, args))
            rows.append((name, params, run, bare, min(waits)))
    print(
        f"{'model':6} {'params':>10} {'llmtrain run':>14} {'bare loop':>12} {'ratio':>7} {'data wait':>10}"
    )
    for name, params, run, bare, wait in rows:
        print(
            f"{name:6} {params:>10,} {run:>12,.0f}/s {bare:>10,.0f}/s {run / bare:>7.3f} "
            f"{100 * wait:>9.2f}%"
        )
    worst = min(r[2] / r[3] for r in rows)
    print(f"\noverhead goal <= 3% (ratio >= 0.97): worst ratio {worst:.3f}")
    if not math.isfinite(worst):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
