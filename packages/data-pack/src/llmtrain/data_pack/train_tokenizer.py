"""`llmtrain data train-tokenizer`: a byte-level BPE trained on your own corpus (any input format
`pack` reads), for machines that cannot download one. The result is a tokenizer.json the `hf`
tokenizer (and its fast path) reads.

Two phases: reading the corpus (the tokenizers library splits it into words as it comes), with
the progress of the bytes and documents read; then training on the word counts, where that
library shows its own bars on a terminal."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import fsspec
import structlog
from fsspec.core import url_to_fs

from llmtrain.core_mesh.errors import UserError, naming_file
from llmtrain.core_mesh.storage_errors import missing_bucket, storage_errors
from llmtrain.data_pack.documents import text_batches
from llmtrain.data_pack.formats import InputFormats
from llmtrain.data_pack.progress import Progress, ProgressSettings
from llmtrain.data_pack.sources import Source, expand_inputs
from llmtrain.data_pack.tokenizer import ENDOFTEXT, TokenizerError, tokenizer_json, train_bpe

if TYPE_CHECKING:
    from llmtrain.core_mesh.plugins import PluginManager

log = structlog.get_logger("llmtrain.data_pack")

READ_SPLIT_BYTES = 1 << 20  # the input is read (and its progress reported) a MB at a time


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
    progress: ProgressSettings = ProgressSettings(),
    plugins: PluginManager | None = None,
) -> int:
    """Train on the inputs' documents and write tokenizer.json; returns the vocab size reached.
    `plugins`: where the input formats come from (default: the installed plugins)."""
    storage_options = dict(storage_options or {})
    with storage_errors(output, doing="write"):
        _check_output(output, overwrite, storage_options)
    formats = None if plugins is None else InputFormats.from_plugins(plugins)
    sources = expand_inputs(inputs, storage_options, formats=formats)
    if any(_same_file(output, s.url) for s in sources):
        raise UserError(f"{output} is one of the inputs; write the tokenizer to another file")
    corpus = _Corpus(sources, field, storage_options)
    text = train_bpe(
        corpus.read(max_documents, progress, vocab_size),
        vocab_size,
        special_tokens=tuple(special_tokens or (ENDOFTEXT,)),
        min_frequency=min_frequency,
        show_progress=progress.bar,
    )
    if corpus.documents == 0:
        raise UserError(f"no documents with field {field!r} in {', '.join(inputs)}")
    with storage_errors(output, doing="write"), naming_file(output):
        _write(output, text, storage_options)
    reached = len(json.loads(text)["model"]["vocab"])
    log.info("tokenizer.trained", output=output, documents=corpus.documents, vocab_size=reached)
    if reached < vocab_size:
        log.warning(
            "tokenizer.vocab_smaller",
            asked=vocab_size,
            reached=reached,
            hint="the corpus has too few distinct pairs; use more text or a smaller vocab",
        )
    return reached


def _check_output(output: str, overwrite: bool, storage_options: dict[str, Any]) -> None:
    """An existing output is replaced only with --overwrite, and only if it is a tokenizer file
    (a tokenizer.json): a directory, or any other file (a corpus, a config), is someone's data
    and is refused before anything is written."""
    fs, path = url_to_fs(output, **storage_options)
    if not fs.exists(path):
        if "://" in output and (problem := missing_bucket(fs, output)) is not None:
            raise UserError(problem)
        if "://" not in output:  # refused now, not after the training
            above = os.path.dirname(os.path.abspath(output))
            while not os.path.exists(above):
                above = os.path.dirname(above)
            if not os.path.isdir(above):
                raise UserError(
                    f"{output}: {above} is a file, not a folder: choose a path below a folder"
                )
        return
    if not overwrite:
        raise UserError(f"{output} already exists; pass --overwrite to replace it")
    if fs.isdir(path):
        raise UserError(
            f"{output} is a directory; --overwrite only replaces a tokenizer.json file, so "
            "nothing was changed: give the path of the file to write"
        )
    try:
        tokenizer_json(fs.cat_file(path), output)
    except TokenizerError:
        raise UserError(
            f"{output} exists and is not a tokenizer.json: --overwrite only replaces a "
            "tokenizer file, so nothing was changed; choose another output, or remove it "
            "yourself if it is to go"
        ) from None


def _write(output: str, text: str, storage_options: dict[str, Any]) -> None:
    """Write the tokenizer whole or not at all: on a local disk through a temporary file renamed
    into place (an interrupted write would leave a tokenizer.json cut short, which a later
    --overwrite would not recognise as one); an object store makes an object whole on close."""
    if "://" in output and not output.startswith("file://"):
        with fsspec.open(output, "w", encoding="utf-8", **storage_options) as f:
            f.write(text)
        return
    path = output.removeprefix("file://")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    temporary = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        with open(temporary, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)


def _same_file(a: str, b: str) -> bool:
    if "://" in a or "://" in b:
        return a.rstrip("/") == b.rstrip("/")
    return os.path.abspath(a) == os.path.abspath(b)


class _Corpus:
    """The documents of the inputs, counted as the trainer reads them."""

    def __init__(self, sources: Sequence[Source], field: str, storage_options: dict[str, Any]):
        self.sources, self.field, self.storage_options = sources, field, storage_options
        self.documents = self.bytes = 0

    def read(
        self, max_documents: int | None, progress: ProgressSettings, vocab_size: int
    ) -> Iterator[str]:
        """The documents (the first `max_documents`), reporting the bytes and documents read;
        logs the start of the training phase when they are all read."""
        total = sum(s.size for s in self.sources)
        meter = Progress(progress, total, event="tokenizer.reading", desc="reading")
        try:
            batches = text_batches(self.sources, self.field, self.storage_options, READ_SPLIT_BYTES)
            for texts, n_bytes in batches:
                if max_documents is not None:
                    texts = texts[: max_documents - self.documents]
                yield from texts
                self.documents += len(texts)
                self.bytes += n_bytes
                meter.update(n_bytes, documents=self.documents)
                if self.documents == max_documents:
                    break
        finally:
            meter.close()
        log.info(
            "tokenizer.training", documents=self.documents, bytes=self.bytes, vocab_size=vocab_size
        )
