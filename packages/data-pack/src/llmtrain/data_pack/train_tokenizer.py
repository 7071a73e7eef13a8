"""`llmtrain data train-tokenizer`: a byte-level BPE trained on your own JSONL, for machines that
cannot download one. The result is a tokenizer.json the `hf` tokenizer (and its fast path) reads."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import fsspec
import structlog
from fsspec.core import url_to_fs

from llmtrain.core_mesh.errors import UserError
from llmtrain.data_pack.documents import iter_texts
from llmtrain.data_pack.sources import expand_inputs
from llmtrain.data_pack.tokenizer import ENDOFTEXT, train_bpe

log = structlog.get_logger("llmtrain.data_pack")


def train_tokenizer(
    inputs: Sequence[str],
    output: str,
    *,
    vocab_size: int,
    field: str = "text",
    min_frequency: int = 2,
    special_tokens: Sequence[str] | None = None,
    max_documents: int | None = None,
    overwrite: bool = False,
    storage_options: Mapping[str, Any] | None = None,
) -> int:
    """Train on the inputs' documents and write tokenizer.json; returns the vocab size reached."""
    import json

    storage_options = dict(storage_options or {})
    fs, path = url_to_fs(output, **storage_options)
    if fs.exists(path) and not overwrite:
        raise UserError(f"{output} already exists; pass --overwrite to replace it")
    sources = expand_inputs(inputs, storage_options)
    texts = iter_texts(sources, field, storage_options)
    if max_documents is not None:
        texts = itertools.islice(texts, max_documents)
    counted = _Counter(texts)
    text = train_bpe(
        counted,
        vocab_size,
        special_tokens=tuple(special_tokens or (ENDOFTEXT,)),
        min_frequency=min_frequency,
    )
    if counted.n == 0:
        raise UserError(f"no documents with field {field!r} in {', '.join(inputs)}")
    with fsspec.open(output, "w", encoding="utf-8", **storage_options) as f:
        f.write(text)
    reached = len(json.loads(text)["model"]["vocab"])
    log.info("tokenizer.trained", output=output, documents=counted.n, vocab_size=reached)
    if reached < vocab_size:
        log.warning(
            "tokenizer.vocab_smaller",
            asked=vocab_size,
            reached=reached,
            hint="the corpus has too few distinct pairs; use more text or a smaller vocab",
        )
    return reached


class _Counter:
    def __init__(self, texts):
        self.texts, self.n = texts, 0

    def __iter__(self):
        for text in self.texts:
            self.n += 1
            yield text
