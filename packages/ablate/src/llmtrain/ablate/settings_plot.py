"""A result against a setting: `llmtrain plot SWEEP --x optimizer.lr --group model.d_model`.

Each finished run is one point: the x value is a setting read from its config (as `compare`
reads settings), the y value the final value of a logged metric (`final_eval_loss` by
default, `compare`'s column). Runs that share every other setting but their seed are one point,
the seeds' mean (each seed drawn faint behind it). With `--group KEY` there is one curve per
value of KEY; each remaining combination of varied settings is a panel of its own (a sweep
crossing `model.parametrization` gets a `standard` and a `mup` panel). Settings stepped
together with the x or group key (a `--zip` of `model.d_model` and `model.n_heads`) name the
curve rather than split it. The best x of each curve (the lowest loss, the highest accuracy)
is marked: the learning-rate transfer figure of µP (Tensor Programs V, fig. 1) is this plot
of a sweep over `optimizer.lr` x `model.d_model` x `model.parametrization`.

A run that did not finish (a diverged one stops with a non-finite loss) has no final value:
it is marked at the top of its panel and never the best.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import attrs

from llmtrain.ablate.compare import metric_results
from llmtrain.ablate.runs import (
    SEED_KEYS,
    Run,
    group_by_settings,
    higher_is_better,
    is_number,
    label,
    short_keys,
    shown,
    varied_keys,
)
from llmtrain.core_mesh.errors import UserError

LOG_SPAN = 10.0  # x values all positive and spanning this factor or more: a logarithmic axis


@attrs.frozen
class Point:
    x: float
    value: float | None  # the seeds' mean of the final metric; None: no run of it finished
    values: tuple[float, ...]  # each finished seed's value
    runs: int  # runs at this point (finished or not)


@attrs.frozen
class Curve:
    settings: dict[str, object]  # the group key and the keys stepped with it (empty: no group)
    metric: str
    points: tuple[Point, ...]  # by x
    higher_is_better: bool = False  # as the curve's runs recorded it

    @property
    def best(self) -> Point | None:
        """The point with the best finite value (the lowest loss, the highest accuracy; ties:
        the smaller x); None when no point has one."""
        finite = [p for p in self.points if p.value is not None and math.isfinite(p.value)]
        if not finite:
            return None
        sign = -1.0 if self.higher_is_better else 1.0
        return min(finite, key=lambda p: sign * (p.value or 0.0))


@attrs.frozen
class Panel:
    settings: dict[str, object]  # the other varied keys' values (empty: one panel)
    metric: str
    curves: tuple[Curve, ...]

    @property
    def xs(self) -> list[float]:
        """Every x of the panel, sorted: the grid that best-x distances are counted on."""
        return sorted({p.x for curve in self.curves for p in curve.points})

    def best_spread(self) -> int | None:
        """How many grid steps apart the curves' best x values lie (0: every curve's best is
        the same x); None when fewer than two curves have a best."""
        grid = self.xs
        steps = [grid.index(c.best.x) for c in self.curves if c.best is not None]
        return max(steps) - min(steps) if len(steps) > 1 else None


def resolve_key(runs: Sequence[Run], given: str, option: str) -> str:
    """A config key as given (`optimizer.lr`) or by the short name `compare` shows (`lr`)."""
    keys = list(dict.fromkeys(k for run in runs for k in run.settings))
    if given in keys:
        return given
    varied = varied_keys(runs)
    matches = [k for k, short in short_keys(varied).items() if short == given]
    matches = matches or [k for k in varied if k.endswith("." + given)]
    if len(matches) == 1:
        return matches[0]
    if matches:
        raise UserError(
            f"{option} {given}: names several settings ({', '.join(matches)}); give one"
        )
    hint = f"; the settings that vary: {', '.join(varied)}" if varied else ""
    raise UserError(f"{option} {given}: not a setting of these runs (a config key){hint}")


def _final(run: Run, metric: str) -> float | None:
    """The run's final value of `metric` (compare's `final_<metric>`), only for a finished run."""
    if not run.finished:
        return None
    return metric_results(metric, [run])[0].read(run)


def _stepped_with(runs: Sequence[Run], key: str, candidates: Sequence[str]) -> list[str]:
    """The candidates whose value and `key`'s determine each other in every run (a `--zip`)."""
    out = []
    for other in candidates:
        forward: dict[str, str] = {}
        backward: dict[str, str] = {}
        ok = True
        for run in runs:
            a, b = shown(run.settings.get(key)), shown(run.settings.get(other))
            if forward.setdefault(a, b) != b or backward.setdefault(b, a) != a:
                ok = False
                break
        if ok:
            out.append(other)
    return out


def panels(
    runs: Sequence[Run], x: str, group: str | None = None, metrics: Sequence[str] = ("eval_loss",)
) -> list[Panel]:
    """The points of each metric against the setting `x`, one curve per value of `group`, one
    panel per combination of the other varied settings (seeds averaged)."""
    x = resolve_key(runs, x, "--x")
    group = None if group is None else resolve_key(runs, group, "--group")
    if group == x:
        raise UserError(f"--group {group}: is the x axis; group by another setting")
    for run in runs:
        value = run.settings.get(x)
        if not is_number(value):
            raise UserError(
                f"--x {x}: run {run.path} has {shown(value)}, not a number; a setting drawn "
                "against must be numeric"
            )
    varied = [k for k in varied_keys(runs) if k not in SEED_KEYS and k not in (x, group)]
    tied = _stepped_with(runs, x, varied)
    curve_keys = [] if group is None else [group, *_stepped_with(runs, group, varied)]
    panel_keys = [k for k in varied if k not in tied and k not in curve_keys]
    out = []
    for metric in metrics:
        for panel_settings, panel_runs in group_by_settings(runs, panel_keys):
            curves = []
            for curve_settings, curve_runs in group_by_settings(panel_runs, curve_keys):
                points = []
                for _, members in group_by_settings(curve_runs, [x]):
                    values = tuple(v for v in (_final(r, metric) for r in members) if v is not None)
                    mean = math.fsum(values) / len(values) if values else None
                    at = float(members[0].settings[x])
                    points.append(Point(at, mean, values, len(members)))
                points.sort(key=lambda p: p.x)
                higher = higher_is_better(metric, curve_runs)
                curves.append(Curve(curve_settings, metric, tuple(points), higher))
            curves.sort(key=lambda c: [_order(v) for v in c.settings.values()])
            out.append(Panel(panel_settings, metric, tuple(curves)))
    return out


def _order(value: object) -> tuple[int, float, str]:
    return (0, float(value), "") if is_number(value) else (1, 0.0, shown(value))


def _short_names(found: Sequence[Panel], x: str) -> dict[str, str]:
    """The short names (as compare shows them) of x and of the panels' and curves' keys."""
    keys = [k for p in found for k in [*p.settings, *(k for c in p.curves for k in c.settings)]]
    return short_keys(dict.fromkeys([x, *keys]))


def best_lines(found: Sequence[Panel], x: str) -> list[str]:
    """A plain-text table: per panel and curve, the best x and its value; per panel, how many
    grid steps the curves' best x values span."""
    short = _short_names(found, x)
    lines = []
    for panel in found:
        head = label(panel.settings, short) if panel.settings else "all runs"
        lines.append(f"{head}: {panel.metric}")
        for curve in panel.curves:
            name = label(curve.settings, short) if curve.settings else "runs"
            best = curve.best
            text = (
                f"best {short[x]} {shown(best.x)} ({best.value:.4f})"
                if best is not None and best.value is not None
                else "no finished run"
            )
            lines.append(f"  {name}: {text}")
        spread = panel.best_spread()
        if spread is not None:
            lines.append(f"  the best {short[x]} spans {spread} grid step(s) across the curves")
    return lines


def draw(
    found: Sequence[Panel],
    output: Path,
    x: str,
    *,
    log_y: bool = False,
    title: str | None = None,
) -> None:
    """One panel a row of three; log x where the values span a factor of LOG_SPAN (base 2
    where they are all powers of two); a star on each curve's best point, an x at the top
    for each x where no run finished."""
    from matplotlib.figure import Figure

    from llmtrain.ablate.plot import COLUMNS, save

    short = _short_names(found, x)
    ncols = min(len(found), COLUMNS)
    nrows = math.ceil(len(found) / ncols)
    fig = Figure(figsize=(6.0 * ncols, 4.4 * nrows), layout="constrained")
    grid = fig.subplots(nrows, ncols, squeeze=False).flat
    axes = [next(grid) for _ in found]
    for unused in grid:
        unused.set_visible(False)
    for ax, panel in zip(axes, found, strict=True):
        xs = panel.xs
        for i, curve in enumerate(panel.curves):
            colour = f"C{i % 10}"
            drawn = [p for p in curve.points if p.value is not None and math.isfinite(p.value)]
            for p in drawn:
                if len(p.values) > 1:
                    ax.plot([p.x] * len(p.values), p.values, ".", color=colour, alpha=0.3)
            best = curve.best
            name = label(curve.settings, short) if curve.settings else "runs"
            if best is not None:
                name += f" (best {shown(best.x)})"
            ax.plot(
                [p.x for p in drawn],
                [p.value for p in drawn],
                "-o",
                color=colour,
                markersize=4,
                linewidth=1.4,
                label=name,
            )
            if best is not None:
                ax.plot([best.x], [best.value], "*", color=colour, markersize=16,
                        markeredgecolor="black", markeredgewidth=0.6, zorder=5)  # fmt: skip
            failed = [p.x for p in curve.points if p.value is None or not math.isfinite(p.value)]
            if failed:
                ax.plot(failed, [1.0] * len(failed), "x", color=colour, markersize=8,
                        transform=ax.get_xaxis_transform(), clip_on=False)  # fmt: skip
        if xs and xs[0] > 0 and xs[-1] / xs[0] >= LOG_SPAN:
            powers_of_two = all(math.log2(v).is_integer() for v in xs)
            ax.set_xscale("log", base=2 if powers_of_two else 10)
        ax.set_xlabel(x)
        ax.set_ylabel(f"final {panel.metric}")
        ax.set_title(label(panel.settings, short) if panel.settings else f"final {panel.metric}")
        ax.grid(alpha=0.3)
        if log_y:
            ax.set_yscale("log")
        ax.legend(fontsize="small")
    if title:
        fig.suptitle(title)
    save(fig, output)
