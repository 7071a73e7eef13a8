"""Warm start (`init: {from: ...}`): the run's model starts from weights trained elsewhere.

Weights only: the optimizer state, the lr schedule, the data order and the step counter start
fresh. A run that already has a committed checkpoint of its own resumes it instead (a restarted
fine-tune continues where it stopped), and `init.from` is not read.

The source is an llmtrain checkpoint directory, read through DCP at this run's layout whatever
layout wrote it (pipeline stages read their own tensors only), or a directory a `weights` plugin
recognises (`hf` of llmtrain-hf: a transformers model directory), read as one state dict that every
rank takes its shards of. Before a tensor moves the source is checked against this run: the model
options that change what the weights compute, every tensor's name and shape, and (when the source
records it) the tokenizer the source was trained with against the one of this run's data.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, cast

import structlog
import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from llmtrain.checkpoint.export import model_prefix
from llmtrain.checkpoint.manager import Checkpointer, CheckpointError, CorruptCheckpointError
from llmtrain.checkpoint.safe_io import UnsafeCheckpointError
from llmtrain.checkpoint.state import ModelState
from llmtrain.core_mesh.config import unstructure
from llmtrain.core_mesh.errors import UserError
from llmtrain.core_mesh.interfaces import ModelOptions, ParallelModel, WeightFormat
from llmtrain.core_mesh.plugins import MODEL, WEIGHTS, PluginManager, Registry
from llmtrain.train_loop.run_config import InitConfig
from llmtrain.train_loop.saved_model import model_choice

log = structlog.get_logger("llmtrain.train")

LLMTRAIN = "llmtrain"  # the built-in format: a directory of committed step-<n>/ checkpoints
STEP_DIR = re.compile(r"^step-(\d+)$")
# values an options class derives from several keys: compared as derived, so that e.g.
# `mlp_hidden: null` and the hidden size it implies are the same model
DERIVED = (
    ("padded_vocab_size", ("vocab_size", "pad_vocab_to"), "embedding rows"),
    ("hidden_size", ("mlp_hidden", "mlp_multiple_of"), "MLP hidden size"),
    ("kv_heads", ("n_kv_heads",), "key/value heads"),
    # `null` follows d_model / n_heads, or `bias`
    ("head_dim", ("head_dim",), "head size"),
    ("qkv_bias", ("qkv_bias",), "q/k/v biases"),
    ("out_bias", ("out_bias",), "output-projection bias"),
    ("mlp_bias", ("mlp_bias",), "MLP biases"),
)
_DERIVED_BY_NAME = {name: (keys, what) for name, keys, what in DERIVED}
SHOWN = 4  # differing tensors named in an error


class WarmStartError(UserError):
    """`init:` cannot start this run: what is wrong with the source, and what to do."""


def start(
    init: InitConfig | None,
    model: ParallelModel,
    checkpoints: Checkpointer,
    info: Mapping[str, Any],
    plugins: PluginManager,
) -> dict[str, Any] | None:
    """Load `init.from` into `model` unless the run has a checkpoint of its
    own; every rank calls it. Returns the provenance checkpoints record as `info["init"]`: this
    warm start's, or the one the resumed checkpoint recorded (None when there is none)."""
    latest = checkpoints.latest_step()
    if latest is not None:
        recorded: dict[str, Any] | None = checkpoints.info(latest).get("info", {}).get("init")
        if init is not None:
            log.info(
                "run.warm_start_skipped",
                message=f"the run resumes its own checkpoint (step {latest}); init.from "
                f"{init.from_} is not used",
            )
        return recorded
    if init is None:
        return None
    fmt, url, step = resolve(init, plugins)
    if step is not None:  # resolve gives a step for llmtrain checkpoints (fmt LLMTRAIN) only
        tensors = _load_checkpoint(init, url, step, model, info, plugins)
    else:
        tensors = _load_format(init, fmt, url, model, info, plugins)
    log.info("run.warm_start", source=url, step=step, format=fmt, tensors=tensors)
    return {"from": init.from_, "step": step, "format": fmt}


# --- which source ---------------------------------------------------------------------------------


def resolve(init: InitConfig, plugins: PluginManager) -> tuple[str, str, int | None]:
    """(format, the URL to read, the llmtrain step or None) of `init`, or a WarmStartError that
    says what the path lacks and which formats are installed."""
    url = init.from_.rstrip("/") or init.from_
    fs, root = _fs(url, init.storage_options)
    if not _exists(fs, root):
        raise WarmStartError(f"init.from: {url} does not exist")
    formats = plugins.registry(WEIGHTS)
    if init.format not in ("auto", LLMTRAIN) and init.format not in formats:
        raise WarmStartError(
            f"init.format: no weight format {init.format!r}; {_installed(formats)}"
        )
    if init.format in ("auto", LLMTRAIN):
        found = _llmtrain_source(url, init)
        if found is not None:
            return LLMTRAIN, *found
        if init.format == LLMTRAIN:
            raise WarmStartError(
                f"init.from: {url} holds no committed llmtrain checkpoint (a step-<n>/ directory "
                "with its COMMITTED marker); give a run's checkpoint directory "
                "(runs/<name>/checkpoints)"
            )
    if init.step is not None:
        raise WarmStartError(
            f"init.step: {init.step} is for llmtrain checkpoints, but {url} is not one "
            "(no committed step-<n>/ in it); remove init.step"
        )
    names = formats.names() if init.format == "auto" else [init.format]
    for name in names:
        weight_format = plugins.build(WEIGHTS, name)
        if weight_format.recognizes(url, dict(init.storage_options)):
            return name, url, None
    if init.format != "auto":
        raise WarmStartError(
            f"init.from: {url} is not in format {init.format!r} (it needs "
            f"{plugins.build(WEIGHTS, init.format).describe()})"
        )
    wanted = [f"{LLMTRAIN}: committed step-<n>/ checkpoint directories"] + [
        f"{name}: {plugins.build(WEIGHTS, name).describe()}" for name in names
    ]
    raise WarmStartError(
        f"init.from: {url} is in no format this installation reads; it needs one of: "
        f"{'; '.join(wanted)}. {_installed(formats)}"
    )


def _installed(formats: Registry) -> str:
    names = [f"{LLMTRAIN} (built in)"] + [
        f"{name} ({formats.get(name).origin.distribution or 'in process'})" for name in formats
    ]
    hint = "" if "hf" in formats else "; a Hugging Face directory needs `pip install llmtrain-hf`"
    return f"installed formats: {', '.join(names)}{hint}"


def _llmtrain_source(url: str, init: InitConfig) -> tuple[str, int] | None:
    """(checkpoint directory, step) when `url` is one (or one of its step-<n> directories)."""
    checkpoints = Checkpointer(url, storage_options=init.storage_options)
    if checkpoints.committed_steps():
        return url, _step(checkpoints, init.step)
    parent, _, name = url.rpartition("/")
    match = STEP_DIR.match(name)
    if parent and match:
        checkpoints = Checkpointer(parent, storage_options=init.storage_options)
        step = int(match.group(1))
        if step in checkpoints.committed_steps():
            if init.step not in (None, step):
                raise WarmStartError(
                    f"init.step: {init.step}, but init.from names step {step} ({url}); give one"
                )
            return parent, step
    return None


def _step(checkpoints: Checkpointer, step: int | None) -> int:
    try:
        resolved = checkpoints.resolve_step(step)
    except CheckpointError as exc:
        raise WarmStartError(f"init.step: {exc}") from None
    if resolved is None:  # callers ask only where committed steps exist
        raise WarmStartError(f"init.from: {checkpoints.url} holds no committed checkpoint")
    return resolved


class _FileSystem(Protocol):
    """What `_exists` asks of an fsspec file system."""

    def invalidate_cache(self, path: str, /) -> None: ...

    def exists(self, path: str, /) -> object: ...


def _fs(url: str, storage_options: Mapping[str, str]) -> tuple[_FileSystem, str]:
    from fsspec.core import url_to_fs

    try:
        # fsspec is untyped: url_to_fs gives (the filesystem, the path within it)
        return cast(tuple[_FileSystem, str], url_to_fs(url, **storage_options))
    except (ValueError, ImportError) as exc:  # an unknown protocol or its missing package
        raise WarmStartError(f"init.from: cannot open {url}: {exc}") from None


def _exists(fs: _FileSystem, root: str) -> bool:
    try:
        fs.invalidate_cache(root)
        return bool(fs.exists(root))
    except OSError:
        return False


# --- loading --------------------------------------------------------------------------------------


def _load_checkpoint(
    init: InitConfig,
    url: str,
    step: int,
    model: ParallelModel,
    info: Mapping[str, Any],
    plugins: PluginManager,
) -> int:
    """DCP into the parts this rank holds, resharded to this run's layout."""
    checkpoints = Checkpointer(url, storage_options=init.storage_options)
    where = checkpoints.step_url(step)
    source = checkpoints.info(step).get("info", {})
    try:
        stored = checkpoints.reader(step).read_metadata()
    except UnsafeCheckpointError as exc:
        raise WarmStartError(f"init.from: {where}: {exc}") from None
    try:
        prefix = model_prefix(list(stored.state_dict_metadata))
    except CheckpointError as exc:
        raise WarmStartError(f"init.from: {where}: {exc}") from None
    shapes = {
        key.removeprefix(prefix): tuple(meta.size)
        for key, meta in stored.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)
    }
    check_source(where, source.get("model"), shapes, info, plugins)
    if init.check_tokenizer:
        check_tokenizer(where, source.get("data") or {}, info["data"])
    state = {prefix.removesuffix(".model."): ModelState(model.parts)}
    try:
        checkpoints.load(state, step=step, restore_rng=False)
    except CorruptCheckpointError:  # a damaged file: its own line says which and what to do
        raise
    except CheckpointError as exc:
        raise WarmStartError(
            f"init.from: {exc}; init.from must hold this run's model (`model:` as the source's)"
        ) from None
    finally:
        checkpoints.close()
    return sum(len(part.state_dict()) for part in model.parts)


def _load_format(
    init: InitConfig,
    fmt: str,
    url: str,
    model: ParallelModel,
    info: Mapping[str, Any],
    plugins: PluginManager,
) -> int:
    """A plugin's whole state dict (on CPU, every rank the same); each rank keeps its shards."""
    weight_format: WeightFormat = plugins.build(WEIGHTS, fmt)
    weights, source_model = weight_format.load(url, dict(init.storage_options))
    expected = check_source(
        url, source_model, {k: tuple(v.shape) for k, v in weights.items()}, info, plugins
    )
    # the run's precision, whatever the file's (a bf16 safetensors into a float32 model)
    model.load_full_state_dict(
        {k: v.to(expected[k][1]) if v.is_floating_point() else v for k, v in weights.items()}
    )
    return len(weights)


# --- checks ---------------------------------------------------------------------------------------


def check_source(
    where: str,
    source_model: Mapping[str, Any] | None,
    shapes: Mapping[str, tuple[int, ...]],
    info: Mapping[str, Any],
    plugins: PluginManager,
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Raise a WarmStartError naming every model option and (some) tensors of the source that do
    not fit this run's model; returns this run's full (unsharded) tensors: name -> (shape, dtype)."""
    own = info["model"]
    expected = _full_tensors(own, plugins)
    lines = model_differences(source_model, own, plugins) if source_model else []
    lines += tensor_differences(shapes, {k: shape for k, (shape, _) in expected.items()})
    if lines:
        body = "\n".join(f"  {line}" for line in lines)
        raise WarmStartError(
            f"init.from: {where} holds another model than this run's `model:`:\n{body}\n"
            "Set these options in `model:` to the source's values (options that only shape "
            "training, such as dropout, doc_masking or init_std, may differ), or start from "
            "weights of this model"
        )
    return expected


def _full_tensors(
    own: Mapping[str, Any], plugins: PluginManager
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every tensor of this run's whole model (its state dict on the meta device)."""
    choice = model_choice(own, plugins, source="model")
    with torch.device("meta"):
        module: torch.nn.Module = plugins.build(MODEL, choice)
    return {k: (tuple(v.shape), v.dtype) for k, v in module.state_dict().items()}


def model_differences(
    source: Mapping[str, Any], own: Mapping[str, Any], plugins: PluginManager
) -> list[str]:
    """'model.KEY: A in init.from, B here' for each option of the source model info that changes
    what the weights compute and differs from this run's."""
    theirs, ours = _options(source, plugins), _options(own, plugins)
    if source.get("kind") != own.get("kind") and not _same_family(source, own, plugins):
        return [
            f"model.kind: {source.get('kind')!r} in init.from, {own.get('kind')!r} here (another "
            "model family)"
        ]
    a, b = _comparable(theirs, source), _comparable(ours, own)
    if a.get("positions") == b.get("positions") == "rope":
        a.pop("max_seq_len", None)
        b.pop("max_seq_len", None)
    # each options class names its options that only shape training (`training_only`)
    training_only = frozenset().union(*(o.training_only for o in (theirs, ours) if o is not None))
    lines = []
    for key in [*a, *(k for k in b if k not in a)]:
        if key in training_only or a.get(key, _NONE) == b.get(key, _NONE):
            continue
        if key in _DERIVED_BY_NAME and theirs is not None and ours is not None:
            keys, what = _DERIVED_BY_NAME[key]
            lines.append(
                f"model.{keys[0]}: {what} {a[key]} in init.from ({_raw(source, theirs, keys)}), "
                f"{b[key]} here ({_raw(own, ours, keys)})"
            )
        else:
            lines.append(f"model.{key}: {_shown(a, key)} in init.from, {_shown(b, key)} here")
    return lines


_NONE = object()


def _shown(values: Mapping[str, object], key: str) -> str:
    return repr(values[key]) if key in values else "(no such option)"


def _raw(raw: Mapping[str, object], options: ModelOptions, keys: Sequence[str]) -> str:
    values = {k: getattr(options, k, raw.get(k)) for k in keys}
    return ", ".join(f"{k}: {'null' if v is None else v}" for k, v in values.items())


def _options(model_info: Mapping[str, Any], plugins: PluginManager) -> ModelOptions | None:
    """The structured options of a model info dict, or None (a kind this install lacks)."""
    try:
        # a model plugin's options class provides ModelOptions (checked when a run starts)
        options: ModelOptions = plugins.options_of("model", model_choice(model_info, plugins))
    except UserError:
        return None
    return options


def _comparable(options: ModelOptions | None, raw: Mapping[str, object]) -> dict[str, object]:
    if options is None:
        return {k: v for k, v in raw.items() if k != "kind"}
    values = dict(unstructure(options))
    for derived, keys, _ in DERIVED:
        if hasattr(options, derived):
            for key in keys:
                values.pop(key, None)
            values[derived] = getattr(options, derived)
    # options that compute nothing in this model: `bias` once every projection's bias is
    # resolved, where no LayerNorm has one; the q/k norm's scope without a q/k norm
    if values.get("norm") == "rmsnorm" and "mlp_bias" in values:
        values.pop("bias", None)
    if values.get("qk_norm") is False:
        values.pop("qk_norm_scope", None)
    return values


def _same_family(source: Mapping[str, Any], own: Mapping[str, Any], plugins: PluginManager) -> bool:
    """Two kinds that build the same model class from the same options (presets of one family:
    `tiny` and `transformer`)."""
    registry = plugins.registry("model")
    if source.get("kind") not in registry or own.get("kind") not in registry:
        return False
    a, b = registry.get(source["kind"]), registry.get(own["kind"])
    return a.target is b.target and a.options is b.options


def tensor_differences(
    source: Mapping[str, tuple[int, ...]], expected: Mapping[str, tuple[int, ...]]
) -> list[str]:
    """'tensor NAME: SHAPE in init.from, SHAPE here' for missing, extra and reshaped tensors."""
    lines = [
        f"tensor {key}: {source.get(key, 'missing')} in init.from, "
        f"{expected.get(key, 'not in this model')} here"
        for key in [*expected, *(k for k in source if k not in expected)]
        if source.get(key) != expected.get(key)
    ]
    if len(lines) > SHOWN:
        lines = [*lines[:SHOWN], f"(and {len(lines) - SHOWN} more tensors)"]
    return lines


def check_tokenizer(where: str, source: Mapping[str, Any], own: Mapping[str, Any]) -> None:
    """The source was trained on ids of the same tokenizer as this run's data (when it says)."""
    theirs = source.get("fingerprint")
    if theirs is None or theirs == own["fingerprint"]:
        return
    their_name = (source.get("tokenizer") or {}).get("name", "unnamed")
    our_name = (own.get("tokenizer") or {}).get("name", "unnamed")
    raise WarmStartError(
        f"init.from: {where} was trained on data tokenized by {their_name} ({theirs}), but this "
        f"run's data was packed with {our_name} ({own['fingerprint']}): the same ids would mean "
        "other tokens. Pack the data with the source's tokenizer, or, when the ids agree where it "
        "matters (special tokens added at the end of the vocabulary), set "
        "init.check_tokenizer: false"
    )
