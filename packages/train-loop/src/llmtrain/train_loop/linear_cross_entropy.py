"""Cross-entropy of the output projection without the batch's logits: `linear_cross_entropy_sum`.

A vocabulary of 128k makes the logits of a (4 x 2048)-token batch 2.1 GB in bf16, 4.2 GB in
float32, and a plain `F.cross_entropy(F.linear(h, W).float(), t)` keeps several such tensors
alive (the float32 copy, the log-softmax saved for backward, its gradient). Here the tokens go
through the projection in groups: each group's logits are made by one matmul, turned chunk by
chunk into the loss and, in place, into the loss's gradient with respect to the logits, and
multiplied back into the gradients of the hidden states and of the projection right away, so
at most one group of logits exists at a time. The gradients are computed in the forward pass
(the loss is a scalar whose backward only scales them), which costs no FLOPs beyond the three
matmuls autograd would run anyway.

Two sizes, because two costs pull apart (measured on an H100, llama-1b, 8192 tokens): every
group adds its share of the projection's gradient into a float32 (V, d) sum, about 1 ms of
memory traffic at a 128k vocabulary, so groups are few and large (GROUP_ELEMENTS); the
softmax runs on chunks (CHUNK_ELEMENTS) because uncompiled it makes float32 temporaries of
the chunk's size, and compiled it is one pass over a chunk either way.

The numbers are those of the plain form: logits in the matmul's dtype (bf16 under autocast, as
autocast's `F.linear` gives them), softmax statistics in float32, ignored targets (-100) count
neither in the loss nor in the gradient, and the z-loss adds `z * logsumexp²` per counted token.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch

ChunkFn = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]

IGNORE = -100  # targets with this value (masked tokens) count neither in the loss nor the total
CHUNK_ELEMENTS = 1 << 27  # logits per softmax chunk: 1024 tokens of a 128k vocabulary
GROUP_ELEMENTS = 1 << 29  # logits per matmul group: 4096 tokens of a 128k vocabulary, 1 GiB bf16


def chunk_loss_and_grad_(
    logits: torch.Tensor, targets: torch.Tensor, z_loss: float
) -> torch.Tensor:
    """The summed loss of one chunk of logits (n, V); the logits are overwritten with
    d loss / d logits (in their dtype), which is all the matmuls after it need."""
    counted = targets != IGNORE
    safe = torch.where(counted, targets, 0)
    wide = logits.float()
    log_z = torch.logsumexp(wide, dim=-1)
    target_logit = wide.gather(1, safe.unsqueeze(1)).squeeze(1)
    per_token = log_z - target_logit
    # d/dlogits of log Z is the softmax; of z * (log Z)², 2 z log Z times the softmax
    softmax_weight = 1.0 + 2.0 * z_loss * log_z if z_loss else torch.ones_like(log_z)
    if z_loss:
        per_token = per_token + z_loss * log_z.square()
    # the target's -1 as a comparison, not a scatter: compiled, the whole gradient is one
    # elementwise pass over the chunk after the logsumexp's
    is_target = torch.arange(logits.size(1), device=logits.device) == safe.unsqueeze(1)
    grad = torch.exp(wide - log_z.unsqueeze(1)) * softmax_weight.unsqueeze(1) - is_target.float()
    logits.copy_(grad * counted.unsqueeze(1))
    return (per_token * counted).sum()


_compiled_chunk: ChunkFn | None = None


def _chunk_fn(on_cuda: bool, compile_chunks: bool) -> ChunkFn:
    """The chunk function, compiled where it pays: on CUDA Inductor fuses the float32 softmax
    and its gradient into one pass over the bf16 logits; on CPU compiling costs more than it saves
    at the sizes CPUs train."""
    global _compiled_chunk
    if not (on_cuda and compile_chunks):
        return chunk_loss_and_grad_
    if _compiled_chunk is None:
        _compiled_chunk = torch.compile(chunk_loss_and_grad_, dynamic=False)
    return _compiled_chunk


def chunk_rows(n_tokens: int, vocab: int, elements: int | None = None) -> int:
    """Tokens per chunk of `elements` logits (CHUNK_ELEMENTS), in multiples of 128 rows
    (matmul tiles), and chunks of equal size where the token count allows (one compiled shape)."""
    rows = max(128, ((elements or CHUNK_ELEMENTS) // vocab) // 128 * 128)
    if rows >= n_tokens:
        return n_tokens
    chunks = -(-n_tokens // rows)
    even = -(-n_tokens // chunks)
    return even if n_tokens % even == 0 else rows


def group_rows(n_tokens: int, vocab: int) -> tuple[int, int]:
    """(tokens per matmul group, tokens per softmax chunk): a group is a whole number of chunks."""
    chunk = chunk_rows(n_tokens, vocab)
    group = chunk_rows(n_tokens, vocab, max(GROUP_ELEMENTS, CHUNK_ELEMENTS))
    return max(chunk, group // chunk * chunk), chunk


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        z_loss: float,
        compute_dtype: torch.dtype,
        compile_chunks: bool,
    ) -> torch.Tensor:
        needs_hidden, needs_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        n_tokens, vocab = hidden.size(0), weight.size(0)
        group, chunk = group_rows(n_tokens, vocab)
        chunk_fn = _chunk_fn(hidden.is_cuda, compile_chunks)
        w = weight.to(compute_dtype)
        total = torch.zeros((), device=hidden.device, dtype=torch.float32)
        grad_hidden = torch.empty_like(hidden) if needs_hidden else None
        grad_weight: torch.Tensor | None = None
        for start in range(0, n_tokens, group):
            h = hidden[start : start + group].to(compute_dtype)
            t = targets[start : start + group]
            grad_logits = h @ w.t()  # the logits, until each chunk's turn overwrites them
            for first in range(0, h.size(0), chunk):
                rows = slice(first, first + chunk)
                total += chunk_fn(grad_logits[rows], t[rows], z_loss)
            if grad_hidden is not None:
                grad_hidden[start : start + group] = grad_logits @ w
            if needs_weight:
                part = grad_logits.t() @ h
                grad_weight = part.float() if grad_weight is None else grad_weight.add_(part)
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(
        ctx: Any, grad_total: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None, None, None]:
        # scaled in place: a second copy of the projection's gradient would raise the peak (a
        # graph through this loss is not for backpropagating twice)
        grad_hidden, grad_weight = ctx.saved_tensors
        if grad_hidden is not None:
            grad_hidden.mul_(grad_total.to(grad_hidden.dtype))
        if grad_weight is not None:
            grad_weight = grad_weight.mul_(grad_total).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None


def linear_cross_entropy_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    z_loss: float = 0.0,
    compile_chunks: bool = False,
) -> torch.Tensor:
    """The summed cross-entropy of `hidden (..., d) @ weight (V, d).T` against `targets (...)`,
    equal to the plain form's, chunked so the logits of the whole batch never exist.
    `compile_chunks`: compile the per-chunk softmax on CUDA (the run's `parallel.compile`)."""
    flat = hidden.reshape(-1, hidden.size(-1))
    compute_dtype = weight.dtype
    if torch.is_autocast_enabled(hidden.device.type):
        compute_dtype = torch.get_autocast_dtype(hidden.device.type)
    # the matmuls run in compute_dtype explicitly; autocast would recast inside the chunks
    with torch.autocast(hidden.device.type, enabled=False):
        # torch's Function.apply is unannotated (returns Any); forward returns the loss tensor
        return cast(
            torch.Tensor,
            _LinearCrossEntropy.apply(  # type: ignore[no-untyped-call]
                flat, weight, targets.reshape(-1), z_loss, compute_dtype, compile_chunks
            ),
        )
