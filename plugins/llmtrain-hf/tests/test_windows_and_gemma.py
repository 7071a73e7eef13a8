"""Sliding-window attention (Mistral, Qwen2, Qwen3), linear RoPE scaling and Gemma 2 / Gemma 3
against transformers itself, in float32, on tiny random models whose windows are shorter than
the 32 tokens compared (and than a generation's 23): a `save_pretrained` directory imports
(the `hf` weight format) with max |Δlogit| ≤ 1e-5 and transformers' greedy generation; the
import exports back as the same class with the same bounds and tensors (a Gemma's norm weights
to half a float32 ulp of 1: llmtrain keeps 1 + w); llmtrain models with these options export
with the same logits and generations, back to the same tensors, and byte for byte what
`save_pretrained` writes; `hf import` then `hf export` on the command line gives the
directory back; config.json files exported under transformers 4.57 and 5.23 (`tests/data/`)
read back under the running version; what has no counterpart is refused in one line naming
the field.

Gemma 2's attention soft-capping runs in transformers' eager attention only (its SDPA drops it,
and 4.x picks SDPA by default): Gemma 2 models are compared with attn_implementation="eager".
This module runs in `plugin-hf` (transformers 5) and `plugin-hf-transformers4`."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest
import torch
from llmtrain_hf.convert import (
    UnsupportedModelError,
    architecture_of,
    from_hf_model,
    hf_config,
    options_from_hf,
    portable_config,
    save_hf_model,
    source_architecture,
    to_hf_model,
)
from llmtrain_hf.weights import HFWeights

from llmtrain.core_mesh.config import structure
from llmtrain.models.config import AttentionOptions, RopeScaling, TransformerConfig
from llmtrain.models.generate import generate
from llmtrain.models.transformer import build_model

S, F = "sliding_attention", "full_attention"
DATA = Path(__file__).parent / "data"
PROMPT = torch.tensor([[5, 17, 42, 99, 3, 250, 7]])
NEW_TOKENS = 16
# how far a Gemma norm weight w may come back from llmtrain's 1 + w (float32): half an ulp of 1
GEMMA_NORM_ROUNDING = 2.0**-24

# case: (config class, what sets it apart, its architecture)
CASES = {
    "mistral-window": ("MistralConfig", dict(head_dim=24, sliding_window=8), "MistralForCausalLM"),
    "qwen2-window-from-layer-1": (
        "Qwen2Config",
        dict(
            num_hidden_layers=3,
            use_sliding_window=True,
            sliding_window=8,
            max_window_layers=1,
            tie_word_embeddings=True,
        ),
        "Qwen2ForCausalLM",
    ),
    "qwen3-window-bias": (
        "Qwen3Config",
        dict(
            head_dim=16,
            use_sliding_window=True,
            sliding_window=6,
            max_window_layers=0,
            attention_bias=True,
        ),
        "Qwen3ForCausalLM",
    ),
    "llama-linear-rope": (
        "LlamaConfig",
        dict(rope_scaling={"rope_type": "linear", "factor": 4.0}),
        "LlamaForCausalLM",
    ),
    "gemma2": (
        "Gemma2Config",
        dict(
            num_hidden_layers=3,
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=8,
            attn_logit_softcapping=20.0,
            final_logit_softcapping=10.0,
            tie_word_embeddings=True,
        ),
        "Gemma2ForCausalLM",
    ),
    "gemma3-linear-rope": (
        "Gemma3TextConfig",
        dict(
            num_hidden_layers=4,
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=8,
            layer_types=[S, S, F, S],
            rope_theta=1e6,
            rope_local_base_freq=1e4,
            rope_scaling={"rope_type": "linear", "factor": 4.0},
            tie_word_embeddings=True,
        ),
        "Gemma3ForCausalLM",
    ),
    "gemma3-bias-untied": (
        "Gemma3TextConfig",
        dict(
            head_dim=32,  # attention width 128 on d_model 64
            query_pre_attn_scalar=256,
            attention_bias=True,
            sliding_window=6,
            layer_types=[F, S],
            final_logit_softcapping=12.0,
        ),
        "Gemma3ForCausalLM",
    ),
}
GEMMA = dict(mlp="geglu", norm_placement="sandwich", scale_embeddings=True, norm="rmsnorm")
# what each case's llmtrain options must say
OPTIONS = {
    "mistral-window": dict(attention=AttentionOptions(window=8), head_dim=24, mlp="swiglu"),
    "qwen2-window-from-layer-1": dict(
        attention=AttentionOptions(window=8, pattern=("global", "local", "local")),
        qkv_bias=True,
        out_bias=False,
    ),
    "qwen3-window-bias": dict(
        attention=AttentionOptions(window=6), qk_norm=True, qkv_bias=True, out_bias=True
    ),
    "llama-linear-rope": dict(
        attention=AttentionOptions(), rope_scaling=RopeScaling(kind="linear", factor=4.0)
    ),
    "gemma2": dict(
        **GEMMA,
        qk_norm=False,
        logit_softcap=10.0,
        tied_embeddings=True,
        rope_scaling=None,
        attention=AttentionOptions(
            window=8, pattern=("local", "global"), softcap=20.0, scale=24**-0.5
        ),
    ),
    "gemma3-linear-rope": dict(
        **GEMMA,
        qk_norm=True,
        qk_norm_scope="head",
        logit_softcap=None,
        rope_base=1e6,
        rope_scaling=RopeScaling(kind="linear", factor=4.0),
        attention=AttentionOptions(
            window=8, pattern=("local", "local", "global"), local_rope_base=1e4, scale=0.25
        ),
    ),
    "gemma3-bias-untied": dict(
        **GEMMA,
        head_dim=32,
        qkv_bias=True,
        out_bias=True,
        mlp_bias=False,
        tied_embeddings=False,
        logit_softcap=12.0,
        attention=AttentionOptions(
            window=6, pattern=("global", "local"), local_rope_base=1e4, scale=256**-0.5
        ),
    ),
}


def is_gemma(architecture: str) -> bool:
    return architecture.startswith("Gemma")


def attention_of(architecture: str) -> str | None:
    """transformers' attention to compare with: eager for Gemma 2's soft-capping, else its
    default."""
    return "eager" if architecture == "Gemma2ForCausalLM" else None


def hf_config_of(hf, case: str, **overrides):
    class_name, specific, _ = CASES[case]
    return hf.config_on_the_base(class_name, **{**specific, **overrides})


def random_model(hf, case: str, seed: int = 0):
    """A random transformers model of `case`; a Gemma's norm weights centred on 0, as Gemma's
    are (its norms multiply by 1 + weight)."""
    architecture = CASES[case][2]
    model = hf.random_model(hf_config_of(hf, case), seed, attention_of(architecture))
    if is_gemma(architecture):
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.sub_(1.0)
    return model


def load_theirs(path, architecture: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation=attention_of(architecture)
    )
    assert type(model).__name__ == architecture
    return model.eval()


def load_ours(directory: str):
    """The llmtrain model of a directory, read as `init: {from: DIR}` reads it."""
    weights, options = HFWeights().load(directory, {})
    cfg = structure({k: v for k, v in options.items() if k != "kind"}, TransformerConfig)
    model = build_model(cfg)
    model.load_state_dict(weights, strict=True)
    return model.eval()


def hf_logits(model, tokens):
    with torch.no_grad():
        return model(tokens).logits


def our_logits(model, tokens):
    with torch.no_grad():
        return model(tokens)


def assert_same_tensors(got: dict, expected: dict, architecture: str) -> None:
    """The same tensors; a Gemma's norm weights within float32 rounding of 1 + w."""
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        if is_gemma(architecture) and name.endswith("norm.weight"):
            assert got[name].dtype == tensor.dtype, name
            assert (got[name] - tensor).abs().max().item() <= GEMMA_NORM_ROUNDING, name
        else:
            assert torch.equal(got[name], tensor), name


@pytest.fixture
def tokens() -> torch.Tensor:
    return torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(1))


# --- transformers -> llmtrain -> transformers ------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_a_saved_directory_imports_with_transformers_logits_and_generations(
    hf, tmp_path, tokens, case
):
    architecture = CASES[case][2]
    hf_dir = hf.save_dir(random_model(hf, case), tmp_path / "hf")
    theirs = load_theirs(hf_dir, architecture)
    ours = load_ours(hf_dir)
    for key, value in OPTIONS[case].items():
        assert getattr(ours.cfg, key) == value, key
    assert hf.max_diff(our_logits(ours, tokens), hf_logits(theirs, tokens)) <= hf.TOL
    assert generate(ours, PROMPT, NEW_TOKENS, temperature=0).tolist() == hf.greedy(
        theirs, PROMPT, NEW_TOKENS
    )


@pytest.mark.parametrize("case", list(CASES))
def test_an_import_exports_back_as_the_same_architecture(hf, tmp_path, tokens, case):
    from transformers import AutoConfig

    architecture = CASES[case][2]
    source = hf.save_dir(random_model(hf, case, seed=3), tmp_path / "hf")
    ours = load_ours(source)
    out = tmp_path / "export"
    to_hf_model(ours, architecture=architecture).save_pretrained(out)
    portable_config(str(out), ours.cfg)

    theirs = load_theirs(out, architecture)
    assert source_architecture(AutoConfig.from_pretrained(out)) == architecture
    assert hf.max_diff(hf_logits(theirs, tokens), our_logits(ours, tokens)) <= hf.TOL
    assert (
        hf.greedy(theirs, PROMPT, NEW_TOKENS)
        == generate(ours, PROMPT, NEW_TOKENS, temperature=0).tolist()
    )
    original = load_theirs(source, architecture)
    assert_same_tensors(theirs.state_dict(), original.state_dict(), architecture)
    # and its config.json, in the keys of the running version, reads back to the same options
    assert load_ours(str(out)).cfg == ours.cfg


@pytest.mark.parametrize("case", list(CASES))
def test_hf_import_then_hf_export_gives_back_the_same_directory(run_cli, hf, tmp_path, case):
    architecture = CASES[case][2]
    theirs = random_model(hf, case, seed=4)
    hf_dir = hf.save_dir(theirs, tmp_path / "hf")
    code, out, err = run_cli("hf", "import", hf_dir, "-o", tmp_path / "ckpt")
    assert code == 0, err
    assert f": {architecture}, " in out
    flags = ["--architecture", architecture, "--no-tokenizer"]
    code, out, err = run_cli("hf", "export", tmp_path / "ckpt", "-o", tmp_path / "out", *flags)
    assert code == 0, err
    back = load_theirs(tmp_path / "out", architecture)
    assert_same_tensors(back.state_dict(), theirs.state_dict(), architecture)


def test_qwen_slides_the_layers_from_max_window_layers_on(hf):
    """Qwen's layers at and past max_window_layers slide (the config's layer_types); a window
    as long as the context, or use_sliding_window false, is global attention."""

    def attention(**overrides):
        config = hf_config_of(hf, "qwen2-window-from-layer-1", sliding_window=16, **overrides)
        return options_from_hf(config).attention

    assert attention(max_window_layers=3) == AttentionOptions()
    assert attention(max_window_layers=2) == AttentionOptions(
        window=16, pattern=("global", "global", "local")
    )
    assert attention(max_window_layers=0) == AttentionOptions(window=16)
    assert attention(max_window_layers=0, use_sliding_window=False) == AttentionOptions()
    assert (
        options_from_hf(hf_config_of(hf, "mistral-window", sliding_window=128)).attention
        == AttentionOptions()
    )


# --- llmtrain -> transformers ----------------------------------------------------------------------


def dense(**overrides) -> TransformerConfig:
    values = dict(
        vocab_size=300,
        pad_vocab_to=64,  # 320 rows: generation suppresses the padding ids
        max_seq_len=64,
        d_model=64,
        n_layers=3,
        n_heads=4,
        n_kv_heads=2,
        positions="rope",
        rope_base=10000.0,
        norm="rmsnorm",
        norm_eps=1e-6,
        mlp="swiglu",
        mlp_hidden=96,
        bias=False,
        tied_embeddings=False,
    )
    return TransformerConfig(**{**values, **overrides})


def gemma(**overrides) -> TransformerConfig:
    values = dict(
        head_dim=16,
        mlp="geglu",
        norm_placement="sandwich",
        scale_embeddings=True,
        logit_softcap=15.0,
        tied_embeddings=True,
    )
    return dense(**{**values, **overrides})


LLMTRAIN_CONFIGS = {
    "window-every-layer": (dense(attention=AttentionOptions(window=8)), "MistralForCausalLM"),
    "window-from-layer-1-qkv-bias": (
        dense(
            qkv_bias=True,
            attention=AttentionOptions(window=8, pattern=("global", "local", "local")),
        ),
        "Qwen2ForCausalLM",
    ),
    "window-qk-norm-linear-rope": (
        dense(
            qk_norm=True,
            head_dim=32,
            rope_scaling=RopeScaling(kind="linear", factor=2.0),
            attention=AttentionOptions(window=6),
        ),
        "Qwen3ForCausalLM",
    ),
    "linear-rope": (
        dense(rope_scaling=RopeScaling(kind="linear", factor=2.0)),
        "LlamaForCausalLM",
    ),
    "gemma2-shape": (
        gemma(attention=AttentionOptions(window=8, pattern=("local", "global"), softcap=25.0)),
        "Gemma2ForCausalLM",
    ),
    "gemma3-shape": (
        gemma(
            qk_norm=True,
            logit_softcap=None,
            rope_base=1e6,
            rope_scaling=RopeScaling(kind="linear", factor=8.0),
            attention=AttentionOptions(
                window=8, pattern=("local", "local", "global"), local_rope_base=1e4, scale=0.2
            ),
        ),
        "Gemma3ForCausalLM",
    ),
    "gemma3-global-untied": (
        gemma(qk_norm=True, head_dim=32, tied_embeddings=False, bias=True, mlp_bias=False),
        "Gemma3ForCausalLM",
    ),
}


@pytest.mark.parametrize("name", list(LLMTRAIN_CONFIGS))
def test_an_llmtrain_model_exports_with_its_logits_and_generations(hf, tokens, name):
    cfg, architecture = LLMTRAIN_CONFIGS[name]
    ours = hf.spread(build_model(cfg))
    theirs = to_hf_model(ours, eos_token_id=0)
    assert type(theirs).__name__ == architecture_of(cfg) == architecture
    assert hf.max_diff(hf_logits(theirs, tokens), our_logits(ours, tokens)) <= hf.TOL
    assert (
        hf.greedy(theirs, PROMPT, NEW_TOKENS)
        == generate(ours, PROMPT, NEW_TOKENS, temperature=0).tolist()
    )
    # back: the same weights (a Gemma's norms too: w - 1 + 1 is w in float32 for w in [0.5, 2])
    again = from_hf_model(theirs)
    expected = cfg.attention
    if architecture.startswith("Gemma") and expected.scale is None:
        # a Gemma always scales by query_pre_attn_scalar^-1/2, written as head_dim
        expected = attrs.evolve(expected, scale=cfg.head_dim**-0.5)
    assert again.cfg.attention == expected
    for key, value in ours.state_dict().items():
        assert torch.equal(again.state_dict()[key], value), key


@pytest.mark.parametrize("name", list(LLMTRAIN_CONFIGS))
def test_save_hf_model_writes_what_save_pretrained_writes(hf, tmp_path, name):
    cfg, architecture = LLMTRAIN_CONFIGS[name]
    ours = hf.spread(build_model(cfg))
    save_hf_model(str(tmp_path / "direct"), ours, eos_token_id=0, dtype=torch.bfloat16)
    to_hf_model(ours, eos_token_id=0, dtype=torch.bfloat16).save_pretrained(tmp_path / "hf")
    files = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert files == ["config.json", "generation_config.json", "model.safetensors"]
    assert sorted(p.name for p in (tmp_path / "direct").iterdir()) == files
    for file in files:
        direct, theirs = ((tmp_path / d / file).read_bytes() for d in ("direct", "hf"))
        assert direct == theirs, file
    assert json.loads((tmp_path / "direct" / "config.json").read_text())["architectures"] == [
        architecture
    ]


def test_a_gemma3_exports_rope_settings_in_the_keys_of_both_transformers_versions(tmp_path):
    """transformers 5 writes Gemma 3's RoPE by layer type (`rope_parameters`); 4.x reads the
    global layers' `rope_theta` and `rope_scaling` and the local layers' `rope_local_base_freq`
    (without them: 1e6, no scaling, 1e4)."""
    cfg, _ = LLMTRAIN_CONFIGS["gemma3-shape"]
    save_hf_model(str(tmp_path), build_model(cfg))
    portable_config(str(tmp_path), cfg)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["rope_theta"] == 1e6 and written["rope_local_base_freq"] == 1e4
    assert written["rope_scaling"] == {"rope_type": "linear", "factor": 8.0}
    assert written["layer_types"] == [S, S, F]
    assert written["query_pre_attn_scalar"] == 25  # scale 0.2
    from transformers import AutoConfig

    # the padded table is the vocabulary transformers knows; head_dim d_model / n_heads is implied
    expected = attrs.evolve(cfg, vocab_size=320, pad_vocab_to=1, head_dim=None)
    assert options_from_hf(AutoConfig.from_pretrained(tmp_path)) == expected


@pytest.mark.parametrize("version", ["4", "5"])
@pytest.mark.parametrize("name", ["gemma3", "qwen2-window"])
def test_an_export_written_under_either_major_version_reads_back(hf, name, version):
    """config.json files as llmtrain-hf exported them under transformers 4.57 and 5.23 (a
    Gemma 3 with linear RoPE scaling and a local base, a Qwen2 sliding from its second layer),
    read by the transformers running here."""
    from transformers import AutoConfig

    path = DATA / f"{name}-export-transformers{version}"
    assert json.loads((path / "config.json").read_text())["transformers_version"].startswith(
        f"{version}."
    )
    config = AutoConfig.from_pretrained(path)
    cfg = options_from_hf(config)
    if name == "gemma3":
        assert (cfg.rope_base, cfg.rope_scaling) == (1e6, RopeScaling(kind="linear", factor=8.0))
        assert cfg.attention == AttentionOptions(
            window=8, pattern=("local", "local", "global"), local_rope_base=1e4, scale=0.2
        )
        assert (cfg.mlp, cfg.norm_placement, cfg.scale_embeddings) == ("geglu", "sandwich", True)
    else:
        assert cfg.attention == AttentionOptions(window=8, pattern=("global", "local", "local"))
    theirs = hf.random_model(config)
    ours = from_hf_model(theirs)
    tokens = torch.randint(0, 300, (1, 32), generator=torch.Generator().manual_seed(2))
    assert hf.max_diff(our_logits(ours, tokens), hf_logits(theirs, tokens)) <= hf.TOL


# --- refused ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cfg", "architecture", "message"),
    [
        (
            dense(attention=AttentionOptions(window=8, pattern=("local", "global"))),
            None,
            r"MistralForCausalLM: model\.attention\.pattern: \['local', 'global'\] \(its window "
            r"slides on every layer or on none\)",
        ),
        (
            dense(qkv_bias=True, attention=AttentionOptions(window=8, pattern=("local", "global"))),
            "Qwen2ForCausalLM",
            r"Qwen2ForCausalLM: model\.attention\.pattern: \['local', 'global'\] \(its window "
            r"slides on the layers from max_window_layers on",
        ),
        (
            dense(attention=AttentionOptions(window=8)),
            "LlamaForCausalLM",
            r"LlamaForCausalLM: model\.attention\.window: 8 \(no sliding-window attention\)",
        ),
        (
            dense(scale_embeddings=True, logit_softcap=30.0),
            "LlamaForCausalLM",
            r"model\.scale_embeddings: true \(Gemma's only\), model\.logit_softcap: 30\.0",
        ),
        (
            dense(attention=AttentionOptions(softcap=50.0, scale=0.1)),
            "MistralForCausalLM",
            r"model\.attention\.softcap: 50\.0 \(Gemma's only\), model\.attention\.scale: 0\.1",
        ),
        (
            gemma(qk_norm=True, attention=AttentionOptions(window=8, softcap=30.0)),
            None,
            r"Gemma3ForCausalLM: model\.attention\.softcap: 30\.0 \(transformers' Gemma 3 never "
            r"soft-caps attention scores\)",
        ),
        (
            gemma(attention=AttentionOptions(scale=0.07)),
            "Gemma2ForCausalLM",
            r"model\.attention\.scale: 0\.07 \(Gemma's is query_pre_attn_scalar\^-1/2 for a "
            r"whole number",
        ),
        (
            gemma(qk_norm=True, rope_scaling=RopeScaling(kind="linear", factor=4.0),
                  attention=AttentionOptions(window=8)),
            "Gemma3ForCausalLM",
            r"model\.rope_scaling without attention\.local_rope_base \(it scales the local",
        ),
        (
            gemma(rope_scaling=RopeScaling(kind="linear", factor=4.0)),
            "Gemma2ForCausalLM",
            r"Gemma2ForCausalLM: model\.rope_scaling is not supported",
        ),
        (
            gemma(qk_norm=True, rope_scaling=RopeScaling(factor=8.0, original_max_seq_len=32)),
            "Gemma3ForCausalLM",
            r"model\.rope_scaling: kind llama3 is not supported \(it has linear\)",
        ),
        (
            gemma(scale_embeddings=False, mlp="swiglu"),
            "Gemma2ForCausalLM",
            r"model\.mlp: swiglu \(needs geglu\), model\.scale_embeddings: false \(Gemma "
            r"multiplies them by sqrt\(d_model\)\)",
        ),
        (
            gemma(n_heads=3, n_kv_heads=1),
            "Gemma2ForCausalLM",
            r"model\.n_heads: 3 does not divide d_model 64",
        ),
        (
            TransformerConfig(
                d_model=64, n_heads=4, n_layers=2, attention=AttentionOptions(window=8)
            ),
            None,
            r"model\.attention\.window: 8 \(no sliding window\): no equivalent in GPT2LMHeadModel",
        ),
    ],
    ids=[
        "mistral-pattern",
        "qwen2-local-first",
        "llama-window",
        "llama-gemma-options",
        "mistral-gemma-attention",
        "gemma3-attention-softcap",
        "gemma-scale",
        "gemma3-scaled-local-layers",
        "gemma2-rope-scaling",
        "gemma3-llama3-scaling",
        "gemma2-llama-blocks",
        "gemma2-heads",
        "gpt2-window",
    ],
)  # fmt: skip
def test_llmtrain_options_without_equivalent_are_refused(cfg, architecture, message):
    with pytest.raises(UnsupportedModelError, match=message) as info:
        hf_config(cfg, architecture=architecture)
    assert "\n" not in str(info.value)


def _scaled_local_layers(hf):
    """A Gemma 3 whose local layers' RoPE is scaled: transformers 5 can say it (rope_parameters
    by layer type), 4.x cannot; set on the config object as 5.x keeps it."""
    config = hf_config_of(hf, "gemma3-linear-rope")
    config.rope_parameters = {
        F: {"rope_type": "default", "rope_theta": 1e6},
        S: {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
    }
    return config


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda hf: hf_config_of(hf, "gemma2", hidden_activation="gelu"),
            r"hidden_activation 'gelu': llmtrain's GeGLU is the tanh approximation of GELU",
        ),
        (
            lambda hf: hf_config_of(hf, "gemma3-bias-untied", use_bidirectional_attention=True),
            r"use_bidirectional_attention: true \(an encoder's attention\); llmtrain's is causal",
        ),
        (
            lambda hf: hf_config_of(
                hf, "gemma3-linear-rope",
                rope_scaling={
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 32,
                },
            ),
            r"rope_type 'llama3' with Gemma3ForCausalLM: llmtrain-hf reads 'linear' scaling",
        ),
        (
            lambda hf: hf_config_of(
                hf, "gemma3-linear-rope", rope_scaling={"rope_type": "dynamic", "factor": 2.0}
            ),
            r"rope_type 'dynamic' \(RoPE frequency scaling\) has no llmtrain equivalent",
        ),
        (
            _scaled_local_layers,
            r"rope_type 'linear' of the local \(sliding_attention\) layers",
        ),
        (
            lambda hf: hf.rope_family_config("olmo2", rope_scaling={"type": "linear",
                                                                    "factor": 2.0}),
            r"rope_type 'linear' with Olmo2ForCausalLM: transformers 4\.x's Olmo2Config",
        ),
    ],
    ids=[
        "gemma2-exact-gelu",
        "gemma3-bidirectional",
        "gemma3-llama3-rope",
        "gemma3-dynamic-rope",
        "gemma3-scaled-local-rope",
        "olmo2-linear-rope",
    ],
)  # fmt: skip
def test_hf_configs_without_equivalent_are_refused(hf, make, message):
    with pytest.raises(UnsupportedModelError, match=message) as info:
        options_from_hf(make(hf))
    assert "\n" not in str(info.value)
