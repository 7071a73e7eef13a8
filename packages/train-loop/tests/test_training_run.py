"""Callbacks see the run through `RunView`: core-mesh's `TrainingRun`, nothing more of the
Trainer (its optimizers, recorder, loop state), and each read is the Trainer's current value."""

from __future__ import annotations

from types import SimpleNamespace

from llmtrain.core_mesh.conformance import protocol_mismatches
from llmtrain.core_mesh.interfaces import TrainingRun
from llmtrain.train_loop.training_run import RunView

# read by the built-in summary callback to mask credentials; not part of the Protocol
EXTRA = {"secrets"}


def public(cls: type) -> set[str]:
    return {name for name in dir(cls) if not name.startswith("_")}


def test_the_view_is_exactly_the_protocol():
    assert protocol_mismatches(RunView, TrainingRun) == []
    assert public(RunView) - EXTRA == public(TrainingRun)


def test_the_view_reads_the_trainer_now_and_forwards_the_two_changes():
    calls = []
    trainer = SimpleNamespace(
        step=3,
        record_metric=lambda *args, **kwargs: calls.append(("record", args, kwargs)),
        request_stop=lambda reason: calls.append(("stop", reason)),
        optimizers=["not a callback's"],
    )
    view = RunView(trainer)  # type: ignore[arg-type]
    assert view.step == 3
    trainer.step = 4
    assert view.step == 4  # not a copy taken when the view was made
    view.record_metric("probe", 1.0, reduce="max", better="higher")
    view.request_stop("enough")
    assert calls == [
        ("record", ("probe", 1.0), {"reduce": "max", "better": "higher"}),
        ("stop", "enough"),
    ]
    assert not hasattr(view, "optimizers")
