"""`llmtrain export`: consolidated model weights (safetensors) from any committed checkpoint.

Runs in one process whatever layout saved the checkpoint (DCP reassembles the shards), reads only
the model's tensors (never the optimizer), and writes `model.safetensors` plus `model_options.json`
(the model options the run stored with the step) and `llmtrain.json` (where the weights came
from). The options file is not named config.json on purpose: the directory is not a transformers
model directory, and must not look like one (llmtrain-hf's `hf export` writes those).
"""

from __future__ import annotations

import json
import os
import re
import warnings
from collections.abc import Mapping
from typing import Any

import fsspec
import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from llmtrain.checkpoint.manager import Checkpointer, CheckpointError, load_failure
from llmtrain.checkpoint.safe_io import SafeLoadPlanner

MODEL_KEY = re.compile(r"^([^.]+)\.model\.")
# where train-loop's `ema` callback saves its moving average of the trainable weights, by the
# same names as the model's tensors (the other tensors, buffers among them, are the model's)
EMA_PREFIX = "ema.weights."
WEIGHTS = ("model", "ema")
OPTIONS_FILE = "model_options.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def model_prefix(keys: list[str], given: str | None = None) -> str:
    """The key prefix of the model's tensors: `<part>.model.` of a ModelState part."""
    if given is not None:
        return given
    parts = sorted({m.group(1) for k in keys if (m := MODEL_KEY.match(k))})
    if len(parts) != 1:
        raise CheckpointError(
            "cannot tell which tensors are the model's "
            f"(candidates: {', '.join(parts) or 'none'}); pass --prefix"
        )
    return f"{parts[0]}.model."


def load_model_weights(
    url: str,
    *,
    step: int | None = None,
    prefix: str | None = None,
    storage_options: Mapping[str, object] | None = None,
    weights: str = "model",
) -> tuple[dict[str, torch.Tensor], dict[str, Any], int]:
    """(weights by module name, the stored info, the step) from a committed checkpoint;
    `weights="ema"`: the `ema` callback's moving average in place of the trainable weights."""
    if weights not in WEIGHTS:
        raise CheckpointError(f"weights {weights!r}: choose one of {', '.join(WEIGHTS)}")
    checkpoints = Checkpointer(url, storage_options=storage_options)
    step = checkpoints.resolve_step(step)
    if step is None:
        raise CheckpointError(f"{url} has no committed checkpoint")
    reader, metadata = checkpoints.open_step(step)  # every file it reads checked first
    stored = {
        key: meta
        for key, meta in metadata.state_dict_metadata.items()
        if isinstance(meta, TensorStorageMetadata)
    }
    prefix = model_prefix(list(stored), prefix)
    wanted = [key for key in stored if key.startswith(prefix)]
    if not wanted:
        raise CheckpointError(f"{checkpoints.step_url(step)} has no tensors under {prefix!r}")
    averaged = [key for key in stored if key.startswith(EMA_PREFIX)]
    if weights == "ema":
        if not averaged:
            raise CheckpointError(
                f"{checkpoints.step_url(step)} holds no moving average of the weights: the run "
                "had no `ema` callback, or saved this step before the callback's start step; "
                "use --weights model"
            )
        wanted += averaged
    tensors = {
        key: torch.empty(tuple(stored[key].size), dtype=stored[key].properties.dtype)
        for key in wanted
    }
    with warnings.catch_warnings():  # one process on purpose; DCP warns that it assumes so
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            dcp_load(tensors, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
        except CheckpointException as exc:
            raise load_failure(exc, checkpoints.step_url(step)) from exc
    found = {key.removeprefix(prefix): tensors[key] for key in wanted if key.startswith(prefix)}
    if weights == "ema":
        for key in averaged:
            name = key.removeprefix(EMA_PREFIX)
            if name not in found:
                raise CheckpointError(
                    f"{checkpoints.step_url(step)}: the moving average holds {name!r}, which "
                    "the model's weights do not"
                )
            # float32 average into the weight's own dtype, as the model held it
            found[name] = tensors[key].to(found[name].dtype)
    return found, checkpoints.info(step), step


def export(
    url: str,
    output: str,
    *,
    step: int | None = None,
    prefix: str | None = None,
    dtype: str = "float32",
    overwrite: bool = False,
    storage_options: Mapping[str, object] | None = None,
    weights: str = "model",
) -> dict[str, object]:
    from safetensors.torch import save as save_safetensors

    if dtype not in DTYPES:
        raise CheckpointError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    tensors, info, step = load_model_weights(
        url, step=step, prefix=prefix, storage_options=storage_options, weights=weights
    )
    fs, path = fsspec.core.url_to_fs(output, **dict(storage_options or {}))
    if fs.exists(f"{path}/config.json"):
        # a transformers directory: its config.json beside llmtrain-named tensors would load as
        # a randomly initialised model (with only a warning)
        raise CheckpointError(
            f"{output} holds a transformers model (config.json); export llmtrain's format to "
            "another directory, or replace it with `llmtrain hf export ... --overwrite`"
        )
    if fs.exists(f"{path}/model.safetensors") and not overwrite:
        raise CheckpointError(f"{output} already holds an export; pass --overwrite to replace it")
    fs.makedirs(path, exist_ok=True)
    # tied weights share storage; safetensors wants each tensor on its own
    data = save_safetensors(
        {
            k: (v.to(DTYPES[dtype]) if v.is_floating_point() else v).contiguous().clone()
            for k, v in tensors.items()
        },
        metadata={"format": "pt", "source": f"{url.rstrip('/')}/step-{step}"},
    )
    with fs.open(f"{path}/model.safetensors", "wb") as f:
        f.write(data)
    config = (info.get("info") or {}).get("model") or {}
    with fs.open(f"{path}/{OPTIONS_FILE}", "w") as f:
        json.dump(config, f, indent=2)
    summary = {
        "source": f"{url.rstrip('/')}/step-{step}",
        "step": step,
        "tensors": len(tensors),
        "parameters": int(sum(v.numel() for v in tensors.values())),
        "bytes": len(data),
        "weights": weights,
    }
    with fs.open(f"{path}/llmtrain.json", "w") as f:
        json.dump(summary, f, indent=2)
    return {**summary, "output": os.fspath(output)}
