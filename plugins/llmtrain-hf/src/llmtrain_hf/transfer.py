"""Whole directories: an llmtrain checkpoint -> a transformers model directory (`export_checkpoint`),
and a transformers model directory -> an llmtrain checkpoint at step 0 (`import_hf`)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import warnings
from collections.abc import Iterator

import attrs
import torch

from llmtrain.checkpoint.export import DTYPES
from llmtrain.checkpoint.manager import Checkpointer
from llmtrain.checkpoint.state import ModelState
from llmtrain.core_mesh.config import unstructure
from llmtrain.core_mesh.errors import UserError
from llmtrain.core_mesh.plugins import PluginManager
from llmtrain.models.config import TransformerConfig
from llmtrain.models.transformer import Transformer
from llmtrain_hf import moe
from llmtrain_hf.architectures import GPT2
from llmtrain_hf.convert import (
    architecture_of,
    build_llmtrain,
    model_kind,
    portable_config,
    save_hf_model,
)
from llmtrain_hf.hf_dir import HFDir, read_config, read_weights_of
from llmtrain_hf.tokenizer import (
    TokenizerExport,
    hf_tokenizer,
    read_tokenizer,
    save_tokenizer,
    write_tokenizer,
)

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
def _one_process() -> Iterator[None]:
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
    weights: str = "model",
) -> Report:
    """Write a committed llmtrain checkpoint (newest step, or `step`) as a transformers model
    directory: config.json, model.safetensors, generation_config.json and the tokenizer files.

    `tokenizer` is a tokenizer.json to use instead of the recorded path (it must be the same
    tokenizer); `with_tokenizer=False` writes the model only; `architecture` picks one of
    those that compute the model (MistralForCausalLM for a Llama-shaped model, say);
    `weights="ema"`: the moving average train-loop's `ema` callback saved with the step."""
    from llmtrain.train_loop.saved_model import load_model

    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    if os.path.exists(out) and not os.path.isdir(out):
        raise UserError(f"-o {out} is a file; give a directory for the transformers model")
    if os.path.exists(os.path.join(out, "config.json")) and not overwrite:
        raise UserError(
            f"{out} already holds a model (config.json); pass --overwrite to replace it"
        )
    plugins = _plugins(plugins)
    with _one_process():
        model, info, step = load_model(checkpoint, step, plugins, weights=weights)
    if type(model) is not Transformer and not (
        isinstance(model, Transformer) and moe.is_moe(model.cfg)
    ):
        kind = info.get("model", {}).get("kind")
        raise UserError(
            f"{checkpoint}: model kind {kind!r} builds a {type(model).__name__}, not llmtrain's "
            "Transformer; hf export handles the built-in transformer kinds and llmtrain-moe's"
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
    source = f"{checkpoint.rstrip('/')}/step-{step}"
    with _staged(out) as staging:
        save_hf_model(
            staging, model, eos_token_id=tok.eos_token_id, dtype=DTYPES[dtype], architecture=arch
        )
        portable_config(staging, cfg)
        save_tokenizer(tok, staging)
        with open(os.path.join(staging, "llmtrain.json"), "w", encoding="utf-8") as f:
            json.dump(
                {"source": source, "step": step, "weights": weights, "model": info.get("model")},
                f,
                indent=2,
            )
    return Report(
        output=out,
        source=source,
        architecture=arch,
        parameters=sum(p.numel() for p in model.parameters()),
        files=sorted(os.listdir(out)),
        notes=notes,
    )


# files of an earlier export that a new one replaces even when it does not write them (a sharded
# model exported again in one file): transformers would read them with the new ones
STALE_WEIGHTS = re.compile(
    r"^(model|pytorch_model)(-\d+-of-\d+)?\.(safetensors|bin)$|\.index\.json$"
)


@contextlib.contextmanager
def _staged(out: str) -> Iterator[str]:
    """A directory to write the export into, beside `out`, that becomes `out` when the block
    ends (its files moved in, config.json last); removed if the block fails. A partly written
    export never sits in `out` looking complete (config.json is what marks one)."""
    target = os.path.abspath(out)
    parent, name = os.path.split(target)
    staging = os.path.join(parent, f".{name}.hf-export-partial")
    try:
        os.makedirs(parent, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)  # left by an export that was killed
        os.makedirs(staging)
    except OSError as exc:
        raise UserError(f"cannot create {out}: {_os_error(exc)}") from None
    try:
        yield staging
        written = sorted(os.listdir(staging), key=lambda n: n == "config.json")
        if not os.path.isdir(target):
            os.rename(staging, target)
            return
        for old in os.listdir(target):
            if STALE_WEIGHTS.search(old) and old not in written:
                os.remove(os.path.join(target, old))
        for file in written:
            os.replace(os.path.join(staging, file), os.path.join(target, file))
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _os_error(exc: OSError) -> str:
    """What went wrong with which path, in a few words ("File exists: /a/b")."""
    if exc.strerror and exc.filename:
        return f"{exc.strerror}: {exc.filename}"
    return exc.strerror or str(exc)


def _export_notes(cfg: TransformerConfig, arch: str) -> list[str]:
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
    if moe.is_moe(cfg) and cfg.router_z_loss:
        notes.append(
            f"model.router_z_loss {cfg.router_z_loss}: {arch} has no field for it (a training "
            "loss; aux_loss_weight is its router_aux_loss_coef)"
        )
    return notes


def import_hf(
    hf_dir: str,
    out: str,
    *,
    plugins: PluginManager | None = None,
) -> Report:
    """Read a transformers model directory (an architecture of `convert.ARCHITECTURES`) and save
    it as a committed llmtrain checkpoint at step 0 in `out` (a path or fsspec URL), with the
    model options (kind `transformer`, or llmtrain-moe's `moe`; every option explicit) and,
    when HF_DIR has
    tokenizer.json, the tokenizer: `llmtrain generate OUT` and `llmtrain eval` then work on it.

    Every file of HF_DIR is read and checked before anything is written (`hf_dir`): a missing,
    damaged or mismatched one is a UserError naming it, and `out` is left as it was."""
    source = HFDir.open(hf_dir)
    cfg = read_config(source)  # refuse an unsupported model before reading its weights
    plugins = _plugins(plugins)
    checkpoints = _empty_destination(out)
    try:
        weights, _ = read_weights_of(source, cfg)
        model = build_llmtrain(cfg.options)
        model.load_state_dict({k: v.to(torch.float32) for k, v in weights.items()}, strict=True)
        del weights
        model = model.to(torch.float32).eval()
        tokenizer = read_tokenizer(hf_dir, cfg.config, plugins)
        record = tokenizer.record
        if record is not None and record["vocab_size"] > model.cfg.vocab_size:
            raise UserError(
                f"{hf_dir}: tokenizer.json has {record['vocab_size']} ids but the model's "
                f"vocab_size is {model.cfg.vocab_size}"
            )
        with _removed_on_failure(out):
            record, note = write_tokenizer(tokenizer, out)
            # every option explicit: no preset defaults (kind `transformer`, or `moe`)
            kind = model_kind(model.cfg)
            info: dict[str, object] = {"model": {"kind": kind, **unstructure(model.cfg)}}
            if record is not None:
                info["data"] = {"fingerprint": record["fingerprint"], "tokenizer": record}
            with _one_process():
                checkpoints.save(0, {MODEL_PART: ModelState(model)}, info=info, blocking=True)
    finally:
        checkpoints.close()
    return Report(
        output=out,
        source=hf_dir,
        architecture=cfg.architecture,
        parameters=sum(p.numel() for p in model.parameters()),
        files=["step-0", *(["tokenizer.json"] if record is not None else [])],
        notes=[note],
    )


def _empty_destination(out: str) -> Checkpointer:
    """The Checkpointer of `out`, which must be (or be able to become) a directory without
    committed checkpoints."""
    from fsspec.core import url_to_fs

    try:
        fs, root = url_to_fs(out)
        is_file = fs.isfile(root)
    except (ValueError, ImportError) as exc:  # an unknown protocol or its missing package
        raise UserError(f"-o {out}: {exc}") from None
    except OSError as exc:
        raise UserError(f"-o {out}: {_os_error(exc)}") from None
    if is_file:
        raise UserError(f"-o {out} is a file; give a directory for the checkpoint")
    checkpoints = Checkpointer(out)
    try:
        existing = checkpoints.committed_steps()
    except OSError as exc:  # a file on the way (NotADirectoryError), no access
        checkpoints.close()
        raise UserError(f"-o {out}: cannot use it as a directory ({_os_error(exc)})") from None
    if existing:
        checkpoints.close()
        raise UserError(
            f"{out} already holds checkpoints (steps {', '.join(map(str, existing))}); import "
            "into an empty directory"
        )
    return checkpoints


@contextlib.contextmanager
def _removed_on_failure(out: str) -> Iterator[None]:
    """Create `out`; if what follows fails, remove what it wrote: all of `out` when this made it,
    else the files and directories it added. A directory that cannot be created is a UserError."""
    from fsspec.core import url_to_fs

    fs, root = url_to_fs(out)
    created = not fs.exists(root)
    try:
        fs.makedirs(root, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create {out}: {_os_error(exc)}") from None
    before = set() if created else set(fs.ls(root, detail=False))
    try:
        yield
    except BaseException:
        with contextlib.suppress(OSError):
            if created:
                fs.rm(root, recursive=True)
            else:
                for path in set(fs.ls(root, detail=False)) - before:
                    fs.rm(path, recursive=True)
        raise
