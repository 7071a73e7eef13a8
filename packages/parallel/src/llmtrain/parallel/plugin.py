"""parallel's plugin (entry point `parallel`): the `default` strategy. Loading it imports no torch."""

from __future__ import annotations

from llmtrain.core_mesh.plugins import hookimpl
from llmtrain.parallel.options import ParallelOptions


def build(options: ParallelOptions):
    from llmtrain.parallel.strategy import DefaultStrategy

    return DefaultStrategy(options)


@hookimpl
def llmtrain_parallel_strategies(register):
    register(
        "default",
        build,
        options=ParallelOptions,
        help="TP (+SP), activation checkpointing, compile, FSDP2/HSDP or DDP, pipeline and "
        "context parallelism, as the mesh asks",
    )
