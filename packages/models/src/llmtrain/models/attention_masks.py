"""Attention masks as compositions of mask functions: the seam attention variants plug into.

A mask function says, for a row b, a query at position q and a key at position k, whether the
query may see the key (FlexAttention's `mask_mod`, over positions rather than indices). A block's
mask is the AND of its functions: `Causal` (or `PrefixBidirectional`) and any of `Document`,
`SlidingWindow`, or a function a third-party model brings (`MaskFunction`: a hashable object with
a `name` and `__call__`). The functions read per-row data from `MaskRows` (document ids, prefix
flags, each token's place in its sequence) and are written with tensor ops only, so the same
function serves two kernels:

- on CUDA, FlexAttention with a BlockMask (made once per distinct mask per forward: blocks that
  share a mask share it). Tiles are classified from each function's `tiles` bounds, without
  evaluating the mask at every pair (a function without `tiles` falls back to torch's
  `create_block_mask`), and FlexAttention applies the functions inside the partial tiles. It is
  fast only when compiled: inside a compiled block (`parallel.compile: true`) it joins the
  block's graph; otherwise every layer calls one shared `torch.compile(flex_attention)`.
- elsewhere (CPU), with dropout (FlexAttention has none), with a KV cache and under context
  parallelism: scaled_dot_product_attention with the dense (B, 1, Tq, Tk) boolean mask
  evaluated from the same functions, or, when scores are soft-capped, the same computation
  written out. FlexAttention on CPU has no backward (torch refuses it).

The tests hold every composition's FlexAttention (eager and compiled) and BlockMask tiles to the
dense reference on CPU; gradients through the CUDA kernel are checked by the GPU tests.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import attrs
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

# FlexAttention's tile on the GPU (its kernels are tuned for 128 x 128); the tests set smaller
# blocks so that a short row spans several of them
BLOCK_SIZE = 128


# --- the data the functions read -------------------------------------------------------------
@attrs.frozen(eq=False)
class MaskRows:
    """What a forward's mask functions read: where its queries and keys sit in their sequence,
    and per-row data over the whole sequence.

    - `q_pos` (Tq,), `k_pos` (Tk,): the positions of the queries and keys along the sequence
      (0..T-1 for a plain forward; a shard's positions under context parallelism; the cached
      and new positions when decoding).
    - `doc_ids` (B, T) int: each token's document, non-decreasing along a row (`Document`).
    - `prefix` (B, T) bool: tokens every token of the prefix sees (`PrefixBidirectional`).
    - `places` (B, T): each token's place in its own sequence where a row packs several side
      by side (downstream scoring); windows count distance in it. None: the position itself.
    - `given` (B, Tq, Tk) bool: an explicit mask (packed rows), read by `Given`.
    """

    q_pos: torch.Tensor
    k_pos: torch.Tensor
    doc_ids: torch.Tensor | None = None
    prefix: torch.Tensor | None = None
    places: torch.Tensor | None = None
    given: torch.Tensor | None = None

    @property
    def batch(self) -> int | None:
        """Rows the mask differs between; None when it is the same for every row."""
        for data in (self.doc_ids, self.prefix, self.places, self.given):
            if data is not None:
                return data.size(0)
        return None

    def distance(self, b: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """How far key position k is behind query position q (in row b's own sequence)."""
        if self.places is None:
            return q - k
        return self.places[b, q] - self.places[b, k]


# (B or 1, n, n) per (query block i, key block j): whether some pair may be visible, whether all
TileBounds = tuple[torch.Tensor, torch.Tensor]


@runtime_checkable
class MaskFunction(Protocol):
    """One condition of a mask: `fn(rows, b, q, k)` -> bool tensor, True where a query at
    position q of row b may see the key at position k (the arguments broadcast against each
    other; index `rows`' per-row data with them). `name` identifies it in the model's
    description (and must make equal functions equal: attrs frozen classes do). A function may
    also define `tiles(rows, first, last)` -> `TileBounds`, given the first and last position of
    each tile: then a BlockMask is classified without evaluating every pair."""

    @property
    def name(self) -> str: ...

    def __call__(
        self, rows: MaskRows, b: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> torch.Tensor: ...


@attrs.frozen
class Causal:
    """A query sees itself and the keys before it."""

    name = "causal"

    def __call__(
        self, rows: MaskRows, b: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> torch.Tensor:
        return q >= k

    def tiles(self, rows: MaskRows, first: torch.Tensor, last: torch.Tensor) -> TileBounds:
        q_first, q_last = first.view(1, -1, 1), last.view(1, -1, 1)
        k_first, k_last = first.view(1, 1, -1), last.view(1, 1, -1)
        return k_first <= q_last, k_last <= q_first


@attrs.frozen
class Document:
    """A query sees only keys of its own document (`rows.doc_ids`)."""

    name = "document"

    def __call__(
        self, rows: MaskRows, b: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> torch.Tensor:
        doc = _needs(rows.doc_ids, "document ids")
        return doc[b, q] == doc[b, k]

    def tiles(self, rows: MaskRows, first: torch.Tensor, last: torch.Tensor) -> TileBounds:
        # documents never decrease along a row: a tile's documents are the range between its
        # first and last token's
        doc = _needs(rows.doc_ids, "document ids")
        lo, hi = doc[:, first], doc[:, last]
        q_lo, q_hi = lo.unsqueeze(2), hi.unsqueeze(2)
        k_lo, k_hi = lo.unsqueeze(1), hi.unsqueeze(1)
        overlap = (k_lo <= q_hi) & (q_lo <= k_hi)
        one_document = (q_lo == q_hi) & (k_lo == k_hi) & (q_lo == k_lo)
        return overlap, one_document


@attrs.frozen
class SlidingWindow:
    """A query sees the `size` most recent keys, itself included (0 <= q - k < size), as
    transformers' `sliding_window` means."""

    size: int

    @property
    def name(self) -> str:
        return f"window={self.size}"

    def __call__(
        self, rows: MaskRows, b: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> torch.Tensor:
        return rows.distance(b, q, k) < self.size

    def tiles(self, rows: MaskRows, first: torch.Tensor, last: torch.Tensor) -> TileBounds:
        q_first, q_last = first.view(1, -1, 1), last.view(1, -1, 1)
        k_first, k_last = first.view(1, 1, -1), last.view(1, 1, -1)
        # (the lower bound q - k >= 0 is Causal's to bound)
        return q_first - k_last < self.size, q_last - k_first < self.size


@attrs.frozen
class PrefixBidirectional:
    """Causal, except that the tokens of a prefix see each other both ways (a prefix LM): in
    place of `Causal`, with `rows.prefix`; compose it with `Document` so that packed documents'
    prefixes stay apart."""

    name = "prefix"

    def __call__(
        self, rows: MaskRows, b: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> torch.Tensor:
        prefix = _needs(rows.prefix, "prefix flags")
        return (q >= k) | (prefix[b, q] & prefix[b, k])


@attrs.frozen
class Given:
    """An explicit (B, Tq, Tk) mask (`rows.given`) in place of `Causal`: packed rows where
    several sequences share a prefix (downstream scoring)."""

    name = "given"

    def __call__(
        self, rows: MaskRows, b: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> torch.Tensor:
        # positions index the explicit mask directly: its rows are the queries, in order
        given = _needs(rows.given, "an explicit mask")
        return given[b, q - rows.q_pos[0], k - rows.k_pos[0]]


def _needs(data: torch.Tensor | None, what: str) -> torch.Tensor:
    if data is None:
        raise ValueError(f"this mask function reads {what}, which the forward was not given")
    return data


# --- one block's mask ----------------------------------------------------------------------
class AttentionMask:
    """The AND of some mask functions over one forward's rows, in the form the attention kernel
    of the device takes: a BlockMask where FlexAttention runs, else the dense boolean mask,
    made on first use and shared by every block with the same functions."""

    def __init__(
        self,
        functions: Sequence[MaskFunction],
        rows: MaskRows,
        block_mask: BlockMask | None = None,
    ):
        self.functions = tuple(functions)
        self.rows = rows
        self.block_mask = block_mask
        self._dense: torch.Tensor | None = None

    def allows(self, b: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Whether query position q of row b may see key position k: every function agrees."""
        allowed = self.functions[0](self.rows, b, q, k)
        for fn in self.functions[1:]:
            allowed = allowed & fn(self.rows, b, q, k)
        return allowed

    def dense(self) -> torch.Tensor:
        """The (B or 1, 1, Tq, Tk) boolean mask (True = may attend) for SDPA."""
        if self._dense is not None:
            return self._dense
        rows = self.rows
        device = rows.q_pos.device
        b = torch.arange(rows.batch or 1, device=device).view(-1, 1, 1)
        allowed = self.allows(b, rows.q_pos.view(1, -1, 1), rows.k_pos.view(1, 1, -1))
        dense = allowed.expand(b.size(0), rows.q_pos.numel(), rows.k_pos.numel()).unsqueeze(1)
        if not torch.compiler.is_compiling():
            # eager blocks share one; a compiled block keeps no state between calls
            self._dense = dense
        return dense


def attention_masks(
    layers: Sequence[Sequence[MaskFunction]], rows: MaskRows, *, dense_only: bool = False
) -> list[AttentionMask]:
    """One AttentionMask per block; blocks with the same functions share one object (and so
    one BlockMask or dense mask). BlockMasks are built where FlexAttention runs, unless
    `dense_only` (queries and keys that are not both the positions 0..T-1)."""
    flex = flex_runs_here(rows.q_pos) and not dense_only
    shared: dict[tuple[MaskFunction, ...], AttentionMask] = {}
    masks = []
    for functions in layers:
        key = tuple(functions)
        if key not in shared:
            mask = AttentionMask(key, rows)
            if flex:
                mask.block_mask = block_mask(mask, BLOCK_SIZE)
            shared[key] = mask
        masks.append(shared[key])
    return masks


def block_mask(mask: AttentionMask, block_size: int) -> BlockMask:
    """The BlockMask of `mask`, whose queries and keys are the positions 0..T-1: classified tile by tile from the
    functions' `tiles` bounds when every function has them, else by torch's create_block_mask
    (compiled on CUDA), which evaluates every pair."""
    rows = mask.rows
    T = rows.q_pos.numel()
    tiled = [getattr(fn, "tiles", None) for fn in mask.functions]
    if any(t is None for t in tiled):
        build = _compiled_create_block_mask() if rows.q_pos.is_cuda else create_block_mask
        return build(
            _padding_safe(mask, T),
            rows.batch,
            None,
            T,
            T,
            device=rows.q_pos.device,
            BLOCK_SIZE=block_size,
        )
    n = -(-T // block_size)
    device = rows.q_pos.device
    first = torch.arange(n, device=device) * block_size
    last = torch.clamp(first + block_size, max=T) - 1
    some, every = tiled[0](rows, first, last)  # type: ignore[misc]
    for bounds in tiled[1:]:
        s, e = bounds(rows, first, last)  # type: ignore[misc]
        some, every = some & s, every & e
    # tiles that run past the row's end are never full, as in create_block_mask; FlexAttention
    # applies the mask inside every partial tile
    whole = torch.ones(n, dtype=torch.bool, device=device)
    if T % block_size:
        whole[-1] = False
    full = every & whole.view(1, n, 1) & whole.view(1, 1, n)
    partial = some & ~full
    B = rows.batch or 1
    partial, full = partial.expand(B, n, n), full.expand(B, n, n)
    kv_num, kv_indices = _ordered(partial)
    full_num, full_indices = _ordered(full)
    return BlockMask.from_kv_blocks(
        kv_num,
        kv_indices,
        full_num,
        full_indices,
        BLOCK_SIZE=block_size,
        mask_mod=_padding_safe(mask, T),
        seq_lengths=(T, T),
    )


def _padding_safe(mask: AttentionMask, T: int):  # type: ignore[no-untyped-def]
    """mask_mod that rejects the padding a kernel reads past the row's end (it indexes per-row
    data, which has no entry there)."""

    def mask_mod(
        b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        inside = (q_idx < T) & (kv_idx < T)
        q, k = q_idx.clamp(max=T - 1), kv_idx.clamp(max=T - 1)
        return inside & mask.allows(b, q, k)

    return mask_mod


def _ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, n, n) bool tiles -> per query block the count of its key blocks and their indices,
    first the chosen ones in ascending order (BlockMask's layout, with a head dimension of 1)."""
    counts = blocks.sum(dim=-1, dtype=torch.int32)
    order = torch.argsort(blocks.to(torch.int32), dim=-1, descending=True, stable=True)
    return counts.unsqueeze(1).contiguous(), order.to(torch.int32).unsqueeze(1).contiguous()


# --- document helpers --------------------------------------------------------------------------
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


# --- the kernels ----------------------------------------------------------------------------
def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: AttentionMask | None,
    *,
    dropout_p: float = 0.0,
    scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of q (B, Hq, Tq, D) over k, v (B, Hkv, Tk, D) under `mask` (None: causal, with
    Tq == Tk), key/value heads shared by groups of query heads. `scale` multiplies the scores
    (None: 1/sqrt(D)); `softcap` passes them through softcap * tanh(score / softcap)."""
    gqa = q.size(1) != k.size(1)
    if mask is not None and mask.block_mask is not None and dropout_p == 0.0:
        score_mod = None if softcap is None else _softcapped(softcap)
        return _flex(q)(
            q, k, v, score_mod=score_mod, block_mask=mask.block_mask, scale=scale, enable_gqa=gqa
        )
    if softcap is not None:
        allowed = mask.dense() if mask is not None else _causal(q.size(2), q.device)
        return _softcapped_attention(q, k, v, allowed, dropout_p, scale, softcap)
    return F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=None if mask is None else mask.dense(),
        is_causal=mask is None,
        dropout_p=dropout_p,
        scale=scale,
        enable_gqa=gqa,
    )


def _causal(T: int, device: torch.device) -> torch.Tensor:
    return torch.ones(T, T, dtype=torch.bool, device=device).tril()


def _softcapped(cap: float):  # type: ignore[no-untyped-def]
    def score_mod(
        score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> torch.Tensor:
        return cap * torch.tanh(score / cap)

    return score_mod


def _softcapped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor,
    dropout_p: float,
    scale: float | None,
    cap: float,
) -> torch.Tensor:
    """Attention with soft-capped scores written out (SDPA has no soft-capping); the softmax in
    float32 as the fused kernels keep it."""
    groups = q.size(1) // k.size(1)
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-2, -1)) * (scale if scale is not None else q.size(-1) ** -0.5)
    scores = cap * torch.tanh(scores / cap)
    scores = scores.masked_fill(~allowed, float("-inf"))
    weights = scores.float().softmax(dim=-1).type_as(q)
    if dropout_p:
        weights = F.dropout(weights, p=dropout_p)
    return weights @ v


def flex_runs_here(x: torch.Tensor) -> bool:
    """Whether masked attention runs through FlexAttention on x's device: on CUDA only (see the
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
        score_mod: object,
        block_mask: BlockMask | None,
        scale: float | None,
        enable_gqa: bool,
    ) -> torch.Tensor: ...


def _flex(q: torch.Tensor) -> _FlexAttention:
    # inside a graph being compiled the call joins that graph, and off CUDA (the tests) the eager
    # reference runs; a CUDA caller that is not compiled gets the shared compiled one
    if torch.compiler.is_compiling() or q.device.type != "cuda":
        return flex_attention  # type: ignore[return-value]
    return _compiled_flex_attention()


@functools.cache
def _compiled_flex_attention() -> _FlexAttention:
    compiled: _FlexAttention = torch.compile(flex_attention)  # type: ignore[arg-type]
    return compiled


@functools.cache
def _compiled_create_block_mask():  # type: ignore[no-untyped-def]
    return torch.compile(create_block_mask)
