"""The entry point (`toy-lm` in the `llmtrain` group): the model kind `toy-lm`. Loading it
imports no torch; building the model does."""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmtrain.core_mesh.plugins import Register, hookimpl
from llmtrain_toy_lm.options import ToyLMOptions

if TYPE_CHECKING:
    from llmtrain_toy_lm.model import ToyLM


def build(options: ToyLMOptions) -> ToyLM:
    from llmtrain_toy_lm.model import ToyLM

    return ToyLM(options)


@hookimpl
def llmtrain_models(register: Register) -> None:
    register(
        "toy-lm",
        build,
        options=ToyLMOptions,
        help="a test model: causal depthwise convolutions and gated MLPs (no attention)",
    )
