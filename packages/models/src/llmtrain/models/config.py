"""The transformer's shape and options: plain attrs config (no torch), checked before any allocation."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar, Literal, TypeVar

import attrs

from llmtrain.core_mesh.config import YAML_KEY, ConfigValueError

# an option's value, for the validators that check one
_Count = TypeVar("_Count", bound=int | None)


def _positive(instance: object, attribute: attrs.Attribute[_Count], value: _Count) -> None:
    if value is not None and value < 1:
        raise ValueError(f"must be at least 1, got {value}")


def _fraction(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not 0.0 <= value < 1.0:
        raise ValueError(f"must be in [0, 1), got {value}")


def _round_up(value: int, multiple: int) -> int:
    return math.ceil(value / multiple) * multiple


def _positive_float(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"must be a positive number, got {value}")


def _above_one(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    # RoPE's wavelengths grow as powers of the base: at 1 or below every pair turns alike
    if not (math.isfinite(value) and value > 1):
        raise ValueError(f"must be a number above 1, got {value}")


def _follows_bias(name: str) -> Any:
    """A per-projection bias switch: `null` (the default) follows `bias`. The attribute is
    private and its YAML key public, so `cfg.<name>` reads the resolved value. (Any, as
    `attrs.field` returns: a placeholder that the class decorator replaces.)"""
    return attrs.field(default=None, metadata={YAML_KEY: name})


@attrs.frozen(kw_only=True)
class RopeScaling:
    """RoPE frequency scaling. `kind: llama3` (`rope_type: llama3` in transformers): frequencies
    whose wavelength exceeds `original_max_seq_len / low_freq_factor` are divided by `factor`,
    those shorter than `original_max_seq_len / high_freq_factor` are kept, and the band between
    is interpolated smoothly; it stretches a model trained at `original_max_seq_len` to longer
    contexts. `kind: linear` (Gemma 3's global blocks): every frequency is divided by `factor`,
    i.e. positions are."""

    kind: Literal["llama3", "linear"] = attrs.field(
        default="llama3", validator=attrs.validators.in_(("llama3", "linear"))
    )
    factor: float = attrs.field(validator=_positive_float)
    low_freq_factor: float = attrs.field(default=1.0, validator=_positive_float)
    high_freq_factor: float = attrs.field(default=4.0, validator=_positive_float)
    # llama3's only
    original_max_seq_len: int | None = attrs.field(default=None, validator=_positive)

    def __attrs_post_init__(self) -> None:
        if self.kind == "llama3" and self.original_max_seq_len is None:
            raise ConfigValueError(
                "original_max_seq_len", "kind llama3 needs the context the model was trained at"
            )
        if self.high_freq_factor <= self.low_freq_factor:
            raise ConfigValueError(
                "high_freq_factor",
                f"must be larger than low_freq_factor ({self.low_freq_factor}), "
                f"got {self.high_freq_factor}",
            )


def _as_tuple(value: Iterable[str]) -> tuple[str, ...]:
    return tuple(value)


def _window_pattern(
    instance: object, attribute: attrs.Attribute[tuple[str, ...]], value: tuple[str, ...]
) -> None:
    if not value or any(kind not in ("local", "global") for kind in value):
        raise ValueError(f"must be a non-empty list of local and global, got {list(value)}")


def _positive_or_none(
    instance: object, attribute: attrs.Attribute[float | None], value: float | None
) -> None:
    if value is not None and not (math.isfinite(value) and value > 0):
        raise ValueError(f"must be a positive number or null, got {value}")


@attrs.frozen(kw_only=True)
class AttentionOptions:
    """What each block's attention sees and how it scores (`model.attention`).

    - `window`: a local block's query attends to the `window` most recent tokens, itself
      included (Mistral's, Qwen2's and Gemma's `sliding_window`); null: every block is global.
    - `pattern`: which blocks are local, repeated over the blocks from the first: `[local]` (the
      default: every block, as Mistral), `[local, global]` (Gemma 2), five locals then a global
      (Gemma 3); a list as long as the model gives each block its own.
    - `local_rope_base`: the RoPE base of local blocks (Gemma 3: 10000); null: `rope_base`.
      RoPE scaling applies to global blocks only when it is set.
    - `softcap`: scores pass through `softcap * tanh(score / softcap)` (Gemma 2: 50).
    - `scale`: the scores' multiplier; null: 1/sqrt(head_dim) (Gemma: query_pre_attn_scalar^-1/2).
    """

    window: int | None = attrs.field(default=None, validator=_positive)
    pattern: tuple[str, ...] = attrs.field(
        default=("local",), converter=_as_tuple, validator=_window_pattern
    )
    local_rope_base: float | None = attrs.field(default=None)
    softcap: float | None = attrs.field(default=None, validator=_positive_or_none)
    scale: float | None = attrs.field(default=None, validator=_positive_or_none)

    def __attrs_post_init__(self) -> None:
        if self.local_rope_base is not None and not (
            math.isfinite(self.local_rope_base) and self.local_rope_base > 1
        ):
            raise ConfigValueError(
                "local_rope_base", f"must be a number above 1, got {self.local_rope_base}"
            )

    def window_of(self, layer: int) -> int | None:
        """The window of block `layer`, None where it attends to the whole context."""
        if self.window is None or self.pattern[layer % len(self.pattern)] == "global":
            return None
        return self.window


def _as_attention(value: AttentionOptions | Mapping[str, Any]) -> AttentionOptions:
    """`attention=` as options or as their fields (Python callers write a dict, as YAML does)."""
    return value if isinstance(value, AttentionOptions) else AttentionOptions(**value)


@attrs.frozen(kw_only=True)
class TransformerConfig:
    # options that shape training, not the function the weights compute: a warm start from
    # weights trained with other values of these is the same model
    training_only: ClassVar[frozenset[str]] = frozenset(
        {"dropout", "doc_masking", "init_std", "scale_residual_init"}
    )

    vocab_size: int = attrs.field(default=50257, validator=_positive)
    pad_vocab_to: int = attrs.field(default=64, validator=_positive)
    max_seq_len: int = attrs.field(default=1024, validator=_positive)
    d_model: int = attrs.field(default=768, validator=_positive)
    n_layers: int = attrs.field(default=12, validator=_positive)
    n_heads: int = attrs.field(default=12, validator=_positive)
    n_kv_heads: int | None = attrs.field(default=None, validator=_positive)
    positions: Literal["learned", "rope"] = attrs.field(
        default="learned", validator=attrs.validators.in_(("learned", "rope"))
    )
    rope_base: float = attrs.field(default=10000.0, validator=_above_one)
    rope_scaling: RopeScaling | None = None
    norm: Literal["layernorm", "rmsnorm"] = attrs.field(
        default="layernorm", validator=attrs.validators.in_(("layernorm", "rmsnorm"))
    )
    norm_eps: float = attrs.field(default=1e-5, validator=_positive_float)
    mlp: Literal["gelu", "swiglu", "geglu"] = attrs.field(
        default="gelu", validator=attrs.validators.in_(("gelu", "swiglu", "geglu"))
    )
    mlp_hidden: int | None = attrs.field(default=None, validator=_positive)
    mlp_multiple_of: int = attrs.field(default=256, validator=_positive)
    norm_placement: Literal["pre", "after_sublayer", "sandwich"] = attrs.field(
        default="pre", validator=attrs.validators.in_(("pre", "after_sublayer", "sandwich"))
    )
    qk_norm: bool = False
    qk_norm_scope: Literal["head", "all_heads"] = attrs.field(
        default="head", validator=attrs.validators.in_(("head", "all_heads"))
    )
    # null: d_model / n_heads; set it when the attention width n_heads x head_dim is not d_model
    _head_dim: int | None = attrs.field(
        default=None, validator=_positive, metadata={YAML_KEY: "head_dim"}
    )
    tied_embeddings: bool = True
    bias: bool = True
    _qkv_bias: bool | None = _follows_bias("qkv_bias")
    _out_bias: bool | None = _follows_bias("out_bias")
    _mlp_bias: bool | None = _follows_bias("mlp_bias")
    dropout: float = attrs.field(default=0.0, validator=_fraction)
    init_std: float = attrs.field(default=0.02, validator=_positive_float)
    scale_residual_init: bool = True
    doc_masking: bool = False
    attention: AttentionOptions = attrs.field(factory=AttentionOptions, converter=_as_attention)
    # Gemma: token embeddings are multiplied by sqrt(d_model) before the first block
    scale_embeddings: bool = False
    # Gemma 2: logits pass through `logit_softcap * tanh(logits / logit_softcap)`
    logit_softcap: float | None = attrs.field(default=None, validator=_positive_or_none)
    # µP (Tensor Programs V): init, output multiplier, attention scale and per-parameter learning
    # rates follow the width multiplier d_model / mup_base_width, so settings tuned at the base
    # width transfer to wider models; at d_model == mup_base_width it is the standard model
    parametrization: Literal["standard", "mup"] = attrs.field(
        default="standard", validator=attrs.validators.in_(("standard", "mup"))
    )
    mup_base_width: int = 256

    def __attrs_post_init__(self) -> None:
        if self._head_dim is None and self.d_model % self.n_heads:
            raise ConfigValueError(
                "n_heads",
                f"must divide d_model={self.d_model}, got {self.n_heads} (or set head_dim)",
            )
        if self.n_heads % self.kv_heads:
            raise ConfigValueError(
                "n_kv_heads", f"must divide n_heads={self.n_heads}, got {self.kv_heads}"
            )
        if self.positions == "rope" and self.head_dim % 2:
            raise ConfigValueError(
                "d_model" if self._head_dim is None else "head_dim",
                f"RoPE needs an even head size; head_dim (d_model / n_heads unless set) = {self.head_dim}",
            )
        if self.rope_scaling is not None and self.positions != "rope":
            raise ConfigValueError("rope_scaling", "scales RoPE; set positions: rope or remove it")
        pattern = self.attention.pattern
        if len(pattern) > self.n_layers:
            raise ConfigValueError(
                ("attention", "pattern"),
                f"has {len(pattern)} entries for {self.n_layers} layers; give at most one a layer",
            )
        if self.attention.window is not None and self.attention.window >= self.max_seq_len:
            raise ConfigValueError(
                ("attention", "window"),
                f"{self.attention.window} covers the whole context (max_seq_len "
                f"{self.max_seq_len}); set it below max_seq_len, or null for global attention",
            )
        if self.attention.local_rope_base is not None and (
            self.positions != "rope" or self.attention.window is None
        ):
            raise ConfigValueError(
                ("attention", "local_rope_base"),
                "is the RoPE base of windowed blocks: it needs positions: rope and "
                "attention.window",
            )
        if self.attention.scale is not None and self.parametrization == "mup":
            raise ConfigValueError(
                ("attention", "scale"), "µP sets the attention scale itself; remove one of them"
            )
        if self.mup_base_width < 1:
            raise ConfigValueError(
                "mup_base_width",
                f"must be a positive width (the d_model at which µP is the standard model), "
                f"got {self.mup_base_width}",
            )

    @property
    def width_multiplier(self) -> float:
        """µP's m = d_model / mup_base_width; 1 under the standard parametrization."""
        if self.parametrization != "mup":
            return 1.0
        return self.d_model / self.mup_base_width

    @property
    def output_multiplier(self) -> float:
        """What the final normed hidden state is multiplied by before the output projection:
        1/m under µP (the logits' multiplier), 1 under standard."""
        return 1.0 / self.width_multiplier

    @property
    def attention_scale(self) -> float | None:
        """The attention scores' scale: under standard `attention.scale` (None: SDPA's
        1/sqrt(head_dim)); under µP
        sqrt(b) / head_dim, b the head size this config has at d_model = mup_base_width. A head
        size derived from d_model widens with it (b = mup_base_width / n_heads) and the scale
        falls as 1/head_dim; an explicit `head_dim` stays put as width grows by adding heads, so
        b = head_dim and the scale is the standard one. Written as 1/sqrt(head_dim * head_dim/b)
        so that at m == 1 it is exactly the float SDPA computes by default."""
        if self.parametrization != "mup":
            return self.attention.scale
        base_head_dim = (
            self._head_dim if self._head_dim is not None else self.mup_base_width / self.n_heads
        )
        return 1.0 / math.sqrt(self.head_dim * (self.head_dim / base_head_dim))

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self._head_dim if self._head_dim is not None else self.d_model // self.n_heads

    @property
    def qkv_bias(self) -> bool:
        return self.bias if self._qkv_bias is None else self._qkv_bias

    @property
    def out_bias(self) -> bool:
        return self.bias if self._out_bias is None else self._out_bias

    @property
    def mlp_bias(self) -> bool:
        return self.bias if self._mlp_bias is None else self._mlp_bias

    @property
    def padded_vocab_size(self) -> int:
        return _round_up(self.vocab_size, self.pad_vocab_to)

    @property
    def hidden_size(self) -> int:
        if self.mlp_hidden is not None:
            return self.mlp_hidden
        if self.mlp == "gelu":
            return 4 * self.d_model
        return _round_up(int(8 * self.d_model / 3), self.mlp_multiple_of)
