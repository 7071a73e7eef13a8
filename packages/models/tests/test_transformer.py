"""The Transformer's numbers: causality, GQA, positions, document masking, sliding windows,
parameter counts."""

from __future__ import annotations

import fnmatch

import pytest
import torch

from llmtrain.core_mesh.interfaces import ModelDescription
from llmtrain.models.attention_masks import positions_in_document
from llmtrain.models.config import AttentionOptions, TransformerConfig
from llmtrain.models.presets import preset_config
from llmtrain.models.transformer import Transformer

VOCAB = 128

# the two ends of the family: a llama-style block and a gpt2-style block
LLAMA_STYLE = dict(
    positions="rope", norm="rmsnorm", mlp="swiglu", n_kv_heads=2, bias=False, mlp_multiple_of=32
)
GPT2_STYLE = dict(positions="learned", norm="layernorm", mlp="gelu", bias=True)
STYLES = pytest.mark.parametrize("style", [LLAMA_STYLE, GPT2_STYLE], ids=["llama", "gpt2"])


def small_config(**overrides) -> TransformerConfig:
    # tests that compare logits pass init_std=0.1: logits then differ visibly between inputs
    fields = dict(vocab_size=VOCAB, max_seq_len=64, d_model=64, n_layers=2, n_heads=4)
    fields.update(overrides)
    return TransformerConfig(**fields)


def seeded_model(cfg: TransformerConfig, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(cfg)
    model.init_weights(torch.Generator().manual_seed(seed))
    return model.eval()


def doc_starts_for(lengths: list[int]) -> torch.Tensor:
    starts = torch.zeros(sum(lengths), dtype=torch.bool)
    offset = 0
    for n in lengths:
        starts[offset] = True
        offset += n
    return starts


# -- causality ----------------------------------------------------------------------------------


@STYLES
def test_future_tokens_never_change_past_logits(style):
    model = seeded_model(small_config(**style, init_std=0.1))
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (2, 24), generator=gen)
    with torch.no_grad():
        base = model(tokens)
        assert base.shape == (2, 24, VOCAB)
        for t in (0, 5, 11, 22):
            changed = tokens.clone()
            changed[:, t + 1 :] = torch.randint(0, VOCAB, (2, 23 - t), generator=gen)
            assert not torch.equal(changed[:, t + 1 :], tokens[:, t + 1 :])
            out = model(changed)
            torch.testing.assert_close(out[:, : t + 1], base[:, : t + 1], atol=1e-5, rtol=0)
            # and the test can see a change: the later positions do move
            assert (out[:, t + 1 :] - base[:, t + 1 :]).abs().max() > 1e-3


# -- grouped-query attention --------------------------------------------------------------------


def _repeat_kv_rows(w: torch.Tensor, n_kv: int, group: int, head_dim: int) -> torch.Tensor:
    """Rows of a K or V projection, kv head j (rows j*hd:(j+1)*hd) repeated for its group."""
    heads = w.reshape(n_kv, head_dim, *w.shape[1:])
    return heads.repeat_interleave(group, dim=0).reshape(n_kv * group * head_dim, *w.shape[1:])


def _mha_from_gqa(gqa: Transformer, mha: Transformer, cfg: TransformerConfig) -> None:
    """Load `mha` with `gqa`'s weights, each K/V head repeated for the query heads it serves.

    Assumptions, from nn.Linear's [out, in] layout and common practice (not spelled out by the
    spec): the two models have the same parameter names; a K or V projection's output rows are
    grouped by kv head, head j being rows j*head_dim:(j+1)*head_dim; kv head j serves query heads
    j*group .. (j+1)*group-1 (llama's repeat_kv). The K/V tensors are found by shape, so this
    handles separate k and v projections, one fused kv projection ([k; v]) and one fused qkv
    projection ([q; k; v]), weights and biases alike.
    """
    hd, h, kv = cfg.head_dim, cfg.n_heads, cfg.kv_heads
    group = h // kv
    target = mha.state_dict()
    state = {}
    n_expanded = 0
    for name, value in gqa.state_dict().items():
        want = target[name].shape
        if value.shape == want:
            state[name] = value
            continue
        rows = (value.shape[0], want[0])
        if rows == (kv * hd, h * hd):  # k or v alone
            parts, kv_parts = [value], [0]
        elif rows == (2 * kv * hd, 2 * h * hd):  # [k; v]
            parts, kv_parts = list(value.split(kv * hd)), [0, 1]
        elif rows == ((h + 2 * kv) * hd, 3 * h * hd):  # [q; k; v]
            parts, kv_parts = list(value.split([h * hd, kv * hd, kv * hd])), [1, 2]
        else:
            raise AssertionError(f"{name}: no K/V layout explains {tuple(value.shape)} -> {want}")
        for i in kv_parts:
            parts[i] = _repeat_kv_rows(parts[i], kv, group, hd)
            n_expanded += 1
        state[name] = torch.cat(parts)
        assert state[name].shape == want
    # every layer has a K and a V projection weight to expand (biases too when bias=True)
    assert n_expanded == cfg.n_layers * 2 * (2 if cfg.bias else 1)
    mha.load_state_dict(state, strict=True)


@pytest.mark.parametrize(
    "style",
    [
        LLAMA_STYLE,
        dict(GPT2_STYLE, qk_norm=True, n_kv_heads=2, positions="rope"),
        dict(GPT2_STYLE, n_kv_heads=2),
    ],
    ids=["llama", "gpt2-bias-qknorm-rope", "gpt2-bias-learned"],
)
def test_gqa_equals_mha_with_repeated_kv_heads(style):
    gqa_cfg = small_config(**style, init_std=0.1)
    assert (gqa_cfg.n_heads, gqa_cfg.kv_heads) == (4, 2)
    mha_cfg = small_config(**{**style, "n_kv_heads": 4}, init_std=0.1)
    gqa = seeded_model(gqa_cfg)
    mha = seeded_model(mha_cfg, seed=1)
    tokens = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        before = mha(tokens)
        _mha_from_gqa(gqa, mha, gqa_cfg)
        want, got = gqa(tokens), mha(tokens)
    assert (before - want).abs().max() > 1e-2  # the copy is what makes them agree
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_multi_query_attention_runs():
    cfg = small_config(**{**LLAMA_STYLE, "n_kv_heads": 1})
    model = seeded_model(cfg)
    assert model.describe().n_kv_heads == 1
    tokens = torch.randint(0, VOCAB, (3, 10))
    with torch.no_grad():
        logits = model(tokens)
    assert logits.shape == (3, 10, VOCAB)
    assert torch.isfinite(logits).all()
    assert sum(p.numel() for p in model.parameters()) == expected_n_params(cfg)


# -- positions and document masking --------------------------------------------------------------


@STYLES
def test_packed_document_sees_only_itself_from_position_zero(style):
    """docB inside [docA | docB] gives docB-alone's logits: masking plus positions restarting."""
    model = seeded_model(small_config(**style, doc_masking=True, init_std=0.1))
    gen = torch.Generator().manual_seed(3)
    doc_a = torch.randint(0, VOCAB, (7,), generator=gen)
    doc_b = torch.randint(0, VOCAB, (13,), generator=gen)
    packed = torch.cat([doc_a, doc_b])[None]
    with torch.no_grad():
        in_pack = model(packed, doc_starts_for([7, 13])[None])
        alone_b = model(doc_b[None], doc_starts_for([13])[None])
        alone_a = model(doc_a[None], doc_starts_for([7])[None])
    torch.testing.assert_close(in_pack[:, 7:], alone_b, atol=1e-5, rtol=0)
    torch.testing.assert_close(in_pack[:, :7], alone_a, atol=1e-5, rtol=0)


@STYLES
def test_document_boundaries_are_per_row(style):
    model = seeded_model(small_config(**style, doc_masking=True, init_std=0.1))
    gen = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, VOCAB, (2, 16), generator=gen)
    starts = torch.stack([doc_starts_for([5, 11]), doc_starts_for([3, 6, 7])])
    with torch.no_grad():
        packed = model(tokens, starts)
        row0_b = model(tokens[:1, 5:], doc_starts_for([11])[None])
        row1_c = model(tokens[1:, 9:], doc_starts_for([7])[None])
        row1_b = model(tokens[1:, 3:9], doc_starts_for([6])[None])
    torch.testing.assert_close(packed[:1, 5:], row0_b, atol=1e-5, rtol=0)
    torch.testing.assert_close(packed[1:, 9:], row1_c, atol=1e-5, rtol=0)
    torch.testing.assert_close(packed[1:, 3:9], row1_b, atol=1e-5, rtol=0)


@STYLES
@pytest.mark.parametrize("doc_masking", [True, False])
def test_changing_an_earlier_document(style, doc_masking):
    model = seeded_model(small_config(**style, doc_masking=doc_masking, init_std=0.1))
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (1, 20), generator=gen)
    changed = tokens.clone()
    changed[0, :8] = (tokens[0, :8] + 1 + torch.randint(0, VOCAB - 1, (8,), generator=gen)) % VOCAB
    assert (changed[0, :8] != tokens[0, :8]).all()
    starts = doc_starts_for([8, 12])[None]
    with torch.no_grad():
        base, out = model(tokens, starts), model(changed, starts)
    moved = (out[:, 8:] - base[:, 8:]).abs().max()
    if doc_masking:
        assert moved < 1e-5
    else:
        assert moved > 1e-3


def test_rope_logits_do_not_depend_on_the_absolute_start_position():
    """RoPE scores depend on distances only: shifting every position by start_pos changes nothing."""
    model = seeded_model(small_config(**LLAMA_STYLE, init_std=0.1))
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        base = model(tokens)
        shifted = model(tokens, start_pos=37)
    torch.testing.assert_close(shifted, base, atol=1e-4, rtol=0)


def test_learned_positions_do_depend_on_the_start_position():
    model = seeded_model(small_config(**GPT2_STYLE, init_std=0.1))
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        base = model(tokens)
        shifted = model(tokens, start_pos=37)
    assert (shifted - base).abs().max() > 1e-2


# -- sliding windows -------------------------------------------------------------------------------


def windowed_mask(starts: torch.Tensor, window: int | None) -> torch.Tensor:
    """(B, T, T) pair by pair: the key is not in the future, in the query's document, and less
    than `window` tokens back (None: any distance)."""
    doc = (starts.cumsum(dim=1) - 1).tolist()
    T = starts.size(1)
    return torch.tensor(
        [
            [
                [
                    k <= q and row[k] == row[q] and (window is None or q - k < window)
                    for k in range(T)
                ]
                for q in range(T)
            ]
            for row in doc
        ]
    )


def logits_and_grads(model: Transformer, tokens: torch.Tensor, **inputs):
    model.train()  # (no dropout: the configs keep 0)
    model.zero_grad(set_to_none=True)
    logits = model(tokens, **inputs)
    logits.float().square().mean().backward()
    return logits.detach(), {name: p.grad for name, p in model.named_parameters()}


@STYLES
@pytest.mark.parametrize("window", [1, 5, 24])
@pytest.mark.parametrize("documents", [False, True], ids=["causal", "documents"])
def test_a_window_equals_the_explicit_windowed_mask_with_gradients(style, window, documents):
    """A model whose blocks all have a window against the same weights without one, given the
    window as an explicit mask (positions + attention_mask written pair by pair): the same
    logits and gradients."""
    options = dict(style, init_std=0.1, doc_masking=documents, max_seq_len=32)
    windowed = seeded_model(small_config(**options, attention=AttentionOptions(window=window)))
    unwindowed = seeded_model(small_config(**options))
    unwindowed.load_state_dict(windowed.state_dict())
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(8))
    starts = torch.stack([doc_starts_for([9, 1, 14]), doc_starts_for([24])])
    if not documents:
        starts = doc_starts_for([24]).expand(2, 24)
    got, got_grads = logits_and_grads(windowed, tokens, doc_starts=starts if documents else None)
    want, want_grads = logits_and_grads(
        unwindowed,
        tokens,
        positions=positions_in_document(starts),
        attention_mask=windowed_mask(starts, window),
    )
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, atol=1e-6, rtol=1e-5, msg=name)
    # a window shorter than the documents cuts: the logits are not the unwindowed model's
    with torch.no_grad():
        full = unwindowed(tokens, starts if documents else None)
    assert ((got - full).abs().max() > 1e-3) == (window < 24)


@STYLES
def test_local_and_global_blocks_equal_their_own_masks(style):
    """With `pattern: [local, global]` only the local blocks are windowed: the explicit path
    (which applies each block's window to the mask it is given, counting in positions) gives
    the plain forward's logits and gradients, and both differ from windowing every block or
    none."""
    options = dict(style, init_std=0.1, max_seq_len=32)

    def model(pattern: tuple[str, ...] | None) -> Transformer:
        attention = (
            AttentionOptions() if pattern is None else AttentionOptions(window=4, pattern=pattern)
        )
        return seeded_model(small_config(**options, n_layers=3, attention=attention))

    local_global = model(("local", "global"))
    tokens = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(8))
    causal = torch.ones(2, 20, 20, dtype=torch.bool).tril()
    got, got_grads = logits_and_grads(local_global, tokens)
    want, want_grads = logits_and_grads(
        local_global, tokens, positions=torch.arange(20)[None], attention_mask=causal
    )
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, atol=1e-6, rtol=1e-5, msg=name)
    with torch.no_grad():
        for other in (model(("local",)), model(None)):
            other.load_state_dict(local_global.state_dict())
            assert (other(tokens) - got).abs().max() > 1e-3


# -- shared prefixes: several continuations after one copy of their context ----------------------


@STYLES
def test_continuations_packed_after_one_context_equal_their_own_rows(style):
    """A row of context + two continuations, each at the positions it has after the context
    and seeing only the context and itself, gives each continuation its own row's logits; a
    row longer than max_seq_len is fine while its positions fit."""
    model = seeded_model(small_config(**style, init_std=0.1, max_seq_len=16))
    gen = torch.Generator().manual_seed(9)
    context, first, second = (torch.randint(0, VOCAB, (n,), generator=gen) for n in (10, 5, 6))
    row = torch.cat([context, first, second]).unsqueeze(0)  # 21 tokens > max_seq_len
    positions = torch.cat([torch.arange(15), torch.arange(10, 16)]).unsqueeze(0)
    segment = torch.tensor([0] * 10 + [1] * 5 + [2] * 6)
    causal = torch.ones(21, 21, dtype=torch.bool).tril()
    mask = causal & ((segment.unsqueeze(0) == 0) | (segment.unsqueeze(0) == segment.unsqueeze(1)))
    with torch.no_grad():
        packed = model(row, positions=positions, attention_mask=mask.unsqueeze(0))[0]
        alone_first = model(torch.cat([context, first]).unsqueeze(0))[0]
        alone_second = model(torch.cat([context, second]).unsqueeze(0))[0]
        at = torch.zeros(1, 21, dtype=torch.bool)
        at[0, [9, 12, 20]] = True
        picked = model(row, positions=positions, attention_mask=mask.unsqueeze(0), logits_at=at)
    torch.testing.assert_close(packed[:15], alone_first, atol=1e-5, rtol=0)
    torch.testing.assert_close(packed[15:], alone_second[10:], atol=1e-5, rtol=0)
    assert picked.shape == (3, VOCAB)
    torch.testing.assert_close(picked, packed[[9, 12, 20]], atol=1e-5, rtol=0)


def test_packed_positions_past_max_seq_len_and_a_mask_without_positions_are_refused():
    model = seeded_model(small_config(**LLAMA_STYLE, max_seq_len=16))
    tokens = torch.zeros(1, 4, dtype=torch.long)
    mask = torch.ones(1, 4, 4, dtype=torch.bool).tril()
    with pytest.raises(ValueError, match="sequence of 17 tokens is longer than the model's"):
        model(tokens, positions=torch.tensor([[0, 1, 2, 16]]), attention_mask=mask)
    with pytest.raises(ValueError, match="an attention_mask goes with explicit positions"):
        model(tokens, attention_mask=mask)


# -- parameter counts and the description ----------------------------------------------------------


def _norm_params(cfg: TransformerConfig, width: int) -> int:
    # rmsnorm: a weight; layernorm: a weight and, when the model has biases, a bias
    return width * (2 if cfg.norm == "layernorm" and cfg.bias else 1)


def expected_n_params(cfg: TransformerConfig) -> int:
    """The parameter count written out from the architecture.

    qk-norm: one weight of head_dim for queries and one for keys, per layer (no bias); an untied
    head has no bias.
    """
    d, hd, h, kv, hidden = cfg.d_model, cfg.head_dim, cfg.n_heads, cfg.kv_heads, cfg.hidden_size
    attention = d * h * hd + 2 * d * kv * hd + h * hd * d
    mlp = (3 if cfg.mlp == "swiglu" else 2) * d * hidden
    if cfg.bias:
        attention += h * hd + 2 * kv * hd + d
        mlp += (2 if cfg.mlp == "swiglu" else 1) * hidden + d
    block = attention + mlp + 2 * _norm_params(cfg, d)
    if cfg.qk_norm:
        block += 2 * hd
    embedding = cfg.padded_vocab_size * d
    positions = cfg.max_seq_len * d if cfg.positions == "learned" else 0
    head = 0 if cfg.tied_embeddings else cfg.padded_vocab_size * d
    return embedding + positions + cfg.n_layers * block + _norm_params(cfg, d) + head


def _embedding_params(cfg: TransformerConfig) -> int:
    return cfg.padded_vocab_size * cfg.d_model + (
        cfg.max_seq_len * cfg.d_model if cfg.positions == "learned" else 0
    )


COUNTED = {
    "tiny": preset_config("tiny"),
    "gpt2-like-bias": TransformerConfig(
        vocab_size=100, max_seq_len=32, d_model=48, n_layers=3, n_heads=4
    ),
    "untied-qknorm-rmsnorm": small_config(
        **LLAMA_STYLE, tied_embeddings=False, qk_norm=True, n_layers=3
    ),
    "untied-learned-gelu-gqa": small_config(
        positions="learned", mlp="gelu", bias=False, tied_embeddings=False, n_kv_heads=1
    ),
    "layernorm-bias-qknorm-swiglu": small_config(
        positions="rope", norm="layernorm", mlp="swiglu", mlp_hidden=100, qk_norm=True, bias=True
    ),
}


@pytest.mark.parametrize("name", list(COUNTED))
def test_n_params_matches_module_and_formula(name):
    cfg = COUNTED[name]
    model = seeded_model(cfg)
    info = model.describe()
    unique = sum(p.numel() for p in model.parameters())  # parameters() yields a tied one once
    assert info.n_params == unique == expected_n_params(cfg)
    assert info.n_non_embedding_params == info.n_params - _embedding_params(cfg)
    # the head's V x d matmul counts tied or untied (an untied one is a non-embedding parameter)
    head = cfg.padded_vocab_size * cfg.d_model if cfg.tied_embeddings else 0
    for seq_len in (1, 32, 1000):
        attention = 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len
        assert info.flops_per_token(seq_len) == 6 * (info.n_non_embedding_params + head) + attention


@pytest.mark.parametrize("name", ["gpt2-124m", "gpt2-350m", "llama-1b", "llama-3b", "llama-8b"])
def test_preset_n_params_match_formula_on_meta(name):
    cfg = preset_config(name)
    with torch.device("meta"):
        model = Transformer(cfg)
    info = model.describe()
    assert info.n_params == sum(p.numel() for p in model.parameters()) == expected_n_params(cfg)
    assert info.n_non_embedding_params == info.n_params - _embedding_params(cfg)


def test_tied_embeddings_are_counted_once():
    tied_cfg = small_config(**LLAMA_STYLE)
    untied_cfg = small_config(**LLAMA_STYLE, tied_embeddings=False)
    tied, untied = seeded_model(tied_cfg), seeded_model(untied_cfg)
    assert getattr(tied, "head", None) is None
    assert isinstance(untied.head, torch.nn.Linear)
    extra = untied_cfg.padded_vocab_size * untied_cfg.d_model
    assert untied.describe().n_params - tied.describe().n_params == extra
    # the non-embedding count keeps the untied head and has no second copy of a tied one
    assert (
        untied.describe().n_non_embedding_params - tied.describe().n_non_embedding_params == extra
    )
    # tied: the logits really are the token embedding read backwards
    with torch.no_grad():
        tokens = torch.randint(0, VOCAB, (1, 8))
        before = tied(tokens)
        tied.tok_emb.weight[5] += 1.0
        after = tied(tokens)
    assert (after[..., 5] - before[..., 5]).abs().max() > 1e-2


def test_describe_fields():
    cfg = small_config(**LLAMA_STYLE)
    model = seeded_model(cfg)
    info = model.describe()
    assert isinstance(info, ModelDescription)
    assert info.module is model
    assert len(info.blocks) == cfg.n_layers
    for i, block in enumerate(info.blocks):
        assert block is model.get_submodule(f"blocks.{i}")  # checkpoint names blocks.<i>.*
    assert (info.n_heads, info.n_kv_heads) == (4, 2)
    assert len(info.tp_plan) > 0
    # every plan key names modules that exist (globs allowed)
    names = [n for n, _ in model.named_modules()]
    for key in info.tp_plan:
        assert any(fnmatch.fnmatchcase(n, key) for n in names), key


def test_blocks_keyed_by_layer_index_survive_dropping_blocks():
    """`blocks` is a ModuleDict keyed by layer index, so a pipeline stage that drops blocks keeps
    the parameter names (`blocks.<i>.…`) that checkpoints use."""
    model = seeded_model(small_config(**LLAMA_STYLE))
    assert list(model.blocks) == ["0", "1"]
    assert [type(b).__name__ for b in model.blocks.values()] == ["Block", "Block"]
    del model.blocks["0"]
    assert all(
        name.startswith("blocks.1.") for name, _ in model.blocks.named_parameters(prefix="blocks")
    )


def test_padded_vocab_logits_shape():
    cfg = small_config(vocab_size=100)
    model = seeded_model(cfg)
    with torch.no_grad():
        logits = model(torch.randint(0, 100, (2, 5)))
    assert logits.shape == (2, 5, 128)
    assert logits.dtype == torch.float32
