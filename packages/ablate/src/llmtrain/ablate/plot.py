"""`llmtrain plot`: loss curves of runs or sweeps, one line per run, labelled by what varies.

One panel per metric (train `loss` and, where runs have them, `eval_loss` and each named
held-out set's `eval/<name>/loss`; any logged metric with `--metric`, every
`downstream/<task>/<metric>` with `--downstream`), against steps or tokens, three panels a row. Runs that differ only in their seed share a colour and one legend
entry: their mean at the x values every seed logged, with the mean's 95% t-interval as a band
(each seed drawn thin behind it; `--per-run` draws one line per run instead). A single run's
metric logged with a `<metric>_stderr` gets a ± stderr band. matplotlib is an optional
extra: `pip install 'llmtrain-ablate[plot]'`.

With a setting as `--x` (`--x optimizer.lr --group model.d_model`) each run is one point
instead: `settings_plot.py`.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from llmtrain.ablate.runs import (
    DOWNSTREAM,
    STDERR,
    Run,
    downstream_metrics,
    eval_set_losses,
    find_runs,
    group_by_settings,
    label,
    short_keys,
    varied_keys,
)
from llmtrain.core_mesh.cli import Context
from llmtrain.core_mesh.errors import UserError

if TYPE_CHECKING:
    from matplotlib.figure import Figure

FORMATS = (".png", ".svg", ".pdf")
CURVE_X = ("step", "tokens")  # curves over the run; any other --x is a setting
TITLES = {"loss": "train loss", "eval_loss": "eval loss"}
COLUMNS = 3  # panels a row


def smooth(values: Sequence[float], weight: float) -> list[float]:
    """Exponential moving average with bias correction (0: none)."""
    out, avg = [], 0.0
    for i, value in enumerate(values, 1):
        avg = weight * avg + (1 - weight) * value
        out.append(avg / (1 - weight**i) if weight else value)
    return out


def _curve(run: Run, metric: str, x: str, smoothing: float) -> tuple[list[float], list[float]]:
    xs, ys = run.series(metric, x)
    if metric == "loss" and smoothing and xs:
        ys = smooth(ys, smoothing)
    return xs, ys


def band(
    members: Sequence[Run],
    metric: str,
    x: str = "step",
    *,
    smoothing: float = 0.0,
    confidence: float = 0.95,
) -> tuple[list[float], list[float], list[float], list[float]] | None:
    """A group of seeds' curve: at each x that every seed logged, (xs, the mean over the seeds,
    the mean's `confidence` t-interval low and high: n - 1 degrees of freedom). None for fewer
    than two seeds with the metric or no x they share."""
    from scipy import stats

    curves = [dict(zip(*_curve(run, metric, x, smoothing), strict=True)) for run in members]
    curves = [c for c in curves if c]
    if len(curves) < 2:
        return None
    shared = sorted(set.intersection(*(set(c) for c in curves)))
    if not shared:
        return None
    n = len(curves)
    t = float(stats.t.ppf((1 + confidence) / 2, n - 1))
    xs, means, lows, highs = [], [], [], []
    for at in shared:
        values = [float(c[at]) for c in curves]
        mean = sum(values) / n
        sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
        half = t * sd / math.sqrt(n)
        xs.append(at)
        means.append(mean)
        lows.append(mean - half)
        highs.append(mean + half)
    return xs, means, lows, highs


def plot(
    runs: Sequence[Run],
    output: str | Path,
    *,
    x: str = "step",
    metrics: Sequence[str] = ("loss", "eval_loss"),
    smoothing: float = 0.0,
    log_y: bool = False,
    title: str | None = None,
    bands: bool = True,
    confidence: float = 0.95,
) -> list[str]:
    """Draw and save; returns the metrics drawn (those some run has). `bands`: a group of
    seeds is drawn as its mean with the mean's `confidence` interval as a band (and each seed
    thin behind it); without, one line per run."""
    output = _matplotlib(output)
    from matplotlib.figure import Figure

    drawn = [m for m in metrics if any(run.series(m, x)[0] for run in runs)]
    if not drawn:
        raise UserError(
            f"none of the runs logged {', '.join(metrics)} against {x!r} yet; nothing to plot"
        )
    keys = varied_keys(runs)
    short = short_keys(keys)
    groups = group_by_settings(runs, keys)
    ncols = min(len(drawn), COLUMNS)
    nrows = math.ceil(len(drawn) / ncols)
    legend = _legend_layout([label(s, short) if keys else m[0].name for s, m in groups], ncols)
    height = 4.2 * nrows + (legend[1] if legend else 0.0)
    fig = Figure(figsize=(6.0 * ncols, height), layout="constrained")
    grid = fig.subplots(nrows, ncols, squeeze=False).flat
    axes = [next(grid) for _ in drawn]
    for unused in grid:
        unused.set_visible(False)
    colours = [f"C{i % 10}" for i in range(len(groups))]
    for ax, metric in zip(axes, drawn, strict=True):
        for (settings, members), colour in zip(groups, colours, strict=True):
            name = label(settings, short) if keys else None
            evaluated = metric == "eval_loss" or metric.startswith(("eval/", DOWNSTREAM))
            marker = "o" if evaluated else None
            seeds = band(members, metric, x, smoothing=smoothing, confidence=confidence)
            if bands and seeds is not None:  # a group of seeds: its mean and the mean's band
                for run in members:
                    xs, ys = _curve(run, metric, x, smoothing)
                    ax.plot(xs, ys, color=colour, alpha=0.25, linewidth=0.8)
                xs, means, lows, highs = seeds
                ax.plot(
                    xs,
                    means,
                    color=colour,
                    linewidth=1.6,
                    marker=marker,
                    markersize=3,
                    label=f"{name or members[0].name} ({len(members)} seeds): mean, "
                    f"{confidence:.0%} CI",
                )
                ax.fill_between(xs, lows, highs, color=colour, alpha=0.2, linewidth=0)
                continue
            for i, run in enumerate(members):
                xs, ys = _curve(run, metric, x, smoothing)
                if not xs:
                    continue
                shown_name = (name or run.name) if i == 0 else None
                if shown_name and len(members) > 1:
                    shown_name += f" ({len(members)} seeds)"
                ax.plot(
                    xs,
                    ys,
                    color=colour,
                    alpha=1.0 if len(members) == 1 else 0.7,
                    linewidth=1.4,
                    marker=marker,
                    markersize=3,
                    label=shown_name,
                )
                stderr_xs, stderrs = run.series(metric + STDERR, x)
                if stderr_xs == xs:  # logged beside every value
                    low = [y - e for y, e in zip(ys, stderrs, strict=True)]
                    high = [y + e for y, e in zip(ys, stderrs, strict=True)]
                    ax.fill_between(xs, low, high, color=colour, alpha=0.15, linewidth=0)
        ax.set_xlabel("tokens" if x == "tokens" else "step")
        ax.set_ylabel(metric)
        ax.set_title(TITLES.get(metric, metric.removeprefix(DOWNSTREAM)))
        ax.grid(alpha=0.3)
        if log_y:
            ax.set_yscale("log")
    if legend:  # too many settings to sit inside a panel: below the figure, in columns
        fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center",
                   ncols=legend[0], fontsize="x-small")  # fmt: skip
    else:
        axes[0].legend(fontsize="small")
    if title:
        fig.suptitle(title)
    save(fig, output)
    return drawn


LEGEND_INSIDE = 10  # more settings than this: the legend goes below the panels


def _legend_layout(names: Sequence[str], panels_a_row: int) -> tuple[int, float] | None:
    """(columns, inches of height) of a legend below the panels for this many settings; None
    where it fits inside the first panel. A crowded legend inside a panel hides the curves."""
    if len(names) <= LEGEND_INSIDE:
        return None
    width = 6.0 * panels_a_row
    entry = 0.7 + 0.06 * max(len(name) for name in names)  # x-small text, in inches
    columns = max(1, min(len(names), int(width // entry)))
    return columns, 0.3 + 0.17 * math.ceil(len(names) / columns)


def save(fig: Figure, output: Path) -> None:
    """Write a matplotlib figure by its suffix, through a temporary file renamed over it."""
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(output.name + ".tmp")
    fig.savefig(tmp, format=output.suffix[1:].lower(), dpi=120)
    tmp.replace(output)


def _matplotlib(output: str | Path) -> Path:
    """The output path, once matplotlib imports and the suffix is one it writes."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UserError(
            "llmtrain plot needs matplotlib: pip install 'llmtrain-ablate[plot]'"
        ) from None
    output = Path(output)
    if output.suffix.lower() not in FORMATS:
        raise UserError(f"-o {output}: use a file ending in {', '.join(FORMATS)}")
    return output


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "paths", nargs="+", metavar="RUN_OR_SWEEP", help="run directories, sweeps or run folders"
    )
    parser.add_argument(
        "-o",
        "--output",
        required=True,
        metavar="FILE",
        help="the figure: .png, .svg or .pdf (required)",
    )
    parser.add_argument(
        "--x",
        default="step",
        metavar="X",
        help="the x axis: step, tokens, or a setting (a config key such as optimizer.lr): then "
        "each run is one point, the final value of --metric (default eval_loss), with the best "
        "x of each curve marked (default: step)",
    )
    parser.add_argument(
        "--group",
        default=None,
        metavar="KEY",
        help="with a setting as --x: one curve per value of this setting, e.g. model.d_model "
        "(default: one curve)",
    )
    parser.add_argument(
        "--metric",
        action="append",
        default=None,
        help="a logged metric to draw, e.g. downstream/hellaswag/acc_norm (repeatable; "
        "default: loss and eval_loss)",
    )
    parser.add_argument(
        "--downstream",
        action="store_true",
        help="also a panel for every downstream/<task>/<metric> the runs logged (default: off)",
    )
    parser.add_argument(
        "--smooth",
        type=float,
        default=0.0,
        help="EMA weight for the train loss, 0 to <1 (default: 0, none)",
    )
    parser.add_argument(
        "--log-y", action="store_true", help="logarithmic loss axis (default: linear)"
    )
    parser.add_argument(
        "--per-run",
        action="store_true",
        help="one line per run (default: a group of seeds as its mean with a 95%% CI band)",
    )
    parser.add_argument("--title", default=None, help="the figure's title (default: none)")


def run(args: argparse.Namespace, ctx: Context) -> int:
    if not 0.0 <= args.smooth < 1.0:
        raise UserError(f"--smooth must be in [0, 1), got {args.smooth}")
    if args.x not in CURVE_X:
        return _run_against_setting(args)
    if args.group is not None:
        raise UserError(
            f"--group {args.group}: groups points against a setting; give one as --x "
            "(e.g. --x optimizer.lr)"
        )
    runs = find_runs(args.paths)
    metrics = args.metric or ["loss", "eval_loss", *eval_set_losses(runs)]
    if args.downstream:
        found = downstream_metrics(runs)
        if not found:
            print("--downstream: none of the runs logged a downstream/ metric yet", file=sys.stderr)
        metrics = list(dict.fromkeys([*metrics, *found]))
    drawn = plot(
        runs,
        args.output,
        x=args.x,
        metrics=metrics,
        smoothing=args.smooth,
        log_y=args.log_y,
        title=args.title,
        bands=not args.per_run,
    )
    print(f"{len(runs)} runs, {', '.join(drawn)} -> {args.output}", file=sys.stderr)
    return 0


def _run_against_setting(args: argparse.Namespace) -> int:
    """`--x SETTING`: the final metric of each run against a setting, the best x marked, and
    the best x per curve printed."""
    from llmtrain.ablate import settings_plot

    for flag, given in (("--smooth", args.smooth), ("--per-run", args.per_run)):
        if given:
            raise UserError(
                f"{flag}: is for curves over steps; with --x {args.x} each run is one point "
                "(seeds are averaged, each drawn faint)"
            )
    output = _matplotlib(args.output)
    runs = find_runs(args.paths)
    metrics = args.metric or (
        ["eval_loss"] if any("eval_loss" in m for run in runs for m in run.metrics) else []
    )
    metrics = metrics or eval_set_losses(runs) or ["loss"]
    if args.downstream:
        metrics = list(dict.fromkeys([*metrics, *downstream_metrics(runs)]))
    found = settings_plot.panels(runs, args.x, args.group, metrics)
    x = settings_plot.resolve_key(runs, args.x, "--x")
    settings_plot.draw(found, output, x, log_y=args.log_y, title=args.title)
    print("\n".join(settings_plot.best_lines(found, x)))
    print(f"{len(runs)} runs, final {', '.join(metrics)} against {x} -> {output}", file=sys.stderr)
    return 0
