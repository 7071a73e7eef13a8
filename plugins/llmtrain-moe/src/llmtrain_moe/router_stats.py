"""The router statistics callback (kind `moe_router_stats`): at logged steps, each MoE layer's
load balance, dropped share and z-loss in the step's metrics, for the whole global batch.

Each layer's statistics describe its last training forward on this rank (the last
micro-batch). They are turned back into counts (expert loads x token choices, dropped choices,
loss x choices) and summed over the ranks that see different tokens: the data-parallel ranks
(`sum_over_data`) and context-parallel shards. Tensor-parallel ranks route the same whole
sequences, so they are not summed. Under a pipeline each stage holds some of the layers; the
stages add their tables (zeros where a layer is elsewhere), so every rank reports every layer.
A model cut to a stage outside a pipeline reports the layers it has.

The statistics are read after the step and before an evaluation runs, so an eval step reports
the training forward, not the evaluation's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from llmtrain.core_mesh.errors import UserError
from llmtrain.core_mesh.interfaces import Callback, TrainingRun
from llmtrain_moe.model import MoETransformer, RouterStats
from llmtrain_moe.options import RouterStatsOptions

KIND = "moe_router_stats"


def moe_models(parts: Sequence[torch.nn.Module]) -> list[MoETransformer]:
    """The MoE models (or pipeline stages of one) among a rank's model parts, wrapped or not."""
    return [m for part in parts for m in part.modules() if isinstance(m, MoETransformer)]


class RouterStatsCallback(Callback):
    def __init__(self, options: RouterStatsOptions):
        self.options = options
        self.models: list[MoETransformer] = []
        self.held: tuple[int, dict[int, RouterStats]] | None = None  # (step, stats by layer)

    def on_run_start(self, run: TrainingRun) -> None:
        self.models = moe_models(run.model.parts)
        if not self.models:
            kind = getattr(run.config.model, "kind", "?")
            raise UserError(
                f"callback {KIND}: model kind {kind!r} is not a Mixture-of-Experts model of "
                "llmtrain-moe (e.g. moe-tiny, moe-small); remove the callback or change the model"
            )

    # the training forward's statistics, kept before an evaluation's forward replaces them
    def after_step(self, run: TrainingRun, step: int, metrics: dict[str, Any]) -> None:
        if self.held is None or self.held[0] != step:
            self.held = (step, self._current())

    def before_eval(self, run: TrainingRun, step: int) -> None:
        self.held = (step, self._current())

    def on_log(
        self, run: TrainingRun, step: int, metrics: dict[str, float], rank_metrics: dict[str, float]
    ) -> None:
        if not self.models or (self.options.every is not None and step % self.options.every):
            return
        stats = self.held[1] if self.held is not None and self.held[0] == step else self._current()
        cfg = self.models[0].cfg
        table = counts_table(stats, cfg.n_layers, cfg.n_experts, run.device)
        table = run.model.sum_over_data(table)
        for dim in ("cp", "pp"):
            mesh = run.model.dim(dim)
            if mesh.size() > 1:
                dist.all_reduce(table, group=mesh.get_group())
        metrics.update(figures(table.tolist(), cfg.n_experts))

    def _current(self) -> dict[int, RouterStats]:
        return {
            int(name): moe.stats
            for model in self.models
            for name, moe in model.moe_layers().items()
            if moe.stats is not None
        }


def counts_table(
    stats: dict[int, RouterStats], n_layers: int, n_experts: int, device: torch.device
) -> torch.Tensor:
    """(n_layers, n_experts + 5) float64, a row per layer: the token choices of each expert,
    dropped choices, all choices, balance loss x choices, z-loss x choices, 1 (the layer is
    here). Rows of layers this rank lacks are zeros, so summing tables over ranks adds up."""
    table = torch.zeros(n_layers, n_experts + 5, dtype=torch.float64, device=device)
    for layer, s in stats.items():
        choices = float(s.assignments)
        table[layer, :n_experts] = s.load.to(device, torch.float64) * choices
        table[layer, n_experts] = s.dropped.to(device, torch.float64)
        table[layer, n_experts + 1] = choices
        table[layer, n_experts + 2] = s.balance_loss.to(device, torch.float64) * choices
        table[layer, n_experts + 3] = s.z_loss.to(device, torch.float64) * choices
        table[layer, n_experts + 4] = 1.0
    return table


def figures(table: list[list[float]], n_experts: int) -> dict[str, float]:
    """The metrics of a summed table: per layer `moe/layer{i}/...` and the means over layers."""
    out: dict[str, float] = {}
    layers: list[dict[str, float]] = []
    dropped = choices = 0.0
    for i, row in enumerate(table):
        n = row[n_experts + 1]
        if not row[n_experts + 4] or not n:
            continue  # no rank holds this layer (a model cut to a pipeline stage)
        layer = {
            "balance_loss": row[n_experts + 2] / n,
            "max_load": max(row[:n_experts]) / n * n_experts,
            "dropped_share": row[n_experts] / n,
            "z_loss": row[n_experts + 3] / n,
        }
        out.update({f"moe/layer{i}/{key}": value for key, value in layer.items()})
        layers.append(layer)
        dropped, choices = dropped + row[n_experts], choices + n
    if layers:
        for key in ("balance_loss", "max_load", "z_loss"):
            out[f"moe/{key}"] = sum(layer[key] for layer in layers) / len(layers)
        out["moe/dropped_share"] = dropped / choices
    return out
