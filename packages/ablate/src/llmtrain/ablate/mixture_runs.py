"""A data-mixture sweep read back as points for `mixture_fit`: each finished run's mixture
(`data.train`'s weights in config.yaml, in order, normalised to sum 1; a weight of 0 is a
source left out) and its target, a weighted sum of metrics' final logged values (what compare
calls `final_<metric>`). `llmtrain fit --mixture` (fit_command.py) and the report's mixture
section (mixture_report.py) read runs through it.

`--target 'eval/web/loss=0.5,eval/code/loss=0.5'` names the target (a metric alone has weight
1); without one, the mean of the runs' `eval/<name>/loss` metrics (one per named held-out set)
where they log any, else `eval_loss`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import PurePosixPath

import attrs
import numpy as np

from llmtrain.ablate.fit_command import final_value, listed
from llmtrain.ablate.mixture_fit import MixtureData, MixtureFit, fit_mixture, min_runs
from llmtrain.ablate.runs import Run, eval_set_losses, higher_is_better, is_number, shown
from llmtrain.core_mesh.errors import UserError

EVAL_LOSS = "eval_loss"


# --- the target ---


@attrs.frozen
class MixtureTarget:
    """A weighted sum of logged metrics: (metric, weight) terms, in the order given."""

    terms: tuple[tuple[str, float], ...]

    @property
    def metrics(self) -> list[str]:
        return [metric for metric, _ in self.terms]

    @property
    def weights(self) -> list[float]:
        return [weight for _, weight in self.terms]

    @property
    def text(self) -> str:
        """How the output names it: `eval_loss`, `0.5 eval/web/loss + 0.5 eval/code/loss`."""
        if len(self.terms) == 1 and self.terms[0][1] == 1:
            return self.terms[0][0]
        return " + ".join(f"{weight:g} {metric}" for metric, weight in self.terms)

    @property
    def spec(self) -> str:
        """As `--target` takes it."""
        return ",".join(f"{metric}={weight:g}" for metric, weight in self.terms)


def parse_target(text: str) -> MixtureTarget:
    """'eval/web/loss=0.5,eval/code/loss=0.5' or 'eval_loss' (weight 1)."""
    terms: dict[str, float] = {}
    example = "e.g. --target 'eval/web/loss=0.5,eval/code/loss=0.5' or --target eval_loss"
    for part in text.split(","):
        metric, sep, given = (piece.strip() for piece in part.partition("="))
        try:
            weight = float(given) if sep else 1.0
        except ValueError:
            weight = math.nan
        if not metric:
            raise UserError(f"--target {text}: a term without a metric name; {example}")
        if not (math.isfinite(weight) and weight > 0):
            raise UserError(
                f"--target {text}: {metric}'s weight {given or '(none)'} is not a positive "
                f"number; {example}"
            )
        if metric in terms:
            raise UserError(f"--target {text}: {metric} is named twice; {example}")
        terms[metric] = weight
    return MixtureTarget(tuple(terms.items()))


def held_out_losses(runs: Sequence[Run]) -> list[str]:
    """`eval_loss` where a run logged it, then each named held-out set's `eval/<name>/loss`."""
    unnamed = any(is_number(line.get(EVAL_LOSS)) for run in runs for line in run.metrics)
    return [EVAL_LOSS] * unnamed + eval_set_losses(runs)


def default_target(runs: Sequence[Run]) -> tuple[MixtureTarget, str]:
    """(the target, a sentence saying how it was chosen) when none is given: the mean of the
    named held-out sets' losses, else eval_loss."""
    named = eval_set_losses(runs)
    if len(named) > 1:
        share = 1 / len(named)
        target = MixtureTarget(tuple((metric, share) for metric in named))
        return target, f"the mean of the {len(named)} held-out sets' losses"
    if named:
        return MixtureTarget(((named[0], 1.0),)), "the loss of the runs' one named held-out set"
    if held_out_losses(runs):
        return MixtureTarget(((EVAL_LOSS, 1.0),)), "the runs' held-out loss"
    raise UserError(
        "the runs log neither eval_loss nor eval/<name>/loss; name the target with --target "
        "(e.g. --target loss)"
    )


# --- the mixtures ---


@attrs.frozen
class Source:
    """One dataset of `data.train`: its path and what the output calls it."""

    path: str
    name: str


def data_train(run: Run) -> tuple[list[str], list[float], list[str | None]] | None:
    """(paths, weights, names) of the run's `data.train` datasets, None where it has no such
    list (or no positive weight)."""
    data = run.config.get("data")
    train = data.get("train") if isinstance(data, dict) else None
    if not isinstance(train, list) or not train:
        return None
    if not all(isinstance(d, dict) and isinstance(d.get("path"), str) for d in train):
        return None
    weights = [d.get("weight", 1.0) for d in train]
    if not all(is_number(w) and w >= 0 for w in weights) or sum(weights) <= 0:
        return None
    names = [d.get("name") if isinstance(d.get("name"), str) else None for d in train]
    return [d["path"] for d in train], [float(w) for w in weights], names


def sources_of(paths: Sequence[str], names: Sequence[str | None]) -> list[Source]:
    """Each dataset's `name`, else its path's stem (`web.zarr` -> `web`); the path itself where
    two would be called alike."""
    called = [
        name or PurePosixPath(path.rstrip("/")).stem or path
        for path, name in zip(paths, names, strict=True)
    ]
    return [
        Source(path, name if called.count(name) == 1 else path)
        for path, name in zip(paths, called, strict=True)
    ]


def has_schedule(run: Run) -> bool:
    data = run.config.get("data")
    return isinstance(data, dict) and bool(data.get("phases"))


def is_mixture_sweep(runs: Sequence[Run]) -> bool:
    """Whether the runs train on the same datasets in different proportions (no schedules)."""
    read = [data_train(run) for run in runs]
    if len(runs) < 2 or any(r is None for r in read) or any(has_schedule(r) for r in runs):
        return False
    mixtures = [r for r in read if r is not None]  # every run's
    if len({tuple(paths) for paths, _, _ in mixtures}) > 1:
        return False
    shares = {tuple(round(w / sum(weights), 9) for w in weights) for _, weights, _ in mixtures}
    return len(shares) > 1


@attrs.frozen
class MixtureRuns:
    """The runs as a fit's points: `data` in the order of `names`."""

    sources: list[Source]
    names: list[str]
    target: MixtureTarget
    data: MixtureData
    left_out: list[str]  # the runs that did not finish (name and status)


def read_mixtures(runs: Sequence[Run], target: MixtureTarget) -> MixtureRuns:
    """Every finished run's mixture and target; every problem refused in one line."""
    scheduled = [run.name for run in runs if has_schedule(run)]
    if scheduled:
        raise UserError(
            f"runs with a mixture schedule (data.phases): {listed(scheduled)}; fit --mixture "
            f"needs one mixture per run"
        )
    read = [(run, data_train(run)) for run in runs]
    missing = [run.name for run, found in read if found is None]
    if missing:
        raise UserError(
            f"runs without a data.train list of datasets with paths and weights: "
            f"{listed(missing)}; fit --mixture reads each run's mixture from it"
        )
    mixtures = [(run, found) for run, found in read if found is not None]  # every run
    by_paths: dict[tuple[str, ...], list[str]] = {}
    for run, (paths, _, _) in mixtures:
        by_paths.setdefault(tuple(paths), []).append(run.name)
    if len(by_paths) > 1:
        groups = "; ".join(
            f"{listed(names, 3)}: {', '.join(paths)}" for paths, names in by_paths.items()
        )
        raise UserError(
            f"the runs train on different data.train lists ({groups}); fit --mixture needs "
            f"the same datasets in every run, in the same order, only their weights differing"
        )
    left_out = [f"{run.name} ({run.status})" for run in runs if not run.finished]
    finished = [(run, found) for run, found in mixtures if run.finished]
    paths, _, names = mixtures[0][1]
    sources = sources_of(paths, names)
    needed = min_runs(len(sources))
    if len(finished) < needed:
        raise UserError(
            f"{len(finished)} finished runs are fewer than the {needed} a mixture fit of "
            f"{len(sources)} sources needs (sources + 2 and at least 4, so that each "
            f"cross-validation fold keeps enough runs to fit the mixing law's sources + 1 "
            f"parameters); add runs"
        )
    weights = np.array([found[1] for _, found in finished], dtype=np.float64)
    weights /= weights.sum(axis=1, keepdims=True)
    if np.all(np.ptp(weights, axis=0) == 0):
        mixture = ", ".join(
            f"{s.name} {shown(float(w))}" for s, w in zip(sources, weights[0], strict=True)
        )
        raise UserError(
            f"the {len(finished)} finished runs all train on the same mixture ({mixture}): "
            f"nothing to regress on; a mixture sweep varies the weights "
            f"(llmtrain sweep BASE --mixtures N)"
        )
    kept = [run for run, _ in finished]
    metrics, higher = _metrics(kept, target), _higher(kept, target)
    data = MixtureData(weights, metrics, np.array(target.weights), higher)
    return MixtureRuns(sources, [run.name for run in kept], target, data, left_out)


def _metrics(runs: Sequence[Run], target: MixtureTarget) -> np.ndarray:
    """(runs, metrics): each run's final value of each metric of the target."""
    values = [[final_value(run, metric) for metric in target.metrics] for run in runs]
    without = {
        metric: [run.name for run, row in zip(runs, values, strict=True) if row[i] is None]
        for i, metric in enumerate(target.metrics)
    }
    missing = [f"{metric}: {listed(names, 4)}" for metric, names in without.items() if names]
    if missing:
        logged = ", ".join(held_out_losses(runs)) or "none"
        raise UserError(
            f"runs that logged no {'; '.join(missing)}; pick --target from what they log "
            f"(held-out losses: {logged})"
        )
    found = np.array(values, dtype=np.float64)  # every value there
    bad = [run.name for run, row in zip(runs, found, strict=True) if not np.isfinite(row).all()]
    if bad:
        raise UserError(
            f"runs whose final {' or '.join(target.metrics)} is NaN or inf (diverged?): "
            f"{listed(bad)}; leave them out"
        )
    return found


def _higher(runs: Sequence[Run], target: MixtureTarget) -> bool:
    """Whether a higher target is better: every metric of it must go the same way."""
    ways = {metric: higher_is_better(metric, runs) for metric in target.metrics}
    if len(set(ways.values())) > 1:
        up = [m for m, higher in ways.items() if higher]
        down = [m for m, higher in ways.items() if not higher]
        raise UserError(
            f"--target {target.spec} adds metrics that improve upwards ({', '.join(up)}) to "
            f"ones that improve downwards ({', '.join(down)}); their sum has no best"
        )
    return next(iter(ways.values()))


# --- the fit ---


@attrs.frozen
class MixtureStudy:
    """A mixture sweep's runs and the fit over them."""

    runs: MixtureRuns
    fit: MixtureFit


def study(
    runs: Sequence[Run], target: MixtureTarget | None = None, seed: int = 0
) -> tuple[MixtureStudy, str]:
    """(the runs read and fitted, how the target was chosen: "" where it was given)."""
    how = ""
    if target is None:
        target, how = default_target(runs)
    points = read_mixtures(runs, target)
    return MixtureStudy(points, fit_mixture(points.data, seed)), how
