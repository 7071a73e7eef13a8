"""The MoE layer against a dense reference computation of the same experts (forward and
gradients; per-expert loop and grouped matmul), the model's description, initialisation,
generation and router statistics, and the plugin as llmtrain finds it."""

from __future__ import annotations

import subprocess
import sys

import attrs
import pytest
import torch
import torch.nn.functional as F
from llmtrain_moe.model import MoE, MoETransformer, build_model
from llmtrain_moe.options import PRESETS, MoEOptions, preset_options

from llmtrain.core_mesh.config import Choice, ConfigError, structure
from llmtrain.core_mesh.conformance import protocol_mismatches
from llmtrain.core_mesh.interfaces import LanguageModel, ModelOptions
from llmtrain.core_mesh.plugins import PluginManager
from llmtrain.models.generate import generate

LAYER = dict(vocab_size=8, d_model=16, n_heads=1, n_layers=1, mlp_hidden=24, bias=False)


def dense_reference(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """Every expert on every token, then the top-k mixture (dropped choices masked): no
    sorting, no dispatch."""
    cfg = layer.cfg
    logits = x.float() @ layer.router.weight.float().T
    probs = logits.softmax(-1)
    top, chosen = probs.topk(cfg.top_k, dim=-1)
    if layer.expert_bias is not None:  # the bias chooses, the probabilities weigh
        chosen = (probs + layer.expert_bias).topk(cfg.top_k, dim=-1).indices
        top = probs.gather(-1, chosen)
    weights = top / top.sum(-1, keepdim=True) if cfg.renormalize else top
    w1, w3, w2 = layer.experts.w1, layer.experts.w3, layer.experts.w2
    pre = torch.einsum("btd,ehd->bteh", x, w1)
    h = (
        F.silu(pre) * torch.einsum("btd,ehd->bteh", x, w3)
        if w3 is not None
        else F.gelu(pre, approximate="tanh")
    )
    every = torch.einsum("bteh,edh->bted", h, w2)  # (B, T, E, d)
    picked = every.gather(2, chosen.unsqueeze(-1).expand(-1, -1, -1, x.size(-1)))
    if cfg.capacity_factor is not None:
        from llmtrain_moe.routing import expert_capacity, within_capacity

        capacity = expert_capacity(x.size(1), cfg.n_experts, cfg.top_k, cfg.capacity_factor)
        weights = weights * within_capacity(chosen, cfg.n_experts, capacity)
    out = (picked * weights.unsqueeze(-1)).sum(2)
    if layer.shared is not None:
        out = out + layer.shared.dense(x)
    return out


def _layer(**options) -> MoE:
    torch.manual_seed(0)
    layer = MoE(MoEOptions(**{**LAYER, **options}))
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    return layer


def route_of(layer: MoE, x: torch.Tensor, bias: torch.Tensor):
    from llmtrain_moe.routing import route

    return route(x.float() @ layer.router.weight.float().T, layer.cfg.top_k, bias=bias)


def _grads(layer: MoE, x: torch.Tensor, fn) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    layer.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    out = fn(layer, x)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach(), {"x": x.grad, **{n: p.grad for n, p in layer.named_parameters()}}


CASES = {
    "swiglu-top2": dict(mlp="swiglu", n_experts=4, top_k=2),
    "gelu-top1-raw": dict(mlp="gelu", n_experts=4, top_k=1, renormalize=False),
    "swiglu-top3-shared": dict(mlp="swiglu", n_experts=6, top_k=3, shared_expert=True),
    "capacity": dict(mlp="swiglu", n_experts=4, top_k=2, capacity_factor=0.75),
    # fine-grained: many small experts, 8 a token, choices moved by the routing bias
    "fine-grained-top8": dict(mlp="swiglu", n_experts=16, top_k=8, mlp_hidden=8),
    "fine-grained-top8-bias": dict(
        mlp="swiglu", n_experts=16, top_k=8, mlp_hidden=8, renormalize=False, bias_update_rate=0.01
    ),
}


@pytest.mark.parametrize("matmul", ["loop", "grouped"])
@pytest.mark.parametrize("case", list(CASES))
def test_dispatch_equals_the_dense_reference(case, matmul):
    layer = _layer(**CASES[case], expert_matmul=matmul, aux_loss_weight=0.0)
    layer.train(False)
    if layer.expert_bias is not None:
        layer.expert_bias.copy_(torch.linspace(0.3, -0.3, 16))
        unbiased = layer.expert_bias.new_zeros(16)
        x = torch.randn(3, 10, 16, generator=torch.Generator().manual_seed(1))
        assert not torch.equal(
            route_of(layer, x, layer.expert_bias).experts, route_of(layer, x, unbiased).experts
        )  # the bias does change choices here
    x = torch.randn(3, 10, 16, generator=torch.Generator().manual_seed(1))
    out, grads = _grads(layer, x, lambda m, v: m(v))
    ref_out, ref_grads = _grads(layer, x, dense_reference)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-5, atol=1e-6, msg=name)
    if case == "capacity":
        assert int(layer.stats.dropped) > 0  # the case does drop choices
    else:
        assert int(layer.stats.dropped) == 0


def test_forward_is_deterministic_and_loop_equals_grouped_exactly_enough():
    x = torch.randn(2, 12, 16, generator=torch.Generator().manual_seed(2))
    loop, grouped = _layer(expert_matmul="loop"), _layer(expert_matmul="grouped")
    grouped.load_state_dict(loop.state_dict())
    assert torch.equal(loop(x), loop(x))
    torch.testing.assert_close(loop(x), grouped(x), rtol=1e-6, atol=1e-7)


def test_router_stats_after_a_forward():
    cfg = preset_options("moe-tiny", capacity_factor=1.0)
    torch.manual_seed(0)
    model = build_model(cfg)
    model.init_weights(torch.Generator().manual_seed(0))
    assert model.router_stats() == {}
    model(torch.randint(0, 320, (2, 16)))
    stats = model.router_stats()
    assert list(stats) == ["0", "1"]
    for layer in stats.values():
        assert len(layer["load"]) == 4 and sum(layer["load"]) == pytest.approx(1.0)
        assert layer["assignments"] == 2 * 16 * 2
        assert 0 <= layer["dropped"] <= layer["assignments"]
        assert layer["balance_loss"] >= 1.0 - 1e-6 and layer["z_loss"] > 0


def test_describe_counts_active_experts():
    with torch.device("meta"):
        model = build_model(preset_options("moe-tiny"))
    d = model.describe()
    # per block: attention 64*64*2 + 64*32*2, two norms, router 4*64, experts 4 x 3 x 64*64
    per_expert = 3 * 64 * 64
    block = 2 * 64 * 64 + 2 * 64 * 32 + 2 * 64 + 4 * 64 + 4 * per_expert
    assert d.n_non_embedding_params == 2 * block + 64
    assert d.n_params == d.n_non_embedding_params + 320 * 64
    assert model.inactive_params() == 2 * (4 - 2) * per_expert
    active = d.n_non_embedding_params - 2 * 2 * per_expert
    head = 320 * 64  # the tied head's matmul counts; the embedding lookup does not
    assert d.flops_per_token(16) == 6 * (active + head) + 12 * 2 * 4 * 16 * 16
    assert [type(b).__name__ for b in d.blocks] == ["Block", "Block"]
    assert (d.n_heads, d.n_kv_heads, d.tied_embeddings, d.trim_to_stage) == (4, 2, True, None)
    untied = build_model(preset_options("moe-tiny", tied_embeddings=False))
    assert untied.describe().trim_to_stage is MoETransformer.trim_to_stage


def test_moe_small_flops_count_the_active_experts():
    """moe-small at seq 1024, by hand: vocab 50257 padded to 50304, d 512, 8 layers, 8 heads of
    64, 4 kv heads, 8 SwiGLU experts of 1024 of which a token takes 2, tied head."""
    with torch.device("meta"):
        d = build_model(preset_options("moe-small")).describe()
    per_expert = 3 * 512 * 1024
    attention = 512 * 512 + 2 * 512 * 256 + 512 * 512
    block = attention + 2 * 512 + 8 * 512 + 8 * per_expert  # norms, router, experts
    assert d.n_non_embedding_params == 8 * block + 512 == 106_996_224
    # a token multiplies by its top 2 experts of 8, and the head's 50304 x 512
    active = 8 * (attention + 2 * 512 + 8 * 512 + 2 * per_expert) + 512 + 50_304 * 512
    assert active == 57_254_400
    assert d.flops_per_token(1024) == 6 * active + 12 * 8 * 8 * 64 * 1024 == 393_858_048


def test_olmoe_presets_count_olmoe_1b_7b_parameters():
    """olmoe-1b-7b by hand: d 2048, 16 layers of 16 heads (kv 16), query and key norms over all
    heads, 64 SwiGLU experts of 1024 of which a token takes 8, untied vocab 50304: OLMoE's 6.9B
    total and 1.3B active. olmoe-tiny has the same structure."""
    with torch.device("meta"):
        model = build_model(preset_options("olmoe-1b-7b"))
    d = model.describe()
    per_expert = 3 * 2048 * 1024
    dense = 4 * 2048 * 2048 + 2 * 2048 + 2 * 2048 + 64 * 2048  # attention, qk norms, norms, router
    embeddings = 2 * 50_304 * 2048  # untied: embedding and head
    assert d.n_params == 16 * (dense + 64 * per_expert) + 2048 + embeddings == 6_919_161_856
    active = d.n_params - model.inactive_params()
    assert active == 16 * (dense + 8 * per_expert) + 2048 + embeddings == 1_282_017_280
    assert (d.n_heads, d.n_kv_heads, d.tied_embeddings) == (16, 16, False)
    tiny, big = preset_options("olmoe-tiny"), preset_options("olmoe-1b-7b")
    # only the sizes differ
    shape = ("d_model", "n_layers", "n_heads", "n_kv_heads", "mlp_hidden", "n_experts", "top_k")
    assert [
        a.name
        for a in attrs.fields(MoEOptions)
        if a.name not in (*shape, "vocab_size", "max_seq_len")
        and getattr(tiny, a.name) != getattr(big, a.name)
    ] == []
    assert (big.qk_norm_scope, big.renormalize, big.router_z_loss) == ("all_heads", False, 0.001)
    assert (tiny.n_experts, tiny.top_k, tiny.mlp_hidden) == (16, 4, 32)


@pytest.mark.parametrize("shared_expert", [False, True])
def test_tp_plan_names_modules_of_the_model(shared_expert):
    from llmtrain.parallel.tensor_parallel import resolve_plan

    with torch.device("meta"):
        model = build_model(preset_options("moe-tiny", shared_expert=shared_expert))
    resolved = resolve_plan(model, model.tp_plan())  # strict: every entry matches
    assert resolved["blocks.1.moe.experts"] == "sequence_parallel"
    assert ("blocks.0.moe.shared" in resolved) == shared_expert
    assert not any(
        k.startswith("blocks.0.moe.") and v != "sequence_parallel" for k, v in resolved.items()
    )


def test_trim_to_stage_keeps_layer_names():
    model = build_model(preset_options("moe-tiny", tied_embeddings=False, n_layers=4))
    model.trim_to_stage([2, 3], first=False, last=True)
    assert list(model.blocks) == ["2", "3"] and model.tok_emb is None and model.head is not None
    assert list(model.router_stats()) == []
    hidden = torch.randn(1, 8, 64)
    assert model(hidden).shape == (1, 8, 320)
    assert list(model.router_stats()) == ["2", "3"]


def test_init_weights_after_meta_is_reproducible_and_scaled():
    cfg = preset_options("moe-tiny", shared_expert=True)

    def init(seed):
        with torch.device("meta"):
            model = build_model(cfg)
        model.to_empty(device="cpu")
        model.init_weights(torch.Generator().manual_seed(seed))
        return model

    a, b = init(0), init(0)
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(p, q), name
    experts = a.blocks["0"].moe.experts
    assert experts.w1.std().item() == pytest.approx(0.02, rel=0.05)
    assert experts.w2.std().item() == pytest.approx(0.02 / 2, rel=0.05)  # 0.02 / sqrt(2 * 2)
    assert a.blocks["0"].moe.shared.w2.std().item() == pytest.approx(0.01, rel=0.1)
    assert torch.equal(a.rope_cos, build_model(cfg).rope_cos)
    assert not torch.equal(init(1).blocks["0"].moe.router.weight, a.blocks["0"].moe.router.weight)


def test_cached_generation_equals_uncached():
    torch.manual_seed(0)
    model = build_model(preset_options("moe-tiny", max_seq_len=48))
    model.init_weights(torch.Generator().manual_seed(0))
    prompt = torch.tensor([[5, 6, 7, 8]])
    kwargs = dict(temperature=0.0, vocab_size=300)
    cached = generate(model, prompt, 20, use_cache=True, **kwargs)
    uncached = generate(model, prompt, 20, use_cache=False, **kwargs)
    assert cached.shape == (1, 24) and torch.equal(cached, uncached)


def test_meta_forward_for_memory_estimates():
    with torch.device("meta"):
        model = build_model(preset_options("moe-small", capacity_factor=1.25))
        logits = model(torch.zeros(2, 64, dtype=torch.long))
    assert logits.shape == (2, 64, 50304) and logits.is_meta


def test_plugin_entry_point_registers_the_presets_without_importing_torch():
    code = (
        "import sys, llmtrain_moe.plugin; "
        "assert 'torch' not in sys.modules, 'the entry point imported torch'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    plugins = PluginManager(blocked=()).load_entry_points()
    assert {"moe-tiny", "moe-small", "olmoe-tiny", "olmoe-1b-7b"} <= set(
        plugins.registry("model").names()
    )
    entry = plugins.registry("model").get("moe-tiny")
    assert entry.origin.distribution == "llmtrain-moe" and entry.defaults == PRESETS["moe-tiny"]
    model = plugins.build("model", Choice.of("model")("moe-tiny"))
    assert isinstance(model, MoETransformer) and model.cfg == preset_options("moe-tiny")


def test_the_options_are_what_the_trainer_reads():
    """core-mesh's ModelOptions, and the MoE losses and kernels are training-only options."""
    assert protocol_mismatches(MoEOptions, ModelOptions) == []
    assert {"aux_loss_weight", "expert_matmul"} <= MoEOptions.training_only
    assert MoEOptions.training_only <= {a.name for a in attrs.fields(MoEOptions)}


def test_the_model_keeps_the_language_model_contract():
    """core-mesh's LanguageModel (generate, eval, downstream scoring, lm-eval): the MoE model
    reuses the Transformer's forward and cache with its own block."""
    assert protocol_mismatches(MoETransformer, LanguageModel) == []
    model = build_model(preset_options("moe-tiny"))
    assert isinstance(model, LanguageModel) and model.options == preset_options("moe-tiny")
    assert MoETransformer.packed_rows


@attrs.frozen
class Schema:
    model: Choice.of("model")


def test_config_errors_name_the_option():
    plugins = PluginManager(blocked=()).load_entry_points()
    ok = structure({"model": {"kind": "moe-small", "n_layers": 2}}, Schema, plugins=plugins)
    assert ok.model.options.n_layers == 2 and ok.model.options.n_experts == 8
    with pytest.raises(ConfigError) as info:
        structure({"model": {"kind": "moe-tiny", "top_k": 5}}, Schema, plugins=plugins)
    assert "model.top_k: must be at most n_experts=4, got 5" in str(info.value)
    with pytest.raises(ConfigError) as info:
        structure(
            {"model": {"kind": "moe-tiny", "capacity_factor": 0, "aux_loss_weight": -1.0,
                       "expert_matmul": "fast", "bias_update_rate": -0.001}},
            Schema,
            plugins=plugins,
        )  # fmt: skip
    text = str(info.value)
    for key in ("capacity_factor", "aux_loss_weight", "expert_matmul", "bias_update_rate"):
        assert f"model.{key}" in text, text


def test_dense_options_the_moe_block_does_not_have_are_refused():
    plugins = PluginManager(blocked=()).load_entry_points()
    for key, value, message in (
        ("norm_placement", "after_sublayer", "the MoE block normalises each branch's input (pre)"),
        ("norm_placement", "sandwich", "the MoE block normalises each branch's input (pre)"),
        ("mlp", "geglu", "the experts are swiglu or gelu; geglu is not built for them"),
        ("mlp_bias", True, "the experts have no biases"),
        ("parametrization", "mup", "mup is not supported for Mixture-of-Experts models yet"),
    ):
        with pytest.raises(ConfigError) as info:
            structure({"model": {"kind": "moe-tiny", key: value}}, Schema, plugins=plugins)
        assert f"model.{key}: {message}" in str(info.value)


def test_a_query_key_norm_over_all_heads_leaves_no_tp_plan():
    """The parallel package then refuses mesh.tp > 1 by name instead of normalising shards."""
    assert build_model(preset_options("moe-tiny", qk_norm=True)).tp_plan() != {}
    model = build_model(preset_options("moe-tiny", qk_norm=True, qk_norm_scope="all_heads"))
    assert model.tp_plan() == {}
    assert model.describe().tp_plan == {}
