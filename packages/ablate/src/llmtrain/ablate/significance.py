"""Is a difference between two rows of `llmtrain compare` more than seed noise?

- `mean_interval`: the t-distribution confidence interval of a mean over seeds.
- `difference`: a row's mean minus the baseline's, its confidence interval and the two-sided
  t-test p-value: paired by seed (`scipy.stats.ttest_rel`) when both rows ran the same seeds
  and data orders, else Welch's unequal-variance test (`scipy.stats.ttest_ind`).
- `holm`: Holm's step-down adjustment of the p-values of the rows tested against one baseline,
  so that "significant at alpha" holds for the family of rows, not for each row alone. SciPy
  has no Holm adjustment; it is four lines: sort the p-values, multiply the i-th smallest of m
  by (m - i), keep the running maximum, cap at 1.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

import attrs


def mean_interval(values: Sequence[float], confidence: float) -> tuple[float, float] | None:
    """The `confidence` interval of the mean of `values` (t with n - 1 degrees of freedom);
    None for fewer than two values."""
    from scipy import stats  # on use: scipy.stats takes a second to import

    if len(values) < 2:
        return None
    mean = statistics.fmean(values)
    sem = statistics.stdev(values) / math.sqrt(len(values))
    if sem == 0:
        return mean, mean
    low, high = stats.t.interval(confidence, len(values) - 1, loc=mean, scale=sem)
    return float(low), float(high)


@attrs.frozen
class Difference:
    """A row's mean minus the baseline's. `test`: "paired" or "welch"; `low`/`high`: the
    difference's confidence interval; `p`: the two-sided p-value (`p_adjusted` after Holm)."""

    delta: float
    low: float
    high: float
    p: float
    test: str
    p_adjusted: float | None = None

    def significant(self, alpha: float) -> bool:
        p = self.p if self.p_adjusted is None else self.p_adjusted
        return p < alpha


def difference(
    values: Sequence[float],
    baseline: Sequence[float],
    confidence: float,
    *,
    paired: bool,
) -> Difference | None:
    """`values` minus `baseline` (paired: the same seeds, in the same order); None where a
    side has fewer than two values (no spread to test against)."""
    from scipy import stats

    if len(values) < 2 or len(baseline) < 2:
        return None
    delta = statistics.fmean(values) - statistics.fmean(baseline)
    if paired:
        result = stats.ttest_rel(values, baseline)
    else:
        result = stats.ttest_ind(values, baseline, equal_var=False)
    if math.isnan(result.pvalue):  # no spread on either side: the difference is exact
        return Difference(delta, delta, delta, 0.0 if delta else 1.0, _name(paired))
    interval = result.confidence_interval(confidence)
    return Difference(
        delta, float(interval.low), float(interval.high), float(result.pvalue), _name(paired)
    )


def _name(paired: bool) -> str:
    return "paired" if paired else "welch"


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm-adjusted p-values, in the order given."""
    m = len(p_values)
    order = sorted(range(m), key=lambda i: p_values[i])
    adjusted = [0.0] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted
