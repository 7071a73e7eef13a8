"""parallel's plugin (entry point `parallel`): the `default` strategy. Loading it imports no torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmtrain.core_mesh.plugins import Register, hookimpl
from llmtrain.parallel.options import ParallelOptions

if TYPE_CHECKING:  # imports torch: only when the strategy is built
    from llmtrain.parallel.strategy import DefaultStrategy


def build(options: ParallelOptions) -> DefaultStrategy:
    from llmtrain.parallel.strategy import DefaultStrategy

    return DefaultStrategy(options)


@hookimpl
def llmtrain_parallel_strategies(register: Register) -> None:
    register(
        "default",
        build,
        options=ParallelOptions,
        help="TP (+SP), activation checkpointing, compile, FSDP2/HSDP or DDP, pipeline and "
        "context parallelism, as the mesh asks",
    )
