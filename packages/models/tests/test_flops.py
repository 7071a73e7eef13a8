"""Training FLOPs per token of the presets, pinned to counts written out by hand.

The convention (TorchTitan, Megatron, PaLM): 6 x every parameter a token multiplies by (the
forward's multiply-add is 2 FLOPs per parameter, the backward twice that), the LM head's V x d
included whether it is tied to the token embedding or not, the embedding lookups (token and
learned position) left out, experts a token is not routed to left out; plus attention's
12 x layers x heads x head_dim x seq_len (QK^T and AV, forward and backward, no causal halving),
a local block counting the keys its window lets a query see, min(window, seq_len), in place of
seq_len.
Norm weights and biases count as parameters (TorchTitan's 6 x (N - N_embedding) counts them too;
they are a few in ten thousand). Models are built on the meta device: nothing is allocated.
"""

from __future__ import annotations

import pytest
import torch

from llmtrain.models.config import AttentionOptions
from llmtrain.models.presets import preset_config
from llmtrain.models.transformer import Transformer


def flops_per_token(name: str, seq_len: int, **overrides) -> float:
    with torch.device("meta"):
        model = Transformer(preset_config(name, **overrides))
    return model.describe().flops_per_token(seq_len)


# llama-1b (Llama 3.2 1B): vocab 128,256 (already a multiple of 64), d 2048, 16 layers,
# 32 heads of 64, 8 kv heads, SwiGLU 8192, RMSNorm, no biases, tied
LLAMA_1B_BLOCK = (
    2048 * 2048  # wq
    + 2 * 2048 * 512  # wk, wv: 8 kv heads x 64
    + 2048 * 2048  # wo
    + 3 * 2048 * 8192  # w1, w2, w3
    + 2 * 2048  # two RMSNorm weights
)
LLAMA_1B_HEAD = 128_256 * 2048  # = the token embedding, counted once as the head's matmul
LLAMA_1B_MATMUL = 16 * LLAMA_1B_BLOCK + 2048 + LLAMA_1B_HEAD  # + the final norm
LLAMA_1B_ATTENTION = 12 * 16 * 32 * 64 * 2048


def test_llama_1b_at_2048_is_8_2202e9():
    assert LLAMA_1B_BLOCK == 60_821_504
    # all of the tied model's parameters: the embedding is counted once, as the head
    assert LLAMA_1B_MATMUL == 1_235_814_400
    assert LLAMA_1B_ATTENTION == 805_306_368
    want = 6 * 1_235_814_400 + 805_306_368
    assert want == 8_220_192_768
    got = flops_per_token("llama-1b", 2048)
    assert got == want
    assert got == pytest.approx(8.2202e9, rel=1e-4)  # TorchTitan's count for this shape


def test_untied_llama_1b_counts_the_same_flops():
    """Untying adds a second V x d matrix to the parameters, not to the work: the head is one
    matmul either way and the lookup is free."""
    with torch.device("meta"):
        untied = Transformer(preset_config("llama-1b", tied_embeddings=False)).describe()
    assert untied.n_params == 1_235_814_400 + LLAMA_1B_HEAD == 1_498_482_688
    assert untied.flops_per_token(2048) == 8_220_192_768


def test_llama_8b_untied():
    # d 4096, 32 layers, 32 heads of 128, 8 kv heads, SwiGLU 14336, untied head
    block = 4096 * 4096 + 2 * 4096 * 1024 + 4096 * 4096 + 3 * 4096 * 14336 + 2 * 4096
    assert block == 218_112_000
    matmul = 32 * block + 4096 + 128_256 * 4096  # blocks, final norm, head
    assert matmul == 7_504_924_672
    attention = 12 * 32 * 32 * 128 * 2048
    assert 6 * matmul + attention == 48_250_773_504
    assert flops_per_token("llama-8b", 2048) == 48_250_773_504


def test_gpt2_124m_at_1024():
    # vocab 50257 padded to 50304, d 768, 12 layers, 12 heads of 64, GELU 3072, LayerNorm and
    # biases everywhere, learned positions (a lookup: not counted), tied
    attention = 3 * (768 * 768 + 768) + 768 * 768 + 768  # qkv and output projection
    mlp = 768 * 3072 + 3072 + 3072 * 768 + 768
    block = attention + mlp + 2 * 2 * 768  # two LayerNorms, weight and bias
    assert block == 7_087_872
    matmul = 12 * block + 2 * 768 + 50_304 * 768  # blocks, final LayerNorm, head
    assert matmul == 123_689_472
    want = 6 * matmul + 12 * 12 * 12 * 64 * 1024
    assert want == 855_383_040
    assert flops_per_token("gpt2-124m", 1024) == want


def test_tiny_at_256():
    # vocab 320, d 64, 2 layers, 4 heads of 16, 2 kv heads, SwiGLU int(8 x 64 / 3) = 170 rounded
    # up to 192, RMSNorm, no biases, tied
    block = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 192 + 2 * 64
    assert block == 49_280
    matmul = 2 * block + 64 + 320 * 64
    assert matmul == 119_104
    want = 6 * matmul + 12 * 2 * 4 * 16 * 256
    assert want == 1_107_840
    assert flops_per_token("tiny", 256) == want


def test_flops_grow_with_seq_len_by_the_attention_term_only():
    per_position = 12 * 16 * 32 * 64
    assert flops_per_token("llama-1b", 4096) - flops_per_token("llama-1b", 2048) == (
        per_position * 2048
    )


# -- sliding windows: a local block's queries see at most its window of keys ----------------------

LLAMA_1B_PER_KEY = 12 * 32 * 64  # 12 x heads x head_dim: one key's share of one block


@pytest.mark.parametrize(
    ("seq_len", "want"),
    [
        # below the window every block sees all seq_len keys: the plain count
        (256, 6 * 1_235_814_400 + LLAMA_1B_PER_KEY * 16 * 256),
        (512, 6 * 1_235_814_400 + LLAMA_1B_PER_KEY * 16 * 512),
        # above it the 8 local blocks stay at 512 keys, the 8 global ones see seq_len
        (2048, 6 * 1_235_814_400 + LLAMA_1B_PER_KEY * (8 * 512 + 8 * 2048)),
        (4096, 6 * 1_235_814_400 + LLAMA_1B_PER_KEY * (8 * 512 + 8 * 4096)),
    ],
)
def test_local_global_blocks_count_their_keys(seq_len, want):
    attention = AttentionOptions(window=512, pattern=("local", "global"))
    assert want == {256: 7_515_549_696, 512: 7_616_212_992, 2048: 7_918_202_880,
                    4096: 8_320_856_064}[seq_len]  # fmt: skip
    assert flops_per_token("llama-1b", seq_len, attention=attention) == want


@pytest.mark.parametrize(("seq_len", "want"), [(2048, 7_867_871_232), (8192, 8_169_861_120)])
def test_gemma3_pattern_counts_two_global_blocks_of_sixteen(seq_len, want):
    """Five local blocks then a global one, repeated: blocks 5 and 11 are global, the other 14
    local (window 1024)."""
    attention = AttentionOptions(window=1024, pattern=("local",) * 5 + ("global",))
    assert want == 6 * 1_235_814_400 + LLAMA_1B_PER_KEY * (14 * 1024 + 2 * seq_len)
    assert flops_per_token("llama-1b", seq_len, attention=attention) == want


def test_a_window_on_every_block_stops_the_attention_term_growing():
    """Mistral's layout: past the window, longer sequences cost no more attention per token;
    the parameters (and their 6 x N) are the plain model's."""
    attention = AttentionOptions(window=4096)
    with torch.device("meta"):
        windowed = Transformer(preset_config("llama-1b", attention=attention)).describe()
    assert windowed.n_params == 1_235_814_400
    assert windowed.flops_per_token(2048) == 8_220_192_768  # the plain count: 2048 < window
    assert windowed.flops_per_token(4096) == 6 * 1_235_814_400 + LLAMA_1B_PER_KEY * 16 * 4096
    assert windowed.flops_per_token(8191) == windowed.flops_per_token(4096) == 9_025_499_136
