"""From a task's items to token rows to score, the way lm-evaluation-harness builds them.

A multiple-choice or cloze option becomes one row: the tokens of context + continuation, cut to
the model's length from the left, whose last tokens (the continuation's) are scored. The
continuation's tokens are those of the whole string minus the context's (trailing spaces of the
context move to the continuation first), so a word is tokenized as it appears in running text;
an empty context becomes the end-of-document token. A perplexity document becomes disjoint
windows of `max_len` scored tokens, the first after the end-of-document token. Loading this
module imports no torch.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from llmtrain.core_mesh.interfaces import TaskItem, Tokenizer


@attrs.frozen
class Request:
    """One row: `tokens` (at most max_len + 1) predicted left to right; the last `scored` of
    them count. `truncated`: the context was cut from the left to fit."""

    item: int
    option: int
    tokens: tuple[int, ...]
    scored: int
    truncated: bool = False


def split_context(context: str, continuation: str) -> tuple[str, str]:
    """Trailing spaces of the context belong to the continuation (` Paris`, not `Paris`)."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        return context[:-n_spaces], context[-n_spaces:] + continuation
    return context, continuation


def option_requests(items: Sequence[TaskItem], tokenizer: Tokenizer, max_len: int) -> list[Request]:
    """One request per option of every item. Each distinct context is encoded once, and all
    strings of the task go through the tokenizer in one batch."""
    pairs = [
        (i, option, *split_context(item.context(option), item.delimiter + item.choice(option)))
        for i, item in enumerate(items)
        for option in range(item.n_options)
    ]
    contexts = sorted({context for _, _, context, _ in pairs if context})
    wholes = [context + continuation for _, _, context, continuation in pairs]
    encoded = tokenizer.encode_batch(contexts + wholes)
    context_ids = dict(zip(contexts, encoded[: len(contexts)], strict=True))
    requests = []
    for (i, option, context, continuation), whole in zip(
        pairs, encoded[len(contexts) :], strict=True
    ):
        if context:
            prefix = context_ids[context]
            answer = whole[len(prefix) :]
        else:
            prefix, answer = [tokenizer.eod_id], tokenizer.encode_batch([continuation])[0]
        requests.append(_row(i, option, list(prefix), list(answer), max_len))
    return requests


def _row(item: int, option: int, prefix: list[int], answer: list[int], max_len: int) -> Request:
    tokens = (prefix + answer)[-(max_len + 1) :]
    return Request(
        item,
        option,
        tuple(tokens),
        scored=min(len(answer), len(tokens) - 1),
        truncated=len(prefix) + len(answer) > max_len + 1,
    )


def rolling_requests(
    items: Sequence[TaskItem], tokenizer: Tokenizer, max_len: int
) -> list[Request]:
    """Disjoint windows of each document (`item.choices[0]`): every token is scored once, with
    up to max_len - 1 tokens of context from the same window or the one before."""
    documents = tokenizer.encode_batch([item.choices[0] for item in items])
    requests = []
    for i, ids in enumerate(documents):
        ids = list(ids)
        row = [tokenizer.eod_id, *ids]
        end, window = 0, 0
        while end < len(ids):
            new_end = min(end + max_len, len(ids))
            start = max(0, new_end - max_len)  # in `row`, position p holds ids[p - 1]
            requests.append(Request(i, window, tuple(row[start : new_end + 1]), new_end - end))
            end, window = new_end, window + 1
    return requests


def requests_of(
    scoring: str, items: Sequence[TaskItem], tokenizer: Tokenizer, max_len: int
) -> list[Request]:
    if scoring == "perplexity":
        return rolling_requests(items, tokenizer, max_len)
    return option_requests(items, tokenizer, max_len)
