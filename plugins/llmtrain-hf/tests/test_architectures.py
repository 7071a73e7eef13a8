"""Every supported RoPE-family architecture against transformers itself, through directories as
users hold them: a random-init model saved with save_pretrained imports (the `hf` weight format)
with max |Δlogit| ≤ 1e-5 in float32 and the same greedy generation; an export of it loads with
AutoModelForCausalLM as the same architecture, with the same bounds; and its config.json carries
the RoPE settings in the keys of transformers 4.x and 5.x both.

This module runs in the hf plugin's nox session against the transformers of the constraints and
in a second session against the other major version (`plugin-hf-transformers4`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from llmtrain_hf.convert import (
    from_hf_model,
    options_from_hf,
    portable_config,
    source_architecture,
    to_hf_model,
)
from llmtrain_hf.weights import HFWeights

from llmtrain.core_mesh.config import structure
from llmtrain.models.config import RopeScaling, TransformerConfig
from llmtrain.models.generate import generate
from llmtrain.models.transformer import build_model

ARCHITECTURE = {
    "llama3-rope-scaling": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3-bias": "Qwen3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
}
# what each case's llmtrain options must say (the options the architecture exists for)
OPTIONS = {
    "llama3-rope-scaling": dict(head_dim=32, qkv_bias=False, out_bias=False, mlp_bias=False),
    "mistral": dict(head_dim=24, qk_norm=False),
    "qwen2": dict(qkv_bias=True, out_bias=False, mlp_bias=False),
    "qwen3": dict(head_dim=32, qk_norm=True, qk_norm_scope="head", qkv_bias=False),
    "qwen3-bias": dict(head_dim=8, qkv_bias=True, out_bias=True, mlp_bias=False),
    "olmo2": dict(
        qk_norm=True, qk_norm_scope="all_heads", norm_placement="after_sublayer", rope_base=5e5
    ),
}
CASES = list(ARCHITECTURE)
DATA = Path(__file__).parent / "data"
PROMPT = torch.tensor([[5, 17, 42, 99, 3, 250, 7]])
NEW_TOKENS = 16


def load_ours(directory: str):
    """The llmtrain model of a directory, read as `init: {from: DIR}` reads it."""
    weights, options = HFWeights().load(directory, {})
    cfg = structure({k: v for k, v in options.items() if k != "kind"}, TransformerConfig)
    model = build_model(cfg)
    model.load_state_dict(weights, strict=False)  # rope tables are buffers, not weights
    missing = set(model.state_dict()) - set(weights)
    assert missing <= {"rope_cos", "rope_sin"}, missing
    return model.eval()


def logits(model, tokens, *, hf: bool):
    with torch.no_grad():
        out = model(tokens)
    return out.logits if hf else out


@pytest.mark.parametrize("case", CASES)
def test_a_saved_directory_imports_with_transformers_logits_and_generations(
    hf, tmp_path, tokens, case
):
    from transformers import AutoModelForCausalLM

    hf_dir = hf.save_dir(hf.random_model(hf.rope_family_config(case)), tmp_path / "hf")
    theirs = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    assert type(theirs).__name__ == ARCHITECTURE[case]
    ours = load_ours(hf_dir)
    cfg = ours.cfg
    for key, value in OPTIONS[case].items():
        assert getattr(cfg, key) == value, key
    assert hf.max_diff(logits(ours, tokens, hf=False), logits(theirs, tokens, hf=True)) <= hf.TOL
    assert generate(ours, PROMPT, NEW_TOKENS, temperature=0).tolist() == hf.greedy(
        theirs, PROMPT, NEW_TOKENS
    )


@pytest.mark.parametrize("case", CASES)
def test_an_export_loads_in_transformers_as_the_same_architecture(hf, tmp_path, tokens, case):
    from transformers import AutoConfig, AutoModelForCausalLM

    source = hf.save_dir(hf.random_model(hf.rope_family_config(case), seed=3), tmp_path / "hf")
    ours = load_ours(source)
    out = tmp_path / "export"
    to_hf_model(ours, architecture=ARCHITECTURE[case]).save_pretrained(out)
    portable_config(str(out), ours.cfg)

    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(theirs).__name__ == ARCHITECTURE[case]
    assert source_architecture(AutoConfig.from_pretrained(out)) == ARCHITECTURE[case]
    assert hf.max_diff(logits(theirs, tokens, hf=True), logits(ours, tokens, hf=False)) <= hf.TOL
    assert (
        hf.greedy(theirs, PROMPT, NEW_TOKENS)
        == generate(ours, PROMPT, NEW_TOKENS, temperature=0).tolist()
    )
    # the same tensors as the directory it came from
    original = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    for name, tensor in original.state_dict().items():
        assert torch.equal(theirs.state_dict()[name], tensor), name


@pytest.mark.parametrize("case", ["llama3-rope-scaling", "olmo2"])
def test_an_exports_rope_settings_are_in_the_keys_of_both_transformers_versions(hf, tmp_path, case):
    """transformers 5 writes only `rope_parameters`; 4.x reads `rope_theta` and `rope_scaling`
    and would fall back to theta 10000 without them."""
    ours = load_ours(hf.save_dir(hf.random_model(hf.rope_family_config(case)), tmp_path / "hf"))
    out = tmp_path / "export"
    to_hf_model(ours).save_pretrained(out)
    portable_config(str(out), ours.cfg)
    written = json.loads((out / "config.json").read_text())
    assert written["rope_theta"] == ours.cfg.rope_base
    scaling = ours.cfg.rope_scaling
    expected = (
        None
        if scaling is None
        else {
            "rope_type": "llama3",
            "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_seq_len,
        }
    )
    assert written["rope_scaling"] == expected
    # the keys of the running version read back to the same settings
    assert load_ours(str(out)).cfg == ours.cfg


@pytest.mark.parametrize("version", ["4", "5"])
def test_an_export_written_under_either_major_version_keeps_its_rope_settings(hf, version):
    """config.json files as llmtrain-hf exported them under transformers 4.57 and 5.23 (a Llama
    with llama3 RoPE scaling, theta 50000), read by the transformers running here."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(DATA / f"llama3-export-transformers{version}")
    assert json.loads((DATA / f"llama3-export-transformers{version}" / "config.json").read_text())[
        "transformers_version"
    ].startswith(f"{version}.")
    cfg = options_from_hf(config)
    assert cfg.rope_base == 50000.0
    assert cfg.rope_scaling == RopeScaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=32
    )
    # the model transformers builds from it computes llmtrain's RoPE
    theirs = hf.random_model(config)
    ours = from_hf_model(theirs)
    tokens = torch.randint(0, 300, (1, 120), generator=torch.Generator().manual_seed(2))
    assert hf.max_diff(logits(ours, tokens, hf=False), logits(theirs, tokens, hf=True)) <= hf.TOL


@pytest.mark.parametrize("case", CASES)
def test_hf_import_then_hf_export_gives_back_the_same_directory(run_cli, hf, tmp_path, case):
    """The commands end to end: `hf import` to a checkpoint, `hf export` of it to a directory
    of the same architecture holding the same tensors."""
    from transformers import AutoModelForCausalLM

    theirs = hf.random_model(hf.rope_family_config(case), seed=4)
    hf_dir = hf.save_dir(theirs, tmp_path / "hf")
    code, out, err = run_cli("hf", "import", hf_dir, "-o", tmp_path / "ckpt")
    assert code == 0, err
    assert f": {ARCHITECTURE[case]}, " in out
    flags = ["--architecture", ARCHITECTURE[case], "--no-tokenizer"]
    code, out, err = run_cli("hf", "export", tmp_path / "ckpt", "-o", tmp_path / "out", *flags)
    assert code == 0, err
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    assert type(back).__name__ == ARCHITECTURE[case]
    for name, tensor in theirs.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name


def test_rope_matches_transformers_far_into_a_long_context(hf):
    """RoPE's frequencies are computed as transformers computes them, to the bit: a differing
    last bit grows with the position (5e-4 in the logits at 4096-8192 tokens)."""
    config = hf.rope_family_config(
        "llama3-rope-scaling",
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=64,
        rope_theta=500000.0,
        max_position_embeddings=4096,
    )
    theirs = hf.random_model(config)
    ours = from_hf_model(theirs)
    tokens = torch.randint(0, 300, (1, 4096), generator=torch.Generator().manual_seed(5))
    assert hf.max_diff(logits(ours, tokens, hf=False), logits(theirs, tokens, hf=True)) <= hf.TOL


def test_rotary_buffers_saved_with_older_weights_are_not_weights(hf, tmp_path):
    from safetensors.torch import load_file, save_file

    theirs = hf.random_model(hf.rope_family_config("qwen2"))
    hf_dir = hf.save_dir(theirs, tmp_path / "hf")
    weights = load_file(f"{hf_dir}/model.safetensors")
    for i in range(2):
        weights[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(weights, f"{hf_dir}/model.safetensors", metadata={"format": "pt"})
    tokens = torch.randint(0, 300, (1, 40), generator=torch.Generator().manual_seed(6))
    expected = logits(theirs, tokens, hf=True)
    assert hf.max_diff(logits(load_ours(hf_dir), tokens, hf=False), expected) <= hf.TOL
