"""Routing math on hand-checked inputs (top-k, renormalisation, capacity, the auxiliary losses)
and the identity trick that carries the auxiliary losses' gradient: exact against autograd on
the explicit sum."""

from __future__ import annotations

import math

import attrs
import pytest
import torch
import torch.nn.functional as F
from llmtrain_moe.model import MoE, build_model
from llmtrain_moe.options import MoEOptions, preset_options
from llmtrain_moe.routing import (
    add_aux_loss,
    balance_loss,
    expert_capacity,
    expert_load,
    route,
    router_z_loss,
    within_capacity,
)


def test_top_k_picks_the_most_probable_experts_and_renormalizes():
    probs = torch.tensor([[[0.1, 0.2, 0.3, 0.4], [0.5, 0.05, 0.05, 0.4]]])
    routing = route(probs.log(), 2)
    torch.testing.assert_close(routing.probs, probs)
    assert routing.experts.tolist() == [[[3, 2], [0, 3]]]
    expected = torch.tensor([[[0.4 / 0.7, 0.3 / 0.7], [0.5 / 0.9, 0.4 / 0.9]]])
    torch.testing.assert_close(routing.weights, expected)
    assert routing.keep is None  # dropless
    raw = route(probs.log(), 2, renormalize=False)
    torch.testing.assert_close(raw.weights, torch.tensor([[[0.4, 0.3], [0.5, 0.4]]]))
    top1 = route(probs.log(), 1)
    assert top1.experts.tolist() == [[[3], [0]]] and top1.weights.eq(1).all()


# three tokens prefer expert 0 then 1, the last one 1 then 0
CHOICES = torch.tensor([[[0, 1], [0, 1], [0, 1], [1, 0]]])
# GShard order: all first choices (tokens 0-3), then the second ones. With room for 2 per expert:
# expert 0 takes tokens 0 and 1 (first choices), so token 2's first choice and token 3's second
# are dropped; expert 1 takes token 3 (first) and token 0 (second), not tokens 1 and 2 (second).
KEPT = [[[True, True], [True, False], [False, False], [True, False]]]


def test_capacity_drops_in_gshard_priority_order():
    assert expert_capacity(tokens=4, n_experts=2, top_k=2, capacity_factor=0.5) == 2
    assert expert_capacity(tokens=5, n_experts=2, top_k=2, capacity_factor=1.0) == 5  # ceil
    assert within_capacity(CHOICES, 2, 2).tolist() == KEPT
    assert within_capacity(CHOICES, 2, 4).all()  # room for everything: nothing dropped
    assert within_capacity(CHOICES, 2, 1).tolist() == [
        [[True, False], [False, False], [False, False], [True, False]]
    ]
    # each group (sequence) fills its own experts
    two = within_capacity(torch.cat([CHOICES, CHOICES.flip(2)]), 2, 2)
    assert two[0].tolist() == KEPT[0] and two[1].tolist() == KEPT[0]
    logits = torch.tensor([[[2.0, 1.0], [2.0, 1.0], [2.0, 1.0], [1.0, 2.0]]])
    routing = route(logits, 2, capacity=2)
    assert routing.experts.tolist() == CHOICES.tolist() and routing.keep.tolist() == KEPT


def test_dropped_choices_contribute_nothing_and_are_counted():
    cfg = MoEOptions(
        vocab_size=8, d_model=4, n_heads=1, n_layers=1, mlp="swiglu", mlp_hidden=8, bias=False,
        n_experts=2, top_k=2, capacity_factor=0.5,
    )  # fmt: skip
    torch.manual_seed(0)
    layer = MoE(cfg)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.5)
        layer.router.weight.copy_(torch.eye(2, 4))  # logits = the first two features
    x = torch.randn(1, 4, 4)
    x[..., :2] = torch.tensor([[2.0, 1.0], [2.0, 1.0], [2.0, 1.0], [1.0, 2.0]])
    y = layer(x)
    keep = torch.tensor(KEPT[0])
    weights = F.softmax(x[0, :, :2], dim=-1).sort(dim=-1, descending=True).values
    w1, w3, w2 = layer.experts.w1, layer.experts.w3, layer.experts.w2
    expected = torch.zeros(4, 4)
    for t in range(4):
        for j in range(2):
            if keep[t, j]:
                e = CHOICES[0, t, j]
                h = F.silu(x[0, t] @ w1[e].T) * (x[0, t] @ w3[e].T)
                expected[t] += weights[t, j] * (h @ w2[e].T)
    torch.testing.assert_close(y[0], expected)
    stats = layer.stats
    assert int(stats.dropped) == 4 and stats.assignments == 8
    assert stats.load.tolist() == [0.5, 0.5]  # the load counts choices before drops


def test_load_and_balance_loss_hand_values():
    top1 = torch.tensor([[[0], [0]], [[0], [1]]])
    assert expert_load(top1, 2).tolist() == [[1.0, 0.0], [0.5, 0.5]]
    probs = torch.tensor([[[0.9, 0.1], [0.6, 0.4]], [[0.5, 0.5], [0.5, 0.5]]])
    # group 0: f = (1, 0), P = (0.75, 0.25) -> 2 * 0.75 = 1.5; group 1: f = P = (0.5, 0.5) -> 1
    assert balance_loss(probs, top1).item() == pytest.approx(1.25)
    uniform = torch.full((1, 8, 4), 0.25)
    spread = torch.arange(8).view(1, 8, 1) % 4
    assert balance_loss(uniform, spread).item() == pytest.approx(1.0)  # balanced: the minimum
    collapsed = torch.tensor([[[1.0, 0.0, 0.0, 0.0]] * 8])
    assert balance_loss(collapsed, torch.zeros(1, 8, 1, dtype=torch.long)).item() == 4.0  # E


def test_router_z_loss_hand_values():
    assert router_z_loss(torch.zeros(1, 3, 4)).item() == pytest.approx(math.log(4) ** 2)
    two = torch.tensor([[[0.0, math.log(3.0)], [0.0, 0.0]]])  # logsumexp log 4 and log 2
    assert router_z_loss(two).item() == pytest.approx((math.log(4) ** 2 + math.log(2) ** 2) / 2)


def test_add_aux_loss_is_exactly_the_gradient_of_the_explicit_sum():
    torch.manual_seed(0)
    x0, w0, g = torch.randn(3, 4), torch.randn(4), torch.randn(3, 4)

    def grads(inject: bool, scale: float = 1.0):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        y, aux = x * 2, 0.3 * (w * x.sum(0)).square().sum()
        if inject:
            loss = (add_aux_loss(y, aux) * g).sum() * scale
        else:
            loss = (y * g).sum() * scale + aux
        loss.backward()
        return x.grad, w.grad

    for scale in (1.0, 0.125):
        inject, explicit = grads(True, scale), grads(False, scale)
        for a, b in zip(inject, explicit, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    # the auxiliary loss's gradient does not follow the caller's loss scale
    assert torch.equal(grads(True, 0.125)[1], grads(True, 1.0)[1])


def _trainer_step_grads(model, tokens, targets, inject: bool, scale: float):
    """Gradients of one micro-batch as the trainer computes them: a summed cross-entropy times
    the step's scale; with injection off, the auxiliary losses are added by hand."""
    model.zero_grad(set_to_none=True)
    model.inject_aux_loss(inject)
    logits = model(tokens)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum") * scale
    if not inject:
        loss = loss + model.aux_loss()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_injected_aux_gradients_equal_autograd_on_the_explicit_loss(capacity_factor):
    cfg = preset_options(
        "moe-tiny", d_model=32, aux_loss_weight=0.1, router_z_loss=0.01,
        capacity_factor=capacity_factor, shared_expert=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = build_model(cfg)
    model.init_weights(torch.Generator().manual_seed(0))
    tokens = torch.randint(0, 320, (3, 24), generator=torch.Generator().manual_seed(1))
    targets = tokens.roll(-1, dims=1)
    scale = 1.0 / targets.numel()
    injected = _trainer_step_grads(model, tokens, targets, True, scale)
    explicit = _trainer_step_grads(model, tokens, targets, False, scale)
    assert injected.keys() == explicit.keys()
    for name in injected:
        assert torch.equal(injected[name], explicit[name]), name  # bit for bit
    # and the auxiliary losses did move the router: without them its gradient differs
    plain = build_model(attrs.evolve(cfg, aux_loss_weight=0.0, router_z_loss=0.0))
    plain.load_state_dict(model.state_dict())
    without = _trainer_step_grads(plain, tokens, targets, True, scale)
    router = "blocks.0.moe.router.weight"
    assert not torch.allclose(without[router], injected[router], rtol=1e-3, atol=0)
