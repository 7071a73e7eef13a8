"""Auxiliary-loss-free balancing (DeepSeek-V3) in pieces: the bias chooses the experts but not
their weights, the layer counts its training choices without a host sync, the update after an
optimizer step moves each expert's bias by the rate towards an even load over every rank's
counts, and the bias is model state only when the option is on."""

from __future__ import annotations

import torch
from llmtrain_moe.experts import expert_counts
from llmtrain_moe.model import MoE, build_model
from llmtrain_moe.options import MoEOptions, preset_options
from llmtrain_moe.routing import bias_update, route

from llmtrain.core_mesh.interfaces import AfterOptimizerStep

LAYER = dict(vocab_size=8, d_model=16, n_heads=1, n_layers=1, mlp_hidden=24, bias=False)


def test_the_bias_chooses_the_experts_and_the_probabilities_weigh_them():
    probs = torch.tensor([[[0.1, 0.2, 0.3, 0.4], [0.5, 0.05, 0.05, 0.4]]])
    bias = torch.tensor([0.0, 0.25, 0.0, -0.2])  # biased scores: [.1 .45 .3 .2], [.5 .3 .05 .2]
    routing = route(probs.log(), 2, bias=bias)
    assert routing.experts.tolist() == [[[1, 2], [0, 1]]]
    torch.testing.assert_close(routing.probs, probs)  # the balance loss sees the unbiased ones
    expected = torch.tensor([[[0.2 / 0.5, 0.3 / 0.5], [0.5 / 0.55, 0.05 / 0.55]]])
    torch.testing.assert_close(routing.weights, expected)
    raw = route(probs.log(), 2, renormalize=False, bias=bias)
    torch.testing.assert_close(raw.weights, torch.tensor([[[0.2, 0.3], [0.5, 0.05]]]))
    # a zero bias routes as no bias
    plain, zero = route(probs.log(), 3), route(probs.log(), 3, bias=torch.zeros(4))
    assert torch.equal(plain.experts, zero.experts) and torch.equal(plain.weights, zero.weights)


def test_counts_and_the_update_step():
    experts = torch.tensor([[[0, 1], [0, 2], [0, 1]]])
    assert expert_counts(experts.reshape(-1), 4).tolist() == [3, 2, 1, 0]
    # mean 1.5: expert 0 and 1 over it, 2 and 3 under
    torch.testing.assert_close(
        bias_update(torch.tensor([3, 2, 1, 0]), 0.01), torch.tensor([-0.01, -0.01, 0.01, 0.01])
    )
    # exactly at the mean: no move; integers compared exactly where float32 would round
    assert bias_update(torch.tensor([2, 2, 2, 2]), 0.5).tolist() == [0.0] * 4
    big = torch.tensor([2**25 + 1, 2**25 - 1])
    assert bias_update(big, 1.0).tolist() == [-1.0, 1.0]


def _layer(rate: float, **options) -> MoE:
    torch.manual_seed(0)
    layer = MoE(
        MoEOptions(**{**LAYER, "n_experts": 4, "top_k": 2, **options}, bias_update_rate=rate)
    )
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    return layer


def test_training_forwards_count_and_the_step_moves_the_bias_on_every_ranks_counts():
    layer = _layer(0.01)
    assert isinstance(layer, AfterOptimizerStep)
    x = torch.randn(2, 10, 16, generator=torch.Generator().manual_seed(1))
    layer.train()
    with torch.no_grad():  # not a training forward: nothing counted
        layer(x)
    layer.eval()
    layer(x)
    assert layer.expert_choices.tolist() == [0, 0, 0, 0]
    layer.train()
    layer(x)
    first = layer.expert_choices.clone()
    assert first.sum() == 2 * 10 * 2
    torch.testing.assert_close(first.float() / 40, layer.stats.load)
    layer(x)  # a second micro-batch of the step adds to the count
    assert torch.equal(layer.expert_choices, 2 * first)

    other_rank = torch.tensor([0, 0, 0, 200])  # another data rank's counts of the step
    seen = []

    def sum_over_ranks(t):
        seen.append(t.clone())
        return t + other_rank

    layer.after_optimizer_step(sum_over_ranks)
    assert torch.equal(seen[0], 2 * first)
    total = 2 * first + other_rank
    expected = 0.01 * torch.sign(total.sum() / 4 - total.float())
    assert torch.equal(layer.expert_bias, expected)
    assert expected[3] == -0.01  # the other rank's busy expert goes down
    assert layer.expert_choices.tolist() == [0, 0, 0, 0]  # the next step counts afresh
    layer.after_optimizer_step(sum_over_ranks)  # a step whose forwards this rank did not count
    assert torch.equal(layer.expert_bias, expected + 0.01 * torch.tensor([1.0, 1, 1, -1]))


def test_the_bias_is_state_only_when_balancing_is_on():
    off, on = _layer(0.0), _layer(0.001)
    assert off.expert_bias is None and off.expert_choices is None
    assert "expert_bias" not in off.state_dict() and list(off.buffers()) == []
    off.after_optimizer_step(lambda t: t)  # nothing to update
    # the bias is checkpointed, the step's count is not
    assert [k for k in on.state_dict() if not k.startswith(("router", "experts"))] == [
        "expert_bias"
    ]
    assert on.expert_bias.dtype == torch.float32 and on.expert_choices.dtype == torch.long
    standard = build_model(preset_options("moe-tiny"))
    assert not any("expert_bias" in k for k in standard.state_dict())
    balanced = build_model(preset_options("moe-tiny", bias_update_rate=0.001))
    keys = [k for k in balanced.state_dict() if "expert_bias" in k]
    assert keys == ["blocks.0.moe.expert_bias", "blocks.1.moe.expert_bias"]
    # the rest is the standard model's, and a standard state dict loads with the bias missing only
    missing, unexpected = balanced.load_state_dict(standard.state_dict(), strict=False)
    assert missing == keys and unexpected == []


def test_init_weights_zeroes_the_bias_after_meta_and_a_trained_bias_reloads():
    cfg = preset_options("moe-tiny", bias_update_rate=0.001)
    with torch.device("meta"):
        model = build_model(cfg)
    model.to_empty(device="cpu")
    model.init_weights(torch.Generator().manual_seed(0))
    for moe in model.moe_layers().values():
        assert moe.expert_bias.tolist() == [0.0] * 4 and moe.expert_choices.tolist() == [0] * 4
    model.train()
    model(torch.randint(0, 320, (2, 16)))
    for moe in model.moe_layers().values():
        moe.after_optimizer_step(lambda t: t)
    biases = [m.expert_bias.clone() for m in model.moe_layers().values()]
    assert all(b.abs().sum() > 0 for b in biases)
    again = build_model(cfg)
    again.load_state_dict(model.state_dict())  # strict
    assert all(
        torch.equal(a.expert_bias, b)
        for a, b in zip(again.moe_layers().values(), biases, strict=True)
    )


def test_the_model_is_not_a_step_hook_itself():
    """The strategy calls every module that has the hook: on the model as well as its layers,
    each layer would move twice per step."""
    model = build_model(preset_options("moe-tiny", bias_update_rate=0.001))
    hooks = [name for name, m in model.named_modules() if isinstance(m, AfterOptimizerStep)]
    assert hooks == ["blocks.0.moe", "blocks.1.moe"]
