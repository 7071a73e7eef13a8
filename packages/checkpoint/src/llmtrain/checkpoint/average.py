"""`llmtrain average`: one checkpoint whose weights are the mean of several committed steps.

The chosen steps' model weights (`train.model.<name>`, read by `export.load_model_weights`) are
read one step at a time and summed in float64 (memory: one step's weights and the sum), the sum
is divided by their count and stored as float32 (float64 weights stay float64): for each element
`torch.stack(values).double().mean(0).float()`. Tensors that are not floating point (none in
llmtrain's models) must be equal in every step and are kept as they are.

The result is a committed step of its own (`Checkpointer.save`: COMMITTED, the manifest,
llmtrain.json) in the output directory, numbered like the newest step averaged, whose info is
that step's (the model options, the data and its tokenizer, seq_len) plus an `averaged` record
(source, steps). It holds the model's weights only (no optimizer state, counters or callback
state): `eval`, `eval-tasks`, `generate`, `export`, `hf export` and warm starts (`init: {from:
...}`) read it like any checkpoint; a resume cannot go on from it.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from llmtrain.checkpoint.export import load_model_weights
from llmtrain.checkpoint.integrity import COMMIT_FILE, CheckpointError
from llmtrain.checkpoint.manager import Checkpointer
from llmtrain.core_mesh.storage_errors import storage_errors

# the part the weights are saved under: `train.model.<name>`, as the trainer's ModelState saves
# them (`export.MODEL_KEY` finds the model's tensors by it)
PART = "train"


def _listed(steps: Sequence[int]) -> str:
    shown = ", ".join(map(str, steps[-12:]))
    return f"committed: {'..., ' if len(steps) > 12 else ''}{shown or 'none'}"


def chosen_steps(
    source: Checkpointer,
    *,
    last: int | None = None,
    steps: Sequence[int] | None = None,
    at_least: int = 2,
) -> list[int]:
    """The committed steps chosen by `--last` (the newest `last`) or `--steps` (each of them
    committed), in step order; at least `at_least` of them (averaging needs two; `eval-tasks`
    scores one or more)."""
    if (last is None) == (steps is None):
        raise CheckpointError("choose the steps to average with one of --last K or --steps N,N,...")
    committed = source.committed_steps()
    if not committed:
        raise CheckpointError(f"{source.url} has no committed checkpoint")
    if last is not None:
        if last > len(committed):
            raise CheckpointError(
                f"--last {last}: {source.url} has {len(committed)} committed "
                f"step{'s' * (len(committed) != 1)} ({_listed(committed)})"
            )
        chosen = committed[len(committed) - last :]
    else:
        assert steps is not None
        if len(set(steps)) != len(steps):
            raise CheckpointError(f"--steps {','.join(map(str, steps))}: name each step once")
        for step in steps:
            if step not in committed:
                raise CheckpointError(
                    f"--steps: step {step} is not a committed step of {source.url} "
                    f"({_listed(committed)})"
                )
        chosen = sorted(steps)
    if len(chosen) < at_least:
        raise CheckpointError(
            f"averaging needs at least 2 checkpoints; {len(chosen)} chosen (step "
            f"{', '.join(map(str, chosen))}) of {source.url} ({_listed(committed)})"
        )
    return chosen


def _location(checkpoints: Checkpointer) -> tuple[str, str]:
    """(file system, path) of a checkpoint directory, a local one with its links resolved."""
    protocol = checkpoints.fs.protocol
    name = protocol if isinstance(protocol, str) else protocol[0]
    path = checkpoints.root.rstrip("/")
    if name in ("file", "local"):
        return "file", os.path.realpath(path)
    return name, path


def check_output(source: Checkpointer, output: Checkpointer, *, overwrite: bool) -> list[int]:
    """Refuse an output that is the source directory (or lies inside it) or holds a committed
    checkpoint (unless `overwrite`); returns the output's step directories (to remove when
    overwriting)."""
    (fs_in, path_in), (fs_out, path_out) = _location(source), _location(output)
    if fs_in == fs_out and (path_out == path_in or path_out.startswith(path_in + "/")):
        where = "is" if path_out == path_in else "lies inside"
        raise CheckpointError(
            f"-o {output.url}: that {where} the source checkpoint directory {source.url}; "
            "write the average to a directory of its own"
        )
    dirs = output._step_dirs()
    committed = [s for s, done in dirs.items() if done]
    if committed and not overwrite:
        raise CheckpointError(
            f"-o {output.url} already holds a committed checkpoint (step "
            f"{', '.join(map(str, committed))}); pass --overwrite to replace it, or choose "
            "another directory"
        )
    return list(dirs)


def _first_difference(a: Mapping[str, Any], b: Mapping[str, Any]) -> str:
    for key in sorted(set(a) | set(b)):
        if a.get(key) != b.get(key):
            return f"{key}: {a.get(key, '(absent)')!r} vs {b.get(key, '(absent)')!r}"
    return ""


def _check_same_run(
    url: str, first: int, first_info: Mapping[str, Any], step: int, info: Mapping[str, Any]
) -> None:
    """The steps hold one model (the same stored model options) trained on one data set (the
    same data fingerprint)."""
    model_a, model_b = first_info.get("model") or {}, info.get("model") or {}
    if model_a != model_b:
        raise CheckpointError(
            f"{url}: steps {first} and {step} hold different models (model "
            f"{_first_difference(model_a, model_b)}); average checkpoints of one model"
        )
    data_a = (first_info.get("data") or {}).get("fingerprint")
    data_b = (info.get("data") or {}).get("fingerprint")
    if data_a != data_b:
        raise CheckpointError(
            f"{url}: steps {first} and {step} were trained on different data (data fingerprint "
            f"{data_a} vs {data_b}): they are not checkpoints of one run; average the steps of "
            "one run"
        )


def _add(
    where: str,
    first: int,
    step: int,
    total: dict[str, torch.Tensor],
    tensors: Mapping[str, torch.Tensor],
) -> None:
    """Add step `step`'s weights to `total` (float sums in float64; other tensors must equal
    the first step's)."""
    if missing := sorted(total.keys() - tensors.keys()):
        raise CheckpointError(
            f"{where}: step {step} has no tensor {missing[0]!r}, which step {first} has: the "
            "checkpoints are of different model shapes"
        )
    if extra := sorted(tensors.keys() - total.keys()):
        raise CheckpointError(
            f"{where}: step {step} has a tensor {extra[0]!r}, which step {first} has not: the "
            "checkpoints are of different model shapes"
        )
    for name, tensor in tensors.items():
        kept = total[name]
        if tensor.shape != kept.shape:
            raise CheckpointError(
                f"{where}: tensor {name!r} has shape {tuple(tensor.shape)} at step {step} but "
                f"{tuple(kept.shape)} at step {first}: the checkpoints are of different model "
                "shapes"
            )
        if tensor.is_floating_point() != kept.is_floating_point():
            raise CheckpointError(
                f"{where}: tensor {name!r} is {tensor.dtype} at step {step} but {kept.dtype} at "
                f"step {first}"
            )
        if tensor.is_floating_point():
            kept.add_(tensor)  # float64 += the step's value, converted exactly
        elif tensor.dtype != kept.dtype or not torch.equal(tensor, kept):
            raise CheckpointError(
                f"{where}: tensor {name!r} ({tensor.dtype}, not floating point) differs between "
                f"steps {first} and {step}; only equal values of it can be averaged"
            )


def average(
    url: str,
    output: str,
    *,
    last: int | None = None,
    steps: Sequence[int] | None = None,
    overwrite: bool = False,
    storage_options: Mapping[str, object] | None = None,
) -> dict[str, object]:
    """Average the model weights of the committed steps `last` (the newest K) or `steps` of
    checkpoint directory `url` into a committed step of `output`; returns what was done."""
    source = Checkpointer(url, storage_options=storage_options)
    chosen = chosen_steps(source, last=last, steps=steps)
    target = Checkpointer(output, storage_options=storage_options)
    check_output(source, target, overwrite=overwrite)

    total: dict[str, torch.Tensor] = {}
    dtypes: dict[str, torch.dtype] = {}
    first = chosen[0]
    first_info: dict[str, Any] = {}
    newest_info: dict[str, Any] = {}
    for step in chosen:
        tensors, record, _ = load_model_weights(url, step=step, storage_options=storage_options)
        info = record.get("info") or {}
        if step == first:
            first_info = info
            dtypes = {name: t.dtype for name, t in tensors.items()}
            total = {
                name: t.to(torch.float64) if t.is_floating_point() else t
                for name, t in tensors.items()
            }
        else:
            _check_same_run(source.url, first, first_info, step, info)
            _add(source.url, first, step, total, tensors)
        newest_info = info
        del tensors

    weights = {
        name: (
            t.div_(len(chosen)).to(torch.promote_types(dtypes[name], torch.float32))
            if t.is_floating_point()
            else t
        )
        for name, t in total.items()
    }
    del total
    newest = chosen[-1]
    parameters = int(sum(t.numel() for t in weights.values()))
    info = {
        # the callbacks' state is of one step of the run and its tensors are not carried over
        **{key: value for key, value in newest_info.items() if key != "callbacks"},
        # a local source as an absolute path: the record outlives the directory it was run in
        "averaged": {"source": _absolute(source.url), "steps": chosen},
    }
    _clear(target, overwrite=overwrite)
    try:
        with warnings.catch_warnings():  # one process on purpose; DCP warns that it assumes so
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            target.save(newest, {PART: {"model": weights}}, info=info, blocking=True)
    finally:
        target.close()
    return {
        "source": source.url,
        "steps": chosen,
        "step": newest,
        "output": target.url,
        "checkpoint": target.step_url(newest),
        "tensors": len(weights),
        "parameters": parameters,
    }


def _absolute(url: str) -> str:
    return url if "://" in url else os.path.abspath(url)


def _clear(target: Checkpointer, *, overwrite: bool) -> None:
    """With `overwrite`, remove the step directories the output holds (each one's marker first,
    so a half-removed step is never taken for a checkpoint), once the average is computed."""
    if not overwrite:
        return
    with storage_errors(target.url, doing="write", error=CheckpointError):
        for step, committed in target._step_dirs().items():
            if committed:
                target.fs.rm(target._path(step, COMMIT_FILE))
            target.fs.rm(target._path(step), recursive=True)
