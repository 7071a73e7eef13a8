"""Which documents a range of tokens holds, and where each came from (file, line or row, id).

A packed dataset lays its documents end to end, each ended by one eod token, and records every
document's origin beside it (`store.py`). `documents_in(dataset, start, stop)` lists the documents
overlapping tokens [start, stop) with the part of each inside the range; `sample_documents` does
it for training samples, through the same sampler training uses, so a window a step read can be
traced back to its records. Reads stay small: the chunk index narrows the document offsets to
the few chunks the range touches, and only those documents' origins are read.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs
import numpy as np

from llmtrain.data_pack.sources import location
from llmtrain.data_pack.store import PackedDataset

if TYPE_CHECKING:
    from llmtrain.data_pack.loader import WindowDataset


@attrs.frozen
class DocumentSpan:
    """The part of one document inside a token range. `start`/`stop` are absolute token
    offsets in the dataset; `offset` is where that part begins in the range. The document's own
    tokens, its eod included, are [`doc_start`, `doc_stop`)."""

    document: int
    url: str  # the input file
    unit: str  # what `number` counts: "line" (from 1), "row" (from 0) or "file" (no number)
    number: int
    id: str  # the record's id field ("" when it had none)
    start: int
    stop: int
    offset: int
    doc_start: int
    doc_stop: int

    @property
    def cut_start(self) -> bool:
        """The range begins after the document's first token."""
        return self.start > self.doc_start

    @property
    def cut_end(self) -> bool:
        """The range ends before the document's last token (its eod)."""
        return self.stop < self.doc_stop

    @property
    def where(self) -> str:
        """`file:line`, `file, row N`, or the file."""
        return location(self.url, self.unit, self.number)


@attrs.frozen
class SampleDocuments:
    """One training sample: which dataset (index into the WindowDataset's sources) and window it
    is, the window's tokens [`start`, `stop`) in that dataset, and the documents they hold."""

    sample: int
    source: int
    window: int
    start: int
    stop: int
    documents: list[DocumentSpan]


def _first_starts(dataset: PackedDataset, start: int, stop: int) -> tuple[int, np.ndarray]:
    """(k, doc_offsets[k : m + 1]): the offsets of every document that can overlap tokens
    [start, stop), read from the chunks the range touches. `chunk_docs[c]` is the first document
    starting at or after chunk c; a position in chunk c lies in a document starting in that
    chunk or in the one before `chunk_docs[c]`."""
    first_chunk = start // dataset.chunk_tokens
    last_chunk = (stop - 1) // dataset.chunk_tokens
    low = max(int(dataset.chunk_docs[first_chunk]) - 1, 0)
    high = int(dataset.chunk_docs[last_chunk + 1])  # every overlapping document ends by here
    return low, np.asarray(dataset.doc_offsets[low : high + 1], dtype=np.int64)


def documents_in(dataset: PackedDataset, start: int, stop: int) -> list[DocumentSpan]:
    """The documents overlapping tokens [start, stop) of `dataset`, in order: their parts tile
    the range exactly. A DatasetError when the dataset records no provenance."""
    if not 0 <= start < stop <= dataset.n_tokens:
        raise IndexError(f"token range [{start}, {stop}) is outside 0..{dataset.n_tokens}")
    low, offsets = _first_starts(dataset, start, stop)
    first, last = np.searchsorted(offsets, [start, stop - 1], side="right") - 1
    origins = dataset.origins(low + int(first), low + int(last) + 1)
    sources = dataset.meta["sources"]
    spans = []
    for i, k in enumerate(range(int(first), int(last) + 1)):
        doc_start, doc_stop = int(offsets[k]), int(offsets[k + 1])
        source = sources[int(origins.sources[i])]
        part_start, part_stop = max(doc_start, start), min(doc_stop, stop)
        spans.append(
            DocumentSpan(
                document=low + k,
                url=source["url"],
                unit=source["unit"],
                number=int(origins.rows[i]),
                id=origins.ids[i],
                start=part_start,
                stop=part_stop,
                offset=part_start - start,
                doc_start=doc_start,
                doc_stop=doc_stop,
            )
        )
    return spans


def sample_documents(
    data: WindowDataset, samples: Sequence[int] | np.ndarray
) -> list[SampleDocuments]:
    """Each global sample's dataset, window and documents, as `data.read(samples)` reads them."""
    samples = np.asarray(samples, dtype=np.int64)
    sources, windows = data.sampler.lookup(samples)
    seq_len = data.seq_len
    found = []
    for sample, source, window in zip(
        samples.tolist(), sources.tolist(), windows.tolist(), strict=True
    ):
        start = window * seq_len
        stop = start + seq_len + 1
        dataset = data.sources[source].dataset
        found.append(
            SampleDocuments(sample, source, window, start, stop, documents_in(dataset, start, stop))
        )
    return found
