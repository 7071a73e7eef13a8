"""Data parallelism: FSDP2 `fully_shard` per block and at the root (HSDP on a 2-D mesh), or DDP
(replication through the same FSDP2 machinery) when the layout only replicates.

Gradients are averaged across data-parallel ranks (the collective's own average, which gloo
supports and keeps low-precision reductions in range); `Parallelized` scales the loss to match.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from llmtrain.parallel.options import ParallelOptions

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def mixed_precision(options: ParallelOptions) -> MixedPrecisionPolicy:
    return MixedPrecisionPolicy(
        param_dtype=getattr(torch, options.param_dtype),
        reduce_dtype=getattr(torch, options.reduce_dtype),
    )


def should_reshard(options: ParallelOptions, pipelined: bool, is_last_block: bool) -> bool:
    if options.reshard_after_forward == "always":
        return True
    if options.reshard_after_forward == "never":
        return False
    # default: keep parameters gathered where they are needed again at once (the last block
    # starts backward; pipeline micro-batches reuse every stage's parameters)
    return not pipelined and not is_last_block


def apply_fsdp(
    module: nn.Module,
    blocks: list[nn.Module],
    dp_mesh: DeviceMesh,
    options: ParallelOptions,
    *,
    pipelined: bool,
) -> None:
    """Shard each block, then the rest of the module (embeddings, final norm, head) at the root."""
    mp = mixed_precision(options)
    for i, block in enumerate(blocks):
        reshard = should_reshard(options, pipelined, i == len(blocks) - 1)
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(
        module,
        mesh=dp_mesh,
        mp_policy=mp,
        reshard_after_forward=should_reshard(options, pipelined, True),
    )


def apply_ddp(
    module: nn.Module, blocks: list[nn.Module], dp_mesh: DeviceMesh, options: ParallelOptions
) -> None:
    """Replicate parameters; all-reduce gradients per block so communication overlaps backward."""
    mp = mixed_precision(options)
    for block in blocks:
        replicate(block, mesh=dp_mesh, mp_policy=mp)
    replicate(module, mesh=dp_mesh, mp_policy=mp)


def set_gradient_sync(module: nn.Module, enabled: bool) -> None:
    """Skip (False) or do (True) the gradient reduction in the next backward: micro-batches of
    one step reduce once, after the last."""
    if isinstance(module, FSDPModule):
        module.set_requires_gradient_sync(enabled)
