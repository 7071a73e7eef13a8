"""The `hf` tokenizer: a Hugging Face tokenizer.json, through the tokenizers library or, for a
GPT-2-style byte-level BPE, through tiktoken's BPE core (`fast_bpe`) once both give the same ids."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

import attrs
import numpy as np

from llmtrain.data_pack.tokenizer import pieces
from llmtrain.data_pack.tokenizer.common import (
    EOD_CANDIDATES,
    TokenizerError,
    fingerprint_of,
    read_bytes,
)
from llmtrain.data_pack.tokenizer.fast_bpe import (
    split_pattern,
    tiktoken_arrays,
    tiktoken_equivalent,
)
from llmtrain.data_pack.tokenizer.pieces import (
    Ids,
    encode_in_pieces,
    join_arrays,
    join_lists,
    pieces_match,
)
from llmtrain.data_pack.tokenizer.tokenizer_json import tokenizer_json


@attrs.frozen
class HFOptions:
    """A Hugging Face `tokenizer.json` (local path or fsspec URL)."""

    path: str
    eod_token: str | None = None
    fast: Literal["auto", "on", "off"] = "auto"
    # False: a special token's text inside a document ("<|endoftext|>") is encoded as plain text,
    # so only the packer's eod ends documents; True: it becomes the special id (chat templates)
    parse_special: bool = False


def _added_tokens_allow_cuts(added: Sequence[dict[str, Any]], parse_special: bool) -> bool:
    """Whether no added token that the encoder finds in text could span a cut (its text holds
    whitespace) or take the whitespace beside one (lstrip, rstrip). Special tokens are found only
    with `parse_special`; the others always."""
    for token in added:
        if token.get("special") and not parse_special:
            continue
        content = token.get("content", "")
        if token.get("lstrip") or token.get("rstrip") or any(c.isspace() for c in content):
            return False
    return True


class HFTokenizer:
    def __init__(self, options: HFOptions):
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        import tokenizers

        self.options = options
        raw = read_bytes(options.path)
        self._spec = tokenizer_json(raw, options.path)
        try:
            self._tok = tokenizers.Tokenizer.from_str(raw.decode("utf-8"))
        except Exception as exc:  # noqa: BLE001 - tokenizers raises plain Exception
            raise TokenizerError(
                f"{options.path}: a tokenizer.json that tokenizers {tokenizers.__version__} "
                f"cannot load: {exc}"
            ) from None
        self._tok.encode_special_tokens = not options.parse_special
        self._eod_token = self._find_eod(options.eod_token)
        eod = self._tok.token_to_id(self._eod_token)
        if eod is None:  # _find_eod returns only a token the tokenizer has
            raise TokenizerError(f"{options.path}: no token {self._eod_token!r} (eod_token)")
        self._eod = eod
        # `auto` builds the fast encoder but uses it only once trusted: after `verify_fast`, or
        # in a copy from `with_fast(True)` (pack starts its workers on one while a thread
        # compares both encoders on a sample, `first_fast_difference`, and keeps nothing they
        # wrote if the check fails); `on` uses it at once
        self._fast = None
        self._fast_verified = options.fast == "on"
        self.fast_reason = "disabled (fast: off)"
        if options.fast != "off":
            self._fast, why = tiktoken_equivalent(self._spec, self._tok)
            self.fast_reason = "tiktoken BPE core" if self._fast else why
            if options.fast == "on" and self._fast is None:
                raise TokenizerError(f"{options.path}: fast: on, but {why}")

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickled (pack's workers get the parent's tokenizer pickled): tokenizers' own pickle
        keeps the vocabulary but not the special-token switch, so it is set again."""
        self.__dict__.update(state)
        self._tok.encode_special_tokens = not self.options.parse_special

    def _find_eod(self, given: str | None) -> str:
        if given is not None:
            if self._tok.token_to_id(given) is None:
                raise TokenizerError(f"{self.options.path}: no token {given!r} (eod_token)")
            return given
        for name in EOD_CANDIDATES:
            if self._tok.token_to_id(name) is not None:
                return name
        added = [t["content"] for t in self._spec.get("added_tokens") or []]
        raise TokenizerError(
            f"{self.options.path}: no end-of-document token found (tried {', '.join(EOD_CANDIDATES)}); "
            f"set eod_token to one of its tokens (added tokens: {', '.join(added) or 'none'})"
        )

    @property
    def name(self) -> str:
        return f"hf:{os.path.basename(self.options.path)}"

    @functools.cached_property
    def vocab_size(self) -> int:
        # ids may be sparse (an added token far beyond the vocab): size by the largest id
        return max(self._tok.get_vocab(with_added_tokens=True).values()) + 1

    @property
    def eod_id(self) -> int:
        return self._eod

    @functools.cached_property
    def fingerprint(self) -> str:
        return fingerprint_of("hf", self._spec, self._eod, self.options.parse_special)

    @property
    def fast(self) -> bool:
        """Whether a fast encoder exists for this file (used once verified or `fast: on`)."""
        return self._fast is not None

    def verify_fast(self, texts: Sequence[str]) -> int | None:
        """Compare both encoders on `texts`; enable the fast one if every id matches.

        Returns None when they match, else the index of the first text that differs."""
        differs = self.first_fast_difference(texts)
        self._fast_verified = differs is None
        return differs

    def first_fast_difference(self, texts: Sequence[str]) -> int | None:
        """Compare both encoders on `texts`, changing nothing: None when every id matches, else
        the index of the first text that differs (0 when there is no fast encoder)."""
        if self._fast is None:
            return 0
        fast = self.encode_batch_fast(texts)
        reference = self.encode_batch_hf(texts)
        for i, (a, b) in enumerate(zip(fast, reference, strict=True)):
            if a != b:
                return i
        return None

    def with_fast(self, on: bool) -> HFTokenizer:
        """A copy that uses the fast encoder (trusted: the caller checks it) or the reference.

        The copy shares the Rust tokenizer, so it is made without `__setstate__`: setting its
        special-token switch there needs the tokenizer's lock, which the pack's check thread may
        hold while it encodes ("RuntimeError: Already borrowed")."""
        twin = object.__new__(type(self))
        twin.__dict__.update(self.__dict__)
        twin._fast_verified = on and self._fast is not None
        return twin

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        if self._fast is not None and self._fast_verified:
            return self.encode_batch_fast(texts)
        return self.encode_batch_hf(texts)

    def encode_batch_fast(self, texts: Sequence[str]) -> list[list[int]]:
        return [a.tolist() for a in self._fast_arrays(texts)]

    def _fast_arrays(self, texts: Sequence[str]) -> list[np.ndarray]:
        return self._by_pieces(texts, self._fast_whole, join_arrays)

    def _fast_whole(self, texts: Sequence[str]) -> list[np.ndarray]:
        return tiktoken_arrays(self._fast, texts, self.options.parse_special)

    def encode_batch_arrays(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Like encode_batch, as numpy arrays (a list of ints costs several times the memory)."""
        if self._fast is not None and self._fast_verified:
            return self._fast_arrays(texts)
        return self._by_pieces(texts, self._hf_whole_arrays, join_arrays)

    def encode_batch_hf(self, texts: Sequence[str]) -> list[list[int]]:
        """The reference encoder: the tokenizers library's own."""
        return self._by_pieces(texts, self._hf_whole, join_lists)

    def _hf_whole(self, texts: Sequence[str]) -> list[list[int]]:
        encodings = self._tok.encode_batch_fast(list(texts), add_special_tokens=False)
        return [e.ids for e in encodings]

    def _hf_whole_arrays(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.asarray(ids, np.uint32) for ids in self._hf_whole(texts)]

    def _by_pieces(
        self,
        texts: Sequence[str],
        encode: Callable[[Sequence[str]], list[Ids]],
        join: Callable[[list[Ids]], Ids],
    ) -> list[Ids]:
        """`encode(texts)`, with long texts encoded in pieces when that gives the same ids."""
        if all(len(text) <= pieces.PIECE_CHARS for text in texts) or not self.pieces_safe:
            return encode(texts)
        return encode_in_pieces(texts, encode, join)

    @functools.cached_property
    def pieces_safe(self) -> bool:
        """Whether long texts may be encoded in pieces (`text_pieces`): a byte-level BPE
        pre-tokenizer with a split regex and no normalizer (one that prepends a marker to each
        text would differ), no added token a cut could break, and the probe text's pieces give
        its whole ids. Otherwise a text is encoded whole, however long."""
        return (
            self._spec.get("normalizer") is None
            and split_pattern(self._spec.get("pre_tokenizer")) is not None
            and _added_tokens_allow_cuts(
                self._spec.get("added_tokens") or [], self.options.parse_special
            )
            and pieces_match(self._hf_whole)
        )

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @property
    def special_tokens(self) -> list[str]:
        """The added tokens (each matched whole, with an id of its own)."""
        return [t["content"] for t in self._spec.get("added_tokens") or []]
