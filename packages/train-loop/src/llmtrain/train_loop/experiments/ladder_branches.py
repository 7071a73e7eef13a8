"""Decay branches of a ladder (`llmtrain sweep --ladder ... --branch-decays F`): the rungs of one
model shape share their stable phase.

Under a warmup-stable-decay (`wsd`) schedule the lr before the decay does not depend on the run's
length, and the data order never does. So the rungs of one shape (with the same other settings:
seed, grid values) need not each train from scratch: the longest of them, the trunk, is trained
whole, and each other rung is a branch that goes on from the trunk's checkpoint at the step where
its own decay starts, `S - round(F x S)` for a rung of S steps (wsd's rule), and decays over the
rest. Up to that step the trunk trained exactly what the rung would have, so the branch's losses
equal those of the rung trained alone (`init.state: all` carries the optimizer, step, data
position and random states across).

The trunk saves at its branches' starts (`checkpoint.steps`, never pruned); every run decays
over the fraction F (`lr_scheduler.decay_fraction`). A rung whose decay starts at step 0 trains
from scratch. Tokens trained: the trunk's S plus F x S of each branch, against the sum of S.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import attrs

from llmtrain.core_mesh.errors import UserError
from llmtrain.core_mesh.plugins import PluginManager
from llmtrain.train_loop.experiments.sweep_plan import run_checkpoint_dir
from llmtrain.train_loop.run_config import RunConfig
from llmtrain.train_loop.schedules import WSDOptions, decay_start

# the keys of a rung's run length: runs that differ only in these share a trunk
LENGTH_KEYS = ("training.steps", "training.tokens")


@attrs.frozen
class Branch:
    """How one run of the sweep trains: `trunk` is the run it branches from (None: the run
    trains from scratch), at step `start`; a trunk saves at `saves`."""

    trunk: str | None = None
    start: int = 0
    saves: tuple[int, ...] = ()

    def overrides(self, checkpoints_of: Mapping[str, str]) -> dict[str, object]:
        """The config keys this run sets besides its settings (`checkpoints_of`: each run's
        checkpoint directory)."""
        if self.trunk is not None:
            return {
                "init": {"from": checkpoints_of[self.trunk], "step": self.start, "state": "all"}
            }
        return {"checkpoint.steps": list(self.saves)} if self.saves else {}


@attrs.frozen
class Branched:
    """The decay branches of a sweep: `decay` (--branch-decays; None: none), each run's
    `Branch` by id, and each run's checkpoint directory."""

    decay: float | None = None
    by_run: dict[str, Branch] = attrs.Factory(dict)
    checkpoints: dict[str, str] = attrs.Factory(dict)

    def branch(self, run_id: str) -> Branch:
        return self.by_run.get(run_id, Branch())

    @property
    def overrides(self) -> dict[str, dict[str, object]]:
        """By run id, the config keys its branch sets (every run decays over `decay`)."""
        if self.decay is None:
            return {}
        return {
            run_id: {"lr_scheduler.decay_fraction": self.decay, **b.overrides(self.checkpoints)}
            for run_id, b in self.by_run.items()
        }

    def record(self) -> dict[str, dict[str, object]]:
        """What the manifest keeps: each branch's trunk and start step."""
        return {
            run_id: {"trunk": b.trunk, "start": b.start}
            for run_id, b in self.by_run.items()
            if b.trunk is not None
        }


def check_decay(fraction: float, base: RunConfig, plugins: PluginManager) -> WSDOptions:
    """--branch-decays F: a fraction in (0, 1) of a `wsd` base's runs; the base's wsd options
    with that decay fraction."""
    if not 0 < fraction < 1:
        raise UserError(
            f"--branch-decays {fraction:g}: give the decay's fraction of each rung's steps, "
            "between 0 and 1 (e.g. 0.2)"
        )
    choice = base.lr_scheduler
    kind = None if choice is None else choice.kind
    options = None if choice is None else plugins.options_of("lr_scheduler", choice)
    if kind != "wsd" or not isinstance(options, WSDOptions):
        raise UserError(
            f"--branch-decays needs the base's lr schedule to be wsd (warmup, stable, decay), "
            f"whose lr before the decay does not depend on the run's length; it is "
            f"{kind or 'constant (no lr_scheduler)'}: set lr_scheduler: {{kind: wsd}} in the "
            "base config"
        )
    if options.decay_steps is not None:
        raise UserError(
            "--branch-decays decays over a fraction of each rung's steps; the base's "
            f"lr_scheduler.decay_steps {options.decay_steps} would fix it in steps: remove it"
        )
    if any(phase.until_fraction is not None for phase in base.data.phases or ()):
        raise UserError(
            "--branch-decays: the base's data.phases end at a fraction of the run "
            "(until_fraction), so a rung's data would depend on its length and a branch could "
            "not share its trunk's; give the phases' ends as until_step"
        )
    return attrs.evolve(options, decay_fraction=fraction)


def branches(
    runs: Sequence[tuple[str, Mapping[str, object]]], options: WSDOptions
) -> dict[str, Branch]:
    """Each run's branch, from (run id, settings) of every run: runs that share all settings
    but their length share the longest one as their trunk."""
    groups: dict[str, list[tuple[str, int]]] = {}
    for run_id, settings in runs:
        shared = {k: v for k, v in settings.items() if k not in LENGTH_KEYS}
        steps = settings.get("training.steps")
        if not isinstance(steps, int):
            raise AssertionError(f"a ladder rung sets training.steps, {run_id} has {steps!r}")
        groups.setdefault(json.dumps(shared, sort_keys=True, default=str), []).append(
            (run_id, steps)
        )
    out: dict[str, Branch] = {}
    for members in groups.values():
        trunk, longest = max(members, key=lambda member: member[1])
        starts = {}
        for run_id, steps in members:
            start = decay_start(options, steps) or 0
            if run_id != trunk and 0 < start:
                starts[run_id] = start
                out[run_id] = Branch(trunk, start)
            elif run_id != trunk:
                out[run_id] = Branch()  # its decay is all of it: nothing to share
        out[trunk] = Branch(saves=tuple(sorted(set(starts.values()))))
        assert all(start <= (decay_start(options, longest) or 0) for start in starts.values())
    return out


def trained_steps(steps: int, branch: Branch) -> int:
    """The steps a run trains itself: all of them, or a branch's after its start."""
    return steps - branch.start


def checkpoints_of(
    run_ids: Sequence[str], sweep_dir: Path, shared_dir: str | None
) -> dict[str, str]:
    """Where each run of the sweep saves: `<sweep>/<run>/checkpoints`, or under the base's
    `checkpoint.dir` as the sweep places it (`run_checkpoint_dir`)."""
    if shared_dir:
        return {r: run_checkpoint_dir(shared_dir, r, sweep_dir) for r in run_ids}
    return {r: str(sweep_dir / r / "checkpoints") for r in run_ids}
