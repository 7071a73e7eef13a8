"""The entry point (`moe` in the `llmtrain` group): each preset is a model kind whose options
default to it, and the callback kind `moe_router_stats` logs the routers' statistics. Loading
this module imports no torch (every `llmtrain` start loads it); the builders do."""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmtrain.core_mesh.plugins import Register, hookimpl
from llmtrain_moe.options import PRESETS, MoEOptions, RouterStatsOptions

if TYPE_CHECKING:  # they import torch: only when a model or callback is built
    from llmtrain_moe.model import MoETransformer
    from llmtrain_moe.router_stats import RouterStatsCallback


def build(options: MoEOptions) -> MoETransformer:
    from llmtrain_moe.model import build_model

    return build_model(options)


def _summary(name: str) -> str:
    v = PRESETS[name]
    return (
        f"Mixture-of-Experts decoder, {name} preset (d_model={v['d_model']}, "
        f"n_layers={v['n_layers']}, {v['n_experts']} experts, top-{v['top_k']}); "
        "any option can be overridden"
    )


@hookimpl
def llmtrain_models(register: Register) -> None:
    for name in PRESETS:
        register(name, build, options=MoEOptions, defaults=PRESETS[name], help=_summary(name))
    # no preset: MoEOptions' own defaults; the kind of models read from transformers
    # directories (llmtrain-hf), whose options are all explicit
    register(
        "moe",
        build,
        options=MoEOptions,
        help="Mixture-of-Experts decoder, every option explicit (MoEOptions' defaults)",
    )


def build_router_stats(options: RouterStatsOptions) -> RouterStatsCallback:
    from llmtrain_moe.router_stats import RouterStatsCallback

    return RouterStatsCallback(options)


@hookimpl
def llmtrain_callbacks(register: Register) -> None:
    register(
        "moe_router_stats",
        build_router_stats,
        options=RouterStatsOptions,
        help="log each MoE layer's load balance, dropped tokens and router z-loss",
    )
