"""Instruction tuning from a transformers directory: `pack-chat --template HF_DIR` tokenizes a
conversation exactly as transformers' `apply_chat_template` does, a run with `init: {from:
HF_DIR}` starts from its weights, and `generate --chat` replies with what transformers' greedy
`generate` gives for the same chat."""

from __future__ import annotations

import itertools
import json

import yaml

from llmtrain.data_pack.store import PackedDataset

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MODEL = {
    "kind": "tiny",
    "vocab_size": 300,
    "pad_vocab_to": 1,
    "max_seq_len": 128,
    "mlp_hidden": 96,
    "rope_base": 50000.0,
    "norm_eps": 1e-6,
    "tied_embeddings": False,
    "doc_masking": True,
}


def hf_ids(tokenizer, messages, **options) -> list[int]:
    """transformers' rendering of a chat, tokenized as transformers does (special tokens in the
    text become their ids)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, **options)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_chat_tuning_from_a_transformers_directory(run_cli, hf, tmp_path):
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from llmtrain.data_pack.tokenizer import train_bpe

    hf_dir = tmp_path / "hf"
    model = hf.random_model(hf.llama_config())
    model.save_pretrained(hf_dir)
    bpe = train_bpe(hf.sentences(200), 300, special_tokens=SPECIALS)
    fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(bpe), eos_token="<|im_end|>")
    fast.chat_template = CHATML
    fast.save_pretrained(hf_dir)

    said = hf.sentences(60, seed=3)
    conversations = [
        [
            {"role": "user", "content": said[2 * i][:40]},
            {"role": "assistant", "content": said[2 * i + 1][:30]},
        ]
        for i in range(30)
    ]
    (tmp_path / "chat.jsonl").write_text(
        "".join(json.dumps({"messages": c}) + "\n" for c in conversations)
    )
    data = tmp_path / "chat.zarr"
    code, out, err = run_cli(
        "data",
        "pack-chat",
        tmp_path / "chat.jsonl",
        "-o",
        data,
        "--tokenizer",
        hf_dir / "tokenizer.json",
        "--template",
        hf_dir,  # chat_template.jinja and the eos_token <|im_end|> of tokenizer_config.json
        "--seq-len",
        128,
        "--log-dir",
        tmp_path / "logs",
    )
    assert code == 0, err
    dataset = PackedDataset(str(data))
    assert dataset.chat["template"]["stop"] == ["<|im_end|>"]
    # every conversation's ids are transformers' apply_chat_template ids, then the eod
    eod = fast.convert_tokens_to_ids("<|endoftext|>")
    offsets = dataset.doc_offsets[:]
    packed = [dataset.read(int(a), int(b)).tolist() for a, b in itertools.pairwise(offsets)]
    expected = sorted([*hf_ids(fast, c), eod] for c in conversations)
    trimmed = sorted(doc[: doc.index(eod) + 1] for doc in packed)  # less block padding
    assert trimmed == expected

    config = {
        "name": "sft",
        "run_dir": str(tmp_path / "runs"),
        "device": "cpu",
        "model": MODEL,
        "data": {"train": [{"path": str(data)}], "seq_len": 128, "micro_batch": 2},
        "optimizer": {"kind": "adamw", "lr": 1e-3, "weight_decay": 0.0},
        # a zero update, so the checkpoint holds the transformers weights it started from
        "training": {"steps": 1, "log_every": 1, "max_grad_norm": 0.0},
        "loggers": [{"kind": "jsonl"}],
        "init": {"from": str(hf_dir)},
    }
    (tmp_path / "sft.yaml").write_text(yaml.safe_dump(config))
    code, _, err = run_cli("run", tmp_path / "sft.yaml")
    assert code == 0, err

    chat = [{"role": "user", "content": said[0][:40]}]
    prompt = hf_ids(fast, chat, add_generation_prompt=True)
    import torch

    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None
        )[0, len(prompt) :].tolist()
    stop = fast.convert_tokens_to_ids("<|im_end|>")
    reply = out[: out.index(stop)] if stop in out else out
    code, printed, err = run_cli(
        "generate",
        tmp_path / "runs" / "sft" / "checkpoints",
        "--chat",
        "--prompt",
        said[0][:40],
        "--temperature",
        "0",
        "--max-new-tokens",
        12,
    )
    assert code == 0, err
    assert len(reply) >= 4, reply  # enough of a reply to compare
    assert printed == fast.decode(reply, skip_special_tokens=False) + "\n"
