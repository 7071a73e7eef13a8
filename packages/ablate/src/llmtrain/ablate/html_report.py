"""`llmtrain report RUN_OR_SWEEP... -o report.html`: a sweep's verdict on one static page.

The page, from the jinja2 template `templates/report.html.j2`, opens with its sweep's answer
(`report_kind`): a ladder (its manifest.json has `ladder`, or its runs fit a scaling law and no
baseline was named) with the fit's law, the warnings that say when it cannot be trusted and each
rung's final loss against its compute (ladder_report.py; its runs table says which rung each
run is); a learning rate swept at several widths (µP transfer) with the lr-against-width figure
and whether each panel's best lr stays put; an ablation, a mixture sweep and two ladders
compared across scale with the verdict, as below (the baseline hint only where a baseline is
the question). Long tables and legends follow the answer. An ablation's verdict: with
`--baseline`, one sentence per row (the difference, its interval, the Holm-corrected p-value,
the seeds on each side, a warning where they are too few). Then the compare table in the
narrow default columns of `llmtrain compare` (means over seeds with their confidence
intervals; with `--baseline`, each row's difference and significance mark), every result in a
folded second table, each metric's signal and noise (can it separate the variants at this
scale? the metrics to drop called out; signal_noise.py), the loss and metric curves (a group
of seeds as its mean with a confidence band), where the runs vary a learning rate at several widths the final loss
against it (one curve per width, the best marked: the µP transfer figure), the scaling-law fits and their extrapolation where the runs vary model size
and tokens (`llmtrain fit`'s; a sweep that cannot be fitted says why instead), and each run's
settings and status. On a data-mixture sweep (the same datasets in every run, their weights
differing) the verdict names the mixture `llmtrain fit --mixture` predicts best, and a section
after it shows how the fit got there (mixture_report.py). With `--compare BASELINE VARIANT` the
two ladders are fitted apart and compared across scale instead of fitted together (`llmtrain fit
--compare`'s: fit_compare.py): its sentences open the verdict, and its section, both fits along
their compute-optimal frontiers with their bootstrap bands, takes the place of the fits. Wide
tables scroll inside their own box, so the page never scrolls sideways. It is self-contained: the styles are inline, the
figures are PNGs in data: URLs, and there is no script, so it opens from a file, an e-mail or
an artifact store without a network.
matplotlib draws the figures (the `[plot]` extra).
"""

from __future__ import annotations

import argparse
import base64
import datetime
import sys
import tempfile
from collections.abc import Callable, Sequence
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from llmtrain.ablate import compare, plot
from llmtrain.ablate.files import write_atomically
from llmtrain.ablate.ladder_report import Ladder
from llmtrain.ablate.runs import (
    Run,
    find_runs,
    group_by_settings,
    is_number,
    shown,
    varied_keys,
)
from llmtrain.core_mesh.cli import Context
from llmtrain.core_mesh.errors import UserError

if TYPE_CHECKING:
    from llmtrain.ablate import settings_plot

TEMPLATE = "report.html.j2"  # in llmtrain/ablate/templates/


def render_page(**context: object) -> str:
    """The report template filled in (jinja2, every value escaped)."""
    import jinja2

    source = resources.files("llmtrain.ablate").joinpath("templates", TEMPLATE)
    environment = jinja2.Environment(
        autoescape=True, undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True
    )
    return environment.from_string(source.read_text(encoding="utf-8")).render(**context)


def table_context(
    header: Sequence[str],
    body: Sequence[Sequence[str]],
    *,
    css_id: str,
    cell_class: Callable[[int, str], str] | None = None,
) -> dict[str, object]:
    """A table for the template: `cell_class(column, text)` may name a CSS class per cell."""
    return {
        "id": css_id,
        "header": list(header),
        "body": [
            [
                {"text": text, "css": cell_class(column, text) if cell_class else ""}
                for column, text in enumerate(line)
            ]
            for line in body
        ],
    }


def png_data_url(draw: Callable[[Path], object]) -> str:
    """`draw(path)` writes a PNG there; its bytes as a data: URL."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "figure.png"
        draw(path)
        return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode("ascii")


def compare_context(
    runs: Sequence[Run], metrics: Sequence[str], baseline: str | None, on: str | None, alpha: float
) -> tuple[dict[str, object], list[dict[str, object]]]:
    """(the compare section: the narrow table, every result in a second one, the intro; the
    verdict sentences, empty without a baseline)."""
    keys, rows = compare.table(runs, metrics=metrics)
    comparison = compare.comparison_of(keys, rows, metrics, baseline, on, alpha)
    narrow = compare.columns_of(None, rows, comparison, metrics)
    tables = {}
    for name, columns in (("narrow", narrow), ("wide", None)):
        header, body = compare.cells(
            keys,
            rows,
            confidence=1 - alpha,
            comparison=comparison,
            columns=columns,
            intervals=comparison is None or columns is None,
        )
        p_column = len(header) - 1 if comparison is not None else -1

        def marked(column: int, text: str, p_column: int = p_column) -> str:
            return "significant" if column == p_column and text.endswith(" *") else ""

        css_id = "compare" if name == "narrow" else "compare-all"
        tables[name] = table_context(header, body, css_id=css_id, cell_class=marked)
    intro = (
        f"Rows of seeds show mean ± sample std [the mean's {1 - alpha:.0%} t-interval] for "
        "losses and scores; throughput, tokens and wall time have no interval."
    )
    if comparison is not None:
        intro = (
            f"Rows of seeds show mean ± sample std (the means' {1 - alpha:.0%} t-intervals are "
            f"under every result below). Against the baseline row, on {comparison.result}: the "
            f"difference with its interval, and the Holm-adjusted p-value (* below {alpha:g}, "
            "ns above)."
        )
    verdicts = []
    for verdict in compare.verdicts_of(keys, rows, comparison):
        sentence, _, warning = verdict.text.partition(" Warning: ")
        verdicts.append(
            {
                "sentence": sentence,
                "warning": f"Warning: {warning}" if warning else "",
                "significant": bool(verdict.significant),
                "weak": verdict.weak,
            }
        )
    return {"intro": intro, **tables}, verdicts


def signal_noise_context(runs: Sequence[Run], last: int, alpha: float) -> dict[str, object] | None:
    """The signal-and-noise section (`signal_noise.measure_all`): the table, each metric's
    sentence, the metrics to drop called out, those left out; None when no metric was
    evaluated twice by a run."""
    from llmtrain.ablate import signal_noise

    measured, left_out = signal_noise.measure_all(runs, last=last, alpha=alpha)
    if not measured:
        return None
    header, body = signal_noise.cells(measured)
    verdict_column = len(header) - 1

    def marked(column: int, text: str) -> str:
        if column != verdict_column:
            return ""
        return {"decided": "significant", "drop": "drop"}.get(text, "")

    return {
        "note": f"Each run's score is the mean of its last {last} evaluations (fewer where it "
        "has fewer); checkpoint noise is their pooled spread within runs, seed noise the "
        "spread between seeds beyond it, signal the spread between the variants' scores. A "
        f"metric separates the variants when its signal reaches the {1 - alpha:.0%} normal "
        "quantile times the standard error of a difference.",
        "table": table_context(header, body, css_id="signal-noise", cell_class=marked),
        "sentences": [{"text": r.sentence, "decided": r.decided, "drop": r.drop} for r in measured],
        "drop": [r.metric for r in measured if r.drop],
        "left_out": signal_noise.left_out_line(left_out),
    }


def curves_context(
    runs: Sequence[Run], metrics: Sequence[str], x: str, alpha: float
) -> dict[str, object]:
    """The curves of the train loss and of each metric some run logged at two steps or more (a
    ladder's runs evaluate once, at the end: no one-point "curves")."""
    drawn: list[str] = []

    def curve(metric: str) -> bool:
        return any(sum(metric in m for m in run.metrics) > 1 for run in runs)

    shown_metrics = ["loss", *(m for m in ("eval_loss", *metrics) if curve(m))]

    def draw(path: Path) -> None:
        drawn.extend(plot.plot(runs, path, x=x, metrics=shown_metrics, confidence=1 - alpha))

    url = png_data_url(draw)
    seeds = any(len(members) > 1 for _, members in group_by_settings(runs, varied_keys(runs)))
    note = (
        f"A group of seeds is drawn as its mean with the mean's {1 - alpha:.0%} t-interval as a "
        "band (each seed thin behind it)."
        if seeds
        else ""
    )
    once = [m for m in ("eval_loss", *metrics) if m not in shown_metrics]
    if once and any(m in line for m in once for run in runs for line in run.metrics):
        note += (
            f" Not drawn: {', '.join(once)}, logged once per run (its final value is in the "
            "tables and figures above)."
        )
    return {"url": url, "alt": "curves of " + ", ".join(drawn), "band_note": note.strip()}


WIDTH_KEY = "model.d_model"  # the width a learning-rate sweep is read against


def transfer_context(runs: Sequence[Run], loss_key: str) -> dict[str, object] | None:
    """Where the runs vary a learning rate (a key ending in `lr`, 3 values or more) at several
    widths (`model.d_model`): the final loss against the lr, one curve per width, the best lr
    of each marked (`plot --x optimizer.lr --group model.d_model`'s figure) and the best lr per
    width as text. None otherwise."""
    from llmtrain.ablate import settings_plot

    keys = varied_keys(runs)
    values = {k: {shown(run.settings.get(k)) for run in runs} for k in keys}
    lrs = [k for k in keys if k.rsplit(".", 1)[-1] == "lr" and len(values[k]) >= 3]
    if not lrs or WIDTH_KEY not in keys:
        return None
    if not all(is_number(run.settings.get(lrs[0])) for run in runs):
        return None
    logged = any(loss_key in m for run in runs for m in run.metrics)
    metric = loss_key if logged else "loss"
    found = settings_plot.panels(runs, lrs[0], WIDTH_KEY, [metric])
    url = png_data_url(lambda path: settings_plot.draw(found, path, lrs[0]))
    return {
        "verdict": transfer_verdict(found, lrs[0]),
        "url": url,
        "alt": f"final {metric} against {lrs[0]}, one curve per {WIDTH_KEY}",
        "note": f"Each finished run is one point: its final {metric} against {lrs[0]}, one "
        f"curve per {WIDTH_KEY}, a panel per other setting; the star is each width's best. "
        "Under µP the best learning rate should stay put as the width grows.",
        "text": "\n".join(settings_plot.best_lines(found, lrs[0])),
    }


def transfer_verdict(found: Sequence[settings_plot.Panel], x: str) -> list[str]:
    """One sentence per panel: does the best learning rate stay put as the width grows (within
    one grid step: it transfers), or move (by how many grid steps, from where to where)?"""
    sentences = []
    for panel in found:
        where = f"{runs_label(panel.settings)}: " if panel.settings else ""
        bests = [(c, c.best) for c in panel.curves if c.best is not None]
        spread = panel.best_spread()
        if spread is None:
            sentences.append(f"{where}fewer than two widths finished a run: no transfer to judge.")
            continue
        by_width = "width " + ", ".join(
            f"{shown(c.settings.get(WIDTH_KEY, ''))}: {shown(b.x)}" for c, b in bests
        )
        if spread == 0:
            verdict = f"the best {x} is the same at every width ({by_width}): it transfers"
        elif spread == 1:
            verdict = (
                f"the best {x} moves by one grid step across the widths ({by_width}): it "
                "transfers to within the grid's resolution"
            )
        else:
            verdict = (
                f"the best {x} moves by {spread} grid steps across the widths ({by_width}): it "
                "does not transfer"
            )
        sentences.append(f"{where}{verdict}.")
    return sentences


def runs_label(settings: dict[str, object]) -> str:
    return ", ".join(f"{key.rsplit('.', 1)[-1]}={shown(v)}" for key, v in settings.items())


def fit_context(
    runs: Sequence[Run], loss_key: str, predict: Sequence[str] = ()
) -> dict[str, object]:
    """The parametric fit of the runs and, where they hold IsoFLOP budgets, the IsoFLOP fit,
    extrapolated to the `predict` targets (`llmtrain fit --predict`'s); or why there is no fit
    (nothing is extrapolated from a failed one). `fits`: the fits, for the ladder's lead."""
    from llmtrain.ablate import fit_command

    try:
        fits = fit_command.fit_runs(runs, loss_key=loss_key)
    except UserError as error:
        return {"error": str(error), "fits": None}
    no_isoflop = ""
    try:
        fits = fit_command.with_isoflop(fits)
    except UserError as error:
        no_isoflop = str(error)
    targets = [fit_command.parse_target(text) for text in predict]
    if fits.isoflop is None:  # a compute target needs the IsoFLOP optimum
        targets = [t for t in targets if t.compute is None]
    fits = fit_command.with_predictions(fits, targets)
    url = png_data_url(lambda path: fit_command.draw_fits(fits, path))
    warnings = fits.warnings
    lines = fit_command.render_fits(fits)
    text = "\n".join(line for line in lines if not line.startswith("warning: ")).rstrip()
    return {
        "error": "",
        "text": text,
        "warnings": warnings,
        "no_isoflop": no_isoflop,
        "url": url,
        "fits": fits,
    }


def runs_context(
    runs: Sequence[Run], ladder: Ladder | None = None, loss_key: str = "eval_loss"
) -> dict[str, object]:
    """Each run's settings and status; for a ladder, which rung each run is
    (`ladder_report.rung_table`)."""
    if ladder:
        from llmtrain.ablate.ladder_report import rung_table

        header, body = rung_table(runs, ladder, loss_key)
        status = header.index("status")

        def not_done(column: int, text: str) -> str:
            return "unfinished" if column == status and text != "finished" else ""

        return table_context(header, body, css_id="runs", cell_class=not_done)
    keys = varied_keys(runs)
    header = ["run", "status", *keys, "step", "tokens", "wall time s", "error"]
    body = []
    for run in runs:
        summary = run.summary or {}
        body.append(
            [
                run.name,
                run.status,
                *(shown(run.settings.get(k)) for k in keys),
                str(summary.get("step", run.metrics[-1]["step"] if run.metrics else "")),
                f"{summary['tokens']:,.0f}" if "tokens" in summary else "",
                str(summary.get("wall_time_s", "")),
                str(summary.get("error") or ""),
            ]
        )

    def unfinished(column: int, text: str) -> str:
        return "unfinished" if column == 1 and text != "finished" else ""

    return table_context(header, body, css_id="runs", cell_class=unfinished)


def report_html(
    runs: Sequence[Run],
    *,
    title: str,
    metrics: Sequence[str] = (),
    baseline: str | None = None,
    on: str | None = None,
    alpha: float = 0.05,
    x: str = "step",
    loss_key: str = "eval_loss",
    predict: Sequence[str] = (),
    target: str | None = None,
    last_evals: int = 4,
    compare_ladders: Sequence[str] = (),
) -> str:
    """The page: the verdict sentences (and a mixture sweep's best mixture, for `target`), the
    mixture fit, the compare table, the metrics' signal and noise (each run's last
    `last_evals` evaluations), curves, fits (extrapolated to `predict`), the runs."""
    from llmtrain.ablate.ladder_report import lead_context, read_ladder
    from llmtrain.ablate.mixture_report import mixture_context

    generated = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    compare_part, verdicts = compare_context(runs, metrics, baseline, on, alpha)
    scale_compare: dict[str, object] | None = None
    if compare_ladders:  # BASELINE VARIANT: fitted apart, compared across scale
        from llmtrain.ablate.fit_compare import report_context

        scale_compare, scale_verdicts = report_context(compare_ladders, loss_key, predict)
        verdicts = [*scale_verdicts, *verdicts]
    mixture = mixture_context(runs, target)
    transfer = transfer_context(runs, loss_key)
    fit = fit_context(runs, loss_key, predict) if scale_compare is None else {}
    ladder = read_ladder(runs)
    kind = report_kind(
        ladder=bool(ladder),
        fitted=bool(fit) and not fit.get("error"),
        mixture=mixture is not None,
        transfer=transfer is not None,
        scale_compare=scale_compare is not None,
        baseline=baseline is not None,
    )
    lead = None
    if kind == "ladder":
        from llmtrain.ablate.fit_command import Fits

        fits = fit.get("fits")
        lead = lead_context(runs, loss_key, fits if isinstance(fits, Fits) else None)
    return render_page(
        title=title,
        kind=kind,
        runs=len(runs),
        finished=sum(run.finished for run in runs),
        generated=generated,
        verdicts=verdicts,
        no_verdict="No baseline named: with --baseline ROW (e.g. --baseline lr=0.001) each "
        "other row is tested against it here, in one sentence each.",
        mixture=mixture,
        compare=compare_part,
        signal_noise=signal_noise_context(runs, last_evals, alpha),
        curves=curves_context(runs, metrics, x, alpha),
        transfer=transfer,
        lead=lead,
        fit=fit,
        scale_compare=scale_compare,
        runs_table=runs_context(runs, ladder if ladder else None, loss_key),  # rungs: a ladder
    )


KINDS = ("ablation", "ladder", "transfer", "mixture", "scale-compare")


def report_kind(
    *,
    ladder: bool,
    fitted: bool,
    mixture: bool,
    transfer: bool,
    scale_compare: bool,
    baseline: bool,
) -> str:
    """What the page opens with (`KINDS`): two ladders compared across scale, or a mixture
    sweep's best mixture, in the verdict; a learning rate swept at several widths (µP
    transfer) with the lr-against-width figure and whether the best lr stays put; a ladder (its
    manifest says so, or the runs fit a scaling law and no baseline was named) with its fit and
    loss against compute; anything else (an ablation) with the verdict."""
    if scale_compare:
        return "scale-compare"
    if mixture:
        return "mixture"
    if transfer:
        return "transfer"
    if ladder or (fitted and not baseline):
        return "ladder"
    return "ablation"


def configure(parser: argparse.ArgumentParser) -> None:
    from llmtrain.ablate.fit_command import loss_key

    parser.add_argument(
        "paths", nargs="+", metavar="RUN_OR_SWEEP", help="run directories, sweeps or run folders"
    )
    parser.add_argument(
        "-o",
        "--output",
        required=True,
        metavar="FILE.html",
        help="the HTML file to write (required)",
    )
    parser.add_argument("--title", default=None, help="default: the sweeps' names")
    compare.add_metric_arguments(parser)
    compare.add_baseline_arguments(parser)
    compare.add_last_evals_argument(parser)
    parser.add_argument(
        "--x", choices=("step", "tokens"), default="step", help="the curves' x axis (default: step)"
    )
    parser.add_argument(
        "--loss",
        type=loss_key,
        default="eval_loss",
        help="the loss the fits use: eval_loss, loss or a named eval set's eval/NAME/loss "
        "(default: eval_loss)",
    )
    parser.add_argument(
        "--predict",
        action="append",
        default=[],
        metavar="TARGET",
        help="extrapolate the fits to N=..,D=.. or C=.. (as llmtrain fit; repeatable; "
        "default: none)",
    )
    parser.add_argument(
        "--compare",
        action="store_true",
        help="the two paths are ladders, BASELINE then VARIANT: fit them apart and compare them "
        "across scale (llmtrain fit --compare's section) instead of fitting them together "
        "(default: off)",
    )
    parser.add_argument(
        "--target",
        default=None,
        metavar="METRIC=W,...",
        help="on a data-mixture sweep, the weighted sum of final metrics the mixture fit "
        "optimises, as llmtrain fit --mixture (default: the mean of the eval/<name>/loss "
        "metrics logged, else eval_loss)",
    )


def run(args: argparse.Namespace, ctx: Context) -> int:
    if Path(args.output).suffix.lower() not in (".html", ".htm"):
        raise UserError(f"-o {args.output}: the report is HTML; name it report.html")
    if not 0 < args.alpha < 1:
        raise UserError(f"--alpha {args.alpha}: a significance level between 0 and 1, e.g. 0.05")
    from llmtrain.ablate.fit_command import parse_target
    from llmtrain.ablate.mixture_runs import parse_target as parse_mixture_target

    for text in args.predict:
        parse_target(text)  # a bad target is refused before anything is read
    if args.target is not None:
        parse_mixture_target(args.target)
    if args.compare:
        from llmtrain.ablate.fit_compare import check_paths

        check_paths(args.paths)  # two ladders, not one twice
    from llmtrain.ablate.signal_noise import DEFAULT_LAST

    runs = find_runs(args.paths)
    metrics = compare.metrics_of(args, runs)
    title = args.title or "llmtrain report: " + ", ".join(Path(p).name for p in args.paths)
    page = report_html(
        runs,
        title=title,
        metrics=metrics,
        baseline=args.baseline,
        on=args.on,
        alpha=args.alpha,
        x=args.x,
        loss_key=args.loss,
        predict=args.predict,
        target=args.target,
        last_evals=args.last_evals or DEFAULT_LAST,
        compare_ladders=args.paths if args.compare else (),
    )
    path = write_atomically(args.output, page)
    print(f"{len(runs)} runs -> {path}", file=sys.stderr)
    return 0
