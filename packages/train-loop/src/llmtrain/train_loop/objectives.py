"""The built-in training objective, `cross_entropy` (`training.objective`): summed cross-entropy
with an optional z-loss, the loss every run trained with before objectives were a plugin kind.

An objective is a plugin (kind `objective`); the trainer only counts targets, calls
`prepare`, hands the objective to `forward_backward` and logs `metrics()`. This module imports
no torch (the plugin module registers from it); the loss itself is `loss.CrossEntropySum`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    from llmtrain.core_mesh.interfaces import ObjectiveContext
    from llmtrain.train_loop.loss import CrossEntropySum

__all__ = ["CrossEntropyOptions", "cross_entropy"]


def _non_negative(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if value < 0:
        raise ValueError(f"{attribute.name} must be >= 0, got {value}")


@attrs.frozen(kw_only=True)
class CrossEntropyOptions:
    # PaLM's z-loss weight (0: off)
    z_loss: float = attrs.field(default=0.0, validator=_non_negative)


def cross_entropy(options: CrossEntropyOptions, context: ObjectiveContext) -> CrossEntropySum:
    from llmtrain.core_mesh.interfaces import AuxiliaryLosses
    from llmtrain.train_loop.loss import AuxiliaryTerms, CrossEntropySum

    # model parts with auxiliary losses (MoE) stop adding them through their own backward and
    # the loss adds them. Not under pipeline parallelism: the loss runs on the last stage only,
    # so the stages without the output keep the model's own injection (all of them do, alike)
    parts = [p for p in context.parts if isinstance(p, AuxiliaryLosses)]
    aux = None
    if parts and context.pipeline_stages == 1:
        for part in parts:
            part.inject_aux_loss(False)
        aux = AuxiliaryTerms(parts, context.averaged_ranks)
    # the chunked form of the loss compiles its softmax on CUDA when the run compiles
    return CrossEntropySum(options.z_loss, context.compile, aux)
