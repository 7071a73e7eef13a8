"""The `bytes` tokenizer: UTF-8 bytes as ids 0-255, then the special tokens."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence

import attrs
import numpy as np

from llmtrain.data_pack.tokenizer.common import ENDOFTEXT, fingerprint_of


@attrs.frozen
class BytesOptions:
    """UTF-8 bytes as ids 0-255, then the special tokens (the first ends documents)."""

    special_tokens: list[str] = attrs.field(factory=lambda: [ENDOFTEXT, "<|pad|>"])

    def __attrs_post_init__(self) -> None:
        from llmtrain.core_mesh.config import ConfigValueError

        if not self.special_tokens:
            raise ConfigValueError("special_tokens", "needs at least the end-of-document token")
        if len(set(self.special_tokens)) != len(self.special_tokens):
            raise ConfigValueError("special_tokens", "has duplicates")


class BytesTokenizer:
    """A byte-level tokenizer with no training: for tests, smoke runs and byte-level models."""

    def __init__(self, options: BytesOptions | None = None):
        self.options = options or BytesOptions()
        self._specials = list(self.options.special_tokens)

    @property
    def name(self) -> str:
        return "bytes"

    @property
    def vocab_size(self) -> int:
        return 256 + len(self._specials)

    @property
    def eod_id(self) -> int:
        return 256

    @functools.cached_property
    def fingerprint(self) -> str:
        return fingerprint_of("bytes", self._specials)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(text.encode("utf-8")) for text in texts]

    def encode_batch_arrays(self, texts: Sequence[str]) -> list[np.ndarray]:
        """The ids as uint8 arrays over each text's UTF-8 bytes: one byte a token, where a list
        of ints costs eight bytes a token and more."""
        return [np.frombuffer(text.encode("utf-8"), np.uint8) for text in texts]

    def decode(self, ids: Iterable[int]) -> str:
        out: list[str] = []
        pending = bytearray()
        for i in ids:
            i = int(i)
            if i < 256:
                pending.append(i)
                continue
            out.append(pending.decode("utf-8", errors="replace"))
            pending.clear()
            out.append(self._specials[i - 256] if i - 256 < len(self._specials) else f"<{i}>")
        out.append(pending.decode("utf-8", errors="replace"))
        return "".join(out)

    def token_id(self, token: str) -> int | None:
        return 256 + self._specials.index(token) if token in self._specials else None

    @property
    def special_tokens(self) -> list[str]:
        """Tokens with an id of their own, never split (chat templates use them)."""
        return list(self._specials)
