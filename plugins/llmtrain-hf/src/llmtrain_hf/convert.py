"""llmtrain's transformer <-> transformers' causal LMs: configs and weights.

Supported: GPT2LMHeadModel, and the RoPE + RMSNorm family: with SwiGLU LlamaForCausalLM (Llama 3
and linear RoPE scaling included), MistralForCausalLM (a sliding window on every layer or none),
Qwen2ForCausalLM and Qwen3ForCausalLM (a sliding window on the layers from `max_window_layers`
on), Olmo2ForCausalLM; with GeGLU Gemma2ForCausalLM and Gemma3ForCausalLM (`gemma3_text`: local
and global layers in any pattern, soft-capping, `query_pre_attn_scalar`, Gemma 3's local RoPE
base and linear RoPE scaling of its global layers); with Mixture-of-Experts layers
(llmtrain-moe's models, `llmtrain_hf.moe`) OlmoeForCausalLM, Qwen3MoeForCausalLM and
MixtralForCausalLM. What an architecture can express is a row of `ROPE_FAMILY`; a config it
cannot express is refused naming the option. An export picks the first architecture of
`EXPORT_ORDER` (`MOE_EXPORT_ORDER`) that expresses the model (or the one asked for). The weight
layouts differ in these ways, all handled here:

- RoPE: llmtrain rotates the pairs (x[i], x[i + head_dim/2]) with frequencies
  base^(-2i/head_dim), which is exactly HF's `rotate_half`: q/k rows need no permutation
  (the Meta -> HF conversion permutes because Meta's code rotates interleaved pairs).
- OLMo-2 normalises each branch's output (`post_attention_layernorm`,
  `post_feedforward_layernorm`): llmtrain's `attn_norm` / `mlp_norm` with
  `norm_placement: after_sublayer`; its q/k norms span all heads (`qk_norm_scope: all_heads`),
  Qwen3's and Gemma 3's one head (`head`).
- Gemma normalises each branch's input and output (`norm_placement: sandwich`): `attn_norm`,
  `attn_out_norm`, `mlp_norm`, `mlp_out_norm` are `input_layernorm`,
  `post_attention_layernorm`, `pre_feedforward_layernorm`, `post_feedforward_layernorm`. Its
  RMSNorm multiplies by 1 + weight, torch's by weight: every norm of a Gemma (q/k and final
  ones too) is its weight + 1 in llmtrain (computed in float32 at least), - 1 in transformers.
- Sliding windows mean the same on both sides (key j seen by query i iff 0 <= i - j < window):
  `attention.window` is `sliding_window`; which layers slide is transformers' `layer_types`
  (Gemma, Qwen; Qwen's from `use_sliding_window` and `max_window_layers`), every layer for
  Mistral; llmtrain's `attention.pattern` is its shortest repeating prefix. A window as long as
  the context is no window.
- GPT-2 fuses q, k, v into one `c_attn` and stores every projection as a `Conv1D`, whose weight
  is (in, out): the transpose of an `nn.Linear` weight.
- GPT-2's MLP uses the tanh approximation of GELU (`gelu_new`), as llmtrain's does; Gemma's
  GeGLU `gelu_pytorch_tanh`, the same function.
- GPT-2 always has biases: a llmtrain model without them exports zeros (the same function).
- Padded vocabularies export their padded size: HF's `vocab_size` is the embedding's row count;
  the generation config suppresses the padding ids, which llmtrain never samples either.
- transformers 5 keeps RoPE settings in `rope_parameters` (Gemma 3's by layer type), 4.x in
  `rope_theta` and `rope_scaling` (Gemma 3's local layers: `rope_local_base_freq`): both are
  read, and an export's config.json carries both (`portable_config`).
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import TYPE_CHECKING, Any, Final, Literal, TypedDict

import attrs
import torch

from llmtrain.core_mesh.errors import UserError
from llmtrain.models.config import AttentionOptions, RopeScaling, TransformerConfig
from llmtrain.models.transformer import Transformer, build_model
from llmtrain_hf import moe
from llmtrain_hf.architectures import (
    ARCHITECTURES,
    GEMMA2,
    GEMMA3,
    GPT2,
    LLAMA,
    MISTRAL,
    MIXTRAL,
    OLMO2,
    OLMOE,
    QWEN2,
    QWEN3,
    QWEN3_MOE,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

# the layout (positions, norm, mlp) of GPT-2 and of the RoPE family (Gemma: mlp geglu)
GPT2_LAYOUT = {"positions": "learned", "norm": "layernorm", "mlp": "gelu"}
ROPE_LAYOUT = {"positions": "rope", "norm": "rmsnorm", "mlp": "swiglu"}
# HF activations that are llmtrain's GELU (torch's tanh approximation) up to float rounding
GPT2_GELUS = ("gelu_new", "gelu_pytorch_tanh")
GEMMA_GELU = "gelu_pytorch_tanh"
LLAMA3_ROPE = "llama3"
LINEAR_ROPE: Final = "linear"
# the RoPE scaling kinds of llmtrain (`RopeScaling.kind`), named as transformers' `rope_type`
ROPE_SCALINGS = (LLAMA3_ROPE, LINEAR_ROPE)
# transformers' names of the two kinds of layers in `layer_types`
SLIDING, FULL = "sliding_attention", "full_attention"


@attrs.frozen
class GemmaLayout:
    """What a Gemma computes beyond the RoPE family's Llama blocks, all of it: GeGLU
    (`gelu_pytorch_tanh`), four norms a block (`norm_placement: sandwich`) that multiply by
    1 + weight, embeddings times sqrt(d_model) (`scale_embeddings`), scores scaled by
    `query_pre_attn_scalar`^-1/2 (`attention.scale`), logits soft-capped by
    `final_logit_softcapping` (`logit_softcap`), local and global layers in any pattern
    (`layer_types`). Then per version:

    `attention_softcap`: Gemma 2 soft-caps attention scores (`attn_logit_softcapping`);
    transformers' Gemma 3 has the field but never applies it.
    `local_rope_base`: Gemma 3 rotates its local layers by `rope_local_base_freq`, unscaled, and
    scales the RoPE of its global layers only (llmtrain's `attention.local_rope_base`)."""

    attention_softcap: bool
    local_rope_base: bool


@attrs.frozen
class RopeArchitecture:
    """What one architecture of the RoPE + RMSNorm family can express.

    `biases`: which projections carry biases and which config fields switch them —
    "attention+mlp" (Llama: `attention_bias` for q/k/v/o, `mlp_bias`), "attention" (q/k/v/o by
    `attention_bias`, no MLP bias), "qkv" (Qwen2: q/k/v always, o and MLP never), "none".
    `rope_scaling`: the RoPE scaling kinds it reads and writes. `sliding`: which layers a
    sliding window may cover — "none", "every_layer" (Mistral: `sliding_window` on all or
    none), "from_layer" (Qwen: the layers from `max_window_layers` on), "per_layer" (Gemma:
    `layer_types`). `export_fields`: config values an export sets (sliding windows off where it
    has no `sliding`). `moe`: how a Mixture-of-Experts architecture lays out its MoE layers
    (None: a dense one). `gemma`: a Gemma's (None: SwiGLU, norms that multiply by their
    weight, no soft-capping)."""

    name: str
    model_type: str
    config_class: str
    biases: Literal["attention+mlp", "attention", "qkv", "none"]
    qk_norm: Literal["none", "head", "all_heads"]
    norm_placement: Literal["pre", "after_sublayer", "sandwich"]
    rope_scaling: tuple[str, ...]
    sliding: Literal["none", "every_layer", "from_layer", "per_layer"] = "none"
    export_fields: dict[str, object] = attrs.field(factory=dict)
    moe: moe.MoELayout | None = None
    gemma: GemmaLayout | None = None


ROPE_FAMILY = {
    a.name: a
    for a in (
        RopeArchitecture(LLAMA, "llama", "LlamaConfig", "attention+mlp", "none", "pre", ROPE_SCALINGS),
        RopeArchitecture(
            MISTRAL, "mistral", "MistralConfig", "none", "none", "pre", ROPE_SCALINGS,
            sliding="every_layer",
        ),
        RopeArchitecture(
            QWEN2, "qwen2", "Qwen2Config", "qkv", "none", "pre", ROPE_SCALINGS,
            sliding="from_layer",
        ),
        RopeArchitecture(
            QWEN3, "qwen3", "Qwen3Config", "attention", "head", "pre", ROPE_SCALINGS,
            sliding="from_layer",
        ),
        # transformers 4.x's Olmo2Config accepts no llama3 RoPE scaling
        RopeArchitecture(OLMO2, "olmo2", "Olmo2Config", "attention", "all_heads", "after_sublayer", ()),
        # Gemma 2's config classes take no RoPE scaling; Gemma 3's linear scaling (that of its
        # released models) is its global layers'
        RopeArchitecture(
            GEMMA2, "gemma2", "Gemma2Config", "attention", "none", "sandwich", (),
            sliding="per_layer", gemma=GemmaLayout(attention_softcap=True, local_rope_base=False),
        ),
        RopeArchitecture(
            GEMMA3, "gemma3_text", "Gemma3TextConfig", "attention", "head", "sandwich",
            (LINEAR_ROPE,), sliding="per_layer",
            gemma=GemmaLayout(attention_softcap=False, local_rope_base=True),
        ),
        # Mixture-of-Experts: pre-norm blocks with the MoE layers of `moe`; OLMoE's q/k norms
        # span all heads (OLMo-2's), Qwen3-MoE's one head; no RoPE scaling llmtrain-hf writes,
        # no sliding window (llmtrain-moe's attention is global)
        RopeArchitecture(
            OLMOE, "olmoe", "OlmoeConfig", "attention", "all_heads", "pre", (),
            export_fields={"clip_qkv": None}, moe=moe.OLMOE_LAYOUT,
        ),
        RopeArchitecture(
            QWEN3_MOE, "qwen3_moe", "Qwen3MoeConfig", "attention", "head", "pre", (),
            export_fields={
                "use_sliding_window": False, "decoder_sparse_step": 1, "mlp_only_layers": []
            },
            moe=moe.QWEN3_MOE_LAYOUT,
        ),
        RopeArchitecture(
            MIXTRAL, "mixtral", "MixtralConfig", "none", "none", "pre", (),
            export_fields={"sliding_window": None, "router_jitter_noise": 0.0},
            moe=moe.MIXTRAL_LAYOUT,
        ),
    )
}  # fmt: skip
MODEL_TYPES = {
    **{a.model_type: a.name for a in ROPE_FAMILY.values() if a.moe is None},
    "gpt2": GPT2,
    **{a.model_type: a.name for a in ROPE_FAMILY.values() if a.moe is not None},
}
# an export takes the first that fits: Mistral computes what Llama does, so it is taken for a
# model that slides on every layer, or when asked; only a Gemma computes Gemma's blocks, and the
# query/key norm tells Gemma 2 and 3 apart
EXPORT_ORDER = (LLAMA, QWEN2, QWEN3, OLMO2, MISTRAL, GEMMA2, GEMMA3)
# the query/key norm tells them apart: at most one fits a model
MOE_EXPORT_ORDER = (OLMOE, QWEN3_MOE, MIXTRAL)


class UnsupportedModelError(UserError):
    """A model with no exact counterpart on the other side, naming the option that prevents it."""


# --- which architecture ----------------------------------------------------------------------------


# the biases each kind of `RopeArchitecture.biases` has, said in an error
BIAS_KINDS = {
    "attention+mlp": "one switch for q/k/v/o biases and one for the MLP's",
    "attention": "one switch for q/k/v/o biases and no MLP biases",
    "qkv": "q/k/v biases only",
    "none": "no biases",
}


def _bias_mismatches(arch: RopeArchitecture, cfg: TransformerConfig) -> list[str]:
    qkv, out, mlp = cfg.qkv_bias, cfg.out_bias, cfg.mlp_bias
    expressible = {
        "attention+mlp": qkv == out,
        "attention": qkv == out and not mlp,
        "qkv": qkv and not out and not mlp,
        "none": not (qkv or out or mlp),
    }[arch.biases]
    if expressible:
        return []
    return [f"biases q/k/v {qkv}, output {out}, MLP {mlp} (it has {BIAS_KINDS[arch.biases]})"]


def mismatches(arch: RopeArchitecture, cfg: TransformerConfig) -> list[str]:
    """Why `arch` cannot compute the model of `cfg` (empty: it can)."""
    if moe.is_moe(cfg) != (arch.moe is not None):
        if arch.moe is None:
            return ["a Mixture-of-Experts model (a dense architecture)"]
        return ["a dense model (a Mixture-of-Experts architecture, for llmtrain-moe's models)"]
    layout = {**ROPE_LAYOUT, "mlp": "geglu" if arch.gemma is not None else "swiglu"}
    problems = [
        f"model.{key}: {getattr(cfg, key)} (needs {value})"
        for key, value in layout.items()
        if getattr(cfg, key) != value
    ]
    problems += _bias_mismatches(arch, cfg)
    scope = cfg.qk_norm_scope if cfg.qk_norm else "none"
    if scope != arch.qk_norm:
        problems.append(f"query/key norm: {scope} (needs {arch.qk_norm})")
    if cfg.norm_placement != arch.norm_placement:
        problems.append(f"model.norm_placement: {cfg.norm_placement} (needs {arch.norm_placement})")
    if cfg.rope_scaling is not None and cfg.rope_scaling.kind not in arch.rope_scaling:
        problems.append(
            "model.rope_scaling is not supported"
            if not arch.rope_scaling
            else f"model.rope_scaling: kind {cfg.rope_scaling.kind} is not supported (it has "
            f"{' or '.join(arch.rope_scaling)})"
        )
    if arch.name in (LLAMA, GEMMA2, GEMMA3) and cfg.d_model % cfg.n_heads:
        # transformers 5's config classes refuse it, whatever head_dim says
        problems.append(f"model.n_heads: {cfg.n_heads} does not divide d_model {cfg.d_model}")
    problems += _window_mismatches(arch, cfg)
    problems += _gemma_only(cfg) if arch.gemma is None else _gemma_mismatches(arch.gemma, cfg)
    if arch.moe is not None and moe.is_moe(cfg):
        problems += moe.mismatches(arch.moe, cfg)
    return problems


def local_layers(cfg: TransformerConfig) -> list[bool]:
    """Whether each block attends through the sliding window (`attention.window_of`)."""
    return [cfg.attention.window_of(i) is not None for i in range(cfg.n_layers)]


def _window_mismatches(arch: RopeArchitecture, cfg: TransformerConfig) -> list[str]:
    local = local_layers(cfg)
    if not any(local):
        return []
    if arch.sliding == "none":
        return [f"model.attention.window: {cfg.attention.window} (no sliding-window attention)"]
    pattern = f"model.attention.pattern: {list(cfg.attention.pattern)}"
    if arch.sliding == "every_layer" and not all(local):
        return [f"{pattern} (its window slides on every layer or on none)"]
    if arch.sliding == "from_layer" and local != sorted(local):
        return [
            f"{pattern} (its window slides on the layers from max_window_layers on: global "
            "layers first, then local ones)"
        ]
    return []


def _gemma_only(cfg: TransformerConfig) -> list[str]:
    """The options of `cfg` that only a Gemma architecture expresses, where they are set."""
    attention = cfg.attention
    named = [
        ("model.scale_embeddings", cfg.scale_embeddings or None),
        ("model.logit_softcap", cfg.logit_softcap),
        ("model.attention.softcap", attention.softcap),
        ("model.attention.scale", attention.scale),
        ("model.attention.local_rope_base", attention.local_rope_base),
    ]
    return [
        f"{name}: {'true' if value is True else value} (Gemma's only)"
        for name, value in named
        if value is not None
    ]


def _gemma_mismatches(layout: GemmaLayout, cfg: TransformerConfig) -> list[str]:
    problems = []
    attention = cfg.attention
    if not cfg.scale_embeddings:
        problems.append("model.scale_embeddings: false (Gemma multiplies them by sqrt(d_model))")
    if attention.softcap is not None and not layout.attention_softcap:
        problems.append(
            f"model.attention.softcap: {attention.softcap} (transformers' Gemma 3 never "
            "soft-caps attention scores)"
        )
    if attention.local_rope_base is not None and not layout.local_rope_base:
        problems.append(
            f"model.attention.local_rope_base: {attention.local_rope_base} (one RoPE base for "
            "every layer)"
        )
    if (
        layout.local_rope_base
        and attention.local_rope_base is None
        and cfg.rope_scaling is not None
        and any(local_layers(cfg))
    ):
        problems.append(
            "model.rope_scaling without attention.local_rope_base (it scales the local layers' "
            "RoPE too; Gemma 3 scales its global layers' only: set local_rope_base to rope_base)"
        )
    if query_pre_attn_scalar(cfg) is None:
        problems.append(
            f"model.attention.scale: {attention.scale} (Gemma's is query_pre_attn_scalar^-1/2 "
            "for a whole number query_pre_attn_scalar)"
        )
    return problems


def query_pre_attn_scalar(cfg: TransformerConfig) -> int | None:
    """Gemma's `query_pre_attn_scalar` (scores times its -1/2 power) of `cfg`'s attention scale
    (None: SDPA's 1/sqrt(head_dim)); None where no whole number gives that scale (transformers
    5 takes whole numbers only)."""
    scale = cfg.attention.scale
    if scale is None:
        return cfg.head_dim
    value = round(scale**-2)
    if value >= 1 and math.isclose(value**-0.5, scale, rel_tol=1e-12):
        return value
    return None


def architecture_of(cfg: TransformerConfig, prefer: str | None = None) -> str:
    """The transformers architecture an export of `cfg` writes: `prefer` when given (it must
    fit), else the first of EXPORT_ORDER that fits (GPT2 for learned positions; the first of
    MOE_EXPORT_ORDER for llmtrain-moe's models); else a UserError naming what each candidate
    lacks."""
    mixture = moe.is_moe(cfg)
    if type(cfg) is not TransformerConfig and not mixture:
        raise UnsupportedModelError(
            f"model options of type {type(cfg).__name__} are not llmtrain's TransformerConfig; "
            "hf export handles the built-in transformer kinds (tiny, gpt2-*, llama-*, transformer) "
            "and llmtrain-moe's models"
        )
    if prefer is not None and prefer not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"--architecture {prefer}: choose one of {', '.join(ARCHITECTURES)}"
        )
    if cfg.parametrization != "standard":
        # µP's logit multiplier and attention scale have no field in a transformers config
        raise UnsupportedModelError(
            f"model.parametrization: {cfg.parametrization} has no transformers equivalent "
            "(its logit multiplier and attention scale); hf export takes standard models only"
        )
    if moe.is_moe(cfg):
        problems = moe.unexpressible(cfg)
        if problems:
            raise UnsupportedModelError(
                f"{'; '.join(problems)}: no transformers architecture computes this model"
            )
    if prefer == GPT2 or (prefer is None and cfg.positions == "learned"):
        problems = _gpt2_mismatches(cfg) + (["a Mixture-of-Experts model"] if mixture else [])
        if problems:
            raise UnsupportedModelError(f"{'; '.join(problems)}: no equivalent in {GPT2}")
        return GPT2
    candidates = (
        [prefer] if prefer is not None else list(MOE_EXPORT_ORDER if mixture else EXPORT_ORDER)
    )
    reasons = {name: mismatches(ROPE_FAMILY[name], cfg) for name in candidates}
    for name in candidates:
        if not reasons[name]:
            return name
    detail = "; ".join(f"{name}: {', '.join(why)}" for name, why in reasons.items())
    raise UnsupportedModelError(f"no transformers architecture computes this model ({detail})")


def _gpt2_mismatches(cfg: TransformerConfig) -> list[str]:
    problems = [
        f"model.{key}: {getattr(cfg, key)}"
        for key, value in GPT2_LAYOUT.items()
        if getattr(cfg, key) != value
    ]
    if cfg.qk_norm:
        problems.append("model.qk_norm: true")
    if cfg.norm_placement != "pre":
        problems.append(f"model.norm_placement: {cfg.norm_placement}")
    if cfg.kv_heads != cfg.n_heads:
        problems.append(f"model.n_kv_heads: {cfg.n_kv_heads} (grouped-query attention)")
    if cfg.head_dim * cfg.n_heads != cfg.d_model:
        problems.append(f"model.head_dim: {cfg.head_dim} (n_heads x head_dim != d_model)")
    if any(local_layers(cfg)):
        problems.append(f"model.attention.window: {cfg.attention.window} (no sliding window)")
    return problems + _gemma_only(cfg)


# --- configs ---------------------------------------------------------------------------------------


class _CommonConfig(TypedDict):
    """The transformers config fields every architecture's config takes alike."""

    vocab_size: int
    tie_word_embeddings: bool
    initializer_range: float
    bos_token_id: None
    eos_token_id: int | None
    pad_token_id: None
    architectures: list[str]


def hf_config(
    cfg: TransformerConfig,
    *,
    eos_token_id: int | None = None,
    dtype: torch.dtype = torch.float32,
    architecture: str | None = None,
) -> PretrainedConfig:
    """The transformers config of an llmtrain model config (see `architecture_of`)."""
    import transformers

    arch = architecture_of(cfg, architecture)
    common = _CommonConfig(
        vocab_size=cfg.padded_vocab_size,
        tie_word_embeddings=cfg.tied_embeddings,
        initializer_range=cfg.init_std,
        bos_token_id=None,
        eos_token_id=eos_token_id,
        pad_token_id=None,
        architectures=[arch],
    )
    if arch == GPT2:
        config = transformers.GPT2Config(
            n_positions=cfg.max_seq_len,
            n_embd=cfg.d_model,
            n_layer=cfg.n_layers,
            n_head=cfg.n_heads,
            n_inner=cfg.hidden_size,
            activation_function="gelu_new",
            resid_pdrop=cfg.dropout,
            embd_pdrop=cfg.dropout,
            attn_pdrop=cfg.dropout,
            layer_norm_epsilon=cfg.norm_eps,
            scale_attn_weights=True,
            scale_attn_by_inverse_layer_idx=False,
            reorder_and_upcast_attn=False,
            **common,
        )
    else:
        spec = ROPE_FAMILY[arch]
        fields: dict[str, object] = dict(
            hidden_size=cfg.d_model,
            intermediate_size=cfg.hidden_size,
            num_hidden_layers=cfg.n_layers,
            num_attention_heads=cfg.n_heads,
            num_key_value_heads=cfg.kv_heads,
            head_dim=cfg.head_dim,
            max_position_embeddings=cfg.max_seq_len,
            rms_norm_eps=cfg.norm_eps,
            rope_theta=cfg.rope_base,
            rope_scaling=_hf_rope_scaling(cfg.rope_scaling),
            attention_dropout=cfg.dropout,
            **_bias_fields(spec, cfg),
            **_window_fields(spec, cfg),
            **spec.export_fields,
            **common,
        )
        if spec.gemma is None:
            fields["hidden_act"] = "silu"
        else:
            fields.update(_gemma_fields(spec.gemma, cfg))
        if spec.moe is not None and moe.is_moe(cfg):
            if not spec.moe.head_dim:  # OLMoE has no such field: d_model / n_heads (checked)
                del fields["head_dim"]
            fields.update(moe.config_fields(spec.moe, cfg))
        config = getattr(transformers, spec.config_class)(**fields)
    config.dtype = dtype
    return config


def _window_fields(spec: RopeArchitecture, cfg: TransformerConfig) -> dict[str, object]:
    """The config fields of which layers slide, and by how much (checked: `mismatches`)."""
    local = local_layers(cfg)
    window = cfg.attention.window if any(local) else None
    if spec.sliding == "every_layer":
        return {"sliding_window": window}
    if spec.sliding == "from_layer":
        if window is None:
            return {"use_sliding_window": False}
        return {
            "use_sliding_window": True,
            "sliding_window": window,
            "max_window_layers": local.index(True),
        }
    if spec.sliding == "per_layer":
        # transformers builds the sliding mask whether a layer uses it or not, so it needs a
        # window: without one, the whole context (which no layer uses: all are global)
        return {
            "sliding_window": window if window is not None else cfg.max_seq_len,
            "layer_types": [SLIDING if slides else FULL for slides in local],
        }
    return {}


def _gemma_fields(layout: GemmaLayout, cfg: TransformerConfig) -> dict[str, object]:
    """A Gemma's config fields beyond the RoPE family's (checked: `mismatches`)."""
    fields: dict[str, object] = {
        "hidden_activation": GEMMA_GELU,
        "query_pre_attn_scalar": query_pre_attn_scalar(cfg),
        "final_logit_softcapping": cfg.logit_softcap,
        "attn_logit_softcapping": cfg.attention.softcap,
    }
    if layout.local_rope_base:
        local = cfg.attention.local_rope_base
        fields["rope_local_base_freq"] = local if local is not None else cfg.rope_base
        fields["use_bidirectional_attention"] = False
    return fields


def _bias_fields(spec: RopeArchitecture, cfg: TransformerConfig) -> dict[str, bool]:
    if spec.biases == "attention+mlp":
        return {"attention_bias": cfg.qkv_bias, "mlp_bias": cfg.mlp_bias}
    if spec.biases == "attention":
        return {"attention_bias": cfg.qkv_bias}
    return {}


def _hf_rope_scaling(scaling: RopeScaling | None) -> dict[str, object] | None:
    if scaling is None:
        return None
    if scaling.kind == LINEAR_ROPE:
        return {"rope_type": LINEAR_ROPE, "factor": scaling.factor}
    return {
        "rope_type": LLAMA3_ROPE,
        "factor": scaling.factor,
        "low_freq_factor": scaling.low_freq_factor,
        "high_freq_factor": scaling.high_freq_factor,
        "original_max_position_embeddings": scaling.original_max_seq_len,
    }


def portable_config(directory: str, cfg: TransformerConfig) -> None:
    """Make the config.json that save_pretrained wrote readable by transformers 4.x and 5.x:
    5.x writes RoPE settings only as `rope_parameters`, which 4.x ignores (it would fall back to
    rope_theta 10000), so the 4.x keys are added; 4.x's file already reads in 5.x. Likewise 5.x
    writes Qwen3-MoE's expert count as `num_local_experts`, 4.x reads `num_experts` (else 128),
    and Gemma 3's RoPE by layer type, where 4.x reads the global layers' in `rope_theta` and
    `rope_scaling` and the local layers' base in `rope_local_base_freq`."""
    if cfg.positions != "rope":
        return
    path = os.path.join(directory, "config.json")
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    data["rope_theta"] = cfg.rope_base
    data["rope_scaling"] = _hf_rope_scaling(cfg.rope_scaling)
    spec = ROPE_FAMILY.get((data.get("architectures") or [""])[0])
    if spec is not None and spec.gemma is not None and spec.gemma.local_rope_base:
        local = cfg.attention.local_rope_base
        data["rope_local_base_freq"] = local if local is not None else cfg.rope_base
    if spec is not None and spec.moe is not None and moe.is_moe(cfg):
        data[spec.moe.experts_field] = cfg.n_experts
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")


def _rope(config: Any) -> tuple[float, dict[str, Any]]:
    """(theta, scaling parameters with `rope_type`) of an HF config: transformers 5 keeps them
    in `rope_parameters`, 4.x in `rope_theta` and `rope_scaling`."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    scaling = dict(getattr(config, "rope_scaling", None) or {})
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    return _theta_and_type(theta, {**scaling, **params})


def _theta_and_type(theta: Any, params: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return float(theta if theta is not None else 10000.0), params


def _gemma3_rope(config: Any) -> tuple[tuple[float, dict[str, Any]], tuple[float, dict[str, Any]]]:
    """Gemma 3's RoPE (theta, parameters with `rope_type`) of its global and its local layers:
    transformers 5 keeps them in `rope_parameters` by layer type; 4.x the global layers' in
    `rope_theta` and `rope_scaling`, the local layers' base in `rope_local_base_freq` (their RoPE
    is never scaled)."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and FULL in params:
        full, local = dict(params.get(FULL) or {}), dict(params.get(SLIDING) or {})
        return (
            _theta_and_type(full.get("rope_theta"), full),
            _theta_and_type(local.get("rope_theta"), local),
        )
    scaling = dict(getattr(config, "rope_scaling", None) or {})
    local_theta = getattr(config, "rope_local_base_freq", None)
    return (
        _theta_and_type(getattr(config, "rope_theta", None), scaling),
        _theta_and_type(local_theta, {"rope_type": "default"}),
    )


def _refuse(where: str, what: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"{where}: {what}")


def source_architecture(config: Any, where: str = "config.json") -> str:
    """The supported architecture of an HF config (by its model_type), or a UserError."""
    model_type = getattr(config, "model_type", None)
    archs = list(getattr(config, "architectures", None) or [])
    if model_type == moe.QWEN2_MOE_TYPE:
        raise _refuse(
            where,
            f"model_type {model_type!r} is not supported: Qwen2-MoE scales its shared expert by a "
            "sigmoid gate that llmtrain-moe's shared expert has no weight for",
        )
    arch = MODEL_TYPES.get(model_type) if isinstance(model_type, str) else None
    if arch is None or any(a != arch for a in archs):
        named = f"{model_type!r}" + (f" ({', '.join(archs)})" if archs else "")
        supported = ", ".join(f"{name} ({t})" for t, name in MODEL_TYPES.items())
        raise _refuse(where, f"model_type {named} is not supported; llmtrain-hf reads {supported}")
    return arch


def options_from_hf(config: Any, where: str = "config.json") -> TransformerConfig:
    """The llmtrain model options equivalent to a supported transformers config; refuses what
    has no llmtrain equivalent, naming the field."""
    arch = source_architecture(config, where)
    common = dict(
        vocab_size=config.vocab_size,
        pad_vocab_to=1,  # the table is as large as HF's: pad nothing further
        tied_embeddings=bool(config.tie_word_embeddings),
        init_std=float(config.initializer_range),
        dropout=0.0,
        doc_masking=False,
    )
    if arch == GPT2:
        return _gpt2_options(config, where, common)
    return _rope_family_options(ROPE_FAMILY[arch], config, where, common)


def _rope_family_options(
    spec: RopeArchitecture, config: Any, where: str, common: dict[str, Any]
) -> TransformerConfig:
    if spec.gemma is None and config.hidden_act != "silu":
        raise _refuse(where, f"hidden_act {config.hidden_act!r}: llmtrain's SwiGLU uses silu")
    if spec.gemma is not None:
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
        if act not in GPT2_GELUS:
            raise _refuse(
                where,
                f"hidden_activation {act!r}: llmtrain's GeGLU is the tanh approximation of GELU "
                f"({' or '.join(GPT2_GELUS)})",
            )
        if getattr(config, "use_bidirectional_attention", False):
            raise _refuse(
                where,
                "use_bidirectional_attention: true (an encoder's attention); llmtrain's is causal",
            )
    window, pattern = _attention_layers(spec, config, where)
    theta, scaling, local_theta = _rope_settings(spec, config, where)
    qkv, out, mlp = _biases(spec, config)
    bias = qkv if qkv == out == mlp else False
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    options: dict[str, Any] = dict(
        max_seq_len=config.max_position_embeddings,
        d_model=config.hidden_size,
        n_layers=config.num_hidden_layers,
        n_heads=config.num_attention_heads,
        n_kv_heads=config.num_key_value_heads or config.num_attention_heads,
        head_dim=None if head_dim * config.num_attention_heads == config.hidden_size else head_dim,
        positions="rope",
        rope_base=theta,
        rope_scaling=scaling,
        norm="rmsnorm",
        norm_eps=float(config.rms_norm_eps),
        norm_placement=spec.norm_placement,
        mlp="swiglu" if spec.gemma is None else "geglu",
        mlp_hidden=config.intermediate_size,
        qk_norm=spec.qk_norm != "none",
        qk_norm_scope="all_heads" if spec.qk_norm == "all_heads" else "head",
        bias=bias,
        qkv_bias=None if qkv == bias else qkv,
        out_bias=None if out == bias else out,
        mlp_bias=None if mlp == bias else mlp,
        attention=_attention(window=window, pattern=pattern),
        **common,
    )
    if spec.gemma is not None:
        options.update(_gemma_options(spec.gemma, config, window, pattern, local_theta))
    if spec.moe is not None:
        return moe.options(spec.moe, config, where, options)
    return TransformerConfig(**options)


def _gemma_options(
    layout: GemmaLayout,
    config: Any,
    window: int | None,
    pattern: tuple[str, ...],
    local_theta: float | None,
) -> dict[str, Any]:
    """A Gemma's options beyond the RoPE family's (see `GemmaLayout`)."""
    softcap = config.attn_logit_softcapping if layout.attention_softcap else None
    final = getattr(config, "final_logit_softcapping", None)
    return dict(
        scale_embeddings=True,
        logit_softcap=None if final is None else float(final),
        attention=_attention(
            window=window,
            pattern=pattern,
            # the RoPE base of windowed blocks: without a window every layer is global
            local_rope_base=local_theta if window is not None else None,
            softcap=None if softcap is None else float(softcap),
            # as transformers computes it: a Python float, query_pre_attn_scalar**-0.5
            scale=float(config.query_pre_attn_scalar) ** -0.5,
        ),
    )


def _attention(**fields: Any) -> AttentionOptions:
    """`AttentionOptions(**fields)`: its `pattern` converter (`tuple`) leaves mypy no type to
    check a pattern against."""
    return AttentionOptions(**fields)


def _rope_settings(
    spec: RopeArchitecture, config: Any, where: str
) -> tuple[float, RopeScaling | None, float | None]:
    """(rope_base, rope_scaling, the local layers' base: Gemma 3's) of a RoPE-family config."""
    local_theta = None
    if spec.gemma is not None and spec.gemma.local_rope_base:
        (theta, rope), (local_theta, local) = _gemma3_rope(config)
        if local["rope_type"] != "default":
            raise _refuse(
                where,
                f"rope_type {local['rope_type']!r} of the local (sliding_attention) layers: "
                f"llmtrain scales the RoPE of {spec.name}'s global layers only; use the default "
                "RoPE for its local layers",
            )
    else:
        theta, rope = _rope(config)
    kind = rope["rope_type"]
    if kind != "default" and kind not in ROPE_SCALINGS:
        raise _refuse(
            where,
            f"rope_type {kind!r} (RoPE frequency scaling) has no llmtrain equivalent; llmtrain "
            f"reads the default RoPE and {' and '.join(map(repr, ROPE_SCALINGS))} scaling",
        )
    if kind != "default" and kind not in spec.rope_scaling:
        why = (
            f"llmtrain-hf reads {' and '.join(map(repr, spec.rope_scaling))} scaling for it only"
            if spec.rope_scaling
            else f"transformers 4.x's {spec.config_class} has no such scaling, so llmtrain-hf "
            "reads it for the other architectures only"
        )
        raise _refuse(where, f"rope_type {kind!r} with {spec.name}: {why}")
    scaling = None
    if kind == LLAMA3_ROPE:
        scaling = RopeScaling(
            factor=float(rope["factor"]),
            low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_seq_len=int(rope["original_max_position_embeddings"]),
        )
    elif kind == LINEAR_ROPE:
        scaling = RopeScaling(kind=LINEAR_ROPE, factor=float(rope["factor"]))
    return theta, scaling, local_theta


def _biases(spec: RopeArchitecture, config: Any) -> tuple[bool, bool, bool]:
    """(q/k/v, output projection, MLP) biases of a RoPE-family config."""
    attention = bool(getattr(config, "attention_bias", False))
    return {
        "attention+mlp": (attention, attention, bool(getattr(config, "mlp_bias", False))),
        "attention": (attention, attention, False),
        "qkv": (True, False, False),
        "none": (False, False, False),
    }[spec.biases]


def _attention_layers(
    spec: RopeArchitecture, config: Any, where: str
) -> tuple[int | None, tuple[str, ...]]:
    """(`attention.window`, `attention.pattern`) of a RoPE-family config: the layers that slide
    are those of `layer_types` (Gemma; Qwen's, which its config class fills in from
    `use_sliding_window` and `max_window_layers`), or all of them (Mistral, whose model reads no
    `layer_types`); a window as long as the context, or none, is global attention."""
    n_layers = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if spec.sliding == "every_layer" or layer_types is None:
        # Mistral and Mixtral: a window, when set, on every layer; a config class that fills
        # in no layer_types (a Qwen before them) slides from max_window_layers on
        first = getattr(config, "max_window_layers", 0) or 0
        on = bool(getattr(config, "use_sliding_window", True))
        slides = [on and i >= first for i in range(n_layers)]
    else:
        other = sorted(set(layer_types) - {SLIDING, FULL})
        if other:
            raise _refuse(
                where,
                f"layer_types {other[0]!r}: llmtrain's layers attend to the whole context "
                f"({FULL}) or through a sliding window ({SLIDING})",
            )
        slides = [kind == SLIDING for kind in layer_types]
    if window is None or window >= config.max_position_embeddings or not any(slides):
        return None, ("local",)
    if spec.sliding == "none":
        raise _refuse(
            where,
            f"sliding_window {window} (shorter than max_position_embeddings "
            f"{config.max_position_embeddings}): llmtrain-hf reads sliding windows of "
            f"{', '.join(a.name for a in ROPE_FAMILY.values() if a.sliding != 'none')} only; "
            "use a model without one, or set sliding_window to null if it was never trained "
            "with one",
        )
    return int(window), _pattern(slides)


def _pattern(slides: list[bool]) -> tuple[str, ...]:
    """`attention.pattern` of the layers that slide: the shortest prefix that repeats over
    them (Gemma 2: local, global; Gemma 3: five local, one global)."""
    kinds = ["local" if s else "global" for s in slides]
    period = next(
        p
        for p in range(1, len(kinds) + 1)
        if all(kind == kinds[i % p] for i, kind in enumerate(kinds))
    )
    return tuple(kinds[:period])


def _gpt2_options(config: Any, where: str, common: dict[str, Any]) -> TransformerConfig:
    if config.activation_function not in GPT2_GELUS:
        raise _refuse(
            where,
            f"activation_function {config.activation_function!r}: llmtrain's GELU MLP is the tanh "
            f"approximation ({' or '.join(GPT2_GELUS)})",
        )
    for key, supported in (
        ("scale_attn_weights", True),
        ("scale_attn_by_inverse_layer_idx", False),
        ("add_cross_attention", False),
    ):
        if bool(getattr(config, key, supported)) != supported:
            raise _refuse(where, f"{key}: {not supported} has no llmtrain equivalent")
    return TransformerConfig(
        max_seq_len=config.n_positions,
        d_model=config.n_embd,
        n_layers=config.n_layer,
        n_heads=config.n_head,
        positions="learned",
        norm="layernorm",
        norm_eps=float(config.layer_norm_epsilon),
        mlp="gelu",
        mlp_hidden=config.n_inner or 4 * config.n_embd,
        bias=True,
        qk_norm=False,
        **common,
    )


# --- weights ---------------------------------------------------------------------------------------

# llmtrain name -> HF name; `{i}` is the layer index. GPT-2's attention and Conv1D layers are
# not renames and are handled in `_gpt2_block_to_hf` / `_gpt2_block_from_hf`.
ROPE_FAMILY_NAMES = {
    "tok_emb.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "head.weight": "lm_head.weight",
    "blocks.{i}.attn.q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "blocks.{i}.attn.k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    **{
        f"blocks.{{i}}.attn.{ours}.{p}": f"model.layers.{{i}}.self_attn.{theirs}.{p}"
        for ours, theirs in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj"))
        for p in ("weight", "bias")
    },
    **{
        f"blocks.{{i}}.mlp.{ours}.{p}": f"model.layers.{{i}}.mlp.{theirs}.{p}"
        for ours, theirs in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))
        for p in ("weight", "bias")
    },
}
# the block norms by `norm_placement`: on each branch's input, or on its output (OLMo-2)
BLOCK_NORM_NAMES = {
    "pre": {
        "blocks.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
        "blocks.{i}.mlp_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    },
    "after_sublayer": {
        "blocks.{i}.attn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
        "blocks.{i}.mlp_norm.weight": "model.layers.{i}.post_feedforward_layernorm.weight",
    },
    # Gemma: both
    "sandwich": {
        "blocks.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
        "blocks.{i}.attn_out_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
        "blocks.{i}.mlp_norm.weight": "model.layers.{i}.pre_feedforward_layernorm.weight",
        "blocks.{i}.mlp_out_norm.weight": "model.layers.{i}.post_feedforward_layernorm.weight",
    },
}
# the weights of norms (llmtrain's names: blocks' four, q/k, final), which a Gemma's RMSNorm
# multiplies by as 1 + weight and torch's as weight (`_offset_norms`)
NORM_WEIGHT = re.compile(r"norm\.weight$")
GPT2_NAMES = {
    "tok_emb.weight": "transformer.wte.weight",
    "pos_emb.weight": "transformer.wpe.weight",
    "norm.weight": "transformer.ln_f.weight",
    "norm.bias": "transformer.ln_f.bias",
    "head.weight": "lm_head.weight",
    "blocks.{i}.attn_norm.weight": "transformer.h.{i}.ln_1.weight",
    "blocks.{i}.attn_norm.bias": "transformer.h.{i}.ln_1.bias",
    "blocks.{i}.mlp_norm.weight": "transformer.h.{i}.ln_2.weight",
    "blocks.{i}.mlp_norm.bias": "transformer.h.{i}.ln_2.bias",
}
# Conv1D layers of a GPT-2 block: HF name -> llmtrain Linear
GPT2_CONV1D = {"attn.c_proj": "attn.wo", "mlp.c_fc": "mlp.w1", "mlp.c_proj": "mlp.w2"}
# buffers some transformers versions keep in a GPT-2 state dict (the causal mask), not weights
GPT2_BUFFERS = re.compile(r"\.attn\.(bias|masked_bias)$")
# RoPE frequencies older transformers saved with the weights: derived from the config, not weights
ROTARY_BUFFER = re.compile(r"rotary_emb\.inv_freq$")


# an llmtrain-moe block: its norms as pre-norm blocks name them, no dense MLP
MOE_BLOCK_NAMES = {
    **{k: v for k, v in ROPE_FAMILY_NAMES.items() if not k.startswith("blocks.{i}.mlp.")},
    "blocks.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blocks.{i}.moe_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
}


def _moe_layout(cfg: TransformerConfig) -> moe.MoELayout | None:
    """The MoE layout of the architecture a model of `cfg` exports as (None: a dense model)."""
    if not moe.is_moe(cfg):
        return None
    return ROPE_FAMILY[architecture_of(cfg)].moe


def _names(cfg: TransformerConfig) -> dict[str, str]:
    """llmtrain name -> HF name of every tensor a model of `cfg` may have (its layout's; a MoE
    model's experts aside, which are not renames: `moe.experts_to_hf`)."""
    if cfg.positions == "learned":
        return _layered(GPT2_NAMES, cfg.n_layers)
    layout = _moe_layout(cfg)
    if layout is not None:
        return _layered({**MOE_BLOCK_NAMES, **moe.router_names(layout)}, cfg.n_layers)
    return _layered({**ROPE_FAMILY_NAMES, **BLOCK_NORM_NAMES[cfg.norm_placement]}, cfg.n_layers)


def _layered(names: dict[str, str], n_layers: int) -> dict[str, str]:
    out = {}
    for ours, theirs in names.items():
        if "{i}" in ours:
            out.update({ours.format(i=i): theirs.format(i=i) for i in range(n_layers)})
        else:
            out[ours] = theirs
    return out


def _offset_norms(
    weights: dict[str, torch.Tensor], cfg: TransformerConfig, offset: float
) -> dict[str, torch.Tensor]:
    """`weights` (llmtrain's names) with `offset` added to every norm's weight in a Gemma model
    (sandwich blocks: Gemma's only), whose RMSNorm multiplies by 1 + weight: +1 from
    transformers, -1 to it. In float32 at least, as Gemma's norm adds in float32: 1 + w in
    bfloat16 would keep 8 bits of w."""
    if cfg.norm_placement != "sandwich":
        return weights
    return {
        k: v.to(torch.promote_types(v.dtype, torch.float32)) + offset
        if NORM_WEIGHT.search(k)
        else v
        for k, v in weights.items()
    }


def _take(weights: dict[str, torch.Tensor], name: str, like: torch.Tensor) -> torch.Tensor:
    """weights[name], or zeros shaped like `like` for a bias the model does not have."""
    if name in weights:
        return weights[name]
    return torch.zeros(like.shape[0], dtype=like.dtype)


def _check_names(got: set[str], expected: set[str], what: str) -> None:
    missing, unexpected = sorted(expected - got), sorted(got - expected)
    if missing or unexpected:
        raise UserError(
            f"the {what} weights do not fit the model's config: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )


def to_hf_state_dict(
    weights: dict[str, torch.Tensor], cfg: TransformerConfig
) -> dict[str, torch.Tensor]:
    """llmtrain weights (module names) -> the HF state dict of `architecture_of(cfg)` (every
    architecture of the RoPE family names the tensors of a given config alike)."""
    weights = {k: v for k, v in weights.items() if not k.endswith(("rope_cos", "rope_sin"))}
    weights = _offset_norms(weights, cfg, -1.0)
    arch = architecture_of(cfg)
    names = _names(cfg)
    out = {names[k]: v for k, v in weights.items() if k in names}
    used = set(names)
    if arch == GPT2:
        for i in range(cfg.n_layers):
            block, read = _gpt2_block_to_hf(weights, i)
            out.update(block)
            used |= read
        out.setdefault("transformer.ln_f.bias", torch.zeros_like(weights["norm.weight"]))
    layout = _moe_layout(cfg)
    if layout is not None:
        experts, read = moe.experts_to_hf(weights, layout, cfg.n_layers)
        out.update(experts)
        used |= read
    if cfg.tied_embeddings:
        out["lm_head.weight"] = weights["tok_emb.weight"]
    unused = sorted(set(weights) - used)
    if unused:
        raise UserError(f"no {arch} weight for the llmtrain tensors {unused[:5]}")
    return {k: v.detach().contiguous() for k, v in out.items()}


def _gpt2_block_to_hf(
    weights: dict[str, torch.Tensor], i: int
) -> tuple[dict[str, torch.Tensor], set[str]]:
    """One block's fused attention and Conv1D weights (and zero biases where llmtrain has none),
    and the llmtrain names read."""
    ours, theirs = f"blocks.{i}.", f"transformer.h.{i}."
    out: dict[str, torch.Tensor] = {}
    for norm, ln in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
        # LayerNorm(bias=False) is a LayerNorm with a zero bias
        out.setdefault(
            f"{theirs}{ln}.bias",
            _take(weights, f"{ours}{norm}.bias", weights[f"{ours}{norm}.weight"]),
        )
    qkv = [weights[f"{ours}attn.{w}.weight"] for w in ("wq", "wk", "wv")]
    out[f"{theirs}attn.c_attn.weight"] = torch.cat(qkv, dim=0).t()
    out[f"{theirs}attn.c_attn.bias"] = torch.cat(
        [
            _take(weights, f"{ours}attn.{w}.bias", q)
            for w, q in zip(("wq", "wk", "wv"), qkv, strict=True)
        ]
    )
    for conv, linear in GPT2_CONV1D.items():
        w = weights[f"{ours}{linear}.weight"]
        out[f"{theirs}{conv}.weight"] = w.t()
        out[f"{theirs}{conv}.bias"] = _take(weights, f"{ours}{linear}.bias", w)
    layers = [f"{ours}attn.{w}" for w in ("wq", "wk", "wv")] + [
        f"{ours}{m}" for m in GPT2_CONV1D.values()
    ]
    return out, {f"{m}.{p}" for m in layers for p in ("weight", "bias")}


def from_hf_state_dict(
    state: dict[str, torch.Tensor], cfg: TransformerConfig
) -> dict[str, torch.Tensor]:
    """An HF state dict, as the files lay it out (`moe.file_layout`), -> llmtrain weights for
    `cfg` (see `options_from_hf`)."""
    gpt2 = cfg.positions == "learned"
    state = {
        k: v
        for k, v in state.items()
        if not (gpt2 and GPT2_BUFFERS.search(k)) and not ROTARY_BUFFER.search(k)
    }
    if cfg.tied_embeddings:  # HF lists the tied head too: the same tensor as the embedding
        state.pop("lm_head.weight", None)
    back = {theirs: ours for ours, theirs in _names(cfg).items()}
    out = {back[k]: v for k, v in state.items() if k in back}
    used = set(back)
    if gpt2:
        for i in range(cfg.n_layers):
            block, read = _gpt2_block_from_hf(state, cfg, i)
            out.update(block)
            used |= read
    layout = _moe_layout(cfg)
    if layout is not None and moe.is_moe(cfg):
        experts, read = moe.experts_from_hf(state, layout, cfg.n_layers, cfg.n_experts)
        out.update(experts)
        used |= read
    extra = sorted(set(state) - used)
    if extra:
        raise UserError(f"HF weights with no llmtrain counterpart: {extra[:5]}")
    out = _offset_norms(out, cfg, 1.0)
    return {k: v.detach().contiguous() for k, v in out.items()}


def _gpt2_block_from_hf(
    state: dict[str, torch.Tensor], cfg: TransformerConfig, i: int
) -> tuple[dict[str, torch.Tensor], set[str]]:
    """One block's q/k/v and Linear weights from the fused, transposed Conv1D ones, and the HF
    names read."""
    ours, theirs = f"blocks.{i}.", f"transformer.h.{i}."
    out: dict[str, torch.Tensor] = {}
    # torch.split, not Tensor.split: the same call, but the method has no annotations
    q, k, v = torch.split(state[f"{theirs}attn.c_attn.weight"].t(), cfg.d_model, dim=0)
    qb, kb, vb = torch.split(state[f"{theirs}attn.c_attn.bias"], cfg.d_model)
    for name, w, b in (("wq", q, qb), ("wk", k, kb), ("wv", v, vb)):
        out[f"{ours}attn.{name}.weight"], out[f"{ours}attn.{name}.bias"] = w, b
    for conv, linear in GPT2_CONV1D.items():
        out[f"{ours}{linear}.weight"] = state[f"{theirs}{conv}.weight"].t()
        out[f"{ours}{linear}.bias"] = state[f"{theirs}{conv}.bias"]
    convs = ["attn.c_attn", *GPT2_CONV1D]
    return out, {f"{theirs}{c}.{p}" for c in convs for p in ("weight", "bias")}


# --- whole models ----------------------------------------------------------------------------------

# the model kind of options read from a transformers config: every option explicit
DENSE_KIND = "transformer"
MOE_KIND = "moe"


def build_llmtrain(cfg: TransformerConfig) -> Transformer:
    """The llmtrain model of `cfg` on the default device: llmtrain-models' `Transformer`, or
    llmtrain-moe's `MoETransformer` (a subclass) for its options."""
    if moe.is_moe(cfg):
        model: Transformer = moe.build(cfg)
        return model
    return build_model(cfg)


def model_kind(cfg: TransformerConfig) -> str:
    """The model kind (plugin entry) that builds `cfg` from its options alone."""
    return MOE_KIND if moe.is_moe(cfg) else DENSE_KIND


def to_hf_model(
    model: Transformer | dict[str, torch.Tensor],
    options: TransformerConfig | None = None,
    *,
    eos_token_id: int | None = None,
    dtype: torch.dtype = torch.float32,
    architecture: str | None = None,
) -> Any:
    """A transformers model (`architecture`, or the one `architecture_of` picks) with the weights
    of an llmtrain model (a `Transformer`, or its state dict with `options`)."""
    import transformers

    if isinstance(model, Transformer):
        options = options or model.cfg
        weights = model.state_dict()
    else:
        weights = dict(model)
    if options is None:
        raise TypeError("to_hf_model needs `options` (the TransformerConfig) for a state dict")
    arch = architecture_of(options, architecture)
    config = hf_config(options, eos_token_id=eos_token_id, dtype=dtype, architecture=arch)
    state = to_hf_state_dict(weights, options)
    spec = ROPE_FAMILY.get(arch)
    if spec is not None and spec.gemma is not None and spec.gemma.attention_softcap:
        # transformers' SDPA and flash attention drop the soft-capping (4.x picks SDPA)
        config._attn_implementation = "eager"
    hf = getattr(transformers, arch)(config)
    layout = ROPE_FAMILY[arch].moe if arch in ROPE_FAMILY else None
    if layout is not None and moe.is_moe(options):  # transformers 5 fuses experts in memory
        names = set(hf.state_dict())
        state = moe.in_memory_layout(state, layout, options.n_layers, options.n_experts, names)
    _check_names(set(state), set(hf.state_dict()), arch)
    hf.load_state_dict(state, strict=True)
    if options.padded_vocab_size > options.vocab_size:
        # llmtrain never samples the padding ids; neither does transformers' generate then
        hf.generation_config.suppress_tokens = list(
            range(options.vocab_size, options.padded_vocab_size)
        )
    return hf.to(dtype).eval()


def save_hf_model(
    directory: str,
    model: Transformer,
    *,
    eos_token_id: int | None = None,
    dtype: torch.dtype = torch.float32,
    architecture: str | None = None,
) -> None:
    """Write what `to_hf_model(model, ...).save_pretrained(directory)` writes (config.json,
    generation_config.json, model.safetensors) without building the transformers model: its
    modeling code is not imported (`hf export` starts faster) and no second, randomly
    initialised copy of the weights is made (a large model exports in the memory of one)."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    options = model.cfg
    arch = architecture_of(options, architecture)
    config = hf_config(options, eos_token_id=eos_token_id, dtype=dtype, architecture=arch)
    state = to_hf_state_dict(model.state_dict(), options)
    if options.tied_embeddings:
        del state["lm_head.weight"]  # the embedding: save_pretrained leaves tied copies out too
    state = {k: v.to(dtype).contiguous() for k, v in state.items()}
    config.save_pretrained(directory)
    generation = GenerationConfig.from_model_config(config)
    if options.padded_vocab_size > options.vocab_size:
        # llmtrain never samples the padding ids; neither does transformers' generate then
        generation.suppress_tokens = list(range(options.vocab_size, options.padded_vocab_size))
    generation.save_pretrained(directory)
    save_file(state, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})


def from_hf_model(hf_model: PreTrainedModel) -> Transformer:
    """An llmtrain `Transformer` (float32, eval mode; its options are `.cfg`; llmtrain-moe's
    `MoETransformer` for a MoE architecture) with the weights of a transformers model of a
    supported architecture (`ARCHITECTURES`)."""
    cfg = options_from_hf(hf_model.config, where=type(hf_model).__name__)
    arch = source_architecture(hf_model.config)
    if type(hf_model).__name__ != arch:
        raise UnsupportedModelError(
            f"{type(hf_model).__name__} is not supported; llmtrain-hf reads the causal-LM heads "
            f"{', '.join(ARCHITECTURES)}"
        )
    state = hf_model.state_dict()
    layout = ROPE_FAMILY[arch].moe if arch in ROPE_FAMILY else None
    if layout is not None:  # transformers 5 fuses experts in memory
        state = moe.file_layout(state, layout)
    weights = from_hf_state_dict(state, cfg)
    model = build_llmtrain(cfg)
    _check_names(set(weights), set(model.state_dict()), arch)
    model.load_state_dict(weights, strict=True)
    return model.to(torch.float32).eval()
