"""µP (`parametrization: mup`): at the base width it is the standard model bit for bit; wider,
its init, logit multiplier, attention scale and learning-rate multipliers follow the formulas of
the README's µP section, checked here against numbers written by hand."""

from __future__ import annotations

import math

import attrs
import pytest
import torch

from llmtrain.core_mesh.config import Choice, ConfigError, ConfigValueError, structure
from llmtrain.core_mesh.plugins import PluginManager
from llmtrain.models import attention_masks
from llmtrain.models.config import TransformerConfig
from llmtrain.models.transformer import Attention, Transformer

# the eager FlexAttention compared below is the reference torch warns about, on purpose
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

VOCAB = 96
# each a different path through the model: RoPE/RMSNorm/SwiGLU/GQA/tied; learned
# positions/LayerNorm/GELU/biases/untied; an explicit head size; qk-norm after sublayers
SHAPES = {
    "llama": dict(
        positions="rope", norm="rmsnorm", mlp="swiglu", bias=False, n_kv_heads=2, mlp_hidden=96
    ),
    "gpt2": dict(positions="learned", norm="layernorm", mlp="gelu", tied_embeddings=False),
    "head_dim": dict(positions="rope", norm="rmsnorm", mlp="swiglu", head_dim=12, bias=False),
    "olmo2": dict(
        positions="rope",
        norm="rmsnorm",
        mlp="swiglu",
        qk_norm=True,
        qk_norm_scope="all_heads",
        norm_placement="after_sublayer",
        bias=False,
    ),
}


def config(d_model: int, shape: str = "llama", **options: object) -> TransformerConfig:
    return TransformerConfig(
        **{
            "vocab_size": VOCAB,
            "max_seq_len": 64,
            "d_model": d_model,
            "n_layers": 2,
            "n_heads": 4,
            **SHAPES[shape],
            **options,
        }
    )


def initialised(cfg: TransformerConfig, seed: int = 0) -> Transformer:
    model = Transformer(cfg)
    model.init_weights(torch.Generator().manual_seed(seed))
    return model


def tokens(B: int = 2, T: int = 24) -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(7))


# -- at the base width µP is the standard model -------------------------------------------------


@pytest.mark.parametrize("shape", list(SHAPES))
def test_at_the_base_width_mup_is_the_standard_model_bit_for_bit(shape):
    standard = config(64, shape)
    mup = attrs.evolve(standard, parametrization="mup", mup_base_width=64)
    assert mup.width_multiplier == 1.0
    a, b = initialised(standard), initialised(mup)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name
    x = tokens()
    with torch.no_grad():
        assert torch.equal(a(x), b(x))
        # the hidden states a chunked loss gets through head_fn, too
        take = lambda h, w: h  # noqa: E731
        assert torch.equal(a(x, head_fn=take), b(x, head_fn=take))
    assert b.lr_multipliers() == {}


def test_at_the_base_width_document_masking_is_the_standard_model_too(monkeypatch):
    standard = config(64, doc_masking=True)
    mup = attrs.evolve(standard, parametrization="mup", mup_base_width=64)
    a, b = initialised(standard), initialised(mup)
    starts = torch.zeros(2, 24, dtype=torch.bool)
    starts[:, [0, 5, 17]] = True
    with torch.no_grad():
        assert torch.equal(a(tokens(), starts), b(tokens(), starts))


# -- wider: the init --------------------------------------------------------------------------


@pytest.mark.parametrize("m", [2, 4])
def test_init_std_of_each_parameter_kind_follows_the_width(m):
    """d_model = 128·m over a base of 128, 4 layers: hidden matrices 0.02/sqrt(m), residual
    outputs that over sqrt(2·4) more, embeddings and head 0.02 whatever the width, norms 1,
    biases 0. A sample std of N normal draws is off by 1/sqrt(2N) relative (one sigma): each is
    held to 5 sigma, at most 1.4% here, where m = 2 already moves a hidden std by 29%."""
    d = 128 * m
    cfg = config(d, "gpt2", n_layers=4, parametrization="mup", mup_base_width=128)
    cfg = attrs.evolve(cfg, vocab_size=512, max_seq_len=256)
    model = initialised(cfg, seed=m)
    hidden = 0.02 / math.sqrt(m)
    want = {"tok_emb": 0.02, "pos_emb": 0.02, "head": 0.02}
    for i in range(4):
        for w in ("attn.wq", "attn.wk", "attn.wv", "mlp.w1"):
            want[f"blocks.{i}.{w}"] = hidden
        for w in ("attn.wo", "mlp.w2"):
            want[f"blocks.{i}.{w}"] = hidden / math.sqrt(8)
    seen = set()
    for name, p in model.named_parameters():
        module, kind = name.rsplit(".", 1)
        if kind == "bias":
            assert torch.all(p == 0), name
        elif "norm" in module:
            assert torch.all(p == 1), name
        else:
            got, sigma = p.std().item(), 1 / math.sqrt(2 * p.numel())
            assert abs(got - want[module]) <= 5 * sigma * want[module], (name, got, want[module])
            seen.add(module)
    assert seen == set(want)


# -- wider: the forward -----------------------------------------------------------------------


@pytest.mark.parametrize("m", [2, 4])
def test_the_head_sees_the_final_hidden_state_over_m(m):
    model = initialised(config(16 * m, parametrization="mup", mup_base_width=16))
    normed: list[torch.Tensor] = []
    assert model.norm is not None
    model.norm.register_forward_hook(lambda mod, args, out: normed.append(out))
    x = tokens()
    with torch.no_grad():
        logits = model(x)
        hidden = model(x, head_fn=lambda h, w: h)
    by_hand = normed[0] / m
    torch.testing.assert_close(hidden, by_hand, rtol=0, atol=0)
    assert model.tok_emb is not None
    torch.testing.assert_close(logits, by_hand @ model.tok_emb.weight.T, rtol=1e-6, atol=1e-6)


def attention_by_hand(attn: Attention, x: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal multi-head attention written out (no RoPE, no GQA, no norms)."""
    B, T, _ = x.shape
    heads = lambda y: y.view(B, T, -1, attn.head_dim).transpose(1, 2)  # noqa: E731
    q, k, v = heads(attn.wq(x)), heads(attn.wk(x)), heads(attn.wv(x))
    scores = (q @ k.transpose(-1, -2)) * scale
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    y = scores.masked_fill(future, float("-inf")).softmax(-1) @ v
    out: torch.Tensor = attn.wo(y.transpose(1, 2).reshape(B, T, -1))
    return out


# (d_model, base width, explicit head_dim or None) -> the scale by hand: sqrt(b) / head_dim
SCALES = {
    # heads widen with d_model (4 heads): head 32, at the base 16: 4/32
    (128, 64, None): 4 / 32,
    # m = 4: head 64, base head 16: 4/64, i.e. 1/head_dim scaled by sqrt(16)
    (256, 64, None): 4 / 64,
    # an explicit head size stays put as width grows: the standard 1/sqrt(24)
    (256, 64, 24): 1 / math.sqrt(24),
}


@pytest.mark.parametrize(("d_model", "base", "head_dim"), list(SCALES))
def test_attention_scores_are_scaled_by_sqrt_base_head_over_head_dim(d_model, base, head_dim):
    options = {} if head_dim is None else {"head_dim": head_dim}
    cfg = config(d_model, "gpt2", parametrization="mup", mup_base_width=base, **options)
    scale = SCALES[(d_model, base, head_dim)]
    assert cfg.attention_scale == pytest.approx(scale, rel=1e-12)
    attn = Attention(cfg)
    for p in attn.parameters():
        # O(1) scores, so that the softmax is not one-hot and the scale shows
        std = 1 / math.sqrt(d_model)
        torch.nn.init.normal_(p, std=std, generator=torch.Generator().manual_seed(3))
    x = torch.randn(2, 12, d_model, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        got = attn(x, None, None, None, 0)
        torch.testing.assert_close(got, attention_by_hand(attn, x, scale), rtol=1e-5, atol=1e-5)
        if head_dim is None:
            # the standard scale gives another output: the check can fail
            standard = attention_by_hand(attn, x, 1 / math.sqrt(cfg.head_dim))
            assert (got - standard).abs().max() > 1e-2


def test_flex_attention_gets_the_mup_scale(monkeypatch):
    """FlexAttention (documents on CUDA; forced here) and the dense mask agree under µP: both
    run with the µP scale, not their default 1/sqrt(head_dim)."""
    model = initialised(config(64, doc_masking=True, parametrization="mup", mup_base_width=16))
    starts = torch.zeros(2, 24, dtype=torch.bool)
    starts[:, [0, 5, 17]] = True
    with torch.no_grad():
        dense = model(tokens(), starts)
        monkeypatch.setattr(attention_masks, "flex_runs_here", lambda x: True)
        monkeypatch.setattr(attention_masks, "BLOCK_SIZE", 8)
        flex = model(tokens(), starts)
    torch.testing.assert_close(flex, dense, atol=2e-5, rtol=0)


# -- learning-rate multipliers ------------------------------------------------------------------


@pytest.mark.parametrize("m", [2, 4])
@pytest.mark.parametrize("tied", [True, False])
def test_lr_multipliers_are_one_over_m_for_the_hidden_matrices_only(m, tied):
    model = Transformer(
        config(16 * m, tied_embeddings=tied, parametrization="mup", mup_base_width=16)
    )
    want = {
        f"blocks.{i}.{w}.weight": 1 / m
        for i in range(2)
        for w in ("attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp.w1", "mlp.w2", "mlp.w3")
    }
    got = model.lr_multipliers()
    assert got == want
    names = dict(model.named_parameters())
    assert set(got) <= set(names)
    # the tied embedding is the output matrix too, and keeps the base rate
    assert "tok_emb.weight" not in got and ("head.weight" in names) != tied


def test_lr_multipliers_of_a_pipeline_stage_are_its_own_parameters():
    model = Transformer(config(32, "gpt2", n_layers=4, parametrization="mup", mup_base_width=16))
    model.trim_to_stage([2, 3], first=False, last=True)
    got = model.lr_multipliers()
    assert set(got) == {
        f"blocks.{i}.{w}.weight"
        for i in (2, 3)
        for w in ("attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp.w1", "mlp.w2")
    }
    assert set(got.values()) == {0.5}


def test_the_standard_model_has_no_multipliers():
    cfg = config(128)
    assert cfg.width_multiplier == 1.0 and cfg.output_multiplier == 1.0
    assert cfg.attention_scale is None
    assert Transformer(cfg).lr_multipliers() == {}


# -- options ------------------------------------------------------------------------------------


def test_mup_options_change_the_function_so_a_warm_start_compares_them():
    assert {"parametrization", "mup_base_width"}.isdisjoint(TransformerConfig.training_only)


@pytest.mark.parametrize("base", [0, -256])
def test_a_base_width_below_one_is_a_one_line_config_error(base):
    with pytest.raises(ConfigValueError) as info:
        TransformerConfig(parametrization="mup", mup_base_width=base)
    assert info.value.field == "mup_base_width"
    assert str(base) in str(info.value) and "\n" not in str(info.value)


def test_an_unknown_parametrization_is_refused():
    with pytest.raises(ValueError, match="parametrization"):
        TransformerConfig(parametrization="mu")


def test_the_multipliers_follow_d_model_over_the_base_width():
    cfg = TransformerConfig(d_model=1024, n_heads=8, parametrization="mup", mup_base_width=256)
    assert cfg.width_multiplier == 4.0 and cfg.output_multiplier == 0.25
    # head 128, head at the base 32
    assert cfg.attention_scale == pytest.approx(math.sqrt(32) / 128, rel=1e-12)
    narrow = attrs.evolve(cfg, d_model=128)
    assert narrow.width_multiplier == 0.5 and narrow.output_multiplier == 2.0


@attrs.frozen(kw_only=True)
class Schema:
    model: Choice.of("model")


def test_bad_mup_options_under_a_kind_are_reported_at_their_paths():
    plugins = PluginManager(blocked=()).load_entry_points()
    ok = structure({"model": {"kind": "tiny", "parametrization": "mup"}}, Schema, plugins=plugins)
    assert ok.model.options.parametrization == "mup" and ok.model.options.mup_base_width == 256
    with pytest.raises(ConfigError) as info:
        structure(
            {"model": {"kind": "tiny", "parametrization": "mup", "mup_base_width": 0}},
            Schema,
            plugins=plugins,
        )
    assert [p.path for p in info.value.problems] == [("model", "mup_base_width")]
    assert "model.mup_base_width: must be a positive width" in str(info.value)
    with pytest.raises(ConfigError) as info:
        structure({"model": {"kind": "tiny", "parametrization": "µP"}}, Schema, plugins=plugins)
    assert [p.path for p in info.value.problems] == [("model", "parametrization")]
