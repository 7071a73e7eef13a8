"""Context parallelism by gathering keys and values (the variant the Llama 3 paper uses).

Every rank of the `cp` group holds a shard of each sequence's queries. Inside attention it gathers
the keys and values of the whole sequence (an all-gather whose backward reduce-scatters), and
masks causally by each token's global position. With load balancing the sequence is cut into
2·cp chunks and rank r holds chunks r and 2·cp - 1 - r, so every rank does the same causal work.

The model is unchanged: while `attention_over(group)` is active, calls to torch's
scaled_dot_product_attention with `is_causal=True` are answered this way. It must also be active
during backward, where activation checkpointing recomputes attention.
"""

from __future__ import annotations

import contextlib
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


class _GatheredAttention(TorchFunctionMode):
    def __init__(self, group: ProcessGroup, mask: torch.Tensor):
        super().__init__()
        self.group = group
        self.mask = mask  # (T_local, T): may local query i see gathered key j

    def __torch_function__(
        self,
        func: Callable[..., object],
        types: Collection[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> object:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        if kwargs.get("attn_mask") is not None or not kwargs.get("is_causal"):
            raise RuntimeError(
                "context parallelism needs plain causal attention; document masking and "
                "custom masks are not supported with cp > 1"
            )
        q, k, v = args[:3]
        k = all_gather_tensor_autograd(k.contiguous(), gather_dim=2, group=self.group)
        v = all_gather_tensor_autograd(v.contiguous(), gather_dim=2, group=self.group)
        kwargs = {**kwargs, "attn_mask": self.mask, "is_causal": False}
        return func(q, k, v, *args[3:], **kwargs)


@contextlib.contextmanager
def attention_over(
    group: ProcessGroup,
    seq_len: int,
    rank: int,
    size: int,
    load_balance: bool,
    device: torch.device,
) -> Iterator[None]:
    """Within this context, causal attention on `rank`'s shard attends over the whole sequence."""
    queries = shard_index(seq_len, rank, size, load_balance)
    # keys arrive in rank order, each rank's shard in its own order
    keys = torch.cat([shard_index(seq_len, r, size, load_balance) for r in range(size)])
    mask = (queries.unsqueeze(1) >= keys.unsqueeze(0)).to(device)
    with _GatheredAttention(group, mask):
        yield
