"""`model: {from: PATH, ...}`: a run's model options taken from where its weights are.

PATH is an llmtrain checkpoint directory (the model options its step records) or a directory a
`weights` plugin recognises (llmtrain-hf: a transformers directory's config.json), found as
`init: {from: ...}` finds it. The other keys of the section override the source's options, so
`model: {from: HF_DIR, doc_masking: true}` is that model trained with document masking. A run
with `init.from` and a `model:` section without `kind` (or none) takes its model from
`init.from`.

The section is expanded before the config is structured: the run's written config.yaml holds
every option explicitly, as if they had been typed. A run that resumes its own checkpoint takes
the model that checkpoint recorded, so a resume does not need the source any more (it may have
moved, or its credentials expired).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from llmtrain.core_mesh.config import Problem, line_of, load_config
from llmtrain.core_mesh.errors import UserError
from llmtrain.core_mesh.plugins import WEIGHTS, PluginManager
from llmtrain.core_mesh.redact import refuse_redacted
from llmtrain.train_loop.run_config import (
    InitConfig,
    RunConfig,
    layout_problems,
    run_path_problems,
)

FROM = "from"


def load_run_config(
    path: str,
    plugins: PluginManager,
    overrides: Sequence[str] = (),
    *,
    paths: Literal["exist", "writable"] | None = None,
    world_size: int | None = None,
) -> RunConfig:
    """A run config file with its overrides applied and `model: {from: ...}` expanded. A run's
    written config.yaml whose credentials were redacted is refused before anything (the model
    source included) could send them. `paths`: also check the places the run writes
    (`run_path_problems`): that none exists as the wrong kind, and with "writable" that this
    process can write them; and the data section against the model and, with `world_size`,
    the launch (`layout_problems`). Every problem with its file and line."""

    def check(config: RunConfig) -> list[Problem]:
        if paths is None:
            return []
        return [
            *layout_problems(config, plugins, world_size=world_size),
            *run_path_problems(config, plugins, writable=paths == "writable"),
        ]

    return load_config(
        path,
        RunConfig,
        plugins=plugins,
        overrides=overrides,
        prepare=lambda raw: with_model_source(refuse_redacted(raw, path), plugins, path),
        check=check,
    )


def with_model_source(raw: object, plugins: PluginManager, config_file: str) -> object:
    """`raw` (a parsed run config) with its `model:` section expanded from its source; the
    same object when there is nothing to expand. Errors name `config_file`."""
    try:
        return _expanded(raw, plugins)
    except UserError as exc:
        # at the line of the section the source was named in
        model = raw.get("model") if isinstance(raw, Mapping) else None
        named = ("model",) if isinstance(model, Mapping) and FROM in model else ("init", FROM)
        line = line_of(raw, named)
        raise UserError(f"{config_file}{f':{line}' if line else ''}: {exc}") from None


def _expanded(raw: object, plugins: PluginManager) -> object:
    if not isinstance(raw, Mapping):
        return raw
    model = raw.get("model")
    init = raw.get("init")
    untyped = model is None or (isinstance(model, Mapping) and not {"kind", FROM} & set(model))
    if untyped and isinstance(init, Mapping) and isinstance(init.get(FROM), str):
        model = {FROM: init[FROM], **(model or {})}
    if not isinstance(model, Mapping) or FROM not in model:
        return raw
    source = model[FROM]
    if not isinstance(source, str) or not source.strip():
        raise UserError(f"model.from: expected a path or URL, got {source!r}")
    overrides = {k: v for k, v in model.items() if k != FROM}
    options = resumed_model(raw)
    if options is None:
        options = source_model(source, init, plugins)
    return {**raw, "model": {**options, **overrides}}


def resumed_model(raw: Mapping[str, object]) -> dict[str, object] | None:
    """The model the run's own newest committed checkpoint recorded, when it will resume it."""
    from llmtrain.checkpoint.manager import Checkpointer

    checkpoint = raw.get("checkpoint") or {}
    name = raw.get("name")
    if not isinstance(checkpoint, Mapping) or checkpoint.get("resume") == "never":
        return None
    if not isinstance(name, str) or not name:
        return None
    url = checkpoint.get("dir") or str(Path(str(raw.get("run_dir", "runs"))) / name / "checkpoints")
    try:
        checkpoints = Checkpointer(
            url, storage_options=dict(checkpoint.get("storage_options") or {})
        )
        step = checkpoints.latest_step()
        if step is None:
            return None
        recorded = checkpoints.info(step).get("info", {}).get("model")
    except (OSError, ValueError):  # the run's checkpoint storage is not there (yet)
        return None
    return dict(recorded) if recorded else None


def source_model(source: str, init: Any, plugins: PluginManager) -> dict[str, object]:
    """The model info (`{"kind": ..., **options}`) recorded at `source`. Storage options and
    format come from `init:` when it reads the same source."""
    from llmtrain.checkpoint.manager import Checkpointer
    from llmtrain.train_loop import warm_start

    same = isinstance(init, Mapping) and _same_place(init.get(FROM), source)
    lookup = InitConfig(
        from_=source,
        step=init.get("step") if same else None,
        format=init.get("format", "auto") if same else "auto",
        storage_options=dict(init.get("storage_options") or {}) if same else {},
    )
    try:
        fmt, url, step = warm_start.resolve(lookup, plugins)
    except warm_start.WarmStartError as exc:
        raise UserError(f"model.from: {str(exc).removeprefix('init.from: ')}") from None
    if fmt == warm_start.LLMTRAIN and step is not None:  # resolve gives llmtrain's a step
        checkpoints = Checkpointer(url, storage_options=lookup.storage_options)
        recorded = checkpoints.info(step).get("info", {}).get("model")
        if not recorded:
            raise UserError(
                f"model.from: {url} step {step} does not record its model options; write the "
                "model section out in full"
            )
        return dict(recorded)
    entry = plugins.registry(WEIGHTS).get(fmt)
    # built unchecked: `model` is the one optional method of a weight format
    read = getattr(entry.target(plugins.options_of(WEIGHTS, fmt)), "model", None)
    if read is None:
        raise UserError(
            f"model.from: the weight format {fmt!r} ({entry.origin.describe()}) cannot say its "
            "model's options (its plugin has no `model` method); write the model section out"
        )
    return dict(read(url, lookup.storage_options))


def _same_place(a: object, b: str) -> bool:
    return isinstance(a, str) and a.rstrip("/") == b.rstrip("/")
