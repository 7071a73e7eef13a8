"""The `tiktoken` tokenizer: a `.tiktoken` ranks file and its split pattern and special tokens
(by hand, or from one of tiktoken's published encodings, without downloading anything)."""

from __future__ import annotations

import base64
import contextlib
import functools
import os
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import attrs
import numpy as np

from llmtrain.data_pack.tokenizer import pieces
from llmtrain.data_pack.tokenizer.common import (
    ENDOFTEXT,
    GPT2_PATTERN,
    TokenizerError,
    fingerprint_of,
    read_bytes,
)
from llmtrain.data_pack.tokenizer.fast_bpe import tiktoken_arrays
from llmtrain.data_pack.tokenizer.pieces import (
    encode_in_pieces,
    join_arrays,
    pieces_match,
)


@attrs.frozen
class TiktokenOptions:
    """A `.tiktoken` ranks file (base64 token, rank per line) plus its split pattern.

    `encoding` names one of tiktoken's published encodings (e.g. cl100k_base, o200k_base) to take
    the pattern and special tokens from; `pattern` and `special_tokens` set them by hand instead.
    """

    path: str
    encoding: str | None = None
    pattern: str | None = None
    special_tokens: dict[str, int] | None = None
    eod_token: str = ENDOFTEXT
    parse_special: bool = False  # as for `hf`: special-token text in documents is plain text


def parse_tiktoken_ranks(data: bytes, source: str) -> dict[bytes, int]:
    if data.lstrip()[:1] in (b"{", b"["):
        raise TokenizerError(
            f"{source}: JSON, not a .tiktoken ranks file (a 'base64-token rank' pair a line); "
            f"a Hugging Face tokenizer.json is given as hf:{source}"
        )
    ranks: dict[bytes, int] = {}
    ranked: dict[int, int] = {}  # rank -> the line that gave it
    for number, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank_text = line.split()
            piece, rank = base64.b64decode(token, validate=True), int(rank_text)
        except ValueError:
            raise TokenizerError(
                f"{source}:{number}: expected 'base64-token rank', got {line[:60]!r}"
            ) from None
        # tiktoken's core panics (a Rust panic, not a Python error) on a token or rank given
        # twice, and on text with a byte that has no rank: refused here, naming the line
        if piece in ranks or rank in ranked or rank < 0:
            why = "a negative rank" if rank < 0 else "a token or rank given before"
            raise TokenizerError(f"{source}:{number}: {why} ({line[:60]!r}); the file is damaged")
        ranks[piece] = rank
        ranked[rank] = number
    if not ranks:
        raise TokenizerError(f"{source}: no ranks in the file")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise TokenizerError(
            f"{source}: no rank for {len(missing)} of the 256 single bytes (the first: "
            f"0x{missing[0]:02x}), which every byte-level BPE ranks file has: the file is cut "
            "short or damaged"
        )
    return ranks


def _published(name: str, ranks: dict[bytes, int]) -> dict[str, Any]:
    """Pattern and special tokens of a published tiktoken encoding, built on our local ranks.

    tiktoken's constructors download their ranks; we hand them the local ones instead, so the
    pattern and special tokens come from tiktoken itself and nothing is fetched.
    """
    import tiktoken_ext.openai_public as published

    constructors = published.ENCODING_CONSTRUCTORS
    if name not in constructors or name == "gpt2":
        known = ", ".join(n for n in constructors if n != "gpt2")
        raise TokenizerError(f"unknown tiktoken encoding {name!r}; known: {known}")
    with _swapped(published, "load_tiktoken_bpe", lambda *a, **k: ranks):
        parameters: dict[str, Any] = constructors[name]()
        return parameters


@contextlib.contextmanager
def _swapped(module: Any, attribute: str, value: Any) -> Iterator[None]:
    old = getattr(module, attribute)
    setattr(module, attribute, value)
    try:
        yield
    finally:
        setattr(module, attribute, old)


class TiktokenTokenizer:
    def __init__(self, options: TiktokenOptions):
        import tiktoken

        self.options = options
        data = read_bytes(options.path)
        ranks = parse_tiktoken_ranks(data, options.path)
        if options.encoding is not None:
            published = _published(options.encoding, ranks)
            pattern = options.pattern or published["pat_str"]
            specials = options.special_tokens or published["special_tokens"]
        else:
            pattern = options.pattern or GPT2_PATTERN
            specials = options.special_tokens or {ENDOFTEXT: max(ranks.values()) + 1}
        if options.eod_token not in specials:
            raise TokenizerError(
                f"{options.path}: eod_token {options.eod_token!r} is not a special token "
                f"({', '.join(specials)})"
            )
        taken = {rank: token for token, rank in ranks.items()}
        for special, rank in specials.items():
            if type(rank) is not int or rank < 0 or rank in taken:
                raise TokenizerError(
                    f"{options.path}: special token {special!r} has id {rank!r}, which "
                    + ("a token of the ranks file has" if rank in taken else "is no token id")
                    + "; give special_tokens ids above the ranks"
                )
        self._pattern = pattern
        self._specials: dict[str, int] = dict(specials)
        self._ranks_hash = fingerprint_of(data)
        try:
            self._enc = tiktoken.Encoding(
                name="llmtrain", pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials
            )
        except Exception as exc:  # noqa: BLE001 - tiktoken raises plain Exception
            raise TokenizerError(f"{options.path}: tiktoken cannot use it: {exc}") from None

    @property
    def name(self) -> str:
        return f"tiktoken:{os.path.basename(self.options.path)}"

    @property
    def vocab_size(self) -> int:
        n_vocab: int = self._enc.n_vocab
        return n_vocab

    @property
    def eod_id(self) -> int:
        return self._specials[self.options.eod_token]

    @functools.cached_property
    def fingerprint(self) -> str:
        return fingerprint_of(
            "tiktoken",
            self._ranks_hash,
            self._pattern,
            self._specials,
            self.eod_id,
            self.options.parse_special,
        )

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [a.tolist() for a in self.encode_batch_arrays(texts)]

    def encode_batch_arrays(self, texts: Sequence[str]) -> list[np.ndarray]:
        if all(len(text) <= pieces.PIECE_CHARS for text in texts) or not self.pieces_safe:
            return self._whole_arrays(texts)
        return encode_in_pieces(texts, self._whole_arrays, join_arrays)

    def _whole_arrays(self, texts: Sequence[str]) -> list[np.ndarray]:
        return tiktoken_arrays(self._enc, texts, self.options.parse_special)

    @functools.cached_property
    def pieces_safe(self) -> bool:
        """Whether long texts may be encoded in pieces (`text_pieces`): no special token that
        text can spell holds whitespace, and the probe text's pieces give its whole ids."""
        specials = self._specials if self.options.parse_special else {}
        if any(c.isspace() for token in specials for c in token):
            return False
        return pieces_match(self._whole_arrays)

    def decode(self, ids: Iterable[int]) -> str:
        return self._enc.decode([int(i) for i in ids], errors="replace")

    def token_id(self, token: str) -> int | None:
        if token in self._specials:
            return self._specials[token]
        try:
            found: int = self._enc.encode_single_token(token)
            return found
        except KeyError:
            return None

    @property
    def special_tokens(self) -> list[str]:
        return list(self._specials)
