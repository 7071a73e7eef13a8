"""What `llmtrain report` shows of a scaling ladder (`llmtrain sweep --ladder`): the answer
first (the fit's law, why it cannot be trusted, and each rung's final loss against its compute
C = flops_per_token x tokens, coloured by model size N, with the fit's curves and its
compute-optimal frontier), and a table that says which rung each run is.

A sweep is a ladder when its manifest.json has `ladder`: one record per rung, its `label`
(`{"C": "1e15", "r": 20}`, or `{"N": "50k", "r": 20}` for a ladder by size, `--params`), the
budget or size asked for, tokens per parameter, the shape and steps chosen. A run is matched to
its rung by the shape (`model.<key>`) and `training.steps` the rung set. A ladder with decay
branches has `branches`: `{run id: {"trunk": id, "start": step}}`: the branch resumed from its
trunk's checkpoint at `start` and decayed, so its metrics.jsonl starts there.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from llmtrain.ablate.runs import Run, is_number, read_json, shown
from llmtrain.core_mesh.errors import UserError

if TYPE_CHECKING:
    from llmtrain.ablate.fit_command import Fits, RunPoint

# what a ladder record holds besides the shape it chose (the rest are `model.<key>`)
RECORD_FIELDS = {
    "label",
    "budget",
    "tokens_per_param",
    "target_params",
    "target_tokens",
    "params",
    "tokens",
    "actual_budget",
    "actual_tokens_per_param",
    "flops_per_token",
    "steps",
}
LEGEND_SIZES = 8  # more model sizes than this get a colour bar instead of legend entries


@attrs.frozen
class Rung:
    """One run's rung of its ladder, as the sweep's manifest recorded it."""

    label: str  # `C=1e15, r=20` or `N=50k, r=20`
    by_size: bool
    budget: float | None  # FLOPs asked for (ladder by budget)
    target_params: float | None  # N asked for (ladder by size)
    tokens_per_param: float | None
    trunk: str | None = None  # a decay branch: the run it resumed from, at step `start`
    start: int | None = None


@attrs.frozen
class Ladder:
    """The rung of each run (by run name) of the sweeps whose manifests describe a ladder."""

    rungs: dict[str, Rung]

    def __bool__(self) -> bool:
        return bool(self.rungs)

    @property
    def by_size(self) -> bool:
        return any(rung.by_size for rung in self.rungs.values())

    @property
    def branched(self) -> bool:
        return any(rung.trunk is not None for rung in self.rungs.values())


def _manifest(sweep: Path) -> dict[str, Any] | None:
    try:
        manifest = read_json(sweep / "manifest.json")
    except (OSError, UserError):
        return None
    return manifest if isinstance(manifest, dict) else None


def _label(record: Mapping[str, Any]) -> str:
    label = record.get("label")
    if isinstance(label, dict):
        return ", ".join(f"{key}={shown(value)}" for key, value in label.items())
    return ""


def _matches(record: Mapping[str, Any], run: Run) -> bool:
    """Whether the run trains the rung's shape for the rung's steps."""
    shape = {k: v for k, v in record.items() if k not in RECORD_FIELDS}
    if run.settings.get("training.steps") != record.get("steps"):
        return False
    return all(run.settings.get(f"model.{key}") == value for key, value in shape.items())


def _number(value: object) -> float | None:
    return float(value) if is_number(value) else None


def read_ladder(runs: Sequence[Run]) -> Ladder:
    """The rungs of the runs that belong to a ladder sweep (their folder's manifest.json has
    `ladder`); empty when none does."""
    rungs: dict[str, Rung] = {}
    manifests: dict[Path, dict[str, Any] | None] = {}
    for run in runs:
        sweep = run.path.parent
        if sweep not in manifests:
            manifests[sweep] = _manifest(sweep)
        manifest = manifests[sweep]
        records = manifest.get("ladder") if manifest else None
        if not manifest or not isinstance(records, list):
            continue
        branches = manifest.get("branches")
        branch = branches.get(run.name) if isinstance(branches, dict) else None
        for record in records:
            if not isinstance(record, dict) or not _matches(record, run):
                continue
            label = record.get("label")
            by_size = isinstance(label, dict) and "N" in label
            rungs[run.name] = Rung(
                label=_label(record),
                by_size=by_size,
                budget=_number(record.get("budget")),
                target_params=_number(record.get("target_params")),
                tokens_per_param=_number(record.get("tokens_per_param")),
                trunk=str(branch["trunk"]) if isinstance(branch, dict) else None,
                start=int(branch["start"]) if isinstance(branch, dict) else None,
            )
            break
    return Ladder(rungs)


def rung_table(
    runs: Sequence[Run], ladder: Ladder, loss_key: str
) -> tuple[list[str], list[list[str]]]:
    """One row per run: its rung (label, the budget or size asked for, tokens per parameter),
    what it trained (N, D, C = flops_per_token x D), the trunk a decay branch resumed from,
    its status and final loss."""
    from llmtrain.ablate.fit_command import final_value

    kinds = {rung.by_size for rung in ladder.rungs.values()}
    asked = "size N asked" if ladder.by_size else "budget C asked"
    if len(kinds) > 1:  # ladders of both kinds: each row's label says which it asked
        asked = "budget C or size N asked"
    header = ["run", "rung", asked, "tokens/param", "N", "D", "C", "status", f"final {loss_key}"]
    if ladder.branched:
        header.insert(7, "decay branch of")
    body = []
    for run in runs:
        rung = ladder.rungs.get(run.name)
        summary = run.summary or {}
        n, d = summary.get("non_embedding_params"), summary.get("tokens")
        per_token = summary.get("flops_per_token")
        compute = per_token * d if is_number(per_token) and is_number(d) else None
        loss = final_value(run, loss_key)
        target = None if rung is None else rung.target_params if rung.by_size else rung.budget
        row = [
            run.name,
            rung.label if rung else "",
            _g(target),
            _g(rung.tokens_per_param if rung else None),
            _g(n),
            _g(d),
            _g(compute),
            run.status,
            "" if loss is None else f"{loss:.4f}",
        ]
        if ladder.branched:
            branch = f"{rung.trunk} at step {rung.start}" if rung and rung.trunk else ""
            row.insert(7, branch)
        body.append(row)
    return header, body


def _g(value: object) -> str:
    return f"{value:.3g}" if is_number(value) else ""


def law(fits: Fits) -> str:
    p = fits.parametric
    return f"L = {p.E:.4g} + {p.A:.4g}/N^{p.alpha:.3g} + {p.B:.4g}/D^{p.beta:.3g}"


def draw_loss_compute(
    points: Sequence[RunPoint], fits: Fits | None, output: Path, loss_key: str
) -> None:
    """Each run's final loss against its compute C (log), coloured by N (log), one marker per
    run; with a fit, each size's fitted loss along C (D = C / (k N)) and the fit's
    compute-optimal frontier (dashed)."""
    import matplotlib as mpl
    import numpy as np
    from matplotlib.figure import Figure

    from llmtrain.ablate.fit import compute_optimal

    figure = Figure(figsize=(7.2, 3.9), layout="constrained")
    ax = figure.subplots()
    sizes = sorted({p.n for p in points})
    norm = mpl.colors.LogNorm(min(sizes), max(sizes) * 1.0001)
    cmap = mpl.colormaps["viridis"]
    labelled = len(sizes) <= LEGEND_SIZES
    computes = [p.compute for p in points]
    grid = np.geomspace(min(computes) / 1.5, max(computes) * 1.5, 120)
    k = math.exp(float(np.mean([math.log(p.compute / (p.n * p.d)) for p in points])))
    for size in sizes:
        colour = cmap(norm(size))
        mine = sorted((p for p in points if p.n == size), key=lambda p: p.compute)
        ax.scatter(
            [p.compute for p in mine],
            [p.loss for p in mine],
            color=colour,
            s=28,
            edgecolor="black",
            linewidth=0.4,
            zorder=3,
            label=f"N={size:.3g}" if labelled else None,
        )
        if fits is not None:  # D = C / (k N) with this size's own FLOPs per token
            own = math.exp(float(np.mean([math.log(p.compute / (p.n * p.d)) for p in mine])))
            span = np.geomspace(mine[0].compute / 1.5, mine[-1].compute * 1.5, 60)
            fitted = fits.parametric.predict(size, span / (own * size)).value
            ax.plot(span, fitted, color=colour, lw=1, alpha=0.8)
    if fits is not None:
        frontier = np.asarray(compute_optimal(list(fits.parametric.params.values()), grid, k).loss)
        if np.isfinite(frontier).any():
            ax.plot(grid, frontier, "k--", lw=1.2, label="fit's compute-optimal frontier")
    if not labelled:
        figure.colorbar(mpl.cm.ScalarMappable(norm, cmap), ax=ax, label="params N")
    ax.set(
        xscale="log",
        xlabel="compute C = flops_per_token x tokens (FLOPs)",
        ylabel=f"final {loss_key}",
        title="each rung's final loss against its compute",
    )
    losses = [p.loss for p in points]
    low, high = min(losses), max(losses)
    ax.set_ylim(low - 0.1 * (high - low) - 1e-3, high + 0.15 * (high - low) + 1e-3)  # the rungs
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output)


def lead_context(runs: Sequence[Run], loss_key: str, fits: Fits | None) -> dict[str, object]:
    """The ladder's answer: the law and its warnings (or why there is no fit), and the
    loss-against-compute figure (None where no run has N, D and a loss)."""
    from llmtrain.ablate import fit_command
    from llmtrain.ablate.html_report import png_data_url

    finished = [run for run in runs if run.finished]
    try:
        points = (
            fits.points
            if fits is not None
            else fit_command.read_points(finished, loss_key, "non_embedding")
        )
    except UserError:
        points = []
    url = None
    if points:
        url = png_data_url(lambda path: draw_loss_compute(points, fits, path, loss_key))
    return {
        "law": "" if fits is None else law(fits),
        "points": len(points),
        "warnings": [] if fits is None else fits.warnings,
        "url": url,
        "alt": f"final {loss_key} against compute, coloured by model size",
        "note": "Each point is one rung: its final "
        f"{loss_key} at its compute C (flops_per_token x tokens from summary.json), coloured by "
        "its model size N. Lines: the fit along C at each size (D = C / (k N)) and, dashed, the "
        "lowest loss the fit allows at each C.",
    }
