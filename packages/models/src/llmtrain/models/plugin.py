"""models' plugin (entry point `models`): every preset as a model kind whose options default to it.

Loading this module imports no torch; the builder does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmtrain.core_mesh.plugins import Register, hookimpl
from llmtrain.models.config import TransformerConfig
from llmtrain.models.presets import PRESETS

if TYPE_CHECKING:  # loading the plugin imports no torch
    from llmtrain.models.transformer import Transformer


def build(options: TransformerConfig) -> Transformer:
    from llmtrain.models.transformer import build_model

    return build_model(options)


def _summary(name: str) -> str:
    values = PRESETS[name]
    if not values:
        return "decoder-only transformer, every option explicit (GPT-2 124M defaults)"
    shape = f"d_model={values.get('d_model')}, n_layers={values.get('n_layers')}, n_heads={values.get('n_heads')}"
    return f"{name} preset ({shape}); any option can be overridden"


@hookimpl
def llmtrain_models(register: Register) -> None:
    for name in PRESETS:
        register(
            name, build, options=TransformerConfig, defaults=PRESETS[name], help=_summary(name)
        )
