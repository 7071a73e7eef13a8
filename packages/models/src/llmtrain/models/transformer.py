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

from llmtrain.core_mesh.interfaces import ModelDescription
from llmtrain.models.attention_masks import (
    DocumentMask,
    attend,
    document_mask,
    positions_in_document,
)
from llmtrain.models.config import TransformerConfig

# head_fn(final hidden states (..., d), output matrix (V, d)) -> what forward returns
HeadFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# the cos and sin tables at each token's position, (.., T, 1, head_dim / 2) each
Rope = tuple[torch.Tensor, torch.Tensor]
# what attention runs under: causal (None), a boolean mask, or packed documents
Mask = torch.Tensor | DocumentMask | None


def make_norm(cfg: TransformerConfig, dim: int) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(dim, eps=cfg.norm_eps)
    return nn.LayerNorm(dim, eps=cfg.norm_eps, bias=cfg.bias)


def rope_frequencies(cfg: TransformerConfig, device: torch.device | None = None) -> torch.Tensor:
    """The angle per position of each rotated pair, (head_dim / 2,): base^(-2i/head_dim), then
    Llama 3's scaling when `rope_scaling` is set (see `RopeScaling`)."""
    # 1 / base^(2i/head_dim), computed in this order in float32 as transformers does: the same
    # bits, so logits agree at long positions too (base^(-i/half) differs by an ulp, which grows
    # with the position)
    even = torch.arange(0, cfg.head_dim, 2, device=device, dtype=torch.int64).float()
    freqs = 1.0 / (cfg.rope_base ** (even / cfg.head_dim))
    scaling = cfg.rope_scaling
    if scaling is None:
        return freqs
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
    cfg: TransformerConfig, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position x frequency, (max_seq_len, head_dim / 2)."""
    freqs = rope_frequencies(cfg, device)
    angles = torch.outer(torch.arange(cfg.max_seq_len, device=device, dtype=torch.float32), freqs)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[i], x[i + half]) of x (B, T, heads, head_dim) by their position's angle."""
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return rotated.type_as(x)


class LayerCache:
    """Keys and values of one layer for incremental decoding, preallocated to a maximum length."""

    def __init__(
        self,
        batch: int,
        kv_heads: int,
        max_len: int,
        head_dim: int,
        *,
        device: torch.device | str | None,
        dtype: torch.dtype | None,
    ) -> None:
        self.k = torch.zeros(batch, kv_heads, max_len, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)

    def update(
        self, k: torch.Tensor, v: torch.Tensor, start: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        end = start + k.size(2)
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]


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
        # None (SDPA's 1/sqrt(head_dim)) but under µP
        self.scale = cfg.attention_scale

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
            is_causal=mask is None and cache is None,
            dropout_p=self.dropout if self.training else 0.0,
            scale=self.scale,
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
    """GELU: w2(gelu(w1 x)). SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        hidden = cfg.hidden_size
        self.w1 = nn.Linear(cfg.d_model, hidden, bias=cfg.mlp_bias)
        self.w3 = nn.Linear(cfg.d_model, hidden, bias=cfg.mlp_bias) if cfg.mlp == "swiglu" else None
        self.w2 = nn.Linear(hidden, cfg.d_model, bias=cfg.mlp_bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w3 is None:
            h = F.gelu(self.w1(x), approximate="tanh")
        else:
            h = F.silu(self.w1(x)) * self.w3(x)
        out: torch.Tensor = self.dropout(self.w2(h))
        return out


class Block(nn.Module):
    """Attention then MLP, each in a residual branch. `norm_placement: pre` normalises each
    branch's input (GPT-2, Llama); `after_sublayer` normalises each branch's output before it
    joins the residual stream (OLMo-2)."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.attn_norm = make_norm(cfg, cfg.d_model)
        self.attn = Attention(cfg)
        self.mlp_norm = make_norm(cfg, cfg.d_model)
        self.mlp = MLP(cfg)
        self.norm_before = cfg.norm_placement == "pre"

    def forward(
        self,
        x: torch.Tensor,
        rope: Rope | None = None,
        mask: Mask = None,
        cache: LayerCache | None = None,
        start_pos: int = 0,
    ) -> torch.Tensor:
        out: torch.Tensor
        if self.norm_before:
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
    ) -> torch.Tensor:
        """Logits (B, T, padded vocab) for tokens (B, T); hidden states on pipeline stages.

        `positions` (1 or B, T) gives each token's place in its sequence when the tokens are not
        one contiguous run (context parallelism hands each rank a shard of the sequence).
        `attention_mask` (B, T, T), with `positions`: which tokens each token sees (True) in
        place of causal attention; a row may then hold several sequences that share a prefix.
        `logits_at` (B, T) bool: the logits of only those tokens, (N, padded vocab), row-major.
        `head_fn(hidden (B, T, d), weight (padded vocab, d))`: called in place of the output
        projection, its result returned; a loss that needs no logits (the memory-lean
        cross-entropy) takes the final hidden states and the output matrix this way.
        """
        B, T = tokens.shape[:2]
        if attention_mask is not None and positions is None:
            raise ValueError("an attention_mask goes with explicit positions")
        if positions is not None and attention_mask is not None:
            # sequences packed side by side: the row may be longer than one sequence may be
            end = int(positions.max()) + 1
        else:
            end = start_pos + T
        if end > self.cfg.max_seq_len:
            raise ValueError(
                f"sequence of {end} tokens is longer than the model's max_seq_len "
                f"({self.cfg.max_seq_len}); raise model.max_seq_len or shorten the input"
            )
        if positions is None:
            # a pipeline stage's input may be a sequence shard (sequence parallelism): the
            # document starts cover the whole sequence
            seq = doc_starts.size(1) if doc_starts is not None else T
            positions, mask = self._positions_and_mask(
                B, seq, tokens.device, doc_starts, cache, start_pos
            )
        elif doc_starts is not None or cache is not None:
            raise ValueError("explicit positions go with neither document masking nor a cache")
        else:
            mask = None if attention_mask is None else attention_mask.unsqueeze(1)
        h: torch.Tensor = self.tok_emb(tokens) if self.tok_emb is not None else tokens
        if self.pos_emb is not None:
            h = h + self.pos_emb(positions)
        h = self.drop(h)
        rope = None
        if self.cfg.positions == "rope":
            rope = (self.rope_cos[positions].unsqueeze(2), self.rope_sin[positions].unsqueeze(2))
        for i, block in enumerate(self.blocks.values()):
            h = block(h, rope, mask, cache[i] if cache is not None else None, start_pos)
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
            return head_fn(h, self._output_matrix())
        if self.head is not None:
            logits: torch.Tensor = self.head(h)
            return logits
        return F.linear(h, self._output_matrix())

    def _output_matrix(self) -> torch.Tensor:
        """The output projection's weight (padded vocab, d): the head's, else the tied token
        embedding's."""
        if self.head is not None:
            return self.head.weight
        if self.tok_emb is None:
            # only an untied model is cut into stages, so a tied one keeps its embedding
            raise ValueError("a model with tied embeddings needs its token embedding for logits")
        return self.tok_emb.weight

    def _positions_and_mask(
        self,
        B: int,
        T: int,
        device: torch.device,
        doc_starts: torch.Tensor | None,
        cache: list[LayerCache] | None,
        start_pos: int,
    ) -> tuple[torch.Tensor, Mask]:
        """Positions (1 or B, T) and an attention mask (a boolean tensor, or a DocumentMask that
        every layer shares), or None for plain causal attention."""
        index = torch.arange(start_pos, start_pos + T, device=device)
        if doc_starts is not None and self.cfg.doc_masking:
            if cache is not None:
                raise ValueError("document masking is for training; decode one document at a time")
            return positions_in_document(doc_starts), document_mask(doc_starts)
        mask: torch.Tensor | None = None
        if cache is not None and T > 1:
            mask = index.unsqueeze(1) >= torch.arange(start_pos + T, device=device).unsqueeze(0)
        return index.unsqueeze(0), mask

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
                batch, kv_heads, max_len, self.cfg.head_dim, device=ref.device, dtype=ref.dtype
            )
            for _ in self.blocks
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
        # 12 x L x H x head_dim x T, no causal halving. Every MFU figure uses this count.
        tied_head = cfg.padded_vocab_size * cfg.d_model if cfg.tied_embeddings else 0
        active = non_embedding + tied_head - self.inactive_params()
        attention_flops = 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim

        def flops_per_token(seq_len: int) -> float:
            return float(6 * active + attention_flops * seq_len)

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
            takes_head_fn=True,
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
            "blocks.*.mlp.w1": "colwise",
            "blocks.*.mlp.w2": "rowwise",
        }
        if self.cfg.mlp == "swiglu":
            plan["blocks.*.mlp.w3"] = "colwise"
        if self.pos_emb is not None:
            plan["pos_emb"] = "embedding"
        if self.head is not None:
            plan["head"] = "colwise_output"
        return plan


def splits_across_tp_ranks(cfg: TransformerConfig) -> bool:
    """Whether a tensor-parallel plan can split a model of `cfg` (a subclass's `tp_plan` asks
    too): not with a query/key norm over a whole projection, which would need the heads of every
    rank, nor with norms after each sublayer, since the plan places its sequence-parallel norms
    on the branches' inputs."""
    return not (cfg.qk_norm and cfg.qk_norm_scope == "all_heads") and cfg.norm_placement == "pre"


def build_model(cfg: TransformerConfig) -> Transformer:
    """The model on the current default device (use `torch.device("meta")` for large ones)."""
    return Transformer(cfg)
