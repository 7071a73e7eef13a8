"""A file given as a tokenizer that is not one: each case through the CLI, one line naming the
file and saying what it is and what to give, exit 2 (a user error), never "this is a bug".

The tokenizers library reads any JSON as a broken tokenizer (`{"a": 1}` was "expected `,` or `}`
at line 1 column 5"), so the file is looked at before it is handed over.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

USER_ERROR = 2
GIVE = 'give the tokenizer.json of a Hugging Face tokenizer, or "bytes"'


@pytest.fixture
def corpus_file(write_jsonl) -> Path:
    return write_jsonl("in.jsonl", ["hello world", "a second document"])


def _refused(run_cli, corpus_file: Path, tmp_path: Path, *tokenizer: object) -> str:
    """Pack with `--tokenizer ...`; the one error line it must end with."""
    code, out, err = run_cli(
        "data",
        "pack",
        corpus_file,
        "-o",
        tmp_path / "out.zarr",
        "--workers",
        "1",
        "--no-progress",
        "--tokenizer",
        *tokenizer,
    )
    assert code == USER_ERROR, err
    assert out == ""
    assert "this is a bug" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert not (tmp_path / "out.zarr").exists()
    return lines[0]


def _write(path: Path, value: object) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(value if isinstance(value, str) else json.dumps(value), encoding="utf-8")
    return path


@pytest.mark.parametrize(
    ("value", "what"),
    [
        ({"a": 1}, 'an object with keys "a"'),
        ([1, 2], "an array"),
        ("just a string", "a string"),
        (3, "a number"),
        (None, "null"),
        ({"model": "BPE"}, 'an object with keys "model"'),
    ],
)
def test_json_that_is_no_tokenizer(run_cli, corpus_file, tmp_path, value, what):
    path = _write(tmp_path / "x.json", json.dumps(value))
    assert _refused(run_cli, corpus_file, tmp_path, path) == (
        f'error: {path}: valid JSON but not a tokenizer.json ({what}; no "model" with a '
        f'"vocab"/"merges"); {GIVE}'
    )


def test_model_config_points_to_the_tokenizer_beside_it(
    run_cli, corpus_file, tmp_path, tokenizer_json
):
    model = tmp_path / "model"
    config = _write(
        model / "config.json", {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    )
    assert _refused(run_cli, corpus_file, tmp_path, config) == (
        f"error: {config}: valid JSON but not a tokenizer.json: it looks like a model's "
        f"config.json (llama); give the model's tokenizer.json: there is none beside it in "
        f"{model} (transformers' save_pretrained writes one)"
    )
    (model / "tokenizer.json").write_bytes(tokenizer_json.read_bytes())
    line = _refused(run_cli, corpus_file, tmp_path, f"hf:{config}")
    assert line.endswith(f"give the tokenizer.json beside it: {model}/tokenizer.json")


def test_tokenizer_config_points_to_the_tokenizer_beside_it(
    run_cli, corpus_file, tmp_path, tokenizer_json
):
    model = tmp_path / "model"
    (model / "tokenizer.json").parent.mkdir()
    (model / "tokenizer.json").write_bytes(tokenizer_json.read_bytes())
    config = _write(
        model / "tokenizer_config.json",
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
         "chat_template": "{{ messages }}"},
    )  # fmt: skip
    assert _refused(run_cli, corpus_file, tmp_path, config) == (
        f"error: {config}: valid JSON but not a tokenizer.json: it looks like a "
        "tokenizer_config.json, a tokenizer's settings and chat template but not its vocabulary "
        f"(pack-chat takes it as --template); give the tokenizer.json beside it: "
        f"{model}/tokenizer.json"
    )


def test_vocab_json(run_cli, corpus_file, tmp_path):
    vocab = _write(tmp_path / "vocab.json", {f"t{i}": i for i in range(300)})
    line = _refused(run_cli, corpus_file, tmp_path, vocab)
    assert line.startswith(f"error: {vocab}: valid JSON but not a tokenizer.json: it looks like a ")
    assert "vocab.json, a vocabulary without its merges" in line


def test_malformed_json_names_file_line_and_column(run_cli, corpus_file, tmp_path):
    broken = _write(tmp_path / "broken.json", '{\n  "model": {"vocab": {"a": 0},\n  "merges": [}\n')
    assert _refused(run_cli, corpus_file, tmp_path, broken) == (
        f"error: {broken}:3:14: not a valid tokenizer.json: malformed JSON (Expecting value); "
        f"{GIVE}"
    )


@pytest.mark.parametrize(
    ("content", "said"),
    [
        (b"", "an empty file, not a tokenizer.json"),
        (b"  \n", "an empty file, not a tokenizer.json"),
        (b"\n\x0a\xff\x01protobuf", "not a tokenizer.json: binary, not UTF-8 text (byte 2;"),
    ],
)
def test_empty_or_binary_file(run_cli, corpus_file, tmp_path, content, said):
    path = tmp_path / "tokenizer.json"
    path.write_bytes(content)
    line = _refused(run_cli, corpus_file, tmp_path, path)
    assert line.startswith(f"error: {path}: {said}")
    assert line.endswith(GIVE)


def test_tokenizer_json_the_library_cannot_load(run_cli, corpus_file, tmp_path):
    """It looks like a tokenizer.json, so the library's own reason is worth showing."""
    path = _write(tmp_path / "odd.json", {"model": {"type": "BPE", "vocab": {"a": "zero"}}})
    line = _refused(run_cli, corpus_file, tmp_path, path)
    assert line.startswith(f"error: {path}: a tokenizer.json that tokenizers ")
    assert "cannot load: " in line


def test_directory_points_to_the_file_in_it(run_cli, corpus_file, tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    assert _refused(run_cli, corpus_file, tmp_path, f"hf:{folder}") == (
        f"error: {folder}: a directory, not a tokenizer file; give the file in it (for a "
        f"Hugging Face tokenizer: {folder}/tokenizer.json)"
    )


def test_json_given_as_tiktoken_ranks(run_cli, corpus_file, tmp_path, tokenizer_json):
    assert _refused(run_cli, corpus_file, tmp_path, f"tiktoken:{tokenizer_json}") == (
        f"error: {tokenizer_json}: JSON, not a .tiktoken ranks file (a 'base64-token rank' pair "
        f"a line); a Hugging Face tokenizer.json is given as hf:{tokenizer_json}"
    )


def test_pack_chat_and_inspect_say_the_same(run_cli, tmp_path, write_jsonl):
    """Every command that loads a tokenizer file goes through the same check (inspect reports
    the dataset and gives the reason in place of the decoded sample)."""
    not_tokenizer = _write(tmp_path / "x.json", {"a": 1})
    expected = f"error: {not_tokenizer}: valid JSON but not a tokenizer.json (an object with keys"
    chats = write_jsonl("chats.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    code, _, err = run_cli(
        "data", "pack-chat", chats, "-o", tmp_path / "chat.zarr", "--seq-len", "64",
        "--workers", "1", "--no-progress", "--tokenizer", not_tokenizer,
    )  # fmt: skip
    assert code == USER_ERROR
    assert err.strip().startswith(expected)

    texts = write_jsonl("in.jsonl", ["hello"])
    code, _, err = run_cli(
        "data", "pack", texts, "-o", tmp_path / "ok.zarr", "--tokenizer", "bytes",
        "--workers", "1", "--no-progress",
    )  # fmt: skip
    assert code == 0, err
    # inspect still reports the dataset, and says why it cannot decode the sample
    code, out, _ = run_cli("data", "inspect", tmp_path / "ok.zarr", "--tokenizer", not_tokenizer)
    assert code == 0
    assert f"cannot decode the sample: {expected.removeprefix('error: ')}" in out


def test_python_api_raises_a_user_error(tmp_path):
    from llmtrain.core_mesh.errors import UserError
    from llmtrain.data_pack.tokenizer import HFOptions, HFTokenizer

    path = _write(tmp_path / "x.json", [])
    with pytest.raises(UserError, match=r"valid JSON but not a tokenizer\.json \(an array;"):
        HFTokenizer(HFOptions(str(path)))
