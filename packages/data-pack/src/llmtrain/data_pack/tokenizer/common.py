"""What every tokenizer backend shares: the end-of-document names, the error type, the
fingerprint hash and reading a tokenizer file from a path or fsspec URL."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import fsspec

from llmtrain.core_mesh.errors import UserError
from llmtrain.core_mesh.storage_errors import storage_errors

ENDOFTEXT = "<|endoftext|>"
# names tried, in order, when an `hf` tokenizer is given no `eod_token`
EOD_CANDIDATES = (ENDOFTEXT, "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[EOS]")
# the pre-tokenization regex of GPT-2's byte-level BPE (HF `ByteLevel(use_regex=True)`)
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


class TokenizerError(UserError):
    """A tokenizer file or option that cannot be used."""


def fingerprint_of(*parts: Any) -> str:
    digest = hashlib.sha256()
    for part in parts:
        data = part if isinstance(part, bytes) else json.dumps(part, sort_keys=True).encode()
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.hexdigest()[:32]


def read_bytes(url: str) -> bytes:
    """A whole file from a local path or fsspec URL, with a clear error if it is not there."""
    try:
        with storage_errors(url, error=TokenizerError), fsspec.open(url, "rb") as f:
            data: bytes = f.read()
            return data
    except FileNotFoundError:
        raise TokenizerError(f"{url}: no such tokenizer file") from None
    except IsADirectoryError:
        raise TokenizerError(
            f"{url}: a directory, not a tokenizer file; give the file in it (for a Hugging Face "
            f"tokenizer: {url.rstrip('/')}/tokenizer.json)"
        ) from None
    except OSError as exc:
        raise TokenizerError(f"{url}: cannot read the tokenizer file: {exc}") from None
