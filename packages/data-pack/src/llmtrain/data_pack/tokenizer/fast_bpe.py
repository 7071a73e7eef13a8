"""The `hf` tokenizer's fast path: when a tokenizer.json is a GPT-2-style byte-level BPE that
tiktoken's BPE core encodes to the same ids (several times faster per thread), that Encoding.
`tiktoken_arrays` is how both the fast path and the `tiktoken` backend encode."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from llmtrain.data_pack.tokenizer.common import GPT2_PATTERN


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (how byte-level BPE stores tokens)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += range(ord("®"), ord("ÿ") + 1)
    chars = list(keep)
    extra = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(keep, map(chr, chars), strict=True))


def split_pattern(pre: dict[str, Any] | None) -> str | None:
    """The regex a byte-level pre-tokenizer splits with, or None if tiktoken cannot mirror it."""
    if pre is None:
        return None
    if pre.get("type") == "ByteLevel":
        if pre.get("add_prefix_space") or not pre.get("use_regex", True):
            return None
        return GPT2_PATTERN
    if pre.get("type") == "Sequence":
        steps = pre.get("pretokenizers") or []
        if len(steps) == 1:
            return split_pattern(steps[0])
        if len(steps) == 2:
            split, byte_level = steps
            if (
                split.get("type") == "Split"
                and "Regex" in (split.get("pattern") or {})
                and split.get("behavior") == "Isolated"
                and not split.get("invert")
                and byte_level.get("type") == "ByteLevel"
                and not byte_level.get("add_prefix_space")
                and not byte_level.get("use_regex", True)
            ):
                regex = split["pattern"]["Regex"]
                return regex if isinstance(regex, str) else None
    return None


def tiktoken_equivalent(spec: dict[str, Any], tokenizer: Any = None) -> tuple[Any | None, str]:
    """A tiktoken Encoding with the same ids as this tokenizer.json, or (None, why not).

    tiktoken merges any adjacent pair whose concatenation is a token; HF merges only listed
    pairs. They agree when token ids follow the merge order and every token is what HF's own BPE
    makes of its bytes (true of tokenizers trained by BPE); `tokenizer` is the loaded HF tokenizer
    (built from `spec` if not given). `pack` still compares both on a sample of the corpus."""
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        return None, f"model type {model.get('type')!r} is not BPE"
    for key in ("dropout", "continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(key):
            return None, f"BPE option {key} is set"
    if model.get("byte_fallback"):
        return None, "byte_fallback is set"
    if spec.get("normalizer") is not None:
        return None, "it has a normalizer"
    pattern = split_pattern(spec.get("pre_tokenizer"))
    if pattern is None:
        return None, "the pre-tokenizer is not byte-level BPE with a split regex"
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    added = {t["content"]: t["id"] for t in spec.get("added_tokens") or []}
    if any(
        t.get("lstrip") or t.get("rstrip") or t.get("single_word") or not t.get("special")
        for t in spec.get("added_tokens") or []
    ):
        return None, "an added token is not special, strips, or matches single words"
    ranks: dict[bytes, int] = {}
    for token, i in model.get("vocab", {}).items():
        if token in added:
            continue
        try:
            ranks[bytes(byte_of[c] for c in token)] = i
        except KeyError:
            return None, f"vocab entry {token!r} is not byte-level"
    if any(bytes([b]) not in ranks for b in range(256)):
        return None, "not every byte has a token"
    last = -1
    for merge in model.get("merges", []):
        a, b = merge.split(" ", 1) if isinstance(merge, str) else merge
        merged = ranks.get(bytes(byte_of[c] for c in a + b))
        if merged is None or merged <= last:
            return None, "merge order and token ids disagree"
        last = merged
    if tokenizer is None:
        import tokenizers

        tokenizer = tokenizers.Tokenizer.from_str(json.dumps(spec))
    bpe = tokenizer.model
    for token, i in model.get("vocab", {}).items():
        if token not in added and [t.id for t in bpe.tokenize(token)] != [i]:
            return None, f"token {token!r} is not reachable by the merges"
    import tiktoken

    encoding = tiktoken.Encoding(
        name="hf-bpe", pat_str=pattern, mergeable_ranks=ranks, special_tokens=added
    )
    return encoding, ""


def tiktoken_arrays(encoding: Any, texts: Sequence[str], parse_special: bool) -> list[np.ndarray]:
    """Ids as numpy arrays; special-token text is plain text unless `parse_special`."""
    special = "all" if parse_special else set()
    return [
        encoding.encode_to_numpy(t, allowed_special=special, disallowed_special=()) for t in texts
    ]
