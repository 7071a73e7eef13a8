"""transformers' Mixture-of-Experts causal LMs <-> llmtrain-moe's `MoETransformer`: what differs
from the dense RoPE family of `convert` (the attention, norms and RoPE are that family's).

Supported: OlmoeForCausalLM (queries and keys RMS-normalised over all heads), Qwen3MoeForCausalLM
(per head) and MixtralForCausalLM (none). Each computes, per token, a softmax router in float32,
its top-k experts, the top-k probabilities rescaled to sum to 1 or not (`norm_topk_prob`;
Mixtral always rescales), and SwiGLU experts without biases, with no token ever dropped: exactly
llmtrain-moe's dropless routing with `renormalize` = `norm_topk_prob`. Qwen2-MoE is not
supported: its shared expert is scaled by a sigmoid gate of its own, which llmtrain-moe's
shared expert has no weight for.

llmtrain-moe is an optional dependency (the `moe` extra): this module imports it only for these
architectures, so llmtrain-hf installs and converts dense models without it, and llmtrain-moe
does not depend on llmtrain-hf (no cycle).

The expert weights differ in layout only:

- llmtrain-moe stacks them: `blocks.{i}.moe.experts.w1` / `w3` / `w2`, [E, out, in] (each
  expert's `nn.Linear` weight), the router `blocks.{i}.moe.router.weight` [E, d].
- The files (every transformers version's `save_pretrained`, and 4.x models in memory) hold one
  tensor per expert: `model.layers.{i}.mlp.experts.{j}.gate_proj/up_proj/down_proj.weight`
  (Mixtral: `block_sparse_moe.experts.{j}.w1/w3/w2.weight`), the router `mlp.gate.weight`
  (Mixtral: `block_sparse_moe.gate.weight`).
- transformers 5 models in memory fuse them: `model.layers.{i}.mlp.experts.gate_up_proj`
  [E, 2 x hidden, d] (gate rows, then up rows) and `mlp.experts.down_proj` [E, d, hidden], the
  router `mlp.gate.weight` for all three (`in_memory_layout` / `file_layout` convert).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, TypeGuard

import attrs
import torch

from llmtrain.core_mesh.errors import UserError

if TYPE_CHECKING:  # llmtrain-moe is optional: imported where a MoE model is met
    from llmtrain_moe.model import MoETransformer
    from llmtrain_moe.options import MoEOptions

QWEN2_MOE_TYPE = "qwen2_moe"
INSTALL = "pip install llmtrain-moe (or llmtrain-hf[moe])"


@attrs.frozen
class MoELayout:
    """How one transformers MoE architecture names and configures its MoE layers.

    `experts_field` / `hidden_field`: the config fields of the expert count and the experts'
    hidden size; `norm_topk_prob`: the config has that switch (else the top-k weights are always
    rescaled); `head_dim`: the config may set the head size (else d_model / n_heads); `block`:
    the MoE module's name in the files; `expert_names`: each expert's gate, up and down
    projections in the files (llmtrain's w1, w3, w2)."""

    experts_field: str
    hidden_field: str
    norm_topk_prob: bool
    head_dim: bool
    block: str
    expert_names: tuple[str, str, str]


OLMOE_LAYOUT = MoELayout(
    "num_experts", "intermediate_size", True, False, "mlp", ("gate_proj", "up_proj", "down_proj")
)
QWEN3_MOE_LAYOUT = MoELayout(
    "num_experts", "moe_intermediate_size", True, True, "mlp", ("gate_proj", "up_proj", "down_proj")
)
MIXTRAL_LAYOUT = MoELayout(
    "num_local_experts", "intermediate_size", False, True, "block_sparse_moe", ("w1", "w3", "w2")
)
# llmtrain-moe's stacked expert weights, in the order of `MoELayout.expert_names`
STACKED = ("w1", "w3", "w2")


# --- llmtrain-moe, when installed --------------------------------------------------------------


def options_class(where: str) -> type[MoEOptions]:
    """llmtrain-moe's `MoEOptions`; a UserError naming `where` when llmtrain-moe is missing."""
    try:
        from llmtrain_moe.options import MoEOptions
    except ImportError:
        raise UserError(
            f"{where}: a Mixture-of-Experts model needs the plugin llmtrain-moe: {INSTALL}"
        ) from None
    return MoEOptions


def is_moe(cfg: object) -> TypeGuard[MoEOptions]:
    """Whether `cfg` is llmtrain-moe's `MoEOptions` (False when llmtrain-moe is not installed:
    then no model has them)."""
    try:
        from llmtrain_moe.options import MoEOptions
    except ImportError:
        return False
    return isinstance(cfg, MoEOptions)


def build(cfg: MoEOptions) -> MoETransformer:
    """llmtrain-moe's model of `cfg` (a `Transformer` subclass) on the default device."""
    from llmtrain_moe.model import build_model

    return build_model(cfg)


# --- options -----------------------------------------------------------------------------------


def unexpressible(cfg: MoEOptions) -> list[str]:
    """What no supported transformers architecture computes, whatever its layout."""
    problems = []
    if cfg.capacity_factor is not None:
        problems.append(
            f"model.capacity_factor: {cfg.capacity_factor} (transformers' MoE layers are "
            "dropless; this model drops the tokens over capacity)"
        )
    if cfg.shared_expert:
        problems.append(
            "model.shared_expert: true (OLMoE, Qwen3-MoE and Mixtral have no shared expert; "
            "Qwen2-MoE's is gated by a sigmoid llmtrain has no weight for)"
        )
    rate = getattr(cfg, "bias_update_rate", 0.0)
    if rate:
        problems.append(
            f"model.bias_update_rate: {rate} (the routing bias blocks.*.moe.expert_bias chooses "
            "the experts; no transformers MoE architecture has one)"
        )
    return problems


def mismatches(layout: MoELayout, cfg: MoEOptions) -> list[str]:
    """What `layout`'s architecture lacks for `cfg`, beyond its attention (see `convert`)."""
    problems = []
    if not cfg.renormalize and not layout.norm_topk_prob:
        problems.append("model.renormalize: false (it always rescales the top-k weights)")
    if not layout.head_dim and cfg.head_dim * cfg.n_heads != cfg.d_model:
        problems.append(f"model.head_dim: {cfg.head_dim} (needs d_model / n_heads)")
    return problems


def config_fields(layout: MoELayout, cfg: MoEOptions) -> dict[str, object]:
    """The transformers config fields of the MoE layers of `cfg`."""
    fields: dict[str, object] = {
        layout.experts_field: cfg.n_experts,
        layout.hidden_field: cfg.hidden_size,
        "num_experts_per_tok": cfg.top_k,
        # the balance loss transformers adds when asked (`output_router_logits`)
        "router_aux_loss_coef": cfg.aux_loss_weight,
    }
    if layout.norm_topk_prob:
        fields["norm_topk_prob"] = cfg.renormalize
    return fields


def options(layout: MoELayout, config: Any, where: str, dense: dict[str, Any]) -> MoEOptions:
    """llmtrain-moe's options for a transformers MoE config whose decoder options (attention,
    norms, RoPE: `convert`'s) are `dense`; what it cannot compute is refused naming the field."""
    moe_options = options_class(where)
    n_layers = config.num_hidden_layers
    step = getattr(config, "decoder_sparse_step", 1) or 1
    only_mlp = list(getattr(config, "mlp_only_layers", None) or [])
    dense_layers = [i for i in range(n_layers) if i in only_mlp or (i + 1) % step]
    if dense_layers:
        raise UserError(
            f"{where}: layers {dense_layers} are dense MLPs (decoder_sparse_step {step}, "
            f"mlp_only_layers {only_mlp}); llmtrain-moe makes every block a MoE layer"
        )
    if getattr(config, "clip_qkv", None) is not None:
        raise UserError(
            f"{where}: clip_qkv {config.clip_qkv}: llmtrain does not clip queries, keys and values"
        )
    head_dim = getattr(config, "head_dim", None)
    if (
        not layout.head_dim
        and head_dim
        and head_dim * config.num_attention_heads != dense["d_model"]
    ):
        raise UserError(
            f"{where}: head_dim {head_dim}: this architecture's query/key norms take "
            "hidden_size / num_attention_heads"
        )
    renormalize = bool(config.norm_topk_prob) if layout.norm_topk_prob else True
    return moe_options(
        **{
            **dense,
            "mlp_hidden": getattr(config, layout.hidden_field),
            "n_experts": getattr(config, layout.experts_field),
            "top_k": config.num_experts_per_tok,
            "renormalize": renormalize,
            "capacity_factor": None,  # transformers never drops a token
            "aux_loss_weight": float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0),
            "router_z_loss": 0.0,
            "shared_expert": False,
        }
    )


# --- weights -----------------------------------------------------------------------------------


def router_names(layout: MoELayout) -> dict[str, str]:
    """llmtrain name -> name in the files of the router (`{i}`: the layer)."""
    return {"blocks.{i}.moe.router.weight": f"model.layers.{{i}}.{layout.block}.gate.weight"}


def _expert_file_name(layout: MoELayout, i: int, j: int, w: str) -> str:
    return f"model.layers.{i}.{layout.block}.experts.{j}.{w}.weight"


def experts_to_hf(
    weights: dict[str, torch.Tensor], layout: MoELayout, n_layers: int
) -> tuple[dict[str, torch.Tensor], set[str]]:
    """Each layer's stacked experts as one tensor per expert, named as in the files, and the
    llmtrain names read. The experts are copies: safetensors refuses views of one tensor."""
    out: dict[str, torch.Tensor] = {}
    read = set()
    for i in range(n_layers):
        for ours, theirs in zip(STACKED, layout.expert_names, strict=True):
            name = f"blocks.{i}.moe.experts.{ours}"
            for j, w in enumerate(weights[name].detach()):
                out[_expert_file_name(layout, i, j, theirs)] = w.clone()
            read.add(name)
    return out, read


def experts_from_hf(
    state: dict[str, torch.Tensor], layout: MoELayout, n_layers: int, n_experts: int
) -> tuple[dict[str, torch.Tensor], set[str]]:
    """Each layer's experts stacked as llmtrain-moe holds them, and the HF names read (all of
    them must be there: `convert` checks the names first)."""
    out: dict[str, torch.Tensor] = {}
    read = set()
    for i in range(n_layers):
        for ours, theirs in zip(STACKED, layout.expert_names, strict=True):
            names = [_expert_file_name(layout, i, j, theirs) for j in range(n_experts)]
            missing = [n for n in names if n not in state]
            if missing:
                raise UserError(f"HF weights lack the experts {missing[:5]}")
            out[f"blocks.{i}.moe.experts.{ours}"] = torch.stack([state[n] for n in names])
            read.update(names)
    return out, read


# transformers 5's fused experts and router of a model in memory
FUSED = re.compile(
    r"^model\.layers\.(\d+)\.mlp\.(experts\.gate_up_proj|experts\.down_proj|gate\.weight)$"
)


def is_fused(names: set[str]) -> bool:
    """Whether the state dict names are transformers 5's fused in-memory experts."""
    return any(name.endswith(".mlp.experts.gate_up_proj") for name in names)


def file_layout(state: dict[str, torch.Tensor], layout: MoELayout) -> dict[str, torch.Tensor]:
    """A state dict with the experts (and router) as the files name them, from one in either
    layout (transformers 5 fuses them in memory)."""
    if not is_fused(set(state)):
        return state
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        match = FUSED.match(name)
        if match is None:
            out[name] = tensor
            continue
        i, what = int(match.group(1)), match.group(2)
        gate, up, down = layout.expert_names
        if what == "gate.weight":
            out[f"model.layers.{i}.{layout.block}.gate.weight"] = tensor
        elif what == "experts.down_proj":
            for j, w in enumerate(tensor):
                out[_expert_file_name(layout, i, j, down)] = w
        else:
            for j, w in enumerate(tensor):
                g, u = w.chunk(2, dim=0)
                out[_expert_file_name(layout, i, j, gate)] = g
                out[_expert_file_name(layout, i, j, up)] = u
    return out


def in_memory_layout(
    state: dict[str, torch.Tensor],
    layout: MoELayout,
    n_layers: int,
    n_experts: int,
    names: set[str],
) -> dict[str, torch.Tensor]:
    """A state dict in the files' layout as a transformers model whose state dict has `names`
    holds it: unchanged for 4.x, the experts fused (and the router under `mlp.`) for 5.x."""
    if not is_fused(names):
        return state
    out = dict(state)
    gate, up, down = layout.expert_names
    for i in range(n_layers):
        parts = {
            w: torch.stack([out.pop(_expert_file_name(layout, i, j, w)) for j in range(n_experts)])
            for w in (gate, up, down)
        }
        prefix = f"model.layers.{i}.mlp."
        out[prefix + "experts.gate_up_proj"] = torch.cat([parts[gate], parts[up]], dim=1)
        out[prefix + "experts.down_proj"] = parts[down]
        out[prefix + "gate.weight"] = out.pop(f"model.layers.{i}.{layout.block}.gate.weight")
    return out
