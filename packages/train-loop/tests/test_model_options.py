"""A model plugin's options must offer what training reads of them (`ModelOptions`)."""

from __future__ import annotations

import attrs
import pytest

from llmtrain.core_mesh.config import Choice
from llmtrain.core_mesh.errors import UserError
from llmtrain.core_mesh.plugins import hookimpl
from llmtrain.train_loop.run_config import checked_model_options


@attrs.frozen(kw_only=True)
class BareOptions:
    n_layers: int = 2
    vocab_size: int = 320


class BarePlugin:
    @hookimpl
    def llmtrain_models(self, register):
        register("bare", "builder", options=BareOptions)


def test_options_without_what_training_reads_are_named(installed):
    installed.register(BarePlugin(), "bare-plugin")
    with pytest.raises(UserError) as info:
        checked_model_options(installed, Choice.of("model")(kind="bare"))
    assert str(info.value) == (
        "model: kind 'bare' of plugin 'bare-plugin' (registered in process) has options "
        "(BareOptions) without doc_masking, max_seq_len, training_only; a model plugin's "
        "options class must provide them (llmtrain.core_mesh.interfaces.ModelOptions)"
    )


def test_the_built_in_model_s_options_pass(installed):
    options = checked_model_options(installed, Choice.of("model")(kind="tiny", options=None))
    assert (options.vocab_size, options.doc_masking) == (320, False)
