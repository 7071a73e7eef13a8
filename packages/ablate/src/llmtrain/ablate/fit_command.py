"""`llmtrain fit RUN_OR_SWEEP...`: scaling-law fits over runs that vary model size and tokens.

Each finished run is one point: N (summary.json `non_embedding_params`, or `params` with
`--params all`), D (summary.json `tokens`), compute C (`flops_per_token` x D, else 6 N D) and its
loss (the final logged `eval_loss`, or train `loss` with `--loss loss`). The points go to
`fit.fit_parametric` (L = E + A/N^alpha + B/D^beta with bootstrap intervals) and, with
`--isoflop`, to `fit.fit_isoflop` (per-budget optima and N_opt, D_opt ∝ C^a). Prints tables,
writes JSON (`-o`) and a plot (`--plot`, matplotlib imported only then). scipy is imported only
when the command runs, so loading the plugin stays cheap for every other command.

`--compare BASELINE VARIANT` fits two ladders apart and compares them at the `--predict` targets
and along the compute-optimal frontier (fit_compare.py).

`--mixture` fits a data-mixture sweep instead: each finished run's `data.train` weights against
a target (`--target`, a weighted sum of metrics), regressions chosen by cross-validation, the
mixture they predict best and the target at `--at` mixtures (`mixture_runs.py` reads the runs,
`mixture_fit.py` fits them; LightGBM, the `[mixture]` extra, imported only then).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

import attrs

from llmtrain.ablate.files import write_atomically
from llmtrain.ablate.runs import Run, find_runs, is_number
from llmtrain.core_mesh.cli import Context
from llmtrain.core_mesh.errors import UserError

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from llmtrain.ablate.fit import IsoFlopFit, ParametricFit, Prediction
    from llmtrain.ablate.mixture_runs import MixtureStudy

LOSSES = ("eval_loss", "loss")
PARAM_COUNTS = {"non_embedding": "non_embedding_params", "all": "params"}
PLOT_FORMATS = (".png", ".svg", ".pdf")
LEGEND_SIZES = 8  # more model sizes than this get a colour bar instead of legend entries
# the options of the scaling-law fits only, and of the mixture fit only (dest: flag)
SCALING_ONLY = {
    "isoflop": "--isoflop",
    "predict": "--predict",
    "loss": "--loss",
    "params": "--params",
    "bootstrap": "--bootstrap",
    "include_unfinished": "--include-unfinished",
}
MIXTURE_ONLY = {"target": "--target", "at": "--at"}
EDGE = 0.02  # a best weight this near the lowest or highest weight the runs tried is at its edge


@attrs.frozen
class RunPoint:
    """One run as a point of the fits."""

    name: str
    n: float
    d: float
    compute: float
    loss: float

    def to_json(self) -> dict[str, object]:
        return attrs.asdict(self)


def listed(names: Sequence[str], limit: int = 8) -> str:
    """The first `limit` names, and how many more."""
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def check_finished(runs: Sequence[Run], include_unfinished: bool) -> None:
    """A run that has not finished has not reached the N, D it is a point for."""
    unfinished = [f"{run.name} ({run.status})" for run in runs if not run.finished]
    if unfinished and not include_unfinished:
        raise UserError(
            f"runs that did not finish: {listed(unfinished)}; their losses are not the final "
            f"ones; leave them out, or pass --include-unfinished to fit them as they are"
        )


def loss_key(text: str) -> str:
    """`--loss`: eval_loss, loss, or a named held-out set's `eval/<name>/loss`."""
    if text in LOSSES or re.fullmatch(r"eval/[A-Za-z0-9_.-]+/loss", text):
        return text
    raise argparse.ArgumentTypeError(
        f"{text!r}: give eval_loss, loss, or a named eval set's eval/<name>/loss"
    )


def tokenizer_of(run: Run) -> str | None:
    """What names the run's tokenizer: the config's `data.tokenizer` (or `tokenizer`) when it
    has one, else the tokenizer recorded in the packed dataset's zarr.json (eval data first,
    then training data; a local path readable from here). None: cannot tell."""
    data = run.config.get("data") or {}
    for given in (data.get("tokenizer"), run.config.get("tokenizer")):
        if given is not None:
            return given if isinstance(given, str) else json.dumps(given, sort_keys=True)
    # data.eval is one held-out set or a list of named ones
    evals = data.get("eval") or []
    paths = [
        e.get("path")
        for e in (evals if isinstance(evals, list) else [evals])
        if isinstance(e, dict)
    ]
    paths += [source.get("path") for source in data.get("train") or [] if isinstance(source, dict)]
    for path in paths:
        if not isinstance(path, str) or "://" in path:
            continue
        try:
            group = json.loads((Path(path) / "zarr.json").read_text(encoding="utf-8"))
            tokenizer = group["attributes"]["llmtrain"]["tokenizer"]
            return f"{tokenizer['name']} ({tokenizer['fingerprint']})"
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return None


def check_tokenizers(runs: Sequence[Run], allow_mixed: bool) -> None:
    """Losses in nats per token of different tokenizers measure different things. Runs whose
    tokenizer cannot be told are not compared."""
    by_tokenizer: dict[str, list[str]] = {}
    for run in runs:
        tokenizer = tokenizer_of(run)
        if tokenizer is not None:
            by_tokenizer.setdefault(tokenizer, []).append(run.name)
    if len(by_tokenizer) > 1 and not allow_mixed:
        groups = "; ".join(f"{tok}: {listed(names, 4)}" for tok, names in by_tokenizer.items())
        raise UserError(
            f"the runs use {len(by_tokenizer)} tokenizers, so their losses per token are not "
            f"comparable ({groups}); fit each tokenizer's runs apart, or pass "
            f"--allow-mixed-tokenizers"
        )


def final_value(run: Run, key: str) -> float | None:
    values = [float(m[key]) for m in run.metrics if is_number(m.get(key))]
    return values[-1] if values else None


def read_points(runs: Sequence[Run], loss_key: str, params: str) -> list[RunPoint]:
    """Each run's (N, D, C, loss); every run missing one of them is named in one error."""
    params_key = PARAM_COUNTS[params]
    no_summary = [run.name for run in runs if run.summary is None]
    if no_summary:
        raise UserError(
            f"runs without summary.json: {listed(no_summary)}; N and D are read from it "
            f"(written when a run ends)"
        )
    summaries = [(run, run.summary) for run in runs if run.summary is not None]  # every run's
    missing = [run.name for run, summary in summaries if not is_number(summary.get(params_key))]
    if missing:
        raise UserError(
            f"summary.json of {listed(missing)} has no {params_key} (older llmtrain): re-run "
            f"them with this version, which records params, non_embedding_params and "
            f"flops_per_token"
        )
    missing = [run.name for run, summary in summaries if not is_number(summary.get("tokens"))]
    if missing:
        raise UserError(f"summary.json of {listed(missing)} has no tokens count")
    losses = {run.name: final_value(run, loss_key) for run in runs}
    missing = [name for name, loss in losses.items() if loss is None]
    if missing:
        other = "loss" if loss_key == "eval_loss" else "eval_loss"
        raise UserError(
            f"runs that logged no {loss_key}: {listed(missing)}; fit them on --loss {other}?"
        )
    final_losses = {name: loss for name, loss in losses.items() if loss is not None}  # all
    points = []
    for run, summary in summaries:
        n, d = float(summary[params_key]), float(summary["tokens"])
        per_token = summary.get("flops_per_token")
        compute = float(per_token) * d if is_number(per_token) else 6.0 * n * d
        points.append(RunPoint(run.name, n, d, compute, final_losses[run.name]))
    return points


# --- --predict ---


@attrs.frozen
class Target:
    """A --predict target: N and D (a loss), or C (the compute-optimal N and D)."""

    n: float | None = None
    d: float | None = None
    compute: float | None = None

    @property
    def text(self) -> str:
        if self.compute is not None:
            return f"C={self.compute:.3g}"
        return f"N={self.n:.3g},D={self.d:.3g}"


def parse_target(text: str) -> Target:
    """'N=1e9,D=2e10' or 'C=1e21'."""
    values: dict[str, float] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        key = key.strip().upper()
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if not sep or key not in ("N", "D", "C") or not number > 0 or key in values:
            raise UserError(
                f"--predict {text}: give N=<params>,D=<tokens> or C=<FLOPs>, e.g. N=1e9,D=2e10"
            )
        values[key] = number
    if set(values) == {"N", "D"}:
        return Target(n=values["N"], d=values["D"])
    if set(values) == {"C"}:
        return Target(compute=values["C"])
    raise UserError(f"--predict {text}: give N and D together, or C alone")


# --- tables ---


def _number(value: float | None) -> str:
    if value is None or not math.isfinite(value):
        return "-"
    return f"{value:.4g}"


def _interval(low: float | None, high: float | None) -> str:
    if low is None or high is None or not (math.isfinite(low) and math.isfinite(high)):
        return "-"
    return f"{_number(low)} - {_number(high)}"


def _table(header: Sequence[str], body: Sequence[Sequence[str]]) -> list[str]:
    """Columns padded as compare's table pads them."""
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += [
        "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip() for cells in body
    ]
    return lines


# --- when a fit cannot be trusted ---

POINTS_PER_PARAMETER = 3  # fewer points than this per fitted parameter: barely determined
MIN_DISTINCT = 3  # model sizes (token counts) needed to identify alpha (beta), not just fit it
WIDE_INTERVAL = 10.0  # an interval whose ends differ by more than this factor pins nothing
EXPONENTS = (0.05, 1.0)  # alpha, beta outside this: implausible (Chinchilla: 0.34, 0.28)
EXTRAPOLATION = 10.0  # a prediction beyond this factor past the trained N or D
FLOOR_SHARE = 0.9  # a prediction of which E is this share or more says little beyond E


def figure(value: float, signed: bool = False) -> str:
    """A number for a table or sentence: 4 decimals in a loss's range, 3 significant digits in
    scientific notation far outside it (`1.73e+07`, not `17346265.4749`); `-` when not finite."""
    if not math.isfinite(value):
        return "-"
    sign = "+" if signed else ""
    if value != 0 and not 1e-3 <= abs(value) < 1e4:
        return f"{value:{sign}.3g}"
    return f"{value:{sign}.4f}"


def trust_warnings(
    points: Sequence[RunPoint],
    parametric: ParametricFit,
    at: Sequence[tuple[str, float, float, float]] = (),
) -> list[str]:
    """Why the parametric fit (and its predictions `at`: (target, N, D, loss)) cannot be
    trusted, one sentence each; [] when nothing is known against it. Too few points per
    parameter, too few sizes or token counts to identify an exponent, bootstrap intervals wider
    than an order of magnitude, implausible exponents, predictions far outside the trained N
    and D or dominated by the floor E."""
    from llmtrain.ablate.fit import PARAMETERS

    warnings = []
    count, needed = len(points), POINTS_PER_PARAMETER * len(PARAMETERS)
    if count < needed:
        warnings.append(
            f"{count} runs for {len(PARAMETERS)} parameters (fewer than {POINTS_PER_PARAMETER} "
            f"per parameter, {needed}): the fit is barely determined; add runs"
        )
    for axis, values, exponent in (
        ("model sizes N", {p.n for p in points}, "alpha"),
        ("token counts D", {p.d for p in points}, "beta"),
    ):
        if len(values) < MIN_DISTINCT:
            warnings.append(
                f"{len(values)} distinct {axis}: {exponent} is not identified (it takes at "
                f"least {MIN_DISTINCT}); add runs at other {axis.split()[0]} {axis.split()[1]}"
            )
    wide = []
    for name, interval in parametric.intervals.items():
        low, high = interval.low, interval.high
        unbounded = not (math.isfinite(low) and math.isfinite(high)) or low <= 0
        if unbounded or high / low > WIDE_INTERVAL:
            wide.append(f"{name} {low:.3g} - {high:.3g}")
    if wide:
        warnings.append(
            f"95% intervals spanning more than an order of magnitude (or unbounded): "
            f"{'; '.join(wide)}: the runs do not pin these down"
        )
    low, high = EXPONENTS
    odd = [
        f"{name} = {value:.3g}"
        for name, value in (("alpha", parametric.alpha), ("beta", parametric.beta))
        if not low <= value <= high
    ]
    if odd:
        warnings.append(
            f"implausible exponents ({', '.join(odd)}; published fits lie within "
            f"{low:g} - {high:g}, Chinchilla's 0.34 and 0.28): the fit has bent to the points, "
            f"not found a law"
        )
    n_range = (min(p.n for p in points), max(p.n for p in points))
    d_range = (min(p.d for p in points), max(p.d for p in points))
    for target, n, d, loss in at:
        outside = [
            f"{axis}={value:.3g} is {factor:.3g}x {side} the runs' {axis} "
            f"({lowest:.3g} - {highest:.3g})"
            for axis, value, (lowest, highest) in (("N", n, n_range), ("D", d, d_range))
            for factor, side in ((value / highest, "beyond"), (lowest / value, "below"))
            if math.isfinite(value) and factor > EXTRAPOLATION
        ]
        if outside:
            warnings.append(
                f"predict {target}: {'; '.join(outside)}: an extrapolation of more than "
                f"{EXTRAPOLATION:g}x"
            )
        if math.isfinite(loss) and loss > 0 and parametric.E >= FLOOR_SHARE * loss:
            warnings.append(
                f"predict {target}: the floor E = {parametric.E:.4g} is "
                f"{parametric.E / loss:.0%} of the predicted {loss:.4g}: the prediction says "
                f"little beyond E"
            )
    return warnings


def render_parametric(result: ParametricFit, loss_key: str, params: str) -> list[str]:
    head = (
        f"L(N, D) = E + A / N^alpha + B / D^beta: {result.n_points} runs, N = {params} params, "
        f"loss = final {loss_key}, 95% intervals from {len(result.bootstrap)} bootstrap refits"
    )
    body = [
        [name, _number(value), _interval(result.intervals[name].low, result.intervals[name].high)]
        for name, value in result.params.items()
    ]
    return [head, *_table(["param", "value", "95% interval"], body)]


def render_isoflop(result: IsoFlopFit) -> list[str]:
    body = [
        [
            f"{b.compute:.3g}",
            str(len(b.names)),
            _number(b.n_opt),
            _number(b.d_opt),
            _number(b.loss_opt),
            "" if b.rejected is None else f"left out: {b.rejected}",
        ]
        for b in result.budgets
    ]
    lines = ["IsoFLOP profiles (a parabola of loss in log N per compute budget):"]
    lines += _table(["budget C", "runs", "N_opt", "D_opt", "loss at opt", "note"], body)
    for name, law in (("N_opt", result.n_opt), ("D_opt", result.d_opt)):
        interval = law.exponent_interval
        spread = (
            f" (95%: {_interval(interval.low, interval.high)}, stderr {law.exponent_stderr:.3g})"
            if interval is not None
            else " (no interval from 2 budgets)"
        )
        lines.append(f"{name} = {law.coefficient:.4g} * C^{law.exponent:.4f}{spread}")
    return lines


def predictions(
    targets: Sequence[Target], parametric: ParametricFit, isoflop: IsoFlopFit | None
) -> list[dict[str, Any]]:
    """Each target's predicted values, each as [value, low, high]."""
    out = []
    for target in targets:
        row: dict[str, Any] = {"target": target.text}
        n, d = target.n, target.d
        if target.compute is not None:
            if isoflop is None:
                raise UserError(f"--predict {target.text}: a compute target needs --isoflop")
            n_opt, d_opt = isoflop.predict(target.compute)
            row["n_opt"] = [n_opt.value, n_opt.low, n_opt.high]
            row["d_opt"] = [d_opt.value, d_opt.low, d_opt.high]
            n, d = n_opt.value, d_opt.value
        loss = parametric.predict(n, d)
        row.update(n=n, d=d, loss=[float(loss.value), float(loss.low), float(loss.high)])
        out.append(row)
    return out


def render_predictions(rows: Sequence[dict[str, Any]]) -> list[str]:
    body = []
    for row in rows:
        cells = [row["target"]]
        for key in ("n_opt", "d_opt"):
            value = row.get(key)
            cells.append("" if value is None else f"{_number(value[0])} ({_interval(*value[1:])})")
        cells.append(f"{_number(row['loss'][0])} ({_interval(*row['loss'][1:])})")
        body.append(cells)
    header = ["predict", "N_opt (95%)", "D_opt (95%)", "loss (95%)"]
    title = "predictions (loss from the parametric fit, at N_opt, D_opt for C):"
    return [title, *_table(header, body)]


# --- the plot ---


def draw(
    points: Sequence[RunPoint],
    parametric: ParametricFit,
    isoflop: IsoFlopFit | None,
    targets: Sequence[Target],
    output: Path,
) -> None:
    """Loss against D, one colour per model size, with the fitted curves reaching the --predict
    targets; with --isoflop also each budget's parabola against N and N_opt against C."""
    import numpy as np

    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise UserError(
            "llmtrain fit --plot needs matplotlib: pip install 'llmtrain-ablate[plot]'"
        ) from None
    import matplotlib as mpl

    panels = 3 if isoflop is not None else 1
    figure = Figure(figsize=(6 * panels, 4.5), layout="constrained")
    axes = figure.subplots(1, panels, squeeze=False)[0]
    sizes = sorted({p.n for p in points})
    # colour by log N; a legend entry per size only while the legend stays readable
    norm = mpl.colors.LogNorm(min(sizes), max(sizes) * 1.0001)
    colours = mpl.colormaps["viridis"](norm(sizes))
    labelled = len(sizes) <= LEGEND_SIZES
    d_all = [p.d for p in points] + [t.d for t in targets if t.d is not None]
    d_grid = np.geomspace(min(d_all) / 1.5, max(d_all) * 1.5, 100)
    ax = axes[0]
    for size, colour in zip(sizes, colours, strict=True):
        mine = [p for p in points if p.n == size]
        ax.scatter([p.d for p in mine], [p.loss for p in mine], color=colour, s=18)
        ax.plot(
            d_grid,
            parametric.predict(size, d_grid).value,
            color=colour,
            lw=1,
            label=f"N={size:.3g}" if labelled else None,
        )
    if not labelled:
        scale = mpl.cm.ScalarMappable(norm, mpl.colormaps["viridis"])
        figure.colorbar(scale, ax=ax, label="params N")
    for target in targets:
        if target.n is None:
            continue
        ax.plot(d_grid, parametric.predict(target.n, d_grid).value, "k--", lw=1)
        loss = parametric.predict(target.n, target.d)
        ax.errorbar(
            [target.d],
            [loss.value],
            yerr=_error_bar(loss),
            fmt="k*",
            ms=10,
            capsize=3,
            label=f"predict {target.text}",
        )
    ax.set(
        xscale="log", xlabel="tokens D", ylabel="loss", title=r"$L = E + A/N^\alpha + B/D^\beta$"
    )
    if ax.get_legend_handles_labels()[0]:  # nothing labelled: many sizes, no targets
        ax.legend(fontsize="small")
    if isoflop is not None:
        _draw_isoflop(axes[1], axes[2], isoflop, targets)
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output)


def _error_bar(prediction: Prediction) -> list[list[float]] | None:
    """matplotlib's yerr for a prediction's interval; None without one. Clipped at 0: an
    interval that collapsed onto the value may sit a rounding error beside it."""
    value, low, high = (float(x) for x in (prediction.value, prediction.low, prediction.high))
    if not (math.isfinite(low) and math.isfinite(high)):
        return None
    return [[max(value - low, 0.0)], [max(high - value, 0.0)]]


def _draw_isoflop(
    parabolas: Axes, laws: Axes, isoflop: IsoFlopFit, targets: Sequence[Target]
) -> None:
    import matplotlib as mpl
    import numpy as np

    colours = mpl.colormaps["plasma"](np.linspace(0, 0.85, len(isoflop.budgets)))
    for budget, colour in zip(isoflop.budgets, colours, strict=True):
        parabolas.scatter(budget.n, budget.loss, color=colour, s=18)
        if budget.parabola is not None:
            grid = np.geomspace(budget.n.min(), budget.n.max(), 60)
            parabolas.plot(
                grid,
                np.polyval(budget.parabola, np.log(grid)),
                color=colour,
                lw=1,
                label=f"C={budget.compute:.2g}",
            )
        if budget.n_opt is not None and budget.loss_opt is not None:  # both or neither
            parabolas.plot([budget.n_opt], [budget.loss_opt], "x", color=colour, ms=8)
    parabolas.set(xscale="log", xlabel="params N", ylabel="loss", title="IsoFLOP profiles")
    parabolas.legend(fontsize="small")
    used = [b for b in isoflop.budgets if b.rejected is None]
    compute = [b.compute for b in used] + [t.compute for t in targets if t.compute is not None]
    grid = np.geomspace(min(compute), max(compute), 50)
    optima = [  # every used budget has its optimum
        (b.compute, b.n_opt, b.d_opt) for b in used if b.n_opt is not None and b.d_opt is not None
    ]
    laws.scatter([c for c, _, _ in optima], [n for _, n, _ in optima], color="C0", label="N_opt")
    laws.scatter([c for c, _, _ in optima], [d for _, _, d in optima], color="C1", label="D_opt")
    laws.plot(grid, isoflop.n_opt(grid), color="C0", lw=1)
    laws.plot(grid, isoflop.d_opt(grid), color="C1", lw=1)
    for target in targets:
        if target.compute is not None:
            for law, colour in ((isoflop.n_opt, "C0"), (isoflop.d_opt, "C1")):
                p = law.predict(target.compute)
                laws.errorbar(
                    [target.compute],
                    [p.value],
                    yerr=_error_bar(p),
                    fmt="*",
                    color=colour,
                    ms=10,
                    capsize=3,
                )
    laws.set(xscale="log", yscale="log", xlabel="compute C (FLOPs)", title="compute-optimal N, D")
    laws.legend(fontsize="small")


# --- the command ---


def _plain(value: Any) -> object:
    """JSON-ready: numpy numbers as floats (integers as ints), NaN and inf (no interval) as
    null."""
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, (str, bool)) or value is None:
        return value
    if isinstance(value, int) or getattr(getattr(value, "dtype", None), "kind", "") in ("i", "u"):
        return int(value)  # counts stay whole numbers
    number = float(value)
    return number if math.isfinite(number) else None


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "paths",
        nargs="+",
        metavar="RUN_OR_SWEEP",
        help="run directories, sweeps or run folders (with --compare: BASELINE VARIANT)",
    )
    parser.add_argument(
        "--loss",
        type=loss_key,
        default=None,
        metavar="{eval_loss,loss,eval/NAME/loss}",
        help="each run's final logged eval_loss, train loss, or the loss of a named held-out "
        "set (default: eval_loss)",
    )
    parser.add_argument(
        "--params",
        choices=tuple(PARAM_COUNTS),
        default=None,
        help="N: non-embedding parameters or all (default: non_embedding)",
    )
    parser.add_argument(
        "--predict",
        action="append",
        default=[],
        metavar="N=..,D=.. | C=..",
        help="the loss at N params and D tokens (N=1e9,D=2e10), or with --isoflop the "
        "compute-optimal N and D for C FLOPs (C=1e21); repeatable (default: none)",
    )
    parser.add_argument(
        "--isoflop",
        action="store_true",
        help="also fit IsoFLOP profiles: per compute budget the optimal N, then N_opt, "
        "D_opt ∝ C^a (default: off)",
    )
    parser.add_argument(
        "--bootstrap",
        type=int,
        default=None,
        metavar="K",
        help="bootstrap refits for the 95%% intervals (default 200; 0: none)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="the bootstrap's seed; with --mixture the folds', LightGBM's and the search's "
        "(default: 0)",
    )
    parser.add_argument(
        "--compare",
        action="store_true",
        help="fit two ladders apart, BASELINE then VARIANT, and print each fit's loss at the "
        "--predict targets, the difference variant - baseline with its bootstrap interval, and "
        "where the fits cross along the compute-optimal frontier (default: off)",
    )
    parser.add_argument(
        "--mixture",
        action="store_true",
        help="fit a data-mixture sweep instead: the target against each run's data.train "
        "weights, the mixture predicted best (needs the [mixture] extra) (default: off)",
    )
    parser.add_argument(
        "--target",
        default=None,
        metavar="METRIC=W,...",
        help="with --mixture, the weighted sum of final metrics to optimise, e.g. "
        "'eval/web/loss=0.5,eval/code/loss=0.5' (default: the mean of the eval/<name>/loss "
        "metrics logged, else eval_loss)",
    )
    parser.add_argument(
        "--at",
        action="append",
        default=[],
        metavar="W0,W1,...",
        help="with --mixture, the predicted target at this mixture (one weight per data.train "
        "dataset, in order); repeatable (default: none)",
    )
    parser.add_argument(
        "-o",
        "--output",
        default=None,
        metavar="FILE.json",
        help="write the fits as JSON here; the figure is --plot's (default: none)",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print JSON instead of text (the tables) (default: off)",
    )
    parser.add_argument(
        "--plot",
        default=None,
        metavar="FILE",
        help="draw the fits (PNG, SVG, PDF) (default: none)",
    )
    parser.add_argument(
        "--include-unfinished",
        action="store_true",
        help="fit runs that did not finish too, at their last logged loss (default: off)",
    )
    parser.add_argument(
        "--allow-mixed-tokenizers",
        action="store_true",
        help="fit runs of different tokenizers together, though their losses are not "
        "comparable (default: off)",
    )


@attrs.frozen
class Fits:
    """What `llmtrain fit` (and the report) computed from a set of runs."""

    loss_key: str
    params: str
    points: list[RunPoint]
    parametric: ParametricFit
    isoflop: IsoFlopFit | None = None
    targets: tuple[Target, ...] = ()
    predicted: list[dict[str, object]] = attrs.Factory(list)

    @property
    def warnings(self) -> list[str]:
        """Why the fit and its predictions cannot be trusted (`trust_warnings`)."""
        rows: list[dict[str, Any]] = self.predicted  # as `predictions` made them
        at = [(str(r["target"]), r["n"], r["d"], r["loss"][0]) for r in rows]
        return trust_warnings(self.points, self.parametric, at)

    def to_json(self) -> dict[str, object]:
        return {
            "loss": self.loss_key,
            "params": self.params,
            "warnings": self.warnings,
            "runs": [p.to_json() for p in self.points],
            "parametric": self.parametric.to_json(),
            "isoflop": None if self.isoflop is None else self.isoflop.to_json(),
            "predictions": self.predicted,
        }


def fit_runs(
    runs: Sequence[Run],
    *,
    loss_key: str = "eval_loss",
    params: str = "non_embedding",
    bootstrap: int = 200,
    seed: int = 0,
    include_unfinished: bool = False,
    allow_mixed_tokenizers: bool = False,
) -> Fits:
    """The runs checked, read as points, and fitted parametrically."""
    from llmtrain.ablate import fit

    check_finished(runs, include_unfinished)
    check_tokenizers(runs, allow_mixed_tokenizers)
    points = read_points(runs, loss_key, params)
    parametric = fit.fit_parametric(
        [p.n for p in points],
        [p.d for p in points],
        [p.loss for p in points],
        names=[p.name for p in points],
        n_boot=bootstrap,
        seed=seed,
    )
    return Fits(loss_key, params, points, parametric)


def with_isoflop(fits: Fits) -> Fits:
    """`fits` with the IsoFLOP fit of its points."""
    from llmtrain.ablate import fit

    points = fits.points
    isoflop = fit.fit_isoflop(
        [p.n for p in points],
        [p.d for p in points],
        [p.loss for p in points],
        [p.compute for p in points],
        names=[p.name for p in points],
    )
    return attrs.evolve(fits, isoflop=isoflop)


def with_predictions(fits: Fits, targets: Sequence[Target]) -> Fits:
    predicted = predictions(targets, fits.parametric, fits.isoflop)
    return attrs.evolve(fits, targets=tuple(targets), predicted=predicted)


def render_fits(fits: Fits) -> list[str]:
    lines = render_parametric(fits.parametric, fits.loss_key, fits.params)
    if fits.isoflop is not None:
        lines += ["", *render_isoflop(fits.isoflop)]
    if fits.predicted:
        lines += ["", *render_predictions(fits.predicted)]
    warnings = fits.warnings
    if warnings:  # last, where a terminal leaves the eye
        lines += ["", *(f"warning: {warning}" for warning in warnings)]
    return lines


def draw_fits(fits: Fits, output: Path) -> None:
    draw(fits.points, fits.parametric, fits.isoflop, fits.targets, output)


# --- --mixture ---


def parse_at(text: str) -> list[float]:
    """'0.5,0.3,0.2': a mixture, one weight per data.train dataset (their count is checked
    against the runs'); negative weights, or all of them 0, refused."""
    try:
        weights = [float(part) for part in text.split(",")]
    except ValueError:
        weights = [math.nan]
    if not all(math.isfinite(w) for w in weights):
        raise UserError(f"--at {text}: give one weight per data.train dataset, e.g. 0.5,0.3,0.2")
    if any(w < 0 for w in weights):
        raise UserError(f"--at {text}: a weight below 0; a mixture's weights are 0 or more")
    if not any(w > 0 for w in weights):
        raise UserError(f"--at {text}: every weight is 0; at least one dataset must be mixed in")
    return weights


class AtPrediction(TypedDict):
    """An --at mixture (normalised), its predicted target and interval, and the datasets it
    weights beyond the range the runs covered."""

    weights: list[float]
    predicted: float
    interval: list[float]
    outside: list[str]


def mixture_at(study: MixtureStudy, given: Sequence[list[float]]) -> list[AtPrediction]:
    """Each --at mixture (normalised to sum 1) with its predicted target and interval, and the
    sources it weights beyond the range the runs covered."""
    import numpy as np

    sources = study.runs.sources
    x = study.fit.data.weights
    out = []
    for weights in given:
        text = ",".join(f"{w:g}" for w in weights)
        if len(weights) != len(sources):
            names = ", ".join(s.name for s in sources)
            raise UserError(
                f"--at {text}: {len(weights)} weights for {len(sources)} datasets ({names}); "
                f"give one per data.train dataset, in order"
            )
        at = np.array(weights) / sum(weights)
        for i in np.flatnonzero(~study.fit.data.varying):
            if abs(at[i] - x[0, i]) > 1e-9:
                raise UserError(
                    f"--at {text}: {sources[i].name} has weight {x[0, i]:g} in every run; the "
                    f"fit cannot tell what another weight of it does"
                )
        outside = [
            s.name
            for s, w, low, high in zip(sources, at, x.min(axis=0), x.max(axis=0), strict=True)
            if not low - 1e-9 <= w <= high + 1e-9
        ]
        predicted = study.fit.predict(at)
        out.append(  # numbers, for JSON
            AtPrediction(
                weights=[float(w) for w in at],
                predicted=predicted.value,
                interval=[predicted.low, predicted.high],
                outside=outside,
            )
        )
    return out


def _share(value: float) -> str:
    """A weight of the answer (hundredths) as the ready line writes it: 0.47, 0.5, 0, 1."""
    return f"{value:.6g}"


def ready_line(weights: Iterable[float]) -> str:
    """`data.weights=[w0,w1,...]`, as `llmtrain sweep --grid` takes a mixture."""
    return "data.weights=[" + ",".join(_share(w) for w in weights) + "]"


def mixture_answer(study: MixtureStudy) -> str:
    """The answer: the mixture, its predicted target and interval."""
    fit, sources = study.fit, study.runs.sources
    mixture = ", ".join(f"{s.name} {_share(w)}" for s, w in zip(sources, fit.weights, strict=True))
    best = fit.predicted
    return (
        f"{mixture}; predicted {study.runs.target.text} = "
        f"{_predicted(best.value, best.low, best.high)}"
    )


def _predicted(value: float, low: float, high: float) -> str:
    """A predicted target with its interval: `3.2915 (95% interval 3.2101 - 3.3729)`."""
    return f"{value:.4f} (95% interval {low:.4f} - {high:.4f})"


def mixture_edges(study: MixtureStudy) -> list[str]:
    """A sentence for each source whose best weight sits at the lowest or highest weight any
    run gave it (not 0 or 1): the best may lie beyond what the runs tried."""
    x = study.fit.data.weights
    lines = []
    for source, w, low, high in zip(
        study.runs.sources, study.fit.weights, x.min(axis=0), x.max(axis=0), strict=True
    ):
        for bound, word, edge in ((low, "lowest", 0.0), (high, "highest", 1.0)):
            if abs(w - bound) <= EDGE and abs(bound - edge) > EDGE:
                lines.append(
                    f"{source.name} is at the {word} weight any run gave it ({bound:.3g}): the "
                    f"best may lie beyond what the runs tried"
                )
    return lines


Table = tuple[list[str], list[list[str]]]  # (header, body)


def mixture_tables(study: MixtureStudy) -> tuple[Table, Table]:
    """(each dataset's best weight beside the range of weights the runs gave it; every
    model's cross-validated RMSE and Spearman correlation, the chosen one marked)."""
    fit, x = study.fit, study.fit.data.weights
    sources = [
        [s.name, _share(w), f"{low:.3g} - {high:.3g}", s.path]
        for s, w, low, high in zip(
            study.runs.sources, fit.weights, x.min(axis=0), x.max(axis=0), strict=True
        )
    ]
    models = [
        [
            s.name,
            _number(s.rmse),
            f"{s.spearman:.3f}" if math.isfinite(s.spearman) else "-",
            "chosen" if s.name == fit.model else s.error,
        ]
        for s in fit.scores
    ]
    return (
        (["dataset", "best", "runs' range", "path"], sources),
        (["model", "cv rmse", "cv spearman", ""], models),
    )


def mixture_method(study: MixtureStudy) -> str:
    fit = study.fit
    return (
        f"{fit.folds}-fold cross-validation (seed {fit.seed}): each run predicted by the model "
        f"fitted without it; the lowest cv rmse is chosen. The best mixture is the mean of the "
        f"{fit.top} best of {fit.searched:,} mixtures searched within the runs' range; the "
        f"interval is +- {fit.radius:.4g}, the 95% conformal quantile of the chosen model's "
        f"absolute cv residuals."
    )


def render_mixture(study: MixtureStudy, how: str, at: Sequence[AtPrediction]) -> list[str]:
    """The answer first (the mixture, its predicted target, the ready line), then the datasets'
    table, every model's cross-validation, and the --at predictions."""
    fit, points = study.fit, study.runs
    direction = "higher" if fit.data.higher_is_better else "lower"
    target = points.target.text + (f" ({how})" if how else "")
    sources, models = mixture_tables(study)
    lines = [
        f"mixture fit: {len(points.names)} runs, {len(points.sources)} datasets; target "
        f"{target}, {direction} is better",
        f"best mixture: {mixture_answer(study)}",
        ready_line(fit.weights),
        *mixture_edges(study),
        "",
        *_table(*sources),
        "",
        *_table(*models),
        mixture_method(study),
    ]
    if points.left_out:
        lines.append(f"left out, not finished: {', '.join(points.left_out)}")
    for row in at:
        mixture = ", ".join(
            f"{s.name} {w:.3g}" for s, w in zip(points.sources, row["weights"], strict=True)
        )
        beyond = row["outside"] and f"; beyond the runs' range of {', '.join(row['outside'])}"
        predicted = _predicted(row["predicted"], *row["interval"])
        lines.append(f"at {mixture}: predicted {predicted}{beyond or ''}")
    return lines


def mixture_json(study: MixtureStudy, how: str, at: Sequence[AtPrediction]) -> dict[str, object]:
    """What --json prints and -o writes: the answer first, then how it was reached."""
    fit, points = study.fit, study.runs
    predicted = fit.predicted
    document: dict[str, object] = {
        "weights": [float(w) for w in fit.weights],
        "predicted": predicted.value,
        "interval": [predicted.low, predicted.high],
        "cv_spearman": fit.score.spearman,
        "cv_rmse": fit.score.rmse,
        "model": fit.model,
        "data_weights": ready_line(fit.weights),
        "sources": [s.name for s in points.sources],
        "paths": [s.path for s in points.sources],
        "target": points.target.spec,
        "target_chosen": how,
        "higher_is_better": fit.data.higher_is_better,
        "models": {
            s.name: {"cv_rmse": s.rmse, "cv_spearman": s.spearman, "error": s.error or None}
            for s in fit.scores
        },
        "folds": fit.folds,
        "seed": fit.seed,
        "searched": fit.searched,
        "radius": fit.radius,
        "runs": [
            {"name": name, "weights": list(w), "target": y, "cv_predicted": p}
            for name, w, y, p in zip(
                points.names, fit.data.weights, fit.data.target, fit.score.predicted, strict=True
            )
        ],
        "left_out": points.left_out,
    }
    if at:
        document["at"] = list(at)
    return document


def _given(value: object) -> bool:
    """Whether an option was given: its default is None, False or [] (and 0 is a value)."""
    return value is not None and value is not False and value != []


def check_flags(args: argparse.Namespace) -> None:
    """--mixture with a scaling-law option, or a mixture option without it, is refused."""
    flags = {**SCALING_ONLY, **MIXTURE_ONLY}
    given = [flag for dest, flag in flags.items() if _given(getattr(args, dest))]
    if args.mixture and (clash := [f for f in given if f in SCALING_ONLY.values()]):
        raise UserError(
            f"{', '.join(clash)}: for the scaling-law fits only; --mixture fits the target "
            f"against the runs' data mixtures (its options: --target, --at)"
        )
    if not args.mixture and (lonely := [f for f in given if f in MIXTURE_ONLY.values()]):
        raise UserError(f"{', '.join(lonely)}: for the mixture fit only; add --mixture")
    clash = [flag for flag in ("--mixture", "--isoflop") if getattr(args, flag[2:])]
    if args.compare and clash:
        raise UserError(
            f"--compare with {', '.join(clash)}: --compare fits each ladder's L = E + A/N^alpha "
            f"+ B/D^beta and reads its compute-optimal frontier from that fit; run "
            f"{' and '.join(clash)} on each sweep apart"
        )


@attrs.frozen
class Outcome:
    """What `llmtrain fit` prints (`lines`, or `document` as JSON), writes (`document`) and
    draws, whichever fit it ran."""

    document: dict[str, object]
    lines: list[str]
    draw: Callable[[Path], None]
    runs: int


def run_mixture(args: argparse.Namespace) -> Outcome:
    from llmtrain.ablate import mixture_report, mixture_runs

    target = None if args.target is None else mixture_runs.parse_target(args.target)
    given = [parse_at(text) for text in args.at]
    runs = find_runs(args.paths)
    check_tokenizers(runs, args.allow_mixed_tokenizers)
    study, how = mixture_runs.study(runs, target, args.seed)
    at = mixture_at(study, given)
    return Outcome(
        mixture_json(study, how, at),
        render_mixture(study, how, at),
        functools.partial(mixture_report.draw, study),
        len(study.runs.names),
    )


def run(args: argparse.Namespace, ctx: Context) -> int:
    check_flags(args)
    if args.plot and Path(args.plot).suffix.lower() not in PLOT_FORMATS:
        raise UserError(f"--plot {args.plot}: use a suffix of {', '.join(PLOT_FORMATS)}")
    if args.mixture:
        outcome = run_mixture(args)
    elif args.compare:
        outcome = run_compare(args)
    else:
        fits = scaling_fits(args)
        draw = functools.partial(draw_fits, fits)
        outcome = Outcome(fits.to_json(), render_fits(fits), draw, len(fits.points))
    document = json.dumps(_plain(outcome.document), indent=2) + "\n"
    print(document if args.json else "\n".join(outcome.lines), end="" if args.json else "\n")
    if args.output:
        path = write_atomically(args.output, document)
        print(f"fits of {outcome.runs} runs -> {path}", file=sys.stderr)
    if args.plot:
        outcome.draw(Path(args.plot))
        print(f"plot -> {args.plot}", file=sys.stderr)
    return 0


def run_compare(args: argparse.Namespace) -> Outcome:
    """`--compare BASELINE VARIANT`: both ladders fitted and compared (fit_compare.py)."""
    from llmtrain.ablate import fit_compare

    fit_compare.check_paths(args.paths)
    if not args.predict:
        raise UserError(
            "--compare needs --predict N=<params>,D=<tokens> or C=<FLOPs>: where to compare the "
            "two fits (e.g. --predict C=1e22: each fit's compute-optimal N and D for 1e22 FLOPs)"
        )
    targets = [parse_target(text) for text in args.predict]
    bootstrap = 200 if args.bootstrap is None else args.bootstrap
    if bootstrap < 1:
        raise UserError(
            f"--bootstrap {bootstrap}: --compare's interval comes from the bootstrap refits; "
            f"give 1 or more (default 200)"
        )
    comparison = fit_compare.compare_ladders(
        args.paths,
        targets,
        loss_key=args.loss or "eval_loss",
        params=args.params or "non_embedding",
        bootstrap=bootstrap,
        seed=args.seed,
        include_unfinished=args.include_unfinished,
        allow_mixed_tokenizers=args.allow_mixed_tokenizers,
    )
    return Outcome(
        comparison.to_json(),
        fit_compare.render(comparison),
        functools.partial(fit_compare.draw, comparison),
        sum(len(ladder.fits.points) for ladder in comparison.ladders),
    )


def scaling_fits(args: argparse.Namespace) -> Fits:
    """The scaling-law fits the flags ask for."""
    bootstrap = 200 if args.bootstrap is None else args.bootstrap
    if bootstrap < 0:
        raise UserError(f"--bootstrap {bootstrap}: give 0 or more refits")
    targets = [parse_target(text) for text in args.predict]
    if any(t.compute is not None for t in targets) and not args.isoflop:
        raise UserError("--predict C=...: the compute-optimal N and D come from --isoflop; add it")
    fits = fit_runs(
        find_runs(args.paths),
        loss_key=args.loss or "eval_loss",
        params=args.params or "non_embedding",
        bootstrap=bootstrap,
        seed=args.seed,
        include_unfinished=args.include_unfinished,
        allow_mixed_tokenizers=args.allow_mixed_tokenizers,
    )
    if args.isoflop:
        fits = with_isoflop(fits)
    return with_predictions(fits, targets)
