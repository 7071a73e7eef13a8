"""Tensor parallelism (+ sequence parallelism) from a model's `tp_plan`.

The plan maps module paths (globs such as `blocks.*.attn.wq`) to style names; this module turns
each name into a torch ParallelStyle (or a small hook) on the `tp` mesh:

| style | what happens |
|---|---|
| `embedding` | rows (vocab or positions) sharded; output sharded along the sequence with SP, else replicated |
| `colwise` | output features sharded; input replicated |
| `rowwise` | input features sharded; output reduced (reduce-scattered along the sequence with SP) |
| `sequence_parallel` | norms run on sequence shards (only with SP; otherwise left alone) |
| `sequence_parallel_residual` | the same for a norm whose output joins the residual stream (Gemma's norms after each sublayer): its output is this rank's positions as a plain tensor |
| `gather_input` | the module's first input is gathered from sequence shards (only with SP) |
| `colwise_output` | the output projection; logits replicated, or vocab-sharded with loss parallelism |
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

STYLES = (
    "embedding",
    "colwise",
    "rowwise",
    "sequence_parallel",
    "sequence_parallel_residual",
    "gather_input",
    "colwise_output",
)


def _matches(name: str, pattern: str) -> bool:
    """Glob match per path component: `blocks.*.wq` matches `blocks.3.wq`, not `blocks.3.x.wq`."""
    parts, globs = name.split("."), pattern.split(".")
    return len(parts) == len(globs) and all(
        fnmatch.fnmatchcase(p, g) for p, g in zip(parts, globs, strict=True)
    )


def resolve_plan(module: nn.Module, plan: dict[str, str], *, strict: bool = True) -> dict[str, str]:
    """Module path -> style for every module a plan entry (glob) names. Unknown styles are
    errors; so are entries that match nothing when `strict` (a plan out of step with its
    model). A pipeline stage resolves leniently: its missing layers live on other stages."""
    names = [name for name, _ in module.named_modules() if name]
    resolved: dict[str, str] = {}
    for pattern, style in plan.items():
        if style not in STYLES:
            raise ValueError(
                f"tp_plan entry {pattern!r}: unknown style {style!r}; known: {', '.join(STYLES)}"
            )
        matches = [n for n in names if _matches(n, pattern)]
        if strict and not matches:
            raise ValueError(f"tp_plan entry {pattern!r} matches no module of the model")
        for name in matches:
            resolved[name] = style
    return resolved


def _gather_sequence(
    mesh: DeviceMesh,
) -> Callable[[nn.Module, tuple[Any, ...]], tuple[Any, ...]]:
    def hook(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        x = args[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, (Shard(1),), run_check=False)
        return (x.redistribute(mesh, (Replicate(),)).to_local(), *args[1:])

    return hook


def _style(name: str, sequence_parallel: bool, loss_parallel: bool) -> ParallelStyle | None:
    sp = sequence_parallel
    if name == "embedding":
        return RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(1) if sp else Replicate()
        )
    if name == "colwise":
        return ColwiseParallel()
    if name == "rowwise":
        return RowwiseParallel(output_layouts=Shard(1) if sp else Replicate())
    if name == "sequence_parallel":
        return SequenceParallel() if sp else None
    if name == "sequence_parallel_residual":
        # a plain tensor of this rank's positions out, as the row-wise layers and the embedding
        # give, so that it joins the residual stream
        return SequenceParallel(use_local_output=True) if sp else None
    if name == "colwise_output":
        return ColwiseParallel(
            input_layouts=Shard(1) if sp else Replicate(),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    raise AssertionError(name)


def apply_tensor_parallel(
    module: nn.Module,
    plan: dict[str, str],
    tp_mesh: DeviceMesh,
    *,
    sequence_parallel: bool,
    loss_parallel: bool,
    strict: bool = True,
) -> None:
    """Shard `module` in place over `tp_mesh` following its plan (`strict`: see resolve_plan)."""
    for path, style_name in resolve_plan(module, plan, strict=strict).items():
        target = module.get_submodule(path)
        if style_name == "gather_input":
            if sequence_parallel:
                target.register_forward_pre_hook(_gather_sequence(tp_mesh))
            continue
        style = _style(style_name, sequence_parallel, loss_parallel)
        if style is not None:
            parallelize_module(target, tp_mesh, style)
