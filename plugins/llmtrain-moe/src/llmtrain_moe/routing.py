"""Token-choice top-k routing and the router's auxiliary losses, as small functions of tensors.

Shapes: G groups (the sequences of a batch) x T tokens x E experts, k choices per token. A group
is the unit of load balancing and of capacity: each sequence balances its own tokens, so neither
depends on how a batch is split over ranks or micro-batches.

The auxiliary losses reach the gradients through `add_aux_loss`, an identity on the layer's
output whose backward also hands the auxiliary loss a gradient of 1: the backward pass is the
one of `loss + aux` without the trainer ever seeing `aux`.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, cast

import torch
import torch.nn.functional as F


class Routing(NamedTuple):
    probs: torch.Tensor  # (G, T, E) float32: softmax of the router logits
    experts: torch.Tensor  # (G, T, k) the chosen experts, most probable first
    weights: torch.Tensor  # (G, T, k) float32: how much each chosen expert's output counts
    keep: torch.Tensor | None  # (G, T, k) bool: the choice is within capacity (None: dropless)


def route(
    logits: torch.Tensor,
    top_k: int,
    *,
    renormalize: bool = True,
    capacity: int | None = None,
    bias: torch.Tensor | None = None,
) -> Routing:
    """Route each token of logits (G, T, E) to its `top_k` most probable experts. `renormalize`
    rescales the chosen probabilities to sum to 1; `capacity` caps the tokens an expert takes
    per group (see `within_capacity`). `bias` (E,), DeepSeek-V3's auxiliary-loss-free balancing,
    is added to the probabilities to choose the experts only (they come most biased-probable
    first): the weights stay the chosen experts' own probabilities."""
    probs = logits.float().softmax(dim=-1)
    if bias is None:
        top_probs, experts = probs.topk(top_k, dim=-1)
    else:
        experts = (probs + bias.float()).topk(top_k, dim=-1).indices
        top_probs = probs.gather(-1, experts)
    weights = top_probs / top_probs.sum(dim=-1, keepdim=True) if renormalize else top_probs
    keep = None
    if capacity is not None and logits.device.type != "meta":
        keep = within_capacity(experts, probs.size(-1), capacity)
    return Routing(probs, experts, weights, keep)


def expert_capacity(tokens: int, n_experts: int, top_k: int, capacity_factor: float) -> int:
    """Tokens one expert takes from a group of `tokens`: the even share times the factor."""
    return math.ceil(capacity_factor * tokens * top_k / n_experts)


def within_capacity(experts: torch.Tensor, n_experts: int, capacity: int) -> torch.Tensor:
    """Which choices (G, T, k) an expert has room for. Experts fill up in GShard's priority order:
    every token's first choice before any token's second choice, tokens in sequence order; the
    choices past `capacity` are dropped (the token keeps its residual path)."""
    G, T, k = experts.shape
    queue = experts.transpose(1, 2).reshape(G, k * T)  # choice rank major, then position
    one_hot = F.one_hot(queue, n_experts)
    place = (one_hot.cumsum(dim=1) * one_hot).sum(dim=-1) - 1  # place in its expert's queue
    return (place < capacity).view(G, k, T).transpose(1, 2)


def bias_update(counts: torch.Tensor, rate: float) -> torch.Tensor:
    """DeepSeek-V3's step for the routing bias, from a step's per-expert choice counts (E,):
    `rate * sign(mean count - count_e)`, raising the under-loaded experts and lowering the
    over-loaded ones. Compared in integers as `sum - E * count_e` (the same sign), so the
    counts of a large step lose nothing to float rounding."""
    counts = counts.long()
    return rate * torch.sign(counts.sum() - counts.numel() * counts).float()


def expert_load(experts: torch.Tensor, n_experts: int) -> torch.Tensor:
    """The fraction of each group's choices (G, T, k) that goes to each expert: (G, E), rows sum
    to 1 (before capacity drops)."""
    G = experts.size(0)
    flat = experts.reshape(G, -1)
    counts = torch.zeros(G, n_experts, device=experts.device, dtype=torch.float32)
    counts.scatter_add_(1, flat, torch.ones_like(flat, dtype=torch.float32))
    return counts / flat.size(1)


def balance_loss(probs: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """Switch/GShard load balancing: E * sum_e f_e * P_e per group, averaged over groups, where
    f_e is the fraction of choices routed to expert e (no gradient) and P_e the mean router
    probability of e. 1 when both are uniform; E when one expert takes everything."""
    n_experts = probs.size(-1)
    f = expert_load(experts, n_experts)
    p = probs.mean(dim=1)
    return n_experts * (f * p).sum(dim=-1).mean()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss: the mean over tokens of logsumexp(logits)^2 (keeps logits small)."""
    return torch.logsumexp(logits.float(), dim=-1).square().mean()


class _AddAuxLoss(torch.autograd.Function):
    """y = x forward; backward passes y's gradient to x and a gradient of 1 to `aux`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.aux_like = (aux.shape, aux.dtype, aux.device)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape, dtype, device = ctx.aux_like
        return grad, torch.ones(shape, dtype=dtype, device=device)


def add_aux_loss(x: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
    """`x`, through which backward also differentiates the scalar `aux` as if the caller's loss
    were `loss + aux`. The gradient of `aux` is 1 whatever factor the caller scales its own loss
    by: `aux` must already carry its weight."""
    # torch's Function.apply is unannotated (returns Any); forward returns a tensor
    return cast(torch.Tensor, _AddAuxLoss.apply(x, aux))  # type: ignore[no-untyped-call]
