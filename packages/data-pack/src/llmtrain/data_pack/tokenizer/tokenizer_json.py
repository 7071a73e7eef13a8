"""Reading a tokenizer.json: the parsed file, or an error that says what the file is instead (a
model's config.json, a tokenizer_config.json, a vocab.json, a SentencePiece model, ...)."""

from __future__ import annotations

import json
from typing import Any

import fsspec

from llmtrain.data_pack.tokenizer.common import TokenizerError

_GIVE_TOKENIZER_JSON = 'give the tokenizer.json of a Hugging Face tokenizer, or "bytes"'
# keys of a Hugging Face tokenizer_config.json, none of which a tokenizer.json has at its top
_TOKENIZER_CONFIG_KEYS = {
    "tokenizer_class",
    "chat_template",
    "added_tokens_decoder",
    "model_max_length",
    "bos_token",
    "eos_token",
}
_JSON_TYPES = {list: "an array", str: "a string", int: "a number", float: "a number"}


def tokenizer_json(raw: bytes, path: str) -> dict[str, Any]:
    """The parsed tokenizer.json, or a TokenizerError that says what the file is instead: the
    tokenizers library reads any other JSON as a broken tokenizer ("expected `,` or `}` at line
    1 column 9" for `{"a": 1}`)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TokenizerError(
            f"{path}: not a tokenizer.json: binary, not UTF-8 text (byte {exc.start}; a "
            f"SentencePiece .model file?); {_GIVE_TOKENIZER_JSON}"
        ) from None
    if not text.strip():
        raise TokenizerError(f"{path}: an empty file, not a tokenizer.json; {_GIVE_TOKENIZER_JSON}")
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TokenizerError(
            f"{path}:{exc.lineno}:{exc.colno}: not a valid tokenizer.json: malformed JSON "
            f"({exc.msg}); {_GIVE_TOKENIZER_JSON}"
        ) from None
    except RecursionError:
        raise TokenizerError(f"{path}: JSON nested too deeply to be a tokenizer.json") from None
    if isinstance(spec, dict) and isinstance(spec.get("model"), dict) and "vocab" in spec["model"]:
        return spec
    raise TokenizerError(f"{path}: valid JSON but not a tokenizer.json{_what_it_is(spec, path)}")


def _what_it_is(spec: Any, path: str) -> str:
    """What a JSON file that is no tokenizer.json looks like, and what to give instead."""
    if isinstance(spec, dict) and ("model_type" in spec or "architectures" in spec):
        kind = spec.get("model_type") or ", ".join(map(str, spec.get("architectures") or []))
        return f": it looks like a model's config.json ({kind}); {_beside(path)}"
    if isinstance(spec, dict) and _TOKENIZER_CONFIG_KEYS & spec.keys():
        return (
            ": it looks like a tokenizer_config.json, a tokenizer's settings and chat template "
            f"but not its vocabulary (pack-chat takes it as --template); {_beside(path)}"
        )
    if isinstance(spec, dict) and len(spec) >= 256 and all(type(v) is int for v in spec.values()):
        return (
            ": it looks like a vocab.json, a vocabulary without its merges; save the tokenizer "
            "as one tokenizer.json (transformers' save_pretrained writes one) and give that"
        )
    if isinstance(spec, dict):
        keys = ", ".join(json.dumps(k) for k in list(spec)[:5]) or "none"
        held = f"an object with keys {keys}{', ...' if len(spec) > 5 else ''}"
    else:
        held = _JSON_TYPES.get(type(spec), json.dumps(spec))  # true, false or null
    return f' ({held}; no "model" with a "vocab"/"merges"); {_GIVE_TOKENIZER_JSON}'


def _beside(path: str) -> str:
    """Where the tokenizer.json of a Hugging Face model directory holding `path` would be."""
    folder = path.rpartition("/")[0] or "."
    candidate = f"{folder}/tokenizer.json"
    try:
        there = fsspec.core.url_to_fs(candidate)[0].exists(candidate)
    except Exception:  # noqa: BLE001 - only a hint: a storage that cannot tell us is "unknown"
        there = False
    if there:
        return f"give the tokenizer.json beside it: {candidate}"
    return (
        f"give the model's tokenizer.json: there is none beside it in {folder} "
        "(transformers' save_pretrained writes one)"
    )
