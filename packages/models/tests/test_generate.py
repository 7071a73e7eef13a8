"""Generation: greedy with and without the KV cache, stopping at eod, and sampling controls; a
windowed model's bounded cache."""

from __future__ import annotations

import pytest
import torch

from llmtrain.core_mesh.conformance import protocol_mismatches
from llmtrain.core_mesh.interfaces import LanguageModel
from llmtrain.models.config import AttentionOptions, TransformerConfig
from llmtrain.models.generate import generate
from llmtrain.models.transformer import LayerCache, Transformer

VOCAB = 128  # a multiple of pad_vocab_to: no padded ids that sampling would have to avoid
PROMPT_LEN = 8
NEW = 20

STYLES = {
    "rope": dict(
        positions="rope", norm="rmsnorm", mlp="swiglu", n_kv_heads=2, bias=False, mlp_multiple_of=32
    ),
    "learned": dict(positions="learned", norm="layernorm", mlp="gelu", bias=True),
}


def make_model(style: str, **overrides) -> Transformer:
    cfg = TransformerConfig(
        vocab_size=VOCAB,
        max_seq_len=64,
        d_model=64,
        n_layers=2,
        n_heads=4,
        init_std=0.1,  # peaked logits: no near-ties for greedy decoding to flip on
        # a random tied model copies its last token forever; untied, greedy output varies
        tied_embeddings=False,
        **{**STYLES[style], **overrides},
    )
    torch.manual_seed(0)
    model = Transformer(cfg)
    model.init_weights(torch.Generator().manual_seed(0))
    return model.eval()


@pytest.fixture(scope="module", params=list(STYLES))
def model(request) -> Transformer:
    return make_model(request.param)


@pytest.fixture(scope="module")
def prompt() -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def greedy(model, prompt) -> torch.Tensor:
    return generate(model, prompt, NEW, temperature=0, use_cache=False)


def test_greedy_is_the_argmax_of_the_forward_pass(model, prompt, greedy):
    assert greedy.shape == (1, PROMPT_LEN + NEW)
    assert greedy.dtype == torch.long
    assert torch.equal(greedy[:, :PROMPT_LEN], prompt)
    tokens = prompt
    with torch.no_grad():
        for _ in range(NEW):
            nxt = model(tokens)[:, -1].argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, nxt], dim=1)
    assert torch.equal(greedy, tokens)
    assert len(set(greedy[0, PROMPT_LEN:].tolist())) > 1  # not a degenerate repeat of one token


def test_greedy_with_cache_equals_without(model, prompt, greedy):
    cached = generate(model, prompt, NEW, temperature=0, use_cache=True)
    assert torch.equal(cached, greedy)


def test_generation_stops_right_after_eod(model, prompt, greedy):
    first = greedy[0, PROMPT_LEN].item()
    for use_cache in (True, False):
        out = generate(model, prompt, NEW, temperature=0, eod_id=first, use_cache=use_cache)
        assert out.shape == (1, PROMPT_LEN + 1)
        assert out[0, -1].item() == first
    # a later eod: the first token of the continuation that was not emitted before it
    continuation = greedy[0, PROMPT_LEN:].tolist()
    k = next(i for i, t in enumerate(continuation) if t not in continuation[:i] and i > 0)
    out = generate(model, prompt, NEW, temperature=0, eod_id=continuation[k])
    assert torch.equal(out, greedy[:, : PROMPT_LEN + k + 1])
    # an eod that never comes: all max_new_tokens are generated
    absent = next(t for t in range(VOCAB) if t not in continuation)
    assert generate(model, prompt, NEW, temperature=0, eod_id=absent).shape[1] == PROMPT_LEN + NEW


def test_generation_stops_at_the_first_stop_token(model, prompt, greedy):
    """stop_ids (a chat template's end of turn) stop like eod: at whichever comes first."""
    continuation = greedy[0, PROMPT_LEN:].tolist()
    k = next(i for i, t in enumerate(continuation) if t not in continuation[:i] and i > 1)
    absent = next(t for t in range(VOCAB) if t not in continuation)
    out = generate(model, prompt, NEW, temperature=0, eod_id=absent, stop_ids=[continuation[k]])
    assert torch.equal(out, greedy[:, : PROMPT_LEN + k + 1])
    j = next(i for i, t in enumerate(continuation) if i > 0 and t not in continuation[:i])
    both = generate(
        model, prompt, NEW, temperature=0, eod_id=continuation[j], stop_ids=[continuation[k]]
    )
    assert both.shape[1] == PROMPT_LEN + min(j, k) + 1


@pytest.mark.parametrize("use_cache", [True, False])
def test_top_k_one_is_greedy(model, prompt, greedy, use_cache):
    gen = torch.Generator().manual_seed(3)
    out = generate(model, prompt, NEW, temperature=1.0, top_k=1, use_cache=use_cache, generator=gen)
    assert torch.equal(out, greedy)


def test_tiny_top_p_is_greedy(model, prompt, greedy):
    gen = torch.Generator().manual_seed(4)
    out = generate(model, prompt, NEW, temperature=1.0, top_p=1e-6, generator=gen)
    assert torch.equal(out, greedy)


def test_seeded_sampling_is_reproducible(model, prompt):
    def sample(seed: int) -> torch.Tensor:
        return generate(
            model, prompt, NEW, temperature=1.0, generator=torch.Generator().manual_seed(seed)
        )

    a, b = sample(5), sample(5)
    assert a.shape == (1, PROMPT_LEN + NEW)
    assert torch.equal(a, b)
    # the generator is what decides: other seeds give other continuations
    assert any(not torch.equal(a, sample(seed)) for seed in (6, 7, 8))


def test_top_k_samples_only_among_the_k_best(model, prompt):
    gen = torch.Generator().manual_seed(9)
    out = generate(model, prompt, NEW, temperature=2.0, top_k=3, generator=gen)
    with torch.no_grad():
        logits = model(out)[0]
    for i in range(PROMPT_LEN, PROMPT_LEN + NEW):
        best = logits[i - 1].topk(3).indices.tolist()
        assert out[0, i].item() in best


def test_the_transformer_keeps_the_language_model_contract(model):
    """core-mesh's LanguageModel, what generate, eval, downstream scoring and lm-eval use."""
    assert protocol_mismatches(Transformer, LanguageModel) == []
    assert isinstance(model, LanguageModel) and model.options is model.cfg
    assert Transformer.packed_rows
    # the state dict is the weights: the RoPE tables are buffers, computed, not kept
    assert not {"rope_cos", "rope_sin"} & set(model.state_dict())
    assert len(model.new_cache(1, 16)) == model.cfg.n_layers


class Cacheless(torch.nn.Module):
    """A model with no KV cache that takes no keyword input: the contract's least."""

    packed_rows = False

    def __init__(self, inner: Transformer):
        super().__init__()
        self.inner = inner

    @property
    def options(self) -> TransformerConfig:
        return self.inner.cfg

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.inner(tokens)

    def new_cache(self, batch: int, max_len: int) -> None:
        return None


def test_a_model_without_a_cache_generates_by_rerunning_the_prefix(model, prompt, greedy):
    assert protocol_mismatches(Cacheless, LanguageModel) == []
    cacheless = Cacheless(model).train()
    assert torch.equal(generate(cacheless, prompt, NEW, temperature=0), greedy)
    assert cacheless.training  # the mode it was in is given back


# -- sliding windows: a cache of the window's latest keys -----------------------------------------

WINDOW = 6
# name: (window, pattern)
WINDOWED = {
    "all-local": (WINDOW, ("local",)),
    "local-global": (WINDOW, ("local", "global")),
    "global-local": (WINDOW, ("global", "local")),
    "window=1": (1, ("local",)),
}


def windowed_model(name: str, style: str = "rope") -> Transformer:
    window, pattern = WINDOWED[name]
    return make_model(style, attention=AttentionOptions(window=window, pattern=pattern))


@pytest.mark.parametrize("style", list(STYLES))
@pytest.mark.parametrize("prompt_len", [3, 10], ids=["prompt<window", "prompt>window"])
@pytest.mark.parametrize("name", list(WINDOWED))
def test_cached_decoding_with_windows_equals_the_full_forward(name, prompt_len, style):
    """The prompt in one chunk, then a chunk of 4 and single tokens, through a cache in which
    each local block keeps only its window's latest keys: the full forward's logits."""
    model = windowed_model(name, style)
    window, _ = WINDOWED[name]
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(2))
    cache = model.new_cache(2, 24)
    local = [model.cfg.attention.window_of(i) is not None for i in range(model.cfg.n_layers)]
    assert [c.k.size(2) for c in cache] == [window - 1 if w else 24 for w in local]
    assert all(isinstance(c, LayerCache) and c.v.shape == c.k.shape for c in cache)
    chunks = [(0, prompt_len), (prompt_len, prompt_len + 4)]
    chunks += [(t, t + 1) for t in range(prompt_len + 4, 24)]
    with torch.no_grad():
        full = model(tokens)
        steps = [model(tokens[:, a:b], cache=cache, start_pos=a) for a, b in chunks]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=2e-5, rtol=1e-4)
    # the local caches stayed at the window's size: what the last token saw besides itself
    assert [c.k.size(2) for c in cache] == [window - 1 if w else 24 for w in local]
    for c, is_local in zip(cache, local, strict=True):
        if is_local and window > 1:
            assert c.held == window - 1
    # and the windows cut: the model without them gives other logits
    with torch.no_grad():
        unwindowed = make_model(style)
        unwindowed.load_state_dict(model.state_dict())
        assert (unwindowed(tokens) - full).abs().max() > 1e-3


def test_the_local_cache_holds_the_latest_keys():
    """After an 11-token prompt, the local block's cache holds the keys and values of the
    window - 1 latest tokens, in order (those the first block computes for them alone: its
    input is their embeddings), the global block's all 11."""
    model = windowed_model("local-global")
    tokens = torch.randint(0, VOCAB, (1, 11), generator=torch.Generator().manual_seed(3))
    latest = 11 - (WINDOW - 1)
    with torch.no_grad():
        cache = model.new_cache(1, 11)
        model(tokens, cache=cache)
        again = model.new_cache(1, 11)
        model(tokens[:, latest:], cache=again, start_pos=latest)
    assert (cache[0].k.size(2), cache[0].held, cache[1].k.size(2)) == (WINDOW - 1, WINDOW - 1, 11)
    assert cache[0].key_start(11) == latest
    torch.testing.assert_close(cache[0].k, again[0].k, atol=1e-6, rtol=0)
    torch.testing.assert_close(cache[0].v, again[0].v, atol=1e-6, rtol=0)
    assert (cache[0].k.abs().sum(-1) > 0).all()  # every row written


@pytest.mark.parametrize("prompt_len", [3, PROMPT_LEN + 2], ids=["prompt<window", "prompt>window"])
@pytest.mark.parametrize("name", list(WINDOWED))
def test_greedy_with_windows_is_the_same_with_and_without_cache(name, prompt_len):
    model = windowed_model(name)
    prompt = torch.randint(0, VOCAB, (1, prompt_len), generator=torch.Generator().manual_seed(1))
    uncached = generate(model, prompt, NEW, temperature=0, use_cache=False)
    cached = generate(model, prompt, NEW, temperature=0, use_cache=True)
    assert uncached.shape == (1, prompt_len + NEW)
    assert torch.equal(cached, uncached)
