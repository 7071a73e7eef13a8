"""Scaling-law fits over (model size N, tokens D, compute C, loss) points: pure functions over
numpy arrays; `llmtrain fit` (fit_command.py) reads the runs and calls them.

Two ways to the compute-optimal model, both from Hoffmann et al. 2022 ("Chinchilla"):

- `fit_parametric` (their approach 3): L(N, D) = E + A / N^alpha + B / D^beta, fitted by
  minimising the Huber loss (delta 1e-3) of log-loss residuals with L-BFGS, the prediction in
  log-sum-exp form: log L = logsumexp(e, a - alpha log N, b - beta log D), E = exp(e), A = exp(a),
  B = exp(b). 95% intervals by bootstrap: resample the points with replacement, refit, take the
  2.5 and 97.5 percentiles.
- `fit_isoflop` (their approach 2): runs of one compute budget (within a relative tolerance)
  are one IsoFLOP curve; a parabola of loss in log N gives the budget's optimal N; then
  N_opt ∝ C^a and D_opt ∝ C^b by least squares in log-log.

Every function refuses input that cannot give a meaningful fit with a `UserError` that names
the points (runs) involved; a fit whose optimiser did not converge is an error too, so nothing is
ever extrapolated from a failed fit.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt
from scipy import optimize, special, stats
from threadpoolctl import threadpool_limits

from llmtrain.core_mesh.errors import UserError

PARAMETERS = ("E", "A", "B", "alpha", "beta")
# log E, log A, log B above this overflow exp(): an optimum there has run off to infinity along
# a direction the points do not constrain (e.g. A/N^alpha with alpha -> large), not converged
MAX_LOG_COEFFICIENT = 700.0
HUBER_DELTA = 1e-3  # Hoffmann et al.'s delta: the fit is least squares on residuals below it
CONFIDENCE = 0.95
BUDGET_TOLERANCE = 0.05  # runs whose compute differs by at most 5% share a budget
MIN_SIZES_PER_BUDGET = 3  # a parabola needs three distinct model sizes
# starting points for L-BFGS, in the fitted coordinates (e, a, b, alpha, beta); a coarser
# version of Hoffmann et al.'s grid, spanning E from 0.37 to 4.5 and A, B up to e^25
START_GRID = {
    "e": (-1.0, 0.5, 1.5),
    "a": (0.0, 5.0, 10.0, 15.0, 20.0, 25.0),
    "b": (0.0, 5.0, 10.0, 15.0, 20.0, 25.0),
    "alpha": (0.0, 0.5, 1.0, 1.5, 2.0),
    "beta": (0.0, 0.5, 1.0, 1.5, 2.0),
}
# L-BFGS runs from the grid points with the lowest objective only: evaluating the objective on
# the 2,700 grid points is one vectorised call, while most optimiser runs from the rest would
# end at the same minimum
STARTS_RUN = 4
BOOTSTRAP_STARTS_RUN = 2  # a refit that fails from the full fit's optimum


def chinchilla_loss(n: npt.ArrayLike, d: npt.ArrayLike, params: Iterable[float]) -> Any:
    """E + A / N^alpha + B / D^beta for params (E, A, B, alpha, beta): an array for arrays N
    and D (broadcast), a number for numbers."""
    big_e, big_a, big_b, alpha, beta = params
    with np.errstate(over="ignore"):  # a degenerate bootstrap refit's loss is inf: unbounded
        return big_e + big_a / np.power(n, alpha) + big_b / np.power(d, beta)


def _point_names(names: Sequence[str] | None, count: int) -> list[str]:
    return list(names) if names is not None else [f"point {i}" for i in range(count)]


def _listed(names: Sequence[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def check_points(
    names: Sequence[str] | None,
    n: np.ndarray,
    d: np.ndarray,
    loss: np.ndarray,
    *,
    min_points: int = len(PARAMETERS),
) -> None:
    """Refuse points no fit can use: non-finite or non-positive losses, N or D, fewer points than
    `min_points`, a single model size or a single token count."""
    names = _point_names(names, len(loss))
    bad = [name for name, value in zip(names, loss, strict=True) if not np.isfinite(value)]
    if bad:
        raise UserError(f"runs with a NaN or inf loss (diverged?): {_listed(bad)}; leave them out")
    bad = [name for name, value in zip(names, loss, strict=True) if value <= 0]
    if bad:
        raise UserError(f"runs with a loss of zero or less: {_listed(bad)}; not a cross-entropy")
    sizes_ok = np.isfinite(n) & np.isfinite(d) & (n > 0) & (d > 0)
    bad = [name for name, ok in zip(names, sizes_ok, strict=True) if not ok]
    if bad:
        raise UserError(f"runs without a positive model size and token count: {_listed(bad)}")
    if len(loss) < min_points:
        raise UserError(
            f"{len(loss)} runs ({_listed(names)}) are fewer than the {min_points} the fit needs "
            f"(one per parameter of L = E + A/N^alpha + B/D^beta); add runs"
        )
    if len(np.unique(n)) < 2:
        raise UserError(
            f"every run has the same model size N={n[0]:.4g} ({_listed(names)}): the fit needs "
            f"at least two sizes"
        )
    if len(np.unique(d)) < 2:
        raise UserError(
            f"every run saw the same number of tokens D={d[0]:.4g} ({_listed(names)}): the fit "
            f"needs at least two token counts"
        )


# --- approach 3: the parametric fit ---


def _objective(
    theta: np.ndarray, log_n: np.ndarray, log_d: np.ndarray, log_loss: np.ndarray
) -> tuple[float, np.ndarray]:
    """The Huber loss of the log-loss residuals (scaled by 1/delta^2, which leaves the minimum
    where it is but keeps L-BFGS's relative stopping test from firing at objectives ~1e-7) and
    its gradient in (e, a, b, alpha, beta)."""
    e, a, b, alpha, beta = theta
    terms = np.stack([np.full_like(log_n, e), a - alpha * log_n, b - beta * log_d])
    log_pred = np.logaddexp.reduce(terms, axis=0)  # logsumexp; scipy's costs 100x on 3 rows
    residual = log_pred - log_loss
    value = special.huber(HUBER_DELTA, residual).sum() / HUBER_DELTA**2
    slope = np.clip(residual, -HUBER_DELTA, HUBER_DELTA) / HUBER_DELTA**2  # d huber / d residual
    weights = np.exp(terms - log_pred)  # d log_pred / d term: the softmax of the terms
    grad = np.array(
        [
            slope @ weights[0],
            slope @ weights[1],
            slope @ weights[2],
            -slope @ (weights[1] * log_n),
            -slope @ (weights[2] * log_d),
        ]
    )
    return float(value), grad


def _grid_objectives(
    grid: np.ndarray, log_n: np.ndarray, log_d: np.ndarray, log_loss: np.ndarray
) -> np.ndarray:
    """The objective at every grid point at once (no gradient)."""
    e, a, b, alpha, beta = (grid[:, i, None] for i in range(5))
    terms = np.stack(
        [np.broadcast_to(e, (len(grid), len(log_n))), a - alpha * log_n, b - beta * log_d]
    )
    residual = np.logaddexp.reduce(terms, axis=0) - log_loss
    objectives: np.ndarray = special.huber(HUBER_DELTA, residual).sum(axis=1)  # scipy: untyped
    return objectives


GRID = np.array(list(itertools.product(*START_GRID.values())), dtype=float)


def _minimise(
    starts: np.ndarray, log_n: np.ndarray, log_d: np.ndarray, log_loss: np.ndarray
) -> optimize.OptimizeResult | None:
    """L-BFGS from each start; the converged result with the lowest objective (None: none
    converged to a finite value)."""
    best = None
    for start in starts:
        result = optimize.minimize(
            _objective,
            start,
            args=(log_n, log_d, log_loss),
            jac=True,
            method="L-BFGS-B",
            options={"maxiter": 2000, "ftol": 1e-12, "gtol": 1e-8},
        )
        if not (result.success and np.isfinite(result.fun) and np.all(np.isfinite(result.x))):
            continue
        if np.any(result.x[:3] > MAX_LOG_COEFFICIENT):  # E, A or B beyond a float: degenerate
            continue
        if best is None or result.fun < best.fun:
            best = result
    return best


def _best_starts(
    log_n: np.ndarray, log_d: np.ndarray, log_loss: np.ndarray, count: int
) -> np.ndarray:
    objectives = _grid_objectives(GRID, log_n, log_d, log_loss)
    return GRID[np.argsort(objectives, kind="stable")[:count]]


def _to_params(theta: np.ndarray) -> np.ndarray:
    e, a, b, alpha, beta = theta
    return np.array([math.exp(e), math.exp(a), math.exp(b), alpha, beta])


@attrs.frozen
class Interval:
    low: float
    high: float

    def __contains__(self, value: float) -> bool:
        return self.low <= value <= self.high


@attrs.frozen
class Prediction:
    """A predicted value and its 95% interval (arrays where the inputs were)."""

    value: Any
    low: Any
    high: Any


@attrs.frozen
class ParametricFit:
    """L(N, D) = E + A/N^alpha + B/D^beta fitted to `n_points` points; `intervals` are 95%
    bootstrap percentile intervals from `bootstrap` (one row of (E, A, B, alpha, beta) per
    refit; empty with n_boot=0)."""

    E: float
    A: float
    B: float
    alpha: float
    beta: float
    intervals: dict[str, Interval]
    n_points: int
    objective: float  # the Huber objective at the optimum (in units of delta^2)
    bootstrap: np.ndarray = attrs.field(eq=False, repr=False)

    @property
    def params(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in PARAMETERS}

    def predict(self, n: Any, d: Any) -> Prediction:
        """The fitted loss at (N, D), with the 2.5-97.5 percentiles of the bootstrap fits'
        losses there (NaN without a bootstrap)."""
        value = chinchilla_loss(np.asarray(n, float), np.asarray(d, float), self.params.values())
        if len(self.bootstrap) == 0:
            return Prediction(value, value * np.nan, value * np.nan)
        losses = np.stack([chinchilla_loss(n, d, row) for row in self.bootstrap])
        low, high = np.percentile(losses, _PERCENTILES, axis=0)
        return Prediction(value, low, high)

    def to_json(self) -> dict[str, object]:
        return {
            "model": "L = E + A / N^alpha + B / D^beta",
            "params": self.params,
            "intervals": {k: [v.low, v.high] for k, v in self.intervals.items()},
            "n_points": self.n_points,
            "n_boot": len(self.bootstrap),
            "objective": self.objective,
        }


_PERCENTILES = (100 * (1 - CONFIDENCE) / 2, 100 * (1 + CONFIDENCE) / 2)


@attrs.frozen
class Frontier:
    """The compute-optimal N, D and loss of a law at compute C (arrays where the inputs were;
    NaN for a law with alpha or beta <= 0, which has no optimum)."""

    n: Any
    d: Any
    loss: Any


def compute_optimal(params: npt.ArrayLike, compute: npt.ArrayLike, per_param: float) -> Frontier:
    """Where L = E + A/N^alpha + B/D^beta is lowest on the budget C = k N D (k = `per_param`,
    FLOPs per token per parameter: 6 for Chinchilla's C = 6ND): N_opt = G (C/k)^(beta/(alpha +
    beta)) with G = (alpha A / (beta B))^(1/(alpha + beta)), D_opt = C / (k N_opt) (Hoffmann et
    al. 2022, appendix D.2). `params`: one row (E, A, B, alpha, beta) or an array of rows (a
    bootstrap: one result per row); `compute` broadcasts against the rows."""
    rows = np.asarray(params, dtype=float)
    tokens_params = np.log(np.asarray(compute, dtype=float) / per_param)  # log (N D)
    # rows along a leading axis, against compute's axes after it
    shape = (-1, *[1] * tokens_params.ndim) if rows.ndim == 2 else ()
    big_e, big_a, big_b, alpha, beta = (rows[..., i].reshape(shape) for i in range(5))
    with np.errstate(divide="ignore", invalid="ignore"):
        ok = (alpha > 0) & (beta > 0) & (big_a > 0) & (big_b > 0)
        log_n = (np.log(alpha * big_a / (beta * big_b)) + beta * tokens_params) / (alpha + beta)
        log_n = np.where(ok, log_n, np.nan)
    n = np.exp(log_n)
    d = np.exp(tokens_params - log_n)
    loss = big_e + big_a * np.exp(-alpha * log_n) + big_b / np.power(d, beta)
    return Frontier(n, d, loss)


def fit_parametric(
    n: npt.ArrayLike,
    d: npt.ArrayLike,
    loss: npt.ArrayLike,
    *,
    names: Sequence[str] | None = None,
    n_boot: int = 200,
    seed: int = 0,
) -> ParametricFit:
    """Fit L(N, D) = E + A/N^alpha + B/D^beta to the points (N model parameters, D tokens) and
    bootstrap `n_boot` refits (numpy Generator seeded with `seed`) for the intervals. `names`
    (the runs) are what errors name."""
    # L-BFGS-B calls BLAS on 5x5 matrices thousands of times a fit: with BLAS threads
    # contending for busy cores that runs ~30x slower than on one thread
    with threadpool_limits(limits=1):
        return _fit_parametric(n, d, loss, names, n_boot, seed)


def _fit_parametric(
    given_n: npt.ArrayLike,
    given_d: npt.ArrayLike,
    given_loss: npt.ArrayLike,
    names: Sequence[str] | None,
    n_boot: int,
    seed: int,
) -> ParametricFit:
    n, d, loss = (np.asarray(x, dtype=float) for x in (given_n, given_d, given_loss))
    check_points(names, n, d, loss)
    log_n, log_d, log_loss = np.log(n), np.log(d), np.log(loss)
    best = _minimise(_best_starts(log_n, log_d, log_loss, STARTS_RUN), log_n, log_d, log_loss)
    if best is None:
        raise UserError(
            f"the fit of L = E + A/N^alpha + B/D^beta to {_listed(_point_names(names, len(n)))} "
            f"did not converge from any starting point: nothing to extrapolate from; add runs "
            f"that span more sizes and token counts"
        )
    rng = np.random.default_rng(seed)
    refits = []
    for _ in range(n_boot):
        pick = rng.integers(0, len(n), len(n))
        sample = (log_n[pick], log_d[pick], log_loss[pick])
        # a resample's optimum lies near the full fit's: start there, and from the grid only
        # when that does not converge
        refit = _minimise(best.x[None, :], *sample)
        if refit is None:
            refit = _minimise(_best_starts(*sample, BOOTSTRAP_STARTS_RUN), *sample)
        if refit is not None:
            refits.append(_to_params(refit.x))
    # a resample may repeat one size or token count so often that it has no optimum; more than
    # a few of those says the points do not pin the law down
    if n_boot and len(refits) < 0.9 * n_boot:
        raise UserError(
            f"{n_boot - len(refits)} of {n_boot} bootstrap refits did not converge: the runs do "
            f"not pin the law down; add runs that span more sizes and token counts"
        )
    boot = np.array(refits).reshape(-1, len(PARAMETERS))
    params = _to_params(best.x)
    intervals = {}
    for i, name in enumerate(PARAMETERS):
        low, high = np.percentile(boot[:, i], _PERCENTILES) if len(boot) else (np.nan, np.nan)
        intervals[name] = Interval(float(low), float(high))
    big_e, big_a, big_b, alpha, beta = (float(p) for p in params)
    return ParametricFit(
        big_e,
        big_a,
        big_b,
        alpha,
        beta,
        intervals=intervals,
        n_points=len(n),
        objective=float(best.fun),
        bootstrap=boot,
    )


# --- approach 2: IsoFLOP profiles ---


def group_budgets(compute: npt.ArrayLike, tolerance: float = BUDGET_TOLERANCE) -> list[np.ndarray]:
    """Indices of the points of each compute budget, smallest budget first: sorted by compute,
    a point joins the current budget while it is within `tolerance` (relative) of the
    budget's smallest compute."""
    values = np.asarray(compute, dtype=float)
    order = np.argsort(values, kind="stable")
    groups: list[list[int]] = []
    for i in order:
        if groups and values[i] <= values[groups[-1][0]] * (1 + tolerance):
            groups[-1].append(int(i))
        else:
            groups.append([int(i)])
    return [np.array(g) for g in groups]


@attrs.frozen
class Budget:
    """One IsoFLOP curve: its compute (the geometric mean of its runs'), the runs, the parabola
    loss = c2 (log N)^2 + c1 log N + c0 and, when usable, the optimum on it. `rejected` says why
    a budget is left out of the power laws (None: used)."""

    compute: float
    names: tuple[str, ...]
    n: np.ndarray = attrs.field(eq=False, repr=False)
    loss: np.ndarray = attrs.field(eq=False, repr=False)
    parabola: tuple[float, float, float] | None
    n_opt: float | None
    d_opt: float | None
    loss_opt: float | None
    rejected: str | None

    def to_json(self) -> dict[str, object]:
        return {
            "compute": self.compute,
            "runs": list(self.names),
            "parabola_log_n": self.parabola,
            "n_opt": self.n_opt,
            "d_opt": self.d_opt,
            "loss_opt": self.loss_opt,
            "rejected": self.rejected,
        }


@attrs.frozen
class PowerLaw:
    """y = coefficient * C^exponent, fitted in log-log; `exponent_interval` is the 95%
    t-interval of the slope (None with two budgets: no residual to estimate it from)."""

    exponent: float
    coefficient: float
    exponent_stderr: float | None
    exponent_interval: Interval | None
    log_c: np.ndarray = attrs.field(eq=False, repr=False)
    residual_std: float | None

    def __call__(self, compute: npt.ArrayLike) -> Any:
        return self.coefficient * np.power(compute, self.exponent)

    def predict(self, compute: float) -> Prediction:
        """The fitted value at `compute` and the 95% confidence interval of the fitted line
        there (in log space; NaN with two budgets)."""
        value = float(self(compute))
        if self.residual_std is None:
            return Prediction(value, math.nan, math.nan)
        k = len(self.log_c)
        x = math.log(compute)
        spread = np.sum((self.log_c - self.log_c.mean()) ** 2)
        half = (
            stats.t.ppf((1 + CONFIDENCE) / 2, k - 2)
            * self.residual_std
            * math.sqrt(1 / k + (x - self.log_c.mean()) ** 2 / spread)
        )
        return Prediction(value, value * math.exp(-half), value * math.exp(half))

    def to_json(self) -> dict[str, object]:
        interval = self.exponent_interval
        return {
            "exponent": self.exponent,
            "coefficient": self.coefficient,
            "exponent_stderr": self.exponent_stderr,
            "exponent_interval": None if interval is None else [interval.low, interval.high],
        }


def _power_law(compute: np.ndarray, values: np.ndarray) -> PowerLaw:
    log_c, log_y = np.log(compute), np.log(values)
    line = stats.linregress(log_c, log_y)
    if len(log_c) < 3:
        stderr, interval, residual_std = None, None, None
    else:
        stderr = float(line.stderr)
        half = stats.t.ppf((1 + CONFIDENCE) / 2, len(log_c) - 2) * stderr
        interval = Interval(float(line.slope - half), float(line.slope + half))
        residuals = log_y - (line.intercept + line.slope * log_c)
        residual_std = float(math.sqrt(np.sum(residuals**2) / (len(log_c) - 2)))
    return PowerLaw(
        float(line.slope), float(math.exp(line.intercept)), stderr, interval, log_c, residual_std
    )


@attrs.frozen
class IsoFlopFit:
    """Per-budget optima and the power laws N_opt = k_N C^a, D_opt = k_D C^b fitted to the
    budgets that were not rejected."""

    budgets: list[Budget]
    n_opt: PowerLaw
    d_opt: PowerLaw

    def predict(self, compute: float) -> tuple[Prediction, Prediction]:
        """(N_opt, D_opt) at `compute`, each with its 95% interval."""
        return self.n_opt.predict(compute), self.d_opt.predict(compute)

    def to_json(self) -> dict[str, object]:
        return {
            "budgets": [b.to_json() for b in self.budgets],
            "n_opt": self.n_opt.to_json(),
            "d_opt": self.d_opt.to_json(),
        }


def _fit_budget(
    names: list[str], n: np.ndarray, d: np.ndarray, loss: np.ndarray, compute: np.ndarray
) -> Budget:
    """The parabola of loss in log N and its vertex. A budget is rejected (not an error: others
    may be fine) when it has fewer than three sizes, its parabola opens downward (no minimum),
    or its vertex lies outside the sampled sizes (an optimum extrapolated from one side is
    where the parabola is least like the true curve: sample sizes on both sides of it)."""
    budget = float(np.exp(np.mean(np.log(compute))))
    common = functools.partial(Budget, compute=budget, names=tuple(names), n=n, loss=loss)
    if len(np.unique(n)) < MIN_SIZES_PER_BUDGET:
        reason = f"{len(np.unique(n))} model sizes (needs {MIN_SIZES_PER_BUDGET})"
        return common(parabola=None, n_opt=None, d_opt=None, loss_opt=None, rejected=reason)
    log_n = np.log(n)
    c2, c1, c0 = np.polyfit(log_n, loss, 2)
    parabola = (float(c2), float(c1), float(c0))
    if c2 <= 0:
        reason = "the parabola opens downward: no minimum"
        return common(parabola=parabola, n_opt=None, d_opt=None, loss_opt=None, rejected=reason)
    vertex = -c1 / (2 * c2)
    if not log_n.min() <= vertex <= log_n.max():
        reason = (
            f"the optimum N={math.exp(vertex):.3g} lies outside the sizes run "
            f"({n.min():.3g}-{n.max():.3g})"
        )
        return common(parabola=parabola, n_opt=None, d_opt=None, loss_opt=None, rejected=reason)
    n_opt = math.exp(vertex)
    # FLOPs per token per parameter (6 for C = 6ND; more with attention FLOPs counted), read
    # off the budget's runs and interpolated to N_opt: D_opt = C / (k N_opt)
    order = np.argsort(log_n)
    per_param = compute / (n * d)
    k = float(np.interp(vertex, log_n[order], per_param[order]))
    return common(
        parabola=parabola,
        n_opt=n_opt,
        d_opt=budget / (k * n_opt),
        loss_opt=float(np.polyval([c2, c1, c0], vertex)),
        rejected=None,
    )


def fit_isoflop(
    n: npt.ArrayLike,
    d: npt.ArrayLike,
    loss: npt.ArrayLike,
    compute: npt.ArrayLike,
    *,
    names: Sequence[str] | None = None,
    tolerance: float = BUDGET_TOLERANCE,
) -> IsoFlopFit:
    """Group the points into compute budgets (`group_budgets`), find each budget's optimal N
    (`_fit_budget`), and fit N_opt and D_opt as power laws of C over the usable budgets (at
    least two)."""
    n_, d_, loss_, compute_ = (np.asarray(x, dtype=float) for x in (n, d, loss, compute))
    return _fit_isoflop(n_, d_, loss_, compute_, names, tolerance)


def _fit_isoflop(
    n: np.ndarray,
    d: np.ndarray,
    loss: np.ndarray,
    compute: np.ndarray,
    given_names: Sequence[str] | None,
    tolerance: float,
) -> IsoFlopFit:
    names = _point_names(given_names, len(n))
    check_points(names, n, d, loss, min_points=2 * MIN_SIZES_PER_BUDGET)
    budgets = []
    for group in group_budgets(compute, tolerance):
        budgets.append(
            _fit_budget([names[i] for i in group], n[group], d[group], loss[group], compute[group])
        )
    used = [b for b in budgets if b.rejected is None]
    if len(used) < 2:
        reasons = "; ".join(
            f"C={b.compute:.3g} ({_listed(list(b.names), 4)}): {b.rejected}"
            for b in budgets
            if b.rejected
        )
        raise UserError(
            f"an IsoFLOP fit needs at least 2 compute budgets with {MIN_SIZES_PER_BUDGET} or more "
            f"model sizes each and an optimum inside them; {len(budgets)} budget(s) found "
            f"(runs within {tolerance:.0%} of compute share one), {len(used)} usable"
            + (f"; {reasons}" if reasons else "")
        )
    compute_used = np.array([b.compute for b in used])
    return IsoFlopFit(
        budgets=budgets,
        n_opt=_power_law(compute_used, np.array([b.n_opt for b in used])),
        d_opt=_power_law(compute_used, np.array([b.d_opt for b in used])),
    )
