"""Sampling text from a model (any `interfaces.LanguageModel`, not only the Transformer): its KV
cache when it has one, temperature, top-k, top-p, stop at the end of a document or of a chat
turn."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from llmtrain.core_mesh.interfaces import LanguageModel


def sample_next(
    logits: torch.Tensor,
    *,
    vocab_size: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """One token id per row of logits (B, padded vocab); padding ids are never chosen."""
    logits = logits[:, :vocab_size].float()
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, vocab_size), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # drop a token when the tokens ranked above it already reach top_p; the first always stays
        drop = probs.cumsum(dim=-1) - probs >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@contextlib.contextmanager
def _evaluating(model: object) -> Iterator[None]:
    """Eval mode (no dropout) for the duration, the mode before restored after."""
    if not isinstance(model, torch.nn.Module):
        yield
        return
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


@torch.no_grad()
def generate(
    model: LanguageModel,
    prompt: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eod_id: int | None = None,
    vocab_size: int | None = None,
    use_cache: bool = True,
    generator: torch.Generator | None = None,
    stop_ids: Sequence[int] = (),
) -> torch.Tensor:
    """Continue `prompt` (1, T) by up to `max_new_tokens`, stopping after `eod_id` or one of
    `stop_ids` (a chat template's end of turn) is emitted.

    temperature 0 is greedy. Generation also stops at the model's max_seq_len. `vocab_size`
    (the tokenizer's) keeps sampling to ids the tokenizer has when the model's table is larger.
    A model whose `new_cache` returns None (or `use_cache=False`) reruns the whole prefix for
    each new token.
    """
    if prompt.dim() != 2 or prompt.size(0) != 1:
        raise ValueError(f"prompt must have shape (1, T), got {tuple(prompt.shape)}")
    options = model.options
    if prompt.size(1) >= options.max_seq_len:
        raise ValueError(
            f"prompt of {prompt.size(1)} tokens leaves no room in max_seq_len={options.max_seq_len}"
        )
    max_new_tokens = min(max_new_tokens, options.max_seq_len - prompt.size(1))
    tokens = prompt
    stop = {int(i) for i in stop_ids} | ({eod_id} if eod_id is not None else set())
    with _evaluating(model):
        cache = model.new_cache(1, prompt.size(1) + max_new_tokens) if use_cache else None
        logits = (model(prompt, cache=cache) if cache is not None else model(prompt))[:, -1]
        for _ in range(max_new_tokens):
            nxt = sample_next(
                logits,
                vocab_size=min(options.vocab_size, vocab_size or options.vocab_size),
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                generator=generator,
            )
            tokens = torch.cat([tokens, nxt.view(1, 1)], dim=1)
            if nxt.item() in stop or tokens.size(1) == prompt.size(1) + max_new_tokens:
                break
            if cache is not None:
                logits = model(nxt.view(1, 1), cache=cache, start_pos=tokens.size(1) - 1)[:, -1]
            else:
                logits = model(tokens)[:, -1]
    return tokens
