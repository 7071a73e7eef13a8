"""The options of an item that share their context, scored in one row: the context once, then
each option's continuation, every continuation seeing the context and itself only.

A multiple-choice item's K options are K rows of context + continuation when scored one by one;
packed, the context's tokens go through the model once instead of K times (HellaSwag's contexts
are most of its tokens). A continuation's tokens take the positions they would have after the
context alone, and an attention mask keeps the continuations apart, so each option's
log-likelihood is the one its own row gives. The first token of every continuation is predicted
from the context's last token, the rest from the continuation's own tokens; the continuation's
last token predicts nothing and is left out. Options whose contexts differ (Winogrande's, or
contexts cut from the left to fit) go to rows of their own, as do rolling perplexity windows.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from llmtrain.downstream.requests import Request

PAD_SEGMENT = -1  # padding: seen by no real token
CONTEXT_SEGMENT = 0  # the shared context: seen by every continuation after it


@attrs.frozen
class PackedRow:
    """One row's tokens, their positions and segments (0: the context, k: the k-th packed
    continuation), and for each packed request its index and where its targets are predicted."""

    tokens: tuple[int, ...]
    positions: tuple[int, ...]
    segments: tuple[int, ...]
    requests: tuple[int, ...]
    predicted_at: tuple[tuple[int, ...], ...]  # per request: row positions of its predictions
    targets: tuple[tuple[int, ...], ...]  # per request: the tokens predicted there


def _context_of(request: Request) -> tuple[int, ...]:
    return request.tokens[: len(request.tokens) - request.scored]


def packed_rows(
    requests: Sequence[Request], indices: Sequence[int], max_len: int
) -> list[PackedRow]:
    """Rows of at most `max_len` tokens holding the requests at `indices`: those of one item
    with the same context together (as many per row as fit), the others alone."""
    groups: dict[tuple[int, tuple[int, ...]], list[int]] = {}
    for i in indices:
        groups.setdefault((requests[i].item, _context_of(requests[i])), []).append(i)
    rows = []
    for (_, context), members in groups.items():
        chunk: list[int] = []
        length = len(context)
        for i in members:
            extra = max(requests[i].scored - 1, 0)
            if chunk and length + extra > max_len:
                rows.append(_row(context, [requests[j] for j in chunk], chunk))
                chunk, length = [], len(context)
            chunk.append(i)
            length += extra
        rows.append(_row(context, [requests[j] for j in chunk], chunk))
    return rows


def _row(context: tuple[int, ...], members: Sequence[Request], indices: list[int]) -> PackedRow:
    tokens, positions = list(context), list(range(len(context)))
    segments = [CONTEXT_SEGMENT] * len(context)
    predicted_at, targets = [], []
    for k, request in enumerate(members, start=1):
        answer = request.tokens[len(context) :]
        start = len(tokens)
        tokens += answer[:-1]
        positions += range(len(context), len(context) + len(answer) - 1)
        segments += [k] * (len(answer) - 1)
        # an empty answer (a choice that encodes to nothing) predicts nothing
        predicted_at.append(
            (len(context) - 1, *range(start, start + len(answer) - 1))[: len(answer)]
        )
        targets.append(tuple(answer))
    return PackedRow(
        tuple(tokens),
        tuple(positions),
        tuple(segments),
        tuple(indices),
        tuple(predicted_at),
        tuple(targets),
    )


@attrs.frozen
class PackedBatch:
    """Model inputs for packed rows, and how to read each request's score from the logits of
    the positions `at` marks (B, T; returned in row-major order): prediction k reads logit row
    `gather[k]`, predicts `targets[k]` and counts for request `owner[k]` (its place in
    `requests`). The context's last token is read once per continuation after it."""

    tokens: torch.Tensor
    positions: torch.Tensor
    attention_mask: torch.Tensor
    at: torch.Tensor
    gather: torch.Tensor
    targets: torch.Tensor
    owner: torch.Tensor
    requests: tuple[int, ...]


def packed_batch(
    rows: Sequence[PackedRow], n_rows: int, length: int, device: torch.device | str
) -> PackedBatch:
    """`n_rows` rows of `length` tokens (rows past `rows` are padding and score nothing)."""
    tokens = torch.zeros(n_rows, length, dtype=torch.long)
    positions = torch.zeros(n_rows, length, dtype=torch.long)
    segments = torch.full((n_rows, length), PAD_SEGMENT, dtype=torch.long)
    predictions: list[tuple[int, int, int]] = []  # (row * length + position, target, owner)
    requests: list[int] = []
    for b, row in enumerate(rows):
        n = len(row.tokens)
        tokens[b, :n] = torch.tensor(row.tokens)
        positions[b, :n] = torch.tensor(row.positions)
        segments[b, :n] = torch.tensor(row.segments)
        for request, where, wanted in zip(row.requests, row.predicted_at, row.targets, strict=True):
            owner = len(requests)
            requests.append(request)
            predictions += [(b * length + p, t, owner) for p, t in zip(where, wanted, strict=True)]
    at = torch.zeros(n_rows * length, dtype=torch.bool)
    flat = torch.tensor([f for f, _, _ in predictions], dtype=torch.long)
    at[flat] = True
    # the logit row of a marked position: how many marked positions come before it
    logit_row = at.long().cumsum(0) - 1
    # a token sees the tokens before it in the context and in its own segment; padding sees
    # the context and the padding before it, so no row of the mask is empty
    query, key = segments.unsqueeze(2), segments.unsqueeze(1)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    mask = causal & ((key == CONTEXT_SEGMENT) | (key == query))
    return PackedBatch(
        tokens.to(device),
        positions.to(device),
        mask.to(device),
        at.view(n_rows, length).to(device),
        logit_row[flat].to(device),
        torch.tensor([t for _, t, _ in predictions], dtype=torch.long).to(device),
        torch.tensor([o for _, _, o in predictions], dtype=torch.long).to(device),
        tuple(requests),
    )
