"""llmtrain's transformer <-> transformers' LlamaForCausalLM and GPT2LMHeadModel: configs and weights.

Which architecture a `TransformerConfig` becomes is decided by its layout: RoPE + RMSNorm + SwiGLU
is Llama, learned positions + LayerNorm + GELU is GPT-2; anything else has no exact equivalent and
is refused, naming the option. The weight layouts differ in these ways, all handled here:

- RoPE: llmtrain rotates the pairs (x[i], x[i + head_dim/2]) with frequencies
  base^(-2i/head_dim), which is exactly HF Llama's `rotate_half`: q/k rows need no permutation
  (the Meta -> HF conversion permutes because Meta's code rotates interleaved pairs).
- GPT-2 fuses q, k, v into one `c_attn` and stores every projection as a `Conv1D`, whose weight
  is (in, out): the transpose of an `nn.Linear` weight.
- GPT-2's MLP uses the tanh approximation of GELU (`gelu_new`), as llmtrain's does.
- GPT-2 always has biases: a llmtrain model without them exports zeros (the same function).
- Padded vocabularies export their padded size: HF's `vocab_size` is the embedding's row count;
  the generation config suppresses the padding ids, which llmtrain never samples either.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from llmtrain.core_mesh.errors import UserError
from llmtrain.models.config import TransformerConfig
from llmtrain.models.transformer import Transformer, build_model

LLAMA = "LlamaForCausalLM"
GPT2 = "GPT2LMHeadModel"
ARCHITECTURES = (LLAMA, GPT2)
# the layout (positions, norm, mlp) of each architecture
LAYOUTS = {
    LLAMA: {"positions": "rope", "norm": "rmsnorm", "mlp": "swiglu"},
    GPT2: {"positions": "learned", "norm": "layernorm", "mlp": "gelu"},
}
# HF activations that are llmtrain's GELU (torch's tanh approximation) up to float rounding
GPT2_GELUS = ("gelu_new", "gelu_pytorch_tanh")


class UnsupportedModelError(UserError):
    """A model with no exact counterpart on the other side, naming the option that prevents it."""


# --- configs ---------------------------------------------------------------------------------------


def architecture_of(cfg: TransformerConfig) -> str:
    """LLAMA or GPT2 for a config that has an exact transformers equivalent; else a UserError."""
    if type(cfg) is not TransformerConfig:
        raise UnsupportedModelError(
            f"model options of type {type(cfg).__name__} are not llmtrain's TransformerConfig; "
            "hf export handles the built-in transformer kinds (tiny, gpt2-*, llama-*, transformer)"
        )
    if cfg.qk_norm:
        raise UnsupportedModelError(
            "model.qk_norm: true has no equivalent in LlamaForCausalLM or GPT2LMHeadModel (they "
            "do not normalise queries and keys per head); only models trained with qk_norm: false "
            "can be exported"
        )
    target = LLAMA if cfg.positions == "rope" else GPT2
    wrong = [
        f"model.{key}: {getattr(cfg, key)}"
        for key, value in LAYOUTS[target].items()
        if getattr(cfg, key) != value
    ]
    if wrong:
        need = ", ".join(f"{k}: {v}" for k, v in LAYOUTS[target].items())
        raise UnsupportedModelError(
            f"{'; '.join(wrong)} has no equivalent in {target} (positions: {cfg.positions} "
            f"exports as {target}, which needs {need})"
        )
    if target == GPT2 and cfg.kv_heads != cfg.n_heads:
        raise UnsupportedModelError(
            f"model.n_kv_heads: {cfg.n_kv_heads} (grouped-query attention) has no equivalent in "
            f"GPT2LMHeadModel, which has n_heads ({cfg.n_heads}) key/value heads"
        )
    return target


def hf_config(
    cfg: TransformerConfig,
    *,
    eos_token_id: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> Any:
    """The transformers config (LlamaConfig or GPT2Config) of an llmtrain model config."""
    from transformers import GPT2Config, LlamaConfig

    common = dict(
        vocab_size=cfg.padded_vocab_size,
        tie_word_embeddings=cfg.tied_embeddings,
        initializer_range=cfg.init_std,
        bos_token_id=None,
        eos_token_id=eos_token_id,
        pad_token_id=None,
        architectures=[architecture_of(cfg)],
    )
    if architecture_of(cfg) == LLAMA:
        config = LlamaConfig(
            hidden_size=cfg.d_model,
            intermediate_size=cfg.hidden_size,
            num_hidden_layers=cfg.n_layers,
            num_attention_heads=cfg.n_heads,
            num_key_value_heads=cfg.kv_heads,
            head_dim=cfg.head_dim,
            hidden_act="silu",
            max_position_embeddings=cfg.max_seq_len,
            rms_norm_eps=cfg.norm_eps,
            rope_theta=cfg.rope_base,
            attention_bias=cfg.bias,
            mlp_bias=cfg.bias,
            attention_dropout=cfg.dropout,
            **common,
        )
    else:
        config = GPT2Config(
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
    config.dtype = dtype
    return config


def _rope(config: Any) -> tuple[float, str]:
    """(theta, rope type) of a LlamaConfig: transformers 5 keeps them in `rope_parameters`,
    4.x in `rope_theta` and `rope_scaling`."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    scaling = getattr(config, "rope_scaling", None) or {}
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    return float(theta), kind


def _refuse(where: str, what: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"{where}: {what}")


def options_from_hf(config: Any, where: str = "config.json") -> TransformerConfig:
    """The llmtrain model options equivalent to a LlamaConfig or GPT2Config; refuses the rest."""
    model_type = getattr(config, "model_type", None)
    archs = list(getattr(config, "architectures", None) or [])
    other = [a for a in archs if a not in ARCHITECTURES]
    if model_type not in ("llama", "gpt2") or other:
        named = f"{model_type!r}" + (f" ({', '.join(archs)})" if archs else "")
        raise _refuse(
            where,
            f"model_type {named} is not supported; hf import reads {LLAMA} (model_type llama) "
            f"and {GPT2} (model_type gpt2)",
        )
    common = dict(
        vocab_size=config.vocab_size,
        pad_vocab_to=1,  # the table is as large as HF's: pad nothing further
        tied_embeddings=bool(config.tie_word_embeddings),
        init_std=float(config.initializer_range),
        dropout=0.0,
        qk_norm=False,
        doc_masking=False,
    )
    if model_type == "llama":
        if config.hidden_act != "silu":
            raise _refuse(where, f"hidden_act {config.hidden_act!r}: llmtrain's SwiGLU uses silu")
        head_dim = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        if head_dim * config.num_attention_heads != config.hidden_size:
            raise _refuse(
                where,
                f"head_dim {head_dim} x num_attention_heads {config.num_attention_heads} != "
                f"hidden_size {config.hidden_size}; llmtrain's head size is d_model / n_heads",
            )
        theta, rope_type = _rope(config)
        if rope_type != "default":
            raise _refuse(
                where,
                f"rope_type {rope_type!r} (RoPE frequency scaling) has no llmtrain equivalent; "
                "llmtrain's RoPE is the default one (rope_theta only)",
            )
        if bool(config.attention_bias) != bool(getattr(config, "mlp_bias", False)):
            raise _refuse(
                where,
                f"attention_bias {config.attention_bias} with mlp_bias {config.mlp_bias}: "
                "llmtrain's `bias` option covers attention and MLP together",
            )
        return TransformerConfig(
            max_seq_len=config.max_position_embeddings,
            d_model=config.hidden_size,
            n_layers=config.num_hidden_layers,
            n_heads=config.num_attention_heads,
            n_kv_heads=config.num_key_value_heads or config.num_attention_heads,
            positions="rope",
            rope_base=theta,
            norm="rmsnorm",
            norm_eps=float(config.rms_norm_eps),
            mlp="swiglu",
            mlp_hidden=config.intermediate_size,
            bias=bool(config.attention_bias),
            **common,
        )
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
        **common,
    )


# --- weights ---------------------------------------------------------------------------------------

# llmtrain name -> HF name; `{i}` is the layer index. GPT-2's attention and Conv1D layers are
# not renames and are handled in `_gpt2_block_to_hf` / `_gpt2_block_from_hf`.
LLAMA_NAMES = {
    "tok_emb.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "head.weight": "lm_head.weight",
    "blocks.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blocks.{i}.mlp_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
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


def _layered(names: dict[str, str], n_layers: int) -> dict[str, str]:
    out = {}
    for ours, theirs in names.items():
        if "{i}" in ours:
            out.update({ours.format(i=i): theirs.format(i=i) for i in range(n_layers)})
        else:
            out[ours] = theirs
    return out


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
    """llmtrain weights (module names) -> the HF state dict of `architecture_of(cfg)`."""
    weights = {k: v for k, v in weights.items() if not k.endswith(("rope_cos", "rope_sin"))}
    arch = architecture_of(cfg)
    names = _layered(LLAMA_NAMES if arch == LLAMA else GPT2_NAMES, cfg.n_layers)
    out = {names[k]: v for k, v in weights.items() if k in names}
    used = set(names)
    if arch == GPT2:
        for i in range(cfg.n_layers):
            block, read = _gpt2_block_to_hf(weights, i)
            out.update(block)
            used |= read
        out.setdefault("transformer.ln_f.bias", torch.zeros_like(weights["norm.weight"]))
    if cfg.tied_embeddings:
        out["lm_head.weight"] = weights["tok_emb.weight"]
    unused = sorted(set(weights) - used)
    if unused:
        raise UserError(f"no {arch} weight for the llmtrain tensors {unused[:5]}")
    return {k: v.detach().contiguous() for k, v in out.items()}


def _gpt2_block_to_hf(weights, i: int) -> tuple[dict[str, torch.Tensor], set[str]]:
    """One block's fused attention and Conv1D weights (and zero biases where llmtrain has none),
    and the llmtrain names read."""
    ours, theirs = f"blocks.{i}.", f"transformer.h.{i}."
    out = {}
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
    """An HF Llama/GPT-2 state dict -> llmtrain weights for `cfg` (see `options_from_hf`)."""
    arch = architecture_of(cfg)
    state = {k: v for k, v in state.items() if not (arch == GPT2 and GPT2_BUFFERS.search(k))}
    if cfg.tied_embeddings:  # HF lists the tied head too: the same tensor as the embedding
        state.pop("lm_head.weight", None)
    names = _layered(LLAMA_NAMES if arch == LLAMA else GPT2_NAMES, cfg.n_layers)
    back = {theirs: ours for ours, theirs in names.items()}
    out = {back[k]: v for k, v in state.items() if k in back}
    used = set(back)
    if arch == GPT2:
        for i in range(cfg.n_layers):
            block, read = _gpt2_block_from_hf(state, cfg, i)
            out.update(block)
            used |= read
    extra = sorted(set(state) - used)
    if extra:
        raise UserError(f"HF weights with no llmtrain counterpart: {extra[:5]}")
    return {k: v.detach().contiguous() for k, v in out.items()}


def _gpt2_block_from_hf(state, cfg: TransformerConfig, i: int):
    """One block's q/k/v and Linear weights from the fused, transposed Conv1D ones, and the HF
    names read."""
    ours, theirs = f"blocks.{i}.", f"transformer.h.{i}."
    out = {}
    q, k, v = state[f"{theirs}attn.c_attn.weight"].t().split(cfg.d_model, dim=0)
    qb, kb, vb = state[f"{theirs}attn.c_attn.bias"].split(cfg.d_model)
    for name, w, b in (("wq", q, qb), ("wk", k, kb), ("wv", v, vb)):
        out[f"{ours}attn.{name}.weight"], out[f"{ours}attn.{name}.bias"] = w, b
    for conv, linear in GPT2_CONV1D.items():
        out[f"{ours}{linear}.weight"] = state[f"{theirs}{conv}.weight"].t()
        out[f"{ours}{linear}.bias"] = state[f"{theirs}{conv}.bias"]
    convs = ["attn.c_attn", *GPT2_CONV1D]
    return out, {f"{theirs}{c}.{p}" for c in convs for p in ("weight", "bias")}


# --- whole models ----------------------------------------------------------------------------------


def to_hf_model(
    model: Transformer | dict[str, torch.Tensor],
    options: TransformerConfig | None = None,
    *,
    eos_token_id: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> Any:
    """A transformers LlamaForCausalLM / GPT2LMHeadModel with the weights of an llmtrain model
    (a `Transformer`, or its state dict with `options`)."""
    from transformers import GPT2LMHeadModel, LlamaForCausalLM

    if isinstance(model, Transformer):
        options = options or model.cfg
        weights = model.state_dict()
    else:
        weights = dict(model)
    if options is None:
        raise TypeError("to_hf_model needs `options` (the TransformerConfig) for a state dict")
    config = hf_config(options, eos_token_id=eos_token_id, dtype=dtype)
    state = to_hf_state_dict(weights, options)
    hf = (LlamaForCausalLM if architecture_of(options) == LLAMA else GPT2LMHeadModel)(config)
    _check_names(set(state), set(hf.state_dict()), architecture_of(options))
    hf.load_state_dict(state, strict=True)
    if options.padded_vocab_size > options.vocab_size:
        # llmtrain never samples the padding ids; neither does transformers' generate then
        hf.generation_config.suppress_tokens = list(
            range(options.vocab_size, options.padded_vocab_size)
        )
    return hf.to(dtype).eval()


def from_hf_model(hf_model: Any) -> Transformer:
    """An llmtrain `Transformer` (float32, eval mode; its options are `.cfg`) with the weights of
    a transformers LlamaForCausalLM or GPT2LMHeadModel."""
    cfg = options_from_hf(hf_model.config, where=type(hf_model).__name__)
    arch = architecture_of(cfg)
    if type(hf_model).__name__ != arch:
        raise UnsupportedModelError(
            f"{type(hf_model).__name__} is not supported; hf import reads {LLAMA} and {GPT2}"
        )
    weights = from_hf_state_dict(hf_model.state_dict(), cfg)
    model = build_model(cfg)
    _check_names(set(weights), set(model.state_dict()), arch)
    model.load_state_dict(weights, strict=True)
    return model.to(torch.float32).eval()
