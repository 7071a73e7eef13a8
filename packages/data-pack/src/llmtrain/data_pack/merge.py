"""`llmtrain data merge`: one packed dataset from several of the same tokenizer, in order."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from llmtrain.core_mesh.errors import UserError
from llmtrain.data_pack.store import (
    DEFAULT_COMPRESSION,
    FORMAT,
    FORMAT_VERSION,
    DatasetWriter,
    Origins,
    Output,
    PackedDataset,
)

DOCS_PER_STEP = 1 << 16


@attrs.frozen
class MergeSummary:
    documents: int
    tokens: int
    n_bytes: int | None = None  # the text's UTF-8 bytes, when every input counted them


def _summed_counts(metas: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """The counts of datasets joined: each count every one of them records, summed; a count
    some lack (one packed before it was recorded, such as `bytes`) is left out, not guessed."""
    keys = [key for key in metas[0]["counts"] if all(key in m["counts"] for m in metas[1:])]
    return {key: sum(int(m["counts"][key]) for m in metas) for key in keys}


def merge(
    inputs: Sequence[str],
    output: str,
    *,
    overwrite: bool = False,
    compression: str = DEFAULT_COMPRESSION,
    storage_options: Mapping[str, Any] | None = None,
) -> MergeSummary:
    if "://" in output and output.rstrip("/") in {url.rstrip("/") for url in inputs}:
        # on a local disk the merge is staged and renamed over the input; object storage has
        # no rename, so the input would be deleted before it is read
        raise UserError(
            f"{output} is one of the inputs; on object storage write the merge to another output"
        )
    datasets = [PackedDataset(url, storage_options=storage_options) for url in inputs]
    for dataset in datasets:
        if dataset.chat is not None:
            raise UserError(
                f"{dataset.url} is a chat dataset (conversations in blocks of "
                f"{dataset.block} tokens with a loss mask), which merge does not join: pack the "
                "conversations together (`llmtrain data pack-chat` takes many inputs), or mix "
                "the datasets in the run config's data.train"
            )
    first = datasets[0]
    for other in datasets[1:]:
        if other.fingerprint != first.fingerprint:
            raise UserError(
                f"cannot merge {other.url} (tokenizer {other.meta['tokenizer']['name']}, "
                f"fingerprint {other.fingerprint}) with {first.url} (tokenizer "
                f"{first.meta['tokenizer']['name']}, fingerprint {first.fingerprint}): "
                "merged datasets must share one tokenizer"
            )
    dtype = max((d.dtype for d in datasets), key=lambda t: t.itemsize)
    out = Output(output, overwrite=overwrite, storage_options=storage_options)
    try:
        # provenance survives a merge when every input has it (source indices shift past the
        # sources of the inputs before)
        origins = all(d.has_origins for d in datasets)
        writer = DatasetWriter(
            out, dtype, chunk_tokens=first.chunk_tokens, compression=compression, origins=origins
        )
        source_base = 0
        for dataset in datasets:
            _copy(dataset, writer, source_base if origins else None)
            source_base += len(dataset.meta["sources"])
        writer.close()
        counts = _summed_counts([d.meta for d in datasets])
        out.commit(
            {
                "format": FORMAT,
                "version": FORMAT_VERSION,
                "tokenizer": first.meta["tokenizer"],
                "dtype": dtype.name,
                "field": first.meta.get("field"),
                "sources": [s for d in datasets for s in d.meta["sources"]],
                "counts": counts,
                "bad_lines": [b for d in datasets for b in d.meta.get("bad_lines", [])],
                "merged_from": [d.url for d in datasets],
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            }
        )
    except BaseException as exc:
        out.abort(exc)
        raise
    return MergeSummary(writer.n_documents, writer.n_tokens, counts.get("bytes"))


def _copy(dataset: PackedDataset, writer: DatasetWriter, source_base: int | None) -> None:
    """Stream a dataset's documents across in blocks of whole documents (bounded memory), with
    their origins when `source_base` is given."""
    for begin in range(0, dataset.n_documents, DOCS_PER_STEP):
        end = min(begin + DOCS_PER_STEP, dataset.n_documents)
        offsets = np.asarray(dataset.doc_offsets[begin : end + 1], dtype=np.int64)
        tokens = dataset.read(int(offsets[0]), int(offsets[-1]))
        origins = None
        if source_base is not None:
            theirs = dataset.origins(begin, end)
            origins = Origins(theirs.sources + np.uint32(source_base), theirs.rows, theirs.ids)
        writer.add(tokens, np.diff(offsets), origins=origins)
