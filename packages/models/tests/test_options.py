"""The transformer's newer options, each on its own and together: head_dim, per-projection biases,
qk_norm_scope, norm_placement and rope_scaling, and Gemma's (GeGLU, sandwich norms, embedding
scale, soft-capped scores and logits, sliding windows with their own RoPE base, linear RoPE
scaling, an explicit attention scale). The numbers come from attention, norms and Llama 3's
frequency rule written out here with plain torch ops; then config errors, the TP plan, and a short
training run per option."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from llmtrain.core_mesh.config import ConfigError, format_path, structure, unstructure
from llmtrain.models import transformer
from llmtrain.models.config import AttentionOptions, RopeScaling, TransformerConfig
from llmtrain.models.transformer import Attention, Block, Transformer, rope_frequencies

VOCAB = 64
LLAMA = dict(positions="rope", norm="rmsnorm", mlp="swiglu", bias=False, mlp_multiple_of=16)
GPT2 = dict(positions="learned", norm="layernorm", mlp="gelu", bias=True)
# OLMo-2: whole-projection qk-norm, norms on the branch outputs, no biases, untied head
OLMO2 = dict(
    LLAMA,
    rope_base=500000.0,
    qk_norm=True,
    qk_norm_scope="all_heads",
    norm_placement="after_sublayer",
    tied_embeddings=False,
)
# Qwen3: per-head qk-norm, attention width n_heads x head_dim wider than d_model, GQA
QWEN3 = dict(LLAMA, rope_base=1e6, qk_norm=True, head_dim=16, n_kv_heads=2)
# Llama 3.1: RoPE stretched from a shorter original context
LLAMA31 = dict(
    LLAMA,
    rope_base=500000.0,
    rope_scaling=RopeScaling(factor=8.0, original_max_seq_len=16),
    n_kv_heads=2,
)
ROPE_SCALED = RopeScaling(
    factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=8
)
GEMMA = dict(LLAMA, mlp="geglu", norm_placement="sandwich", scale_embeddings=True, n_kv_heads=2)
# Gemma 2: local and global blocks, soft-capped scores and logits, its own attention scale
GEMMA2 = dict(
    GEMMA,
    head_dim=12,
    logit_softcap=5.0,
    attention=AttentionOptions(window=4, pattern=("local", "global"), softcap=2.0, scale=0.2),
)
# Gemma 3: local blocks (five to a global one; here the second block) with their own RoPE base,
# the global ones' linearly scaled; per-head qk-norm
GEMMA3 = dict(
    GEMMA,
    qk_norm=True,
    rope_base=1e6,
    rope_scaling=RopeScaling(kind="linear", factor=4.0),
    attention=AttentionOptions(
        window=3, pattern=("global", "local"), local_rope_base=1e4, scale=0.25
    ),
)

# each option on its own, over a llama- or gpt2-style base, then the families that combine them
OPTION_CASES = {
    "head_dim-wider": dict(LLAMA, d_model=32, n_heads=4, head_dim=12),
    "head_dim-narrower-gqa": dict(LLAMA, d_model=48, n_heads=4, head_dim=8, n_kv_heads=2),
    "head_dim-indivisible": dict(LLAMA, d_model=30, n_heads=4, head_dim=8),
    "head_dim-learned": dict(GPT2, d_model=32, n_heads=4, head_dim=6),
    "qkv_bias": dict(LLAMA, qkv_bias=True),
    "out_bias": dict(LLAMA, out_bias=True),
    "mlp_bias": dict(LLAMA, mlp_bias=True),
    "gpt2-no-mlp-bias": dict(GPT2, mlp_bias=False),
    "qk_norm-head": dict(LLAMA, qk_norm=True, qk_norm_scope="head", n_kv_heads=2),
    "qk_norm-all_heads": dict(LLAMA, qk_norm=True, qk_norm_scope="all_heads", n_kv_heads=2),
    "after_sublayer-rms": dict(LLAMA, norm_placement="after_sublayer"),
    "after_sublayer-layernorm": dict(GPT2, norm_placement="after_sublayer"),
    "rope_scaling": dict(LLAMA, rope_scaling=ROPE_SCALED),
    "olmo2": OLMO2,
    "qwen3": QWEN3,
    "llama31": LLAMA31,
    "geglu": dict(LLAMA, mlp="geglu"),
    "sandwich": dict(LLAMA, norm_placement="sandwich"),
    "scale_embeddings": dict(GPT2, scale_embeddings=True),
    "logit_softcap": dict(LLAMA, logit_softcap=2.0),
    "window": dict(GPT2, attention=AttentionOptions(window=3)),
    "attention-softcap": dict(LLAMA, attention=AttentionOptions(softcap=1.0)),
    "attention-scale": dict(LLAMA, attention=AttentionOptions(scale=0.5)),
    "rope_scaling-linear": dict(LLAMA, rope_scaling=RopeScaling(kind="linear", factor=4.0)),
    "gemma2": GEMMA2,
    "gemma3": GEMMA3,
}


def config(**overrides) -> TransformerConfig:
    fields = dict(vocab_size=VOCAB, max_seq_len=32, d_model=32, n_layers=1, n_heads=4, init_std=0.1)
    fields.update(overrides)
    return TransformerConfig(**fields)


def perturbed_model(cfg: TransformerConfig, seed: int = 0) -> Transformer:
    """A model with every parameter away from its initial value (biases not 0, norm weights
    not 1), so a reference that drops or misplaces any of them disagrees."""
    torch.manual_seed(seed)
    model = Transformer(cfg)
    gen = torch.Generator().manual_seed(seed)
    model.init_weights(gen)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return model.eval()


def tokens_for(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


# -- the reference: a decoder written out by hand -------------------------------------------------


def llama3_frequencies(
    head_dim: int, base: float, factor: float, low: float, high: float, original: int
) -> list[float]:
    """Llama 3's rule, one frequency at a time in float64."""
    out = []
    for i in range(head_dim // 2):
        f = base ** (-2 * i / head_dim)
        wavelength = 2 * math.pi / f
        if wavelength > original / low:
            f = f / factor
        elif wavelength >= original / high:
            smooth = (original / wavelength - low) / (high - low)
            f = (1 - smooth) * f / factor + smooth * f
        out.append(f)
    return out


def reference_frequencies(cfg: TransformerConfig, local: bool = False) -> torch.Tensor:
    """The frequencies of a block: a local one's with `local_rope_base` unscaled, else
    `rope_base`'s, scaled."""
    hd, s = cfg.head_dim, cfg.rope_scaling
    if local and cfg.attention.local_rope_base is not None:
        freqs = [cfg.attention.local_rope_base ** (-2 * i / hd) for i in range(hd // 2)]
    elif s is None:
        freqs = [cfg.rope_base ** (-2 * i / hd) for i in range(hd // 2)]
    elif s.kind == "linear":
        freqs = [cfg.rope_base ** (-2 * i / hd) / s.factor for i in range(hd // 2)]
    else:
        freqs = llama3_frequencies(
            hd,
            cfg.rope_base,
            s.factor,
            s.low_freq_factor,
            s.high_freq_factor,
            s.original_max_seq_len,
        )
    return torch.tensor(freqs, dtype=torch.float64)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def layer_norm(x, weight, bias, eps):
    centred = x - x.mean(-1, keepdim=True)
    y = centred / torch.sqrt(centred.pow(2).mean(-1, keepdim=True) + eps) * weight
    return y if bias is None else y + bias


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, heads, T, head_dim): pair (x[i], x[i + half]) turned by its angle."""
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class Reference:
    """The model's function from its named parameters alone."""

    def __init__(self, model: Transformer):
        self.cfg = model.cfg
        self.p = dict(model.named_parameters())

    def linear(self, name: str, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.p[f"{name}.weight"].T
        bias = self.p.get(f"{name}.bias")
        return y if bias is None else y + bias

    def norm(self, name: str, x: torch.Tensor) -> torch.Tensor:
        if self.cfg.norm == "rmsnorm":
            return rms_norm(x, self.p[f"{name}.weight"], self.cfg.norm_eps)
        return layer_norm(
            x, self.p[f"{name}.weight"], self.p.get(f"{name}.bias"), self.cfg.norm_eps
        )

    def attention(
        self, layer: str, x: torch.Tensor, angles: torch.Tensor | None, window: int | None = None
    ) -> torch.Tensor:
        cfg = self.cfg
        B, T, _ = x.shape
        h, kv, hd = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        q, k, v = (self.linear(f"{layer}.attn.{w}", x) for w in ("wq", "wk", "wv"))
        q_w, k_w = (
            self.p.get(f"{layer}.attn.q_norm.weight"),
            self.p.get(f"{layer}.attn.k_norm.weight"),
        )
        if cfg.qk_norm and cfg.qk_norm_scope == "all_heads":
            q, k = rms_norm(q, q_w, cfg.norm_eps), rms_norm(k, k_w, cfg.norm_eps)
        q = q.reshape(B, T, h, hd).transpose(1, 2)
        k = k.reshape(B, T, kv, hd).transpose(1, 2)
        v = v.reshape(B, T, kv, hd).transpose(1, 2)
        if cfg.qk_norm and cfg.qk_norm_scope == "head":
            q, k = rms_norm(q, q_w, cfg.norm_eps), rms_norm(k, k_w, cfg.norm_eps)
        if angles is not None:
            cos, sin = angles.cos().float(), angles.sin().float()
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        k = k.repeat_interleave(h // kv, dim=1)  # query head i reads kv head i // group
        v = v.repeat_interleave(h // kv, dim=1)
        scale = cfg.attention.scale if cfg.attention.scale is not None else 1 / math.sqrt(hd)
        scores = q @ k.transpose(-1, -2) * scale
        if cfg.attention.softcap is not None:
            scores = cfg.attention.softcap * torch.tanh(scores / cfg.attention.softcap)
        back = torch.arange(T)[:, None] - torch.arange(T)[None, :]  # how far back the key is
        visible = (back >= 0) & (back < (window or T))
        y = scores.masked_fill(~visible, float("-inf")).softmax(-1) @ v
        return self.linear(f"{layer}.attn.wo", y.transpose(1, 2).reshape(B, T, h * hd))

    def mlp(self, layer: str, x: torch.Tensor) -> torch.Tensor:
        a = self.linear(f"{layer}.mlp.w1", x)
        gelu = 0.5 * a * (1 + torch.tanh(math.sqrt(2 / math.pi) * (a + 0.044715 * a**3)))
        if self.cfg.mlp == "swiglu":
            hidden = a * torch.sigmoid(a) * self.linear(f"{layer}.mlp.w3", x)
        elif self.cfg.mlp == "geglu":
            hidden = gelu * self.linear(f"{layer}.mlp.w3", x)
        else:
            hidden = gelu
        return self.linear(f"{layer}.mlp.w2", hidden)

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        cfg, p = self.cfg, self.p
        T = tokens.shape[1]
        h = p["tok_emb.weight"][tokens]
        if cfg.scale_embeddings:
            h = h * math.sqrt(cfg.d_model)
        if cfg.positions == "learned":
            h = h + p["pos_emb.weight"][:T]
        for i in range(cfg.n_layers):
            layer = f"blocks.{i}"
            # a local block (pattern repeated from the first block) sees its window
            local = cfg.attention.pattern[i % len(cfg.attention.pattern)] == "local"
            window = cfg.attention.window if local else None
            angles = None
            if cfg.positions == "rope":
                freqs = reference_frequencies(cfg, local=window is not None)
                angles = torch.arange(T, dtype=torch.float64)[:, None] * freqs
            norm = lambda name, x, layer=layer: self.norm(f"{layer}.{name}", x)  # noqa: E731
            if cfg.norm_placement == "pre":
                h = h + self.attention(layer, norm("attn_norm", h), angles, window)
                h = h + self.mlp(layer, norm("mlp_norm", h))
            elif cfg.norm_placement == "sandwich":
                attended = self.attention(layer, norm("attn_norm", h), angles, window)
                h = h + norm("attn_out_norm", attended)
                h = h + norm("mlp_out_norm", self.mlp(layer, norm("mlp_norm", h)))
            else:
                h = h + norm("attn_norm", self.attention(layer, h, angles, window))
                h = h + norm("mlp_norm", self.mlp(layer, h))
        h = self.norm("norm", h)
        logits = h @ p.get("head.weight", p["tok_emb.weight"]).T
        if cfg.logit_softcap is not None:
            logits = cfg.logit_softcap * torch.tanh(logits / cfg.logit_softcap)
        return logits


@pytest.mark.parametrize("options", OPTION_CASES.values(), ids=OPTION_CASES.keys())
def test_logits_equal_the_hand_written_decoder(options):
    model = perturbed_model(config(n_layers=2, **options))
    tokens = tokens_for(2, 12)
    with torch.no_grad():
        got = model(tokens)
        want = Reference(model).logits(tokens)
    assert got.shape == (2, 12, VOCAB)
    assert want.abs().max() > 0.1  # logits big enough for a misplaced piece to show
    torch.testing.assert_close(got, want, atol=5e-5, rtol=1e-4)


def test_the_reference_tells_the_options_apart():
    """The reference is not blind to the options it checks: flipping one moves the logits."""
    tokens = tokens_for(2, 12)
    flips = {
        "norm_placement": ("pre", "after_sublayer"),
        "rope_scaling": (None, ROPE_SCALED),
        "mlp": ("swiglu", "geglu"),
        "scale_embeddings": (False, True),
        "logit_softcap": (None, 2.0),
        "attention": (AttentionOptions(), AttentionOptions(window=3)),
    }
    for attention in (
        AttentionOptions(softcap=1.0),
        AttentionOptions(scale=0.5),
        AttentionOptions(window=3, pattern=("global", "local")),
    ):
        flips[f"attention={attention}"] = (AttentionOptions(), attention)
    for key, (one, other) in flips.items():
        field = key.split("=")[0]
        model = perturbed_model(config(**{**LLAMA, "n_layers": 2, field: one}))
        flipped = perturbed_model(config(**{**LLAMA, "n_layers": 2, field: other}))
        flipped.load_state_dict(model.state_dict())
        with torch.no_grad():
            moved = (Reference(model).logits(tokens) - Reference(flipped).logits(tokens)).abs()
        assert moved.max() > 1e-2, key


@pytest.mark.parametrize(
    "options",
    [
        OPTION_CASES[k]
        for k in ("head_dim-wider", "head_dim-indivisible", "olmo2", "qwen3", "llama31")
    ],
    ids=["head_dim-wider", "head_dim-indivisible", "olmo2", "qwen3", "llama31"],
)
def test_cached_decoding_equals_the_uncached_forward(options):
    model = perturbed_model(config(n_layers=2, **options))
    tokens = tokens_for(2, 10)
    cache = model.new_cache(2, 10)
    with torch.no_grad():
        full = model(tokens)
        steps = [model(tokens[:, :4], cache=cache, start_pos=0)]
        steps += [model(tokens[:, t : t + 1], cache=cache, start_pos=t) for t in range(4, 10)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=2e-5, rtol=1e-4)


# -- head_dim -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("d_model", "n_heads", "head_dim", "n_kv_heads"),
    [(48, 4, 16, 2), (48, 4, 16, None), (50, 4, 8, 2), (32, 8, 2, 4)],
)
def test_head_dim_sets_the_projection_shapes(d_model, n_heads, head_dim, n_kv_heads):
    cfg = config(
        **LLAMA, d_model=d_model, n_heads=n_heads, head_dim=head_dim, n_kv_heads=n_kv_heads
    )
    assert cfg.head_dim == head_dim
    kv = n_kv_heads or n_heads
    model = Transformer(cfg)
    attn = model.blocks["0"].attn
    assert attn.wq.weight.shape == (n_heads * head_dim, d_model)
    assert attn.wk.weight.shape == (kv * head_dim, d_model)
    assert attn.wv.weight.shape == (kv * head_dim, d_model)
    assert attn.wo.weight.shape == (d_model, n_heads * head_dim)
    assert model.rope_cos.shape == (cfg.max_seq_len, head_dim // 2)
    cache = model.new_cache(3, 7)
    assert cache[0].k.shape == (3, kv, 7, head_dim)


def test_head_dim_counts_parameters_and_flops():
    cfg = config(
        **LLAMA, d_model=48, n_heads=4, head_dim=16, n_kv_heads=2, mlp_hidden=96, n_layers=2
    )
    d = 48
    attention = d * 64 + d * 32 + d * 32 + 64 * d  # wq, wk and wv (2 kv heads x 16), wo
    mlp = 3 * d * 96
    block = attention + mlp + 2 * d  # and two RMSNorm weights
    embedding = VOCAB * d
    want = embedding + 2 * block + d  # the final norm; the head is tied
    desc = Transformer(cfg).describe()
    assert desc.n_params == want == 49392
    assert desc.n_non_embedding_params == want - embedding
    # the attention term counts the attention width n_heads x head_dim = 64, not d_model = 48
    # the tied head multiplies by the embedding: its V x d counts as a matmul, the lookup not
    assert desc.flops_per_token(10) == 6 * want + 12 * 2 * 64 * 10


def test_head_dim_structures_from_yaml_and_round_trips():
    raw = {"d_model": 50, "n_heads": 4, "head_dim": 8, "positions": "rope", "vocab_size": 64}
    cfg = structure(raw, TransformerConfig)
    assert cfg.head_dim == 8
    dumped = unstructure(cfg)
    assert dumped["head_dim"] == 8
    assert "_head_dim" not in dumped
    assert structure(dumped, TransformerConfig) == cfg
    plain = structure({"d_model": 48, "n_heads": 4}, TransformerConfig)
    assert plain.head_dim == 12  # d_model / n_heads
    assert unstructure(plain)["head_dim"] is None  # not frozen to the derived value
    assert structure(unstructure(plain), TransformerConfig) == plain


# -- per-projection biases ------------------------------------------------------------------------

LINEARS = ("attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp.w1", "mlp.w2", "mlp.w3")
QKV, OUT, MLP = {"attn.wq", "attn.wk", "attn.wv"}, {"attn.wo"}, {"mlp.w1", "mlp.w2", "mlp.w3"}


@pytest.mark.parametrize(
    ("options", "with_bias"),
    [
        (dict(bias=False), set()),
        (dict(bias=True), QKV | OUT | MLP),
        (dict(bias=False, qkv_bias=True), QKV),
        (dict(bias=False, out_bias=True), OUT),
        (dict(bias=False, mlp_bias=True), MLP),
        (dict(bias=True, qkv_bias=False), OUT | MLP),
        (dict(bias=True, out_bias=False), QKV | MLP),
        (dict(bias=True, mlp_bias=False), QKV | OUT),
        (dict(bias=False, qkv_bias=False, out_bias=True, mlp_bias=True), OUT | MLP),
    ],
    ids=lambda v: "-".join(f"{k}={x}" for k, x in v.items()) if isinstance(v, dict) else None,
)
@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_which_linears_have_a_bias(options, with_bias, norm):
    cfg = config(
        norm=norm,
        mlp="swiglu",
        mlp_hidden=40,
        n_kv_heads=2,
        tied_embeddings=False,
        n_layers=2,
        **options,
    )
    model = Transformer(cfg)
    for i in ("0", "1"):
        block = model.blocks[i]
        for name in LINEARS:
            linear = block.get_submodule(name)
            assert (linear.bias is not None) == (name in with_bias), (i, name)
            if linear.bias is not None:
                assert linear.bias.shape == (linear.weight.shape[0],)
    assert model.head.bias is None  # the output head never has one
    norms = [m for m in model.modules() if isinstance(m, (nn.LayerNorm, nn.RMSNorm))]
    assert len(norms) == 2 * 2 + 1
    for m in norms:
        if norm == "layernorm":
            assert (m.bias is not None) == cfg.bias  # the norms follow `bias` alone
        else:
            assert not hasattr(m, "bias") or m.bias is None
    n_bias = sum(p.numel() for n, p in model.named_parameters() if n.endswith(".bias"))
    widths = {"attn.wq": 32, "attn.wk": 16, "attn.wv": 16, "attn.wo": 32}
    widths |= {"mlp.w1": 40, "mlp.w3": 40, "mlp.w2": 32}
    want = 2 * sum(widths[name] for name in with_bias)  # two layers
    if norm == "layernorm" and cfg.bias:
        want += 5 * 32
    assert n_bias == want


def test_bias_options_follow_bias_unless_set_and_round_trip():
    for bias in (True, False):
        cfg = structure({"bias": bias}, TransformerConfig)
        assert (cfg.qkv_bias, cfg.out_bias, cfg.mlp_bias) == (bias, bias, bias)
        dumped = unstructure(cfg)
        assert (dumped["qkv_bias"], dumped["out_bias"], dumped["mlp_bias"]) == (None, None, None)
    qwen2 = structure({"bias": False, "qkv_bias": True}, TransformerConfig)
    assert (qwen2.qkv_bias, qwen2.out_bias, qwen2.mlp_bias) == (True, False, False)
    dumped = unstructure(qwen2)
    assert (dumped["qkv_bias"], dumped["out_bias"], dumped["mlp_bias"]) == (True, None, None)
    assert not any(key.startswith("_") for key in dumped)
    assert structure(dumped, TransformerConfig) == qwen2


# -- qk_norm_scope --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("scope", "q_shape", "k_shape"), [("head", (8,), (8,)), ("all_heads", (32,), (16,))]
)
def test_qk_norm_weight_shapes(scope, q_shape, k_shape):
    cfg = config(**LLAMA, qk_norm=True, qk_norm_scope=scope, n_kv_heads=2)
    assert cfg.head_dim == 8
    attn = Transformer(cfg).blocks["0"].attn
    assert attn.q_norm.weight.shape == q_shape
    assert attn.k_norm.weight.shape == k_shape
    without = Transformer(config(**LLAMA, qk_norm=False, qk_norm_scope=scope)).blocks["0"].attn
    assert without.q_norm is None and without.k_norm is None


def _normalised_queries(attn: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The q_norm output of one attention call, as (B, T, heads, head_dim)."""
    seen = []
    handle = attn.q_norm.register_forward_hook(lambda module, args, out: seen.append(out))
    try:
        attn(x, None, None, None, 0)
    finally:
        handle.remove()
    (out,) = seen
    return out.reshape(*x.shape[:2], -1, attn.head_dim).clone()


@pytest.mark.parametrize("scope", ["head", "all_heads"])
def test_one_heads_query_scale_reaches_other_heads_only_with_all_heads(scope):
    cfg = config(**LLAMA, qk_norm=True, qk_norm_scope=scope, n_kv_heads=2)
    attn = perturbed_model(cfg).blocks["0"].attn
    hd = cfg.head_dim
    x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        before = _normalised_queries(attn, x)
        q = x @ attn.wq.weight.T  # the raw projection, before the scale
        attn.wq.weight[:hd] *= 3.0  # head 0's rows
        after = _normalised_queries(attn, x)
    others = slice(1, None)
    if scope == "head":
        # each head is normalised on its own: the others do not move, head 0 is scale-free
        torch.testing.assert_close(after[:, :, others], before[:, :, others], atol=1e-6, rtol=0)
        torch.testing.assert_close(after[:, :, 0], before[:, :, 0], atol=1e-4, rtol=0)
    else:
        # the other heads shrink by rms(old projection) / rms(new projection), per token
        scaled = q.clone()
        scaled[..., :hd] *= 3.0
        eps = cfg.norm_eps
        ratio = torch.sqrt(q.pow(2).mean(-1) + eps) / torch.sqrt(scaled.pow(2).mean(-1) + eps)
        assert (ratio < 0.95).all()
        want = before[:, :, others] * ratio[..., None, None]
        torch.testing.assert_close(after[:, :, others], want, atol=1e-5, rtol=1e-4)
        assert (after[:, :, others] - before[:, :, others]).abs().max() > 1e-2


def test_all_heads_qk_norm_is_rms_norm_over_the_whole_projection():
    cfg = config(**LLAMA, qk_norm=True, qk_norm_scope="all_heads", n_kv_heads=2)
    attn = perturbed_model(cfg).blocks["0"].attn
    x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(4))
    seen = {}
    hooks = [
        attn.q_norm.register_forward_hook(lambda m, a, out: seen.__setitem__("q", out)),
        attn.k_norm.register_forward_hook(lambda m, a, out: seen.__setitem__("k", out)),
    ]
    with torch.no_grad():
        attn(x, None, None, None, 0)
        q, k = x @ attn.wq.weight.T, x @ attn.wk.weight.T
        want_q = q / torch.sqrt(q.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * attn.q_norm.weight
        want_k = k / torch.sqrt(k.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * attn.k_norm.weight
        # per head it would be another thing: the test can tell the two apart
        per_head = q.reshape(2, 6, 4, 8)
        per_head = per_head / torch.sqrt(per_head.pow(2).mean(-1, keepdim=True) + cfg.norm_eps)
    for h in hooks:
        h.remove()
    assert seen["q"].shape == (2, 6, 32) and seen["k"].shape == (2, 6, 16)
    torch.testing.assert_close(seen["q"], want_q, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(seen["k"], want_k, atol=1e-6, rtol=1e-5)
    assert (per_head.reshape(2, 6, 32) * attn.q_norm.weight - want_q).abs().max() > 1e-2


# -- norm_placement -------------------------------------------------------------------------------


@pytest.mark.parametrize("style", [LLAMA, GPT2], ids=["llama", "gpt2"])
def test_after_sublayer_block_normalises_each_branch_output(style):
    model = perturbed_model(config(**style, norm_placement="after_sublayer"))
    block = model.blocks["0"]
    x = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(5))
    rope = None
    if style["positions"] == "rope":
        rope = (model.rope_cos[:9][None, :, None], model.rope_sin[:9][None, :, None])
    with torch.no_grad():
        got = block(x, rope)
        x1 = x + block.attn_norm(block.attn(x, rope, None, None, 0))
        want = x1 + block.mlp_norm(block.mlp(x1))
        pre_style = x + block.attn(block.attn_norm(x), rope, None, None, 0)
        pre_style = pre_style + block.mlp(block.mlp_norm(pre_style))
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    assert (got - pre_style).abs().max() > 0.1


@pytest.mark.parametrize("style", [LLAMA, GPT2], ids=["llama", "gpt2"])
def test_after_sublayer_differs_from_pre_with_the_same_weights(style):
    after = perturbed_model(config(**style, norm_placement="after_sublayer"))
    pre = Transformer(config(**style, norm_placement="pre")).eval()
    pre.load_state_dict(after.state_dict(), strict=True)  # same parameters, same names
    x = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(6))
    tokens = tokens_for(2, 9)
    with torch.no_grad():
        pre_block = pre.blocks["0"]
        assert (after.blocks["0"](x) - pre_block(x)).abs().max() > 0.1
        x1 = x + pre_block.attn(pre_block.attn_norm(x), None, None, None, 0)
        want = x1 + pre_block.mlp(pre_block.mlp_norm(x1))
        torch.testing.assert_close(pre_block(x), want, atol=1e-6, rtol=1e-5)
        assert (after(tokens) - pre(tokens)).abs().max() > 0.1


# -- Gemma's options -------------------------------------------------------------------------------


def gelu_tanh(a: torch.Tensor) -> torch.Tensor:
    return 0.5 * a * (1 + torch.tanh(math.sqrt(2 / math.pi) * (a + 0.044715 * a**3)))


def test_geglu_is_w2_of_gelu_of_w1_times_w3():
    cfg = config(**{**LLAMA, "mlp": "geglu", "mlp_bias": True})
    assert cfg.hidden_size == 96  # gated: 8 d / 3 = 85 rounded up to a multiple of 16
    mlp = perturbed_model(cfg).blocks["0"].mlp
    assert isinstance(mlp, transformer.MLP) and mlp.w3 is not None
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(1))
    w = {name: getattr(mlp, name) for name in ("w1", "w2", "w3")}
    with torch.no_grad():
        hidden = gelu_tanh(x @ w["w1"].weight.T + w["w1"].bias) * (
            x @ w["w3"].weight.T + w["w3"].bias
        )
        want = hidden @ w["w2"].weight.T + w["w2"].bias
        got = mlp(x)
        swiglu = mlp.w2(torch.nn.functional.silu(mlp.w1(x)) * mlp.w3(x))
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    assert (got - swiglu).abs().max() > 1e-2


def test_sandwich_block_normalises_each_branch_before_and_after():
    """x + attn_out_norm(attn(attn_norm(x))), then h + mlp_out_norm(mlp(mlp_norm(h))): four
    RMSNorms of their own (weights perturbed apart), Gemma 2's and 3's block."""
    model = perturbed_model(config(**GEMMA))
    block = model.blocks["0"]
    assert isinstance(block, Block)
    names = {"attn_norm", "attn_out_norm", "mlp_norm", "mlp_out_norm"}
    assert names <= {name for name, _ in block.named_children()}
    x = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(5))
    rope = (model.rope_cos[:9][None, :, None], model.rope_sin[:9][None, :, None])
    norm = {n: lambda y, n=n: rms_norm(y, getattr(block, n).weight, 1e-5) for n in names}
    with torch.no_grad():
        got = block(x, rope)
        h = x + norm["attn_out_norm"](block.attn(norm["attn_norm"](x), rope, None, None, 0))
        want = h + norm["mlp_out_norm"](block.mlp(norm["mlp_norm"](h)))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # the TP plan places the extra norms (alike), which a model without them leaves out
    plan = model.tp_plan()
    assert plan["blocks.*.attn_out_norm"] == plan["blocks.*.mlp_out_norm"]
    assert "blocks.*.attn_out_norm" not in Transformer(config(**LLAMA)).tp_plan()


@pytest.mark.parametrize("positions", ["rope", "learned"])
def test_scale_embeddings_multiplies_the_embeddings_by_sqrt_d_model(positions):
    style = LLAMA if positions == "rope" else GPT2
    scaled = perturbed_model(config(**style, scale_embeddings=True))
    plain = Transformer(config(**style)).eval()
    plain.load_state_dict(scaled.state_dict())
    tokens = tokens_for(2, 7)
    seen = []
    for model in (scaled, plain):
        model.blocks["0"].register_forward_pre_hook(lambda m, args: seen.append(args[0]))
        with torch.no_grad():
            model(tokens)
    emb = scaled.tok_emb.weight[tokens]
    pos = 0 if positions == "rope" else scaled.pos_emb.weight[:7]
    torch.testing.assert_close(seen[0], emb * math.sqrt(32) + pos, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(seen[1], emb + pos, atol=0, rtol=0)


def test_logit_softcap_caps_the_logits_and_refuses_a_head_fn():
    capped = perturbed_model(config(**LLAMA, logit_softcap=2.0))
    raw_model = Transformer(config(**LLAMA)).eval()
    raw_model.load_state_dict(capped.state_dict())
    tokens = tokens_for(2, 9)
    with torch.no_grad():
        got, raw = capped(tokens), raw_model(tokens)
    assert raw.abs().max() > 2.0  # the cap bites
    assert got.abs().max() < 2.0
    torch.testing.assert_close(got, 2.0 * torch.tanh(raw / 2.0), atol=1e-6, rtol=1e-6)
    # a loss that runs the output projection itself would skip the cap
    assert not capped.describe().takes_head_fn and raw_model.describe().takes_head_fn
    with pytest.raises(ValueError, match="soft-capped logits need the output projection"):
        capped(tokens, head_fn=lambda h, w: h @ w.T)


def attention_by_hand(attn: Attention, x: torch.Tensor, scale: float, softcap: float | None):
    """Causal grouped-query attention written out: scores scaled, soft-capped, masked."""
    B, T, _ = x.shape
    heads = lambda y: y.view(B, T, -1, attn.head_dim).transpose(1, 2)  # noqa: E731
    q, k, v = heads(attn.wq(x)), heads(attn.wk(x)), heads(attn.wv(x))
    group = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = (q @ k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    y = scores.masked_fill(future, float("-inf")).softmax(-1) @ v
    return attn.wo(y.transpose(1, 2).reshape(B, T, -1))


@pytest.mark.parametrize("softcap", [None, 0.5])
@pytest.mark.parametrize("scale", [None, 0.8])
def test_attention_softcap_and_scale_equal_attention_by_hand(softcap, scale):
    """`attention.softcap` passes the scores through softcap * tanh(score / softcap) (the dense
    path writes the attention out); `attention.scale` replaces 1/sqrt(head_dim)."""
    cfg = config(**GEMMA, attention=AttentionOptions(softcap=softcap, scale=scale))
    assert cfg.attention_scale == scale
    attn = perturbed_model(cfg).blocks["0"].attn
    x = torch.randn(2, 11, 32, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        got = attn(x, None, None, None, 0)
        want = attention_by_hand(attn, x, scale or 1 / math.sqrt(cfg.head_dim), softcap)
        plain = attention_by_hand(attn, x, 1 / math.sqrt(cfg.head_dim), None)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    # each option moves the output: the check can fail
    assert ((got - plain).abs().max() > 1e-3) == (softcap is not None or scale is not None)


def test_local_rope_base_gives_local_blocks_their_own_table():
    """Gemma 3: local blocks rotate with `local_rope_base`, unscaled; global blocks with
    `rope_base`, scaled (here linearly by 4). Each block gets its table in the forward."""
    cfg = config(**GEMMA3, n_layers=3, max_seq_len=16)
    model = perturbed_model(cfg)
    hd, positions = cfg.head_dim, torch.arange(16, dtype=torch.float64)[:, None]
    local = torch.tensor([1e4 ** (-2 * i / hd) for i in range(hd // 2)], dtype=torch.float64)
    glob = torch.tensor([1e6 ** (-2 * i / hd) / 4 for i in range(hd // 2)], dtype=torch.float64)
    torch.testing.assert_close(
        model.local_rope_cos.double(), (positions * local).cos(), atol=2e-6, rtol=0
    )
    torch.testing.assert_close(
        model.local_rope_sin.double(), (positions * local).sin(), atol=2e-6, rtol=0
    )
    torch.testing.assert_close(model.rope_cos.double(), (positions * glob).cos(), atol=2e-6, rtol=0)
    torch.testing.assert_close(model.rope_sin.double(), (positions * glob).sin(), atol=2e-6, rtol=0)
    assert [model.local_rope(i) for i in range(3)] == [False, True, False]
    # the tables each block is handed: (cos, sin) at positions 0..6
    handed = {}

    def keep(name: str):
        def hook(module, args) -> None:
            handed[name] = args[1]

        return hook

    for name, block in model.blocks.items():
        block.register_forward_pre_hook(keep(name))
    with torch.no_grad():
        model(tokens_for(1, 7))
    for name, table in (("0", glob), ("1", local), ("2", glob)):
        cos, sin = handed[name]
        angles = positions[:7] * table
        torch.testing.assert_close(cos[0, :, 0].double(), angles.cos(), atol=2e-6, rtol=0)
        torch.testing.assert_close(sin[0, :, 0].double(), angles.sin(), atol=2e-6, rtol=0)
    # not persistent: computed from the options, not kept in a checkpoint
    assert not {"local_rope_cos", "local_rope_sin"} & set(model.state_dict())


def test_without_a_local_base_every_block_rotates_with_the_scaled_table():
    cfg = config(**LLAMA, attention=AttentionOptions(window=3, pattern=("local", "global")),
                 n_layers=2, rope_scaling=RopeScaling(kind="linear", factor=4.0))  # fmt: skip
    model = Transformer(cfg)
    assert not hasattr(model, "local_rope_cos") and not model.local_rope(0)
    scaled = rope_frequencies(cfg)
    torch.testing.assert_close(rope_frequencies(cfg, local=True) / 4, scaled, atol=0, rtol=1e-6)


def test_linear_rope_scaling_divides_the_frequencies_by_the_factor():
    cfg = config(**LLAMA, d_model=64, rope_scaling=RopeScaling(kind="linear", factor=4.0))
    torch.testing.assert_close(rope_frequencies(cfg).double(), PLAIN / 4, rtol=1e-6, atol=0)
    # i.e. position p turns as p / 4 did: the table at 4p is the unscaled one at p
    model = Transformer(cfg)
    unscaled = Transformer(config(**LLAMA, d_model=64))
    torch.testing.assert_close(model.rope_cos[::4], unscaled.rope_cos[:8], atol=2e-6, rtol=0)
    torch.testing.assert_close(model.rope_sin[::4], unscaled.rope_sin[:8], atol=2e-6, rtol=0)


# -- rope_scaling ---------------------------------------------------------------------------------

# head_dim 16, base 10000: wavelengths 2*pi*10000^(i/8) = 6.3, 20, 63, 199, 628, 1987, 6283, 19869.
# original 2048 (low 1, high 4) keeps those below 512, blends 512..2048, divides those above 2048
PLAIN = torch.tensor([10000.0 ** (-2 * i / 16) for i in range(8)], dtype=torch.float64)


def bands_config(
    factor: float = 8.0, original: int = 2048, low: float = 1.0, high: float = 4.0, **overrides
) -> TransformerConfig:
    scaling = RopeScaling(
        factor=factor, low_freq_factor=low, high_freq_factor=high, original_max_seq_len=original
    )
    fields = dict(
        LLAMA, d_model=64, n_heads=4, rope_base=10000.0, rope_scaling=scaling, max_seq_len=48
    )
    fields.update(overrides)
    return config(**fields)


@pytest.mark.parametrize(
    ("original", "low", "high", "counts"),
    [(2048, 1.0, 4.0, (4, 2, 2)), (4096, 1.0, 4.0, (5, 1, 2)), (8192, 2.0, 8.0, (5, 1, 2))],
)
def test_rope_frequencies_follow_llama3_in_all_three_bands(original, low, high, counts):
    cfg = bands_config(factor=8.0, original=original, low=low, high=high)
    assert cfg.head_dim == 16
    wavelength = 2 * math.pi / PLAIN
    long_band = wavelength > original / low
    short_band = wavelength < original / high
    mid_band = ~long_band & ~short_band
    assert (int(short_band.sum()), int(mid_band.sum()), int(long_band.sum())) == counts
    want = torch.tensor(
        llama3_frequencies(16, 10000.0, 8.0, low, high, original), dtype=torch.float64
    )
    got = rope_frequencies(cfg).double()
    assert got.shape == (8,)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    # and the bands, stated apart from the helper: kept, divided by the factor, strictly between
    torch.testing.assert_close(got[short_band], PLAIN[short_band], rtol=1e-6, atol=0)
    torch.testing.assert_close(got[long_band], PLAIN[long_band] / 8, rtol=1e-6, atol=0)
    assert ((got[mid_band] < PLAIN[mid_band]) & (got[mid_band] > PLAIN[mid_band] / 8)).all()


def test_rope_frequency_in_the_band_is_the_blend_worked_by_hand():
    got = rope_frequencies(bands_config(factor=8.0, original=2048)).double()
    # wavelength 2*pi*100 = 628.3: smooth = (2048 / 628.3 - 1) / (4 - 1) = 0.753
    smooth = (2048 / (2 * math.pi * 100) - 1) / 3
    assert 0.75 < smooth < 0.76
    assert got[4].item() == pytest.approx((1 - smooth) * 0.01 / 8 + smooth * 0.01, rel=1e-6)
    # wavelength 1987: smooth = (2048 / 1987 - 1) / 3 = 0.0102, nearly all divided
    smooth = (2048 / (2 * math.pi * 10000**0.625) - 1) / 3
    f = 10000**-0.625
    assert got[5].item() == pytest.approx((1 - smooth) * f / 8 + smooth * f, rel=1e-6)


def test_rope_frequencies_without_scaling_are_base_powers():
    cfg = config(**LLAMA, d_model=64, n_heads=4, rope_base=500000.0)
    want = torch.tensor([500000.0 ** (-2 * i / 16) for i in range(8)], dtype=torch.float64)
    torch.testing.assert_close(rope_frequencies(cfg).double(), want, rtol=1e-6, atol=0)


def test_rope_scaling_with_factor_one_is_no_scaling():
    scaled = rope_frequencies(bands_config(factor=1.0))
    plain = rope_frequencies(bands_config(rope_scaling=None))
    torch.testing.assert_close(scaled, plain, rtol=1e-6, atol=0)
    assert not torch.allclose(rope_frequencies(bands_config(factor=8.0)), plain, rtol=1e-3)


@pytest.mark.parametrize("on_meta", [False, True], ids=["cpu", "meta-then-init"])
def test_rope_tables_use_the_scaled_frequencies(on_meta):
    cfg = bands_config(factor=8.0)
    if on_meta:
        with torch.device("meta"):
            model = Transformer(cfg)
        model.to_empty(device="cpu")
        model.init_weights(torch.Generator().manual_seed(0))
    else:
        model = Transformer(cfg)
    angles = torch.outer(
        torch.arange(48, dtype=torch.float64),
        torch.tensor(llama3_frequencies(16, 10000.0, 8.0, 1.0, 4.0, 2048), dtype=torch.float64),
    )
    assert model.rope_cos.shape == model.rope_sin.shape == (48, 8)
    torch.testing.assert_close(model.rope_cos.double(), angles.cos(), atol=2e-5, rtol=0)
    torch.testing.assert_close(model.rope_sin.double(), angles.sin(), atol=2e-5, rtol=0)
    unscaled = Transformer(bands_config(rope_scaling=None))
    # the blended and divided frequencies turn visibly slower over 48 positions
    assert (model.rope_sin - unscaled.rope_sin).abs().max() > 0.05


def test_rope_scaling_structures_from_yaml_with_defaults_and_round_trips():
    raw = {
        "positions": "rope",
        "d_model": 64,
        "n_heads": 4,
        "rope_scaling": {"factor": 8, "original_max_seq_len": 8192},
    }
    cfg = structure(raw, TransformerConfig)
    assert cfg.rope_scaling == RopeScaling(
        kind="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_seq_len=8192,
    )
    dumped = unstructure(cfg)
    assert dumped["rope_scaling"]["kind"] == "llama3"
    assert structure(dumped, TransformerConfig) == cfg
    assert unstructure(structure({}, TransformerConfig))["rope_scaling"] is None


# -- config errors --------------------------------------------------------------------------------

ROPE = {"positions": "rope", "d_model": 64, "n_heads": 4}


def scaling(**fields) -> dict:
    return {"factor": 8.0, "original_max_seq_len": 8192, **fields}


CONFIG_ERRORS = {
    "scaling-with-learned": ({"positions": "learned", "rope_scaling": scaling()}, "rope_scaling", "positions: rope"),
    "high-equals-low": ({**ROPE, "rope_scaling": scaling(high_freq_factor=1.0)}, "rope_scaling.high_freq_factor", "low_freq_factor"),
    "high-below-low": ({**ROPE, "rope_scaling": scaling(low_freq_factor=4.0, high_freq_factor=2.0)}, "rope_scaling.high_freq_factor", "low_freq_factor"),
    "factor-0": ({**ROPE, "rope_scaling": scaling(factor=0.0)}, "rope_scaling.factor", "positive"),
    "factor-negative": ({**ROPE, "rope_scaling": scaling(factor=-2.0)}, "rope_scaling.factor", "positive"),
    "factor-nan": ({**ROPE, "rope_scaling": scaling(factor=float("nan"))}, "rope_scaling.factor", "expected a finite number"),
    "factor-inf": ({**ROPE, "rope_scaling": scaling(factor=float("inf"))}, "rope_scaling.factor", "expected a finite number"),
    "low-0": ({**ROPE, "rope_scaling": scaling(low_freq_factor=0.0)}, "rope_scaling.low_freq_factor", "positive"),
    "original-0": ({**ROPE, "rope_scaling": scaling(original_max_seq_len=0)}, "rope_scaling.original_max_seq_len", "at least 1"),
    "kind-yarn": ({**ROPE, "rope_scaling": scaling(kind="yarn")}, "rope_scaling.kind", "llama3"),
    "head_dim-0": ({"head_dim": 0}, "head_dim", "at least 1"),
    "head_dim-negative": ({"head_dim": -8}, "head_dim", "at least 1"),
    "qk_norm_scope": ({"qk_norm": True, "qk_norm_scope": "per_head"}, "qk_norm_scope", "all_heads"),
    "norm_placement": ({"norm_placement": "post"}, "norm_placement", "after_sublayer"),
    "indivisible-without-head_dim": ({"d_model": 50, "n_heads": 4}, "n_heads", "head_dim"),
}  # fmt: skip


@pytest.mark.parametrize(("raw", "key", "words"), CONFIG_ERRORS.values(), ids=CONFIG_ERRORS.keys())
def test_config_errors_name_the_key(raw, key, words):
    with pytest.raises(ConfigError) as info:
        structure(raw, TransformerConfig)
    paths = [format_path(p.path) for p in info.value.problems]
    assert paths == [key]
    assert f"{key}: " in str(info.value)
    assert words in str(info.value)


def test_indivisible_d_model_is_fine_with_head_dim():
    cfg = structure({"d_model": 50, "n_heads": 4, "head_dim": 8}, TransformerConfig)
    assert (cfg.head_dim, cfg.n_heads * cfg.head_dim) == (8, 32)


def test_odd_explicit_head_dim_with_rope_is_refused_and_says_so():
    with pytest.raises(ConfigError) as info:
        structure({**ROPE, "head_dim": 7}, TransformerConfig)
    assert len(info.value.problems) == 1
    assert "head_dim" in str(info.value) and "7" in str(info.value)
    assert (
        structure({**ROPE, "positions": "learned", "head_dim": 7}, TransformerConfig).head_dim == 7
    )


# -- tensor-parallel plan -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "splittable"),
    [
        (dict(qk_norm=True, qk_norm_scope="all_heads"), False),
        (dict(norm_placement="after_sublayer"), False),
        (OLMO2, False),
        (dict(qk_norm=True, qk_norm_scope="head"), True),
        (dict(qk_norm=False, qk_norm_scope="all_heads"), True),  # the scope alone does nothing
        (dict(head_dim=16, n_kv_heads=2), True),
        (dict(qkv_bias=True, out_bias=True, mlp_bias=True), True),
        (dict(rope_scaling=ROPE_SCALED), True),
        (QWEN3, True),
    ],
    ids=[
        "qk_norm-all_heads",
        "after_sublayer",
        "olmo2",
        "qk_norm-head",
        "all_heads-without-qk_norm",
        "head_dim",
        "biases",
        "rope_scaling",
        "qwen3",
    ],
)
def test_tp_plan_is_empty_only_when_heads_or_norms_cannot_be_split(options, splittable):
    with torch.device("meta"):
        model = Transformer(config(**{**LLAMA, **options}))
        baseline = Transformer(
            config(**{**LLAMA, "tied_embeddings": options.get("tied_embeddings", True)})
        )
    plan = model.tp_plan()
    assert model.describe().tp_plan == plan
    if splittable:
        assert plan == baseline.tp_plan()
        assert plan["blocks.*.attn.wq"] == "colwise" and plan["blocks.*.attn.wo"] == "rowwise"
    else:
        assert plan == {}
    assert baseline.tp_plan() != {}


# -- training -------------------------------------------------------------------------------------

TRAIN_CASES = {k: OPTION_CASES[k] for k in OPTION_CASES if k != "gpt2-no-mlp-bias"}


@pytest.mark.parametrize("options", TRAIN_CASES.values(), ids=TRAIN_CASES.keys())
def test_a_tiny_model_with_the_option_trains(options):
    # init_std 0.1: token embeddings loud enough that norms on the branch outputs
    # (after_sublayer) do not drown them at the start, so 30 steps suffice for every case
    cfg = config(**{"max_seq_len": 16, "n_layers": 2, "init_std": 0.1, **options})
    torch.manual_seed(0)
    model = Transformer(cfg)
    model.init_weights(torch.Generator().manual_seed(0))
    model.train()
    batch = tokens_for(4, 17, seed=2)
    inputs, targets = batch[:, :-1], batch[:, 1:]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(30):
        optimizer.zero_grad(set_to_none=True)
        logits = model(inputs)
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
        loss.backward()
        if step == 0:
            for name, p in model.named_parameters():  # the new weights are in the graph
                assert p.grad is not None and p.grad.abs().sum() > 0, name
        optimizer.step()
        losses.append(loss.item())
    assert abs(losses[0] - math.log(VOCAB)) < 0.5
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] / 2, f"loss {losses[0]:.3f} -> {losses[-1]:.3f}"
