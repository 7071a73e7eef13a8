"""Forward+backward tokens/s of llmtrain's Transformer vs a plain-PyTorch reference: python tools/bench_model.py [--config llama-small|gpt2-small|gpt2-124m|llama-1b|smoke|small|large|all] [--json].

Both models get the same token batch, the same loss (computed outside the models), the same
thread count and dtype; each step is zero grads, forward, loss, backward (no optimizer). After a
warmup, the two models are timed in interleaved rounds to cancel drift; medians are reported.
GPU: --device cuda --dtype bf16 --compile (also prints MFU against --peak-tflops).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

COMMON = dict(vocab_size=8192, d_model=512, n_layers=8, n_heads=8, seq=256, batch=8)
CONFIGS = {
    "llama-small": dict(
        COMMON, n_kv_heads=4, positions="rope", norm="rmsnorm", mlp="swiglu", bias=False
    ),
    "gpt2-small": dict(
        COMMON, n_kv_heads=8, positions="learned", norm="layernorm", mlp="gelu", bias=True
    ),
}
# the GPU kit's dry run: the same code path in a second, not a measurement
CONFIGS["smoke"] = dict(COMMON, vocab_size=512, d_model=64, n_layers=2, n_heads=4, seq=64,
                        batch=2, n_kv_heads=2, positions="rope", norm="rmsnorm", mlp="swiglu",
                        bias=False)  # fmt: skip
GOAL = 0.97


def _preset(name: str, seq: int, batch: int) -> dict:
    """A published shape from llmtrain.models' presets, in this script's terms."""
    from llmtrain.models.presets import PRESETS

    keys = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "positions", "norm")
    shape = {
        k: PRESETS[name][k] for k in (*keys, "mlp", "bias", "mlp_hidden") if k in PRESETS[name]
    }
    return {"n_kv_heads": shape["n_heads"], **shape, "seq": seq, "batch": batch}


# the small shapes measure overhead on a CPU; the large ones are the GPU kit's (tools/gpu)
CONFIGS |= {"gpt2-124m": _preset("gpt2-124m", 1024, 8), "llama-1b": _preset("llama-1b", 2048, 4)}
GROUPS = {"small": ["llama-small", "gpt2-small"], "large": ["gpt2-124m", "llama-1b"]}


# ---------------------------------------------------------------- reference (plain PyTorch)
class RefBlock(nn.Module):
    def __init__(self, c: dict, hidden: int):
        super().__init__()
        d, bias, self.c = c["d_model"], c["bias"], c
        self.hd = d // c["n_heads"]
        self.norm1, self.norm2 = make_norm(c), make_norm(c)
        self.qkv = nn.Linear(d, (c["n_heads"] + 2 * c["n_kv_heads"]) * self.hd, bias=bias)
        self.proj = nn.Linear(d, d, bias=bias)
        n_up = 2 if c["mlp"] == "swiglu" else 1
        self.up = nn.Linear(d, n_up * hidden, bias=bias)
        self.down = nn.Linear(hidden, d, bias=bias)

    def attn(self, x, cos, sin):
        B, T, _ = x.shape
        h, kv, hd = self.c["n_heads"], self.c["n_kv_heads"], self.hd
        q, k, v = self.qkv(x).split([h * hd, kv * hd, kv * hd], dim=-1)
        q, k, v = (t.view(B, T, -1, hd).transpose(1, 2) for t in (q, k, v))
        if cos is not None:
            q, k = rope(q, cos, sin), rope(k, cos, sin)
        if kv != h:
            k, v = k.repeat_interleave(h // kv, dim=1), v.repeat_interleave(h // kv, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, h * hd))

    def mlp(self, x):
        if self.c["mlp"] == "swiglu":
            gate, up = self.up(x).chunk(2, dim=-1)
            return self.down(F.silu(gate) * up)
        return self.down(F.gelu(self.up(x)))

    def forward(self, x, cos, sin):
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


def make_norm(c: dict) -> nn.Module:
    norm = nn.RMSNorm if c["norm"] == "rmsnorm" else nn.LayerNorm
    return norm(c["d_model"], eps=1e-5)


def rope(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class RefModel(nn.Module):
    def __init__(self, c: dict, vocab: int, hidden: int):
        super().__init__()
        d, self.c = c["d_model"], c
        self.tok_emb = nn.Embedding(vocab, d)
        self.pos_emb = nn.Embedding(c["seq"], d) if c["positions"] == "learned" else None
        self.blocks = nn.ModuleList(RefBlock(c, hidden) for _ in range(c["n_layers"]))
        self.norm = make_norm(c)
        hd = d // c["n_heads"]
        inv_freq = 1.0 / 10000.0 ** (torch.arange(0, hd, 2).float() / hd)
        freqs = torch.outer(torch.arange(c["seq"]).float(), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, tokens):
        T = tokens.shape[1]
        x = self.tok_emb(tokens)
        cos = sin = None
        if self.pos_emb is not None:
            x = x + self.pos_emb(torch.arange(T, device=tokens.device))
        else:
            cos, sin = self.cos[:T], self.sin[:T]
        for block in self.blocks:
            x = block(x, cos, sin)
        return F.linear(self.norm(x), self.tok_emb.weight)  # tied head


# ---------------------------------------------------------------- harness
def sizes(c: dict) -> tuple[int, int]:
    vocab = math.ceil(c["vocab_size"] / 64) * 64
    if c.get("mlp_hidden"):
        return vocab, c["mlp_hidden"]
    swiglu_hidden = math.ceil(int(8 * c["d_model"] / 3) / 256) * 256
    return vocab, swiglu_hidden if c["mlp"] == "swiglu" else 4 * c["d_model"]


def build_ours(c: dict):
    from llmtrain.models.config import TransformerConfig
    from llmtrain.models.transformer import build_model

    fields = {k: v for k, v in c.items() if k not in ("seq", "batch")}
    cfg = TransformerConfig(**fields, max_seq_len=c["seq"], pad_vocab_to=64, dropout=0.0)
    return build_model(cfg)


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() deduplicates tied weights


def make_step(model, tokens, autocast):
    def step():
        model.zero_grad(set_to_none=True)
        with autocast():
            logits = model(tokens)
        loss = F.cross_entropy(
            logits[:, :-1].float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)
        )
        loss.backward()

    return step


def timed(step, n: int, sync) -> float:
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    sync()
    return time.perf_counter() - t0


def bench(name: str, args) -> dict:
    c = CONFIGS[name]
    vocab, hidden = sizes(c)
    dev = torch.device(args.device)
    torch.manual_seed(0)
    with dev:
        models = {"reference": RefModel(c, vocab, hidden)}
        if not args.reference_only:
            models["ours"] = build_ours(c)
    counts = {k: n_params(m) for k, m in models.items()}
    if "ours" in counts:
        diff = abs(counts["ours"] - counts["reference"]) / counts["reference"]
        if diff > 0.001:
            sys.exit(f"{name}: parameter counts differ by {diff:.3%}: {counts}")
    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, c["vocab_size"], (c["batch"], c["seq"]), generator=g).to(dev)
    autocast = nullcontext
    if args.dtype == "bf16":
        autocast = lambda: torch.autocast(dev.type, dtype=torch.bfloat16)  # noqa: E731

    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    steps = {}
    for k, m in models.items():
        m.train()
        steps[k] = make_step(torch.compile(m) if args.compile else m, tokens, autocast)
        for _ in range(args.warmup):
            steps[k]()
    tok_per_step = c["batch"] * c["seq"]
    rates: dict[str, list[float]] = {k: [] for k in models}
    order = list(models)
    for r in range(args.rounds):
        for k in order if r % 2 == 0 else order[::-1]:  # alternate who goes first
            rates[k].append(tok_per_step * args.steps / timed(steps[k], args.steps, sync))
    res = {
        "config": name,
        "params": counts,
        "tokens_per_s": {k: statistics.median(v) for k, v in rates.items()},
        "rounds_tokens_per_s": rates,
    }
    if "ours" in models:
        tps = res["tokens_per_s"]
        res["ratio"] = tps["ours"] / tps["reference"]
        res["goal"] = f">= {GOAL}"
        res["meets_goal"] = res["ratio"] >= GOAL
        if dev.type == "cuda":
            fpt = models["ours"].describe().flops_per_token(c["seq"])
            res["mfu"] = {k: fpt * v / (args.peak_tflops * 1e12) for k, v in tps.items()}
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--config",
        choices=[*CONFIGS, *GROUPS, "all"],
        default="small",
        help="one shape, or small (the CPU pair, the default), large (gpt2-124m, llama-1b), all",
    )
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=5, help="steps per model per round")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="for MFU (H100 bf16 dense)")
    p.add_argument("--reference-only", action="store_true", help="skip llmtrain's model")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    names = list(CONFIGS) if args.config == "all" else GROUPS.get(args.config, [args.config])
    print(
        f"device={args.device} dtype={args.dtype} compile={args.compile} threads={args.threads} "
        f"warmup={args.warmup} rounds={args.rounds}x{args.steps} steps (tokens/s: median of rounds)"
    )
    row = "{:<12} {:>11} {:>11} {:>10} {:>10} {:>6}  {}"
    print(
        row.format(
            "config", "params ref", "params ours", "ref tok/s", "ours tok/s", "ratio", "goal"
        )
    )
    results = []
    for name in names:
        r = bench(name, args)
        results.append(r)
        tps, n = r["tokens_per_s"], r["params"]
        cells = [f"{n['reference']:,}", f"{n.get('ours', 0):,}", f"{tps['reference']:,.0f}"]
        if "ratio" in r:
            verdict = "ok" if r["meets_goal"] else "MISS"
            cells += [f"{tps['ours']:,.0f}", f"{r['ratio']:.3f}", f">= {GOAL} {verdict}"]
        else:
            cells += ["-", "-", "-"]
        print(row.format(name, *cells))
        if "mfu" in r:
            print(f"{'':<12} MFU ref {r['mfu']['reference']:.1%}  ours {r['mfu']['ours']:.1%}")
    if args.json:
        print(json.dumps({"args": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()
