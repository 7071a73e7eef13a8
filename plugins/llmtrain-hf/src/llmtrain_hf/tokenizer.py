"""Tokenizers across the border: what a checkpoint was trained with -> HF tokenizer files, and an
HF directory's tokenizer.json -> the tokenizer spec a checkpoint records (what `llmtrain generate`
reads).

A checkpoint records its tokenizer as packed (`info.data.tokenizer`: name, fingerprint, vocab
size, eod id and the `spec` that rebuilds it). `hf` tokenizers export as their own tokenizer.json;
`bytes` exports as an equivalent byte-level BPE with no merges (byte b is id b, the special
tokens follow); other kinds (tiktoken, plugins) are not exported and say so.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

import attrs
import fsspec

from llmtrain.core_mesh.errors import UserError
from llmtrain.core_mesh.plugins import PluginManager
from llmtrain.data_pack.tokenizer import TokenizerError, read_bytes, tokenizer_from_raw

if TYPE_CHECKING:  # the entry-point module imports no tokenizers
    from tokenizers import Tokenizer


@attrs.frozen
class TokenizerExport:
    """The HF tokenizer to write (None when it cannot be exported) and what to tell the user."""

    tokenizer: Any  # a transformers PreTrainedTokenizerFast, or None
    note: str
    json_text: str | None = None  # tokenizer.json exactly as trained with

    @property
    def eos_token_id(self) -> int | None:
        return None if self.tokenizer is None else self.tokenizer.eos_token_id


def _byte_chars() -> list[str]:
    """GPT-2's printable stand-in for each byte, the alphabet of byte-level BPE."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def bytes_tokenizer_json(special_tokens: list[str]) -> str:
    """tokenizer.json of a tokenizer with llmtrain's `bytes` ids: UTF-8 byte b is id b, the
    special tokens are 256, 257, ... in order."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: b for b, char in enumerate(_byte_chars())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(special_tokens))
    return tok.to_str()


def hf_tokenizer(
    record: dict[str, Any] | None,
    plugins: PluginManager,
    *,
    max_len: int,
    path: str | None = None,
) -> TokenizerExport:
    """The transformers tokenizer equivalent to a checkpoint's recorded tokenizer (`record`:
    `info.data.tokenizer`); `path` replaces the recorded tokenizer.json location."""
    if not record or "spec" not in record:
        return TokenizerExport(None, "the checkpoint records no tokenizer: none written")
    spec = dict(record["spec"])
    kind = spec.get("kind")
    if kind not in ("hf", "bytes"):
        return TokenizerExport(
            None,
            f"the {kind!r} tokenizer ({record.get('name')}) is not exported: only `hf` "
            "(tokenizer.json) and `bytes` tokenizers have an exact transformers equivalent here; "
            "add the tokenizer files to the directory yourself",
        )
    if path is not None:
        if kind != "hf":
            raise UserError(f"--tokenizer replaces an hf tokenizer.json; this one is {kind!r}")
        spec["path"] = path
    try:
        ours = tokenizer_from_raw(spec, plugins)
    except TokenizerError as exc:
        raise UserError(
            f"cannot read the checkpoint's tokenizer: {exc}. Pass --tokenizer PATH (the "
            "tokenizer.json it was trained with) or --no-tokenizer"
        ) from None
    if record.get("fingerprint") not in (None, ours.fingerprint):
        raise UserError(
            f"{spec.get('path', kind)} is not the tokenizer the checkpoint was trained with "
            f"(fingerprint {ours.fingerprint}, recorded {record['fingerprint']}); pass "
            "--tokenizer with the original tokenizer.json, or --no-tokenizer"
        )
    if kind == "hf":
        text = read_bytes(spec["path"]).decode("utf-8")
        note = f"tokenizer: {spec['path']} as tokenizer.json"
    else:
        text = bytes_tokenizer_json(list(ours.options.special_tokens))
        note = "tokenizer: llmtrain `bytes` as an equivalent byte-level tokenizer.json"
    if spec.get("parse_special"):
        note += " (special-token text in input is parsed, as in training)"
    else:
        note += (
            " (transformers parses special-token text such as '<|endoftext|>' in input; "
            "llmtrain trained with it as plain text)"
        )
    return TokenizerExport(_fast(text, ours.eod_id, max_len), note, text)


def _fast(text: str, eod_id: int, max_len: int) -> Any:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer.from_str(text)
    # transformers 5's tokenizer __init__ has no annotations
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok,
        eos_token=tok.id_to_token(eod_id),
        model_max_length=max_len,
        clean_up_tokenization_spaces=False,
    )


def save_tokenizer(export: TokenizerExport, out: str) -> None:
    """Write the tokenizer files into `out`. The config names the class
    `PreTrainedTokenizerFast`, which transformers 4 and 5 both load."""
    if export.tokenizer is None or export.json_text is None:
        return
    export.tokenizer.save_pretrained(out)
    # the file as trained with, not transformers' re-serialisation (which adds a no-op
    # post-processor): the same fingerprint, so `hf import` of this directory matches the data
    with open(os.path.join(out, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(export.json_text)
    config_path = os.path.join(out, "tokenizer_config.json")
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config.pop("backend", None)
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)


# --- import -----------------------------------------------------------------------------------------


def _eos_name(hf_dir: str, config: Any, tok: Tokenizer) -> str | None:
    """The end-of-sequence token of an HF directory: tokenizer_config.json's eos_token, else the
    model config's eos_token_id. A tokenizer_config.json that is not a JSON object is refused."""
    path = os.path.join(hf_dir, "tokenizer_config.json")
    if os.path.exists(path):
        fix = (
            "re-download it, or remove it (the end of document then comes from config.json's "
            "eos_token_id)"
        )
        settings = _json_file(path, fix)
        if not isinstance(settings, dict):
            raise UserError(f"{path}: expected a JSON object of tokenizer settings: {fix}")
        eos = settings.get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        if isinstance(eos, str) and tok.token_to_id(eos) is not None:
            return eos
    eos_id = getattr(config, "eos_token_id", None)
    if isinstance(eos_id, list):
        eos_id = eos_id[0] if eos_id else None
    if isinstance(eos_id, int):
        return tok.id_to_token(eos_id)
    return None


def _read(path: str, fix: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror or exc}: {fix}") from None


def _json_file(path: str, fix: str) -> Any:
    return json_of(_read(path, fix), path, fix)


def json_of(data: bytes, where: str, fix: str) -> Any:
    """The JSON value of a file's bytes; one line naming the file (`where`) and `fix` when they
    are not UTF-8 JSON."""
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise UserError(f"{where} is not text (a binary or damaged file): {fix}") from None
    except json.JSONDecodeError as exc:
        raise UserError(
            f"{where} is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}; "
            f"damaged or cut short): {fix}"
        ) from None


@attrs.frozen
class TokenizerImport:
    """An HF directory's tokenizer.json, read and checked: its bytes, the record a checkpoint
    keeps (its spec's path still the source's; None when not recorded) and what to tell."""

    data: bytes | None
    record: dict[str, Any] | None
    note: str
    eos: str | None = None


def read_tokenizer(hf_dir: str, config: Any, plugins: PluginManager) -> TokenizerImport:
    """HF_DIR/tokenizer.json (and its end of document) as a checkpoint will record it, read
    without writing anything. A tokenizer.json or tokenizer_config.json that cannot be read is
    a UserError naming it; a directory without tokenizer.json, or a tokenizer llmtrain cannot
    use (no end-of-document token), imports without one, and the note says so."""
    from tokenizers import Tokenizer

    source = os.path.join(hf_dir, "tokenizer.json")
    if not os.path.exists(source):
        return TokenizerImport(
            None,
            None,
            f"{hf_dir} has no tokenizer.json: no tokenizer recorded (pass --tokenizer to "
            "`llmtrain generate`)",
        )
    fix = "re-download it, or remove it to import the model without a tokenizer"
    data = _read(source, fix)
    try:
        tok = Tokenizer.from_str(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise UserError(f"{source} is not text (a binary or damaged file): {fix}") from None
    except Exception as exc:  # noqa: BLE001 - tokenizers raises plain Exception on bad files
        detail = " ".join(str(exc).split())
        raise UserError(f"{source} is not a readable tokenizer.json ({detail}): {fix}") from None
    eos = _eos_name(hf_dir, config, tok)
    spec = {"kind": "hf", "path": source, **({"eod_token": eos} if eos else {})}
    try:
        ours = tokenizer_from_raw(spec, plugins)
    except TokenizerError as exc:
        return TokenizerImport(None, None, f"tokenizer not recorded: {exc}")
    record = {
        "name": ours.name,
        "fingerprint": ours.fingerprint,
        "vocab_size": ours.vocab_size,
        "eod_id": ours.eod_id,
        "spec": spec,
    }
    return TokenizerImport(data, record, f"tokenizer: {source} (end of document: {eos!r})", eos)


def write_tokenizer(tokenizer: TokenizerImport, out: str) -> tuple[dict[str, Any] | None, str]:
    """Copy the tokenizer.json of `read_tokenizer` into the checkpoint directory `out`: (the
    record with the copy's path (the fingerprint is of the content: the same), the note)."""
    if tokenizer.data is None or tokenizer.record is None:
        return None, tokenizer.note
    target = f"{out.rstrip('/')}/tokenizer.json"
    if "://" not in target:
        target = os.path.abspath(target)
    with fsspec.open(target, "wb") as f:
        f.write(tokenizer.data)
    source = tokenizer.record["spec"]["path"]
    note = f"tokenizer: {source} copied to {target} (end of document: {tokenizer.eos!r})"
    return {**tokenizer.record, "spec": {**tokenizer.record["spec"], "path": target}}, note
