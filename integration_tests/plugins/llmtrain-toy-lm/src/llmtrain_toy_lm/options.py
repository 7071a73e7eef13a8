"""The `toy-lm` model's options (the `model:` section): plain attrs, no torch."""

from __future__ import annotations

from typing import ClassVar

import attrs


def _positive(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value < 1:
        raise ValueError(f"must be at least 1, got {value}")


@attrs.frozen(kw_only=True)
class ToyLMOptions:
    # what `llmtrain.core_mesh.interfaces.ModelOptions` asks: nothing here is training-only
    training_only: ClassVar[frozenset[str]] = frozenset()

    vocab_size: int = attrs.field(default=320, validator=_positive)
    max_seq_len: int = attrs.field(default=64, validator=_positive)
    d_model: int = attrs.field(default=32, validator=_positive)
    n_layers: int = attrs.field(default=2, validator=_positive)
    kernel: int = attrs.field(default=4, validator=_positive)  # tokens each mixer sees
    init_std: float = 0.02

    @property
    def doc_masking(self) -> bool:
        """The convolutions see across document starts: the data carries none to the model."""
        return False
