"""Can a benchmark separate the variants of a sweep at this scale? Its signal against its noise.

After "Signal and Noise" (Heineman et al. 2025, arXiv 2508.13144): a benchmark decides a
small-scale ablation only if the spread between the variants exceeds its own noise. For each
metric (every downstream task's metrics, every held-out loss), over the runs grouped into
variants as `llmtrain compare` groups them (runs that differ only in their seed are one
variant), with K the number of last evaluations used (`--last-evals`):

- x_{r,k}: run r's metric at its last K_r = min(K, evaluations) evaluated steps; the run's
  score m_r = mean_k x_{r,k} (the averaged-checkpoint score);
- checkpoint noise sigma_ckpt = sqrt(sum_r sum_k (x_{r,k} - m_r)^2 / sum_r (K_r - 1)) (the
  pooled within-run sample std; runs with one evaluation add nothing);
- variant score m_v = mean of m_r over its runs; where a variant has two runs or more,
  s_b^2 = sum_v sum_{r in v} (m_r - m_v)^2 / sum_v (n_v - 1) and seed noise
  sigma_seed = sqrt(max(0, s_b^2 - sigma_ckpt^2 / K_h)), K_h the harmonic mean of the K_r (one-way
  variance components); with one run per variant it is unmeasured and taken as 0;
- signal S = max_v m_v - min_v m_v; SNR = S / sigma_ckpt; one measurement's noise
  sigma = sqrt(sigma_seed^2 + sigma_ckpt^2);
- the standard error of the difference of two variants at n seeds and K averaged checkpoints
  each: se(n, K) = sqrt(2 (sigma_seed^2 / n + sigma_ckpt^2 / (n K)));
- decided when S > 0 and S >= z se(n, K_h), n the fewest runs of any variant, z = the normal
  quantile Phi^-1(1 - alpha / 2) (1.96 at alpha 0.05); else the fewest averaged last
  checkpoints K' <= 64 that would decide, else the fewest seeds per variant n' <= 64 (at K_h),
  else: cannot separate at this scale.

A metric that no run evaluated twice has no checkpoint noise and is left out (`left_out`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import numpy as np

from llmtrain.ablate.runs import (
    Run,
    downstream_metrics,
    eval_set_losses,
    group_by_settings,
    is_number,
    label,
    short_keys,
    varied_keys,
)

DEFAULT_LAST = 4  # evaluations averaged per run (`--last-evals`)
MAX_SUGGESTED = 64  # the largest K' or n' a sentence suggests


@attrs.frozen
class Variant:
    """One variant of a metric: its label, the runs' names, each run's last values (x_{r,k})
    and score (m_r), and the variant's score m_v."""

    label: str
    runs: tuple[str, ...]
    values: tuple[tuple[float, ...], ...]
    scores: tuple[float, ...]
    score: float


@attrs.frozen
class SignalNoise:
    """A metric's signal and noise over the variants of a sweep (module docstring)."""

    metric: str
    k: float  # K_h: the harmonic mean of the runs' K_r
    k_min: int
    k_max: int
    n: int  # the fewest runs of any variant
    variants: tuple[Variant, ...]
    signal: float | None  # None: fewer than two variants
    checkpoint_noise: float
    seed_noise: float  # 0 where unmeasured
    seed_noise_measured: bool
    noise: float
    snr: float | None  # None: one variant, or 0 / 0; inf: a spread without checkpoint noise
    z: float
    se: float  # se(n, K_h)
    decided: bool
    decided_final_only: bool  # whether se(n, 1) (the final checkpoint alone) would decide
    k_needed: int | None  # the fewest averaged checkpoints that would decide (undecided only)
    seeds_needed: int | None  # the fewest seeds per variant that would (undecided, no K')
    sentence: str

    @property
    def drop(self) -> bool:
        """Whether the metric cannot separate the variants at this scale (drop it)."""
        return (
            self.signal is not None
            and not self.decided
            and self.k_needed is None
            and self.seeds_needed is None
        )

    @property
    def verdict(self) -> str:
        """A short word for the table: decided, K=<K'>, n=<n'>, drop, or one variant."""
        if self.signal is None:
            return "one variant"
        if self.decided:
            return "decided"
        bound = "≥" if not self.seed_noise_measured else ""
        if self.k_needed is not None:
            return f"K={bound}{self.k_needed}"
        if self.seeds_needed is not None:
            return f"n={bound}{self.seeds_needed}"
        return "drop"

    def to_json(self) -> dict[str, object]:
        return {
            "metric": self.metric,
            "k": self.k,
            "k_min": self.k_min,
            "k_max": self.k_max,
            "n": self.n,
            "variants": [
                {
                    "label": v.label,
                    "runs": list(v.runs),
                    "values": [list(x) for x in v.values],
                    "run_scores": list(v.scores),
                    "score": v.score,
                }
                for v in self.variants
            ],
            "signal": self.signal,
            "checkpoint_noise": self.checkpoint_noise,
            "seed_noise": self.seed_noise if self.seed_noise_measured else None,
            "seed_noise_measured": self.seed_noise_measured,
            "noise": self.noise,
            "snr": self.snr,
            "z": self.z,
            "se": self.se,
            "threshold": self.z * self.se,
            "decided": self.decided,
            "decided_final_only": self.decided_final_only,
            "k_needed": self.k_needed,
            "seeds_needed": self.seeds_needed,
            "drop": self.drop,
            "verdict": self.verdict,
            "sentence": self.sentence,
        }


def last_values(run: Run, metric: str, last: int) -> list[float]:
    """The run's finite values of `metric` at its last `last` evaluated steps, in step order
    (a step logged twice, as by a resumed run: its last value)."""
    by_step: dict[float, float] = {}
    for line in run.metrics:
        value = line.get(metric)
        if is_number(value) and is_number(line.get("step")) and math.isfinite(value):
            by_step[line["step"]] = float(value)
    return [by_step[step] for step in sorted(by_step)[-last:]]


def metrics_of(runs: Sequence[Run]) -> list[str]:
    """The metrics measured: every held-out loss (`eval_loss`, `eval/<name>/loss`, the EMA
    weights' `eval/ema/...` among them), then every downstream task's metrics (a task scored
    on EMA weights, `<task>@ema`, is a task of its own)."""
    losses = ["eval_loss"] if any("eval_loss" in m for run in runs for m in run.metrics) else []
    return [*losses, *eval_set_losses(runs), *downstream_metrics(runs)]


def standard_error(seed_noise: float, checkpoint_noise: float, n: float, k: float) -> float:
    """se(n, K) = sqrt(2 (sigma_seed^2 / n + sigma_ckpt^2 / (n K))): the standard error of the
    difference of two variants' scores, each the mean of n seeds of K averaged checkpoints."""
    return math.sqrt(2 * (seed_noise**2 / n + checkpoint_noise**2 / (n * k)))


def measure(
    runs: Sequence[Run], metric: str, *, last: int = DEFAULT_LAST, alpha: float = 0.05
) -> SignalNoise | None:
    """`metric`'s signal and noise over the variants of `runs` (None: no run evaluated it
    twice, so no checkpoint noise)."""
    from scipy.stats import norm  # on use: scipy.stats takes a second to import

    keys = varied_keys(runs)
    short = short_keys(keys)
    variants = []
    for settings, members in group_by_settings(runs, keys):
        per_run = [(run.name, last_values(run, metric, last)) for run in members]
        per_run = [(name, x) for name, x in per_run if x]
        if not per_run:
            continue
        scores = tuple(float(np.mean(x)) for _, x in per_run)
        variants.append(
            Variant(
                label(settings, short),
                tuple(name for name, _ in per_run),
                tuple(tuple(x) for _, x in per_run),
                scores,
                float(np.mean(scores)),
            )
        )
    counts = [len(x) for v in variants for x in v.values]
    within_df = sum(c - 1 for c in counts)
    if within_df == 0:
        return None
    within = sum(
        float(np.sum((np.asarray(x) - m) ** 2))
        for v in variants
        for x, m in zip(v.values, v.scores, strict=True)
    )
    checkpoint_noise = math.sqrt(within / within_df)
    k = len(counts) / sum(1 / c for c in counts)  # K_h
    between_df = sum(len(v.scores) - 1 for v in variants)
    seed_noise = 0.0
    if between_df > 0:
        between = sum(float(np.sum((np.asarray(v.scores) - v.score) ** 2)) for v in variants)
        seed_noise = math.sqrt(max(0.0, between / between_df - checkpoint_noise**2 / k))
    n = min(len(v.scores) for v in variants)
    z = float(norm.ppf(1 - alpha / 2))
    se = standard_error(seed_noise, checkpoint_noise, n, k)
    signal = None
    if len(variants) > 1:
        signal = max(v.score for v in variants) - min(v.score for v in variants)

    def decides(se: float) -> bool:
        return signal is not None and signal > 0 and signal >= z * se

    decided = decides(se)
    k_needed = seeds_needed = None
    if signal is not None and not decided:
        k_needed = next(
            (
                kk
                for kk in range(math.ceil(k), MAX_SUGGESTED + 1)
                if kk > k and decides(standard_error(seed_noise, checkpoint_noise, n, kk))
            ),
            None,
        )
        if k_needed is None:
            seeds_needed = next(
                (
                    nn
                    for nn in range(n + 1, MAX_SUGGESTED + 1)
                    if decides(standard_error(seed_noise, checkpoint_noise, nn, k))
                ),
                None,
            )
    snr = None  # one variant, or no spread and no noise (0 / 0)
    if signal is not None and (checkpoint_noise > 0 or signal > 0):
        snr = signal / checkpoint_noise if checkpoint_noise > 0 else math.inf
    result = SignalNoise(
        metric=metric,
        k=k,
        k_min=min(counts),
        k_max=max(counts),
        n=n,
        variants=tuple(variants),
        signal=signal,
        checkpoint_noise=checkpoint_noise,
        seed_noise=seed_noise,
        seed_noise_measured=between_df > 0,
        noise=math.sqrt(seed_noise**2 + checkpoint_noise**2),
        snr=snr,
        z=z,
        se=se,
        decided=decided,
        decided_final_only=decides(standard_error(seed_noise, checkpoint_noise, n, 1)),
        k_needed=k_needed,
        seeds_needed=seeds_needed,
        sentence="",
    )
    return attrs.evolve(result, sentence=sentence_of(result, alpha))


def measure_all(
    runs: Sequence[Run],
    metrics: Sequence[str] | None = None,
    *,
    last: int = DEFAULT_LAST,
    alpha: float = 0.05,
) -> tuple[list[SignalNoise], list[str]]:
    """(the measured metrics, the metrics left out: no run evaluated them twice). `metrics`:
    default `metrics_of(runs)`."""
    measured, left_out = [], []
    for metric in metrics_of(runs) if metrics is None else metrics:
        found = measure(runs, metric, last=last, alpha=alpha)
        if found is None:
            left_out.append(metric)
        else:
            measured.append(found)
    return measured, left_out


def _k_text(result: SignalNoise) -> str:
    if result.k_min == result.k_max:
        return str(result.k_min)
    return f"{result.k_min}-{result.k_max}"


def _number(value: float) -> str:
    return f"{value:.4f}" if abs(value) < 1e4 else f"{value:.4g}"


def sentence_of(result: SignalNoise, alpha: float) -> str:
    """The plain sentence: does the metric separate the variants, and if not what would."""
    level = f"{1 - alpha:.0%}"
    seeds = f"{result.n} seed{'s' if result.n != 1 else ''}"
    averaged = f"the last {_k_text(result)} evaluations averaged"
    unmeasured = (
        ""
        if result.seed_noise_measured
        else " Seed noise is unmeasured (one run per variant), taken as 0: "
        + ("the true noise may be larger." if result.decided else "this figure is a lower bound.")
    )
    if result.signal is None:
        return (
            f"{result.metric}: one variant, nothing to separate (checkpoint noise "
            f"{_number(result.checkpoint_noise)})."
        )
    threshold = result.z * result.se
    head = (
        f"{result.metric}: signal {_number(result.signal)} against {result.z:.2f} x se = "
        f"{_number(threshold)} ({seeds}, {averaged})"
    )
    if result.decided:
        final = (
            "" if result.decided_final_only else "; from the final evaluation alone it would not"
        )
        return f"{head}: separates the variants at {level}{final}.{unmeasured}"
    if result.k_needed is not None:
        return (
            f"{head}: undecided; averaging the last {result.k_needed} evaluations of each run "
            f"would separate them (eval-tasks --last {result.k_needed}).{unmeasured}"
        )
    if result.seeds_needed is not None:
        return (
            f"{head}: undecided; averaging more evaluations is not enough, "
            f"{result.seeds_needed} seeds per variant would separate them.{unmeasured}"
        )
    same = " every variant scores the same:" if result.signal == 0 else ""
    return (
        f"{head}:{same} cannot separate the variants at this scale: drop it or evaluate at a "
        f"larger scale.{unmeasured}"
    )


HEADER = ["metric", "K", "signal", "ckpt noise", "seed noise", "SNR", "verdict"]


def cells(results: Sequence[SignalNoise]) -> tuple[list[str], list[list[str]]]:
    """(header, one line of cell texts per metric): what the terminal table and the report lay
    out."""
    body = []
    for result in results:
        snr = "" if result.snr is None else f"{result.snr:.2f}"
        body.append(
            [
                result.metric,
                _k_text(result),
                "" if result.signal is None else _number(result.signal),
                _number(result.checkpoint_noise),
                _number(result.seed_noise) if result.seed_noise_measured else "unmeasured",
                snr,
                result.verdict,
            ]
        )
    return list(HEADER), body


def left_out_line(left_out: Sequence[str]) -> str:
    return (
        f"not shown (one evaluation per run, no checkpoint noise): {', '.join(left_out)}"
        if left_out
        else ""
    )
