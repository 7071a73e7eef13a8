"""pack-chat tokens/s against plain `pack` of the same rendered text: python tools/bench_pack_chat.py
[--conversations N] [--workers N] [--rounds N].

Generated multi-turn conversations (2-4 exchanges of English-like sentences, some with a system
message) and a byte-level BPE with the ChatML tokens, trained on them. Each round times:
- reference: `pack` of the same conversations already rendered with the template (one text per
  conversation, the template's special tokens parsed), so it writes the same tokens without the
  chat machinery;
- pack-chat: `pack(..., chat=...)` from the conversations: rendering growing prefixes, piecewise
  tokenization, the loss mask and the block layout.
Both run with the same tokenizer backend (HF, reference encoder) and worker count; the ratio is
pack-chat tokens/s over reference tokens/s, padding not counted (rounds interleaved, medians).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from llmtrain.core_mesh.logs import configure_logging
from llmtrain.data_pack.chat import ChatSettings, ChatTemplate
from llmtrain.data_pack.pack import pack
from llmtrain.data_pack.store import PackedDataset
from llmtrain.data_pack.tokenizer import train_bpe
from llmtrain.train_loop.experiments.quickstart import sentence

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def conversations(n: int, seed: int = 0) -> list[list[dict[str, str]]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        messages = [{"role": "system", "content": sentence(rng)}] if rng.random() < 0.3 else []
        for _ in range(rng.randint(2, 4)):
            messages.append({"role": "user", "content": sentence(rng)})
            messages.append({"role": "assistant", "content": " ".join(sentence(rng) for _ in "ab")})
        out.append(messages)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--conversations", type=int, default=20000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=1024)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-pack-chat-"))
    configure_logging(log_dir=work / "logs", level="WARNING")
    convs = conversations(args.conversations)
    template = ChatTemplate.chatml()
    rendered = [template.render(c) for c in convs]
    (work / "chat.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))
    (work / "text.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in rendered))
    bpe = train_bpe(rendered[:2000], 4096, special_tokens=SPECIALS)
    (work / "tokenizer.json").write_text(bpe)
    base = {"kind": "hf", "path": str(work / "tokenizer.json"), "fast": "off"}
    reference_tok = {**base, "parse_special": True}  # the rendered text's markers as their ids
    settings = ChatSettings(template.to_meta(), args.seq_len)
    runs = {"reference": ("text", reference_tok, None), "pack-chat": ("chat", base, settings)}
    timings: dict[str, list[float]] = {"reference": [], "pack-chat": []}
    tokens: dict[str, int] = {}
    for _ in range(args.rounds):
        for name in timings:
            source, tokenizer, chat = runs[name]
            started = time.perf_counter()
            summary = pack(
                [str(work / f"{source}.jsonl")],
                str(work / f"{source}.zarr"),
                tokenizer,
                workers=args.workers,
                overwrite=True,
                chat=chat,
            )
            timings[name].append(time.perf_counter() - started)
            tokens[name] = summary.tokens
            if name == "pack-chat":  # the block padding is not work: counted out
                counts = PackedDataset(str(work / "chat.zarr")).meta["counts"]
                tokens[name] -= counts["padding_tokens"]
                padding = counts["padding_tokens"]
    print(
        f"{args.conversations} conversations, {args.workers} workers, seq_len {args.seq_len}, "
        f"{args.rounds} rounds (median)"
    )
    rate = {}
    for name, seconds in timings.items():
        rate[name] = tokens[name] / statistics.median(seconds)
        print(
            f"  {name:10} {tokens[name]:>10,} tokens  {statistics.median(seconds):6.2f} s  "
            f"{rate[name]:>12,.0f} tokens/s"
        )
    print(f"  ratio pack-chat / reference: {rate['pack-chat'] / rate['reference']:.2f}")
    print(f"  (pack-chat also wrote {padding:,} tokens of block padding, not counted above)")


if __name__ == "__main__":
    main()
