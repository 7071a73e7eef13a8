"""`llmtrain compare`: one table of runs (or sweeps): what varies and what came out.

Rows are runs that differ in more than their seed; runs that differ only in `seed` (or
`data.seed`) are one row with mean ± sample std over the seeds and the mean's confidence
interval (t, 1 - alpha). Results come from each run's `metrics.jsonl` and `summary.json`.
Besides the fixed columns, any logged metric (`--metric`; the loss of every named held-out
set, `eval/<name>/loss`; every `downstream/<task>/<metric>` with `--downstream`) gets a final
and a best column. `--baseline` adds each row's difference to
one row, with its interval and Holm-adjusted p-value (`llmtrain.ablate.baseline`).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from llmtrain.ablate.baseline import Comparison, compare_rows, find_baseline
from llmtrain.ablate.files import write_atomically
from llmtrain.ablate.runs import (
    DOWNSTREAM,
    SEED_KEYS,
    STDERR,
    Run,
    downstream_metrics,
    eval_set_losses,
    find_runs,
    group_by_settings,
    higher_is_better,
    is_number,
    short_keys,
    shown,
    varied_keys,
)
from llmtrain.ablate.significance import mean_interval
from llmtrain.core_mesh.cli import Context
from llmtrain.core_mesh.errors import UserError

if TYPE_CHECKING:
    from llmtrain.ablate.signal_noise import SignalNoise
    from llmtrain.ablate.verdict import Verdict


@attrs.frozen
class Result:
    """A result column: its name, how to read it from one run, how to show a value; where the
    run logged one, the value's standard error; which way `--sort` puts the best first."""

    name: str
    read: Callable[[Run], float | None]
    fmt: Callable[[float], str]
    stderr: Callable[[Run], float | None] | None = None
    higher_is_better: bool = False
    # whether a confidence interval over seeds means something here: yes for losses and
    # scores, no for throughput, tokens or wall time (machine speed, not the model's result)
    interval: bool = True


Point = tuple[float, float | None]  # a logged value and the stderr logged beside it


def _points(run: Run, metric: str) -> list[Point]:
    return [
        (float(m[metric]), m.get(metric + STDERR) if is_number(m.get(metric + STDERR)) else None)
        for m in run.metrics
        if is_number(m.get(metric))
    ]


def _final(run: Run, metric: str) -> Point | None:
    points = _points(run, metric)
    return points[-1] if points else None


def _best(run: Run, metric: str) -> Point | None:
    """The highest value for an accuracy, else the lowest; NaNs (a diverged run) left out."""
    points = [p for p in _points(run, metric) if not math.isnan(p[0])]
    if not points:
        return None
    pick = max if higher_is_better(metric, [run]) else min
    return pick(points, key=lambda p: p[0])


def _number(value: float) -> str:
    return f"{value:.4f}" if abs(value) < 1e6 else f"{value:.4g}"


# logged metrics that measure the machine or the bookkeeping, not what the model learned: no
# confidence interval for them (a t-interval of tokens/s over seeds is not a question anyone asks)
NO_INTERVAL = (
    "tokens",
    "mfu",
    "step_time",
    "wall_time",
    "data_wait",
    "sync_wait",
    "peak_memory",
    "memory",
    "lr",
    "grad_norm",
    "samples",
    "seconds",
)


def has_interval(metric: str) -> bool:
    """Losses, perplexities, accuracies and other scores: True; throughput, MFU, memory, time,
    lr: False."""
    return not metric.rsplit("/", 1)[-1].startswith(NO_INTERVAL)


def metric_results(metric: str, runs: Sequence[Run] = ()) -> list[Result]:
    """`final_<metric>` (its last logged value) and `best_<metric>` (the highest for
    accuracies, the lowest for losses, perplexities, bits per byte: as `runs` recorded it),
    each with the `<metric>_stderr` logged at the same step."""
    higher = higher_is_better(metric, runs)
    interval = has_interval(metric)
    results = []
    for prefix, choose in (("final", _final), ("best", _best)):

        def read(run: Run, choose: Callable[[Run, str], Point | None] = choose) -> float | None:
            point = choose(run, metric)
            return None if point is None else point[0]

        def stderr(run: Run, choose: Callable[[Run, str], Point | None] = choose) -> float | None:
            point = choose(run, metric)
            return None if point is None else point[1]

        results.append(Result(f"{prefix}_{metric}", read, _number, stderr, higher, interval))
    return results


def _last(run: Run, key: str) -> float | None:
    values = [m[key] for m in run.metrics if key in m]
    return values[-1] if values else None


def _steady(run: Run, key: str) -> float | None:
    """The median over logged lines, leaving out the first (start-up, compile)."""
    values = [m[key] for m in run.metrics if key in m]
    if len(values) > 1:
        values = values[1:]
    return statistics.median(values) if values else None


def _tokens(run: Run) -> float | None:
    if run.summary is not None and "tokens" in run.summary:
        tokens: float = run.summary["tokens"]  # summary.json's number of tokens trained on
        return tokens
    return _last(run, "tokens")


def _wall(run: Run) -> float | None:
    return None if run.summary is None else run.summary.get("wall_time_s")


RESULTS = [
    *metric_results("eval_loss"),
    Result("final_loss", lambda r: _last(r, "loss"), lambda v: f"{v:.4f}"),
    Result("tokens", _tokens, lambda v: f"{v:,.0f}", interval=False),
    Result(
        "tokens_per_s",
        lambda r: _steady(r, "tokens_per_s"),
        lambda v: f"{v:,.0f}",
        higher_is_better=True,
        interval=False,
    ),
    Result(
        "mfu",
        lambda r: _steady(r, "mfu"),
        lambda v: f"{100 * v:.1f}%",
        higher_is_better=True,
        interval=False,
    ),
    Result("wall_time_s", _wall, lambda v: f"{v:,.1f}", interval=False),
]


def results_for(metrics: Sequence[str] = (), runs: Sequence[Run] = ()) -> list[Result]:
    """RESULTS, then a final and a best column for each of `metrics` not among them (which
    way each improves: as `runs` recorded it)."""
    results = list(RESULTS)
    for metric in metrics:
        known = {r.name for r in results}
        results += [r for r in metric_results(metric, runs) if r.name not in known]
    return results


@attrs.frozen
class Row:
    settings: dict[str, object]
    runs: list[Run]
    values: dict[str, list[float]]  # result name -> one value per run that has it
    stderrs: dict[str, list[float]] = attrs.Factory(dict)  # the same, for the logged stderrs
    results: tuple[Result, ...] = tuple(RESULTS)  # the columns, in order

    @property
    def status(self) -> str:
        counts: dict[str, int] = {}
        for run in self.runs:
            counts[run.status] = counts.get(run.status, 0) + 1
        if len(counts) == 1 and len(self.runs) == 1:
            return next(iter(counts))
        return ", ".join(f"{n} {status}" for status, n in counts.items())

    def stats(self, name: str) -> tuple[float | None, float | None]:
        values = self.values.get(name, [])
        if not values:
            return None, None
        mean = statistics.fmean(values)
        return mean, statistics.stdev(values) if len(values) > 1 else None

    def interval(self, name: str, confidence: float) -> tuple[float, float] | None:
        """The `confidence` t-interval of the mean over seeds (None for one run)."""
        return mean_interval(self.values.get(name, []), confidence)

    def stderr(self, name: str) -> float | None:
        """The standard error logged beside the result (the mean over the seeds that have it)."""
        values = self.stderrs.get(name, [])
        return statistics.fmean(values) if values else None


def table(
    runs: Sequence[Run], *, per_run: bool = False, metrics: Sequence[str] = ()
) -> tuple[list[str], list[Row]]:
    """(the varied keys, one row per setting: seeds together unless `per_run`). Each of
    `metrics` adds `final_<metric>` and `best_<metric>` columns (`metric_results`)."""
    results = results_for(metrics, runs)
    keys = varied_keys(runs)
    if per_run:
        groups = [({k: run.settings.get(k) for k in keys}, [run]) for run in runs]
    else:
        groups = group_by_settings(runs, keys)
        keys = [k for k in keys if k not in SEED_KEYS]
    rows = []
    for settings, members in groups:
        values: dict[str, list[float]] = {}
        stderrs: dict[str, list[float]] = {}
        for result in results:
            got = [result.read(run) for run in members]
            values[result.name] = [float(v) for v in got if v is not None]
            if result.stderr is not None:
                errors = [result.stderr(run) for run in members]
                stderrs[result.name] = [float(e) for e in errors if e is not None]
        rows.append(Row(settings, members, values, stderrs, tuple(results)))
    return keys, rows


TABLE_WIDTH = 100  # the default columns aim to fit this many characters (a laptop terminal)


def render(
    keys: Sequence[str],
    rows: Sequence[Row],
    fmt: str,
    *,
    sort: str | None = None,
    confidence: float = 0.95,
    comparison: Comparison | None = None,
    columns: Sequence[str] | None = None,
    intervals: bool = True,
    signal_noise: tuple[Sequence[SignalNoise], Sequence[str]] | None = None,
) -> str:
    """`fmt`: table, markdown, csv or json. `sort` a result column: the lowest first, or the
    highest where higher is better (accuracies). `confidence`: of the intervals over seeds.
    `comparison`: the difference columns of `--baseline` (and, in table, markdown and json,
    the verdict sentences). `columns`: the result columns shown (None: all; csv and json
    always hold all). `signal_noise`: (the metrics measured, those left out) of
    `signal_noise.measure_all`: a second table with its sentences (table, markdown; json's
    `signal_noise`)."""
    if fmt == "csv":
        order, results = _order_and_results(rows, sort)
        return _csv(keys, short_keys(keys), rows, order, results, confidence, comparison)
    if fmt == "json":
        return _json(keys, rows, sort, confidence, comparison, signal_noise)
    header, body = cells(
        keys,
        rows,
        sort=sort,
        confidence=confidence,
        comparison=comparison,
        columns=columns,
        intervals=intervals,
    )
    sentences = [v.text for v in verdicts_of(keys, rows, comparison)]
    if fmt == "markdown":
        widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
        lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)) + " |"]
        lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
        lines += [
            "| " + " | ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) + " |"
            for line in body
        ]
        lines += ["", *(f"- {s}" for s in sentences)] if sentences else []
        return "\n".join(lines) + "\n" + _signal_noise_text(signal_noise, markdown=True)
    text = rich_table(header, body)
    if sentences:
        text += "\n" + "\n".join(_wrapped(s) for s in sentences) + "\n"
    return text + _signal_noise_text(signal_noise, markdown=False)


def _signal_noise_text(
    signal_noise: tuple[Sequence[SignalNoise], Sequence[str]] | None, *, markdown: bool
) -> str:
    """The signal-and-noise table, its sentences and the metrics left out ("" when no metric
    was evaluated twice)."""
    from llmtrain.ablate import signal_noise as sn

    if signal_noise is None or not signal_noise[0]:
        return ""
    measured, left_out = signal_noise
    header, body = sn.cells(measured)
    title = "signal and noise: can each metric separate the variants? (last K evaluations)"
    sentences = [r.sentence for r in measured]
    notes = [sn.left_out_line(left_out)] if left_out else []
    if markdown:
        lines = ["", f"**{title}**", "", "| " + " | ".join(header) + " |"]
        lines.append("|" + "|".join("---" for _ in header) + "|")
        lines += ["| " + " | ".join(line) + " |" for line in body]
        lines += ["", *(f"- {s}" for s in [*sentences, *notes])]
        return "\n".join(lines) + "\n"
    text = "\n" + title + "\n" + rich_table(header, body) + "\n"
    return text + "\n".join(_wrapped(s) for s in [*sentences, *notes]) + "\n"


def rich_table(header: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    """A plain-text table drawn by rich: the header, a rule, one line per row (cells never
    wrap; the table is as wide as its cells), no trailing spaces."""
    from rich import box
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    grid = Table(
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
        collapse_padding=True,
        highlight=False,
    )
    for name in header:
        grid.add_column(Text(name), no_wrap=True, overflow="ignore")
    for line in body:
        grid.add_row(*(Text(cell) for cell in line))
    out = io.StringIO()
    console = Console(file=out, width=10_000, color_system=None, force_terminal=False)
    console.print(grid)
    return "\n".join(line.rstrip() for line in out.getvalue().splitlines()) + "\n"


def _wrapped(sentence: str) -> str:
    import textwrap

    return textwrap.fill(sentence, TABLE_WIDTH, subsequent_indent="  ")


def verdicts_of(
    keys: Sequence[str], rows: Sequence[Row], comparison: Comparison | None
) -> list[Verdict]:
    """The verdict sentences of `comparison` (none without one)."""
    from llmtrain.ablate.verdict import verdicts

    if comparison is None:
        return []
    fmt = {r.name: r.fmt for r in rows[0].results}[comparison.result]
    return verdicts(keys, rows, comparison, fmt, lambda i: comparison.values[i])


def cells(
    keys: Sequence[str],
    rows: Sequence[Row],
    *,
    sort: str | None = None,
    confidence: float = 0.95,
    comparison: Comparison | None = None,
    columns: Sequence[str] | None = None,
    intervals: bool = True,
) -> tuple[list[str], list[list[str]]]:
    """(header, one list of cell texts per row, in `sort` order): what the table and markdown
    formats and the HTML report lay out. `columns`: the result columns (None: every one some
    row has). `intervals`: False leaves the means' intervals out (the narrow table with a
    baseline, whose difference column has the interval that matters)."""
    order, results = _order_and_results(rows, sort)
    if columns is not None:
        by_name = {r.name: r for r in results}
        results = [by_name[name] for name in columns if name in by_name]
    seeds = any(len(row.runs) > 1 for row in rows)
    header = [*short_keys(keys).values()] or ["run"]
    header += [*(["runs"] if seeds else []), "status", *(r.name for r in results)]
    if comparison is not None:
        header += ["diff", "p (holm)"]
        fmt_of = {r.name: r.fmt for r in rows[0].results}[comparison.result]
    body = []
    for i in order:
        row = rows[i]
        line = [shown(row.settings[k]) for k in keys] or [row.runs[0].name]
        line += [*([str(len(row.runs))] if seeds else []), row.status]
        line += [_cell(row, result, confidence, intervals) for result in results]
        if comparison is not None:
            line += [comparison.cell(i, fmt_of), comparison.p_cell(i)]
        body.append(line)
    return header, body


def present_results(rows: Sequence[Row]) -> list[str]:
    """The result columns some row has a value for, in order."""
    columns = rows[0].results if rows else RESULTS
    return [r.name for r in columns if any(row.values[r.name] for row in rows)]


def primary_result(
    rows: Sequence[Row], metrics: Sequence[str] = (), on: str | None = None
) -> str | None:
    """The result a table is about: `on`, else `final_<first metric>`, else `final_eval_loss`
    where a run evaluated, else the train loss `final_loss`."""
    if on is not None:
        return on
    present = present_results(rows)
    wanted = [f"final_{metrics[0]}"] if metrics else []
    for name in [*wanted, "final_eval_loss", "final_loss"]:
        if name in present:
            return name
    return present[0] if present else None


def default_columns(
    rows: Sequence[Row], comparison: Comparison | None, metrics: Sequence[str] = ()
) -> list[str]:
    """The narrow default. Without a baseline: the final eval loss (the train loss for runs
    that never evaluated), the final value of each asked-for metric, and tokens/s. With one:
    the result compared, its difference and p-value."""
    present = present_results(rows)
    if comparison is not None:
        return [comparison.result]
    loss = "final_eval_loss" if "final_eval_loss" in present else "final_loss"
    wanted = [loss, *(f"final_{m}" for m in metrics), "tokens_per_s"]
    return [name for name in dict.fromkeys(wanted) if name in present]


def columns_of(
    spec: str | None,
    rows: Sequence[Row],
    comparison: Comparison | None,
    metrics: Sequence[str] = (),
) -> list[str]:
    """`--columns`: None -> the narrow default (`default_columns`); `all` -> every result some
    row has; `a,b,c` -> those (each must be a result column)."""
    if spec is None:
        return default_columns(rows, comparison, metrics)
    present = present_results(rows)
    if spec.strip() == "all":
        return present
    names = [name.strip() for name in spec.split(",") if name.strip()]
    known = [r.name for r in (rows[0].results if rows else RESULTS)]
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        raise UserError(
            f"--columns {spec}: {', '.join(unknown) or 'no column named'} is not a result "
            f"column; one of {', '.join(known)}, or all"
        )
    return names


def _order_and_results(rows: Sequence[Row], sort: str | None) -> tuple[list[int], list[Result]]:
    """The rows' order (by `sort`) and the result columns some row has a value for."""
    columns = rows[0].results if rows else RESULTS
    results = [r for r in columns if any(row.values[r.name] for row in rows)]
    order = list(range(len(rows)))
    if sort is not None:
        by_name = {r.name: r for r in results}
        if sort not in by_name:
            known = ", ".join(by_name)
            raise UserError(f"--sort {sort}: not a result column here; one of {known}")
        sign = -1.0 if by_name[sort].higher_is_better else 1.0

        def key(i: int) -> tuple[bool, float]:
            mean = rows[i].stats(sort)[0]
            return mean is None, sign * (mean or 0)

        order.sort(key=key)
    return order, results


def _cell(row: Row, result: Result, confidence: float, intervals: bool = True) -> str:
    """mean ± std [the mean's interval] over seeds; a value from one run ± the stderr logged
    beside it; blank where no run has it."""
    mean, std = row.stats(result.name)
    if mean is None:
        return ""
    if std is None:
        std = row.stderr(result.name)
    if std is None or std == 0:
        return result.fmt(mean)
    interval = row.interval(result.name, confidence) if result.interval and intervals else None
    shown_interval = (
        "" if interval is None else f" [{result.fmt(interval[0])}, {result.fmt(interval[1])}]"
    )
    return f"{result.fmt(mean)} ± {result.fmt(std)}{shown_interval}"


def _csv(
    keys: Sequence[str],
    short: dict[str, str],
    rows: Sequence[Row],
    order: Sequence[int],
    results: Sequence[Result],
    confidence: float,
    comparison: Comparison | None,
) -> str:
    """Plain numbers: `<result>` is the mean over seeds, `<result>_std` the sample std,
    `<result>_ci_low`/`_ci_high` the mean's interval and, for results with a logged stderr,
    `<result>_stderr` (its mean over the seeds). With a comparison: `diff`, `diff_low`,
    `diff_high`, `p`, `p_holm`, `test` (paired or welch) and `significant`."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    header = ["run_dirs", *keys, "runs", "status"]
    for result in results:
        header += [result.name, f"{result.name}_std", f"{result.name}_ci_low"]
        header.append(f"{result.name}_ci_high")
        if result.stderr is not None:
            header.append(f"{result.name}{STDERR}")
    if comparison is not None:
        header += ["diff", "diff_low", "diff_high", "p", "p_holm", "test", "significant"]
    writer.writerow(header)
    for i in order:
        row = rows[i]
        line: list[object] = [";".join(str(run.path) for run in row.runs)]
        line += [shown(row.settings[k]) for k in keys]
        line += [len(row.runs), row.status]
        for result in results:
            mean, std = row.stats(result.name)
            interval = (row.interval(result.name, confidence) if result.interval else None) or (
                "",
                "",
            )
            line += [_plain(mean), _plain(std), *(_plain(v) for v in interval)]
            if result.stderr is not None:
                line.append(_plain(row.stderr(result.name)))
        if comparison is not None:
            line += _comparison_fields(comparison, i)
        writer.writerow(line)
    return out.getvalue()


def _json(
    keys: Sequence[str],
    rows: Sequence[Row],
    sort: str | None,
    confidence: float,
    comparison: Comparison | None,
    signal_noise: tuple[Sequence[SignalNoise], Sequence[str]] | None = None,
) -> str:
    """Every number of the table as JSON: per row (in `sort` order) its settings, runs and, per
    result, mean, sample std, the number of runs with a value, the mean's interval (results
    that have one) and the mean logged stderr; with a comparison, each row's difference and the
    verdict sentences; `signal_noise` (each metric's `SignalNoise.to_json()`) and
    `signal_noise_left_out` (the metrics no run evaluated twice)."""
    order, results = _order_and_results(rows, sort)
    short = short_keys(keys)
    out_rows = []
    for i in order:
        row = rows[i]
        numbers = {}
        for result in results:
            mean, std = row.stats(result.name)
            if mean is None:
                continue
            interval = row.interval(result.name, confidence) if result.interval else None
            numbers[result.name] = {
                "mean": mean,
                "std": std,
                "n": len(row.values[result.name]),
                "ci_low": None if interval is None else interval[0],
                "ci_high": None if interval is None else interval[1],
                "stderr": row.stderr(result.name),
            }
        entry: dict[str, object] = {
            "settings": {short[k]: row.settings[k] for k in keys},
            "runs": [run.name for run in row.runs],
            "run_dirs": [str(run.path) for run in row.runs],
            "status": row.status,
            "results": numbers,
        }
        if comparison is not None:
            entry["comparison"] = _comparison_json(comparison, i)
        out_rows.append(entry)
    document: dict[str, Any] = {
        "keys": list(keys),
        "confidence": confidence,
        "rows": out_rows,
        "baseline": None,
        "verdicts": [],
        "signal_noise": [r.to_json() for r in signal_noise[0]] if signal_noise else [],
        "signal_noise_left_out": list(signal_noise[1]) if signal_noise else [],
    }
    if comparison is not None:
        document["baseline"] = {
            "row": order.index(comparison.baseline),
            "result": comparison.result,
            "alpha": comparison.alpha,
        }
        document["verdicts"] = [v.to_json() for v in verdicts_of(keys, rows, comparison)]
        for verdict in document["verdicts"]:
            verdict["row"] = order.index(verdict["row"])
    return json.dumps(_finite(document), indent=1, allow_nan=False) + "\n"


def _finite(value: object) -> object:
    """NaN and infinities (a diverged run) as null: JSON has no NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _comparison_json(comparison: Comparison, index: int) -> dict[str, object]:
    if index == comparison.baseline:
        return {"test": "baseline"}
    diff = comparison.differences.get(index)
    if diff is None:
        return {"test": "untested"}
    return {
        "diff": diff.delta,
        "diff_low": diff.low,
        "diff_high": diff.high,
        "p": diff.p,
        "p_holm": diff.p_adjusted,
        "test": diff.test,
        "significant": diff.significant(comparison.alpha),
    }


def _plain(value: float | str | None) -> str:
    return "" if value is None or value == "" else repr(value)


def _comparison_fields(comparison: Comparison, index: int) -> list[str]:
    if index == comparison.baseline:
        return ["", "", "", "", "", "baseline", ""]
    diff = comparison.differences.get(index)
    if diff is None:
        return ["", "", "", "", "", "untested", ""]
    numbers = (diff.delta, diff.low, diff.high, diff.p, diff.p_adjusted)
    return [*(_plain(v) for v in numbers), diff.test, str(diff.significant(comparison.alpha))]


FORMATS = {".md": "markdown", ".csv": "csv", ".txt": "table", ".json": "json"}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "paths", nargs="+", metavar="RUN_OR_SWEEP", help="run directories, sweeps or run folders"
    )
    parser.add_argument(
        "-o",
        "--output",
        default=None,
        metavar="FILE",
        help="write to this file, its format by its suffix: .txt (the table), .md (markdown), "
        ".csv (plain numbers), .json (default: print the table on stdout)",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print JSON instead of text (the table); with -o, write it (default: off)",
    )
    # 0.1's `--format table|markdown|csv`: hidden, one deprecation line (-o's suffix says it)
    parser.add_argument(
        "--format",
        choices=("table", "markdown", "csv"),
        default=None,
        action=DeprecatedFormat,
        help=argparse.SUPPRESS,
    )
    parser.add_argument(
        "--columns",
        default=None,
        metavar="NAMES",
        help="the result columns, comma-separated (e.g. final_eval_loss,final_loss,"
        "tokens_per_s,wall_time_s), or all (default: the final eval loss, each --metric's final "
        "value and tokens_per_s; with --baseline the result compared and the difference)",
    )
    parser.add_argument(
        "--sort",
        default=None,
        help="sort by a result, e.g. final_eval_loss or best_downstream/hellaswag/acc_norm "
        "(the best first: lowest loss, highest accuracy; default: the runs' order)",
    )
    parser.add_argument(
        "--per-run",
        action="store_true",
        help="one row per run, no mean ± std over seeds (default: seeds together)",
    )
    add_metric_arguments(parser)
    add_baseline_arguments(parser)
    add_last_evals_argument(parser)


def add_last_evals_argument(parser: argparse.ArgumentParser) -> None:
    """--last-evals (compare's, and the report's): the evaluations the signal-and-noise table
    averages per run (None: `signal_noise.DEFAULT_LAST`)."""
    from llmtrain.core_mesh.cli_conventions import positive_int

    parser.add_argument(
        "--last-evals",
        type=positive_int,
        default=None,
        metavar="K",
        help="signal and noise: average each run's last K evaluations of every downstream "
        "metric and held-out loss, their spread the checkpoint noise; given, compare's table "
        "shows the section for the held-out losses alone too (default: 4)",
    )


class DeprecatedFormat(argparse.Action):
    """`--format FMT`, 0.1's spelling: stores FMT after one line on stderr naming the new one."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[object] | None,
        option_string: str | None = None,
    ) -> None:
        from llmtrain.core_mesh.cli_conventions import warn_deprecated

        assert isinstance(values, str)  # the option takes one argument (no nargs)
        new = {"csv": "-o FILE.csv", "markdown": "-o FILE.md", "table": "no option"}[values]
        warn_deprecated(
            f"{parser.prog}: {option_string} {values} is deprecated; use {new}, or --json"
        )
        setattr(namespace, self.dest, values)


def add_metric_arguments(parser: argparse.ArgumentParser) -> None:
    """--metric and --downstream (compare's, and the report's)."""
    parser.add_argument(
        "--metric",
        action="append",
        default=[],
        metavar="NAME",
        help="a final_NAME and a best_NAME column for this logged metric, e.g. "
        "downstream/hellaswag/acc_norm (repeatable; default: none)",
    )
    parser.add_argument(
        "--downstream",
        action="store_true",
        help="final and best columns for every downstream/<task>/<metric> the runs logged or "
        "llmtrain eval-tasks wrote (default: off)",
    )


def add_baseline_arguments(parser: argparse.ArgumentParser) -> None:
    """--baseline, --on and --alpha (compare's, and the report's)."""
    parser.add_argument(
        "--baseline",
        default=None,
        metavar="ROW",
        help="compare every other row to this one: its settings (n_layers=2 or "
        "model.n_layers=2,optimizer.lr=0.001) or one of its runs' names (default: none)",
    )
    parser.add_argument(
        "--on",
        default=None,
        metavar="RESULT",
        help="the result --baseline compares (default: final_<first --metric>, else "
        "final_eval_loss, else the train loss final_loss)",
    )
    parser.add_argument(
        "--alpha",
        type=float,
        default=0.05,
        help="significance level, Holm-corrected across rows; intervals are 1 - alpha "
        "(default 0.05: 95%%)",
    )


def run(args: argparse.Namespace, ctx: Context) -> int:
    fmt = "json" if args.json else args.format
    if args.json and args.format is not None:
        raise UserError(f"--json and --format {args.format}: choose one")
    if fmt is None and args.output:
        suffix = Path(args.output).suffix.lower()
        if suffix not in FORMATS:
            raise UserError(
                f"-o {args.output}: the format comes from the suffix: one of "
                f"{', '.join(FORMATS)} (or --json)"
            )
        fmt = FORMATS[suffix]
    if not 0 < args.alpha < 1:
        raise UserError(f"--alpha {args.alpha}: a significance level between 0 and 1, e.g. 0.05")
    runs = find_runs(args.paths)
    metrics = metrics_of(args, runs)
    keys, rows = table(runs, per_run=args.per_run, metrics=metrics)
    if args.baseline is not None and args.per_run:
        raise UserError("--baseline compares rows of seeds: leave out --per-run")
    comparison = comparison_of(keys, rows, metrics, args.baseline, args.on, args.alpha)
    columns = columns_of(args.columns, rows, comparison, metrics)
    from llmtrain.ablate.signal_noise import DEFAULT_LAST, measure_all

    measured = measure_all(runs, last=args.last_evals or DEFAULT_LAST, alpha=args.alpha)
    # the printed section: where a benchmark was evaluated twice by a run, or asked for
    # (held-out losses alone are seldom in doubt; --json always holds it)
    shown_measured = measured
    if args.last_evals is None and not any(r.metric.startswith(DOWNSTREAM) for r in measured[0]):
        shown_measured = ([], measured[1])
    text = render(
        keys,
        rows,
        fmt or "table",
        sort=args.sort,
        confidence=1 - args.alpha,
        comparison=comparison,
        columns=columns,
        # the narrow table with a baseline: the difference's interval answers the question,
        # the means' would push it past 100 characters
        intervals=comparison is None or args.columns is not None,
        signal_noise=measured if fmt == "json" else shown_measured,
    )
    if args.output:
        path = write_atomically(args.output, text)
        print(f"{len(runs)} runs in {len(rows)} rows -> {path}", file=sys.stderr)
    else:
        print(text, end="")
    return 0


def comparison_of(
    keys: Sequence[str],
    rows: Sequence[Row],
    metrics: Sequence[str],
    baseline: str | None,
    on: str | None,
    alpha: float,
) -> Comparison | None:
    """`--baseline`'s comparison (None without one) on `on`: by default `final_<first
    metric>`, else `final_eval_loss`, else (runs without evaluation) `final_loss`."""
    if baseline is None:
        if on is not None:
            raise UserError(f"--on {on}: goes with --baseline")
        return None
    name = primary_result(rows, metrics, on)
    by_name = {r.name: r for r in rows[0].results if any(row.values[r.name] for row in rows)}
    if name not in by_name:
        raise UserError(f"--on {name}: not a result column here; one of {', '.join(by_name)}")
    return compare_rows(rows, find_baseline(keys, rows, baseline), by_name[name], alpha)


def metrics_of(args: argparse.Namespace, runs: Sequence[Run]) -> list[str]:
    """The metrics named by --metric (each logged by some run), then the loss of every named
    held-out set logged (`eval/<name>/loss`) and, with --downstream, every downstream metric
    logged."""
    for metric in args.metric:
        if metric.endswith(STDERR):
            raise UserError(
                f"--metric {metric}: a stderr is shown beside its metric; "
                f"use --metric {metric.removesuffix(STDERR)}"
            )
        if not any(metric in m for run in runs for m in run.metrics):
            logged = downstream_metrics(runs)
            hint = f"; downstream metrics logged: {', '.join(logged)}" if logged else ""
            raise UserError(f"--metric {metric}: none of the {len(runs)} runs logged it{hint}")
    found = downstream_metrics(runs) if args.downstream else []
    if args.downstream and not found:
        print("--downstream: none of the runs logged a downstream/ metric yet", file=sys.stderr)
    return list(dict.fromkeys([*args.metric, *eval_set_losses(runs), *found]))
