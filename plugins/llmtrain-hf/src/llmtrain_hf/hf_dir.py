"""Reading a transformers model directory: what `hf import` and the `hf` weight format read,
each file checked where it is opened.

- `config.json`: JSON text, an object with a `model_type` llmtrain maps (`convert.MODEL_TYPES`),
  not quantized, values the transformers config class and llmtrain's options accept.
- The weights: the shards `model.safetensors.index.json` lists (each present, plain file names),
  else every `*.safetensors` of the directory; each a readable safetensors file (safetensors
  checks its header and that the tensors cover the file, so a cut or a flipped header byte
  shows), of floating-point tensors, one file per tensor name.
- Together: exactly the tensors, with exactly the shapes, the config makes (a tied head, when
  stored, equal to the embedding): otherwise config.json and the weights are of different
  models, or one is damaged.

Every failure is a `UserError` naming the file and what to do. transformers' own loader is not
used: it fills missing tensors with random values, and prints a report before it raises.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import attrs
import torch

from llmtrain.core_mesh.errors import UserError
from llmtrain.models.config import TransformerConfig
from llmtrain_hf.convert import (
    GPT2_BUFFERS,
    GPT2_NAMES,
    ROPE_FAMILY_NAMES,
    ROTARY_BUFFER,
    build_llmtrain,
    options_from_hf,
    source_architecture,
    to_hf_state_dict,
)
from llmtrain_hf.tokenizer import json_of

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
SAFETENSORS = ".safetensors"
# the safetensors dtypes of weights llmtrain reads
WEIGHT_DTYPES = ("F16", "BF16", "F32", "F64")
DTYPE_BYTES = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8}
MAX_HEADER = 100_000_000  # safetensors' own limit on a header's length
REDOWNLOAD = "re-download the directory"
SHOWN = 2  # problems named in one message
HEAD = "lm_head."


def _config_errors() -> tuple[type[BaseException], ...]:
    """What building a transformers config from JSON values raises on a bad value: plain
    TypeError / ValueError / AttributeError (a `dtype` torch lacks) / KeyError in 4.x, and
    huggingface_hub's strict-dataclass validation errors in 5.x."""
    errors: tuple[type[BaseException], ...] = (TypeError, ValueError, AttributeError, KeyError)
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:  # an older huggingface_hub (transformers 4.x): no strict dataclasses
        return errors
    return (*errors, StrictDataclassError)


def one_line(exc: BaseException) -> str:
    """An exception's message on one line."""
    text = " ".join(part.strip() for part in str(exc).splitlines() if part.strip())
    return text.rstrip(".") or type(exc).__name__


@attrs.frozen
class HFDir:
    """An opened transformers model directory: `path` as given, its filesystem and root."""

    path: str
    fs: Any
    root: str

    @classmethod
    def open(cls, path: str, storage_options: Mapping[str, object] | None = None) -> HFDir:
        from fsspec.core import url_to_fs

        try:
            fs, root = url_to_fs(path, **dict(storage_options or {}))
        except (ValueError, ImportError) as exc:  # an unknown protocol or its missing package
            raise UserError(f"cannot open {path}: {one_line(exc)}") from None
        return cls(path.rstrip("/") or path, fs, root.rstrip("/") or root)

    def where(self, name: str) -> str:
        """The file `name` of the directory as the user would write it."""
        return f"{self.path}/{name}"

    def full(self, name: str) -> str:
        return f"{self.root}/{name}"

    def exists(self, name: str) -> bool:
        try:
            return bool(self.fs.isfile(self.full(name)))
        except OSError:
            return False

    def names(self) -> list[str]:
        try:
            entries = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            raise UserError(
                f"{self.path} does not exist; give a transformers model directory"
            ) from None
        except OSError as exc:
            raise UserError(f"cannot list {self.path}: {exc.strerror or one_line(exc)}") from None
        return sorted(str(entry).rstrip("/").rsplit("/", 1)[-1] for entry in entries)

    def read_bytes(self, name: str) -> bytes:
        where = self.where(name)
        try:
            data: bytes = self.fs.cat_file(self.full(name))  # fsspec has no annotations
            return data
        except FileNotFoundError:
            raise UserError(f"{where} is missing: {REDOWNLOAD}") from None
        except IsADirectoryError:
            raise UserError(f"{where} is a directory, not a file: {REDOWNLOAD}") from None
        except OSError as exc:
            raise UserError(f"cannot read {where}: {exc.strerror or one_line(exc)}") from None

    def read_json(self, name: str, fix: str = REDOWNLOAD) -> Any:
        """The JSON value of the file `name`; `fix` says what to do when it is not JSON."""
        return json_of(self.read_bytes(name), self.where(name), fix)


def _kind(value: object) -> str:
    return {dict: "an object", list: "a list", str: "a string", type(None): "null"}.get(
        type(value), type(value).__name__
    )


# --- config.json -----------------------------------------------------------------------------------


@attrs.frozen
class HFConfig:
    """config.json as read: its transformers config, llmtrain options and architecture."""

    config: Any
    options: TransformerConfig
    architecture: str


def read_config(hf: HFDir) -> HFConfig:
    """config.json of the directory, refused by name when llmtrain cannot map it."""
    from transformers import AutoConfig

    where = hf.where(CONFIG)
    if not hf.exists(CONFIG):
        try:
            there, is_file = hf.fs.exists(hf.root), hf.fs.isfile(hf.root)
        except OSError:
            there, is_file = True, False
        what = "does not exist" if not there else "is a file" if is_file else f"has no {CONFIG}"
        raise UserError(
            f"{hf.path} {what}; give a transformers model directory ({CONFIG} and weights)"
        )
    raw = hf.read_json(CONFIG)
    if not isinstance(raw, dict):
        raise UserError(
            f"{where}: expected a JSON object of model settings, found {_kind(raw)}: {REDOWNLOAD}"
        )
    if "model_type" not in raw:
        raise UserError(f"{where}: no model_type; is this a transformers model directory?")
    archs = raw.get("architectures")
    if not isinstance(raw["model_type"], str) or not (
        archs is None or (isinstance(archs, list) and all(isinstance(a, str) for a in archs))
    ):
        raise UserError(
            f"{where}: model_type must be a name and architectures a list of class names "
            f"(found {raw['model_type']!r}, {archs!r}): {REDOWNLOAD}"
        )
    arch = source_architecture(
        SimpleNamespace(model_type=raw["model_type"], architectures=archs), where
    )
    quantization = raw.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else None
        raise UserError(
            f"{where}: a quantized model (quantization_config, {method or 'unknown method'}); "
            "llmtrain reads unquantized weights: use the model's unquantized release"
        )
    errors = _config_errors()
    try:
        config = AutoConfig.for_model(**raw)
    except errors as exc:
        raise UserError(f"{where}: {one_line(exc)}: fix that value or {REDOWNLOAD}") from None
    try:
        options = options_from_hf(config, where=where)
    except (TypeError, ValueError, KeyError, AttributeError) as exc:  # a value llmtrain refuses
        raise UserError(f"{where}: {one_line(exc)}: fix that value or {REDOWNLOAD}") from None
    return HFConfig(config, options, arch)


# --- the weights -----------------------------------------------------------------------------------


def weight_files(hf: HFDir) -> tuple[list[str], dict[str, str] | None]:
    """(the safetensors files of the model, the index's tensor name -> shard): the shards the
    index lists, else every safetensors file of the directory (and no index)."""
    if hf.exists(INDEX):
        return _indexed(hf)
    names = [name for name in hf.names() if name.endswith(SAFETENSORS)]
    if not names:
        raise UserError(
            f"{hf.path} has no {SAFETENSORS} weights; llmtrain reads safetensors only (no pickled "
            "pytorch_model.bin): convert them with transformers' save_pretrained first"
        )
    return names, None


def _indexed(hf: HFDir) -> tuple[list[str], dict[str, str]]:
    """(shard files, tensor name -> shard) of model.safetensors.index.json, every shard present."""
    where = hf.where(INDEX)
    index = hf.read_json(INDEX)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise UserError(
            f"{where}: expected an object with a non-empty weight_map (tensor name -> shard file), "
            f"found {_kind(weight_map if isinstance(index, dict) else index)}: {REDOWNLOAD}"
        )
    shards = set(weight_map.values())
    bad = sorted(
        repr(s)
        for s in shards
        if not isinstance(s, str) or "/" in s or "\\" in s or not s.endswith(SAFETENSORS)
    )
    if bad:
        raise UserError(
            f"{where}: the weight_map names {', '.join(bad[:SHOWN])}, not a {SAFETENSORS} file of "
            f"the directory: {REDOWNLOAD}"
        )
    missing = sorted(s for s in shards if not hf.exists(s))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise UserError(
            f"{where} names {missing[0]}{more}, which is not in {hf.path}: download the missing "
            "shards (or the whole directory again)"
        )
    return sorted(shards), weight_map


def _damaged(where: str, detail: str) -> UserError:
    return UserError(
        f"{where} is not a readable safetensors file ({detail}; damaged or cut short): {REDOWNLOAD}"
    )


def _header(hf: HFDir, name: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """tensor name -> (safetensors dtype, shape) of one file, from its header alone. safetensors
    checks a local file's header whole (offsets, sizes, that the tensors cover the file); a
    remote one's header is parsed here, and safetensors checks the rest when it is loaded."""
    from fsspec.implementations.local import LocalFileSystem
    from safetensors import SafetensorError, safe_open

    where = hf.where(name)
    try:
        if isinstance(hf.fs, LocalFileSystem):
            with safe_open(hf.full(name), framework="pt") as f:
                slices = {key: f.get_slice(key) for key in f.keys()}
                return {k: (s.get_dtype(), tuple(s.get_shape())) for k, s in slices.items()}
        with hf.fs.open(hf.full(name), "rb") as f:
            size = hf.fs.size(hf.full(name))
            head = f.read(8)
            (length,) = struct.unpack("<Q", head) if len(head) == 8 else (-1,)
            if not 0 < length <= min(size - 8, MAX_HEADER):
                raise _damaged(where, f"header length {length} in a file of {size} bytes")
            header = json.loads(f.read(length).decode("utf-8"))
    except SafetensorError as exc:
        raise _damaged(where, one_line(exc)) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _damaged(where, f"header: {one_line(exc)}") from None
    except FileNotFoundError:
        raise UserError(f"{where} is missing: {REDOWNLOAD}") from None
    except OSError as exc:
        raise UserError(f"cannot read {where}: {exc.strerror or one_line(exc)}") from None
    return _parsed_header(where, header, size - 8 - length)


def _parsed_header(
    where: str, header: object, data_size: int
) -> dict[str, tuple[str, tuple[int, ...]]]:
    """What safetensors checks of a header, for one read through fsspec: each entry's dtype,
    shape and offsets agree, and the tensors cover the `data_size` bytes after the header."""
    entries = header.items() if isinstance(header, dict) else [("header", header)]
    out, end = {}, 0
    for key, entry in entries:
        if key == "__metadata__":
            continue
        shape, dtype, offsets = (
            (entry.get("shape"), entry.get("dtype"), entry.get("data_offsets"))
            if isinstance(entry, dict)
            else (None, None, None)
        )
        if not (
            isinstance(dtype, str)
            and isinstance(shape, list)
            and all(isinstance(n, int) and n >= 0 for n in shape)
            and isinstance(offsets, list)
            and len(offsets) == 2
            and all(isinstance(n, int) for n in offsets)
            and 0 <= offsets[0] <= offsets[1]
            and (
                dtype not in DTYPE_BYTES
                or offsets[1] - offsets[0] == DTYPE_BYTES[dtype] * math.prod(shape)
            )
        ):
            raise _damaged(where, f"header entry {key!r}")
        out[key], end = (dtype, tuple(shape)), max(end, offsets[1])
    if end != data_size:
        raise _damaged(where, f"its tensors end at byte {end} of {data_size} bytes of data")
    return out


@attrs.frozen
class Layout:
    """The weights of a directory as their headers say, checked against config.json: the files,
    and each tensor's file and name in the model (buffers older transformers saved, the causal
    mask and RoPE frequencies, are left out; bare-model names get their prefix)."""

    files: list[str]
    origin: dict[str, str]  # name in the file -> file
    names: dict[str, str]  # name in the file -> name in the model


def layout(hf: HFDir, cfg: HFConfig) -> Layout:
    """Read every weight file's header and refuse the directory unless the files hold exactly
    the tensors config.json makes, with their shapes, in floating point, each once."""
    files, weight_map = weight_files(hf)
    origin: dict[str, str] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        for key, (dtype, shape) in _header(hf, file).items():
            if key in origin:
                raise UserError(
                    f"{hf.where(file)}: tensor {key} is also in {origin[key]}; the directory "
                    f"mixes two downloads: {REDOWNLOAD}"
                )
            if dtype not in WEIGHT_DTYPES:
                raise UserError(
                    f"{hf.where(file)}: tensor {key} is {dtype}; llmtrain reads "
                    f"{', '.join(WEIGHT_DTYPES)} weights (a quantized model? use its unquantized "
                    "release)"
                )
            origin[key], shapes[key] = file, shape
    for key, shard in (weight_map or {}).items():
        if key not in origin:
            raise UserError(
                f"{hf.where(INDEX)} places tensor {key} in {shard}, which does not hold it; "
                f"the shards are of another download: {REDOWNLOAD}"
            )
    expected = _expected(hf, cfg.options)
    gpt2 = cfg.options.positions == "learned"
    kept = [
        k for k in origin if not (gpt2 and GPT2_BUFFERS.search(k)) and not ROTARY_BUFFER.search(k)
    ]
    prefix = _prefix(kept, set(expected))
    names = {k: k if k.startswith(HEAD) else prefix + k for k in kept}
    got = {names[k]: (shapes[k], origin[k]) for k in kept}
    head = f"{HEAD}weight"
    if cfg.options.tied_embeddings:  # the head may be stored: the embedding, checked on load
        expected.pop(head, None)
        if head in got:
            expected[head] = expected[_embedding(cfg.options)]
    problems = [f"{n} {_shape(expected[n])} is missing" for n in sorted(expected.keys() - got)]
    problems += [f"{n} in {got[n][1]} has no place in it" for n in sorted(got.keys() - expected)]
    problems += [
        f"{n} is {_shape(got[n][0])} in {got[n][1]}, {_shape(expected[n])} by {CONFIG}"
        for n in sorted(expected.keys() & got.keys())
        if got[n][0] != expected[n]
    ]
    if problems:
        more = f" (and {len(problems) - SHOWN} more)" if len(problems) > SHOWN else ""
        held = files[0] if len(files) == 1 else f"{len(files)} files of {INDEX}"
        raise UserError(
            f"{hf.path}: the weights ({held}) do not fit {CONFIG}: {'; '.join(problems[:SHOWN])}"
            f"{more}. {CONFIG} and the weights are of different models, or one is damaged: "
            f"{REDOWNLOAD}"
        )
    return Layout(files, origin, names)


def _expected(hf: HFDir, options: TransformerConfig) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor of the model `options` describe (a tied head included)."""
    try:
        with torch.device("meta"):
            model = build_llmtrain(options)
    except (TypeError, ValueError) as exc:  # transformers 4.x lets e.g. a float size through
        raise UserError(
            f"{hf.where(CONFIG)}: describes no model llmtrain can build ({one_line(exc)}): fix "
            f"that value or {REDOWNLOAD}"
        ) from None
    state = to_hf_state_dict(model.state_dict(), options)
    return {name: tuple(t.shape) for name, t in state.items()}


def _embedding(options: TransformerConfig) -> str:
    names = GPT2_NAMES if options.positions == "learned" else ROPE_FAMILY_NAMES
    return names["tok_emb.weight"]


def _prefix(names: list[str], expected: set[str]) -> str:
    """The prefix `names` lack: checkpoints of the bare model (GPT-2's `h.0...`, `wte.weight`)
    have no `transformer.` / `model.`, which transformers adds when it loads them."""
    prefixes = {name.split(".", 1)[0] + "." for name in expected if not name.startswith(HEAD)}
    if len(prefixes) != 1:
        return ""
    (prefix,) = prefixes
    return "" if any(name.startswith(prefix) for name in names) else prefix


def _shape(shape: Any) -> str:
    return "(" + ", ".join(map(str, shape)) + ")"


def load_weights(hf: HFDir, cfg: HFConfig, checked: Layout) -> dict[str, torch.Tensor]:
    """The HF state dict of a checked `Layout` (local files memory-mapped), named as the model
    names them; a stored tied head must equal the embedding."""
    from fsspec.implementations.local import LocalFileSystem
    from safetensors import SafetensorError
    from safetensors.torch import load, load_file

    state: dict[str, torch.Tensor] = {}
    for file in checked.files:
        where = hf.where(file)
        try:
            if isinstance(hf.fs, LocalFileSystem):
                tensors = load_file(hf.full(file))
            else:
                tensors = load(hf.read_bytes(file))
        except SafetensorError as exc:
            raise _damaged(where, one_line(exc)) from None
        except OSError as exc:
            raise UserError(f"cannot read {where}: {exc.strerror or one_line(exc)}") from None
        state.update({checked.names[k]: v for k, v in tensors.items() if k in checked.names})
    head, embedding = f"{HEAD}weight", _embedding(cfg.options)
    if cfg.options.tied_embeddings and head in state:
        if not torch.equal(state.pop(head), state[embedding]):
            file = next(f for k, f in checked.origin.items() if checked.names.get(k) == head)
            raise UserError(
                f"{hf.where(CONFIG)}: tie_word_embeddings is true, but {hf.where(file)} holds an "
                f"{head} that differs from {embedding}: set tie_word_embeddings to false if the "
                f"model has its own head, or {REDOWNLOAD}"
            )
    return state


def read_weights_of(hf: HFDir, cfg: HFConfig) -> tuple[dict[str, torch.Tensor], list[str]]:
    """(llmtrain weights, the weight files read) of the directory whose config is `cfg`, every
    file checked; the weights in the files' dtype (local files memory-mapped)."""
    from llmtrain_hf.convert import from_hf_state_dict

    checked = layout(hf, cfg)
    state = load_weights(hf, cfg, checked)
    return from_hf_state_dict(state, cfg.options), checked.files


def read_model(
    path: str, storage_options: Mapping[str, object] | None = None
) -> tuple[HFConfig, dict[str, torch.Tensor], list[str]]:
    """(config, llmtrain weights, the weight files read) of a transformers model directory."""
    hf = HFDir.open(path, storage_options)
    cfg = read_config(hf)
    weights, files = read_weights_of(hf, cfg)
    return cfg, weights, files
