"""`llmtrain fit RUN_OR_SWEEP...`: scaling-law fits over runs that vary model size and tokens.

Each finished run is one point: N (summary.json `non_embedding_params`, or `params` with
`--params all`), D (summary.json `tokens`), compute C (`flops_per_token` x D, else 6 N D) and its
loss (the final logged `eval_loss`, or train `loss` with `--loss loss`). The points go to
`fit.fit_parametric` (L = E + A/N^alpha + B/D^beta with bootstrap intervals) and, with
`--isoflop`, to `fit.fit_isoflop` (per-budget optima and N_opt, D_opt ∝ C^a). Prints tables,
writes JSON (`-o`) and a plot (`--plot`, matplotlib imported only then). scipy is imported only
when the command runs, so loading the plugin stays cheap for every other command.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from llmtrain.ablate.files import write_atomically
from llmtrain.ablate.runs import Run, find_runs, is_number
from llmtrain.core_mesh.cli import Context
from llmtrain.core_mesh.errors import UserError

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from llmtrain.ablate.fit import IsoFlopFit, ParametricFit, Prediction

LOSSES = ("eval_loss", "loss")
PARAM_COUNTS = {"non_embedding": "non_embedding_params", "all": "params"}
PLOT_FORMATS = (".png", ".svg", ".pdf")
LEGEND_SIZES = 8  # more model sizes than this get a colour bar instead of legend entries


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


def _listed(names: Sequence[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def check_finished(runs: Sequence[Run], include_unfinished: bool) -> None:
    """A run that has not finished has not reached the N, D it is a point for."""
    unfinished = [f"{run.name} ({run.status})" for run in runs if not run.finished]
    if unfinished and not include_unfinished:
        raise UserError(
            f"runs that did not finish: {_listed(unfinished)}; their losses are not the final "
            f"ones; leave them out, or pass --include-unfinished to fit them as they are"
        )


def tokenizer_of(run: Run) -> str | None:
    """What names the run's tokenizer: the config's `data.tokenizer` (or `tokenizer`) when it
    has one, else the tokenizer recorded in the packed dataset's zarr.json (eval data first,
    then training data; a local path readable from here). None: cannot tell."""
    data = run.config.get("data") or {}
    for given in (data.get("tokenizer"), run.config.get("tokenizer")):
        if given is not None:
            return given if isinstance(given, str) else json.dumps(given, sort_keys=True)
    paths = [(data.get("eval") or {}).get("path")]
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
        groups = "; ".join(f"{tok}: {_listed(names, 4)}" for tok, names in by_tokenizer.items())
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
            f"runs without summary.json: {_listed(no_summary)}; N and D are read from it "
            f"(written when a run ends)"
        )
    summaries = [(run, run.summary) for run in runs if run.summary is not None]  # every run's
    missing = [run.name for run, summary in summaries if not is_number(summary.get(params_key))]
    if missing:
        raise UserError(
            f"summary.json of {_listed(missing)} has no {params_key} (older llmtrain): re-run "
            f"them with this version, which records params, non_embedding_params and "
            f"flops_per_token"
        )
    missing = [run.name for run, summary in summaries if not is_number(summary.get("tokens"))]
    if missing:
        raise UserError(f"summary.json of {_listed(missing)} has no tokens count")
    losses = {run.name: final_value(run, loss_key) for run in runs}
    missing = [name for name, loss in losses.items() if loss is None]
    if missing:
        other = "loss" if loss_key == "eval_loss" else "eval_loss"
        raise UserError(
            f"runs that logged no {loss_key}: {_listed(missing)}; fit them on --loss {other}?"
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
    """JSON-ready: numpy numbers as floats, NaN and inf (no interval) as null."""
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, (str, bool)) or value is None:
        return value
    number = float(value)
    return number if math.isfinite(number) else None


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "paths", nargs="+", metavar="RUN_OR_SWEEP", help="run directories, sweeps or run folders"
    )
    parser.add_argument(
        "--loss",
        choices=LOSSES,
        default="eval_loss",
        help="each run's final logged eval_loss or train loss (default: eval_loss)",
    )
    parser.add_argument(
        "--params",
        choices=tuple(PARAM_COUNTS),
        default="non_embedding",
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
        default=200,
        metavar="K",
        help="bootstrap refits for the 95%% intervals (default 200; 0: none)",
    )
    parser.add_argument("--seed", type=int, default=0, help="the bootstrap's seed (default: 0)")
    parser.add_argument(
        "-o", "--output", default=None, help="write the fits as JSON here (default: none)"
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print the fits as JSON on stdout instead of the tables (default: off)",
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

    def to_json(self) -> dict[str, object]:
        return {
            "loss": self.loss_key,
            "params": self.params,
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
    return lines


def draw_fits(fits: Fits, output: Path) -> None:
    draw(fits.points, fits.parametric, fits.isoflop, fits.targets, output)


def run(args: argparse.Namespace, ctx: Context) -> int:
    if args.bootstrap < 0:
        raise UserError(f"--bootstrap {args.bootstrap}: give 0 or more refits")
    if args.plot and Path(args.plot).suffix.lower() not in PLOT_FORMATS:
        raise UserError(f"--plot {args.plot}: use a suffix of {', '.join(PLOT_FORMATS)}")
    targets = [parse_target(text) for text in args.predict]
    if any(t.compute is not None for t in targets) and not args.isoflop:
        raise UserError("--predict C=...: the compute-optimal N and D come from --isoflop; add it")
    fits = fit_runs(
        find_runs(args.paths),
        loss_key=args.loss,
        params=args.params,
        bootstrap=args.bootstrap,
        seed=args.seed,
        include_unfinished=args.include_unfinished,
        allow_mixed_tokenizers=args.allow_mixed_tokenizers,
    )
    if args.isoflop:
        fits = with_isoflop(fits)
    fits = with_predictions(fits, targets)
    document = json.dumps(_plain(fits.to_json()), indent=2) + "\n"
    print(document if args.json else "\n".join(render_fits(fits)), end="" if args.json else "\n")
    if args.output:
        path = write_atomically(args.output, document)
        print(f"fits of {len(fits.points)} runs -> {path}", file=sys.stderr)
    if args.plot:
        draw_fits(fits, Path(args.plot))
        print(f"plot -> {args.plot}", file=sys.stderr)
    return 0
