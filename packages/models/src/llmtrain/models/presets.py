"""Named model shapes. Each preset is also a model kind whose option defaults are the preset's
values, so `model: {kind: llama-1b, n_layers: 4}` is a preset plus overrides."""

from __future__ import annotations

from typing import Any

from llmtrain.models.config import TransformerConfig

_GPT2 = dict(
    vocab_size=50257,
    max_seq_len=1024,
    positions="learned",
    norm="layernorm",
    mlp="gelu",
    bias=True,
    tied_embeddings=True,
)
# Llama 3 (1B and 3B are the 3.2 models, 8B is 3.1): published shapes, 128k vocab, RoPE base 500k
_LLAMA3 = dict(
    vocab_size=128256,
    max_seq_len=8192,
    positions="rope",
    rope_base=500000.0,
    norm="rmsnorm",
    mlp="swiglu",
    bias=False,
)

PRESETS: dict[str, dict[str, Any]] = {
    "transformer": {},
    "tiny": dict(
        vocab_size=256 + 64,
        max_seq_len=256,
        d_model=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        positions="rope",
        norm="rmsnorm",
        mlp="swiglu",
        mlp_multiple_of=32,
        bias=False,
    ),
    "gpt2-124m": dict(_GPT2, d_model=768, n_layers=12, n_heads=12),
    "gpt2-350m": dict(_GPT2, d_model=1024, n_layers=24, n_heads=16),
    "llama-1b": dict(_LLAMA3, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8, mlp_hidden=8192),
    "llama-3b": dict(_LLAMA3, d_model=3072, n_layers=28, n_heads=24, n_kv_heads=8, mlp_hidden=8192),
    "llama-8b": dict(
        _LLAMA3,
        d_model=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        mlp_hidden=14336,
        tied_embeddings=False,
    ),
}


def preset_config(name: str, **overrides: Any) -> TransformerConfig:
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    return TransformerConfig(**{**PRESETS[name], **overrides})
