"""A trained model as checkpoints keep it: the model info a run stores beside its weights (the
`model:` section as plain data, enough to rebuild the model), and the whole model loaded back
from a committed checkpoint on one process, with the tokenizer it was trained with.

Used by `llmtrain generate` / `eval`, the quickstart and plugins (llmtrain-hf's export). Loading
this module imports no torch; `load_model` does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from llmtrain.core_mesh.config import Choice, structure, unstructure
from llmtrain.core_mesh.errors import UserError
from llmtrain.core_mesh.interfaces import LanguageModel, Tokenizer
from llmtrain.core_mesh.plugins import MODEL, TOKENIZER, PluginManager


def model_info(plugins: PluginManager, choice: Choice) -> dict[str, object]:
    """The model section as plain data (stored in checkpoints to rebuild the model)."""
    options = plugins.options_of("model", choice)
    return {"kind": choice.kind, **(unstructure(options) if options is not None else {})}


def model_choice(
    info: Mapping[str, object], plugins: PluginManager, *, source: str | None = None
) -> Choice:
    """The model choice of a model info dict (`{"kind": ..., **options}`), structured strictly;
    `source` names where the info came from in errors."""
    return structure(dict(info), Choice.of("model"), plugins=plugins, source=source)


def load_model(
    checkpoint: str, step: int | None, plugins: PluginManager, *, weights: str = "model"
) -> tuple[Any, dict[str, Any], int]:
    """The whole model (one process, CPU, float32, eval mode) with the weights of a committed
    checkpoint (the newest, or `step`); returns (model, the checkpoint's info, step). The model
    keeps `LanguageModel`'s contract (refused with a message when it does not), and its state
    dict is exactly the checkpoint's weights (`weights="ema"`: with the moving average of the
    run's `ema` callback in place of the trainable ones)."""
    import torch

    from llmtrain.checkpoint.export import load_model_weights

    tensors, record, step = load_model_weights(checkpoint, step=step, weights=weights)
    info = record.get("info", {})
    if "model" not in info:
        raise UserError(f"{checkpoint}: the checkpoint does not say which model it holds")
    choice = model_choice(info["model"], plugins, source=f"{checkpoint} (model)")
    model = plugins.build(MODEL, choice)
    check_language_model(model, choice.kind, checkpoint)
    # buffers that are not weights are not persistent, so nothing may be missing
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    if missing or unexpected:
        raise UserError(
            f"{checkpoint} step {step} does not fit its model: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    model.to(torch.float32).eval()
    return model, info, step


def check_language_model(model: object, kind: str, source: str) -> None:
    """Refuses a model that lacks what generate and eval need of it (`LanguageModel`)."""
    if not isinstance(model, LanguageModel):
        raise UserError(
            f"{source}: model kind {kind!r} builds a {type(model).__name__}, which lacks what "
            "generate and eval need of a model (`options`, `packed_rows`, `new_cache`: see "
            "llmtrain.core_mesh.interfaces.LanguageModel)"
        )


def tokenizer_of(info: Mapping[str, Any], given: str | None, plugins: PluginManager) -> Tokenizer:
    """The tokenizer `given` on the command line (`tokenizer_choice`'s spellings), else the one
    the checkpoint's training data was packed with."""
    from llmtrain.data_pack.tokenizer import tokenizer_choice, tokenizer_from_raw

    tokenizer: Tokenizer
    if given:
        tokenizer = plugins.build(TOKENIZER, tokenizer_choice(given, plugins))
        return tokenizer
    spec = info.get("data", {}).get("tokenizer", {}).get("spec")
    if spec is None:
        raise UserError("the checkpoint does not record its tokenizer; pass --tokenizer")
    tokenizer = tokenizer_from_raw(spec, plugins)
    return tokenizer
