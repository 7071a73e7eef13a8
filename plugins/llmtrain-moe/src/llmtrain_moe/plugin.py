"""The entry point (`moe` in the `llmtrain` group): each preset is a model kind whose options
default to it, and the callback kind `moe_router_stats` logs the routers' statistics. Loading
this module imports no torch (every `llmtrain` start loads it); the builders do."""

from __future__ import annotations

from llmtrain.core_mesh.plugins import hookimpl
from llmtrain_moe.options import PRESETS, MoEOptions, RouterStatsOptions


def build(options: MoEOptions):
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
def llmtrain_models(register):
    for name in PRESETS:
        register(name, build, options=MoEOptions, defaults=PRESETS[name], help=_summary(name))


def build_router_stats(options: RouterStatsOptions):
    from llmtrain_moe.router_stats import RouterStatsCallback

    return RouterStatsCallback(options)


@hookimpl
def llmtrain_callbacks(register):
    register(
        "moe_router_stats",
        build_router_stats,
        options=RouterStatsOptions,
        help="log each MoE layer's load balance, dropped tokens and router z-loss",
    )
