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


def no_doc_starts(options):
    """The tiny transformer behind a forward that takes no document starts, as a model plugin
    that cannot mask documents has."""
    from llmtrain.models.transformer import Transformer

    class NoDocStarts(Transformer):
        def forward(self, tokens):  # type: ignore[override]
            return super().forward(tokens)

    return NoDocStarts(options)


class NoDocStartsPlugin:
    @hookimpl
    def llmtrain_models(self, register):
        from llmtrain.models.config import TransformerConfig

        register(
            "nodoc",
            no_doc_starts,
            options=TransformerConfig,
            defaults={"d_model": 16, "n_layers": 1, "n_heads": 2, "max_seq_len": 32},
        )


def test_doc_masking_on_a_model_that_cannot_is_refused_before_the_run(
    installed, tiny_run_config, tmp_path, capsys
):
    """It used to fail at the first step as 'a bug in llmtrain or a plugin' (issue 51)."""
    from llmtrain.core_mesh.cli import main

    installed.register(NoDocStartsPlugin(), "nodoc-plugin")
    config = tiny_run_config(model={"kind": "nodoc", "doc_masking": True})
    assert main(["run", str(config)], plugins=installed) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == (
        "error: model.doc_masking: true, but model kind 'nodoc' of plugin 'nodoc-plugin' "
        "(registered in process) cannot mask documents (its forward takes no doc_starts); set "
        "model.doc_masking: false"
    ), err
    assert not (tmp_path / "runs" / "r" / "checkpoints").exists()
