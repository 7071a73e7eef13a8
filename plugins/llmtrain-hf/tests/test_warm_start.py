"""The `hf` weight format: `llmtrain run` with `init: {from: HF_DIR}` starts from the weights of a
transformers Llama or GPT-2 directory (written by save_pretrained): after one step whose update is
zero its checkpoint holds exactly the converted weights and computes transformers' logits; a
model section that does not match the directory, or a directory without safetensors, is refused
by name."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from llmtrain_hf.convert import from_hf_state_dict, options_from_hf

from llmtrain.checkpoint.export import load_model_weights
from llmtrain.data_pack.pack import pack
from llmtrain.train_loop.experiments.quickstart import write_corpus
from llmtrain.train_loop.saved_model import load_model

# the run's model section for each directory: presets plus what the directory's config says
# (GPT-2 with dropout: an option that only shapes training may differ)
MODELS = {
    "llama": {
        "kind": "tiny",
        "vocab_size": 300,
        "pad_vocab_to": 1,
        "max_seq_len": 64,  # RoPE: any length
        "mlp_hidden": 96,
        "rope_base": 50000.0,
        "norm_eps": 1e-6,
        "tied_embeddings": False,
    },
    "gpt2": {
        "kind": "gpt2-124m",
        "vocab_size": 300,
        "pad_vocab_to": 1,
        "max_seq_len": 128,
        "d_model": 64,
        "n_layers": 2,
        "n_heads": 4,
        "dropout": 0.1,
    },
}


@pytest.fixture(scope="module")
def data(tmp_path_factory, tokenizer_json) -> str:
    """Generated documents packed with the BPE tokenizer the HF directories carry."""
    root = tmp_path_factory.mktemp("warm")
    write_corpus(root / "train.jsonl", 40, seed=0)
    (root / "tokenizer.json").write_text(tokenizer_json)
    out = str(root / "train.zarr")
    tokenizer = {"kind": "hf", "path": str(root / "tokenizer.json")}
    pack([str(root / "train.jsonl")], out, tokenizer, workers=1, overwrite=True)
    return out


def fine_tune(tmp_path, data: str, hf_dir: str, model: dict, **overrides):
    """A one-step run from `hf_dir` whose update is zero (gradients clipped to norm 0, no weight
    decay), so its checkpoint holds the weights it started from."""
    config = {
        "name": "ft",
        "run_dir": str(tmp_path / "runs"),
        "device": "cpu",
        "model": model,
        "data": {"train": [{"path": data}], "seq_len": 32, "micro_batch": 4},
        "optimizer": {"kind": "adamw", "lr": 1e-3, "weight_decay": 0.0},
        "training": {"steps": 1, "log_every": 1, "max_grad_norm": 0.0},
        "loggers": [{"kind": "jsonl"}],
        "init": {"from": hf_dir, **overrides},
    }
    path = tmp_path / "ft.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_run_starts_from_a_transformers_directory(
    run_cli, plugins, hf, data, tokenizer_json, tmp_path, tokens, arch
):
    config = hf.llama_config() if arch == "llama" else hf.gpt2_config()
    theirs = hf.random_model(config)
    hf_dir = hf.save_dir(theirs, tmp_path / "hf", tokenizer_json)
    code, _, err = run_cli("run", fine_tune(tmp_path, data, hf_dir, MODELS[arch]))
    assert code == 0, err
    assert "run.warm_start" in err and "format=hf" in err

    checkpoints = str(tmp_path / "runs" / "ft" / "checkpoints")
    weights, record, step = load_model_weights(checkpoints)
    expected = from_hf_state_dict(theirs.state_dict(), options_from_hf(theirs.config))
    assert step == 1 and sorted(weights) == sorted(expected)
    assert [k for k in expected if not torch.equal(weights[k], expected[k])] == []
    assert record["info"]["init"] == {"from": hf_dir, "step": None, "format": "hf"}

    ours, _, _ = load_model(checkpoints, None, plugins)
    with torch.no_grad():
        assert hf.max_diff(ours(tokens), theirs(tokens).logits) < hf.TOL


def test_a_model_section_that_does_not_match_is_refused(run_cli, hf, data, tmp_path):
    hf_dir = hf.save_dir(hf.random_model(hf.gpt2_config()), tmp_path / "hf")
    model = {**MODELS["gpt2"], "max_seq_len": 64, "norm_eps": 1e-6}
    code, _, err = run_cli("run", fine_tune(tmp_path, data, hf_dir, model))
    assert code == 2, err
    assert f"init.from: {hf_dir} holds another model than this run's `model:`" in err
    assert "model.max_seq_len: 128 in init.from, 64 here" in err  # learned positions: a table
    assert "model.norm_eps: 1e-05 in init.from, 1e-06 here" in err
    assert "tensor pos_emb.weight: (128, 64) in init.from, (64, 64) here" in err
    assert "dropout" not in err.split("Set these")[0]


def test_a_directory_without_safetensors_is_not_recognised(run_cli, hf, data, tmp_path):
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps(hf.llama_config().to_dict()))
    (hf_dir / "pytorch_model.bin").write_bytes(b"pickled weights are not read")
    path = fine_tune(tmp_path, data, str(hf_dir), MODELS["llama"])
    code, _, err = run_cli("run", path)
    assert code == 2, err
    assert f"{hf_dir} is in no format this installation reads" in err
    assert "hf: config.json and *.safetensors" in err
    code, _, err = run_cli("run", path, "init.format=hf")
    assert code == 2 and f"{hf_dir} is not in format 'hf'" in err


@pytest.mark.parametrize("case", ["llama3-rope-scaling", "mistral", "qwen2", "qwen3", "olmo2"])
def test_a_run_takes_its_model_from_the_directory(
    run_cli, plugins, hf, data, tokenizer_json, tmp_path, tokens, case
):
    """No shape copied by hand: `model: {from: HF_DIR}` (here with an override of an option
    that only shapes training), or no model section beside `init.from`."""
    theirs = hf.random_model(hf.rope_family_config(case))
    hf_dir = hf.save_dir(theirs, tmp_path / "hf", tokenizer_json)
    path = fine_tune(tmp_path, data, hf_dir, {"from": hf_dir, "dropout": 0.1})
    code, _, err = run_cli("run", path)
    assert code == 0, err
    checkpoints = tmp_path / "runs" / "ft" / "checkpoints"
    ours, info, _ = load_model(str(checkpoints), None, plugins)
    assert info["model"] == {
        **options_of(plugins, options_from_hf(theirs.config)),
        "dropout": 0.1,
    }
    weights, _, _ = load_model_weights(str(checkpoints))
    expected = from_hf_state_dict(theirs.state_dict(), options_from_hf(theirs.config))
    assert [k for k in expected if not torch.equal(weights[k], expected[k])] == []
    with torch.no_grad():
        assert hf.max_diff(ours(tokens), theirs(tokens).logits) <= hf.TOL

    config = yaml.safe_load(path.read_text())
    del config["model"]
    config["name"] = "bare"
    path.write_text(yaml.safe_dump(config))
    code, _, err = run_cli("run", path)
    assert code == 0, err
    ours, info, _ = load_model(str(tmp_path / "runs" / "bare" / "checkpoints"), None, plugins)
    assert info["model"]["dropout"] == 0.0
    with torch.no_grad():
        assert hf.max_diff(ours(tokens), theirs(tokens).logits) <= hf.TOL


def options_of(plugins, options) -> dict:
    """The model info a run records for options read from a directory (kind `transformer`)."""
    from llmtrain.core_mesh.config import unstructure

    return {"kind": "transformer", **unstructure(options)}
