"""Mixture-of-Experts architectures (OLMoE, Qwen3-MoE, Mixtral) against transformers itself, both
ways, with llmtrain-moe's `MoETransformer`: a random-init directory written by save_pretrained
imports (the `hf` weight format, `hf import`, `init: {from: DIR}`) with max |Δlogit| ≤ 1e-5 in
float32 and transformers' greedy generation; a random llmtrain-moe model exports to a directory
that AutoModelForCausalLM loads as the expected class with the same bounds, byte for byte what
the transformers model's save_pretrained writes; what transformers cannot compute (capacity,
a shared expert, the routing bias, Qwen2-MoE's gated shared expert, dense layers between MoE
layers) is refused in one line naming the option.

Tiny shapes (d 64, 2 layers, 8 experts of hidden 32), random weights everywhere (norms too):
a swapped expert, a transposed projection or a missed renormalisation moves the logits by far
more than the bound."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import yaml
from llmtrain_hf.convert import (
    UnsupportedModelError,
    architecture_of,
    from_hf_model,
    from_hf_state_dict,
    options_from_hf,
    save_hf_model,
    source_architecture,
    to_hf_model,
)
from llmtrain_hf.moe import file_layout
from llmtrain_hf.weights import HFWeights
from llmtrain_moe.model import MoETransformer, build_model
from llmtrain_moe.options import MoEOptions, preset_options

from llmtrain.checkpoint.export import load_model_weights
from llmtrain.core_mesh.config import structure
from llmtrain.core_mesh.errors import UserError
from llmtrain.data_pack.pack import pack
from llmtrain.models.config import RopeScaling
from llmtrain.models.generate import generate
from llmtrain.train_loop.experiments.quickstart import write_corpus
from llmtrain.train_loop.saved_model import load_model

DATA = Path(__file__).parent / "data"
PROMPT = torch.tensor([[5, 17, 42, 99, 3, 250, 7]])
NEW_TOKENS = 12

MOE_BASE = dict(
    hidden_size=64,
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
# case -> (config class, what sets it apart, its architecture, what llmtrain's options must say)
CASES = {
    "olmoe": (
        "OlmoeConfig",
        dict(intermediate_size=32, num_experts=8, num_experts_per_tok=3, norm_topk_prob=False),
        "OlmoeForCausalLM",
        dict(qk_norm=True, qk_norm_scope="all_heads", n_experts=8, top_k=3, renormalize=False),
    ),
    "olmoe-bias-renormalized": (
        "OlmoeConfig",
        dict(
            intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            attention_bias=True,
            num_key_value_heads=4,
            router_aux_loss_coef=0.02,
        ),
        "OlmoeForCausalLM",
        dict(qkv_bias=True, out_bias=True, renormalize=True, aux_loss_weight=0.02),
    ),
    "qwen3-moe": (
        "Qwen3MoeConfig",
        dict(
            intermediate_size=48,  # the dense MLP's, which no layer has here
            moe_intermediate_size=32,
            head_dim=24,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
        ),
        "Qwen3MoeForCausalLM",
        dict(qk_norm=True, qk_norm_scope="head", head_dim=24, mlp_hidden=32, renormalize=True),
    ),
    "qwen3-moe-unnormalized": (
        "Qwen3MoeConfig",
        dict(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=4, norm_topk_prob=False),
        "Qwen3MoeForCausalLM",
        dict(qk_norm_scope="head", top_k=4, renormalize=False),
    ),
    "mixtral": (
        "MixtralConfig",
        dict(intermediate_size=32, head_dim=24, num_local_experts=8, num_experts_per_tok=2),
        "MixtralForCausalLM",
        dict(qk_norm=False, head_dim=24, n_experts=8, top_k=2, renormalize=True),
    ),
}


def moe_config(case: str, **overrides):
    import transformers

    class_name, specific, _, _ = CASES[case]
    return getattr(transformers, class_name)(**{**MOE_BASE, **specific, **overrides})


def load_ours(directory) -> MoETransformer:
    """The llmtrain model of a directory, read as `init: {from: DIR}` reads it."""
    weights, options = HFWeights().load(str(directory), {})
    assert options["kind"] == "moe"
    cfg = structure({k: v for k, v in options.items() if k != "kind"}, MoEOptions)
    model = build_model(cfg)
    model.load_state_dict(weights, strict=True)
    return model.eval()


def logits(model, tokens):
    with torch.no_grad():
        out = model(tokens)
    return getattr(out, "logits", out)


@pytest.mark.parametrize("case", list(CASES))
def test_a_saved_moe_directory_imports_with_transformers_logits_and_generations(
    hf, tmp_path, tokens, case
):
    from transformers import AutoModelForCausalLM

    hf_dir = hf.save_dir(hf.random_model(moe_config(case)), tmp_path / "hf")
    theirs = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    assert type(theirs).__name__ == CASES[case][2]
    ours = load_ours(hf_dir)
    for key, value in CASES[case][3].items():
        assert getattr(ours.cfg, key) == value, key
    assert ours.cfg.capacity_factor is None and not ours.cfg.shared_expert
    assert hf.max_diff(logits(ours, tokens), logits(theirs, tokens)) <= hf.TOL
    # every expert is used by these tokens: none could be misplaced unseen
    load = torch.tensor(ours.router_stats()["0"]["load"])
    assert (load > 0).all(), load
    assert generate(ours, PROMPT, NEW_TOKENS, temperature=0).tolist() == hf.greedy(
        theirs, PROMPT, NEW_TOKENS
    )


# llmtrain-moe models and the architecture each exports as
EXPORTS = {
    # OLMoE's structure: q/k norm over all heads, top-k weights as they are
    "olmoe-tiny": (
        preset_options("olmoe-tiny", vocab_size=300, max_seq_len=64),
        "OlmoeForCausalLM",
    ),
    "olmoe-tiny-biases-tied": (
        preset_options(
            "olmoe-tiny",
            vocab_size=300,
            renormalize=True,
            tied_embeddings=True,
            bias=True,
            mlp_bias=False,
            n_kv_heads=2,
        ),
        "OlmoeForCausalLM",
    ),
    "per-head-qk-norm": (
        preset_options("olmoe-tiny", qk_norm_scope="head", head_dim=24, n_kv_heads=2),
        "Qwen3MoeForCausalLM",
    ),
    # moe-tiny: no q/k norm, renormalised top-2 (its vocab of 320 padded to 320)
    "moe-tiny": (preset_options("moe-tiny"), "MixtralForCausalLM"),
}


@pytest.mark.parametrize("name", list(EXPORTS))
def test_an_llmtrain_moe_model_exports_to_what_transformers_computes(hf, tmp_path, name):
    from transformers import AutoModelForCausalLM

    cfg, arch = EXPORTS[name]
    assert architecture_of(cfg) == arch
    ours = hf.spread(build_model(cfg))
    save_hf_model(str(tmp_path / "hf"), ours)  # no end of document: 12 tokens each
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert type(theirs).__name__ == arch
    tokens = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(2))
    assert hf.max_diff(logits(theirs, tokens), logits(ours, tokens)) <= hf.TOL
    assert (
        hf.greedy(theirs, PROMPT, NEW_TOKENS)
        == generate(ours, PROMPT, NEW_TOKENS, temperature=0).tolist()
    )
    # and back: the same weights and options (aux_loss_weight through router_aux_loss_coef)
    again = from_hf_model(theirs)
    assert isinstance(again, MoETransformer)
    for key, value in ours.state_dict().items():
        assert torch.equal(again.state_dict()[key], value), key
    for key in ("n_experts", "top_k", "renormalize", "aux_loss_weight", "qk_norm_scope"):
        assert getattr(again.cfg, key) == getattr(cfg, key), key


@pytest.mark.parametrize(
    ("name", "dtype"), [("olmoe-tiny", torch.float32), ("moe-tiny", torch.bfloat16)]
)
def test_save_hf_model_writes_what_save_pretrained_writes(hf, tmp_path, name, dtype):
    ours = hf.spread(build_model(EXPORTS[name][0]))
    save_hf_model(str(tmp_path / "direct"), ours, eos_token_id=0, dtype=dtype)
    to_hf_model(ours, eos_token_id=0, dtype=dtype).save_pretrained(tmp_path / "transformers")
    files = sorted(p.name for p in (tmp_path / "transformers").iterdir())
    assert files == ["config.json", "generation_config.json", "model.safetensors"]
    assert sorted(p.name for p in (tmp_path / "direct").iterdir()) == files
    for file in files:
        assert (tmp_path / "direct" / file).read_bytes() == (
            tmp_path / "transformers" / file
        ).read_bytes(), file


def test_hf_import_then_hf_export_gives_back_the_same_directory(run_cli, plugins, hf, tmp_path):
    """The commands end to end: `hf import` writes a checkpoint of kind `moe` that computes
    transformers' logits, `hf export` of it writes a directory of the same tensors."""
    from transformers import AutoModelForCausalLM

    theirs = hf.random_model(moe_config("olmoe"), seed=4)
    hf_dir = hf.save_dir(theirs, tmp_path / "hf")
    code, out, err = run_cli("hf", "import", hf_dir, "-o", tmp_path / "ckpt")
    assert code == 0, err
    assert ": OlmoeForCausalLM, " in out
    ours, info, _ = load_model(str(tmp_path / "ckpt"), None, plugins)
    assert info["model"]["kind"] == "moe" and isinstance(ours, MoETransformer)
    tokens = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(3))
    assert hf.max_diff(logits(ours, tokens), logits(theirs, tokens)) <= hf.TOL

    code, out, err = run_cli(
        "hf", "export", tmp_path / "ckpt", "-o", tmp_path / "out", "--no-tokenizer"
    )
    assert code == 0, err
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    assert type(back).__name__ == "OlmoeForCausalLM"
    for name, tensor in theirs.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name


def test_a_run_starts_from_a_moe_directory(run_cli, plugins, hf, tmp_path, tokenizer_json):
    """`init: {from: HF_DIR}` with the model's shape from the directory (`model: {from: ...}`):
    after a zero update the checkpoint holds exactly the converted weights."""
    write_corpus(tmp_path / "train.jsonl", 20, seed=0)
    (tmp_path / "tokenizer.json").write_text(tokenizer_json)
    tokenizer = {"kind": "hf", "path": str(tmp_path / "tokenizer.json")}
    pack([str(tmp_path / "train.jsonl")], str(tmp_path / "train.zarr"), tokenizer, workers=1)
    theirs = hf.random_model(moe_config("qwen3-moe"), seed=5)
    hf_dir = hf.save_dir(theirs, tmp_path / "hf", tokenizer_json)
    config = {
        "name": "ft",
        "run_dir": str(tmp_path / "runs"),
        "device": "cpu",
        "model": {"from": hf_dir, "capacity_factor": 4.0},  # training only: may differ
        "data": {
            "train": [{"path": str(tmp_path / "train.zarr")}],
            "seq_len": 32,
            "micro_batch": 2,
        },
        "optimizer": {"kind": "adamw", "lr": 1e-3, "weight_decay": 0.0},
        "training": {"steps": 1, "log_every": 1, "max_grad_norm": 0.0},
        "init": {"from": hf_dir},
    }
    (tmp_path / "ft.yaml").write_text(yaml.safe_dump(config))
    code, _, err = run_cli("run", tmp_path / "ft.yaml")
    assert code == 0, err
    checkpoints = str(tmp_path / "runs" / "ft" / "checkpoints")
    weights, _, step = load_model_weights(checkpoints)
    cfg = options_from_hf(theirs.config)
    expected = from_hf_state_dict(file_layout(theirs.state_dict(), _layout("qwen3-moe")), cfg)
    assert step == 1 and sorted(weights) == sorted(expected)
    assert [k for k in expected if not torch.equal(weights[k], expected[k])] == []
    ours, info, _ = load_model(checkpoints, None, plugins)
    assert info["model"]["kind"] == "moe" and info["model"]["capacity_factor"] == 4.0
    tokens = torch.randint(0, 300, (1, 16), generator=torch.Generator().manual_seed(3))
    # an expert takes ceil(4.0 x 16 x 2 / 8) = 16 tokens of 16: none dropped, as in transformers
    assert hf.max_diff(logits(ours, tokens), logits(theirs, tokens)) <= hf.TOL
    # trained with a capacity, it computes another function than transformers on longer texts:
    # its export is refused in one line naming the option, and writes nothing
    code, _, err = run_cli("hf", "export", checkpoints, "-o", tmp_path / "out", "--no-tokenizer")
    assert code == 2, err
    (line,) = [x for x in err.splitlines() if "capacity_factor" in x]
    assert "model.capacity_factor: 4.0 (transformers' MoE layers are dropless" in line
    assert not (tmp_path / "out").exists()


def _layout(case: str):
    from llmtrain_hf.convert import ROPE_FAMILY

    return ROPE_FAMILY[CASES[case][2]].moe


# --- what does not map -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            dict(capacity_factor=1.25),
            "model.capacity_factor: 1.25 (transformers' MoE layers are dropless",
        ),
        (dict(shared_expert=True), "model.shared_expert: true"),
        (dict(bias_update_rate=0.001), "model.bias_update_rate: 0.001 (the routing bias"),
        (dict(mlp="gelu"), "model.mlp: gelu (needs swiglu)"),
        (dict(qk_norm=False, renormalize=False), "MixtralForCausalLM: model.renormalize: false"),
        (dict(head_dim=24), "OlmoeForCausalLM: model.head_dim: 24 (needs d_model / n_heads)"),
        (
            dict(rope_scaling=RopeScaling(factor=8.0, original_max_seq_len=32)),
            "model.rope_scaling is not supported",
        ),
    ],
)
def test_moe_models_transformers_cannot_compute_are_refused(overrides, message):
    cfg = preset_options("olmoe-tiny", **overrides)
    with pytest.raises(UnsupportedModelError) as info:
        architecture_of(cfg)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_a_dense_architecture_is_refused_for_a_moe_model_and_the_other_way_round():
    with pytest.raises(UnsupportedModelError, match="Olmo2ForCausalLM: a Mixture-of-Experts model"):
        architecture_of(preset_options("olmoe-tiny"), "Olmo2ForCausalLM")
    from llmtrain.models.presets import preset_config

    with pytest.raises(UnsupportedModelError, match="MixtralForCausalLM: a dense model"):
        architecture_of(preset_config("tiny"), "MixtralForCausalLM")


def test_moe_configs_transformers_computes_otherwise_are_refused():
    import transformers

    qwen2 = transformers.Qwen2MoeConfig(**MOE_BASE)
    with pytest.raises(
        UserError, match="'qwen2_moe' is not supported: Qwen2-MoE scales its shared"
    ):
        source_architecture(qwen2)
    sparse = moe_config("qwen3-moe", decoder_sparse_step=2)
    with pytest.raises(UserError, match=r"layers \[0\] are dense MLPs \(decoder_sparse_step 2"):
        options_from_hf(sparse)
    with pytest.raises(UserError, match=r"layers \[1\] are dense MLPs"):
        options_from_hf(moe_config("qwen3-moe", mlp_only_layers=[1]))
    with pytest.raises(UserError, match=r"clip_qkv 8\.0: llmtrain does not clip"):
        options_from_hf(moe_config("olmoe", clip_qkv=8.0))
    with pytest.raises(UserError, match="sliding_window 16"):
        options_from_hf(moe_config("mixtral", sliding_window=16))


def test_a_moe_directory_without_llmtrain_moe_says_what_to_install(hf, tmp_path, monkeypatch):
    hf_dir = hf.save_dir(hf.random_model(moe_config("olmoe")), tmp_path / "hf")
    monkeypatch.setitem(sys.modules, "llmtrain_moe.options", None)  # import fails
    with pytest.raises(UserError) as info:
        HFWeights().load(hf_dir, {})
    message = str(info.value)
    assert "config.json: a Mixture-of-Experts model needs the plugin llmtrain-moe" in message
    assert "pip install llmtrain-moe" in message and "\n" not in message
    json.loads((tmp_path / "hf" / "config.json").read_text())  # the directory is intact


@pytest.mark.parametrize("version", ["4", "5"])
def test_an_export_written_under_either_major_version_keeps_its_experts(hf, version):
    """config.json files as `hf export` wrote them under transformers 4.57 and 5.23 (a Qwen3-MoE
    of 16 experts, top-4): 5.x names the count `num_local_experts`, which 4.x does not read
    (it would build 128 experts), so the export writes `num_experts` too."""
    from transformers import AutoConfig

    path = DATA / f"qwen3-moe-export-transformers{version}"
    written = json.loads((path / "config.json").read_text())
    assert written["transformers_version"].startswith(f"{version}.")
    assert written["num_experts"] == 16
    config = AutoConfig.from_pretrained(path)
    cfg = options_from_hf(config)
    assert (cfg.n_experts, cfg.top_k, cfg.head_dim, cfg.renormalize) == (16, 4, 24, False)
    theirs = hf.random_model(config)
    ours = from_hf_model(theirs)
    tokens = torch.randint(0, 300, (1, 40), generator=torch.Generator().manual_seed(2))
    assert hf.max_diff(logits(ours, tokens), logits(theirs, tokens)) <= hf.TOL


def test_training_losses_map_to_transformers_fields_or_are_named():
    """aux_loss_weight is transformers' router_aux_loss_coef; the router z-loss has no field,
    and the export says so (olmoe-tiny trains with 0.001, as OLMoE did)."""
    from llmtrain_hf.convert import hf_config
    from llmtrain_hf.transfer import _export_notes

    cfg = preset_options("olmoe-tiny", aux_loss_weight=0.03)
    assert hf_config(cfg).router_aux_loss_coef == 0.03
    notes = _export_notes(cfg, "OlmoeForCausalLM")
    assert "model.router_z_loss 0.001: OlmoeForCausalLM has no field for it" in "\n".join(notes)
    assert not any("router_z_loss" in n for n in _export_notes(preset_options("moe-tiny"), "x"))
