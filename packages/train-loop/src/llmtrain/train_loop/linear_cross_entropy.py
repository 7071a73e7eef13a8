"""Cross-entropy of the output projection without the batch's logits: `linear_cross_entropy_sum`.

A vocabulary of 128k makes the logits of a (4 x 2048)-token batch 2.1 GB in bf16, 4.2 GB in
float32, and a plain `F.cross_entropy(F.linear(h, W).float(), t)` keeps several such tensors
alive (the float32 copy, the log-softmax saved for backward, its gradient). Here the tokens go
through the projection in chunks: each chunk's logits are made, turned into that chunk's loss
and its gradient with respect to the logits, and multiplied back into the gradients of the
hidden states and of the projection right away, so at most one chunk of logits exists at a
time. The gradients are computed in the forward pass (the loss is a scalar whose backward only
scales them), which costs no FLOPs beyond the three matmuls autograd would run anyway.

The numbers are those of the plain form: logits in the matmul's dtype (bf16 under autocast, as
autocast's `F.linear` gives them), softmax statistics in float32, ignored targets (-100) count
neither in the loss nor in the gradient, and the z-loss adds `z * logsumexp²` per counted token.
"""

from __future__ import annotations

import torch

IGNORE = -100  # targets with this value (masked tokens) count neither in the loss nor the total
CHUNK_ELEMENTS = 1 << 27  # logits per chunk: 1024 tokens of a 128k vocabulary, 256 MiB in bf16


def chunk_loss_and_grad(
    logits: torch.Tensor, targets: torch.Tensor, z_loss: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed loss, d loss / d logits in the logits' dtype) for one chunk of logits (n, V)."""
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
    grad = torch.exp(wide - log_z.unsqueeze(1)) * softmax_weight.unsqueeze(1)
    grad = grad.scatter_add(1, safe.unsqueeze(1), -torch.ones_like(log_z).unsqueeze(1))
    grad = grad * counted.unsqueeze(1)
    return (per_token * counted).sum(), grad.to(logits.dtype)


_compiled_chunk = None


def _chunk_fn(on_cuda: bool, compile_chunks: bool):
    """The chunk function, compiled where it pays: on CUDA Inductor fuses the float32 softmax
    and its gradient into one pass over the bf16 logits; on CPU compiling costs more than it saves
    at the sizes CPUs train."""
    global _compiled_chunk
    if not (on_cuda and compile_chunks):
        return chunk_loss_and_grad
    if _compiled_chunk is None:
        _compiled_chunk = torch.compile(chunk_loss_and_grad, dynamic=False)
    return _compiled_chunk


def chunk_rows(n_tokens: int, vocab: int) -> int:
    """Tokens per chunk: CHUNK_ELEMENTS logits, in multiples of 128 rows (matmul tiles), and
    chunks of equal size where the token count allows (one compiled shape)."""
    rows = max(128, (CHUNK_ELEMENTS // vocab) // 128 * 128)
    if rows >= n_tokens:
        return n_tokens
    chunks = -(-n_tokens // rows)
    even = -(-n_tokens // chunks)
    return even if n_tokens % even == 0 else rows


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, z_loss, compute_dtype, compile_chunks):
        needs_hidden, needs_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        n_tokens, vocab = hidden.size(0), weight.size(0)
        rows = chunk_rows(n_tokens, vocab)
        chunk_fn = _chunk_fn(hidden.is_cuda, compile_chunks)
        w = weight.to(compute_dtype)
        total = torch.zeros((), device=hidden.device, dtype=torch.float32)
        grad_hidden = torch.empty_like(hidden) if needs_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if needs_weight else None
        for start in range(0, n_tokens, rows):
            h = hidden[start : start + rows].to(compute_dtype)
            logits = h @ w.t()
            loss, grad_logits = chunk_fn(logits, targets[start : start + rows], z_loss)
            total += loss
            if needs_hidden:
                grad_hidden[start : start + rows] = grad_logits @ w
            if needs_weight:
                grad_weight += grad_logits.t() @ h
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_total):
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
        return _LinearCrossEntropy.apply(
            flat, weight, targets.reshape(-1), z_loss, compute_dtype, compile_chunks
        )
