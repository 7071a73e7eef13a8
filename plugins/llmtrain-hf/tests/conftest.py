"""Shared setup for llmtrain-hf's tests: one torch thread, the installed plugins, small random
transformers models and a small BPE tokenizer made here (nothing is downloaded)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from shared_fixtures import run_cli  # noqa: F401

from llmtrain.core_mesh.plugins import PluginManager

# float32 logits of the same weights computed by two implementations; seen: ~2e-7
TOL = 1e-5


def pytest_configure(config):
    # DCP in one process without a process group: what these tests (and the CLI) mean to do
    config.addinivalue_line("filterwarnings", "ignore:torch.distributed is disabled:UserWarning")


@pytest.fixture(autouse=True, scope="session")
def quiet():
    from transformers.utils import logging as hf_logging

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: threads buy nothing on a small, busy machine
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def plugins() -> PluginManager:
    pm = PluginManager(blocked=()).load_entry_points()
    assert pm.problems == [], pm.problems
    assert "hf" in pm.registry("command")
    return pm


# the shape every RoPE-family test model shares (hidden 64, 2 layers, 4 heads / 2 kv heads)
ROPE_FAMILY_BASE = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=300,
    max_position_embeddings=128,
    rope_theta=50000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)


def llama_config(**overrides):
    from transformers import LlamaConfig

    return LlamaConfig(**{**ROPE_FAMILY_BASE, **overrides})


# each supported RoPE-family architecture as tests build it: its config class and what sets it
# apart from a plain Llama (explicit head sizes, biases, RoPE scaling, norms)
ROPE_FAMILY_CASES = {
    "llama3-rope-scaling": (
        "LlamaConfig",
        dict(
            head_dim=32,  # attention width 128 on d_model 64
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
            tie_word_embeddings=True,
        ),
    ),
    "mistral": ("MistralConfig", dict(head_dim=24, sliding_window=None)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(head_dim=32, attention_bias=False)),
    "qwen3-bias": ("Qwen3Config", dict(head_dim=8, attention_bias=True, num_key_value_heads=4)),
    "olmo2": ("Olmo2Config", dict(rope_theta=500000.0, attention_bias=False)),
}


def config_on_the_base(class_name: str, **fields):
    """A transformers config of class `class_name` on the RoPE family's base shape, `fields`
    set over it."""
    import transformers

    return getattr(transformers, class_name)(**{**ROPE_FAMILY_BASE, **fields})


def rope_family_config(case: str, **overrides):
    """A small config of one of ROPE_FAMILY_CASES, on the same base shape as `llama_config`."""
    import transformers

    class_name, specific = ROPE_FAMILY_CASES[case]
    return getattr(transformers, class_name)(**{**ROPE_FAMILY_BASE, **specific, **overrides})


def gpt2_config(**overrides):
    from transformers import GPT2Config

    values = dict(
        n_embd=64,
        n_layer=2,
        n_head=4,
        vocab_size=300,
        n_positions=128,
        layer_norm_epsilon=1e-5,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=None,
        eos_token_id=None,
    )
    return GPT2Config(**{**values, **overrides})


def random_hf_model(config, seed: int = 0, attn_implementation: str | None = None):
    """A transformers model with random weights everywhere: norms and biases too (their HF
    initialisation is ones and zeros, which would hide a swapped or dropped tensor).
    `attn_implementation`: transformers' default, or "eager" (Gemma 2's soft-capping needs it)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    model = model.eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if name.endswith("weight") else 0.0))
            else:
                p.normal_(0.0, 0.1)
    return model


def sentences(n: int, seed: int = 0) -> list[str]:
    from llmtrain.train_loop.experiments.quickstart import sentence

    rng = random.Random(seed)
    return [" ".join(sentence(rng) for _ in range(3)) for _ in range(n)]


@pytest.fixture(scope="session")
def tokenizer_json() -> str:
    """A byte-level BPE (tokenizer.json text) of at most 300 ids ending documents with
    <|endoftext|>, trained on generated sentences."""
    from llmtrain.data_pack.tokenizer import train_bpe

    return train_bpe(sentences(200), 300, special_tokens=("<|endoftext|>",))


def save_hf_dir(model, path, tokenizer_json: str | None = None) -> str:
    """A transformers model directory, with a PreTrainedTokenizerFast when given tokenizer.json."""
    model.save_pretrained(path)
    if tokenizer_json is not None:
        from tokenizers import Tokenizer
        from transformers import PreTrainedTokenizerFast

        fast = PreTrainedTokenizerFast(
            tokenizer_object=Tokenizer.from_str(tokenizer_json), eos_token="<|endoftext|>"
        )
        fast.save_pretrained(path)
    return str(path)


def spread_weights(model, seed: int = 0):
    """A freshly built llmtrain `model`, initialised from `seed` and moved away from its init:
    norms and biases off 1 and 0, matrices (routers and experts too) large enough that tokens
    route apart, so no tensor can go missing or be misplaced unseen. In eval mode."""
    g = torch.Generator().manual_seed(seed)
    model.init_weights(g)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
            else:
                p.normal_(0.0, 0.1, generator=g)
    return model.eval()


def greedy_hf(model, prompt: torch.Tensor, max_new_tokens: int) -> list[list[int]]:
    """A transformers model's greedy continuation of `prompt` (B, T), prompt included."""
    with torch.no_grad():
        out = model.generate(
            prompt,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            attention_mask=torch.ones_like(prompt),
            pad_token_id=0,
        )
    return out.tolist()


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.float() - b.float()).abs().max().item()


@pytest.fixture(scope="session")
def hf() -> SimpleNamespace:
    """The helpers above, for test modules (which cannot import conftest)."""
    return SimpleNamespace(
        llama_config=llama_config,
        gpt2_config=gpt2_config,
        rope_family_config=rope_family_config,
        config_on_the_base=config_on_the_base,
        rope_family_cases=tuple(ROPE_FAMILY_CASES),
        random_model=random_hf_model,
        save_dir=save_hf_dir,
        sentences=sentences,
        max_diff=max_diff,
        spread=spread_weights,
        greedy=greedy_hf,
        TOL=TOL,
    )


@pytest.fixture
def tokens() -> torch.Tensor:
    return torch.randint(0, 300, (2, 48), generator=torch.Generator().manual_seed(1))
