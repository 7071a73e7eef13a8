"""The transformer's shape and options: plain attrs config (no torch), checked before any allocation."""

from __future__ import annotations

import math
from typing import ClassVar, Literal

import attrs

from llmtrain.core_mesh.config import ConfigValueError


def _positive(instance: object, attribute: attrs.Attribute, value: int | None) -> None:
    if value is not None and value < 1:
        raise ValueError(f"must be at least 1, got {value}")


def _fraction(instance: object, attribute: attrs.Attribute, value: float) -> None:
    if not 0.0 <= value < 1.0:
        raise ValueError(f"must be in [0, 1), got {value}")


def _round_up(value: int, multiple: int) -> int:
    return math.ceil(value / multiple) * multiple


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
    rope_base: float = 10000.0
    norm: Literal["layernorm", "rmsnorm"] = attrs.field(
        default="layernorm", validator=attrs.validators.in_(("layernorm", "rmsnorm"))
    )
    norm_eps: float = 1e-5
    mlp: Literal["gelu", "swiglu"] = attrs.field(
        default="gelu", validator=attrs.validators.in_(("gelu", "swiglu"))
    )
    mlp_hidden: int | None = attrs.field(default=None, validator=_positive)
    mlp_multiple_of: int = attrs.field(default=256, validator=_positive)
    qk_norm: bool = False
    tied_embeddings: bool = True
    bias: bool = True
    dropout: float = attrs.field(default=0.0, validator=_fraction)
    init_std: float = 0.02
    scale_residual_init: bool = True
    doc_masking: bool = False

    def __attrs_post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ConfigValueError(
                "n_heads", f"must divide d_model={self.d_model}, got {self.n_heads}"
            )
        if self.n_heads % self.kv_heads:
            raise ConfigValueError(
                "n_kv_heads", f"must divide n_heads={self.n_heads}, got {self.kv_heads}"
            )
        if self.positions == "rope" and self.head_dim % 2:
            raise ConfigValueError(
                "d_model",
                f"RoPE needs an even head size; d_model/n_heads = {self.head_dim}",
            )

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

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
