"""One sentence per row against the baseline: what `--baseline` concluded, in words.

Each sentence names the row and the baseline, the result compared, the difference with its
confidence interval, the Holm-corrected p-value and the test, the number of seeds on each side,
and the conclusion (better, worse or within seed noise, at alpha). Fewer than `MIN_SEEDS` seeds
on a side make a weak test (with two, the t-interval is 12.7 standard errors wide each way); the
sentence then says so and how many seeds per side would detect a difference of the size seen
with 80% power (`seeds_needed`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import attrs

from llmtrain.ablate.runs import label, short_keys

if TYPE_CHECKING:
    from llmtrain.ablate.baseline import Comparison
    from llmtrain.ablate.compare import Row

MIN_SEEDS = 3  # fewer seeds on a side than this: the sentence warns that the test is weak
POWER = 0.8  # the power `seeds_needed` plans for
MAX_SEEDS = 1000  # `seeds_needed` gives up above this


@attrs.frozen
class Verdict:
    """`row`: the row's index; `text`: the sentence; `significant`: None where untested;
    `weak`: fewer than MIN_SEEDS seeds on a side; `seeds_needed`: per side, for 80% power at
    the difference seen (None where it cannot be said: no difference, no spread, untested)."""

    row: int
    label: str
    text: str
    significant: bool | None
    weak: bool
    n: int
    n_baseline: int
    seeds_needed: int | None = None

    def to_json(self) -> dict[str, object]:
        return attrs.asdict(self)


def seeds_needed(
    values: Sequence[float],
    baseline: Sequence[float],
    *,
    paired: bool,
    alpha: float,
    power: float = POWER,
) -> int | None:
    """The smallest number of seeds per side for which a two-sided t-test at `alpha` finds the
    difference seen (its effect size: the mean difference over the spread) with probability
    `power`: the noncentral t distribution with n - 1 (paired) or 2n - 2 (two samples) degrees
    of freedom. None without a difference or without spread; MAX_SEEDS + 1 for "more than"."""
    from scipy import stats

    if paired:
        gaps = [x - y for x, y in zip(values, baseline, strict=True)]
        if len(gaps) < 2:
            return None
        delta, spread = statistics.fmean(gaps), statistics.stdev(gaps)
    else:
        if len(values) < 2 or len(baseline) < 2:
            return None
        delta = statistics.fmean(values) - statistics.fmean(baseline)
        spread = math.sqrt((statistics.variance(values) + statistics.variance(baseline)) / 2)
    if delta == 0 or spread == 0 or not math.isfinite(delta / spread):
        return None
    effect = abs(delta) / spread
    for n in range(2, MAX_SEEDS + 1):
        df = n - 1 if paired else 2 * n - 2
        shift = effect * math.sqrt(n if paired else n / 2)
        critical = stats.t.ppf(1 - alpha / 2, df)
        # the far tail (a significant result the wrong way) is negligible, and scipy gives
        # NaN for it at one degree of freedom and a large shift
        far = float(stats.nct.cdf(-critical, df, shift))
        reached = float(stats.nct.sf(critical, df, shift)) + (0.0 if math.isnan(far) else far)
        if reached >= power:
            return n
    return MAX_SEEDS + 1


def verdicts(
    keys: Sequence[str],
    rows: Sequence[Row],
    comparison: Comparison,
    fmt: Callable[[float], str],
    values_of: Callable[[int], tuple[list[float], list[float], bool]],
) -> list[Verdict]:
    """A `Verdict` per row but the baseline, in the rows' order. `values_of(i)`: row i's and the
    baseline's values as tested, and whether they were paired."""
    short = short_keys(keys)
    name = comparison.result
    higher = comparison.higher_is_better
    base_row = rows[comparison.baseline]
    base_label = _label(base_row, keys, short)
    tested = sum(d is not None for d in comparison.differences.values())
    level = f"{1 - comparison.alpha:.0%}"
    out = []
    for i, row in enumerate(rows):
        if i == comparison.baseline:
            continue
        mine, theirs, paired = values_of(i)
        n, n_base = len(mine), len(theirs)
        who = _label(row, keys, short)
        diff = comparison.differences.get(i)
        if diff is None:
            text = (
                f"{who} vs {base_label}: {name} untested: {_runs(n)} with a value against the "
                f"baseline's {n_base}; a t-test needs at least 2 seeds on each side "
                f"(run {MIN_SEEDS} or more)."
            )
            out.append(Verdict(i, who, text, None, True, n, n_base))
            continue
        significant = diff.significant(comparison.alpha)
        if not significant:
            outcome = f"within seed noise (not significant at alpha {comparison.alpha:g})"
        else:
            better = (diff.delta > 0) == higher
            outcome = (
                f"{'better' if better else 'worse'}, significant at alpha {comparison.alpha:g}"
            )
        test = "paired t-test" if diff.test == "paired" else "Welch's t-test"
        holm = f", Holm-corrected over {tested} rows" if tested > 1 else ""
        p = diff.p if diff.p_adjusted is None else diff.p_adjusted
        mean, base_mean = statistics.fmean(mine), statistics.fmean(theirs)
        text = (
            f"{who} vs {base_label}: {name} {fmt(mean)} vs {fmt(base_mean)}, difference "
            f"{_signed(fmt, diff.delta)} ({level} CI [{fmt(diff.low)}, {fmt(diff.high)}]; "
            f"p = {p:.3g}, {test}{holm}; n = {n} vs {n_base} seeds): {outcome}."
        )
        weak = min(n, n_base) < MIN_SEEDS
        needed = seeds_needed(mine, theirs, paired=paired, alpha=comparison.alpha / max(tested, 1))
        if weak:
            text += (
                f" Warning: with {min(n, n_base)} seeds on a side this test is weak (the "
                f"interval is wide and only large differences can show);"
                + (
                    f" about {needed} seeds per side would find a difference this size"
                    f" {POWER:.0%} of the time."
                    if needed is not None and needed <= MAX_SEEDS
                    else f" more than {MAX_SEEDS} seeds per side would be needed to find a"
                    " difference this size."
                    if needed is not None
                    else f" run at least {MIN_SEEDS} seeds per side."
                )
            )
        out.append(Verdict(i, who, text, significant, weak, n, n_base, needed))
    return out


def _label(row: Row, keys: Sequence[str], short: dict[str, str]) -> str:
    if not keys:
        return row.runs[0].name
    return label(row.settings, short).replace(" ", ",")


def _runs(n: int) -> str:
    return f"{n} run" if n == 1 else f"{n} runs"


def _signed(fmt: Callable[[float], str], value: float) -> str:
    text = fmt(value)
    return text if text.startswith("-") else "+" + text
