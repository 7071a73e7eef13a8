"""Configs and weights across the border, in memory: random transformers models give the same
logits as llmtrain after import, random llmtrain models give the same logits in transformers
after export, greedy generation agrees, and what has no equivalent is refused by name."""

from __future__ import annotations

import pytest
import torch
from llmtrain_hf.convert import (
    UnsupportedModelError,
    architecture_of,
    from_hf_model,
    hf_config,
    options_from_hf,
    save_hf_model,
    to_hf_model,
)

from llmtrain.models.generate import generate
from llmtrain.models.presets import preset_config
from llmtrain.models.transformer import build_model


def logits_of_hf(model, tokens):
    with torch.no_grad():
        return model(tokens).logits


def logits_of_ours(model, tokens):
    with torch.no_grad():
        return model(tokens)


# --- transformers -> llmtrain ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides",
    [
        {},  # GQA (4 query, 2 kv heads), untied head
        {"tie_word_embeddings": True, "num_key_value_heads": 4},
        {"attention_bias": True, "mlp_bias": True, "num_key_value_heads": 1},
    ],
    ids=["gqa-untied", "mha-tied", "mqa-bias"],
)
def test_llama_imports_with_its_logits_and_exports_back_exactly(hf, tokens, overrides):
    theirs = hf.random_model(hf.llama_config(**overrides))
    ours = from_hf_model(theirs)
    cfg = ours.cfg
    assert (cfg.positions, cfg.norm, cfg.mlp) == ("rope", "rmsnorm", "swiglu")
    assert cfg.rope_base == 50000.0 and cfg.norm_eps == 1e-6 and cfg.mlp_hidden == 96
    assert cfg.kv_heads == theirs.config.num_key_value_heads
    assert cfg.tied_embeddings == theirs.config.tie_word_embeddings
    assert cfg.padded_vocab_size == 300
    expected = logits_of_hf(theirs, tokens)
    assert hf.max_diff(logits_of_ours(ours, tokens), expected) < hf.TOL

    back = to_hf_model(ours)
    assert type(back).__name__ == "LlamaForCausalLM"
    for name, tensor in theirs.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name
    assert hf.max_diff(logits_of_hf(back, tokens), expected) == 0.0


@pytest.mark.parametrize(
    "overrides",
    [
        {},  # tied, as GPT-2 ships
        {"tie_word_embeddings": False, "n_inner": 80, "activation_function": "gelu_pytorch_tanh"},
    ],
    ids=["tied", "untied-n_inner"],
)
def test_gpt2_imports_with_its_logits_and_exports_back_exactly(hf, tokens, overrides):
    theirs = hf.random_model(hf.gpt2_config(**overrides))
    ours = from_hf_model(theirs)
    cfg = ours.cfg
    assert (cfg.positions, cfg.norm, cfg.mlp, cfg.bias) == ("learned", "layernorm", "gelu", True)
    assert cfg.hidden_size == (overrides.get("n_inner") or 256)
    expected = logits_of_hf(theirs, tokens)
    assert hf.max_diff(logits_of_ours(ours, tokens), expected) < hf.TOL

    back = to_hf_model(ours)
    assert type(back).__name__ == "GPT2LMHeadModel"
    assert back.config.activation_function == "gelu_new"
    for name, tensor in theirs.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name
    assert hf.max_diff(logits_of_hf(back, tokens), expected) < hf.TOL


# --- llmtrain -> transformers ---------------------------------------------------------------------


LLMTRAIN_CONFIGS = {
    # the tiny preset: GQA, SwiGLU rounded to a multiple, vocab 300 padded to 320
    "tiny": preset_config("tiny", vocab_size=300, max_seq_len=64, rope_base=500000.0),
    "tiny-tied-bias-mqa": preset_config(
        "tiny", vocab_size=320, max_seq_len=64, tied_embeddings=True, bias=True, n_kv_heads=1
    ),
    "llama-1b-shape": preset_config(
        "llama-1b",
        vocab_size=500,
        max_seq_len=64,
        d_model=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        mlp_hidden=160,
        norm_eps=1e-6,
        doc_masking=True,
    ),
    "gpt2-124m-shape": preset_config(
        "gpt2-124m", vocab_size=258, max_seq_len=64, d_model=64, n_layers=2, n_heads=4
    ),
    "gpt2-untied-nobias": preset_config(
        "gpt2-124m",
        vocab_size=300,
        max_seq_len=64,
        d_model=48,
        n_layers=2,
        n_heads=3,
        tied_embeddings=False,
        bias=False,
        mlp_hidden=100,
        norm_eps=1e-6,
    ),
}


@pytest.mark.parametrize("name", list(LLMTRAIN_CONFIGS))
def test_llmtrain_model_exports_with_its_logits(hf, name):
    cfg = LLMTRAIN_CONFIGS[name]
    ours = hf.spread(build_model(cfg))
    tokens = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(2))
    theirs = to_hf_model(ours, eos_token_id=0)
    assert type(theirs).__name__ == architecture_of(cfg)
    assert theirs.config.vocab_size == cfg.padded_vocab_size
    assert theirs.config.eos_token_id == 0 and theirs.config.bos_token_id is None
    assert hf.max_diff(logits_of_hf(theirs, tokens), logits_of_ours(ours, tokens)) < hf.TOL
    # and back: the same weights (the options may differ only in how the vocab is padded)
    again = from_hf_model(theirs)
    for key, value in ours.state_dict().items():
        assert torch.equal(again.state_dict()[key], value), key


@pytest.mark.parametrize(
    ("name", "dtype", "architecture"),
    [(name, torch.float32, None) for name in LLMTRAIN_CONFIGS]
    + [("tiny", torch.bfloat16, None), ("tiny", torch.float32, "MistralForCausalLM")],
)
def test_save_hf_model_writes_what_save_pretrained_writes(hf, tmp_path, name, dtype, architecture):
    """`hf export` writes the files without building the transformers model: byte for byte
    what that model's save_pretrained writes (tied heads left out, padding ids suppressed)."""
    ours = hf.spread(build_model(LLMTRAIN_CONFIGS[name]))
    kwargs = dict(eos_token_id=0, dtype=dtype, architecture=architecture)
    save_hf_model(str(tmp_path / "direct"), ours, **kwargs)
    to_hf_model(ours, **kwargs).save_pretrained(tmp_path / "transformers")
    files = sorted(p.name for p in (tmp_path / "transformers").iterdir())
    assert files == ["config.json", "generation_config.json", "model.safetensors"]
    assert sorted(p.name for p in (tmp_path / "direct").iterdir()) == files
    for file in files:
        assert (tmp_path / "direct" / file).read_bytes() == (
            tmp_path / "transformers" / file
        ).read_bytes(), file


def test_export_uses_llmtrain_gelu_and_every_number(hf):
    cfg = LLMTRAIN_CONFIGS["gpt2-untied-nobias"]
    config = hf_config(cfg)
    assert config.activation_function == "gelu_new"  # torch's tanh approximation, as llmtrain
    assert (config.n_inner, config.layer_norm_epsilon, config.n_positions) == (100, 1e-6, 64)
    assert not config.tie_word_embeddings and config.vocab_size == 320
    llama = hf_config(LLMTRAIN_CONFIGS["tiny"])
    assert (llama.num_key_value_heads, llama.head_dim, llama.intermediate_size) == (2, 16, 192)
    assert options_from_hf(llama).rope_base == 500000.0


@pytest.mark.parametrize("name", ["tiny", "gpt2-124m-shape"])
def test_greedy_generation_agrees(hf, name):
    cfg = LLMTRAIN_CONFIGS[name]
    ours = hf.spread(build_model(cfg), seed=5)
    theirs = to_hf_model(ours)
    prompt = torch.tensor([[5, 17, 42, 99, 3]])
    mine = generate(ours, prompt, 12, temperature=0)  # never a padding id (300..319)
    with torch.no_grad():
        out = theirs.generate(
            prompt, max_new_tokens=12, do_sample=False, attention_mask=torch.ones_like(prompt)
        )
    assert mine.tolist() == out.tolist()
    assert theirs.generation_config.suppress_tokens == list(
        range(cfg.vocab_size, cfg.padded_vocab_size)
    )


# --- refused ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            dict(qk_norm=True, qk_norm_scope="all_heads"),  # OLMo-2's norm, Llama's placement
            r"no transformers architecture computes this model \(LlamaForCausalLM: query/key "
            r"norm: all_heads \(needs none\);.*Olmo2ForCausalLM: model\.norm_placement: pre "
            r"\(needs after_sublayer\)",
        ),
        (dict(norm="layernorm"), r"LlamaForCausalLM: model\.norm: layernorm \(needs rmsnorm\)"),
        (dict(mlp="gelu"), r"Qwen2ForCausalLM: model\.mlp: gelu \(needs swiglu\)"),
        (
            dict(qkv_bias=True, mlp_bias=True),  # q/k/v and MLP biases, no output bias
            r"LlamaForCausalLM: biases q/k/v True, output False, MLP True \(it has one switch "
            r"for q/k/v/o biases and one for the MLP's\); Qwen2ForCausalLM: biases q/k/v True, "
            r"output False, MLP True \(it has q/k/v biases only\)",
        ),
        (
            dict(positions="learned"),
            r"model\.norm: rmsnorm; model\.mlp: swiglu; model\.n_kv_heads: 2 \(grouped-query "
            r"attention\): no equivalent in GPT2LMHeadModel",
        ),
    ],
    ids=["qk-norm-all-heads-pre", "layernorm-rope", "gelu-rope", "qkv-and-mlp-bias", "gpt2-mix"],
)
def test_llmtrain_options_without_equivalent_are_refused(options, message):
    cfg = preset_config("tiny", **options)
    with pytest.raises(UnsupportedModelError, match=message):
        hf_config(cfg)
    with pytest.raises(UnsupportedModelError, match=message):
        to_hf_model(build_model(cfg))


def test_an_export_takes_the_first_architecture_that_fits_or_the_one_asked_for():
    assert architecture_of(preset_config("tiny")) == "LlamaForCausalLM"
    assert architecture_of(preset_config("tiny"), "MistralForCausalLM") == "MistralForCausalLM"
    assert architecture_of(preset_config("tiny", qkv_bias=True)) == "Qwen2ForCausalLM"
    assert architecture_of(preset_config("tiny", qk_norm=True)) == "Qwen3ForCausalLM"
    olmo = preset_config(
        "tiny", qk_norm=True, qk_norm_scope="all_heads", norm_placement="after_sublayer"
    )
    assert architecture_of(olmo) == "Olmo2ForCausalLM"
    with pytest.raises(UnsupportedModelError, match=r"MistralForCausalLM: biases q/k/v True"):
        architecture_of(preset_config("tiny", bias=True), "MistralForCausalLM")
    with pytest.raises(UnsupportedModelError, match=r"--architecture Phi3ForCausalLM: choose one"):
        architecture_of(preset_config("tiny"), "Phi3ForCausalLM")
    # a head_dim that n_heads x head_dim != d_model needs: Llama refuses n_heads not dividing
    # d_model (transformers 5's LlamaConfig), Mistral computes it
    odd = preset_config("tiny", d_model=64, n_heads=5, n_kv_heads=1, head_dim=16)
    assert architecture_of(odd) == "MistralForCausalLM"
    with pytest.raises(UnsupportedModelError, match=r"n_heads: 5 does not divide d_model 64"):
        architecture_of(odd, "LlamaForCausalLM")


@pytest.mark.parametrize("kind", ["tiny", "gpt2-124m"])
def test_a_mup_model_is_refused_naming_its_parametrization(kind):
    # even at its base width, where it computes the standard model: the export refuses the option
    for base in (64, 32):
        cfg = preset_config(
            kind, d_model=64, n_layers=1, n_heads=4, parametrization="mup", mup_base_width=base
        )
        with pytest.raises(
            UnsupportedModelError, match=r"^model\.parametrization: mup has no"
        ) as info:
            hf_config(cfg)
        assert "\n" not in str(info.value)
        with pytest.raises(UnsupportedModelError, match=r"model\.parametrization: mup"):
            to_hf_model(build_model(cfg))


def test_gpt2_with_grouped_query_attention_is_refused():
    cfg = preset_config("gpt2-124m", d_model=64, n_layers=1, n_heads=4, n_kv_heads=2)
    with pytest.raises(UnsupportedModelError, match=r"model\.n_kv_heads: 2"):
        architecture_of(cfg)


def _yarn_rope(config):
    scaling = {
        "rope_type": "yarn",
        "rope_theta": 500000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    if hasattr(config, "rope_parameters"):
        config.rope_parameters = scaling
    else:
        config.rope_scaling = scaling
    return config


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda hf: hf.gpt2_config(activation_function="gelu"), "activation_function 'gelu'"),
        (lambda hf: hf.gpt2_config(scale_attn_by_inverse_layer_idx=True), "inverse_layer_idx"),
        (lambda hf: hf.llama_config(hidden_act="gelu"), "hidden_act 'gelu'"),
        (lambda hf: _yarn_rope(hf.llama_config()), "rope_type 'yarn'"),
    ],
    ids=["gpt2-gelu", "gpt2-layer-idx", "llama-gelu", "llama-yarn"],
)
def test_hf_configs_without_equivalent_are_refused(hf, make, message):
    with pytest.raises(UnsupportedModelError, match=message):
        options_from_hf(make(hf))


def test_other_architectures_are_refused():
    from transformers import GemmaConfig

    config = GemmaConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, head_dim=16)
    with pytest.raises(
        UnsupportedModelError,
        match=r"model_type 'gemma' is not supported; llmtrain-hf reads LlamaForCausalLM \(llama\), "
        r"MistralForCausalLM \(mistral\), Qwen2ForCausalLM \(qwen2\), Qwen3ForCausalLM "
        r"\(qwen3\), Olmo2ForCausalLM \(olmo2\), Gemma2ForCausalLM \(gemma2\), "
        r"Gemma3ForCausalLM \(gemma3_text\), GPT2LMHeadModel \(gpt2\)",
    ):
        options_from_hf(config)
