"""Real runs: train a Llama-style model (BPE tokenizer) and a GPT-2-style one (bytes tokenizer) for
a few steps on CPU, export the checkpoints, and check that transformers computes the same logits
and tokenizes the same ids; then import the export again and evaluate it like the original."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from llmtrain.data_pack.pack import pack
from llmtrain.train_loop.experiments.quickstart import write_corpus
from llmtrain.train_loop.saved_model import load_model, tokenizer_of

HELD_OUT = "The river follows a long road near the café. Our team builds the bridge today!"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, tokenizer_json):
    """train.jsonl (80 generated documents) and the BPE tokenizer.json."""
    root = tmp_path_factory.mktemp("corpus")
    write_corpus(root / "train.jsonl", 80, seed=0)
    (root / "tokenizer.json").write_text(tokenizer_json)
    return root


def train(run_cli, corpus, tmp_path, name: str, tokenizer: dict, model: dict) -> str:
    """Pack the corpus with `tokenizer`, train `model` 4 steps; the checkpoint directory."""
    data = tmp_path / f"{name}.zarr"
    pack([str(corpus / "train.jsonl")], str(data), tokenizer, workers=1, overwrite=True)
    config = {
        "name": name,
        "seed": 0,
        "run_dir": str(tmp_path / "runs"),
        "device": "cpu",
        "model": model,
        "data": {"train": [{"path": str(data)}], "seq_len": 32, "micro_batch": 4},
        "optimizer": {"kind": "adamw", "lr": 3e-3},
        "training": {"steps": 4, "log_every": 1},
        "loggers": [{"kind": "jsonl"}],
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    code, _, err = run_cli("run", path)
    assert code == 0, err
    return str(tmp_path / "runs" / name / "checkpoints")


def check_export(run_cli, plugins, tmp_path, ckpt: str, architecture: str) -> dict:
    """Export `ckpt`; transformers' logits and token ids against llmtrain's. The measured
    differences, for the report."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "hf"
    code, stdout, err = run_cli("hf", "export", ckpt, "-o", out)
    assert code == 0, err
    assert architecture in stdout and "step-4" in stdout
    ours, info, step = load_model(ckpt, None, plugins)
    assert step == 4
    tokenizer = tokenizer_of(info, None, plugins)
    ids = tokenizer.encode_batch([HELD_OUT])[0][:60]

    theirs_tok = AutoTokenizer.from_pretrained(out)
    assert theirs_tok(HELD_OUT)["input_ids"] == tokenizer.encode_batch([HELD_OUT])[0]
    assert theirs_tok.eos_token_id == tokenizer.eod_id
    assert theirs_tok.decode(ids) == tokenizer.decode(ids)

    theirs = AutoModelForCausalLM.from_pretrained(out)
    assert type(theirs).__name__ == architecture
    tokens = torch.tensor([ids])
    with torch.no_grad():
        diff = (theirs(tokens).logits - ours(tokens)).abs().max().item()
    assert diff < 1e-4
    assert theirs.config.vocab_size == ours.cfg.padded_vocab_size
    return {"out": out, "diff": diff, "tokens": tokens, "logits": ours(tokens).detach()}


def test_llama_style_run_exports_and_imports_back(run_cli, plugins, corpus, tmp_path):
    ckpt = train(
        run_cli,
        corpus,
        tmp_path,
        "llama",
        {"kind": "hf", "path": str(corpus / "tokenizer.json")},
        {
            "kind": "tiny",
            "max_seq_len": 64,
            "d_model": 32,
            "rope_base": 500000.0,
            "norm_eps": 1e-6,
            "tied_embeddings": False,
        },
    )
    exported = check_export(run_cli, plugins, tmp_path, ckpt, "LlamaForCausalLM")
    config = json.loads((exported["out"] / "config.json").read_text())
    assert config["num_key_value_heads"] == 2 and config["rms_norm_eps"] == 1e-6
    assert config["vocab_size"] == 320 and config["tie_word_embeddings"] is False

    # back into llmtrain: the same logits, and `llmtrain eval` gives the original's loss
    again = tmp_path / "again"
    code, _, err = run_cli("hf", "import", exported["out"], "-o", again)
    assert code == 0, err
    model, info, _ = load_model(str(again), None, plugins)
    with torch.no_grad():
        assert (model(exported["tokens"]) - exported["logits"]).abs().max().item() < 1e-5
    original = json.loads((tmp_path / "runs/llama/checkpoints/step-4/llmtrain.json").read_text())
    assert info["data"]["fingerprint"] == original["info"]["data"]["fingerprint"]
    losses = []
    for checkpoint in (ckpt, again):
        code, out, err = run_cli(
            "eval", checkpoint, "--data", tmp_path / "llama.zarr",
            "--seq-len", "32", "--batches", "2",
        )  # fmt: skip
        assert code == 0, err
        losses.append(json.loads(out)["loss"])
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)


def test_gpt2_style_run_exports_with_bytes_tokenizer(run_cli, plugins, corpus, tmp_path):
    ckpt = train(
        run_cli,
        corpus,
        tmp_path,
        "gpt2",
        {"kind": "bytes"},
        {
            "kind": "gpt2-124m",
            "vocab_size": 258,
            "max_seq_len": 64,
            "d_model": 32,
            "n_layers": 2,
            "n_heads": 2,
        },
    )
    exported = check_export(run_cli, plugins, tmp_path, ckpt, "GPT2LMHeadModel")
    config = json.loads((exported["out"] / "config.json").read_text())
    assert config["activation_function"] == "gelu_new" and config["n_inner"] == 128
    assert config.get("tie_word_embeddings", True) is True and config["vocab_size"] == 320
    generation = json.loads((exported["out"] / "generation_config.json").read_text())
    assert generation["suppress_tokens"] == list(range(258, 320))
