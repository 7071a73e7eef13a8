"""Document masking for packed rows: a token attends to the tokens before it in its own document.

The mask is kept as each token's document index, never as a (T, T) matrix, and attention runs
where the masked tiles are skipped: FlexAttention with a BlockMask built straight from the
document indices. The BlockMask costs O((T / BLOCK_SIZE)^2) per row, one set for the whole
forward (every layer shares it), and attention then computes only the tiles on or below the
diagonal that hold a document in common, so a row of short documents costs less than causal
attention over the whole row.

Where each kernel runs:
- on CUDA, FlexAttention. It is fast only when compiled: inside a compiled block
  (`parallel.compile: true`) it is part of the block's graph; otherwise every layer calls one
  shared `torch.compile(flex_attention)`, whose first call compiles it (seconds, once per shape).
- elsewhere (CPU), and wherever dropout is on (FlexAttention has none):
  scaled_dot_product_attention with the dense (B, 1, T, T) boolean mask, built from the same
  document indices once per forward. FlexAttention on CPU has no backward (torch refuses it), and
  uncompiled it would materialise the scores anyway, slower than SDPA's CPU kernel.
The tests hold FlexAttention (eager and compiled, forward) and the BlockMask's tiles to the dense
reference on CPU; gradients through the CUDA kernel are checked by the GPU tests.
"""

from __future__ import annotations

import functools
from typing import Protocol

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

# FlexAttention's tile on the GPU (its kernels are tuned for 128 x 128); the tests set smaller
# blocks so that a short row spans several of them
BLOCK_SIZE = 128


class DocumentMask:
    """Which document each token of a row is in, and the attention mask that follows from it in
    the form the attention kernel of this device takes: a BlockMask where FlexAttention runs,
    else the dense mask on first use (made once per forward, shared by every layer)."""

    def __init__(self, doc_ids: torch.Tensor, block_mask: BlockMask | None):
        self.doc_ids = doc_ids  # (B, T) int32, 0 for a row's first document, non-decreasing
        self.block_mask = block_mask
        self._dense: torch.Tensor | None = None

    def dense(self) -> torch.Tensor:
        """The (B, 1, T, T) boolean mask (True = may attend) for scaled_dot_product_attention."""
        if self._dense is not None:
            return self._dense
        doc = self.doc_ids
        T = doc.size(1)
        same_doc = doc.unsqueeze(2) == doc.unsqueeze(1)
        causal = torch.ones(T, T, dtype=torch.bool, device=doc.device).tril()
        dense = (same_doc & causal).unsqueeze(1)
        if not torch.compiler.is_compiling():
            # eager layers share one; a compiled block keeps no state between calls
            self._dense = dense
        return dense


def document_ids(doc_starts: torch.Tensor) -> torch.Tensor:
    """(B, T) int32 document index of each token; the first token always starts a document."""
    starts = doc_starts.to(torch.bool).clone()
    starts[:, 0] = True
    return starts.cumsum(dim=1, dtype=torch.int32) - 1


def positions_in_document(doc_starts: torch.Tensor) -> torch.Tensor:
    """(B, T) each token's distance from the start of its document."""
    starts = doc_starts.to(torch.bool).clone()
    starts[:, 0] = True
    index = torch.arange(starts.size(1), device=starts.device)
    last_start = torch.where(starts, index, 0).cummax(dim=1).values
    return index - last_start


def document_mask(doc_starts: torch.Tensor, block_size: int | None = None) -> DocumentMask:
    """The document mask of rows whose documents begin where `doc_starts` (B, T) is true."""
    doc_ids = document_ids(doc_starts)
    if not flex_runs_here(doc_ids):
        return DocumentMask(doc_ids, None)
    return DocumentMask(doc_ids, document_block_mask(doc_ids, block_size or BLOCK_SIZE))


def document_block_mask(doc_ids: torch.Tensor, block_size: int) -> BlockMask:
    """A BlockMask for "same document and not in the future", derived tile by tile from the
    document indices without evaluating the mask at every (query, key) pair.

    Document indices never decrease along a row, so a tile of queries (block i) and keys
    (block j) is described by the first and last document of each: below the diagonal (j < i)
    it holds an allowed pair iff the keys' last document is the queries' first, and every pair
    is allowed iff all its tokens are in one document; a tile on the diagonal always holds the
    token itself and is full only for blocks of one token. Tiles that run past the row's end
    are never full, as in `create_block_mask`; FlexAttention applies `mask_mod` inside every
    partial tile."""
    B, T = doc_ids.shape
    n = -(-T // block_size)
    padded = n * block_size
    # padding keys belong to no document, so mask_mod rejects them wherever a kernel reads them
    ids = F.pad(doc_ids, (0, padded - T), value=-1)
    tiles = ids.view(B, n, block_size)
    first = tiles[:, :, 0]
    # the last real token of each block (the row's last block may be cut short)
    last_index = torch.clamp(torch.arange(n, device=ids.device) * block_size + block_size, max=T)
    last = doc_ids[:, last_index - 1]
    q_first, q_last = first.unsqueeze(2), last.unsqueeze(2)  # (B, n, 1): query block i
    k_first, k_last = first.unsqueeze(1), last.unsqueeze(1)  # (B, 1, n): key block j
    i = torch.arange(n, device=ids.device)
    below = i.unsqueeze(1) > i.unsqueeze(0)  # (n, n): [i, j] = j < i
    on_or_below = below | torch.eye(n, dtype=torch.bool, device=ids.device)
    any_allowed = on_or_below & (k_last >= q_first)
    whole = torch.ones(n, dtype=torch.bool, device=ids.device)
    if T % block_size:
        whole[-1] = False
    before = below if block_size > 1 else on_or_below
    full = before & (k_first == q_last) & whole.view(1, n, 1) & whole.view(1, 1, n)
    partial = any_allowed & ~full

    def same_document_causal(
        b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        return (ids[b, q_idx] == ids[b, kv_idx]) & (q_idx >= kv_idx)

    kv_num, kv_indices = _ordered(partial)
    full_num, full_indices = _ordered(full)
    return BlockMask.from_kv_blocks(
        kv_num,
        kv_indices,
        full_num,
        full_indices,
        BLOCK_SIZE=block_size,
        mask_mod=same_document_causal,
        seq_lengths=(T, T),
    )


def _ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, n, n) bool tiles -> per query block the count of its key blocks and their indices,
    first the chosen ones in ascending order (BlockMask's layout, with a head dimension of 1)."""
    counts = blocks.sum(dim=-1, dtype=torch.int32)
    order = torch.argsort(blocks.to(torch.int32), dim=-1, descending=True, stable=True)
    return counts.unsqueeze(1).contiguous(), order.to(torch.int32).unsqueeze(1).contiguous()


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | DocumentMask | None,
    *,
    is_causal: bool,
    dropout_p: float = 0.0,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of q (B, Hq, T, D) over k, v (B, Hkv, S, D): causal, or under a boolean mask,
    or within documents (a DocumentMask), key/value heads shared by groups of query heads.
    `scale` multiplies the scores (None: 1/sqrt(D); µP passes its own)."""
    gqa = q.size(1) != k.size(1)
    if isinstance(mask, DocumentMask):
        if dropout_p == 0.0 and mask.block_mask is not None:
            return _flex(q)(q, k, v, block_mask=mask.block_mask, scale=scale, enable_gqa=gqa)
        mask = mask.dense()
    return F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        is_causal=is_causal,
        dropout_p=dropout_p,
        scale=scale,
        enable_gqa=gqa,
    )


def flex_runs_here(x: torch.Tensor) -> bool:
    """Whether document masking runs through FlexAttention on x's device: on CUDA only (see the
    module's docstring)."""
    return x.device.type == "cuda"


class _FlexAttention(Protocol):
    """flex_attention as `attend` calls it (no `return_lse`: the output alone)."""

    def __call__(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        block_mask: BlockMask | None,
        scale: float | None,
        enable_gqa: bool,
    ) -> torch.Tensor: ...


def _flex(q: torch.Tensor) -> _FlexAttention:
    # inside a graph being compiled the call joins that graph, and off CUDA (the tests) the eager
    # reference runs; a CUDA caller that is not compiled gets the shared compiled one
    if torch.compiler.is_compiling() or q.device.type != "cuda":
        return flex_attention
    return _compiled_flex_attention()


@functools.cache
def _compiled_flex_attention() -> _FlexAttention:
    return torch.compile(flex_attention)
