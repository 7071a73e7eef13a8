"""Long texts in pieces: a text longer than `PIECE_CHARS` is encoded a piece at a time, cut
where the pre-tokenizer splits anyway, so an encoder's memory grows with the piece, not with the
document (the `hf` and `tiktoken` backends use it)."""

from __future__ import annotations

import itertools
import re
import unicodedata
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import numpy as np

# An encoder's memory grows with what it is given: HF's keeps tokens, offsets and masks, about a
# hundred bytes per token, so one 50 MB document took gigabytes. A longer text than PIECE_CHARS is
# encoded a piece at a time and the ids joined; the pieces are cut where the pre-tokenizer splits
# anyway, which makes the joined ids those of the whole text.

PIECE_CHARS = 1 << 20

# Where a piece may end: before a space that follows a non-space, or before a newline that
# follows a letter or digit. No pre-token of GPT-2's, cl100k's or o200k's split pattern runs from
# a non-space into a space, or from a letter or digit into a newline (cl100k's punctuation
# pre-tokens do take the newlines after them), and none looks back: the whole text's scan ends a
# pre-token there and scans on from there, as a piece starting there is scanned.
_CUT = re.compile(r"\S(?= )|\w(?=\n)")

# ordinary text with every kind of place _CUT finds: a tokenizer encodes long texts in pieces only
# if this text, cut at all of them, gives the ids of the whole
_PROBE = (
    "Hello world, it's 3.14 (x) [y]  two spaces\tand a tab. A line ends here\n"
    "café 日本語 テキスト über 42\n\nnaïve 'quoted' \"double\" a-b a_b ½ x² €100 <|endoftext|> end"
)


def cut_places(text: str, start: int = 0) -> Iterator[int]:
    """The places at or after `start` where a piece of `text` may end (see _CUT)."""
    for match in _CUT.finditer(text, max(start - 1, 0)):
        if text[match.end()] == " " or unicodedata.category(match.group())[0] in "LN":
            yield match.end()


def text_pieces(text: str, size: int) -> Iterator[str]:
    """`text` in pieces of at least `size` characters (the last may be shorter), each cut where
    the pre-tokenizer splits anyway (see _CUT). A stretch with no such place stays in one piece:
    cutting it could change the ids."""
    start = 0
    while len(text) - start > size:
        cut = next(cut_places(text, start + size), None)
        if cut is None:
            break
        yield text[start:cut]
        start = cut
    yield text[start:]


Ids = TypeVar("Ids")  # one text's ids: a list of ints or an array


def join_lists(parts: list[list[int]]) -> list[int]:
    return list(itertools.chain.from_iterable(parts))


def join_arrays(parts: list[np.ndarray]) -> np.ndarray:
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def encode_in_pieces(
    texts: Sequence[str],
    encode: Callable[[Sequence[str]], list[Ids]],
    join: Callable[[list[Ids]], Ids],
) -> list[Ids]:
    """`encode(texts)` (a list of texts to a list of ids), except that each text longer than
    PIECE_CHARS is encoded a piece at a time (`text_pieces`) and its pieces' ids joined by
    `join`. Only for encoders whose pieces give the whole's ids (see `pieces_match`)."""
    long = {i for i, text in enumerate(texts) if len(text) > PIECE_CHARS}
    if not long:
        return encode(texts)
    ids = encode(["" if i in long else text for i, text in enumerate(texts)])
    for i in long:
        ids[i] = join([encode([piece])[0] for piece in text_pieces(texts[i], PIECE_CHARS)])
    return ids


def pieces_match(
    encode: Callable[[list[str]], Sequence[Iterable[Any]]], text: str = _PROBE
) -> bool:
    """Whether `text` cut at every place `text_pieces` may cut it encodes to the ids of the whole
    (`encode`: a list of texts to a list of ids)."""
    bounds = [0, *cut_places(text), len(text)]
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    whole = [int(i) for i in encode([text])[0]]
    return whole == [int(i) for ids in encode(pieces) for i in ids]
