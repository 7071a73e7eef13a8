"""The MoE decoder's options and presets, and the router statistics callback's options: plain
attrs (no torch), checked before any allocation.

`MoEOptions` is llmtrain-models' `TransformerConfig` (every decoder option, same names and
checks) plus the Mixture-of-Experts options. The MLP options describe one expert: `mlp` is the
experts' activation and `mlp_hidden` their hidden size.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import attrs

from llmtrain.core_mesh.config import ConfigValueError
from llmtrain.models.config import TransformerConfig


def _at_least_one(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value < 1:
        raise ValueError(f"must be at least 1, got {value}")


def _non_negative(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if value < 0:
        raise ValueError(f"must be 0 or more, got {value}")


def _positive_or_none(
    instance: object, attribute: attrs.Attribute[float | None], value: float | None
) -> None:
    if value is not None and value <= 0:
        raise ValueError(f"must be more than 0 (or null for dropless routing), got {value}")


@attrs.frozen(kw_only=True)
class MoEOptions(TransformerConfig):
    # the loss terms, the overflow capacity and the kernel: the same experts either way
    training_only: ClassVar[frozenset[str]] = TransformerConfig.training_only | {
        "aux_loss_weight",
        "router_z_loss",
        "expert_matmul",
        "capacity_factor",
        # how fast the routing bias moves; the bias itself is a tensor of the model (a warm
        # start between 0 and a rate > 0 is refused by its tensors, one model has it)
        "bias_update_rate",
    }

    n_experts: int = attrs.field(default=8, validator=_at_least_one)
    top_k: int = attrs.field(default=2, validator=_at_least_one)
    # None: dropless (every token reaches its top_k experts); a number: each expert takes at most
    # ceil(capacity_factor * seq_len * top_k / n_experts) tokens of a sequence, the rest are dropped
    capacity_factor: float | None = attrs.field(default=None, validator=_positive_or_none)
    aux_loss_weight: float = attrs.field(default=0.01, validator=_non_negative)
    router_z_loss: float = attrs.field(default=0.0, validator=_non_negative)
    # DeepSeek-V3's auxiliary-loss-free balancing: after each optimizer step every expert's
    # routing bias moves by this much towards an even load (0: off, no bias; DeepSeek: 0.001)
    bias_update_rate: float = attrs.field(default=0.0, validator=_non_negative)
    renormalize: bool = True  # top-k weights sum to 1 (false: the router's probabilities, Switch)
    shared_expert: bool = False  # a dense MLP of the experts' shape that every token also takes
    expert_matmul: Literal["auto", "grouped", "loop"] = attrs.field(
        default="auto", validator=attrs.validators.in_(("auto", "grouped", "loop"))
    )

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        # the Mixture-of-Experts block normalises each branch's input and its experts have no
        # biases: options that would ask otherwise are refused, not ignored
        if self.norm_placement != "pre":
            raise ConfigValueError(
                "norm_placement",
                f"the MoE block normalises each branch's input (pre); got {self.norm_placement}",
            )
        if self.mlp == "geglu":
            raise ConfigValueError(
                "mlp", "the experts are swiglu or gelu; geglu is not built for them"
            )
        if self._mlp_bias:
            raise ConfigValueError("mlp_bias", "the experts have no biases; remove it")
        if self.parametrization != "standard":
            # the experts and router are not scaled by µP's rules (nor checked to transfer)
            raise ConfigValueError(
                "parametrization",
                f"{self.parametrization} is not supported for Mixture-of-Experts models yet; "
                "use standard",
            )
        if self.n_experts >= 1 and self.top_k > self.n_experts:
            raise ConfigValueError(
                "top_k", f"must be at most n_experts={self.n_experts}, got {self.top_k}"
            )


_SMALL_DECODER = dict(
    positions="rope",
    norm="rmsnorm",
    mlp="swiglu",
    bias=False,
)

PRESETS: dict[str, dict[str, Any]] = {
    "moe-tiny": dict(
        _SMALL_DECODER,
        vocab_size=256 + 64,
        max_seq_len=256,
        d_model=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        mlp_hidden=64,
        n_experts=4,
        top_k=2,
    ),
    "moe-small": dict(
        _SMALL_DECODER,
        vocab_size=50257,
        max_seq_len=1024,
        d_model=512,
        n_layers=8,
        n_heads=8,
        n_kv_heads=4,
        mlp_hidden=1024,
        n_experts=8,
        top_k=2,
    ),
}

# OLMoE-1B-7B's structure (Muennighoff et al. 2024, arXiv 2409.02060): fine-grained experts (64
# of hidden 1024, top-8), queries and keys RMS-normalised over all heads of the projection
# (OLMo-2's norm, `qk_norm_scope: all_heads`), untied embeddings, the router's top-8
# probabilities used as they are (norm_topk_prob false), the load-balancing and z-losses of
# its paper
_OLMOE = dict(
    _SMALL_DECODER,
    qk_norm=True,
    qk_norm_scope="all_heads",
    tied_embeddings=False,
    renormalize=False,
    aux_loss_weight=0.01,
    router_z_loss=0.001,
)

PRESETS["olmoe-1b-7b"] = dict(
    _OLMOE,
    vocab_size=50304,
    max_seq_len=4096,
    d_model=2048,
    n_layers=16,
    n_heads=16,
    n_kv_heads=16,
    mlp_hidden=1024,
    n_experts=64,
    top_k=8,
)
# the same structure at CPU-test size: many small experts, top-4
PRESETS["olmoe-tiny"] = dict(
    _OLMOE,
    vocab_size=256 + 64,
    max_seq_len=256,
    d_model=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=4,
    mlp_hidden=32,
    n_experts=16,
    top_k=4,
)


def preset_options(name: str, **overrides: Any) -> MoEOptions:
    if name not in PRESETS:
        raise KeyError(f"unknown MoE preset {name!r}; presets: {', '.join(PRESETS)}")
    return MoEOptions(**{**PRESETS[name], **overrides})


@attrs.frozen(kw_only=True)
class RouterStatsOptions:
    """The `moe_router_stats` callback: router statistics on the logged steps that are
    multiples of `every` (null: every logged step)."""

    every: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(_at_least_one)
    )
