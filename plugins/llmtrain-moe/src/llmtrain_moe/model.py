"""A decoder-only Mixture-of-Experts transformer: llmtrain-models' attention, norms and rotary
positions, with each block's MLP replaced by a routed set of experts.

Read top to bottom: the MoE layer (router, experts, optional shared expert, router statistics,
auxiliary losses), the block, the model. The model has the dense model's interface: `forward`
(logits; hidden states on pipeline stages), `init_weights`, `describe`, `new_cache` (so
llmtrain's `generate` works), `trim_to_stage`.

After every forward each MoE layer holds its router statistics (`MoE.stats`, tensors, no host
sync); `MoETransformer.router_stats()` turns them into numbers.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from llmtrain.core_mesh.interfaces import ModelDescription
from llmtrain.models.transformer import Attention, LayerCache, make_norm, rope_tables
from llmtrain_moe.experts import Experts, local
from llmtrain_moe.options import MoEOptions
from llmtrain_moe.routing import (
    add_aux_loss,
    balance_loss,
    expert_capacity,
    expert_load,
    route,
    router_z_loss,
)

try:
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # a torch build without distributed support
    DTensor = None


class RouterStats(NamedTuple):
    """One MoE layer's routing in its last forward (this rank's tokens)."""

    load: torch.Tensor  # (E,) fraction of the (token, choice) pairs each expert was chosen for
    dropped: torch.Tensor  # () pairs over capacity, not computed (0 when dropless)
    assignments: int  # (token, choice) pairs: tokens x top_k
    balance_loss: torch.Tensor  # () the unweighted load-balancing loss (1 = balanced)
    z_loss: torch.Tensor  # () the unweighted router z-loss


class MoE(nn.Module):
    """Router + experts (+ a shared expert) in place of a block's MLP."""

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
            Experts(1, cfg.d_model, cfg.hidden_size, gated=cfg.mlp == "swiglu")
            if cfg.shared_expert
            else None
        )
        # True: the weighted auxiliary loss reaches the gradients through the output (the
        # trainer never sees it). False: it is left in `aux_loss` for the caller to add.
        self.inject_aux_loss = True
        self.aux_loss: torch.Tensor | None = None
        self.stats: RouterStats | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if DTensor is not None and isinstance(x, DTensor):
            return self._forward_sequence_shards(x)
        B, T, d = x.shape
        cfg = self.cfg
        # the modules holding parameters are never called: under tensor parallelism their
        # replicating style's forward hooks would take inputs for sequence shards
        logits = F.linear(x.float(), local(self.router.weight).float())  # routing in float32
        capacity = None
        if cfg.capacity_factor is not None:
            capacity = expert_capacity(T, cfg.n_experts, cfg.top_k, cfg.capacity_factor)
        routing = route(logits, cfg.top_k, renormalize=cfg.renormalize, capacity=capacity)
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

    def _weighted_aux(self, balance: torch.Tensor, z: torch.Tensor) -> torch.Tensor | None:
        terms = [(self.cfg.aux_loss_weight, balance), (self.cfg.router_z_loss, z)]
        weighted = [w * loss for w, loss in terms if w > 0]
        return sum(weighted[1:], weighted[0]) if weighted else None

    @torch.no_grad()
    def _record(self, routing, balance: torch.Tensor, z: torch.Tensor) -> None:
        experts = routing.experts
        load = expert_load(experts.reshape(1, -1, experts.size(-1)), self.cfg.n_experts)[0]
        if routing.keep is None:
            dropped = torch.zeros((), dtype=torch.long, device=experts.device)
        else:
            dropped = (~routing.keep).sum()
        self.stats = RouterStats(load, dropped, experts.numel(), balance.detach(), z.detach())

    def _forward_sequence_shards(self, x: Any) -> torch.Tensor:
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

    def forward(self, x, rope=None, mask=None, cache=None, start_pos=0) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), rope, mask, cache, start_pos)
        return x + self.dropout(self.moe(self.moe_norm(x)))


class MoETransformer(nn.Module):
    def __init__(self, cfg: MoEOptions):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.padded_vocab_size, cfg.d_model)
        self.pos_emb = (
            nn.Embedding(cfg.max_seq_len, cfg.d_model) if cfg.positions == "learned" else None
        )
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.norm = make_norm(cfg, cfg.d_model)
        self.head = (
            None
            if cfg.tied_embeddings
            else nn.Linear(cfg.d_model, cfg.padded_vocab_size, bias=False)
        )
        if cfg.positions == "rope":
            cos, sin = rope_tables(cfg)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)

    def forward(
        self,
        tokens: torch.Tensor,
        doc_starts: torch.Tensor | None = None,
        *,
        cache: list[LayerCache] | None = None,
        start_pos: int = 0,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits (B, T, padded vocab) for tokens (B, T); hidden states on pipeline stages.
        `positions` (1 or B, T): each token's place in its sequence (context parallelism)."""
        B, T = tokens.shape[:2]
        if start_pos + T > self.cfg.max_seq_len:
            raise ValueError(
                f"sequence of {start_pos + T} tokens is longer than the model's max_seq_len "
                f"({self.cfg.max_seq_len}); raise model.max_seq_len or shorten the input"
            )
        if positions is None:
            # a pipeline stage's input may be a sequence shard: document starts cover it all
            seq = doc_starts.size(1) if doc_starts is not None else T
            positions, mask = self._positions_and_mask(
                B, seq, tokens.device, doc_starts, cache, start_pos
            )
        elif doc_starts is not None or cache is not None:
            raise ValueError("explicit positions go with neither document masking nor a cache")
        else:
            mask = None
        h = self.tok_emb(tokens) if self.tok_emb is not None else tokens
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
        h = self.norm(h)
        return self.head(h) if self.head is not None else F.linear(h, self.tok_emb.weight)

    def _positions_and_mask(self, B, T, device, doc_starts, cache, start_pos):
        """Positions (1 or B, T) and an attention mask, or None for plain causal attention
        (the same rules as llmtrain-models' Transformer)."""
        index = torch.arange(start_pos, start_pos + T, device=device)
        if doc_starts is not None and self.cfg.doc_masking:
            if cache is not None:
                raise ValueError("document masking is for training; decode one document at a time")
            starts = doc_starts.to(torch.bool).clone()
            starts[:, 0] = True
            last_start = torch.where(starts, index, 0).cummax(dim=1).values
            segment = starts.cumsum(dim=1)
            same_doc = segment.unsqueeze(2) == segment.unsqueeze(1)
            causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
            return index - last_start, (same_doc & causal).unsqueeze(1)
        mask = None
        if cache is not None and T > 1:
            mask = index.unsqueeze(1) >= torch.arange(start_pos + T, device=device).unsqueeze(0)
        return index.unsqueeze(0), mask

    def new_cache(self, batch: int, max_len: int) -> list[LayerCache]:
        ref = next(iter(self.blocks.values())).attn.wk.weight
        kv_heads = ref.size(0) // self.cfg.head_dim
        return [
            LayerCache(
                batch, kv_heads, max_len, self.cfg.head_dim, device=ref.device, dtype=ref.dtype
            )
            for _ in self.blocks
        ]

    # --- the MoE layers ---
    def moe_layers(self) -> dict[str, MoE]:
        """Layer index -> its MoE layer (the blocks this model or pipeline stage holds)."""
        return {name: block.moe for name, block in self.blocks.items()}

    def router_stats(self) -> dict[str, dict[str, Any]]:
        """Per layer index, the routing of the last forward on this rank: `load` (fraction of
        the token choices each expert got; 1/n_experts each when balanced), `dropped` and
        `assignments` (token choices over capacity, and all of them), `balance_loss` (1 when
        balanced) and `z_loss`. Reading it waits for the device."""
        out = {}
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

    def inject_aux_loss(self, enabled: bool) -> None:
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
        """Initialise every parameter and buffer; also right after `to_empty` from meta."""
        cfg = self.cfg
        std = cfg.init_std
        residual_std = std / math.sqrt(2 * cfg.n_layers) if cfg.scale_residual_init else std
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                is_residual_out = name.endswith("attn.wo")
                nn.init.normal_(
                    module.weight, std=residual_std if is_residual_out else std, generator=generator
                )
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
                module.reset_parameters()
            elif isinstance(module, Experts):
                for w in (module.w1, module.w3):
                    if w is not None:
                        nn.init.normal_(w, std=std, generator=generator)
                nn.init.normal_(module.w2, std=residual_std, generator=generator)
        if cfg.positions == "rope":
            cos, sin = rope_tables(cfg, device=self.rope_cos.device)
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)

    def inactive_params(self) -> int:
        """Expert parameters a token does not use: (n_experts - top_k) experts per layer."""
        idle = self.cfg.n_experts - self.cfg.top_k
        return sum(m.experts.expert_params() * idle for m in self.moe_layers().values())

    def describe(self) -> ModelDescription:
        cfg = self.cfg
        n_params = sum(p.numel() for p in self.parameters())
        embedding = sum(m.weight.numel() for m in (self.tok_emb, self.pos_emb) if m is not None)
        non_embedding = n_params - embedding
        active = non_embedding - self.inactive_params()
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
            trim_to_stage=None if cfg.tied_embeddings else MoETransformer.trim_to_stage,
        )

    def trim_to_stage(self, block_ids, first: bool, last: bool) -> None:
        """Keep only what one pipeline stage runs (block names stay their layer indices)."""
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
        """Tensor parallelism shards attention and the embeddings; the MoE layers (router,
        experts, shared expert) are replicated over tp and route whole sequences on every rank."""
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
