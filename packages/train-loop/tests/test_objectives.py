"""The `objective` seam: the built-in `cross_entropy` objective is the loss runs trained with
before (the same numbers), chosen by `training.objective`, with `training.z_loss` as its
deprecated spelling; held-out eval stays plain cross-entropy."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from llmtrain.core_mesh.interfaces import ObjectiveContext
from llmtrain.train_loop.loss import IGNORE, cross_entropy_sum


def test_cross_entropy_objective_is_the_summed_loss_and_passes_targets_through(installed):
    built = installed.build(
        "objective", "cross_entropy", ObjectiveContext(parts=[], device=torch.device("cpu"))
    )
    logits = torch.randn(2, 5, 7, generator=torch.Generator().manual_seed(0))
    targets = torch.randint(0, 7, (2, 5), generator=torch.Generator().manual_seed(1))
    targets[0, :2] = IGNORE
    assert torch.equal(built(logits, targets), cross_entropy_sum()(logits, targets))
    assert built.prepare(torch.zeros(2, 5), targets, torch.tensor(8.0)) is targets


def losses(
    run_cli: Any, write: Callable[..., Path], name: str, training: dict[str, Any]
) -> tuple[list[Any], str]:
    """(loss, grad_norm) of each step of a 4-step run `name` (`tiny_run_config`), and stderr."""
    config = write(name=name, training=training)
    code, _, err = run_cli("run", config)
    assert code == 0, err
    lines = (config.parent / "runs" / name / "metrics.jsonl").read_text().splitlines()
    return [(m["loss"], m["grad_norm"]) for m in map(json.loads, lines) if "loss" in m], err


def test_deprecated_z_loss_trains_as_the_objective_option(run_cli, tiny_run_config):
    plain, _ = losses(run_cli, tiny_run_config, "a", {})
    objective = {"objective": {"kind": "cross_entropy", "z_loss": 0.01}}
    new, quiet = losses(run_cli, tiny_run_config, "b", objective)
    old, said = losses(run_cli, tiny_run_config, "c", {"z_loss": 0.01})
    assert "training.z_loss is deprecated" in said
    assert "training.z_loss is deprecated" not in quiet
    assert len(new) == 4
    assert new == old  # bit for bit
    assert new != plain  # the z-loss changes the numbers: the option reached the loss
