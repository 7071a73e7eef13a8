"""Training a GPT-2-style byte-level BPE with the tokenizers library (`llmtrain data
train-tokenizer`, tests and benchmarks)."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterable, Iterator, Sequence

from llmtrain.core_mesh.errors import UserError
from llmtrain.data_pack.tokenizer.common import ENDOFTEXT


def train_bpe(
    texts: Iterable[str],
    vocab_size: int,
    *,
    special_tokens: Sequence[str] = (ENDOFTEXT,),
    min_frequency: int = 2,
    show_progress: bool = False,
) -> str:
    """Train a GPT-2-style byte-level BPE and return its tokenizer.json text. `show_progress`:
    the tokenizers library's bars for the training phase (words, pairs, merges) on a terminal;
    its bar for reading `texts` stays hidden, the caller shows its own."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 256 + len(special_tokens):
        raise UserError(
            f"vocab size {vocab_size} is too small: byte-level BPE needs at least 256 + "
            f"{len(special_tokens)} special tokens"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    reading = _training_bars_only(texts) if show_progress else contextlib.nullcontext(texts)
    with reading as documents:
        tok.train_from_iterator(documents, trainer=trainer)
    return tok.to_str()


@contextlib.contextmanager
def _training_bars_only(texts: Iterable[str]) -> Iterator[Iterable[str]]:
    """`texts`, for training with the tokenizers library's bars, less two of its habits. Its
    pre-processing bar counts documents against an unknown total, over the caller's bar of bytes
    read: the library draws a bar only if stderr is a terminal when it makes the bar, and it
    makes this one before it asks for the first document, so stderr (fd 2) points at the null
    device from the call until that request. And it ends each bar with a newline on stdout, which
    carries the command's result: stdout (fd 1) points at stderr during the call."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved_out, saved_err = os.dup(1), os.dup(2)

    def reading() -> Iterator[str]:
        os.dup2(saved_err, 2)
        yield from texts

    os.dup2(saved_err, 1)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    os.close(null)
    try:
        yield reading()
    finally:
        os.dup2(saved_err, 2)
        os.dup2(saved_out, 1)
        os.close(saved_out)
        os.close(saved_err)
