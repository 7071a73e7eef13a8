"""Expert parallelism's token exchange: every rank routes its own tokens, sends each (token,
choice) row to the rank holding its expert, runs its own experts on what it receives, and sends
the results back, by two all-to-alls (and their mirror images in backward).

Rows travel sorted by global expert, so a destination rank's rows are contiguous: rank r holds
experts [r * E_local, (r + 1) * E_local). One small all-to-all of the per-expert counts tells
every rank what it receives; the split sizes are the one host sync of the layer (torch's
all-to-all takes them as Python ints).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist

# run(rows sorted by local expert, rows per local expert) -> each row's expert output
RunExperts = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class _AllToAll(torch.autograd.Function):
    """Rows of x go out in `input_splits` pieces, one per rank, and come back in
    `output_splits` pieces; backward sends the gradients the opposite way."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        output_splits: list[int],
        input_splits: list[int],
        group: dist.ProcessGroup,
    ) -> torch.Tensor:
        ctx.splits, ctx.group = (output_splits, input_splits), group
        return _all_to_all(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        output_splits, input_splits = ctx.splits
        return _all_to_all(grad, input_splits, output_splits, ctx.group), None, None, None


def _all_to_all(
    x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
    return out


def all_to_all(
    x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """The differentiable all-to-all of rows."""
    # torch's Function.apply is unannotated (returns Any); forward returns a tensor
    return cast(
        torch.Tensor,
        _AllToAll.apply(x, output_splits, input_splits, group),  # type: ignore[no-untyped-call]
    )


# collectives with data-dependent sizes: a compiled block runs the exchange eagerly
@torch.compiler.disable  # type: ignore[untyped-decorator,unused-ignore]
def run_on_owners(
    rows: torch.Tensor, counts: torch.Tensor, run: RunExperts, group: dist.ProcessGroup
) -> torch.Tensor:
    """Each row's expert output, computed on the rank that holds its expert. `rows` are this
    rank's (token, choice) rows sorted by global expert, `counts` (E,) the rows per expert."""
    world = dist.get_world_size(group)
    per_rank = counts.numel() // world
    send = counts.view(world, per_rank)  # [r, j]: rows for rank r's j-th expert
    recv = torch.empty_like(send)  # [r, j]: rows from rank r for this rank's j-th expert
    dist.all_to_all_single(recv, send.contiguous(), group=group)
    sent, received = torch.stack([send.sum(1), recv.sum(1)]).tolist()
    arrived = all_to_all(rows, received, sent, group)
    # rows arrive by source rank, then by expert: regroup them by expert for the experts' run
    expert_of_row = torch.arange(per_rank, device=rows.device).repeat(world)
    expert_of_row = expert_of_row.repeat_interleave(recv.flatten())
    order = expert_of_row.argsort(stable=True)
    out = run(arrived.index_select(0, order), recv.sum(0))
    out = torch.empty_like(out).index_copy(0, order, out)
    return all_to_all(out, sent, received, group)
