"""Activation checkpointing, applied in place to blocks (module names and state-dict keys stay).

A checkpointed block keeps only its inputs in forward and recomputes the rest in backward.
`ops` mode keeps the outputs of the expensive operators (every other matmul, attention) and
recomputes the cheap ones (norms, activations, elementwise), PyTorch's selective checkpointing.
A block recomputed in backward runs under the context-parallel attention its forward ran under.
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any, cast

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    SelectiveCheckpointContext,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from llmtrain.parallel.context_parallel import active_attention
from llmtrain.parallel.options import ActivationCheckpointing

_aten = torch.ops.aten
# outputs worth keeping: attention (every backend's op) and reductions across ranks
_ALWAYS_SAVE = {
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    # a model's FlexAttention (document masking on CUDA) is attention too
    torch.ops.higher_order.flex_attention,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops._c10d_functional.all_reduce.default,
}
_MATMULS = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default}


def _op_policy() -> tuple[AbstractContextManager[object], AbstractContextManager[object]]:
    counts: Counter[str] = Counter()

    def policy(
        ctx: SelectiveCheckpointContext, op: object, *args: object, **kwargs: object
    ) -> CheckpointPolicy:
        if op in _ALWAYS_SAVE:
            return CheckpointPolicy.MUST_SAVE
        if op in _MATMULS:
            # the counter is per forward and per recompute, so both see the same decisions
            key = "recompute" if ctx.is_recompute else "forward"
            counts[key] += 1
            if counts[key] % 2:
                return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    # torch's create_selective_checkpoint_contexts has no annotations; it returns the
    # (forward, recompute) context managers that checkpoint's context_fn gives
    return cast(
        tuple[AbstractContextManager[object], AbstractContextManager[object]],
        create_selective_checkpoint_contexts(policy),  # type: ignore[no-untyped-call]
    )


def _contexts(
    selective: bool, attention: AbstractContextManager[object]
) -> tuple[AbstractContextManager[object], AbstractContextManager[object]]:
    """checkpoint's (forward, recompute) contexts under context parallelism: selective
    checkpointing's policy, and for the recompute the attention of this forward (backward runs
    outside it)."""
    forward, recompute = (
        _op_policy() if selective else (contextlib.nullcontext(), contextlib.nullcontext())
    )

    @contextlib.contextmanager
    def both() -> Iterator[None]:
        with recompute, attention:
            yield

    return forward, both()


def _checkpoint_forward(block: nn.Module, selective: bool) -> None:
    inner = block.forward

    @functools.wraps(inner)
    def forward(*args: object, **kwargs: Any) -> object:
        # (a compiled block's checkpoint takes dispatch modes alone as its contexts)
        attention = None if torch.compiler.is_compiling() else active_attention()
        if attention is not None:
            context_fn = functools.partial(_contexts, selective, attention)
            return checkpoint(inner, *args, use_reentrant=False, context_fn=context_fn, **kwargs)
        if selective:
            return checkpoint(inner, *args, use_reentrant=False, context_fn=_op_policy, **kwargs)
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    block.forward = forward


def apply_activation_checkpointing(
    blocks: list[nn.Module], options: ActivationCheckpointing, indices: list[int] | None = None
) -> int:
    """Checkpoint the blocks the options choose (`every` counts by each block's index in the whole
    model, so a pipeline stage picks the same blocks as one process would); returns how many."""
    chosen = 0
    for i, block in zip(indices or range(len(blocks)), blocks, strict=True):
        if options.mode == "none" or (options.mode == "blocks" and i % options.every):
            continue
        _checkpoint_forward(block, selective=options.mode == "ops")
        chosen += 1
    return chosen
