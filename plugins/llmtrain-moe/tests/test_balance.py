"""Load balancing works: a toy regression whose router starts biased towards expert 0 ends
balanced with the auxiliary loss, or with the auxiliary-loss-free routing bias (DeepSeek-V3),
and stays collapsed without either.

The layer learns a fixed random MLP (teacher) on inputs shifted along a direction u; the router
starts with `bias * u` added to expert 0's row, so expert 0 wins most tokens. The auxiliary loss
reaches the router only through the identity trick (the loop backpropagates the task loss
alone), as in `llmtrain run`. The routing bias moves after each optimizer step, as the parallel
strategy calls it in `llmtrain run` (one process: the counts summed over ranks are its own).
"""

from __future__ import annotations

import pytest
import torch
from llmtrain_moe.model import MoE
from llmtrain_moe.options import MoEOptions

N_EXPERTS, D, STEPS = 4, 32, 150


def max_load_during_training(
    aux_loss_weight: float, top_k: int, seed: int = 0, bias_update_rate: float = 0.0
):
    """The largest expert load (fraction of token choices) at the first step and averaged over
    the last 10 steps."""
    cfg = MoEOptions(
        vocab_size=8, d_model=D, n_heads=1, n_layers=1, mlp="swiglu", mlp_hidden=32, bias=False,
        n_experts=N_EXPERTS, top_k=top_k, renormalize=top_k > 1, aux_loss_weight=aux_loss_weight,
        bias_update_rate=bias_update_rate,
    )  # fmt: skip
    torch.manual_seed(seed)
    layer = MoE(cfg)
    teacher = torch.nn.Sequential(torch.nn.Linear(D, 64), torch.nn.Tanh(), torch.nn.Linear(64, D))
    u = torch.randn(D)
    u /= u.norm()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.1)
        layer.router.weight[0] += 4.0 * u
    opt = torch.optim.Adam(layer.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(1)
    loads = []
    for _ in range(STEPS):
        x = torch.randn(8, 32, D, generator=data) + u
        with torch.no_grad():
            target = teacher(x)
        loss = (layer(x) - target).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        layer.after_optimizer_step(lambda counts: counts)
        loads.append(layer.stats.load.max().item())
    return loads[0], sum(loads[-10:]) / 10


@pytest.mark.parametrize("top_k", [1, 2])
def test_aux_loss_balances_a_biased_router(top_k):
    first, balanced = max_load_during_training(0.1, top_k)
    _, collapsed = max_load_during_training(0.0, top_k)
    # an expert holds at most 1/k of the choices: top-1 starts near 1, top-2 near 1/2
    imbalanced = {1: 0.6, 2: 0.4}[top_k]
    assert first > imbalanced, first
    assert balanced < 1.5 / N_EXPERTS, (first, balanced)
    assert collapsed > imbalanced, (first, collapsed)


@pytest.mark.parametrize("top_k", [1, 2])
def test_the_routing_bias_balances_a_biased_router_without_an_auxiliary_loss(top_k):
    """0.01 a step, not DeepSeek's 0.001: the bias has 150 steps to offset a router that gives
    expert 0 most of the probability (it ends near +0.45 for the others, -0.1 to -0.2 for 0)."""
    first, balanced = max_load_during_training(0.0, top_k, bias_update_rate=0.01)
    _, collapsed = max_load_during_training(0.0, top_k)
    imbalanced = {1: 0.6, 2: 0.4}[top_k]
    assert first > imbalanced and collapsed > imbalanced, (first, collapsed)
    assert balanced < 1.5 / N_EXPERTS, (first, balanced)
