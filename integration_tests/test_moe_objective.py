"""MoE's auxiliary losses through the `cross_entropy` objective (train-loop) give the gradients
the model's own injection gave (llmtrain-moe), over accumulated micro-batches, and the loss the
objective returns is the cross-entropy alone."""

from __future__ import annotations

import torch
from llmtrain_moe.model import build_model
from llmtrain_moe.options import preset_options

from llmtrain.core_mesh.interfaces import ObjectiveContext
from llmtrain.train_loop.loss import cross_entropy_sum
from llmtrain.train_loop.objectives import CrossEntropyOptions, cross_entropy


def step(model, batches, loss_fn, count):
    """What `forward_backward` does: per micro-batch, loss(logits, targets) * (1/count)."""
    model.zero_grad()
    losses = []
    for tokens, targets in batches:
        loss = loss_fn(model(tokens), targets)
        (loss / count).backward()
        losses.append(loss.detach())
    return losses, {n: p.grad.clone() for n, p in model.named_parameters()}


def test_the_objective_adds_the_aux_losses_with_the_injected_gradients():
    cfg = preset_options("moe-tiny", d_model=32, aux_loss_weight=0.1, router_z_loss=0.01)
    model = build_model(cfg)
    model.init_weights(torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(2):  # two micro-batches: the aux losses weigh once per forward
        tokens = torch.randint(0, 320, (2, 24), generator=gen)
        batches.append((tokens, tokens.roll(-1, dims=1)))
    count = float(sum(t.numel() for _, t in batches))

    injected = step(model, batches, cross_entropy_sum(), count)  # the model's own injection
    context = ObjectiveContext(parts=[model], device=torch.device("cpu"))
    objective = cross_entropy(CrossEntropyOptions(), context)
    assert all(not m.inject_aux_loss for m in model.moe_layers().values())  # handed over
    objective.prepare(batches[0][0], batches[0][1], count)
    through = step(model, batches, objective, count)

    assert [torch.equal(a, b) for a, b in zip(injected[0], through[0], strict=True)] == [True, True]
    assert injected[1].keys() == through[1].keys()
    for name, grad in injected[1].items():
        torch.testing.assert_close(through[1][name], grad, rtol=1e-5, atol=1e-7, msg=name)
    # the aux losses did reach the router: plain cross-entropy without them differs
    plain = step(model, batches, cross_entropy_sum(), count)
    router = "blocks.0.moe.router.weight"
    assert not torch.allclose(plain[1][router], injected[1][router], rtol=1e-3, atol=0)


def test_under_pipeline_parallelism_the_model_keeps_its_injection():
    model = build_model(preset_options("moe-tiny", d_model=32))
    context = ObjectiveContext(parts=[model], device=torch.device("cpu"), pipeline_stages=2)
    objective = cross_entropy(CrossEntropyOptions(), context)
    assert objective.aux is None
    assert all(m.inject_aux_loss for m in model.moe_layers().values())
