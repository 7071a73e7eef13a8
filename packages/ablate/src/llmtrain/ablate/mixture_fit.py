"""Regressions from data-mixture weights to a target, their cross-validation, and the mixture
they predict best: pure functions over numpy arrays. `llmtrain fit --mixture` (fit_command.py)
and the report (mixture_report.py) read the runs (mixture_runs.py) and call `fit_mixture`.

A data-mixture study trains many small proxy runs whose `data.train` weights are drawn from a
Dirichlet distribution, regresses a target (a weighted sum of logged metrics) on the weights and
takes the mixture the regression predicts best (RegMix, arXiv 2407.01492; Data Mixing Laws,
arXiv 2403.16952). Three models, each of the weights of the sources that vary between runs:

- `lightgbm`: gradient-boosted trees on the target, as RegMix fits them (LightGBM, the
  `[mixture]` extra, imported only when this fit runs), sized for tens of runs: trees of 4
  leaves of 3 runs or more, 300 rounds at learning rate 0.05.
- `mixing_law`: Data Mixing Laws' L_m(w) = c_m + k_m exp(sum_j t_mj w_j), one law for each
  metric m of the target (least squares, `scipy.optimize.least_squares` from several starts),
  the target their weighted sum. t of the first varying source is 0 (the weights sum to 1, so
  only differences of t count): |varying sources| + 1 parameters per metric.
- `log_linear`: each metric m of the target linear in the logs of the weights, L_m(w) = c_m +
  sum_j b_mj log(w_j + 0.01) (least squares), the target their weighted sum: diminishing
  returns of a source's share, and the steep loss of a source that gets almost none, which a
  small proxy run shows (the log-linear mixing law of Aioli, arXiv 2411.05735). The floor
  0.01 keeps a weight of 0 finite.
- `linear`: the target linear in the weights (least squares).

Each model is scored by k-fold cross-validation, k = min(5, runs), folds drawn by the seed:
every run is predicted by the model fitted without its fold. The model with the lowest
out-of-fold RMSE is chosen and refitted on every run. Its best mixture is searched as RegMix
searches: 50,000 candidates drawn from Dirichlet distributions centred on the runs' mean
mixture at concentrations from 1 (near the simplex's corners) to 300 (near the mean), the runs'
own mixtures added, those outside the per-source range the runs covered left out (no model here
is trusted beyond its data); the mean of the 100 best predicted is the answer, rounded to
hundredths that sum to 1. Its interval (and every prediction's) is the prediction plus and
minus a quantile of the chosen model's absolute out-of-fold residuals, at split conformal
prediction's rank for 95%: what cross-validation saw between the model's prediction for a run
it had not seen and what that run measured.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import attrs
import numpy as np
import numpy.typing as npt
from scipy import optimize, stats

from llmtrain.ablate.fit import Prediction
from llmtrain.core_mesh.errors import UserError

Array = npt.NDArray[np.float64]
Predictor = Callable[[Array], Array]  # (candidates, sources) weights -> the target per candidate

MODELS = ("lightgbm", "mixing_law", "log_linear", "linear")
MAX_FOLDS = 5
MIN_RUNS = 4  # an out-of-fold Spearman correlation of 3 runs takes 4 values only
CANDIDATES = 50_000
TOP = 100  # the candidates averaged into the answer (RegMix: the top 128 of 100,000)
CONCENTRATIONS = np.geomspace(1.0, 300.0, 10)  # x the runs' mean mixture: corners to the mean
DECIMALS = 2  # the answer's weights are hundredths that sum to 1
COVERAGE = 0.95  # the intervals' aim for a run at the predicted mixture
EXTRA = (
    "pip install 'llmtrain-ablate[mixture]' (from a checkout: "
    "pip install './packages/ablate[mixture]')"
)
# LightGBM for tens of runs: its defaults (leaves of 20 rows, bins of 3) never split them; of
# 2, 3 or 5 runs a leaf, 4 or 8 leaves, 300 or 1,000 rounds at 0.05 or 0.02, these gave the
# lowest cross-validated error on smooth synthetic targets of 16 to 64 runs
LIGHTGBM = {
    "objective": "regression",
    "learning_rate": 0.05,
    "num_leaves": 4,
    "min_data_in_leaf": 3,
    "min_data_in_bin": 1,
    "min_sum_hessian_in_leaf": 0.0,
    "num_threads": 1,  # tens of rows: threads cost more than they buy
    "deterministic": True,
    "force_row_wise": True,
    "verbosity": -1,
}
LIGHTGBM_ROUNDS = 300
MAX_EXPONENT = 50.0  # exp() of the mixing law's exponent is clipped here (a runaway start)
LOG_FLOOR = 0.01  # log_linear's log(w + floor): a weight of 0 stays finite


@attrs.frozen(eq=False)
class MixtureData:
    """The runs as points: each run's mixture and the metrics the target sums."""

    weights: Array  # (runs, sources), each row sums to 1, in data.train order
    metrics: Array  # (runs, metrics): each metric of the target, per run
    coefficients: Array  # (metrics,): the target is metrics @ coefficients
    higher_is_better: bool = False

    @property
    def target(self) -> Array:
        return np.asarray(self.metrics @ self.coefficients, dtype=np.float64)

    @property
    def varying(self) -> npt.NDArray[np.bool_]:
        """The sources whose weight differs between runs (the rest tell the fit nothing)."""
        return np.asarray(np.ptp(self.weights, axis=0) > 0)

    def subset(self, rows: npt.NDArray[np.intp]) -> MixtureData:
        return attrs.evolve(self, weights=self.weights[rows], metrics=self.metrics[rows])


def min_runs(sources: int) -> int:
    """The fewest runs a fit of `sources` varying sources can use: every cross-validation fold
    must leave at least sources + 1 runs to fit the mixing law's sources + 1 parameters on (with
    all the runs that is sources + 2, one left to judge the fit by), and at least `MIN_RUNS`."""
    runs = max(MIN_RUNS, sources + 2)
    while runs - math.ceil(runs / min(MAX_FOLDS, runs)) < sources + 1:  # the largest fold out
        runs += 1
    return runs


def folds(runs: int, seed: int) -> list[npt.NDArray[np.intp]]:
    """The held-out runs of each of the min(5, runs) folds, drawn by `seed`."""
    order = np.random.default_rng(seed).permutation(runs)
    return np.array_split(order, min(MAX_FOLDS, runs))


# --- the models ---


def _lightgbm(x: Array, y: Array, seed: int) -> Callable[[Array], Array]:
    try:
        import lightgbm
    except ImportError:
        raise UserError(f"llmtrain fit --mixture needs LightGBM: {EXTRA}") from None
    except OSError as exc:  # its library links the system's OpenMP runtime, which may be absent
        raise UserError(
            f"LightGBM is installed but cannot load its library ({exc}); it needs the OpenMP "
            "runtime: on Debian or Ubuntu apt install libgomp1, on macOS brew install libomp"
        ) from None
    params = {**LIGHTGBM, "seed": seed}
    booster = lightgbm.train(
        params, lightgbm.Dataset(x, y, params={"min_data_in_bin": 1}), LIGHTGBM_ROUNDS
    )
    return lambda at: np.asarray(booster.predict(at), dtype=np.float64)


def _linear(x: Array, y: Array) -> Callable[[Array], Array]:
    coefficients = np.linalg.lstsq(x, y, rcond=None)[0]  # the weights sum to a constant
    return lambda at: np.asarray(at @ coefficients, dtype=np.float64)


def _log_linear(x: Array, metrics: Array, coefficients: Array) -> Callable[[Array], Array]:
    """Each metric linear in log(w + LOG_FLOOR) (least squares), the target their weighted sum:
    one linear fit of the summed metrics, since least squares is linear in the targets."""

    def design(at: Array) -> Array:
        return np.column_stack([np.ones(len(at)), np.log(at + LOG_FLOOR)])

    fitted = np.linalg.lstsq(design(x), metrics @ coefficients, rcond=None)[0]
    return lambda at: np.asarray(design(at) @ fitted, dtype=np.float64)


def _law(theta: Array, z: Array, sign: float) -> tuple[Array, Array]:
    """(c + sign exp(log_k + z @ t), its exponential term) for theta = (c, log_k, t...)."""
    term = sign * np.exp(np.minimum(theta[1] + z @ theta[2:], MAX_EXPONENT))
    return theta[0] + term, term


def _mixing_law_of(x: Array, y: Array) -> Callable[[Array], Array]:
    """L = c + k exp(sum_j t_j w_j) with t_0 = 0 fitted to one metric: least squares from
    starts below the values (k > 0) and above them (k < 0), each from the linear fit of
    log |y - c| for that c; the lowest squared error wins."""
    z = x[:, 1:]
    design = np.column_stack([np.ones(len(y)), z])
    span = max(float(np.ptp(y)), 1e-9 * max(1.0, float(np.abs(y).max())))
    best: tuple[float, Array, float] | None = None
    for sign in (1.0, -1.0):
        for gap in (0.05, 0.3, 1.0, 3.0):
            c = float(y.min()) - gap * span if sign > 0 else float(y.max()) + gap * span
            start = np.linalg.lstsq(design, np.log(sign * (y - c)), rcond=None)[0]

            def residuals(theta: Array, sign: float = sign) -> Array:
                return _law(theta, z, sign)[0] - y

            def jacobian(theta: Array, sign: float = sign) -> Array:
                term = _law(theta, z, sign)[1]
                return np.column_stack([np.ones(len(y)), term, term[:, None] * z])

            result = optimize.least_squares(
                residuals, np.concatenate([[c], start]), jac=jacobian, method="lm"
            )
            if np.all(np.isfinite(result.x)) and (best is None or result.cost < best[0]):
                best = (float(result.cost), result.x, sign)
    if best is None:
        raise ArithmeticError("no start of the mixing law converged to finite parameters")
    _, theta, sign = best
    return lambda at: _law(theta, at[:, 1:], sign)[0]


def _mixing_law(x: Array, metrics: Array, coefficients: Array) -> Callable[[Array], Array]:
    laws = [_mixing_law_of(x, metrics[:, m]) for m in range(metrics.shape[1])]
    return lambda at: np.asarray(
        sum(a * law(at) for a, law in zip(coefficients, laws, strict=True)), dtype=np.float64
    )


def fit_model(name: str, data: MixtureData, seed: int, varying: npt.NDArray[np.bool_]) -> Predictor:
    """Model `name` fitted to `data` on the weights of the `varying` sources."""
    x = data.weights[:, varying]
    if name == "lightgbm":
        predict = _lightgbm(x, data.target, seed)
    elif name == "linear":
        predict = _linear(x, data.target)
    elif name == "log_linear":
        predict = _log_linear(x, data.metrics, data.coefficients)
    elif name == "mixing_law":
        predict = _mixing_law(x, data.metrics, data.coefficients)
    else:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    return lambda weights: predict(np.atleast_2d(weights)[:, varying])


# --- cross-validation ---


@attrs.frozen(eq=False)
class ModelScore:
    """A model's cross-validation: each run's out-of-fold prediction, their RMSE against the
    runs' targets and Spearman correlation with them; `error` says why it could not be fitted."""

    name: str
    predicted: Array
    rmse: float
    spearman: float
    error: str = ""


def cross_validate(name: str, data: MixtureData, seed: int) -> ModelScore:
    varying = data.varying
    predicted = np.full(len(data.target), np.nan)
    try:
        for held in folds(len(data.target), seed):
            kept = np.setdiff1d(np.arange(len(data.target)), held)
            predicted[held] = fit_model(name, data.subset(kept), seed, varying)(data.weights[held])
    except (ArithmeticError, np.linalg.LinAlgError) as error:
        return ModelScore(name, predicted, np.nan, np.nan, str(error))
    if not np.all(np.isfinite(predicted)):
        return ModelScore(name, predicted, np.nan, np.nan, "predicted a NaN or inf")
    rmse = float(np.sqrt(np.mean((data.target - predicted) ** 2)))
    constant = np.ptp(predicted) == 0 or np.ptp(data.target) == 0
    spearman = np.nan if constant else float(stats.spearmanr(predicted, data.target).statistic)
    return ModelScore(name, predicted, rmse, spearman)


# --- the search and the answer ---


def rounded(weights: Array, decimals: int = DECIMALS) -> Array:
    """`weights` (summing to 1) as multiples of 10^-decimals that sum to 1: each rounded down,
    then the largest remainders rounded up until they do."""
    units = 10**decimals
    scaled = np.asarray(weights, dtype=np.float64) * units
    whole = np.floor(scaled + 1e-9)
    short = round(float(units - whole.sum()))
    order = np.argsort(-(scaled - whole), kind="stable")
    whole[order[:short]] += 1
    return np.asarray(whole / units, dtype=np.float64)


def candidates(data: MixtureData, seed: int, count: int = CANDIDATES) -> Array:
    """Mixtures to search (RegMix's simulation): Dirichlet draws centred on the runs' mean
    mixture at each of `CONCENTRATIONS`, and the runs' own mixtures; a source the runs never
    varied keeps its weight; outside the per-source range of the runs left out."""
    x, varying = data.weights, data.varying
    fixed = x[0, ~varying]
    free = 1.0 - float(fixed.sum())
    mean = x[:, varying].mean(axis=0)
    mean = mean / mean.sum()
    rng = np.random.default_rng(seed)
    per = max(1, count // len(CONCENTRATIONS))
    draws = np.concatenate([rng.dirichlet(mean * c, per) for c in CONCENTRATIONS])
    found = np.empty((len(draws), x.shape[1]))
    found[:, varying] = draws * free
    found[:, ~varying] = fixed
    inside = np.all((found >= x.min(axis=0) - 1e-12) & (found <= x.max(axis=0) + 1e-12), axis=1)
    return np.concatenate([found[inside], x])


@attrs.frozen(eq=False)
class MixtureFit:
    """What `fit_mixture` found: every model's cross-validation, the one chosen (`model`, refitted
    on every run as `predictor`), the best mixture (`weights`, rounded) and the half-width of
    the intervals (`radius`, from the chosen model's out-of-fold residuals)."""

    data: MixtureData
    scores: list[ModelScore]
    model: str
    predictor: Predictor
    weights: Array
    searched: int  # the candidates the search predicted
    radius: float  # a prediction's interval is value +- radius (`conformal_radius`)
    seed: int

    @property
    def score(self) -> ModelScore:
        return next(s for s in self.scores if s.name == self.model)

    @property
    def top(self) -> int:
        """How many of the best candidates the answer averages."""
        return min(TOP, self.searched)

    @property
    def folds(self) -> int:
        return min(MAX_FOLDS, len(self.data.target))

    def predict(self, weights: npt.ArrayLike) -> Prediction:
        """The target at `weights` (one mixture: numbers; several: arrays) with its interval."""
        at = np.asarray(weights, dtype=np.float64)
        value = self.predictor(at)
        low, high = value - self.radius, value + self.radius
        if at.ndim == 1:
            return Prediction(float(value[0]), float(low[0]), float(high[0]))
        return Prediction(value, low, high)

    @property
    def predicted(self) -> Prediction:
        return self.predict(self.weights)


def fit_mixture(data: MixtureData, seed: int = 0, models: Sequence[str] = MODELS) -> MixtureFit:
    """Cross-validate `models`, refit the best on every run and search its best mixture."""
    varying = data.varying
    if not varying.any():
        raise UserError("the runs all train on the same mixture: nothing to regress on")
    needed = min_runs(int(varying.sum()))
    if len(data.target) < needed:
        raise UserError(
            f"{len(data.target)} runs are fewer than the {needed} a fit of "
            f"{int(varying.sum())} varying sources needs; add runs"
        )
    scores = [cross_validate(name, data, seed) for name in models]
    usable = [s for s in scores if np.isfinite(s.rmse)]
    if not usable:
        reasons = "; ".join(f"{s.name}: {s.error}" for s in scores)
        raise UserError(f"no model could be fitted to the runs ({reasons})")
    chosen = min(usable, key=lambda s: s.rmse)
    predictor = fit_model(chosen.name, data, seed, varying)
    found = candidates(data, seed)
    predicted = predictor(found)
    order = np.argsort(-predicted if data.higher_is_better else predicted, kind="stable")
    best = found[order[:TOP]].mean(axis=0)
    return MixtureFit(
        data,
        scores,
        chosen.name,
        predictor,
        rounded(best),
        len(found),
        conformal_radius(data.target - chosen.predicted),
        seed,
    )


def conformal_radius(residuals: Array, coverage: float = COVERAGE) -> float:
    """The half-width of the intervals: the ceil(coverage (n + 1))-th smallest absolute
    out-of-fold residual of n runs (split conformal prediction's rank; the largest where that
    rank passes n, below 39 runs at 95%)."""
    ordered = np.sort(np.abs(residuals))
    rank = int(np.ceil(coverage * (len(ordered) + 1)))
    return float(ordered[min(rank, len(ordered)) - 1])


def line_through(
    weights: Array, source: int, values: Array, varying: npt.NDArray[np.bool_]
) -> Array:
    """Mixtures along the line through `weights` on which `source` takes each of `values`:
    the other varying sources share the rest in the proportions they have in `weights` (evenly
    where they have none), the sources that never vary keep theirs."""
    others = varying.copy()
    others[source] = False
    fixed = float(weights[~varying].sum())
    share = weights * others
    share = share / share.sum() if share.sum() > 0 else others / max(1, others.sum())
    line = np.outer(np.clip(1.0 - fixed - values, 0.0, None), share)
    line[:, source] = values
    line[:, ~varying] = weights[~varying]
    return np.asarray(line, dtype=np.float64)
