"""`llmtrain fit --compare BASELINE VARIANT --predict ...`: does a variant that wins on a ladder
still win at scale?

Each ladder is fitted on its own (`fit_command.fit_runs`: L = E + A/N^alpha + B/D^beta with
`--bootstrap` refits), the baseline's bootstrap seeded with `--seed` and the variant's with
`--seed` + 1, so the two resamplings are independent. At each `--predict` target:

- `N=..,D=..`: both fits' loss there;
- `C=..`: each fit's loss at its own compute-optimal N, D for C FLOPs (`fit.compute_optimal`,
  with C = k N D and k each ladder's FLOPs per token per parameter, the geometric mean of its
  runs' C / (N D): 6 where C = 6ND), so the question answered is "trained compute-optimally
  with C FLOPs, which is lower";

and the difference variant - baseline with its percentile interval over the bootstrap draws (draw
i of the baseline paired with draw i of the variant; each draw's own frontier for `C=`), and
whether that interval excludes 0. Along the compute-optimal frontier (loss against C, each
fit's own), from the smallest rung's compute to `REACH` times the largest's, where the fitted
curves cross (sign changes of the difference on a log grid, refined by `scipy.optimize.brentq`).

`report --compare` draws the same: both frontiers with their bootstrap bands, the rungs as
points, and the difference along C with its band (`draw`, matplotlib: the `[plot]` extra).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from llmtrain.ablate.fit import CONFIDENCE, compute_optimal
from llmtrain.ablate.fit_command import Fits, Target, _table, fit_runs, listed, tokenizer_of
from llmtrain.ablate.runs import Run, find_runs
from llmtrain.core_mesh.errors import UserError

SIDES = ("baseline", "variant")
REACH = 1e4  # crossings are looked for up to this many times the largest rung's compute
GRID_POINTS = 400  # log-spaced compute values the frontier's crossings are bracketed on
_PERCENTILES = (100 * (1 - CONFIDENCE) / 2, 100 * (1 + CONFIDENCE) / 2)


def _percentiles(values: np.ndarray, axis: int | None = None) -> tuple[Any, Any]:
    """The interval's percentiles of the finite values (a draw whose law has no compute-optimal
    frontier is NaN and left out); NaN where none is finite."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # an all-NaN slice: NaN, as wanted
        low, high = np.nanpercentile(values, _PERCENTILES, axis=axis)
    return low, high


@attrs.frozen
class Predicted:
    """One fit at one target: where (N, D; each fit's own optimum for a compute target), its
    loss, and the loss of every bootstrap refit there (NaN: a refit without a frontier)."""

    n: float
    d: float
    loss: float
    draws: np.ndarray = attrs.field(eq=False, repr=False)

    @property
    def interval(self) -> tuple[float, float]:
        low, high = _percentiles(self.draws) if len(self.draws) else (math.nan, math.nan)
        return float(low), float(high)

    def to_json(self) -> dict[str, object]:
        return {"n": self.n, "d": self.d, "loss": [self.loss, *self.interval]}


@attrs.frozen
class Ladder:
    """One side: its path, its fit, and k (C = k N D) for its frontier."""

    side: str
    path: str
    fits: Fits
    per_param: float
    seed: int

    @property
    def law(self) -> list[float]:
        return list(self.fits.parametric.params.values())

    @property
    def has_frontier(self) -> bool:
        return bool(np.isfinite(compute_optimal(self.law, 1.0, self.per_param).loss))

    def frontier(self, compute: np.ndarray) -> np.ndarray:
        """The fit's loss along its compute-optimal frontier."""
        return np.asarray(compute_optimal(self.law, compute, self.per_param).loss)

    def frontier_draws(self, compute: np.ndarray) -> np.ndarray:
        """Each bootstrap refit's loss along its own frontier: one row per refit."""
        boot = self.fits.parametric.bootstrap
        return np.asarray(compute_optimal(boot, compute, self.per_param).loss)

    def predict(self, target: Target) -> Predicted:
        from llmtrain.ablate import fit

        parametric = self.fits.parametric
        if target.compute is None:
            assert target.n is not None and target.d is not None
            n, d = target.n, target.d
            loss = float(fit.chinchilla_loss(n, d, self.law))
            draws = np.asarray(fit.chinchilla_loss(n, d, parametric.bootstrap.T), dtype=float)
            return Predicted(n, d, loss, draws.reshape(-1))
        if not self.has_frontier:
            raise UserError(
                f"--predict {target.text}: the {self.side}'s fit has alpha "
                f"{parametric.alpha:.3g}, beta {parametric.beta:.3g}: no compute-optimal N and D "
                f"(both must be above 0); predict at N=..,D=.. instead"
            )
        best = compute_optimal(self.law, target.compute, self.per_param)
        return Predicted(
            float(best.n),
            float(best.d),
            float(best.loss),
            self.frontier_draws(np.asarray(target.compute)),
        )

    def to_json(self) -> dict[str, object]:
        return {
            "path": self.path,
            "seed": self.seed,
            "flops_per_token_per_param": self.per_param,
            "runs": [p.to_json() for p in self.fits.points],
            "parametric": self.fits.parametric.to_json(),
        }


@attrs.frozen
class Difference:
    """variant - baseline at one target, with the percentile interval of the paired draws'
    differences (`draws` of them)."""

    target: Target
    baseline: Predicted
    variant: Predicted
    value: float
    low: float
    high: float
    draws: int

    @property
    def excludes_zero(self) -> bool | None:
        """Whether the interval lies wholly above or below 0 (None: no interval)."""
        if not (math.isfinite(self.low) and math.isfinite(self.high)):
            return None
        return self.low > 0 or self.high < 0

    @property
    def lower(self) -> str | None:
        """The side predicted lower (None: equal)."""
        return "variant" if self.value < 0 else "baseline" if self.value > 0 else None

    def to_json(self) -> dict[str, object]:
        return {
            "target": self.target.text,
            "baseline": self.baseline.to_json(),
            "variant": self.variant.to_json(),
            "difference": [self.value, self.low, self.high],
            "excludes_zero": self.excludes_zero,
            "lower": self.lower,
            "draws": self.draws,
        }


def difference(target: Target, baseline: Predicted, variant: Predicted) -> Difference:
    """Draw i of the variant minus draw i of the baseline (as many pairs as the side with fewer
    converged refits has), the interval from their percentiles."""
    pairs = min(len(baseline.draws), len(variant.draws))
    gaps = variant.draws[:pairs] - baseline.draws[:pairs]
    finite = gaps[np.isfinite(gaps)]
    low, high = _percentiles(finite) if len(finite) else (math.nan, math.nan)
    return Difference(
        target,
        baseline,
        variant,
        variant.loss - baseline.loss,
        float(low),
        float(high),
        len(finite),
    )


@attrs.frozen
class Crossing:
    """Where the frontiers meet: the compute, the loss there, and the side lower above it."""

    compute: float
    loss: float
    lower_above: str

    def to_json(self) -> dict[str, object]:
        return attrs.asdict(self)


@attrs.frozen
class Segment:
    """A stretch of compute along the frontiers where the interval of variant - baseline lies
    wholly below 0 (`lower` "variant"), wholly above ("baseline"), or around it (None: the
    ladders cannot tell the two apart there)."""

    low: float
    high: float
    lower: str | None

    def to_json(self) -> dict[str, object]:
        return attrs.asdict(self)


@attrs.frozen
class Frontiers:
    """The two frontiers over compute `low` - `high`: where they cross, which side is lower at
    each end, where the difference's interval excludes 0 (`segments`), or why there is no
    frontier (`note`)."""

    low: float
    high: float
    crossings: list[Crossing]
    lower_at_low: str | None
    lower_at_high: str | None
    segments: list[Segment] = attrs.Factory(list)
    note: str = ""

    def to_json(self) -> dict[str, object]:
        return {
            "range": [self.low, self.high],
            "crossings": [c.to_json() for c in self.crossings],
            "lower_at_low": self.lower_at_low,
            "lower_at_high": self.lower_at_high,
            "segments": [s.to_json() for s in self.segments],
            "note": self.note or None,
        }


def _lower(gap: float) -> str | None:
    return "variant" if gap < 0 else "baseline" if gap > 0 else None


def gap_band(baseline: Ladder, variant: Ladder, compute: np.ndarray) -> tuple[Any, Any]:
    """The interval of variant - baseline along the frontiers at each `compute`: draw i of the
    variant's refits minus draw i of the baseline's, each along its own frontier (NaN where
    no pair of draws has a frontier)."""
    ours, theirs = variant.frontier_draws(compute), baseline.frontier_draws(compute)
    pairs = min(len(ours), len(theirs))
    if not pairs:
        nothing = np.full(np.shape(compute), np.nan)
        return nothing, nothing
    return _percentiles(ours[:pairs] - theirs[:pairs], axis=0)


def _segments(grid: np.ndarray, band: tuple[Any, Any]) -> list[Segment]:
    """Runs of grid points with the same side beyond the interval; a segment ends where the
    next begins."""
    low, high = band
    sides = [
        "variant" if h < 0 else "baseline" if lo > 0 else None
        for lo, h in zip(low, high, strict=True)
    ]
    segments: list[Segment] = []
    start = 0
    for i in range(1, len(grid) + 1):
        if i == len(grid) or sides[i] != sides[start]:
            segments.append(
                Segment(float(grid[start]), float(grid[min(i, len(grid) - 1)]), sides[start])
            )
            start = i
    return segments


def frontiers(baseline: Ladder, variant: Ladder) -> Frontiers:
    """Sign changes of variant - baseline along the frontiers on a log grid of compute, each
    refined to the root in log C."""
    from scipy import optimize

    computes = [p.compute for ladder in (baseline, variant) for p in ladder.fits.points]
    low, high = min(computes), REACH * max(computes)
    without = [ladder for ladder in (baseline, variant) if not ladder.has_frontier]
    if without:
        why = "; ".join(
            f"the {x.side}'s fit has alpha {x.fits.parametric.alpha:.3g}, beta "
            f"{x.fits.parametric.beta:.3g}"
            for x in without
        )
        note = f"no compute-optimal frontier ({why}; both must be above 0)"
        return Frontiers(low, high, [], None, None, note=note)

    def gap(log_c: float | np.ndarray) -> Any:
        compute = np.exp(log_c)
        return variant.frontier(compute) - baseline.frontier(compute)

    log_grid = np.linspace(math.log(low), math.log(high), GRID_POINTS)
    gaps = gap(log_grid)
    crossings = []
    for i in np.flatnonzero(np.sign(gaps[:-1]) * np.sign(gaps[1:]) < 0):
        root = float(optimize.brentq(gap, log_grid[i], log_grid[i + 1], xtol=1e-10))
        compute = math.exp(root)
        above = _lower(float(gaps[i + 1]))
        assert above is not None  # a sign change: nonzero on both sides
        loss = float(baseline.frontier(np.array(compute)))
        crossings.append(Crossing(compute, loss, above))
    grid = np.exp(log_grid)
    return Frontiers(
        low,
        high,
        crossings,
        _lower(float(gaps[0])),
        _lower(float(gaps[-1])),
        _segments(grid, gap_band(baseline, variant, grid)),
    )


@attrs.frozen
class ScaleComparison:
    """Everything `fit --compare` prints, writes and draws."""

    baseline: Ladder
    variant: Ladder
    differences: list[Difference]
    frontiers: Frontiers
    n_boot: int

    @property
    def ladders(self) -> tuple[Ladder, Ladder]:
        return self.baseline, self.variant

    @property
    def loss_key(self) -> str:
        return self.baseline.fits.loss_key

    def to_json(self) -> dict[str, object]:
        return {
            "loss": self.loss_key,
            "params": self.baseline.fits.params,
            "confidence": CONFIDENCE,
            "n_boot": self.n_boot,
            "baseline": self.baseline.to_json(),
            "variant": self.variant.to_json(),
            "predictions": [d.to_json() for d in self.differences],
            "frontier": self.frontiers.to_json(),
            "warnings": warnings_of(self),
        }


# --- refusals: ladders whose losses cannot be compared ---


def data_of(run: Run, loss_key: str) -> str | None:
    """What the run's `loss_key` is measured on, as its config names it: the held-out set's
    path (the unnamed `data.eval` for eval_loss, the named one for eval/<name>/loss), or the
    training datasets' paths and weights for the train loss. None: the config does not say."""
    data = run.config.get("data")
    if not isinstance(data, dict):
        return None
    if loss_key == "loss":
        sources = [s for s in data.get("train") or [] if isinstance(s, dict)]
        if not sources:
            return None
        return "training data " + ", ".join(
            f"{s.get('path')} (weight {s.get('weight', 1)})" for s in sources
        )
    name = None if loss_key == "eval_loss" else loss_key.split("/")[1]
    evals = data.get("eval") or []
    for held_out in evals if isinstance(evals, list) else [evals]:
        if isinstance(held_out, dict) and held_out.get("name") == name:
            return f"held-out set {held_out.get('path')}"
    return None


def _said(runs: Sequence[Run], of: Any) -> set[str]:
    return {said for run in runs if (said := of(run)) is not None}


def check_comparable(
    baseline: Sequence[Run], variant: Sequence[Run], loss_key: str, allow_mixed: bool
) -> None:
    """Refuse ladders whose losses measure different things: other tokenizers (unless
    `allow_mixed`), or the loss measured on other data (as the configs name it)."""
    base, var = _said(baseline, tokenizer_of), _said(variant, tokenizer_of)
    if base and var and base != var and not allow_mixed:
        raise UserError(
            f"the baseline's runs use the tokenizer {', '.join(sorted(base))}, the variant's "
            f"{', '.join(sorted(var))}: their losses per token are not comparable; compare "
            f"ladders of one tokenizer, or pass --allow-mixed-tokenizers"
        )
    base = _said(baseline, lambda run: data_of(run, loss_key))
    var = _said(variant, lambda run: data_of(run, loss_key))
    if base and var and base != var:
        raise UserError(
            f"the baseline's {loss_key} is measured on {'; '.join(sorted(base))}, the "
            f"variant's on {'; '.join(sorted(var))}: their losses are not comparable; compare "
            f"ladders evaluated on the same data (or pick another --loss)"
        )


def check_paths(paths: Sequence[str]) -> None:
    """Exactly two sweeps, and not one twice."""
    if len(paths) != 2:
        raise UserError(
            f"--compare takes two sweeps, BASELINE then VARIANT; got {len(paths)}: "
            f"{listed(list(paths), 4)}"
        )
    first, second = (Path(p).resolve() for p in paths)
    if first == second:
        raise UserError(
            f"--compare {paths[0]} {paths[1]}: the baseline and the variant are the same "
            f"directory; give the variant's sweep second"
        )


def per_param(fits: Fits) -> float:
    """k in C = k N D: the geometric mean of the runs' C / (N D)."""
    ratios = [p.compute / (p.n * p.d) for p in fits.points]
    return float(np.exp(np.mean(np.log(ratios))))


def compare_ladders(
    paths: Sequence[str],
    targets: Sequence[Target],
    *,
    loss_key: str = "eval_loss",
    params: str = "non_embedding",
    bootstrap: int = 200,
    seed: int = 0,
    include_unfinished: bool = False,
    allow_mixed_tokenizers: bool = False,
) -> ScaleComparison:
    """Both ladders read, checked comparable, fitted (the baseline's bootstrap seeded with
    `seed`, the variant's with `seed` + 1) and compared at every target and along the
    frontier."""
    check_paths(paths)
    found = [find_runs([path]) for path in paths]
    overlap = {r.path.resolve() for r in found[0]} & {r.path.resolve() for r in found[1]}
    if overlap:
        names = sorted(p.name for p in overlap)
        raise UserError(
            f"--compare {paths[0]} {paths[1]}: runs in both ladders ({listed(names, 4)}); give "
            f"two ladders that share no run"
        )
    check_comparable(found[0], found[1], loss_key, allow_mixed_tokenizers)
    ladders = []
    for i, (side, path, runs) in enumerate(zip(SIDES, paths, found, strict=True)):
        try:
            fits = fit_runs(
                runs,
                loss_key=loss_key,
                params=params,
                bootstrap=bootstrap,
                seed=seed + i,
                include_unfinished=include_unfinished,
                allow_mixed_tokenizers=allow_mixed_tokenizers,
            )
        except UserError as error:
            raise UserError(f"the {side} {path}: {error}") from None
        ladders.append(Ladder(side, str(path), fits, per_param(fits), seed + i))
    baseline, variant = ladders
    differences = [
        difference(target, baseline.predict(target), variant.predict(target)) for target in targets
    ]
    return ScaleComparison(baseline, variant, differences, frontiers(baseline, variant), bootstrap)


# --- what it prints ---


def _with_interval(value: float, low: float, high: float, signed: bool = False) -> str:
    """`0.5270 (0.1774 - 1.73e+07)`: a loss's digits, huge interval ends in scientific
    notation (`fit_command.figure`)."""
    from llmtrain.ablate.fit_command import figure

    shown = figure(value, signed)
    if not (math.isfinite(low) and math.isfinite(high)):
        return shown
    return f"{shown} ({figure(low, signed)} - {figure(high, signed)})"


def warnings_of(comparison: ScaleComparison) -> list[str]:
    """Why each ladder's fit, and its predictions at the targets, cannot be trusted
    (`fit_command.trust_warnings`), each named by its side."""
    from llmtrain.ablate.fit_command import trust_warnings

    out = []
    for ladder in comparison.ladders:
        at = []
        for diff in comparison.differences:
            predicted = diff.baseline if ladder.side == "baseline" else diff.variant
            at.append((diff.target.text, predicted.n, predicted.d, predicted.loss))
        fits = ladder.fits
        out += [f"{ladder.side}: {w}" for w in trust_warnings(fits.points, fits.parametric, at)]
    return out


def _law(ladder: Ladder) -> str:
    p = ladder.fits.parametric
    return f"L = {p.E:.4g} + {p.A:.4g}/N^{p.alpha:.4g} + {p.B:.4g}/D^{p.beta:.4g}"


def verdict(comparison: ScaleComparison, diff: Difference) -> str:
    """One sentence: the difference at the target, its interval, and what it says."""
    from llmtrain.ablate.fit_command import figure

    where = diff.target.text
    if diff.target.compute is not None:
        where += " (each fit's compute-optimal N, D)"
    key = comparison.loss_key
    if diff.lower is None:
        said = f"the variant's predicted {key} equals the baseline's"
    else:
        said = (
            f"the variant's predicted {key} is {'lower' if diff.lower == 'variant' else 'higher'}"
            f" than the baseline's by {figure(abs(diff.value))}"
        )
    excludes = diff.excludes_zero
    if excludes is None:
        return f"At {where}: {said} (no bootstrap: no interval)."
    interval = (
        f"{CONFIDENCE:.0%} interval of variant - baseline {figure(diff.low, True)} to "
        f"{figure(diff.high, True)} "
        f"over {diff.draws} paired bootstrap draws"
    )
    if excludes:
        winner = "the variant" if diff.lower == "variant" else "the baseline"
        return f"At {where}: {said} ({interval}): the interval excludes 0, {winner} is lower there."
    return (
        f"At {where}: {said} ({interval}): the interval includes 0, the ladders cannot tell them "
        f"apart there."
    )


def frontier_sentence(result: Frontiers) -> str:
    from llmtrain.ablate.fit_command import figure

    span = f"C = {result.low:.3g} - {result.high:.3g}"
    if result.note:
        return f"Along the compute-optimal frontier: {result.note}."
    head = f"Along the compute-optimal frontier (each fit's own N_opt, D_opt at C), {span}: "
    if result.crossings:
        parts = []
        for crossing in result.crossings:
            below = "baseline" if crossing.lower_above == "variant" else "variant"
            parts.append(
                f"the curves cross at C = {crossing.compute:.3g} (loss {figure(crossing.loss)}); the "
                f"{below} is lower below it, the {crossing.lower_above} above it"
            )
        head += "; ".join(parts)
    elif result.lower_at_low is None:
        head += "the curves do not cross; they are equal throughout"
    else:
        head += f"the curves do not cross; the {result.lower_at_low} is lower throughout"
    return f"{head}. {segments_sentence(result.segments)}".rstrip()


def segments_sentence(segments: Sequence[Segment]) -> str:
    """Where along the frontiers the difference's interval excludes 0, and which side is lower
    there."""
    if not segments:
        return ""

    def said(segment: Segment) -> str:
        if segment.lower is None:
            return "includes 0"
        return f"excludes 0 with the {segment.lower} lower"

    head = f"The {CONFIDENCE:.0%} interval of the difference"
    if len(segments) == 1:
        return f"{head} {said(segments[0])} over the whole range."
    parts = [f"{said(s)} for C = {s.low:.3g} - {s.high:.3g}" for s in segments]
    return f"{head} {', '.join(parts[:-1])} and {parts[-1]}."


def render(comparison: ScaleComparison) -> list[str]:
    fits = comparison.baseline.fits
    lines = [
        f"variant against baseline across scale: final {fits.loss_key}, N = {fits.params} "
        f"params, {CONFIDENCE:.0%} intervals from {comparison.n_boot} bootstrap refits of each "
        f"ladder"
    ]
    header = ["ladder", "path", "runs", "fit", "C"]
    body = [
        [
            ladder.side,
            ladder.path,
            str(len(ladder.fits.points)),
            _law(ladder),
            f"{ladder.per_param:.3g} N D",
        ]
        for ladder in comparison.ladders
    ]
    lines += _table(header, body)
    if comparison.differences:
        header = [
            "at",
            f"baseline ({CONFIDENCE:.0%})",
            f"variant ({CONFIDENCE:.0%})",
            f"variant - baseline ({CONFIDENCE:.0%})",
            "excludes 0",
        ]
        body = []
        for diff in comparison.differences:
            excludes = diff.excludes_zero
            body.append(
                [
                    diff.target.text,
                    _with_interval(diff.baseline.loss, *diff.baseline.interval),
                    _with_interval(diff.variant.loss, *diff.variant.interval),
                    _with_interval(diff.value, diff.low, diff.high, signed=True),
                    "-" if excludes is None else "yes" if excludes else "no",
                ]
            )
        lines += ["", *_table(header, body)]
        for diff in comparison.differences:
            if diff.target.compute is not None:
                lines.append(
                    f"at {diff.target.text}: baseline N_opt {diff.baseline.n:.3g}, D_opt "
                    f"{diff.baseline.d:.3g}; variant N_opt {diff.variant.n:.3g}, D_opt "
                    f"{diff.variant.d:.3g}"
                )
        lines += ["", *(verdict(comparison, diff) for diff in comparison.differences)]
    lines += ["", frontier_sentence(comparison.frontiers)]
    warnings = warnings_of(comparison)
    if warnings:  # last, where a terminal leaves the eye
        lines += ["", *(f"warning: {warning}" for warning in warnings)]
    return lines


# --- the figure ---


def draw(comparison: ScaleComparison, output: Path) -> None:
    """Two panels against compute C (log): each fit's loss along its compute-optimal frontier
    with its bootstrap band and its rungs as points (a rung lies on or above its ladder's
    frontier), the crossings and `C=` targets marked; and variant - baseline along C with the
    band of the paired draws' differences."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise UserError(
            "drawing --compare needs matplotlib: pip install 'llmtrain-ablate[plot]'"
        ) from None
    result = comparison.frontiers
    targets = [d.target.compute for d in comparison.differences if d.target.compute is not None]
    low, high = result.low, max([result.high, *targets])
    grid = np.geomspace(low, high, 200)
    figure = Figure(figsize=(12, 4.5), layout="constrained")
    losses, gaps = figure.subplots(1, 2)
    colours = {"baseline": "C0", "variant": "C1"}
    draws = {}
    for ladder in comparison.ladders:
        colour = colours[ladder.side]
        points = ladder.fits.points
        losses.scatter(
            [p.compute for p in points], [p.loss for p in points], color=colour, s=16, alpha=0.7
        )
        if not result.note:
            draws[ladder.side] = ladder.frontier_draws(grid)
            losses.plot(
                grid,
                ladder.frontier(grid),
                color=colour,
                lw=1.5,
                label=f"{ladder.side}: {Path(ladder.path).name}",
            )
            if len(draws[ladder.side]):
                band_low, band_high = _percentiles(draws[ladder.side], axis=0)
                losses.fill_between(grid, band_low, band_high, color=colour, alpha=0.2, lw=0)
    for diff in comparison.differences:
        if diff.target.compute is None:
            continue
        for side, predicted in (("baseline", diff.baseline), ("variant", diff.variant)):
            low_end, high_end = predicted.interval
            yerr = None
            if math.isfinite(low_end) and math.isfinite(high_end):
                yerr = [[max(predicted.loss - low_end, 0.0)], [max(high_end - predicted.loss, 0.0)]]
            losses.errorbar(
                [diff.target.compute],
                [predicted.loss],
                yerr=yerr,
                fmt="*",
                color=colours[side],
                ms=10,
                capsize=3,
            )
    for crossing in result.crossings:
        for ax in (losses, gaps):
            ax.axvline(crossing.compute, color="k", ls=":", lw=1)
    losses.set(
        xscale="log",
        xlabel="compute C (FLOPs)",
        ylabel=comparison.loss_key,
        title="loss along each fit's compute-optimal frontier",
    )
    if losses.get_legend_handles_labels()[0]:
        losses.legend(fontsize="small")
    gaps.axhline(0.0, color="k", lw=0.8)
    if not result.note:
        gap = comparison.variant.frontier(grid) - comparison.baseline.frontier(grid)
        gaps.plot(grid, gap, color="C2", lw=1.5, label="variant - baseline")
        band_low, band_high = gap_band(comparison.baseline, comparison.variant, grid)
        if np.isfinite(band_low).any():
            gaps.fill_between(
                grid,
                band_low,
                band_high,
                color="C2",
                alpha=0.2,
                lw=0,
                label=f"{CONFIDENCE:.0%} bootstrap band",
            )
        gaps.legend(fontsize="small")
    gaps.set(
        xscale="log",
        xlabel="compute C (FLOPs)",
        ylabel=f"variant - baseline {comparison.loss_key}",
        title="the difference along the frontier (below 0: the variant is lower)",
    )
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output)


# --- the report's section ---


def report_context(
    paths: Sequence[str], loss_key: str, predict: Sequence[str]
) -> tuple[dict[str, object], list[dict[str, object]]]:
    """`report --compare`'s section (the comparison as `fit --compare` prints it, each ladder's
    fit with its intervals, the figure; or why there is none: `error`) and its verdict
    sentences, one per target and one for the frontier. `paths` were checked (`check_paths`)."""
    from llmtrain.ablate.fit_command import parse_target, render_parametric
    from llmtrain.ablate.html_report import png_data_url

    targets = [parse_target(text) for text in predict]
    try:
        comparison = compare_ladders(paths, targets, loss_key=loss_key)
    except UserError as error:
        return {"error": str(error)}, []
    text = render(comparison)
    for ladder in comparison.ladders:
        fits = ladder.fits
        text += ["", f"{ladder.side} {ladder.path}:"]
        text += render_parametric(fits.parametric, fits.loss_key, fits.params)
    sentences = [(verdict(comparison, d), bool(d.excludes_zero)) for d in comparison.differences]
    sentences.append((frontier_sentence(comparison.frontiers), False))
    verdicts: list[dict[str, object]] = [
        {"sentence": sentence, "warning": "", "significant": beyond, "weak": False}
        for sentence, beyond in sentences
    ]
    verdicts += [  # why a fit cannot be trusted, beside the sentences that rest on it
        {"sentence": "", "warning": f"Warning: {w}", "significant": False, "weak": True}
        for w in warnings_of(comparison)
    ]
    section: dict[str, object] = {
        "error": "",
        "text": "\n".join(text),
        "url": png_data_url(lambda path: draw(comparison, path)),
        "note": (
            f"Each ladder fitted on its own (L = E + A/N^alpha + B/D^beta). Left: each fit's "
            f"{loss_key} along its own compute-optimal frontier with the {CONFIDENCE:.0%} band "
            f"of its bootstrap refits, its rungs as points (a rung lies on or above its "
            f"frontier). Right: variant - baseline along the frontiers with the band of the "
            f"paired refits' differences. Dotted: where the fits cross."
        ),
    }
    return section, verdicts
