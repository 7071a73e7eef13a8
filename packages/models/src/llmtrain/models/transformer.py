"""A decoder-only transformer whose options cover the GPT-2, Llama, Mistral, Qwen2/3 and OLMo-2
families.

Read top to bottom: norms and rotary positions, attention, MLP, block, the model. Attention goes
through torch's scaled_dot_product_attention (the flash kernel on GPU), or FlexAttention within
packed documents (`attention_masks`). Shapes are written with `-1` for head counts so the same
code runs when tensor parallelism shards the heads. Blocks sit in a ModuleDict keyed by layer
index, so a pipeline stage can drop blocks and keep the names checkpoints use; a stage without
`tok_emb` takes hidden states, one without `norm` returns them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from llmtrain.core_mesh.interfaces import AttentionDescription, ModelDescription
from llmtrain.models.attention_masks import (
    AttentionMask,
    Causal,
    Document,
    Given,
    MaskFunction,
    MaskRows,
    PrefixBidirectional,
    SlidingWindow,
    attend,
    attention_masks,
    document_ids,
    positions_in_document,
)
from llmtrain.models.config import TransformerConfig

# head_fn(final hidden states (..., d), output matrix (V, d)) -> what forward returns
HeadFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# the cos and sin tables at each token's position, (.., T, 1, head_dim / 2) each
Rope = tuple[torch.Tensor, torch.Tensor]
# what attention runs under: plain causal (None) or a composition of mask functions
Mask = AttentionMask | None


def make_norm(cfg: TransformerConfig, dim: int) -> nn.Module:
    # Gemma's norms multiply by (1 + weight): importers store 1 + weight, the same function
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(dim, eps=cfg.norm_eps)
    return nn.LayerNorm(dim, eps=cfg.norm_eps, bias=cfg.bias)


def rope_frequencies(
    cfg: TransformerConfig, device: torch.device | None = None, *, local: bool = False
) -> torch.Tensor:
    """The angle per position of each rotated pair, (head_dim / 2,): base^(-2i/head_dim), then
    the scaling `rope_scaling` sets (see `RopeScaling`). `local`: for local (windowed) blocks
    when `attention.local_rope_base` gives them their own base, unscaled."""
    # 1 / base^(2i/head_dim), computed in this order in float32 as transformers does: the same
    # bits, so logits agree at long positions too (base^(-i/half) differs by an ulp, which grows
    # with the position)
    local_base = cfg.attention.local_rope_base
    base = local_base if local and local_base is not None else cfg.rope_base
    even = torch.arange(0, cfg.head_dim, 2, device=device, dtype=torch.int64).float()
    freqs = 1.0 / (base ** (even / cfg.head_dim))
    scaling = cfg.rope_scaling
    if scaling is None or local:
        return freqs
    if scaling.kind == "linear":
        return freqs / scaling.factor
    assert scaling.original_max_seq_len is not None  # the config refuses llama3 without it
    wavelength = 2 * math.pi / freqs
    long_wave = scaling.original_max_seq_len / scaling.low_freq_factor
    short_wave = scaling.original_max_seq_len / scaling.high_freq_factor
    # 0 at the long-wavelength edge of the band, 1 at its short edge
    smooth = (scaling.original_max_seq_len / wavelength - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * freqs / scaling.factor + smooth * freqs
    scaled = torch.where(wavelength > long_wave, freqs / scaling.factor, freqs)
    in_band = (wavelength >= short_wave) & (wavelength <= long_wave)
    return torch.where(in_band, blended, scaled)


def rope_tables(
    cfg: TransformerConfig, device: torch.device | None = None, *, local: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position x frequency, (max_seq_len, head_dim / 2)."""
    freqs = rope_frequencies(cfg, device, local=local)
    angles = torch.outer(torch.arange(cfg.max_seq_len, device=device, dtype=torch.float32), freqs)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[i], x[i + half]) of x (B, T, heads, head_dim) by their position's angle."""
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return rotated.type_as(x)


class LayerCache:
    """Keys and values of one layer for incremental decoding: preallocated to a maximum length,
    or, for a block with a sliding window, only the `window - 1` latest (all a new token can
    see besides itself), so its memory is bounded by the window, not the length."""

    def __init__(
        self,
        batch: int,
        kv_heads: int,
        max_len: int,
        head_dim: int,
        *,
        device: torch.device | str | None,
        dtype: torch.dtype | None,
        window: int | None = None,
    ) -> None:
        self.window = window
        kept = max_len if window is None else min(max_len, window - 1)
        self.k = torch.zeros(batch, kv_heads, kept, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        # with a window: how many of the latest keys it holds (they end where the next chunk starts)
        self.held = 0

    def key_start(self, start: int) -> int:
        """The position of the first key `update` returns for a chunk starting at `start`."""
        return 0 if self.window is None else start - self.held

    def update(
        self, k: torch.Tensor, v: torch.Tensor, start: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The chunk's keys and values stored; returns every key and value the chunk's queries
        may see, in position order from `key_start(start)`."""
        if self.window is None:
            end = start + k.size(2)
            self.k[:, :, start:end] = k
            self.v[:, :, start:end] = v
            return self.k[:, :, :end], self.v[:, :, :end]
        keys = torch.cat((self.k[:, :, : self.held], k), dim=2)
        values = torch.cat((self.v[:, :, : self.held], v), dim=2)
        self.held = min(keys.size(2), self.k.size(2))
        if self.held:
            self.k[:, :, : self.held] = keys[:, :, -self.held :]
            self.v[:, :, : self.held] = values[:, :, -self.held :]
        return keys, values


class Attention(nn.Module):
    """Multi-head attention with grouped key/value heads. `qk_norm` normalises queries and keys
    before RoPE: each head on its own (`qk_norm_scope: head`, Qwen3), or all heads of the
    projection together (`all_heads`, OLMo-2)."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        q_width, kv_width = cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        self.wq = nn.Linear(cfg.d_model, q_width, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.d_model, kv_width, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.d_model, kv_width, bias=cfg.qkv_bias)
        self.wo = nn.Linear(q_width, cfg.d_model, bias=cfg.out_bias)
        self.norm_per_head = cfg.qk_norm_scope == "head"
        q_norm_dim, k_norm_dim = (
            (cfg.head_dim, cfg.head_dim) if self.norm_per_head else (q_width, kv_width)
        )
        self.q_norm = nn.RMSNorm(q_norm_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = nn.RMSNorm(k_norm_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.dropout = cfg.dropout
        self.resid_dropout = nn.Dropout(cfg.dropout)
        # None (SDPA's 1/sqrt(head_dim)) but under µP or with `attention.scale`
        self.scale = cfg.attention_scale
        self.softcap = cfg.attention.softcap

    def forward(
        self,
        x: torch.Tensor,
        rope: Rope | None,
        mask: Mask,
        cache: LayerCache | None,
        start_pos: int,
    ) -> torch.Tensor:
        B, T, _ = x.shape
        q: torch.Tensor = self.wq(x)
        k: torch.Tensor = self.wk(x)
        v: torch.Tensor = self.wv(x)
        if not self.norm_per_head:
            q, k = self._qk_norm(q, k)
        q = q.view(B, T, -1, self.head_dim)
        k = k.view(B, T, -1, self.head_dim)
        v = v.view(B, T, -1, self.head_dim)
        if self.norm_per_head:
            q, k = self._qk_norm(q, k)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if cache is not None:
            k, v = cache.update(k, v, start_pos)
        y = attend(
            q,
            k,
            v,
            mask,
            dropout_p=self.dropout if self.training else 0.0,
            scale=self.scale,
            softcap=self.softcap,
        )
        y = y.transpose(1, 2).reshape(B, T, -1)
        out: torch.Tensor = self.resid_dropout(self.wo(y))
        return out

    def _qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k through their norms, when `qk_norm` made them (it makes both or neither)."""
        if self.q_norm is None or self.k_norm is None:
            return q, k
        return self.q_norm(q), self.k_norm(k)


class MLP(nn.Module):
    """GELU: w2(gelu(w1 x)). SwiGLU: w2(silu(w1 x) * w3 x). GeGLU (Gemma): w2(gelu(w1 x) * w3 x).
    GELU is the tanh approximation throughout (GPT-2's and Gemma's)."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        hidden = cfg.hidden_size
        gated = cfg.mlp in ("swiglu", "geglu")
        self.w1 = nn.Linear(cfg.d_model, hidden, bias=cfg.mlp_bias)
        self.w3 = nn.Linear(cfg.d_model, hidden, bias=cfg.mlp_bias) if gated else None
        self.w2 = nn.Linear(hidden, cfg.d_model, bias=cfg.mlp_bias)
        self.dropout = nn.Dropout(cfg.dropout)
        self.silu_gate = cfg.mlp == "swiglu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w3 is None:
            h = F.gelu(self.w1(x), approximate="tanh")
        elif self.silu_gate:
            h = F.silu(self.w1(x)) * self.w3(x)
        else:
            h = F.gelu(self.w1(x), approximate="tanh") * self.w3(x)
        out: torch.Tensor = self.dropout(self.w2(h))
        return out


class Block(nn.Module):
    """Attention then MLP, each in a residual branch. `norm_placement: pre` normalises each
    branch's input (GPT-2, Llama); `after_sublayer` normalises each branch's output before it
    joins the residual stream (OLMo-2); `sandwich` does both, with a second norm per branch
    (`attn_out_norm`, `mlp_out_norm`: Gemma 2 and 3)."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.attn_norm = make_norm(cfg, cfg.d_model)
        self.attn = Attention(cfg)
        self.mlp_norm = make_norm(cfg, cfg.d_model)
        self.mlp = MLP(cfg)
        self.norm_before = cfg.norm_placement != "after_sublayer"
        sandwich = cfg.norm_placement == "sandwich"
        self.attn_out_norm = make_norm(cfg, cfg.d_model) if sandwich else None
        self.mlp_out_norm = make_norm(cfg, cfg.d_model) if sandwich else None

    def forward(
        self,
        x: torch.Tensor,
        rope: Rope | None = None,
        mask: Mask = None,
        cache: LayerCache | None = None,
        start_pos: int = 0,
    ) -> torch.Tensor:
        out: torch.Tensor
        if self.attn_out_norm is not None and self.mlp_out_norm is not None:
            x = x + self.attn_out_norm(self.attn(self.attn_norm(x), rope, mask, cache, start_pos))
            out = x + self.mlp_out_norm(self.mlp(self.mlp_norm(x)))
        elif self.norm_before:
            x = x + self.attn(self.attn_norm(x), rope, mask, cache, start_pos)
            out = x + self.mlp(self.mlp_norm(x))
        else:
            x = x + self.attn_norm(self.attn(x, rope, mask, cache, start_pos))
            out = x + self.mlp_norm(self.mlp(x))
        return out


class Transformer(nn.Module):
    """A decoder-only transformer; it keeps `interfaces.LanguageModel`'s contract (forward takes
    packed rows and a KV cache; its RoPE tables are not weights)."""

    # forward takes `positions`, `attention_mask` and `logits_at` (downstream scoring packs rows)
    packed_rows: ClassVar[bool] = True
    # buffers registered in __init__ when `positions: rope`; computed from the options, so not
    # persistent (not in the state dict a checkpoint keeps)
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor
    # and for local blocks when `attention.local_rope_base` is set
    local_rope_cos: torch.Tensor
    local_rope_sin: torch.Tensor

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.cfg = cfg
        # the input and output layers are None on the pipeline stages that do without them
        self.tok_emb: nn.Embedding | None = nn.Embedding(cfg.padded_vocab_size, cfg.d_model)
        self.pos_emb = (
            nn.Embedding(cfg.max_seq_len, cfg.d_model) if cfg.positions == "learned" else None
        )
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleDict({str(i): self.make_block(cfg) for i in range(cfg.n_layers)})
        self.norm: nn.Module | None = make_norm(cfg, cfg.d_model)
        self.head = (
            None
            if cfg.tied_embeddings
            else nn.Linear(cfg.d_model, cfg.padded_vocab_size, bias=False)
        )
        if cfg.positions == "rope":
            cos, sin = rope_tables(cfg)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        if cfg.attention.local_rope_base is not None:
            cos, sin = rope_tables(cfg, local=True)
            self.register_buffer("local_rope_cos", cos, persistent=False)
            self.register_buffer("local_rope_sin", sin, persistent=False)

    def make_block(self, cfg: TransformerConfig) -> nn.Module:
        """One repeated block. A subclass may build another kind (a plugin's Mixture-of-Experts
        block, say) with the same call: block(h, rope, mask, cache, start_pos) -> h."""
        return Block(cfg)

    def forward(
        self,
        tokens: torch.Tensor,
        doc_starts: torch.Tensor | None = None,
        *,
        cache: list[LayerCache] | None = None,
        start_pos: int = 0,
        positions: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        logits_at: torch.Tensor | None = None,
        head_fn: HeadFn | None = None,
        sequence_length: int | None = None,
        prefix: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits (B, T, padded vocab) for tokens (B, T); hidden states on pipeline stages.

        `positions` (1 or B, T) gives each token's place in its sequence when the tokens are not
        one contiguous run (context parallelism hands each rank a shard of the sequence).
        `sequence_length`, with `positions`: the tokens are a shard of a sequence this long
        (context parallelism), `doc_starts` then covering the whole of it; each block's mask
        spans every key in position order, which attention gathers from the other shards.
        `attention_mask` (B, T, T), with `positions`: which tokens each token sees (True) in
        place of causal attention; a row may then hold several sequences that share a prefix.
        `logits_at` (B, T) bool: the logits of only those tokens, (N, padded vocab), row-major.
        `head_fn(hidden (B, T, d), weight (padded vocab, d))`: called in place of the output
        projection, its result returned; a loss that needs no logits (the memory-lean
        cross-entropy) takes the final hidden states and the output matrix this way.
        `prefix` (B, T) bool: a prefix LM's prefix, whose tokens see each other both ways (within
        their document with document masking); every other token attends causally.
        """
        T = tokens.size(1)
        self._check_inputs(
            T, doc_starts, cache, start_pos, positions, attention_mask, sequence_length
        )
        if prefix is not None and (positions is not None or cache is not None):
            raise ValueError("a prefix goes with neither explicit positions nor a cache")
        positions, masks = self._positions_and_masks(
            tokens,
            doc_starts,
            cache,
            start_pos,
            positions,
            attention_mask,
            sequence_length,
            prefix=prefix,
        )
        h: torch.Tensor = self.tok_emb(tokens) if self.tok_emb is not None else tokens
        if self.tok_emb is not None and self.cfg.scale_embeddings:
            # Gemma rounds its sqrt(d_model) to the hidden states' dtype first
            h = h * torch.tensor(math.sqrt(self.cfg.d_model), dtype=h.dtype)
        if self.pos_emb is not None:
            h = h + self.pos_emb(positions)
        h = self.drop(h)
        ropes = self._ropes(positions)
        for i, (name, block) in enumerate(self.blocks.items()):
            rope = ropes[self.local_rope(int(name))]
            h = block(h, rope, masks[i], cache[i] if cache is not None else None, start_pos)
        if self.norm is None:
            return h
        if logits_at is not None:
            h = h[logits_at]
        h = self.norm(h)
        if self.cfg.output_multiplier != 1.0:
            # µP's logit multiplier 1/m, applied before the head so that a loss given head_fn,
            # a tensor-parallel head and a pipeline's last stage all see it
            h = h * self.cfg.output_multiplier
        if head_fn is not None:
            if self.cfg.logit_softcap is not None:
                raise ValueError("soft-capped logits need the output projection of the model")
            return head_fn(h, self._output_matrix())
        logits: torch.Tensor
        if self.head is not None:
            logits = self.head(h)
        else:
            logits = F.linear(h, self._output_matrix())
        cap = self.cfg.logit_softcap
        if cap is not None:
            logits = cap * torch.tanh(logits / cap)
        return logits

    def _output_matrix(self) -> torch.Tensor:
        """The output projection's weight (padded vocab, d): the head's, else the tied token
        embedding's."""
        if self.head is not None:
            return self.head.weight
        if self.tok_emb is None:
            # only an untied model is cut into stages, so a tied one keeps its embedding
            raise ValueError("a model with tied embeddings needs its token embedding for logits")
        return self.tok_emb.weight

    def _check_inputs(
        self,
        T: int,
        doc_starts: torch.Tensor | None,
        cache: list[LayerCache] | None,
        start_pos: int,
        positions: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        sequence_length: int | None,
    ) -> None:
        """The input combinations forward takes, and a sequence no longer than max_seq_len."""
        if attention_mask is not None and positions is None:
            raise ValueError("an attention_mask goes with explicit positions")
        if sequence_length is not None and (positions is None or attention_mask is not None):
            raise ValueError("a sequence_length goes with a shard's positions alone")
        sharded = sequence_length is not None
        if positions is not None and (
            cache is not None or (doc_starts is not None and not sharded)
        ):
            raise ValueError("explicit positions go with neither document masking nor a cache")
        if doc_starts is not None and cache is not None and self.cfg.doc_masking:
            raise ValueError("document masking is for training; decode one document at a time")
        if positions is not None and attention_mask is not None:
            # sequences packed side by side: the row may be longer than one sequence may be
            end = int(positions.max()) + 1
        elif sequence_length is not None:
            end = sequence_length
        else:
            end = start_pos + T
        if end > self.cfg.max_seq_len:
            raise ValueError(
                f"sequence of {end} tokens is longer than the model's max_seq_len "
                f"({self.cfg.max_seq_len}); raise model.max_seq_len or shorten the input"
            )

    def _ropes(self, positions: torch.Tensor) -> dict[bool, Rope | None]:
        """The RoPE cos and sin at `positions` (None without RoPE), keyed by `local_rope`."""
        if self.cfg.positions != "rope":
            return {False: None, True: None}
        rope = (self.rope_cos[positions].unsqueeze(2), self.rope_sin[positions].unsqueeze(2))
        if self.cfg.attention.local_rope_base is None:
            return {False: rope, True: rope}
        local = (
            self.local_rope_cos[positions].unsqueeze(2),
            self.local_rope_sin[positions].unsqueeze(2),
        )
        return {False: rope, True: local}

    def local_rope(self, layer: int) -> bool:
        """Whether block `layer` rotates with the local RoPE base (a windowed block when
        `attention.local_rope_base` is set)."""
        return (
            self.cfg.attention.local_rope_base is not None
            and self.cfg.attention.window_of(layer) is not None
        )

    def layer_masks(self, documents: bool) -> list[tuple[MaskFunction, ...]]:
        """The mask functions of each block this model holds (in `blocks` order), with document
        masking or not. The seam for attention variants: a model that brings its own mask
        function returns it here (and `describe()` names it to the layout check)."""
        layers = []
        for name in self.blocks:
            functions: list[MaskFunction] = [Causal()]
            if documents:
                functions.append(Document())
            window = self.cfg.attention.window_of(int(name))
            if window is not None:
                functions.append(SlidingWindow(window))
            layers.append(tuple(functions))
        return layers

    def _positions_and_masks(
        self,
        tokens: torch.Tensor,
        doc_starts: torch.Tensor | None,
        cache: list[LayerCache] | None,
        start_pos: int,
        positions: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        sequence_length: int | None,
        *,
        prefix: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, list[Mask]]:
        """Each token's position (1 or B, T) for RoPE or learned positions, and each block's mask
        (None: plain causal, which SDPA's own causal kernel answers)."""
        B, T = tokens.shape[:2]
        device = tokens.device
        documents = doc_starts is not None and self.cfg.doc_masking
        layers = self.layer_masks(documents)
        if prefix is not None:
            layers = [
                tuple(PrefixBidirectional() if isinstance(f, Causal) else f for f in fs)
                for fs in layers
            ]
        if positions is not None and attention_mask is not None:
            # packed rows: the given mask in place of causal, windows counted in `positions`
            rows = MaskRows(
                q_pos=torch.arange(T, device=device),
                k_pos=torch.arange(T, device=device),
                places=positions.expand(B, T),
                given=attention_mask,
            )
            given = [(Given(), *(f for f in fs if not isinstance(f, Causal))) for fs in layers]
            return positions, list(attention_masks(given, rows, dense_only=True))
        doc_ids = None
        if positions is not None:
            # a shard of the sequence (context parallelism), or a pipeline's whole sequence
            q_pos = positions[0]
            k_pos = (
                q_pos if sequence_length is None else torch.arange(sequence_length, device=device)
            )
            if documents:
                assert doc_starts is not None
                doc_ids = document_ids(doc_starts)
                positions = positions_in_document(doc_starts).gather(1, positions.expand(B, -1))
        elif documents:
            assert doc_starts is not None
            # a pipeline stage's input may be a sequence shard (sequence parallelism): the
            # document starts cover the whole sequence
            doc_ids = document_ids(doc_starts)
            positions = positions_in_document(doc_starts)
            q_pos = k_pos = torch.arange(doc_starts.size(1), device=device)
        else:
            seq = T if doc_starts is None else doc_starts.size(1)
            q_pos = torch.arange(start_pos, start_pos + seq, device=device)
            k_pos = q_pos
            positions = q_pos.unsqueeze(0)
        if cache is not None:
            return positions, self._cached_masks(layers, cache, q_pos, start_pos)
        plain = self.cfg.attention.softcap is None
        if plain and all(fs == (Causal(),) for fs in layers):
            return positions, [None] * len(layers)
        rows = MaskRows(q_pos=q_pos, k_pos=k_pos, doc_ids=doc_ids, prefix=prefix)
        masks: list[Mask] = list(
            attention_masks(layers, rows, dense_only=sequence_length is not None)
        )
        if plain and sequence_length is None:
            # blocks of plain causal attention keep SDPA's causal kernel
            masks = [None if fs == (Causal(),) else m for fs, m in zip(layers, masks, strict=True)]
        return positions, masks

    def _cached_masks(
        self,
        layers: list[tuple[MaskFunction, ...]],
        cache: list[LayerCache],
        q_pos: torch.Tensor,
        start_pos: int,
    ) -> list[Mask]:
        """Masks over the keys each block's cache returns for this chunk: every earlier token,
        or the latest of a window's."""
        by_start: dict[int, MaskRows] = {}
        masks: list[Mask] = []
        for functions, layer_cache in zip(layers, cache, strict=True):
            k_start = layer_cache.key_start(start_pos)
            if k_start not in by_start:
                k_pos = torch.arange(k_start, start_pos + q_pos.numel(), device=q_pos.device)
                by_start[k_start] = MaskRows(q_pos=q_pos, k_pos=k_pos)
            masks.append(attention_masks([functions], by_start[k_start], dense_only=True)[0])
        return masks

    @property
    def options(self) -> TransformerConfig:
        """The options the model was built with (`LanguageModel.options`)."""
        return self.cfg

    def new_cache(self, batch: int, max_len: int) -> list[LayerCache]:
        """One key/value cache a block for incremental decoding (`forward(..., cache=,
        start_pos=)`)."""
        ref = next(iter(self.blocks.values())).get_submodule("attn.wk").weight
        if not isinstance(ref, torch.Tensor):
            raise TypeError(f"attn.wk.weight of the first block is a {type(ref).__name__}")
        kv_heads = ref.size(0) // self.cfg.head_dim
        return [
            LayerCache(
                batch,
                kv_heads,
                max_len,
                self.cfg.head_dim,
                device=ref.device,
                dtype=ref.dtype,
                window=self.cfg.attention.window_of(int(name)),
            )
            for name in self.blocks
        ]

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """Initialise every parameter and buffer; also right after `to_empty` from the meta device."""
        cfg = self.cfg
        # µP: a hidden matrix's std falls as 1/sqrt(fan_in), i.e. by sqrt(m) from the base width
        hidden_std = cfg.init_std / math.sqrt(cfg.width_multiplier)
        residual_std = (
            hidden_std / math.sqrt(2 * cfg.n_layers) if cfg.scale_residual_init else hidden_std
        )
        hidden = {id(module) for module in self.hidden_matrices()}
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                std = hidden_std if id(module) in hidden else cfg.init_std
                if name.endswith(("attn.wo", "mlp.w2")):
                    std = residual_std
                nn.init.normal_(module.weight, mean=0.0, std=std, generator=generator)
                bias = getattr(module, "bias", None)  # an Embedding has none
                if isinstance(bias, torch.Tensor):
                    nn.init.zeros_(bias)
            elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
                module.reset_parameters()
        if cfg.positions == "rope":
            cos, sin = rope_tables(cfg, device=self.rope_cos.device)
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)
        if cfg.attention.local_rope_base is not None:
            cos, sin = rope_tables(cfg, device=self.local_rope_cos.device, local=True)
            self.local_rope_cos.copy_(cos)
            self.local_rope_sin.copy_(sin)

    def hidden_matrices(self) -> list[nn.Module]:
        """The Linear layers whose weights µP treats as hidden matrices (both dimensions grow
        with width): every Linear of the blocks; not the embeddings nor the head."""
        return [
            module
            for block in self.blocks.values()
            for module in block.modules()
            if isinstance(module, nn.Linear)
        ]

    def lr_multipliers(self) -> dict[str, float]:
        """Parameter name (as `named_parameters()` gives it) -> the Adam-family learning-rate
        multiplier µP gives it, only where it is not 1: 1/m for the weights of the hidden
        matrices; embeddings (the tied output matrix too), the head, norms and biases keep the
        base rate. {} under the standard parametrization (or at m == 1)."""
        factor = 1.0 / self.cfg.width_multiplier
        if factor == 1.0:
            return {}
        hidden = {id(module.weight) for module in self.hidden_matrices()}
        return {name: factor for name, p in self.named_parameters() if id(p) in hidden}

    def describe(self) -> ModelDescription:
        cfg = self.cfg
        n_params = sum(p.numel() for p in self.parameters())
        embedding = sum(m.weight.numel() for m in (self.tok_emb, self.pos_emb) if m is not None)
        non_embedding = n_params - embedding
        # Training FLOPs per token as TorchTitan, Megatron and PaLM count them: 6 x the
        # parameters a token multiplies by (forward 2, backward 4), the LM head's V x d included
        # whether tied or not (a tied head multiplies by the token embedding, left out above as
        # a lookup), no lookups, no idle experts; attention's scores and weighted sums
        # 12 x H x head_dim x (keys a query sees) per block: T, no causal halving, or a local
        # block's window where it is shorter. Every MFU figure uses this count.
        tied_head = cfg.padded_vocab_size * cfg.d_model if cfg.tied_embeddings else 0
        active = non_embedding + tied_head - self.inactive_params()
        per_key = 12 * cfg.n_heads * cfg.head_dim
        windows = [cfg.attention.window_of(layer) for layer in range(cfg.n_layers)]

        def flops_per_token(seq_len: int) -> float:
            keys = sum(seq_len if w is None else min(w, seq_len) for w in windows)
            return float(6 * active + per_key * keys)

        return ModelDescription(
            module=self,
            blocks=list(self.blocks.values()),
            tp_plan=self.tp_plan(),
            n_params=n_params,
            n_non_embedding_params=non_embedding,
            flops_per_token=flops_per_token,
            n_heads=cfg.n_heads,
            n_kv_heads=cfg.kv_heads,
            tied_embeddings=cfg.tied_embeddings,
            trim_to_stage=None if cfg.tied_embeddings else type(self).trim_to_stage,
            # a loss that runs the output projection itself would skip the logits' soft-capping
            takes_head_fn=cfg.logit_softcap is None,
            attention=self.describe_attention(),
        )

    def describe_attention(self) -> AttentionDescription:
        """Each block's mask functions by name, and the scores' soft-capping."""
        layers = tuple(
            tuple(f.name for f in functions) for functions in self.layer_masks(self.cfg.doc_masking)
        )
        softcap = self.cfg.attention.softcap
        return AttentionDescription(
            layers=layers, score_mod=None if softcap is None else f"softcap={softcap}"
        )

    def inactive_params(self) -> int:
        """Parameters a token does not use (0 here; a Mixture-of-Experts subclass counts the
        experts it does not route to), left out of the FLOPs per token."""
        return 0

    def trim_to_stage(self, block_ids: Sequence[int], first: bool, last: bool) -> None:
        """Keep only what one pipeline stage runs: some blocks, the embeddings if first, the
        final norm and head if last. Block names stay their layer indices, so a stage's state dict
        keys are a subset of the whole model's."""
        keep = {str(i) for i in block_ids}
        for name in [n for n in self.blocks if n not in keep]:
            del self.blocks[name]
        if not first:
            self.tok_emb = None
            self.pos_emb = None
        if not last:
            self.norm = None
            self.head = None

    def tp_plan(self) -> dict[str, str]:
        """Module path -> tensor-parallel style; empty for a model that cannot be split so (the
        parallel package then refuses mesh.tp > 1)."""
        if not splits_across_tp_ranks(self.cfg):
            return {}
        plan = {
            "tok_emb": "embedding",
            "norm": "sequence_parallel",
            "blocks.*.attn_norm": "sequence_parallel",
            "blocks.*.attn": "gather_input",
            "blocks.*.mlp": "gather_input",
            "blocks.*.attn.wq": "colwise",
            "blocks.*.attn.wk": "colwise",
            "blocks.*.attn.wv": "colwise",
            "blocks.*.attn.wo": "rowwise",
            "blocks.*.mlp_norm": "sequence_parallel",
            # a sandwich's second norms: their output joins the residual stream as a plain shard
            "blocks.*.attn_out_norm": "sequence_parallel_residual",
            "blocks.*.mlp_out_norm": "sequence_parallel_residual",
            "blocks.*.mlp.w1": "colwise",
            "blocks.*.mlp.w2": "rowwise",
        }
        if self.cfg.mlp != "gelu":
            plan["blocks.*.mlp.w3"] = "colwise"
        if self.cfg.norm_placement != "sandwich":
            del plan["blocks.*.attn_out_norm"], plan["blocks.*.mlp_out_norm"]
        if self.pos_emb is not None:
            plan["pos_emb"] = "embedding"
        if self.head is not None:
            plan["head"] = "colwise_output"
        return plan


def splits_across_tp_ranks(cfg: TransformerConfig) -> bool:
    """Whether a tensor-parallel plan can split a model of `cfg` (a subclass's `tp_plan` asks
    too): not with a query/key norm over a whole projection, which would need the heads of every
    rank, nor with norms after each sublayer alone, since the plan places its sequence-parallel
    norms on the branches' inputs (a sandwich's second norms take the row-wise output's sequence
    shards)."""
    whole_projection_norm = cfg.qk_norm and cfg.qk_norm_scope == "all_heads"
    return not whole_projection_norm and cfg.norm_placement != "after_sublayer"


def build_model(cfg: TransformerConfig) -> Transformer:
    """The model on the current default device (use `torch.device("meta")` for large ones)."""
    return Transformer(cfg)
