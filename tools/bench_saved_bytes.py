"""Bytes a training step keeps for its backward pass, per token, by part of the model: python
tools/bench_saved_bytes.py [--model llama-1b] [--layers 2] [--seq-len 2048] [--batch 1] [--json].

Activation memory, not speed, so it is measured on a CPU: every tensor autograd saves for the
backward pass goes through `torch.autograd.graph.saved_tensors_hooks`, and its bytes are summed
(each storage once; parameters and autocast's bf16 copies of them are weights, not activations,
and are left out)
by where it was saved: the block stack, or the final norm + output projection + loss. Each
configuration is measured twice in the same run: the loss from the logits of the whole batch
(`CrossEntropySum()(logits, targets)`, llmtrain before the chunked loss, and what TP/PP layouts
still use) against the chunked loss from the hidden states (`from_hidden`, what a run uses
now), each with and without document masking. bf16 autocast, as the GPU runs train.

The chunked loss keeps the float32 gradient of the output matrix (V x d) from the forward to the
backward: a fixed size, so its share per token falls as the batch grows (run with the batch
the GPU trains, `--batch 4`, to compare with TorchTitan's). The block stack of a few layers
stands for the whole: its bytes per token per layer are printed,
and the full model's estimate is `layers x per-layer + head`. The head's part is what the chunked
loss changes; the block stack's is what document masking may change (its mask is built once per
step and shared by every layer).
"""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import contextmanager

import torch

from llmtrain.models.presets import preset_config
from llmtrain.models.transformer import build_model
from llmtrain.train_loop.loss import cross_entropy_sum


class SavedBytes:
    """Counts the bytes of tensors saved for backward, per region, each storage once."""

    def __init__(self, model: torch.nn.Module):
        self.weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
        # autocast's bf16 copies of the weights (its cast cache) are weights too: same shapes
        self.weight_shapes = {tuple(p.shape) for p in model.parameters()}
        self.region = "blocks"
        self.bytes: dict[str, int] = {"blocks": 0, "head_and_loss": 0}
        self._seen: set[int] = set()

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        weight_copy = tensor.dtype == torch.bfloat16 and tuple(tensor.shape) in self.weight_shapes
        if key and key not in self._seen and key not in self.weights and not weight_copy:
            self._seen.add(key)
            self.bytes[self.region] += storage.nbytes()
        return tensor

    @contextmanager
    def counting(self, model: torch.nn.Module):
        # the final norm starts the head's region: what it and everything after save
        hook = model.norm.register_forward_pre_hook(
            lambda *_: setattr(self, "region", "head_and_loss")
        )
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t):
                yield self
        finally:
            hook.remove()


def measure(model, tokens, targets, doc_starts, chunked: bool) -> dict[str, int]:
    loss = cross_entropy_sum()
    counter = SavedBytes(model)
    with torch.autocast("cpu", dtype=torch.bfloat16), counter.counting(model):
        if chunked:
            out = model(tokens, doc_starts, head_fn=lambda h, w: loss.from_hidden(h, w, targets))
        else:
            out = loss(model(tokens, doc_starts), targets)
    out.backward()
    model.zero_grad(set_to_none=True)
    return counter.bytes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-1b")
    parser.add_argument("--layers", type=int, default=2, help="blocks to build (default 2)")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    rows = []
    for doc_masking in (False, True):
        cfg = preset_config(
            args.model, n_layers=args.layers, max_seq_len=args.seq_len, doc_masking=doc_masking
        )
        model = build_model(cfg)
        model.init_weights(torch.Generator().manual_seed(0))
        g = torch.Generator().manual_seed(1)
        window = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len + 1), generator=g)
        tokens, targets = window[:, :-1], window[:, 1:]
        doc_starts = None
        if doc_masking:
            # documents of 300 tokens, as packed data has them
            doc_starts = torch.zeros_like(tokens, dtype=torch.bool)
            doc_starts[:, ::300] = True
        for chunked in (False, True):
            saved = measure(model, tokens, targets, doc_starts, chunked)
            n = tokens.numel()
            rows.append(
                {
                    "doc_masking": doc_masking,
                    "loss": "chunked (from hidden states)" if chunked else "logits (before)",
                    "blocks_per_layer_per_token": saved["blocks"] / args.layers / n,
                    "head_and_loss_per_token": saved["head_and_loss"] / n,
                    "head_and_loss_mib": saved["head_and_loss"] / 2**20,
                    "full_model_per_token": (
                        saved["blocks"] / args.layers * preset_config(args.model).n_layers
                        + saved["head_and_loss"]
                    )
                    / n,
                }
            )
    if args.json:
        print(json.dumps({"model": args.model, "seq_len": args.seq_len, "rows": rows}))
        return 0
    print(
        f"{args.model}, seq {args.seq_len} x batch {args.batch}, bf16 autocast: "
        "bytes saved for backward per token (head+loss also in MiB for this batch)"
    )
    header = ("doc masking", "loss", "per layer", "head+loss", "whole model", "head+loss MiB")
    print(f"{header[0]:<12} {header[1]:<30} " + " ".join(f"{h:>13}" for h in header[2:]))
    for r in rows:
        numbers = (
            r["blocks_per_layer_per_token"],
            r["head_and_loss_per_token"],
            r["full_model_per_token"],
            r["head_and_loss_mib"],
        )
        print(
            f"{r['doc_masking']!s:<12} {r['loss']:<30} " + " ".join(f"{x:>13,.0f}" for x in numbers)
        )
    for masking in (False, True):
        before, after = (r for r in rows if r["doc_masking"] == masking)
        ratio = after["head_and_loss_per_token"] / before["head_and_loss_per_token"]
        whole = after["full_model_per_token"] / before["full_model_per_token"]
        print(f"doc masking {masking}: head+loss {ratio:.3f} of before, whole model {whole:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
