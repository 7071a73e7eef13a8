"""The `moe_router_stats` callback on a real `moe-tiny` model and a fake run: the figures it logs
against `router_stats()` and against hand-set statistics, summed over two data ranks (two
threads standing in for an all-reduce), a model cut to a pipeline stage, an eval step reporting
the training forward, `every`, the error for a model without MoE layers, and its registration."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import attrs
import pytest
import torch
from llmtrain_moe.model import RouterStats, build_model
from llmtrain_moe.options import RouterStatsOptions, preset_options
from llmtrain_moe.router_stats import RouterStatsCallback

from llmtrain.core_mesh.config import Choice, ConfigError, structure
from llmtrain.core_mesh.errors import UserError
from llmtrain.core_mesh.interfaces import Callback
from llmtrain.core_mesh.plugins import PluginManager

KEYS = ("balance_loss", "max_load", "dropped_share", "z_loss")


class FakeParallel:
    """What the callback reads of `Parallelized`: the parts and the sum over data ranks."""

    def __init__(self, parts, sum_over_data=None):
        self.parts = parts
        self.data_rank, self.data_world = 0, 1
        self._sum = sum_over_data or (lambda t: t.clone())

    def sum_over_data(self, value: torch.Tensor) -> torch.Tensor:
        return self._sum(value)

    def dim(self, name: str):
        return SimpleNamespace(size=lambda: 1)


def fake_run(model, sum_over_data=None, kind: str = "moe-tiny"):
    return SimpleNamespace(
        model=FakeParallel([model], sum_over_data),
        device=torch.device("cpu"),
        config=SimpleNamespace(model=SimpleNamespace(kind=kind)),
        world=SimpleNamespace(rank=0, world_size=1, is_main=True),
    )


def tiny(**overrides):
    model = build_model(preset_options("moe-tiny", **overrides))
    model.init_weights(torch.Generator().manual_seed(0))
    return model


def forward(model, seed: int) -> None:
    tokens = torch.randint(0, 320, (2, 32), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        model(tokens)


def logged(callback, run, step: int, *, eval_forward=None) -> dict[str, float]:
    """The events of one logged step, as the trainer calls them; the metrics the callback added."""
    callback.after_step(run, step, {"loss": 1.0})
    if eval_forward is not None:
        callback.before_eval(run, step)
        eval_forward()
        callback.after_eval(run, step, {"eval_loss": 1.0})
    metrics: dict[str, float] = {}
    callback.on_log(run, step, metrics, {})
    return metrics


def expected_from(stats: dict[str, dict], n_experts: int) -> dict[str, float]:
    """One rank's figures, from `router_stats()`: per layer and the means over the layers."""
    out, per_layer = {}, []
    for name, s in stats.items():
        layer = {
            "balance_loss": s["balance_loss"],
            "max_load": max(s["load"]) * n_experts,
            "dropped_share": s["dropped"] / s["assignments"],
            "z_loss": s["z_loss"],
        }
        out.update({f"moe/layer{name}/{k}": v for k, v in layer.items()})
        per_layer.append(layer)
    for key in ("balance_loss", "max_load", "z_loss"):
        out[f"moe/{key}"] = sum(layer[key] for layer in per_layer) / len(per_layer)
    dropped = sum(s["dropped"] for s in stats.values())
    out["moe/dropped_share"] = dropped / sum(s["assignments"] for s in stats.values())
    return out


def started(model, **run) -> tuple[RouterStatsCallback, SimpleNamespace]:
    callback = RouterStatsCallback(RouterStatsOptions())
    run = fake_run(model, **run)
    callback.on_run_start(run)
    return callback, run


def test_the_figures_of_a_real_forward_are_router_stats():
    model = tiny(capacity_factor=1.0)  # some choices over capacity
    callback, run = started(model)
    forward(model, 0)
    stats = model.router_stats()
    got = logged(callback, run, 1)
    assert got == pytest.approx(expected_from(stats, 4), rel=1e-6)
    assert sorted(got) == sorted(
        [f"moe/layer{i}/{k}" for i in (0, 1) for k in KEYS] + [f"moe/{k}" for k in KEYS]
    )
    assert 0 < got["moe/dropped_share"] < 1  # capacity 1.0 drops some, not all
    assert got["moe/balance_loss"] >= 1.0 and 1.0 <= got["moe/layer0/max_load"] <= 4.0
    # dropless: nothing dropped; the same keys
    dropless = tiny()
    callback, run = started(dropless)
    forward(dropless, 0)
    again = logged(callback, run, 1)
    assert sorted(again) == sorted(got) and again["moe/dropped_share"] == 0.0


# two data ranks' statistics of layers 0 and 1, set by hand: load (fractions of 64 choices),
# dropped, balance loss, z-loss
RANK_A = {0: ([0.5, 0.25, 0.25, 0.0], 3, 1.5, 2.0), 1: ([0.25] * 4, 0, 1.0, 1.0)}
RANK_B = {0: ([0.25] * 4, 1, 1.0, 3.0), 1: ([0.125, 0.375, 0.25, 0.25], 2, 1.25, 1.0)}


def with_stats(stats: dict) -> torch.nn.Module:
    model = tiny()
    for layer, (load, dropped, balance, z) in stats.items():
        model.blocks[str(layer)].moe.stats = RouterStats(
            torch.tensor(load), torch.tensor(dropped), 64, torch.tensor(balance), torch.tensor(z)
        )
    return model


def test_hand_set_statistics_of_one_rank():
    callback, run = started(with_stats(RANK_A))
    assert logged(callback, run, 1) == pytest.approx(
        {
            "moe/layer0/balance_loss": 1.5,
            "moe/layer0/max_load": 2.0,  # 0.5 of the choices x 4 experts
            "moe/layer0/dropped_share": 3 / 64,
            "moe/layer0/z_loss": 2.0,
            "moe/layer1/balance_loss": 1.0,
            "moe/layer1/max_load": 1.0,  # balanced
            "moe/layer1/dropped_share": 0.0,
            "moe/layer1/z_loss": 1.0,
            "moe/balance_loss": 1.25,
            "moe/max_load": 1.5,
            "moe/dropped_share": 3 / 128,
            "moe/z_loss": 1.5,
        },
        rel=1e-12,
    )


class TwoRankSum:
    """An all-reduce (sum) between two threads, each standing in for one data rank."""

    def __init__(self):
        self.barrier = threading.Barrier(2, timeout=60)
        self.slots: list[torch.Tensor | None] = [None, None]

    def of(self, rank: int):
        def sum_over_data(value: torch.Tensor) -> torch.Tensor:
            self.slots[rank] = value.clone()
            self.barrier.wait()
            total = self.slots[0] + self.slots[1]
            self.barrier.wait()
            return total

        return sum_over_data


def test_two_data_ranks_report_the_counts_of_both():
    reduce = TwoRankSum()
    ranks = [started(with_stats(stats), sum_over_data=reduce.of(r)) for r, stats in
             enumerate([RANK_A, RANK_B])]  # fmt: skip
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(logged, callback, run, 1) for callback, run in ranks]
        got = [f.result(timeout=60) for f in futures]
    assert got[0] == got[1]  # every rank has the run's figures
    # layer 0: choices per expert 32+16, 16+16, 16+16, 0+16 of 128; layer 1: 16+8, 16+24, ...
    assert got[0] == pytest.approx(
        {
            "moe/layer0/balance_loss": 1.25,  # (1.5 + 1.0) / 2, weighted by choices
            "moe/layer0/max_load": 48 / 128 * 4,
            "moe/layer0/dropped_share": 4 / 128,
            "moe/layer0/z_loss": 2.5,
            "moe/layer1/balance_loss": 1.125,
            "moe/layer1/max_load": 40 / 128 * 4,
            "moe/layer1/dropped_share": 2 / 128,
            "moe/layer1/z_loss": 1.0,
            "moe/balance_loss": (1.25 + 1.125) / 2,
            "moe/max_load": (1.5 + 1.25) / 2,
            "moe/dropped_share": 6 / 256,
            "moe/z_loss": (2.5 + 1.0) / 2,
        },
        rel=1e-12,
    )


def test_a_model_cut_to_a_pipeline_stage_reports_its_layers():
    model = tiny(capacity_factor=1.0)
    forward(model, 0)
    stats = model.router_stats()
    model.trim_to_stage([1], first=False, last=True)
    callback, run = started(model)
    got = logged(callback, run, 1)
    assert got == pytest.approx(expected_from({"1": stats["1"]}, 4), rel=1e-6)
    assert sorted(got) == sorted([f"moe/layer1/{k}" for k in KEYS] + [f"moe/{k}" for k in KEYS])


def test_an_eval_step_reports_the_training_forward():
    model = tiny(capacity_factor=1.0)
    callback, run = started(model)
    forward(model, 0)
    trained = model.router_stats()
    got = logged(callback, run, 10, eval_forward=lambda: forward(model, 1))
    assert model.router_stats() != trained  # the evaluation routed other tokens
    assert got == pytest.approx(expected_from(trained, 4), rel=1e-6)
    forward(model, 2)  # the next step reads its own forward
    assert logged(callback, run, 11) == pytest.approx(
        expected_from(model.router_stats(), 4), rel=1e-6
    )


def test_every_logs_on_multiples_only():
    model = tiny()
    callback = RouterStatsCallback(RouterStatsOptions(every=3))
    run = fake_run(model)
    callback.on_run_start(run)
    forward(model, 0)
    assert [bool(logged(callback, run, step)) for step in (1, 2, 3, 4, 6)] == [
        False,
        False,
        True,
        False,
        True,
    ]


def test_a_model_without_moe_layers_is_a_one_line_error():
    callback = RouterStatsCallback(RouterStatsOptions())
    with pytest.raises(UserError) as info:
        callback.on_run_start(fake_run(torch.nn.Linear(2, 2), kind="tiny"))
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("callback moe_router_stats: model kind 'tiny' is not a Mixture")


@attrs.frozen
class Schema:
    callbacks: list[Choice.of("callback")]


def test_registered_by_the_entry_point_with_validated_options():
    plugins = PluginManager(blocked=()).load_entry_points()
    entry = plugins.registry("callback").get("moe_router_stats")
    assert entry.origin.distribution == "llmtrain-moe"
    config = structure({"callbacks": [{"kind": "moe_router_stats"}]}, Schema, plugins=plugins)
    assert config.callbacks[0].options == RouterStatsOptions(every=None)
    assert isinstance(entry.target(config.callbacks[0].options), Callback)
    every = structure(
        {"callbacks": [{"kind": "moe_router_stats", "every": 5}]}, Schema, plugins=plugins
    )
    assert every.callbacks[0].options.every == 5
    with pytest.raises(ConfigError) as info:
        structure(
            {"callbacks": [{"kind": "moe_router_stats", "every": 0, "evry": 1}]},
            Schema,
            plugins=plugins,
        )
    text = str(info.value)
    assert "callbacks[0].every: must be at least 1, got 0" in text
    assert "callbacks[0].evry: unknown key" in text
