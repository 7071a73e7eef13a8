"""The experts of one MoE layer: E MLPs of one shape whose weights are stacked parameters
[E, out_features, in_features] (nn.Linear's layout per expert), so FSDP shards them per block
like any other parameter.

Dispatch sorts the routed (token, choice) pairs by expert and runs each expert on its contiguous
slice: with a grouped matmul where torch has one (`F.grouped_mm`, fast on CUDA in bf16), else
one matmul per expert. The results go back to their (token, choice) slots by a copy to unique
indices and are summed over the k choices in a fixed order, so the forward is deterministic on
every device (no scatter-add; the backward of the token gather is one on CUDA).

The module is used through `routed` and `dense`, never called: under tensor parallelism the
plan replicates its parameters with a style whose forward hooks would take the input for a
sequence shard.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

# linear(x, w): x times w's matrices transposed; what `_mlp` applies
Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# (w1, w3 or None without a gate, w2) as plain tensors
Weights = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]

_GROUPED_MM: Callable[..., torch.Tensor] | None = getattr(F, "grouped_mm", None) or getattr(
    torch, "_grouped_mm", None
)

try:
    from torch.distributed.tensor import DTensor

    _DTENSOR: type[DTensor] | None = DTensor
except ImportError:  # a torch build without distributed support
    _DTENSOR = None


def _expert_linear(e: int) -> Linear:
    """linear(x, w) with expert `e`'s matrix of the stacked weight w."""

    def linear(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.linear(a, w[e])

    return linear


def local(t: torch.Tensor) -> torch.Tensor:
    """A parameter as a plain tensor: tensor parallelism replicates the MoE layers' parameters
    as DTensors over tp, and every rank computes with its (identical) local copy."""
    return t.to_local() if _DTENSOR is not None and isinstance(t, _DTENSOR) else t


class Experts(nn.Module):
    def __init__(
        self, n_experts: int, d_model: int, hidden: int, *, gated: bool, matmul: str = "auto"
    ):
        super().__init__()
        self.n_experts, self.matmul = n_experts, matmul
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, d_model))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, d_model)) if gated else None
        self.w2 = nn.Parameter(torch.empty(n_experts, d_model, hidden))

    def routed(
        self,
        x: torch.Tensor,
        experts: torch.Tensor,
        weights: torch.Tensor,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """sum_j weights[n, j] * expert_{experts[n, j]}(x[n]) for x (N, d) and choices (N, k);
        choices where `keep` is False contribute nothing."""
        N, k = experts.shape
        slot = torch.arange(N * k, device=x.device)  # slot n * k + j: token n's choice j
        expert = experts.reshape(-1)
        if keep is not None:
            kept = keep.reshape(-1)
            slot, expert = slot[kept], expert[kept]
        order = expert.argsort(stable=True)
        slot, expert = slot[order], expert[order]
        h = self._run(x.index_select(0, slot // k), expert, self._weights())
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

    def dense(self, x: torch.Tensor) -> torch.Tensor:
        """Expert 0 on every row of x (..., d): the shared expert, which every token takes."""
        return self._mlp(x, lambda a, w: F.linear(a, w[0]), self._weights())

    def _weights(self) -> Weights:
        return local(self.w1), local(self.w3) if self.w3 is not None else None, local(self.w2)

    def _run(self, xs: torch.Tensor, expert: torch.Tensor, weights: Weights) -> torch.Tensor:
        """Each expert's MLP over its rows of xs (rows sorted by expert)."""
        if self.use_grouped(xs):
            grouped_mm = _GROUPED_MM
            if grouped_mm is None:  # use_grouped says False (or raises) without it
                raise RuntimeError("torch's grouped matmul is missing")
            counts = torch.bincount(expert, minlength=self.n_experts)
            offs = counts.cumsum(0, dtype=torch.int32)

            def linear(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
                return grouped_mm(a, w.transpose(-2, -1), offs=offs)

            return self._mlp(xs, linear, weights)
        outs: list[torch.Tensor] = []
        # torch.split, not Tensor.split: the same call, but the method has no annotations
        for e, rows in enumerate(torch.split(xs, self._sizes(expert))):
            if rows.size(0):
                outs.append(self._mlp(rows, _expert_linear(e), weights))
        return torch.cat(outs) if outs else xs.new_zeros(0, self.w2.size(1))

    @staticmethod
    def _mlp(x: torch.Tensor, linear: Linear, weights: Weights) -> torch.Tensor:
        """GELU: w2(gelu(w1 x)). SwiGLU: w2(silu(w1 x) * w3 x), as llmtrain-models' MLP."""
        w1, w3, w2 = weights
        if w3 is None:
            h = F.gelu(linear(x, w1), approximate="tanh")
        else:
            h = F.silu(linear(x, w1)) * linear(x, w3)
        return linear(h, w2)

    def _sizes(self, expert: torch.Tensor) -> list[int]:
        if expert.device.type == "meta":
            # no values to count (memory estimates): an even split, what balancing aims for
            n, e = expert.numel(), self.n_experts
            return [n // e + (i < n % e) for i in range(e)]
        return torch.bincount(expert, minlength=self.n_experts).tolist()

    def expert_params(self) -> int:
        """Parameters of one expert."""
        return sum(p.numel() for p in self.parameters()) // self.n_experts
