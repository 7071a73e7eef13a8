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


# µP: the model's learning-rate multipliers become parameter groups


class Scaled(Mixed):
    """A stand-in for a µP model: multipliers by name, one on a vector and one on a table."""

    def lr_multipliers(self) -> dict[str, float]:
        return {"proj.weight": 0.5, "proj.bias": 0.25, "embed.weight": 2.0, "absent.weight": 3.0}


def mup_tiny(d_model: int = 64, base: int = 32) -> nn.Module:
    torch.manual_seed(0)
    config = preset_config(
        "tiny",
        d_model=d_model,
        max_seq_len=16,
        tied_embeddings=False,
        parametrization="mup",
        mup_base_width=base,
    )
    model = build_model(config)
    model.init_weights()
    return model


def group_of(optimizer) -> dict[int, dict]:
    return {id(p): g for g in optimizer.param_groups for p in g["params"]}


def test_multiplier_groups_scale_lr_and_keep_the_decay_split():
    m = Scaled()
    [opt] = adamw(AdamOptions(lr=0.01, weight_decay=0.5), m)
    groups = group_of(opt)
    expected = {  # name: (lr, weight decay, multiplier)
        "proj.weight": (0.005, 0.5, 0.5),
        "head.weight": (0.01, 0.5, 1.0),
        "kernel": (0.01, 0.5, 1.0),
        "proj.bias": (0.0025, 0.0, 0.25),
        "embed.weight": (0.02, 0.0, 2.0),
        "norm.weight": (0.01, 0.0, 1.0),
        "norm.bias": (0.01, 0.0, 1.0),
        "scale": (0.01, 0.0, 1.0),
    }
    named = dict(m.named_parameters())
    for name, (lr, wd, multiplier) in expected.items():
        group = groups[id(named[name])]
        assert (group["lr"], group["weight_decay"], group["lr_multiplier"]) == (lr, wd, multiplier)
        assert group["base_lr"] == 0.01, name
    assert id(m.frozen) not in groups
    # decay class first, then the multipliers in the order parameters() gives (the module's own
    # parameters before its children's)
    assert [(g["weight_decay"], g["lr_multiplier"]) for g in opt.param_groups] == [
        (0.5, 1.0),
        (0.5, 0.5),
        (0.0, 1.0),
        (0.0, 2.0),
        (0.0, 0.25),
    ]
    before = zero_grads(m)
    opt.step()  # a zero gradient: AdamW's decoupled decay is lr x multiplier x wd
    torch.testing.assert_close(m.proj.weight.detach(), before["proj.weight"] * (1 - 0.005 * 0.5))
    torch.testing.assert_close(m.head.weight.detach(), before["head.weight"] * (1 - 0.01 * 0.5))


def test_a_module_without_multipliers_gets_the_groups_it_always_got():
    """Standard models (lr_multipliers() == {}) and modules without the method: the two decay
    groups exactly, with no µP keys, so a standard run steps bit for bit as before."""

    class NoMultipliers(Mixed):
        def lr_multipliers(self) -> dict[str, float]:
            return {"proj.weight": 1.0}  # a multiplier of 1 is no multiplier

    standard = tiny()
    assert standard.lr_multipliers() == {}
    for module in (Mixed(), NoMultipliers(), standard, mup_tiny(32, 32)):
        [opt] = adamw(AdamOptions(lr=0.01, weight_decay=0.5), module)
        reference = decay_groups(module, 0.5)
        assert len(opt.param_groups) == len(reference)
        for group, plain in zip(opt.param_groups, reference, strict=True):
            assert ids(group["params"]) == ids(plain["params"])
            assert [id(p) for p in group["params"]] == [id(p) for p in plain["params"]]
            assert "lr_multiplier" not in group and "base_lr" not in group
            assert group["lr"] == 0.01
    # µP at its base width computes what standard computes, steps included
    a, b = tiny(), mup_tiny(32, 32)
    b.load_state_dict(a.state_dict())
    tokens = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(3))
    for model in (a, b):
        [opt] = adamw(AdamOptions(lr=0.01), model)
        for _ in range(2):
            logits = model(tokens[:, :-1])
            nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
            opt.step()
            opt.zero_grad()
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_mup_transformer_groups_by_hand():
    model = mup_tiny(64, 32)  # m = 2: hidden matrices at lr / 2
    for build in (adamw, adam):
        [opt] = build(AdamOptions(lr=0.004, weight_decay=0.1), model)
        groups = group_of(opt)
        for name, p in model.named_parameters():
            hidden = name.startswith("blocks.") and name.endswith(
                tuple(f"{w}.weight" for w in ("wq", "wk", "wv", "wo", "w1", "w2", "w3"))
            )
            group = groups[id(p)]
            assert group["lr"] == (0.002 if hidden else 0.004), name
            assert group["lr_multiplier"] == (0.5 if hidden else 1.0), name
            assert group["weight_decay"] == (0.1 if p.ndim == 2 and "emb" not in name else 0.0)


def test_a_pipeline_stage_takes_the_multipliers_of_the_parameters_it_holds():
    model = mup_tiny(64, 32)
    model.trim_to_stage([1], False, True)  # the last of two stages: block 1, norm and head
    [opt] = adamw(AdamOptions(lr=0.004), model)
    named = {id(p): n for n, p in model.named_parameters()}
    scaled = sorted(named[id(p)] for g in opt.param_groups if g["lr"] == 0.002 for p in g["params"])
    assert scaled == sorted(
        f"blocks.1.{w}.weight"
        for w in ("attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp.w1", "mlp.w2", "mlp.w3")
    )
    assert sum(len(g["params"]) for g in opt.param_groups) == len(named)


def test_muon_orthogonalised_matrices_take_no_multiplier_its_adamw_does():
    m = Scaled()
    muon_opt, adamw_opt = muon(MuonOptions(lr=0.02, adamw_lr=0.001, weight_decay=0.1), m)
    [muon_group] = muon_opt.param_groups
    assert id(m.proj.weight) in ids(muon_group["params"])  # its 0.5 is not applied
    assert muon_group["lr"] == 0.02 and "lr_multiplier" not in muon_group
    groups = group_of(adamw_opt)
    assert groups[id(m.proj.bias)]["lr"] == 0.00025
    assert groups[id(m.embed.weight)]["lr"] == 0.002
    assert groups[id(m.head.weight)]["lr"] == 0.001
    assert {g["base_lr"] for g in adamw_opt.param_groups} == {0.001}
    # a µP transformer: every AdamW parameter keeps multiplier 1, so no µP keys there either
    model = mup_tiny(64, 32)
    muon_opt, adamw_opt = muon(MuonOptions(lr=0.02, adamw_lr=0.001), model)
    assert [g["lr"] for g in muon_opt.param_groups] == [0.02]
    assert {g["lr"] for g in adamw_opt.param_groups} == {0.001}


def test_sgd_refuses_a_mup_model():
    with pytest.raises(ConfigValueError, match="sgd has no µP learning-rate rule") as info:
        sgd(SGDOptions(), mup_tiny(64, 32))
    assert info.value.field == "kind"
    [opt] = sgd(SGDOptions(lr=0.1), tiny())
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.1]
