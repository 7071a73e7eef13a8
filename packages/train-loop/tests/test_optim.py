"""Optimizer plugins: which parameters decay, and that each optimizer steps by the numbers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from llmtrain.core_mesh.config import ConfigValueError
from llmtrain.models.presets import preset_config
from llmtrain.models.transformer import build_model
from llmtrain.train_loop.optim import (
    AdamOptions,
    MuonOptions,
    SGDOptions,
    adam,
    adamw,
    decay_groups,
    muon,
    sgd,
)


class Mixed(nn.Module):
    """Every kind of parameter the rule distinguishes."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.norm = nn.LayerNorm(4)
        self.proj = nn.Linear(4, 6)  # weight decays, bias does not
        self.head = nn.Linear(6, 10, bias=False)
        self.scale = nn.Parameter(torch.ones(4))
        self.kernel = nn.Parameter(torch.randn(2, 3, 4))  # 3-D: a matrix by the rule (ndim >= 2)
        self.frozen = nn.Parameter(torch.randn(4, 4), requires_grad=False)


def ids(params) -> set[int]:
    return {id(p) for p in params}


def tiny(tied: bool = False) -> nn.Module:
    torch.manual_seed(0)
    model = build_model(preset_config("tiny", d_model=32, max_seq_len=16, tied_embeddings=tied))
    model.init_weights()
    return model


def test_decay_groups_by_rule():
    m = Mixed()
    decay, no_decay = decay_groups(m, 0.1)
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
    assert ids(decay["params"]) == ids([m.proj.weight, m.head.weight, m.kernel])
    assert ids(no_decay["params"]) == ids(
        [m.embed.weight, m.norm.weight, m.norm.bias, m.proj.bias, m.scale]
    )


def test_decay_groups_on_the_tiny_transformer():
    model = tiny()
    decay, no_decay = decay_groups(model, 0.1)
    named = {id(p): n for n, p in model.named_parameters()}
    decayed = sorted(named[i] for i in ids(decay["params"]))
    exempt = sorted(named[i] for i in ids(no_decay["params"]))
    assert decayed == sorted(
        n for n, p in model.named_parameters() if p.ndim == 2 and n != "tok_emb.weight"
    )
    assert "head.weight" in decayed and "blocks.0.attn.wq.weight" in decayed
    assert exempt == sorted(
        ["tok_emb.weight", "norm.weight"]
        + [f"blocks.{i}.{n}.weight" for i in range(2) for n in ("attn_norm", "mlp_norm")]
    )


def test_groups_without_parameters_are_left_out():
    only_norm = nn.LayerNorm(3)
    [group] = decay_groups(only_norm, 0.1)
    assert group["weight_decay"] == 0.0


def zero_grads(module: nn.Module) -> dict[str, torch.Tensor]:
    for p in module.parameters():
        p.grad = torch.zeros_like(p)
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def test_adamw_decays_only_matrices_by_lr_times_wd():
    m = Mixed()
    [opt] = adamw(AdamOptions(lr=0.01, weight_decay=0.5), m)
    assert isinstance(opt, torch.optim.AdamW)
    assert opt.defaults["foreach"] is True  # CPU: foreach, not fused
    assert [g["lr"] for g in opt.param_groups] == [0.01, 0.01]
    assert opt.param_groups[0]["betas"] == (0.9, 0.95)
    before = zero_grads(m)
    opt.step()  # a zero gradient: only the decoupled decay moves anything
    after = dict(m.named_parameters())
    for name in ("proj.weight", "head.weight", "kernel"):
        torch.testing.assert_close(after[name].detach(), before[name] * (1 - 0.01 * 0.5))
    for name in ("embed.weight", "norm.weight", "norm.bias", "proj.bias", "scale"):
        assert torch.equal(after[name].detach(), before[name]), name
    assert torch.equal(after["frozen"].detach(), before["frozen"])


def test_adam_folds_decay_into_the_gradient():
    m = Mixed()
    [opt] = adam(AdamOptions(lr=0.01, weight_decay=0.5), m)
    assert isinstance(opt, torch.optim.Adam) and not isinstance(opt, torch.optim.AdamW)
    before = zero_grads(m)
    opt.step()
    # the first Adam step of a gradient g (= wd * p here) moves by lr * g / (|g| + eps): ~lr
    moved = before["proj.weight"] - m.proj.weight.detach()
    torch.testing.assert_close(moved, 0.01 * torch.sign(before["proj.weight"]), atol=1e-6, rtol=0)
    assert torch.equal(m.embed.weight.detach(), before["embed.weight"])


def test_sgd_momentum_and_nesterov():
    torch.manual_seed(0)
    for nesterov, factor in ((False, 1.0), (True, 1.9)):  # nesterov: g + momentum * g at step 1
        m = nn.Linear(3, 2)
        [opt] = sgd(SGDOptions(lr=0.1, momentum=0.9, nesterov=nesterov), m)
        assert isinstance(opt, torch.optim.SGD)
        before = m.weight.detach().clone()
        grad = torch.randn(2, 3)
        m.weight.grad, m.bias.grad = grad, torch.zeros(2)
        opt.step()
        torch.testing.assert_close(m.weight.detach(), before - 0.1 * factor * grad)
    with pytest.raises(ConfigValueError) as info:
        SGDOptions(nesterov=True, momentum=0.0)
    assert info.value.field == "nesterov"


def test_adam_options_validate():
    with pytest.raises(ValueError, match=r"two numbers in \[0, 1\)"):
        AdamOptions(betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="must be positive"):
        AdamOptions(lr=0.0)


def test_muon_splits_hidden_matrices_from_the_rest():
    model = tiny()
    muon_opt, adamw_opt = muon(MuonOptions(lr=0.02, adamw_lr=1e-3, weight_decay=0.1), model)
    assert isinstance(muon_opt, torch.optim.Muon)
    assert isinstance(adamw_opt, torch.optim.AdamW)
    named = {id(p): n for n, p in model.named_parameters()}
    in_muon = {named[id(p)] for g in muon_opt.param_groups for p in g["params"]}
    in_adamw = {named[id(p)] for g in adamw_opt.param_groups for p in g["params"]}
    hidden = {
        n
        for n in named.values()
        if n.startswith("blocks.")
        and n.endswith(
            (
                "wq.weight",
                "wk.weight",
                "wv.weight",
                "wo.weight",
                "w1.weight",
                "w2.weight",
                "w3.weight",
            )
        )
    }
    assert in_muon == hidden
    assert in_adamw == set(named.values()) - hidden
    assert {"tok_emb.weight", "head.weight", "norm.weight"} <= in_adamw
    assert muon_opt.param_groups[0]["lr"] == 0.02
    assert {g["lr"] for g in adamw_opt.param_groups} == {1e-3}


def test_muon_adamw_part_follows_the_decay_rule():
    """Weight decay applies to matrices only, whatever the optimizer: the output layer is a
    matrix (not an embedding table), so it decays under muon's AdamW as it does under adamw."""
    model = tiny()
    _, adamw_opt = muon(MuonOptions(weight_decay=0.1), model)
    [plain] = adamw(AdamOptions(weight_decay=0.1), model)

    def decay_of(optimizer) -> dict[int, float]:
        return {id(p): g["weight_decay"] for g in optimizer.param_groups for p in g["params"]}

    under_muon, under_adamw = decay_of(adamw_opt), decay_of(plain)
    assert under_adamw[id(model.head.weight)] == 0.1
    assert under_muon[id(model.tok_emb.weight)] == under_muon[id(model.norm.weight)] == 0.0
    assert under_muon[id(model.head.weight)] == 0.1


@pytest.mark.parametrize("kind", ["adamw", "adam", "sgd", "muon"])
def test_every_optimizer_trains_the_tiny_model(installed, kind):
    """Built through the registry as the trainer does; a few steps on one batch lower its loss."""
    entry = installed.registry("optimizer").get(kind)
    model = tiny(tied=True)
    options = entry.options(**({"lr": 0.05} if kind == "sgd" else {}))
    optimizers = entry.target(options, model)
    tokens = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(5):
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.01, losses
