"""The floor for llmtrain's overhead: the same model trained on the same packed data by a bare
PyTorch loop (torch.compile, bf16 autocast, fused AdamW), tokens/s and MFU.

    python tools/gpu/bare_loop.py --data DATA.zarr --model llama-1b --seq-len 2048 --batch 4 \
        --steps 30 --warmup 10 --device cuda --dtype bf16 --compile --json bare.json

Per step: forward, mean cross-entropy in float32, backward, clip_grad_norm_(1.0) (the run
config's default), AdamW step, zero_grad, and reading the loss (the Trainer reads it every step
too). The batches are read into memory first, so the loop never waits for data.
"""

from __future__ import annotations

import argparse
import json
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from llmtrain.data_pack.loader import open_windows
from llmtrain.data_pack.sampling import BatchPlan
from llmtrain.models.presets import preset_config
from llmtrain.models.transformer import build_model
from llmtrain.train_loop.builtin_callbacks import peak_flops


def model_options(pairs: list[str]) -> dict:
    """`--set vocab_size=320` pairs; values are read as JSON where they parse (numbers, bools)."""
    options = {}
    for pair in pairs:
        key, _, text = pair.partition("=")
        try:
            options[key] = json.loads(text)
        except json.JSONDecodeError:
            options[key] = text
    return options


def read_batches(data: str, seq_len: int, batch: int, steps: int, device: str) -> list:
    windows = open_windows([data], seq_len, seed=0)
    plan = BatchPlan(batch)
    rows = (windows.read(np.concatenate(plan.step(s)))["tokens"] for s in range(steps))
    return [torch.from_numpy(r.astype(np.int64)).to(device) for r in rows]


def train(net, batches: list, args) -> float:
    """Seconds for the steps after the warm-up ones (compilation happens in those)."""
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4, fused=True)
    autocast = (
        torch.autocast(args.device, dtype=torch.bfloat16) if args.dtype == "bf16" else nullcontext()
    )
    started = 0.0
    for i, tokens in enumerate(batches):
        if i == args.warmup:
            synchronize(args.device)
            started = time.perf_counter()
        with autocast:
            logits = net(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
    synchronize(args.device)
    return time.perf_counter() - started


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="a packed dataset (llmtrain data pack)")
    p.add_argument("--model", default="llama-1b", help="a preset of llmtrain.models")
    p.add_argument("--set", action="append", default=[], help="model option, e.g. n_layers=4")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4, help="sequences per step")
    p.add_argument("--steps", type=int, default=30, help="timed steps, after the warm-up")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--peak-tflops", type=float, help="for MFU (default: by GPU name)")
    p.add_argument("--json", help="also write the figures to this file")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    cfg = preset_config(args.model, **model_options(args.set), max_seq_len=args.seq_len)
    torch.manual_seed(0)
    net = build_model(cfg)
    net.init_weights()
    net.to(args.device)
    description = net.describe()
    batches = read_batches(
        args.data, args.seq_len, args.batch, args.warmup + args.steps, args.device
    )
    seconds = train(torch.compile(net) if args.compile else net, batches, args)
    tokens_per_s = args.steps * args.batch * args.seq_len / seconds
    figures = {"model": args.model, "params": description.n_params, "tokens_per_s": tokens_per_s}
    peak = peak_flops(args.peak_tflops, torch.device(args.device))
    if peak:
        figures["mfu"] = tokens_per_s * description.flops_per_token(args.seq_len) / peak
    print(json.dumps(figures))
    if args.json:
        Path(args.json).write_text(json.dumps(figures))


if __name__ == "__main__":
    main()
