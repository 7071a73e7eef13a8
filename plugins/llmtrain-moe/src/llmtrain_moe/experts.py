"""The experts of one MoE layer: E MLPs of one shape whose weights are stacked parameters
[E, out_features, in_features] (nn.Linear's layout per expert), so FSDP shards them per block
like any other parameter.

Dispatch sorts the routed (token, choice) pairs by expert and runs each expert on its contiguous
slice: with a grouped matmul where torch has one (`F.grouped_mm`, fast on CUDA in bf16), else
one matmul per expert. The results go back to their (token, choice) slots by a copy to unique
indices and are summed over the k choices in a fixed order, so the forward is deterministic on
every device (no scatter-add; the backward of the token gather is one on CUDA).

Under expert parallelism (`shard_experts`) each rank holds a contiguous share of the experts as
DTensors sharded on the expert dimension, and `routed` sends the rows to the ranks holding their
experts and back (`llmtrain_moe.dispatch`); the numbers are those of one process.

The module is used through `routed` and `dense`, never called: under tensor parallelism the
plan replicates its parameters with a style whose forward hooks would take the input for a
sequence shard.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from llmtrain_moe.dispatch import run_on_owners

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

# linear(x, w): x times w's matrices transposed; what `_mlp` applies
Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# (w1, w3 or None without a gate, w2) as plain tensors
Weights = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]

_GROUPED_MM: Callable[..., torch.Tensor] | None = getattr(F, "grouped_mm", None) or getattr(
    torch, "_grouped_mm", None
)

try:
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    _DTENSOR: type[DTensor] | None = DTensor
except ImportError:  # a torch build without distributed support
    _DTENSOR = None


def _expert_linear(e: int) -> Linear:
    """linear(x, w) with expert `e`'s matrix of the stacked weight w."""

    def linear(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.linear(a, w[e])

    return linear


def expert_counts(expert: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Rows per expert (n_experts,) of a vector of expert ids: a fixed-size result (unlike
    bincount's), so a compiled graph needs no break here."""
    ones = torch.ones_like(expert)
    return torch.zeros(n_experts, dtype=expert.dtype, device=expert.device).scatter_add_(
        0, expert, ones
    )


def local(t: torch.Tensor) -> torch.Tensor:
    """A parameter as a plain tensor: tensor parallelism replicates the MoE layers' parameters
    as DTensors over tp, and every rank computes with its (identical) local copy; expert
    parallelism shards the experts, and each rank computes with its own."""
    return t.to_local() if _DTENSOR is not None and isinstance(t, _DTENSOR) else t


class StackedExperts(nn.Module):
    """E MLPs of one shape as stacked weights; what routed and shared experts have in common."""

    def __init__(self, n_experts: int, d_model: int, hidden: int, *, gated: bool):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, d_model))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, d_model)) if gated else None
        self.w2 = nn.Parameter(torch.empty(n_experts, d_model, hidden))

    @property
    def n_experts(self) -> int:
        """Experts in the stack: all of them, also where this rank holds a share (a DTensor's
        shape is the global one)."""
        return int(self.w1.shape[0])

    def dense(self, x: torch.Tensor) -> torch.Tensor:
        """Expert 0 on every row of x (..., d): the shared expert, which every token takes."""
        return self._mlp(x, lambda a, w: F.linear(a, w[0]), self._weights())

    def _weights(self) -> Weights:
        return local(self.w1), local(self.w3) if self.w3 is not None else None, local(self.w2)

    @staticmethod
    def _mlp(x: torch.Tensor, linear: Linear, weights: Weights) -> torch.Tensor:
        """GELU: w2(gelu(w1 x)). SwiGLU: w2(silu(w1 x) * w3 x), as llmtrain-models' MLP."""
        w1, w3, w2 = weights
        if w3 is None:
            h = F.gelu(linear(x, w1), approximate="tanh")
        else:
            h = F.silu(linear(x, w1)) * linear(x, w3)
        return linear(h, w2)

    def expert_params(self) -> int:
        """Parameters of one expert."""
        return sum(p.numel() for p in self.parameters()) // self.n_experts


class SharedExpert(StackedExperts):
    """One expert every token takes (DeepSeek-style): never routed, never split over ranks."""

    def __init__(self, d_model: int, hidden: int, *, gated: bool):
        super().__init__(1, d_model, hidden, gated=gated)


class Experts(StackedExperts):
    """The routed experts of one MoE layer (core-mesh's `ExpertParallel`)."""

    def __init__(
        self, n_experts: int, d_model: int, hidden: int, *, gated: bool, matmul: str = "auto"
    ):
        super().__init__(n_experts, d_model, hidden, gated=gated)
        self.matmul = matmul
        self.ep_mesh: DeviceMesh | None = (
            None  # expert parallelism's 1-D mesh (None: this rank has all)
        )

    def shard_experts(self, ep_mesh: DeviceMesh, /) -> None:
        """Keep this rank's share of the experts (core-mesh's `ExpertParallel`): the stacked
        weights become DTensors sharded on the expert dimension over `ep_mesh`, whose global
        shape (and state-dict key) stays that of all experts, so checkpoints reshard."""
        for name in ("w1", "w3", "w2"):
            weight = getattr(self, name)
            if weight is not None:
                shards = distribute_tensor(weight.data, ep_mesh, [Shard(0)])
                setattr(self, name, nn.Parameter(shards, requires_grad=weight.requires_grad))
        self.ep_mesh = ep_mesh

    def routed(
        self,
        x: torch.Tensor,
        experts: torch.Tensor,
        weights: torch.Tensor,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """sum_j weights[n, j] * expert_{experts[n, j]}(x[n]) for x (N, d) and choices (N, k);
        choices where `keep` is False contribute nothing."""
        if self.ep_mesh is not None:
            # expert parallelism makes the experts their own FSDP unit, whose hooks (gather the
            # shards, reduce the gradients) run only when the module is called
            out: torch.Tensor = self(x, experts, weights, keep)
            return out
        return self.forward(x, experts, weights, keep)

    def forward(
        self,
        x: torch.Tensor,
        experts: torch.Tensor,
        weights: torch.Tensor,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`routed`'s computation; call `routed` (see the module's docstring)."""
        N, k = experts.shape
        slot = torch.arange(N * k, device=x.device)  # slot n * k + j: token n's choice j
        expert = experts.reshape(-1)
        if keep is not None:
            kept = keep.reshape(-1)
            slot, expert = slot[kept], expert[kept]
        order = expert.argsort(stable=True)
        slot, expert = slot[order], expert[order]
        rows = x.index_select(0, slot // k)
        counts = expert_counts(expert, self.n_experts)
        weights_ = self._weights()

        def run(rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
            return self._run(rows, counts, weights_)

        h: torch.Tensor
        if self.ep_mesh is not None and rows.device.type != "meta":
            h = run_on_owners(rows, counts, run, self.ep_mesh.get_group())
        else:
            h = run(rows, counts)
        out = h.new_zeros(N * k, h.size(-1)).index_copy(0, slot, h).view(N, k, -1)
        return (out * weights.unsqueeze(-1).to(out.dtype)).sum(dim=1)

    def use_grouped(self, x: torch.Tensor) -> bool:
        if self.matmul == "loop" or x.device.type == "meta":
            return False
        if self.matmul == "grouped":
            if _GROUPED_MM is None:
                raise RuntimeError(
                    f"model.expert_matmul: grouped needs torch's grouped matmul, which torch "
                    f"{torch.__version__} lacks; use auto or loop"
                )
            return True
        # auto: where the fused kernel exists (CUDA, bf16) and the shapes meet its alignment
        aligned = all(n % 8 == 0 for n in self.w2.shape[1:])
        return _GROUPED_MM is not None and x.is_cuda and x.dtype == torch.bfloat16 and aligned

    def _run(self, xs: torch.Tensor, counts: torch.Tensor, weights: Weights) -> torch.Tensor:
        """Each expert's MLP over its rows of xs: rows sorted by expert, `counts` rows for each
        expert of `weights` (this rank's experts)."""
        if self.use_grouped(xs):
            grouped_mm = _GROUPED_MM
            if grouped_mm is None:  # use_grouped says False (or raises) without it
                raise RuntimeError("torch's grouped matmul is missing")
            offs = counts.cumsum(0, dtype=torch.int32)  # on the device: no host sync

            def linear(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
                return grouped_mm(a, w.transpose(-2, -1), offs=offs)

            return self._mlp(xs, linear, weights)
        outs: list[torch.Tensor] = []
        # torch.split, not Tensor.split: the same call, but the method has no annotations
        for e, rows in enumerate(torch.split(xs, self._sizes(counts, xs.size(0)))):
            if rows.size(0):
                outs.append(self._mlp(rows, _expert_linear(e), weights))
        if not outs:
            # no rows for any expert here: an empty product still gives the weights a (zero)
            # gradient, as data parallelism's reduction expects of every rank
            return self._mlp(xs, _expert_linear(0), weights)
        return torch.cat(outs)

    @staticmethod
    def _sizes(counts: torch.Tensor, n: int) -> list[int]:
        if counts.device.type == "meta":
            # no values to count (memory estimates): an even split, what balancing aims for
            e = counts.numel()
            return [n // e + (i < n % e) for i in range(e)]
        sizes: list[int] = counts.tolist()
        return sizes
