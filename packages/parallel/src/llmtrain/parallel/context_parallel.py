"""Context parallelism by gathering keys and values (the variant the Llama 3 paper uses).

Every rank of the `cp` group holds a shard of each sequence's queries. Inside attention it gathers
the keys and values of the whole sequence (an all-gather whose backward reduce-scatters). With
load balancing the sequence is cut into 2·cp chunks and rank r holds chunks r and 2·cp - 1 - r,
so every rank does the same causal work.

The model is unchanged: while `attention_over(group)` is active, torch's
scaled_dot_product_attention is answered this way in one of two forms:
- `is_causal=True` without a mask: masked causally by each token's global position;
- a boolean `attn_mask` over this rank's queries and every key of the sequence in position
  order, (B or 1, 1, T_local, T), which the model builds from the `positions`, `doc_starts` and
  `sequence_length` it is given (document masking, sliding windows): the gathered keys and values
  are put in position order and the model's mask applies as it is.

Backward needs it again where activation checkpointing recomputes a block. A TorchFunctionMode
is not on the stack while backward runs inside it (`.backward()` is itself a torch function, and
the mode runs it with itself set aside), so the checkpoint's recompute context re-enters the
attention that was active at the block's forward (`active_attention`).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch.distributed._functional_collectives import all_gather_tensor_autograd
from torch.overrides import TorchFunctionMode

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


def shard_index(seq_len: int, rank: int, size: int, load_balance: bool) -> torch.Tensor:
    """Positions (into the full sequence) of the tokens `rank` holds."""
    if not load_balance:
        chunk = seq_len // size
        return torch.arange(rank * chunk, (rank + 1) * chunk)
    chunk = seq_len // (2 * size)
    head = torch.arange(rank * chunk, (rank + 1) * chunk)
    tail_start = (2 * size - 1 - rank) * chunk
    return torch.cat((head, torch.arange(tail_start, tail_start + chunk)))


# scaled_dot_product_attention's arguments after query, key and value, in order
_SDPA_ARGS = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


class _GatheredAttention(TorchFunctionMode):
    def __init__(self, group: ProcessGroup, causal: torch.Tensor, order: torch.Tensor | None):
        super().__init__()
        self.group = group
        self.causal = causal  # (T_local, T): may local query i see gathered key j (rank order)
        # gathered (rank order) -> position order; None where they are the same
        self.order = order

    def __torch_function__(
        self,
        func: Callable[..., object],
        types: Collection[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> object:
        if func is not F.scaled_dot_product_attention:
            return func(*args, **(kwargs or {}))
        q, k, v = args[:3]
        # every argument after the tensors by name
        named = {**dict(zip(_SDPA_ARGS, args[3:], strict=False)), **(kwargs or {})}
        mask = named.get("attn_mask")
        causal = named.get("is_causal") is True
        seq_len = self.causal.size(1)
        if mask is None and causal:
            k, v = self._gather(k), self._gather(v)
            return func(q, k, v, **{**named, "attn_mask": self.causal, "is_causal": False})
        if mask is not None and not causal and mask.size(-1) != k.size(2):
            if mask.size(-1) != seq_len or mask.size(-2) != q.size(2):
                raise RuntimeError(
                    f"context parallelism: the attention mask {tuple(mask.shape)} must cover "
                    f"this rank's {q.size(2)} queries and every key of the sequence in position "
                    f"order ({seq_len}); build it from the model's `sequence_length`"
                )
            k, v = self._gather(k), self._gather(v)
            if self.order is not None:
                k, v = k.index_select(2, self.order), v.index_select(2, self.order)
            return func(q, k, v, **named)
        raise RuntimeError(
            "context parallelism answers scaled_dot_product_attention with is_causal=True, or "
            "with an attn_mask over every key of the sequence (the model builds it from "
            "`sequence_length`); this call has "
            + (
                "no mask and is_causal=False"
                if mask is None
                else "both a mask and is_causal=True"
                if causal
                else f"a mask over only this rank's {k.size(2)} keys"
            )
        )

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        gathered: torch.Tensor = all_gather_tensor_autograd(
            x.contiguous(), gather_dim=2, group=self.group
        )
        return gathered


# the gathered attention a forward runs under, for activation checkpointing's recompute
_ACTIVE: contextvars.ContextVar[_GatheredAttention | None] = contextvars.ContextVar(
    "context_parallel_attention", default=None
)


def active_attention() -> contextlib.AbstractContextManager[object] | None:
    """The context-parallel attention active now, if any: activation checkpointing enters it
    where it recomputes a block that runs now."""
    return _ACTIVE.get()


@contextlib.contextmanager
def attention_over(
    group: ProcessGroup,
    seq_len: int,
    rank: int,
    size: int,
    load_balance: bool,
    device: torch.device,
) -> Iterator[None]:
    """Within this context, attention on `rank`'s shard attends over the whole sequence: causal
    attention by global position, or the model's mask over every key in position order."""
    queries = shard_index(seq_len, rank, size, load_balance)
    # keys arrive in rank order, each rank's shard in its own order
    keys = torch.cat([shard_index(seq_len, r, size, load_balance) for r in range(size)])
    causal = (queries.unsqueeze(1) >= keys.unsqueeze(0)).to(device)
    in_order = bool(torch.equal(keys, torch.arange(seq_len)))
    order = None if in_order else torch.argsort(keys).to(device)
    attention = _GatheredAttention(group, causal, order)
    token = _ACTIVE.set(attention)
    try:
        with attention:
            yield
    finally:
        _ACTIVE.reset(token)
