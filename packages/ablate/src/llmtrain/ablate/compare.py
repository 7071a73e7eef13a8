"""`llmtrain compare`: one table of runs (or sweeps): what varies and what came out.

Rows are runs that differ in more than their seed; runs that differ only in `seed` (or
`data.seed`) are one row with mean ± sample std over the seeds. Results come from each run's
`metrics.jsonl` and `summary.json`.
"""

from __future__ import annotations

import argparse
import csv
import io
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from llmtrain.ablate.runs import (
    SEED_KEYS,
    Run,
    find_runs,
    group_by_settings,
    short_keys,
    shown,
    varied_keys,
)
from llmtrain.core_mesh.cli import Context
from llmtrain.core_mesh.errors import UserError


@attrs.frozen
class Result:
    """A result column: its name, how to read it from one run, how to show a value."""

    name: str
    read: Callable[[Run], float | None]
    fmt: Callable[[float], str]


def _eval_losses(run: Run) -> list[float]:
    return [m["eval_loss"] for m in run.metrics if "eval_loss" in m]


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
        return run.summary["tokens"]
    return _last(run, "tokens")


def _wall(run: Run) -> float | None:
    return None if run.summary is None else run.summary.get("wall_time_s")


RESULTS = [
    Result("final_eval_loss", lambda r: (_eval_losses(r) or [None])[-1], lambda v: f"{v:.4f}"),
    Result("best_eval_loss", lambda r: min(_eval_losses(r), default=None), lambda v: f"{v:.4f}"),
    Result("final_loss", lambda r: _last(r, "loss"), lambda v: f"{v:.4f}"),
    Result("tokens", _tokens, lambda v: f"{v:,.0f}"),
    Result("tokens_per_s", lambda r: _steady(r, "tokens_per_s"), lambda v: f"{v:,.0f}"),
    Result("mfu", lambda r: _steady(r, "mfu"), lambda v: f"{100 * v:.1f}%"),
    Result("wall_time_s", _wall, lambda v: f"{v:,.1f}"),
]


@attrs.frozen
class Row:
    settings: dict[str, Any]
    runs: list[Run]
    values: dict[str, list[float]]  # result name -> one value per run that has it

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


def table(runs: Sequence[Run], *, per_run: bool = False) -> tuple[list[str], list[Row]]:
    """(the varied keys, one row per setting: seeds together unless `per_run`)."""
    keys = varied_keys(runs)
    if per_run:
        groups = [({k: run.settings.get(k) for k in keys}, [run]) for run in runs]
    else:
        groups = group_by_settings(runs, keys)
        keys = [k for k in keys if k not in SEED_KEYS]
    rows = []
    for settings, members in groups:
        values: dict[str, list[float]] = {}
        for result in RESULTS:
            got = [result.read(run) for run in members]
            values[result.name] = [float(v) for v in got if v is not None]
        rows.append(Row(settings, members, values))
    return keys, rows


def render(keys: Sequence[str], rows: Sequence[Row], fmt: str, *, sort: str | None = None) -> str:
    results = [r for r in RESULTS if any(row.values[r.name] for row in rows)]
    if sort is not None:
        known = [r.name for r in results]
        if sort not in known:
            raise UserError(f"--sort {sort}: not a result column here; one of {', '.join(known)}")
        rows = sorted(rows, key=lambda row: (row.stats(sort)[0] is None, row.stats(sort)[0] or 0))
    short = short_keys(keys)
    seeds = any(len(row.runs) > 1 for row in rows)
    if fmt == "csv":
        return _csv(keys, short, rows, results)
    header = [*(short[k] for k in keys)] or ["run"]
    header += [*(["runs"] if seeds else []), "status", *(r.name for r in results)]
    body = []
    for row in rows:
        cells = [shown(row.settings[k]) for k in keys] or [row.runs[0].name]
        cells += [*([str(len(row.runs))] if seeds else []), row.status]
        for result in results:
            mean, std = row.stats(result.name)
            if mean is None:
                cells.append("")
            elif std is None or std == 0:
                cells.append(result.fmt(mean))
            else:
                cells.append(f"{result.fmt(mean)} ± {result.fmt(std)}")
        body.append(cells)
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    if fmt == "markdown":
        lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)) + " |"]
        lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
        lines += [
            "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"
            for cells in body
        ]
    else:
        lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip()]
        lines.append("  ".join("-" * w for w in widths))
        lines += [
            "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()
            for cells in body
        ]
    return "\n".join(lines) + "\n"


def _csv(keys: Sequence[str], short: dict[str, str], rows: Sequence[Row], results) -> str:
    """Plain numbers: `<result>` is the mean over seeds, `<result>_std` the sample std."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    header = ["run_dirs", *keys, "runs", "status"]
    for result in results:
        header += [result.name, f"{result.name}_std"]
    writer.writerow(header)
    for row in rows:
        line: list[Any] = [";".join(str(run.path) for run in row.runs)]
        line += [shown(row.settings[k]) for k in keys]
        line += [len(row.runs), row.status]
        for result in results:
            mean, std = row.stats(result.name)
            line += ["" if mean is None else repr(mean), "" if std is None else repr(std)]
        writer.writerow(line)
    return out.getvalue()


FORMATS = {".md": "markdown", ".csv": "csv", ".txt": "table"}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "paths", nargs="+", metavar="RUN_OR_SWEEP", help="run directories, sweeps or run folders"
    )
    parser.add_argument(
        "--format",
        choices=("table", "markdown", "csv"),
        default=None,
        help="default: from -o's suffix (.md, .csv), else a terminal table",
    )
    parser.add_argument("-o", "--output", default=None, help="write to this file")
    parser.add_argument("--sort", default=None, help="sort by a result, e.g. final_eval_loss")
    parser.add_argument(
        "--per-run", action="store_true", help="one row per run (no mean ± std over seeds)"
    )


def run(args: argparse.Namespace, ctx: Context) -> int:
    fmt = args.format
    if fmt is None and args.output:
        suffix = Path(args.output).suffix.lower()
        if suffix not in FORMATS:
            raise UserError(
                f"-o {args.output}: say --format, or use a suffix of {', '.join(FORMATS)}"
            )
        fmt = FORMATS[suffix]
    runs = find_runs(args.paths)
    keys, rows = table(runs, per_run=args.per_run)
    text = render(keys, rows, fmt or "table", sort=args.sort)
    if args.output:
        path = Path(args.output)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
        print(f"{len(runs)} runs in {len(rows)} rows -> {path}", file=sys.stderr)
    else:
        print(text, end="")
    return 0
