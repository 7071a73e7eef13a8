"""`llmtrain hf import` and `llmtrain hf export` on directories: a transformers Llama with its
tokenizer imports into a checkpoint that `llmtrain generate` samples from (the same greedy text as
transformers), exports back to the same weights and tokenizer; bad input is refused by name."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from llmtrain_hf.tokenizer import hf_tokenizer

from llmtrain.checkpoint.manager import Checkpointer
from llmtrain.checkpoint.state import ModelState
from llmtrain.core_mesh.config import unstructure
from llmtrain.core_mesh.errors import UserError
from llmtrain.models.presets import preset_config
from llmtrain.models.transformer import build_model
from llmtrain.train_loop.saved_model import load_model


def hf_logits(model, tokens):
    with torch.no_grad():
        return model(tokens).logits


def test_llama_dir_imports_generates_and_exports_back(
    tmp_path, run_cli, hf, plugins, tokenizer_json, tokens
):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    original = hf.random_model(hf.llama_config(tie_word_embeddings=True))
    hf_dir = hf.save_dir(original, tmp_path / "hf", tokenizer_json)
    ckpt, exported = tmp_path / "ckpt", tmp_path / "exported"

    code, out, err = run_cli("hf", "import", hf_dir, "-o", ckpt)
    assert code == 0, err
    assert "LlamaForCausalLM" in out and "tokenizer.json" in out
    record = json.loads((ckpt / "step-0" / "llmtrain.json").read_text())["info"]
    assert record["model"]["kind"] == "transformer" and record["model"]["n_kv_heads"] == 2
    spec = record["data"]["tokenizer"]["spec"]
    assert spec == {
        "kind": "hf",
        "path": str(ckpt / "tokenizer.json"),
        "eod_token": "<|endoftext|>",
    }

    model, _, step = load_model(str(ckpt), None, plugins)
    assert step == 0
    with torch.no_grad():
        assert hf.max_diff(model(tokens), hf_logits(original, tokens)) < hf.TOL

    # llmtrain generate: the same greedy continuation as transformers with the same tokenizer
    code, out, err = run_cli(
        "generate", ckpt, "--prompt", "The cat", "--temperature", "0",
        "--max-new-tokens", "10",
    )  # fmt: skip
    assert code == 0, err
    theirs = AutoTokenizer.from_pretrained(hf_dir)
    prompt = torch.tensor([theirs("The cat")["input_ids"]])
    with torch.no_grad():
        greedy = original.generate(
            prompt,
            max_new_tokens=10,
            do_sample=False,
            eos_token_id=theirs.eos_token_id,
            attention_mask=torch.ones_like(prompt),
        )
    new = [t for t in greedy[0, prompt.size(1) :].tolist() if t != theirs.eos_token_id]
    assert out.rstrip("\n") == "The cat" + theirs.decode(new)

    code, out, err = run_cli("hf", "export", ckpt, "-o", exported)
    assert code == 0, err
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in exported.iterdir()
    }
    back = AutoModelForCausalLM.from_pretrained(exported)
    assert type(back).__name__ == "LlamaForCausalLM" and back.dtype == torch.float32
    assert hf.max_diff(hf_logits(back, tokens), hf_logits(original, tokens)) == 0.0
    tok = AutoTokenizer.from_pretrained(exported)
    text = "A dog reads the data again. Under 3 trees!"
    assert tok(text)["input_ids"] == theirs(text)["input_ids"]
    assert tok.eos_token == "<|endoftext|>" and back.config.eos_token_id == tok.eos_token_id


def test_gpt2_dir_without_tokenizer_round_trips(tmp_path, run_cli, hf, tokens):
    from transformers import AutoModelForCausalLM

    original = hf.random_model(hf.gpt2_config(tie_word_embeddings=False))
    hf_dir = hf.save_dir(original, tmp_path / "hf")
    ckpt, exported = tmp_path / "ckpt", tmp_path / "exported"
    code, out, err = run_cli("hf", "import", hf_dir, "-o", ckpt)
    assert code == 0, err
    assert "no tokenizer.json" in err
    code, out, err = run_cli("generate", ckpt, "--prompt", "x")
    assert code == 2 and "pass --tokenizer" in err

    code, out, err = run_cli("hf", "export", ckpt, "-o", exported)
    assert code == 0, err
    assert "GPT2LMHeadModel" in out and "records no tokenizer" in err
    back = AutoModelForCausalLM.from_pretrained(exported)
    assert hf.max_diff(hf_logits(back, tokens), hf_logits(original, tokens)) < hf.TOL

    code, _, err = run_cli("hf", "export", ckpt, "-o", exported)
    assert code == 2 and "already holds a model (config.json); pass --overwrite" in err
    code, _, err = run_cli(
        "hf", "export", ckpt, "-o", exported, "--overwrite", "--dtype",
        "bfloat16",
    )  # fmt: skip
    assert code == 0, err
    assert AutoModelForCausalLM.from_pretrained(exported, dtype="auto").dtype == torch.bfloat16


def save_checkpoint(path, cfg, kind="tiny", data=None) -> str:
    """A committed step-1 checkpoint as the Trainer writes it (model part `train`)."""
    model = build_model(cfg)
    model.init_weights(torch.Generator().manual_seed(0))
    info = {"model": {"kind": kind, **unstructure(cfg)}, **({"data": data} if data else {})}
    checkpoints = Checkpointer(str(path))
    checkpoints.save(1, {"train": ModelState(model)}, info=info, blocking=True)
    checkpoints.close()
    return str(path)


def test_export_refuses_what_transformers_cannot_hold(tmp_path, run_cli):
    cfg = preset_config("tiny", qk_norm=True, qk_norm_scope="all_heads")
    ckpt = save_checkpoint(tmp_path / "qk", cfg)
    code, _, err = run_cli("hf", "export", ckpt, "-o", tmp_path / "out")
    assert code == 2 and "no transformers architecture computes this model" in err
    assert "Qwen3ForCausalLM: query/key norm: all_heads (needs head)" in err
    assert not (tmp_path / "out" / "config.json").exists()

    ckpt = save_checkpoint(tmp_path / "mix", preset_config("tiny", norm="layernorm"))
    code, _, err = run_cli("hf", "export", ckpt, "-o", tmp_path / "out")
    assert code == 2 and "LlamaForCausalLM: model.norm: layernorm (needs rmsnorm)" in err

    ckpt = save_checkpoint(tmp_path / "tiny", preset_config("tiny"))
    code, _, err = run_cli(
        "hf", "export", ckpt, "-o", tmp_path / "out",
        "--architecture", "Qwen2ForCausalLM",
    )  # fmt: skip
    assert code == 2 and "Qwen2ForCausalLM: biases q/k/v False" in err


def test_import_refuses_other_architectures_and_used_directories(tmp_path, run_cli, hf):
    from transformers import GemmaConfig, GemmaForCausalLM

    gemma = GemmaForCausalLM(
        GemmaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, vocab_size=64,
        )
    )  # fmt: skip
    hf_dir = hf.save_dir(gemma, tmp_path / "gemma")
    code, _, err = run_cli("hf", "import", hf_dir, "-o", tmp_path / "c1")
    assert code == 2 and "model_type 'gemma' (GemmaForCausalLM) is not supported" in err

    code, _, err = run_cli("hf", "import", tmp_path / "nothing", "-o", tmp_path / "c1")
    assert code == 2 and "does not exist; give a transformers model directory" in err

    gpt2_dir = hf.save_dir(hf.random_model(hf.gpt2_config(n_layer=1)), tmp_path / "gpt2")
    assert run_cli("hf", "import", gpt2_dir, "-o", tmp_path / "c2")[0] == 0
    code, _, err = run_cli("hf", "import", gpt2_dir, "-o", tmp_path / "c2")
    assert code == 2 and "already holds checkpoints (steps 0)" in err


def test_tokenizer_kinds_and_a_moved_tokenizer(tmp_path, plugins, tokenizer_json):
    tiktoken = {"name": "tiktoken:x", "spec": {"kind": "tiktoken", "path": "x.tiktoken"}}
    export = hf_tokenizer(tiktoken, plugins, max_len=64)
    assert export.tokenizer is None and "'tiktoken' tokenizer" in export.note

    path = tmp_path / "tok.json"
    path.write_text(tokenizer_json)
    moved = {"spec": {"kind": "hf", "path": str(tmp_path / "gone.json")}}
    with pytest.raises(UserError, match="Pass --tokenizer PATH"):
        hf_tokenizer(moved, plugins, max_len=64)
    assert hf_tokenizer(moved, plugins, max_len=64, path=str(path)).tokenizer is not None
    wrong = {**moved, "fingerprint": "0" * 32}
    with pytest.raises(UserError, match="not the tokenizer the checkpoint was trained with"):
        hf_tokenizer(wrong, plugins, max_len=64, path=str(path))

    exported = hf_tokenizer({"spec": {"kind": "bytes"}}, plugins, max_len=64).tokenizer
    text = "héllo <|pad|> wörld 3€"
    assert exported(text)["input_ids"][:6] == list(text.encode("utf-8"))[:6]
    assert exported.eos_token_id == 256 and exported.decode(list(text.encode())) == text


def test_help_and_plugins_import_neither_transformers_nor_torch():
    """Every `llmtrain` start loads this plugin: listing commands and plugins, and the help of
    `hf` itself, import none of transformers, torch, tokenizers, safetensors or the hub client
    (only `hf export` / `hf import` running do, and only what they use)."""
    probe = (
        "import contextlib, io, sys\n"
        "from llmtrain.core_mesh.cli import main\n"
        "for argv in (['--help'], ['plugins'], ['hf', '--help'], ['hf', 'export', '--help'],\n"
        "             ['hf', 'import', '--help']):\n"
        "    with contextlib.redirect_stdout(io.StringIO()) as out:\n"
        "        try:\n"
        "            main(argv)\n"
        "        except SystemExit:\n"
        "            pass\n"
        "    heavy = ('transformers', 'torch', 'tokenizers', 'safetensors', 'huggingface_hub')\n"
        "    print(' '.join(argv), bool(out.getvalue()), [m for m in heavy if m in sys.modules])\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.splitlines() == [
        "--help True []",
        "plugins True []",
        "hf --help True []",
        "hf export --help True []",
        "hf import --help True []",
    ]
