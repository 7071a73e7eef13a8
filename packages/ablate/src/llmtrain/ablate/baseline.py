"""`llmtrain compare --baseline`: every other row's difference to one row, on one result.

The baseline is named by its settings (`n_layers=2`, `model.n_layers=2,optimizer.lr=0.001`;
short or full keys, as the table shows them) or by the name of one of its runs. Each other row
gets its mean minus the baseline's, the difference's confidence interval and a t-test p-value
(`significance.difference`: paired by seed where both rows ran the same seeds, else Welch's);
the p-values of all rows are Holm-adjusted together and a difference is significant when its
adjusted p-value is below alpha.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import yaml

from llmtrain.ablate.runs import SEED_KEYS, Run, is_number, short_keys, shown
from llmtrain.ablate.significance import Difference, difference, holm
from llmtrain.core_mesh.errors import UserError

if TYPE_CHECKING:
    from llmtrain.ablate.compare import Result, Row

WEIGHTS = "data.weights="  # a mixture as `llmtrain sweep --grid data.weights=[...]` sets it


@attrs.frozen
class Comparison:
    """The baseline row's index, the result compared, alpha, and per row index its
    `Difference` (None for the baseline and for rows with fewer than two runs with a value)."""

    baseline: int
    result: str
    alpha: float
    differences: dict[int, Difference | None]
    # per row index: (the row's values, the baseline's values, paired), as tested
    values: dict[int, tuple[list[float], list[float], bool]] = attrs.Factory(dict)
    higher_is_better: bool = False  # the result's direction

    def cell(self, index: int, fmt: Callable[[float], str]) -> str:
        if index == self.baseline:
            return "baseline"
        diff = self.differences.get(index)
        if diff is None:
            return "untested (< 2 runs)"
        return f"{fmt(diff.delta)} [{fmt(diff.low)}, {fmt(diff.high)}]"

    def p_cell(self, index: int) -> str:
        diff = self.differences.get(index)
        if diff is None or diff.p_adjusted is None:
            return ""
        mark = "*" if diff.significant(self.alpha) else "ns"
        return f"{diff.p_adjusted:.4g} {mark}"


def find_baseline(keys: Sequence[str], rows: Sequence[Row], spec: str) -> int:
    """The index of the one row `spec` names: the name of one of its runs (a sweep's run ids
    look like settings: `lr=0.001,seed=0`), or `key=value` pairs (comma-separated) that all
    match its settings; `data.weights=[w0,w1,...]` names a mixture as `llmtrain sweep` sets it
    (each dataset's `data.train.<i>.weight`)."""
    found = [i for i, row in enumerate(rows) if any(run.name == spec for run in row.runs)]
    if not found and "=" in spec:
        wanted = _weights(spec, keys) if spec.startswith(WEIGHTS) else _pairs(spec, keys)
        found = [i for i, row in enumerate(rows) if _matches(row.settings, wanted)]
    if len(found) != 1:
        short = short_keys(keys)
        shown_rows = "; ".join(_label(row, keys, short) for row in rows)
        what = "no row matches" if not found else f"{len(found)} rows match"
        raise UserError(f"--baseline {spec}: {what}; the rows: {shown_rows}")
    return found[0]


def _weights(spec: str, keys: Sequence[str]) -> dict[str, str]:
    """`data.weights=[w0,w1,...]` as the settings it sets that vary between the rows."""
    try:
        values = yaml.safe_load(spec.removeprefix(WEIGHTS))
    except yaml.YAMLError:
        values = None
    if not isinstance(values, list) or not all(is_number(v) for v in values):
        raise UserError(f"--baseline {spec}: write the mixture as data.weights=[w0,w1,...]")
    wanted = {f"data.train.{i}.weight": shown(v) for i, v in enumerate(values)}
    return {key: value for key, value in wanted.items() if key in keys}


def _pairs(spec: str, keys: Sequence[str]) -> dict[str, str]:
    short = short_keys(keys)
    by_name = {**{k: k for k in keys}, **{s: k for k, s in short.items()}}
    wanted = {}
    for part in spec.split(","):
        name, _, value = part.partition("=")
        if name.strip() not in by_name:
            raise UserError(
                f"--baseline {spec}: {name.strip()!r} is not a setting that varies; "
                f"one of {', '.join(short[k] for k in keys) or '(none: one row)'}"
            )
        wanted[by_name[name.strip()]] = value.strip()
    return wanted


def _matches(settings: dict[str, object], wanted: dict[str, str]) -> bool:
    return all(_same(settings.get(key), value) for key, value in wanted.items())


def _same(setting: Any, text: str) -> bool:
    if shown(setting) == text:
        return True
    try:
        return float(setting) == float(text)
    except (TypeError, ValueError):
        return False


def _label(row: Row, keys: Sequence[str], short: dict[str, str]) -> str:
    if not keys:
        return row.runs[0].name
    return ",".join(f"{short[k]}={shown(row.settings.get(k))}" for k in keys)


def compare_rows(rows: Sequence[Row], baseline: int, result: Result, alpha: float) -> Comparison:
    """Each row against `rows[baseline]` on `result`, at confidence 1 - alpha, Holm-adjusted."""
    base = rows[baseline]
    differences: dict[int, Difference | None] = {}
    tested_values: dict[int, tuple[list[float], list[float], bool]] = {}
    for i, row in enumerate(rows):
        if i == baseline:
            continue
        paired = _paired_values(row.runs, base.runs, result)
        values = paired or (_values(row.runs, result), _values(base.runs, result))
        differences[i] = difference(*values, 1 - alpha, paired=paired is not None)
        tested_values[i] = (list(values[0]), list(values[1]), paired is not None)
    tested = {i: d for i, d in differences.items() if d is not None}
    adjusted = holm([d.p for d in tested.values()])
    for (i, d), p in zip(tested.items(), adjusted, strict=True):
        differences[i] = attrs.evolve(d, p_adjusted=p)
    return Comparison(
        baseline, result.name, alpha, differences, tested_values, result.higher_is_better
    )


def _values(runs: Sequence[Run], result: Result) -> list[float]:
    return [float(v) for v in (result.read(run) for run in runs) if v is not None]


def _paired_values(
    runs: Sequence[Run], base: Sequence[Run], result: Result
) -> tuple[list[float], list[float]] | None:
    """Both rows' values in the order of their seeds, when both ran the same seeds and data
    orders (each once) and every run has the value; else None (Welch's test then)."""
    mine, theirs = _by_seeds(runs, result), _by_seeds(base, result)
    if mine is None or theirs is None or mine.keys() != theirs.keys():
        return None
    order = sorted(mine, key=repr)
    return [mine[k] for k in order], [theirs[k] for k in order]


def _by_seeds(runs: Sequence[Run], result: Result) -> dict[tuple[object, ...], float] | None:
    values: dict[tuple[object, ...], float] = {}
    for run in runs:
        key = tuple(run.settings.get(k) for k in SEED_KEYS)
        value = result.read(run)
        if value is None or key in values:
            return None
        values[key] = float(value)
    return values
