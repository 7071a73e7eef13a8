"""`llmtrain sweep --mixtures N`: random data mixtures for a mixture study (RegMix, arXiv
2407.01492). N runs weight the base config's `data.train` datasets by draws from a Dirichlet
distribution, so that a regression from weights to a target loss can be fitted over them
(`llmtrain fit --mixture` reads the weights back from each run's config.yaml).

Mixture k is drawn by its own generator, numpy's `default_rng((seed, k))`: it depends on the
seed, alpha and k alone, never on N, so a swarm grown from 16 to 32 mixtures keeps its first
16 runs (ids and configs). The mixtures are one axis of the sweep (`data.weights`, its runs
shown as `mix=003`), crossed with the others like any.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import PurePosixPath

import attrs
import numpy as np

from llmtrain.core_mesh.config import key_path
from llmtrain.core_mesh.errors import UserError
from llmtrain.train_loop.experiments.sweep_plan import WEIGHTS, Axis, PlannedRun, read_base

DECIMALS = 4  # a drawn weight is a multiple of 1e-4, the weights of a run sum to 1
_UNITS = 10**DECIMALS
LABEL = "mix"  # run ids show mixture k as mix=003


@attrs.frozen
class Mixtures:
    """The draw: `weights[k]` is mixture k, one weight per dataset of `data.train`."""

    n: int
    alpha: float | list[float]  # as given: one for every dataset, or one per dataset
    seed: int
    datasets: list[str]  # the paths of data.train, in order
    names: list[str]  # what the dry-run table calls them
    weights: list[list[float]]

    @property
    def flag(self) -> str:
        return f"--mixtures {self.n}"

    def axis(self) -> Axis:
        """The mixtures as one axis of the sweep: each sets data.weights."""
        return Axis(
            (WEIGHTS,),
            [(w,) for w in self.weights],
            (self.flag,),
            labels=[{LABEL: f"{k:03d}"} for k in range(self.n)],
        )

    def record(self) -> dict[str, object]:
        """What manifest.json keeps of the draw (the weights are the axis's values)."""
        return {
            "n": self.n,
            "alpha": self.alpha,
            "seed": self.seed,
            "datasets": self.datasets,
            "numpy": np.__version__,
        }

    def table(self, planned: Sequence[PlannedRun]) -> str:
        """The dry-run listing: each run's id and the weight of every dataset."""
        from llmtrain.ablate.compare import rich_table

        body = []
        for run in planned:
            weights = run.settings[WEIGHTS]
            assert isinstance(weights, list)
            body.append([run.id, *(f"{w:.{DECIMALS}f}" for w in weights)])
        return rich_table(["run id", *self.names], body)


def mixtures_from(
    n: int | None,
    alpha: str | None,
    seed: int | None,
    *,
    base: str,
    overrides: Sequence[str],
    axes: Sequence[Axis],
) -> Mixtures | None:
    """The mixtures of `--mixtures N --alpha A --mixture-seed S` (None without --mixtures),
    checked against the other axes and the base config (with its overrides)."""
    if n is None:
        given = [
            flag for flag, v in (("--alpha", alpha), ("--mixture-seed", seed)) if v is not None
        ]
        if given:
            raise UserError(f"{', '.join(given)} draw data mixtures: add --mixtures N")
        return None
    if n < 1:
        raise UserError(f"--mixtures must be at least 1, got {n}")
    if seed is not None and seed < 0:
        raise UserError(f"--mixture-seed must be 0 or more, got {seed}")
    alphas = _parse_alpha(alpha)
    _refuse_weight_axes(axes, f"--mixtures {n}")
    datasets, names = _datasets(base, overrides)
    if len(alphas) not in (1, len(datasets)):
        raise UserError(
            f"--alpha {alpha}: {len(alphas)} values for the {len(datasets)} datasets of "
            "data.train; give one, or one per dataset"
        )
    if len(alphas) == 1:
        alphas = alphas * len(datasets)
    seed = 0 if seed is None else seed
    return Mixtures(
        n=n,
        alpha=alphas[0] if alpha is None or "," not in alpha else alphas,
        seed=seed,
        datasets=datasets,
        names=names,
        weights=[draw(k, alphas, seed) for k in range(n)],
    )


def draw(k: int, alphas: Sequence[float], seed: int) -> list[float]:
    """Mixture k of the seed: a Dirichlet(alphas) draw of its own generator, rounded."""
    weights = np.random.default_rng((seed, k)).dirichlet(alphas)
    if not np.all(np.isfinite(weights)) or weights.sum() <= 0:  # numpy < 1.25, alpha near 0
        raise UserError(
            f"--alpha: numpy {np.__version__} drew no mixture from alpha {min(alphas):g}; "
            "raise --alpha"
        )
    return rounded([float(w) for w in weights])


def rounded(weights: Sequence[float]) -> list[float]:
    """Weights (summing to 1) as multiples of 10^-DECIMALS that sum to exactly 1: each rounded
    down, the units left over going to the largest remainders. A weight may round to 0 (that
    dataset is left out); every positive one is at least 10^-DECIMALS of the total, far above
    the sampler's MIN_WEIGHT, and one is always positive."""
    total = sum(weights)
    scaled = [w / total * _UNITS for w in weights]
    units = [math.floor(s) for s in scaled]
    by_remainder = sorted(range(len(scaled)), key=lambda i: (units[i] - scaled[i], i))
    for i in by_remainder[: _UNITS - sum(units)]:
        units[i] += 1
    return [u / _UNITS for u in units]


def _parse_alpha(text: str | None) -> list[float]:
    """`--alpha 0.5` or `--alpha 1,2,0.5` (one per dataset); each a positive number."""
    if text is None:
        return [1.0]
    try:
        alphas = [float(part) for part in text.split(",")]
    except ValueError:
        alphas = []
    if not alphas or not all(math.isfinite(a) and a > 0 for a in alphas):
        raise UserError(
            f"--alpha {text}: give a positive number, or a comma list of one per dataset "
            "of data.train"
        )
    return alphas


def _refuse_weight_axes(axes: Sequence[Axis], flag: str) -> None:
    """An axis over data.weights, or over data.train (its datasets or their weights), would
    undo or reshuffle the draw."""
    for axis in axes:
        for key, given in zip(axis.keys, axis.flags, strict=True):
            path = key_path(key)
            if path == ("data",) or path[:2] in (("data", "weights"), ("data", "train")):
                raise UserError(
                    f"{given} and {flag} both set the weights of data.train's datasets: "
                    "--mixtures draws them; drop one"
                )


def _datasets(base: str, overrides: Sequence[str]) -> tuple[list[str], list[str]]:
    """The paths of the base's data.train and their names (a dataset's `name`, else its
    file's stem; numbered where two would read the same)."""
    raw, _ = read_base(base, overrides)
    data = raw.get("data")
    data = data if isinstance(data, dict) else {}
    if data.get("phases"):
        raise UserError(
            f"{base}: data.phases is a mixture schedule: phases carry their own weights; "
            "--mixtures draws one mixture per run (drop data.phases)"
        )
    train = data.get("train")
    if not isinstance(train, list) or len(train) < 2:
        count = len(train) if isinstance(train, list) else 0
        raise UserError(
            f"{base}: a mixture needs at least two datasets in data.train, the base has {count}"
        )
    paths, names = [], []
    for entry in train:
        entry = entry if isinstance(entry, dict) else {"path": entry}
        paths.append(str(entry.get("path")))
        name = entry.get("name")
        names.append(str(name) if name else PurePosixPath(paths[-1].rstrip("/")).stem)
    if len(set(names)) < len(names):
        names = [f"{i}:{name}" for i, name in enumerate(names)]
    return paths, names
