"""`llmtrain plot`: loss curves of runs or sweeps, one line per run, labelled by what varies.

One panel per metric (train `loss` and, where runs have it, `eval_loss`; any logged metric
with `--metric`, every `downstream/<task>/<metric>` with `--downstream`), against steps or
tokens, three panels a row. Runs that differ only in their seed share a colour and one legend
entry; a metric logged with a `<metric>_stderr` gets a ± stderr band. matplotlib is an optional
extra: `pip install 'llmtrain-ablate[plot]'`.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path

from llmtrain.ablate.runs import (
    DOWNSTREAM,
    STDERR,
    Run,
    downstream_metrics,
    find_runs,
    group_by_settings,
    label,
    short_keys,
    varied_keys,
)
from llmtrain.core_mesh.cli import Context
from llmtrain.core_mesh.errors import UserError

FORMATS = (".png", ".svg", ".pdf")
TITLES = {"loss": "train loss", "eval_loss": "eval loss"}
COLUMNS = 3  # panels a row


def smooth(values: Sequence[float], weight: float) -> list[float]:
    """Exponential moving average with bias correction (0: none)."""
    out, avg = [], 0.0
    for i, value in enumerate(values, 1):
        avg = weight * avg + (1 - weight) * value
        out.append(avg / (1 - weight**i) if weight else value)
    return out


def plot(
    runs: Sequence[Run],
    output: str | Path,
    *,
    x: str = "step",
    metrics: Sequence[str] = ("loss", "eval_loss"),
    smoothing: float = 0.0,
    log_y: bool = False,
    title: str | None = None,
) -> list[str]:
    """Draw and save; returns the metrics drawn (those some run has)."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise UserError(
            "llmtrain plot needs matplotlib: pip install 'llmtrain-ablate[plot]'"
        ) from None
    output = Path(output)
    if output.suffix.lower() not in FORMATS:
        raise UserError(f"-o {output}: use a file ending in {', '.join(FORMATS)}")
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
    fig = Figure(figsize=(6.0 * ncols, 4.2 * nrows), layout="constrained")
    grid = fig.subplots(nrows, ncols, squeeze=False).flat
    axes = [next(grid) for _ in drawn]
    for unused in grid:
        unused.set_visible(False)
    colours = [f"C{i % 10}" for i in range(len(groups))]
    for ax, metric in zip(axes, drawn, strict=True):
        for (settings, members), colour in zip(groups, colours, strict=True):
            name = label(settings, short) if keys else None
            for i, run in enumerate(members):
                xs, ys = run.series(metric, x)
                if not xs:
                    continue
                if metric == "loss" and smoothing:
                    ys = smooth(ys, smoothing)
                shown_name = (name or run.name) if i == 0 else None
                if shown_name and len(members) > 1:
                    shown_name += f" ({len(members)} seeds)"
                ax.plot(
                    xs,
                    ys,
                    color=colour,
                    alpha=1.0 if len(members) == 1 else 0.7,
                    linewidth=1.4,
                    marker="o" if metric == "eval_loss" or metric.startswith(DOWNSTREAM) else None,
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
    axes[0].legend(fontsize="small")
    if title:
        fig.suptitle(title)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(output.name + ".tmp")
    fig.savefig(tmp, format=output.suffix[1:].lower(), dpi=120)
    tmp.replace(output)
    return drawn


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "paths", nargs="+", metavar="RUN_OR_SWEEP", help="run directories, sweeps or run folders"
    )
    parser.add_argument("-o", "--output", required=True, help="the figure: .png, .svg or .pdf")
    parser.add_argument("--x", choices=("step", "tokens"), default="step", help="the x axis")
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
        help="also a panel for every downstream/<task>/<metric> the runs logged",
    )
    parser.add_argument(
        "--smooth", type=float, default=0.0, help="EMA weight for the train loss, 0 to <1"
    )
    parser.add_argument("--log-y", action="store_true", help="logarithmic loss axis")
    parser.add_argument("--title", default=None)


def run(args: argparse.Namespace, ctx: Context) -> int:
    if not 0.0 <= args.smooth < 1.0:
        raise UserError(f"--smooth must be in [0, 1), got {args.smooth}")
    runs = find_runs(args.paths)
    metrics = args.metric or ["loss", "eval_loss"]
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
    )
    print(f"{len(runs)} runs, {', '.join(drawn)} -> {args.output}", file=sys.stderr)
    return 0
