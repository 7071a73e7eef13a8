"""protocol_mismatches: members and call signatures of a class against an interfaces Protocol."""

from __future__ import annotations

from typing import ClassVar

import attrs

from llmtrain.core_mesh.conformance import protocol_mismatches
from llmtrain.core_mesh.interfaces import ModelOptions, ParallelModel, ParallelStrategy


@attrs.frozen(kw_only=True)
class Options:
    training_only: ClassVar[frozenset[str]] = frozenset({"dropout"})

    vocab_size: int = 256
    max_seq_len: int = 64
    doc_masking: bool = False
    dropout: float = 0.0


class Strategy:
    def check(self, mesh, world_size, model, **run):
        return mesh

    def parallelize(self, model, device_mesh, device, *, microbatches=1, compile=False):
        return None


def test_a_conforming_class_has_no_mismatches():
    assert protocol_mismatches(Options, ModelOptions) == []
    assert isinstance(Options(), ModelOptions)
    assert protocol_mismatches(Strategy, ParallelStrategy) == []


def test_missing_members_and_attributes_that_are_methods():
    @attrs.frozen
    class Partial:
        vocab_size: int = 256

        def max_seq_len(self) -> int:
            return 64

    assert protocol_mismatches(Partial, ModelOptions) == [
        "doc_masking: missing",
        "max_seq_len: a method, where the Protocol reads an attribute",
        "training_only: missing",
    ]


def test_signatures_must_take_every_call_the_protocol_allows():
    class Narrow:
        def check(self, mesh, world_size, model, *, seq_len, device_type):
            return mesh

        def parallelize(self, model, device_mesh, *, microbatches, extra):
            return None

    assert protocol_mismatches(Narrow, ParallelStrategy) == [
        "check: takes no keyword 'microbatches'",
        "parallelize: takes no positional argument 3 ('device')",
        "parallelize: needs 'extra', which the Protocol does not pass",
    ]


def test_defaults_and_named_arguments():
    class Model:
        parts: ClassVar[list] = []

        def train(self, mode):  # the Protocol's `train()` leaves mode out
            pass

        def forward_backward(self, tokens, targets, loss_fn, *, scale=1.0, doc_starts=None):
            pass

        def size(self, *args):  # *args takes the positional dim
            return 1

    problems = protocol_mismatches(Model, ParallelModel)
    assert "train: 'mode' needs a default (the Protocol's may be left out)" in problems
    assert not any(p.startswith(("forward_backward", "size", "parts")) for p in problems)
    assert "evaluate: missing" in problems
