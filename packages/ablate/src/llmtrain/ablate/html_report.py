"""`llmtrain report RUN_OR_SWEEP... -o report.html`: a sweep's verdict on one static page.

The page holds the compare table (means over seeds with their confidence intervals; with
`--baseline`, each row's difference, p-value and Holm-corrected significance mark), the loss
and metric curves, the scaling-law fits and their extrapolation where the runs vary model size
and tokens (`llmtrain fit`'s; a sweep that cannot be fitted says why instead), and each run's
settings and status. It is self-contained: the styles are inline, the figures are PNGs in
data: URLs, and there is no script, so it opens from a file, an e-mail or an artifact store
without a network. matplotlib draws the figures (the `[plot]` extra).
"""

from __future__ import annotations

import argparse
import base64
import datetime
import html
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from llmtrain.ablate import compare, plot
from llmtrain.ablate.files import write_atomically
from llmtrain.ablate.runs import Run, find_runs, shown, varied_keys
from llmtrain.core_mesh.cli import Context
from llmtrain.core_mesh.errors import UserError

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2rem auto; max-width: 1200px; color: #222; }
h1 { font-size: 1.5rem; } h2 { font-size: 1.2rem; margin-top: 2rem; }
table { border-collapse: collapse; font-size: 0.85rem; margin: 0.5rem 0; }
th, td { border: 1px solid #ccc; padding: 0.25rem 0.5rem; text-align: left; white-space: nowrap; }
th { background: #f3f3f3; }
td.significant { background: #e3f4e3; font-weight: 600; }
td.unfinished { color: #b00020; }
img { max-width: 100%; border: 1px solid #eee; }
p.note { color: #555; }
pre { background: #f7f7f7; padding: 0.5rem; overflow-x: auto; font-size: 0.8rem; }
"""


def html_table(
    header: Sequence[str],
    body: Sequence[Sequence[str]],
    *,
    css_id: str,
    cell_class: Callable[[int, str], str] | None = None,
) -> str:
    """A table of escaped texts; `cell_class(column, text)` may name a CSS class per cell."""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    rows = []
    for line in body:
        tds = []
        for column, text in enumerate(line):
            css = cell_class(column, text) if cell_class else ""
            attribute = f' class="{css}"' if css else ""
            tds.append(f"<td{attribute}>{html.escape(text)}</td>")
        rows.append("<tr>" + "".join(tds) + "</tr>")
    return (
        f'<table id="{css_id}"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>'
    )


def png_data_url(draw: Callable[[Path], Any]) -> str:
    """`draw(path)` writes a PNG there; its bytes as a data: URL."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "figure.png"
        draw(path)
        return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode("ascii")


def compare_section(
    runs: Sequence[Run], metrics: Sequence[str], baseline: str | None, on: str | None, alpha: float
) -> str:
    keys, rows = compare.table(runs, metrics=metrics)
    comparison = compare.comparison_of(keys, rows, metrics, baseline, on, alpha)
    header, body = compare.cells(keys, rows, confidence=1 - alpha, comparison=comparison)
    p_column = len(header) - 1 if comparison is not None else -1

    def marked(column: int, text: str) -> str:
        return "significant" if column == p_column and text.endswith(" *") else ""

    intro = f"Rows of seeds show mean ± sample std [the mean's {1 - alpha:.0%} t-interval]."
    if comparison is not None:
        intro += (
            f" Against the baseline row, on {comparison.result}: the difference with its"
            f" interval, and the Holm-adjusted p-value (* below {alpha:g}, ns above)."
        )
    table = html_table(header, body, css_id="compare", cell_class=marked)
    return f"<h2>Compare</h2><p class='note'>{html.escape(intro)}</p>{table}"


def curves_section(runs: Sequence[Run], metrics: Sequence[str], x: str) -> str:
    drawn: list[str] = []

    def draw(path: Path) -> None:
        drawn.extend(plot.plot(runs, path, x=x, metrics=["loss", "eval_loss", *metrics]))

    url = png_data_url(draw)
    alt = "curves of " + ", ".join(drawn)
    return f'<h2>Curves</h2><img id="curves" alt="{html.escape(alt)}" src="{url}">'


def fit_section(runs: Sequence[Run], loss_key: str, predict: Sequence[str] = ()) -> str:
    """The parametric fit of the runs and, where they hold IsoFLOP budgets, the IsoFLOP fit,
    extrapolated to the `predict` targets (`llmtrain fit --predict`'s); or why there is no fit
    (nothing is extrapolated from a failed one)."""
    from llmtrain.ablate import fit_command

    title = "<h2>Scaling-law fits</h2>"
    try:
        fits = fit_command.fit_runs(runs, loss_key=loss_key)
    except UserError as error:
        return f'{title}<p id="no-fit" class="note">No fit: {html.escape(str(error))}</p>'
    note = ""
    try:
        fits = fit_command.with_isoflop(fits)
    except UserError as error:
        reason = html.escape(str(error))
        note = f'<p id="no-isoflop" class="note">No IsoFLOP fit: {reason}</p>'
    targets = [fit_command.parse_target(text) for text in predict]
    if fits.isoflop is None:  # a compute target needs the IsoFLOP optimum
        targets = [t for t in targets if t.compute is None]
    fits = fit_command.with_predictions(fits, targets)
    url = png_data_url(lambda path: fit_command.draw_fits(fits, path))
    text = "\n".join(fit_command.render_fits(fits))
    return (
        f'{title}<pre id="fit">{html.escape(text)}</pre>{note}'
        f'<img id="fit-plot" alt="the fits against the runs" src="{url}">'
    )


def runs_section(runs: Sequence[Run]) -> str:
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

    return "<h2>Runs</h2>" + html_table(header, body, css_id="runs", cell_class=unfinished)


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
) -> str:
    """The page: the compare table, curves, fits (extrapolated to `predict`), the runs."""
    generated = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    finished = sum(run.finished for run in runs)
    sections = [
        compare_section(runs, metrics, baseline, on, alpha),
        curves_section(runs, metrics, x),
        fit_section(runs, loss_key, predict),
        runs_section(runs),
    ]
    return (
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title><style>{STYLE}</style></head><body>"
        f"<h1>{html.escape(title)}</h1>"
        f"<p class='note'>{len(runs)} runs, {finished} finished; generated {generated} by"
        " llmtrain report.</p>" + "".join(sections) + "</body></html>\n"
    )


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "paths", nargs="+", metavar="RUN_OR_SWEEP", help="run directories, sweeps or run folders"
    )
    parser.add_argument("-o", "--output", required=True, help="the HTML file to write")
    parser.add_argument("--title", default=None, help="default: the sweeps' names")
    compare.add_metric_arguments(parser)
    compare.add_baseline_arguments(parser)
    parser.add_argument("--x", choices=("step", "tokens"), default="step")
    parser.add_argument(
        "--loss", default="eval_loss", help="the loss the fits use (eval_loss or loss)"
    )
    parser.add_argument(
        "--predict",
        action="append",
        default=[],
        metavar="TARGET",
        help="extrapolate the fits to N=..,D=.. or C=.. (as llmtrain fit; repeatable)",
    )


def run(args: argparse.Namespace, ctx: Context) -> int:
    if Path(args.output).suffix.lower() not in (".html", ".htm"):
        raise UserError(f"-o {args.output}: the report is HTML; name it report.html")
    if not 0 < args.alpha < 1:
        raise UserError(f"--alpha {args.alpha}: a significance level between 0 and 1, e.g. 0.05")
    from llmtrain.ablate.fit_command import parse_target

    for text in args.predict:
        parse_target(text)  # a bad target is refused before anything is read
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
    )
    path = write_atomically(args.output, page)
    print(f"{len(runs)} runs -> {path}", file=sys.stderr)
    return 0
