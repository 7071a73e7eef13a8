"""The mixture section of `llmtrain report` and the figure of `llmtrain fit --mixture --plot`:
on a data-mixture sweep (runs training on the same datasets in different proportions), the
mixture the fit predicts best and its predicted target first, then the datasets' best weights
beside the range the runs tried, every model's cross-validation, and one figure: the chosen
model's out-of-fold predictions against what the runs measured, and per dataset the runs'
target against its weight with the fit's prediction along the line through the chosen mixture
on which only that dataset's share changes (the others keep their proportions).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from llmtrain.ablate.runs import Run
from llmtrain.core_mesh.errors import UserError

if TYPE_CHECKING:
    from llmtrain.ablate.mixture_runs import MixtureStudy

LINE_POINTS = 60  # predictions along each dataset's line


def draw(study: MixtureStudy, output: Path) -> None:
    """Predicted (out of fold) against actual, then a panel per dataset, three a row."""
    import math

    import numpy as np

    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise UserError(
            "the mixture figure needs matplotlib: pip install 'llmtrain-ablate[plot]'"
        ) from None
    from llmtrain.ablate.mixture_fit import line_through
    from llmtrain.ablate.plot import COLUMNS, save

    fit, points = study.fit, study.runs
    data, score = fit.data, fit.score
    target, actual = points.target.text, data.target
    panels = 1 + len(points.sources)
    ncols = min(panels, COLUMNS)
    nrows = math.ceil(panels / ncols)
    figure = Figure(figsize=(4.6 * ncols, 3.8 * nrows), layout="constrained")
    figure.suptitle(f"target: {target}", fontsize="medium")
    grid = figure.subplots(nrows, ncols, squeeze=False).flat
    axes = [next(grid) for _ in range(panels)]
    for unused in grid:
        unused.set_visible(False)
    ax = axes[0]
    ax.scatter(score.predicted, actual, s=16, color="C0")
    ends = [min(actual.min(), score.predicted.min()), max(actual.max(), score.predicted.max())]
    ax.plot(ends, ends, "k--", lw=0.8)
    ax.set(
        xlabel=f"predicted ({fit.folds}-fold, out of fold)",
        ylabel="actual target",
        title=f"{fit.model}: Spearman {score.spearman:.3f}, RMSE {score.rmse:.3g}",
    )
    chosen = fit.weights
    varying = data.varying
    best = fit.predicted
    for i, (ax, source) in enumerate(zip(axes[1:], points.sources, strict=True)):
        ax.scatter(data.weights[:, i], actual, s=16, color="C0", label="runs")
        if varying[i]:
            low, high = data.weights[:, i].min(), data.weights[:, i].max()
            values = np.linspace(low, high, LINE_POINTS)
            along = fit.predict(line_through(chosen, i, values, varying))
            ax.plot(values, along.value, color="C1", lw=1.2, label="fit, others in proportion")
            ax.fill_between(values, along.low, along.high, color="C1", alpha=0.12, lw=0)
        ax.errorbar(
            [chosen[i]],
            [best.value],
            yerr=[[best.value - best.low], [best.high - best.value]],
            fmt="*",
            color="C3",
            ms=11,
            capsize=3,
            label=f"chosen {chosen[i]:.2f}",
        )
        ax.set(xlabel=f"weight of {source.name}", ylabel="target", title=source.name)
        ax.legend(fontsize="x-small")
    save(figure, output)


def mixture_context(
    runs: Sequence[Run], target: str | None, seed: int = 0
) -> dict[str, object] | None:
    """The report's mixture section; None where the runs are no mixture sweep (the same
    datasets in every run, their weights differing). A fit that cannot be made says why."""
    from llmtrain.ablate import fit_command, mixture_runs
    from llmtrain.ablate.html_report import png_data_url, table_context

    if not mixture_runs.is_mixture_sweep(runs):
        return None
    given = None if target is None else mixture_runs.parse_target(target)
    try:
        study, how = mixture_runs.study(runs, given, seed)
    except UserError as error:
        return {"error": str(error)}
    fit = study.fit
    direction = "higher" if fit.data.higher_is_better else "lower"
    chosen = how or "given with --target"
    sources, models = fit_command.mixture_tables(study)
    return {
        "error": "",
        "answer": fit_command.mixture_answer(study),
        "ready": fit_command.ready_line(fit.weights),
        "edges": fit_command.mixture_edges(study),
        "target": f"The target: {study.runs.target.text} ({chosen}), {direction} is better; "
        f"each of the {len(study.runs.names)} finished runs is one point.",
        "sources": table_context(*sources, css_id="mixture-weights"),
        "models": table_context(*models, css_id="mixture-models"),
        "method": fit_command.mixture_method(study),
        "url": png_data_url(lambda path: draw(study, path)),
        "figure": "Left: each run's target as the chosen model predicted it when fitted "
        "without the run's fold, against what the run measured. Then, per dataset: the runs' "
        "target against its weight, and the fit's prediction (with its interval) along the "
        "line through the chosen mixture on which only that dataset's share changes, the "
        "others keeping their proportions; the star is the chosen mixture.",
    }
