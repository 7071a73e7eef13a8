"""Whole directories: an llmtrain checkpoint -> a transformers model directory (`export_checkpoint`),
and a transformers model directory -> an llmtrain checkpoint at step 0 (`import_hf`)."""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from typing import Any

import attrs
import torch

from llmtrain.checkpoint.export import DTYPES
from llmtrain.checkpoint.manager import Checkpointer
from llmtrain.checkpoint.state import ModelState
from llmtrain.core_mesh.config import unstructure
from llmtrain.core_mesh.errors import UserError
from llmtrain.core_mesh.plugins import PluginManager
from llmtrain.models.transformer import Transformer
from llmtrain_hf.convert import (
    GPT2,
    architecture_of,
    from_hf_model,
    options_from_hf,
    portable_config,
    source_architecture,
    to_hf_model,
)
from llmtrain_hf.tokenizer import (
    TokenizerExport,
    hf_tokenizer,
    import_tokenizer,
    save_tokenizer,
)

# the model kind an imported checkpoint names: every option explicit, no preset defaults
IMPORT_KIND = "transformer"
# the part name the Trainer saves its model under (`train.model.*` in the checkpoint)
MODEL_PART = "train"


@attrs.frozen
class Report:
    """What an export or import wrote, and what the user should know about it."""

    output: str
    source: str
    architecture: str
    parameters: int
    files: list[str]
    notes: list[str]


@contextlib.contextmanager
def _one_process():
    """Quiet DCP's warning that it runs without a process group: that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _plugins(plugins: PluginManager | None) -> PluginManager:
    return plugins if plugins is not None else PluginManager().load_entry_points()


def export_checkpoint(
    checkpoint: str,
    out: str,
    *,
    step: int | None = None,
    dtype: str = "float32",
    tokenizer: str | None = None,
    with_tokenizer: bool = True,
    overwrite: bool = False,
    architecture: str | None = None,
    plugins: PluginManager | None = None,
) -> Report:
    """Write a committed llmtrain checkpoint (newest step, or `step`) as a transformers model
    directory: config.json, model.safetensors, generation_config.json and the tokenizer files.

    `tokenizer` is a tokenizer.json to use instead of the recorded path (it must be the same
    tokenizer); `with_tokenizer=False` writes the model only; `architecture` picks one of
    those that compute the model (MistralForCausalLM for a Llama-shaped model, say)."""
    from llmtrain.train_loop.saved_model import load_model

    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    if os.path.exists(os.path.join(out, "config.json")) and not overwrite:
        raise UserError(
            f"{out} already holds a model (config.json); pass --overwrite to replace it"
        )
    plugins = _plugins(plugins)
    with _one_process():
        model, info, step = load_model(checkpoint, step, plugins)
    if type(model) is not Transformer:
        kind = info.get("model", {}).get("kind")
        raise UserError(
            f"{checkpoint}: model kind {kind!r} builds a {type(model).__name__}, not llmtrain's "
            "Transformer; hf export handles the built-in transformer kinds"
        )
    cfg = model.cfg
    arch = architecture_of(cfg, architecture)
    notes = _export_notes(cfg, arch)
    record = info.get("data", {}).get("tokenizer")
    if with_tokenizer:
        tok = hf_tokenizer(record, plugins, max_len=cfg.max_seq_len, path=tokenizer)
    else:
        tok = TokenizerExport(None, "--no-tokenizer: no tokenizer files written")
    notes.append(tok.note)
    hf = to_hf_model(model, eos_token_id=tok.eos_token_id, dtype=DTYPES[dtype], architecture=arch)
    os.makedirs(out, exist_ok=True)
    hf.save_pretrained(out)
    portable_config(out, cfg)
    save_tokenizer(tok, out)
    source = f"{checkpoint.rstrip('/')}/step-{step}"
    with open(os.path.join(out, "llmtrain.json"), "w", encoding="utf-8") as f:
        json.dump({"source": source, "step": step, "model": info.get("model")}, f, indent=2)
    return Report(
        output=out,
        source=source,
        architecture=arch,
        parameters=sum(p.numel() for p in model.parameters()),
        files=sorted(os.listdir(out)),
        notes=notes,
    )


def _export_notes(cfg: Any, arch: str) -> list[str]:
    notes = []
    if cfg.padded_vocab_size != cfg.vocab_size:
        notes.append(
            f"vocab_size: {cfg.padded_vocab_size} (model.vocab_size {cfg.vocab_size} padded to a "
            f"multiple of {cfg.pad_vocab_to}); generation_config.json suppresses the padding ids"
        )
    if cfg.doc_masking:
        notes.append(
            "model.doc_masking is a training-time mask over packed documents: the exported "
            "model attends over its whole input, as llmtrain does at generation time"
        )
    if cfg.dropout and arch != GPT2:
        notes.append(
            f"model.dropout {cfg.dropout}: {arch} has attention dropout only "
            "(attention_dropout); llmtrain's residual dropout has no field (no effect at inference)"
        )
    if arch == GPT2 and not cfg.bias:
        notes.append("model.bias: false exports as GPT-2's biases set to zero (the same function)")
    return notes


def import_hf(
    hf_dir: str,
    out: str,
    *,
    plugins: PluginManager | None = None,
) -> Report:
    """Read a transformers model directory (an architecture of `convert.ARCHITECTURES`) and save
    it as a committed llmtrain checkpoint at step 0 in `out` (a path or fsspec URL), with the
    model options (kind `transformer`, every option explicit) and, when HF_DIR has
    tokenizer.json, the tokenizer: `llmtrain generate --checkpoint OUT` and `llmtrain eval` then work on it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if not os.path.isfile(os.path.join(hf_dir, "config.json")):
        raise UserError(f"{hf_dir}: no config.json; give a transformers model directory")
    plugins = _plugins(plugins)
    config = AutoConfig.from_pretrained(hf_dir, local_files_only=True)
    where = os.path.join(hf_dir, "config.json")
    options_from_hf(config, where=where)  # refuse before loading
    arch = source_architecture(config, where)
    checkpoints = Checkpointer(out)
    existing = checkpoints.committed_steps()
    if existing:
        raise UserError(
            f"{out} already holds checkpoints (steps {', '.join(map(str, existing))}); import "
            "into an empty directory"
        )
    if not any(name.endswith(".safetensors") for name in os.listdir(hf_dir)):
        raise UserError(
            f"{hf_dir} has no .safetensors weights; hf import reads safetensors only (no "
            "pickled pytorch_model.bin): convert them with transformers' save_pretrained first"
        )
    hf = AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32, local_files_only=True, use_safetensors=True
    )
    model = from_hf_model(hf)
    del hf
    record, note = import_tokenizer(hf_dir, out, config, plugins)
    if record is not None and record["vocab_size"] > model.cfg.vocab_size:
        raise UserError(
            f"{hf_dir}: tokenizer.json has {record['vocab_size']} ids but the model's vocab_size "
            f"is {model.cfg.vocab_size}"
        )
    info: dict[str, Any] = {"model": {"kind": IMPORT_KIND, **unstructure(model.cfg)}}
    if record is not None:
        info["data"] = {"fingerprint": record["fingerprint"], "tokenizer": record}
    try:
        with _one_process():
            checkpoints.save(0, {MODEL_PART: ModelState(model)}, info=info, blocking=True)
    finally:
        checkpoints.close()
    return Report(
        output=out,
        source=hf_dir,
        architecture=arch,
        parameters=sum(p.numel() for p in model.parameters()),
        files=["step-0", *(["tokenizer.json"] if record is not None else [])],
        notes=[note],
    )
