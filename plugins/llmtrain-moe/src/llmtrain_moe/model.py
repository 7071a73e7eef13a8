"""A decoder-only Mixture-of-Experts transformer: llmtrain-models' attention, norms and rotary
positions, with each block's MLP replaced by a routed set of experts.

Read top to bottom: the MoE layer (router, experts, optional shared expert, router statistics,
auxiliary losses), the block, the model. The model has the dense model's interface, its
`forward` and KV cache included: `forward` (logits; hidden states on pipeline stages),
`init_weights`, `describe`, `trim_to_stage`, and core-mesh's `LanguageModel` (`options`,
`packed_rows`, `new_cache`), so generate, eval, downstream scoring and lm-eval take it.

After every forward each MoE layer holds its router statistics (`MoE.stats`, tensors, no host
sync); `MoETransformer.router_stats()` turns them into numbers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from llmtrain.models.config import TransformerConfig
from llmtrain.models.transformer import (
    Attention,
    LayerCache,
    Mask,
    Rope,
    Transformer,
    make_norm,
    splits_across_tp_ranks,
)
from llmtrain_moe.experts import Experts, SharedExpert, StackedExperts, expert_counts, local
from llmtrain_moe.options import MoEOptions
from llmtrain_moe.routing import (
    Routing,
    add_aux_loss,
    balance_loss,
    bias_update,
    expert_capacity,
    expert_load,
    route,
    router_z_loss,
)

try:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    _DTENSOR: type[DTensor] | None = DTensor
except ImportError:  # a torch build without distributed support
    _DTENSOR = None


class RouterStats(NamedTuple):
    """One MoE layer's routing in its last forward (this rank's tokens)."""

    load: torch.Tensor  # (E,) fraction of the (token, choice) pairs each expert was chosen for
    dropped: torch.Tensor  # () pairs over capacity, not computed (0 when dropless)
    assignments: int  # (token, choice) pairs: tokens x top_k
    balance_loss: torch.Tensor  # () the unweighted load-balancing loss (1 = balanced)
    z_loss: torch.Tensor  # () the unweighted router z-loss


class MoE(nn.Module):
    """Router + experts (+ a shared expert) in place of a block's MLP."""

    # with `bias_update_rate` > 0 only (standard models' state dicts stay as they were):
    # the routing bias (E,) float32, model state (checkpointed), and the choices each expert got
    # in the training forwards since the last optimizer step (E,) int64, not state
    expert_bias: torch.Tensor | None
    expert_choices: torch.Tensor | None

    def __init__(self, cfg: MoEOptions):
        super().__init__()
        self.cfg = cfg
        self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        self.experts = Experts(
            cfg.n_experts,
            cfg.d_model,
            cfg.hidden_size,
            gated=cfg.mlp == "swiglu",
            matmul=cfg.expert_matmul,
        )
        self.shared = (
            SharedExpert(cfg.d_model, cfg.hidden_size, gated=cfg.mlp == "swiglu")
            if cfg.shared_expert
            else None
        )
        # True: the weighted auxiliary loss reaches the gradients through the output (the
        # trainer never sees it). False: it is left in `aux_loss` for the caller to add.
        self.inject_aux_loss = True
        self.aux_loss: torch.Tensor | None = None
        self.stats: RouterStats | None = None
        if cfg.bias_update_rate > 0:
            self.register_buffer("expert_bias", torch.zeros(cfg.n_experts))
            self.register_buffer(
                "expert_choices", torch.zeros(cfg.n_experts, dtype=torch.long), persistent=False
            )
        else:
            self.expert_bias = self.expert_choices = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _DTENSOR is not None and isinstance(x, _DTENSOR):
            return self._forward_sequence_shards(x)
        B, T, d = x.shape
        cfg = self.cfg
        # the modules holding parameters are never called: under tensor parallelism their
        # replicating style's forward hooks would take inputs for sequence shards
        logits = F.linear(x.float(), local(self.router.weight).float())  # routing in float32
        capacity = None
        if cfg.capacity_factor is not None:
            capacity = expert_capacity(T, cfg.n_experts, cfg.top_k, cfg.capacity_factor)
        routing = route(
            logits,
            cfg.top_k,
            renormalize=cfg.renormalize,
            capacity=capacity,
            bias=self.expert_bias,
        )
        if self.expert_choices is not None and self.training and torch.is_grad_enabled():
            # activation checkpointing runs this forward again in the backward and counts every
            # choice twice: the same factor for every expert, which the update's sign ignores
            self.expert_choices.add_(expert_counts(routing.experts.reshape(-1), cfg.n_experts))
        keep = routing.keep.reshape(B * T, -1) if routing.keep is not None else None
        y = self.experts.routed(
            x.reshape(B * T, d),
            routing.experts.reshape(B * T, -1),
            routing.weights.reshape(B * T, -1),
            keep,
        ).view(B, T, d)
        if self.shared is not None:
            y = y + self.shared.dense(x)
        balance, z = balance_loss(routing.probs, routing.experts), router_z_loss(logits)
        self._record(routing, balance, z)
        aux = self._weighted_aux(balance, z)
        if aux is not None and self.inject_aux_loss:
            if self.training and torch.is_grad_enabled():
                y = add_aux_loss(y, aux)
            aux = aux.detach()
        self.aux_loss = aux
        return y

    @torch.no_grad()
    def after_optimizer_step(
        self, sum_over_ranks: Callable[[torch.Tensor], torch.Tensor], /
    ) -> None:
        """core-mesh's `AfterOptimizerStep`, called by the parallel strategy after each optimizer
        step: the routing bias moves by `bias_update_rate` towards an even load, judged on the
        step's choices of every rank that saw different tokens, and the count restarts. Defined
        on the layer only (the strategy calls every module that has it)."""
        if self.expert_bias is None or self.expert_choices is None:
            return
        counts = sum_over_ranks(self.expert_choices)
        self.expert_bias.add_(bias_update(counts, self.cfg.bias_update_rate))
        self.expert_choices.zero_()

    def _weighted_aux(self, balance: torch.Tensor, z: torch.Tensor) -> torch.Tensor | None:
        terms = [(self.cfg.aux_loss_weight, balance), (self.cfg.router_z_loss, z)]
        weighted = [w * loss for w, loss in terms if w > 0]
        return sum(weighted[1:], weighted[0]) if weighted else None

    @torch.no_grad()
    def _record(self, routing: Routing, balance: torch.Tensor, z: torch.Tensor) -> None:
        experts = routing.experts
        load = expert_load(experts.reshape(1, -1, experts.size(-1)), self.cfg.n_experts)[0]
        if routing.keep is None:
            dropped = torch.zeros((), dtype=torch.long, device=experts.device)
        else:
            dropped = (~routing.keep).sum()
        self.stats = RouterStats(load, dropped, experts.numel(), balance.detach(), z.detach())

    def _forward_sequence_shards(self, x: DTensor) -> torch.Tensor:
        """Tensor parallelism with sequence parallelism hands this layer sequence shards (the
        norm before it is sharded): gather the sequences, route them whole on every rank (the
        experts are replicated over tp), return this rank's shard."""
        if tuple(x.placements) != (Shard(1),):
            raise ValueError(
                f"the MoE layer takes sequence shards (Shard(1)) under tensor parallelism, "
                f"got {x.placements}"
            )
        mesh = x.device_mesh
        y = self.forward(x.redistribute(mesh, (Replicate(),)).to_local())
        y = DTensor.from_local(y, mesh, (Replicate(),), run_check=False)
        return y.redistribute(mesh, (Shard(1),)).to_local()


class Block(nn.Module):
    def __init__(self, cfg: MoEOptions):
        super().__init__()
        self.attn_norm = make_norm(cfg, cfg.d_model)
        self.attn = Attention(cfg)
        self.moe_norm = make_norm(cfg, cfg.d_model)
        self.moe = MoE(cfg)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(
        self,
        x: torch.Tensor,
        rope: Rope | None = None,
        mask: Mask = None,
        cache: LayerCache | None = None,
        start_pos: int = 0,
    ) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), rope, mask, cache, start_pos)
        out: torch.Tensor = x + self.dropout(self.moe(self.moe_norm(x)))
        return out


class MoETransformer(Transformer):
    """llmtrain-models' decoder with Mixture-of-Experts blocks: embeddings, positions, masks,
    the KV cache, pipeline trimming and the description come from `Transformer`."""

    cfg: MoEOptions  # `build_model` passes MoEOptions; `make_block` refuses anything else

    def make_block(self, cfg: TransformerConfig) -> Block:
        if not isinstance(cfg, MoEOptions):
            raise TypeError(f"MoETransformer takes MoEOptions, not {type(cfg).__name__}")
        return Block(cfg)

    # --- the MoE layers ---
    def moe_layers(self) -> dict[str, MoE]:
        """Layer index -> its MoE layer (the blocks this model or pipeline stage holds)."""
        layers: dict[str, MoE] = {}
        for name, block in self.blocks.items():
            moe = block.moe  # also through a wrapper that forwards attributes
            if not isinstance(moe, MoE):
                raise TypeError(f"block {name} holds no MoE layer")
            layers[name] = moe
        return layers

    def router_stats(self) -> dict[str, dict[str, Any]]:
        """Per layer index, the routing of the last forward on this rank: `load` (fraction of
        the token choices each expert got; 1/n_experts each when balanced), `dropped` and
        `assignments` (token choices over capacity, and all of them), `balance_loss` (1 when
        balanced) and `z_loss`. Reading it waits for the device."""
        out: dict[str, dict[str, Any]] = {}
        for name, moe in self.moe_layers().items():
            if moe.stats is None:
                continue
            s = moe.stats
            out[name] = {
                "load": s.load.tolist(),
                "dropped": int(s.dropped),
                "assignments": s.assignments,
                "balance_loss": float(s.balance_loss),
                "z_loss": float(s.z_loss),
            }
        return out

    def inject_aux_loss(self, enabled: bool, /) -> None:
        """True (the default): the auxiliary losses reach the gradients by themselves. False:
        training loops add `aux_loss()` to their loss instead."""
        for moe in self.moe_layers().values():
            moe.inject_aux_loss = enabled

    def aux_loss(self) -> torch.Tensor:
        """The weighted auxiliary losses of the last forward, summed over layers (with their
        graph when injection is off)."""
        layers = self.moe_layers().values()
        losses = [m.aux_loss for m in layers if m.aux_loss is not None]
        device = next(iter(layers)).router.weight.device
        return sum(losses, torch.zeros((), device=device))

    # --- weights and description ---
    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """Initialise every parameter and buffer; also right after `to_empty` from meta: the
        dense parts as `Transformer` does, then the stacked expert weights."""
        super().init_weights(generator)
        cfg = self.cfg
        std = cfg.init_std
        residual_std = std / math.sqrt(2 * cfg.n_layers) if cfg.scale_residual_init else std
        for module in self.modules():
            if isinstance(module, StackedExperts):
                for w in (module.w1, module.w3):
                    if w is not None:
                        nn.init.normal_(w, std=std, generator=generator)
                nn.init.normal_(module.w2, std=residual_std, generator=generator)
            elif isinstance(module, MoE):
                for buffer in (module.expert_bias, module.expert_choices):
                    if buffer is not None:
                        buffer.zero_()

    def inactive_params(self) -> int:
        """Expert parameters a token does not use: (n_experts - top_k) experts per layer."""
        idle = self.cfg.n_experts - self.cfg.top_k
        return sum(m.experts.expert_params() * idle for m in self.moe_layers().values())

    def tp_plan(self) -> dict[str, str]:
        """Tensor parallelism shards attention and the embeddings; the MoE layers (router,
        experts, shared expert) are replicated over tp and route whole sequences on every rank."""
        if not splits_across_tp_ranks(self.cfg):
            return {}
        plan = {
            "tok_emb": "embedding",
            "norm": "sequence_parallel",
            "blocks.*.attn_norm": "sequence_parallel",
            "blocks.*.attn": "gather_input",
            "blocks.*.attn.wq": "colwise",
            "blocks.*.attn.wk": "colwise",
            "blocks.*.attn.wv": "colwise",
            "blocks.*.attn.wo": "rowwise",
            "blocks.*.moe_norm": "sequence_parallel",
            # replicated over tp (as DTensors, so optimizers and clipping see one kind of
            # parameter); only with sequence parallelism, like the norms
            "blocks.*.moe.router": "sequence_parallel",
            "blocks.*.moe.experts": "sequence_parallel",
        }
        if self.cfg.shared_expert:
            plan["blocks.*.moe.shared"] = "sequence_parallel"
        if self.pos_emb is not None:
            plan["pos_emb"] = "embedding"
        if self.head is not None:
            plan["head"] = "colwise_output"
        return plan


def build_model(cfg: MoEOptions) -> MoETransformer:
    """The model on the current default device (use `torch.device("meta")` for large ones)."""
    return MoETransformer(cfg)
