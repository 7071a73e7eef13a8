"""Tokenizers (plugins of kind `tokenizer`): `bytes`, `hf` (tokenizer.json) and `tiktoken`, one
module each, beside what they share (`common`: the error type, fingerprint hash, reading files;
`pieces`: long texts in pieces), the `hf` backend's fast path (`fast_bpe`) and file check
(`tokenizer_json`), building one from a config (`choice`) and BPE training (`bpe_training`).

Every tokenizer has a `fingerprint`: a hash of everything that decides its ids (vocabulary,
merges, pattern, special tokens, end-of-document id), stored with each packed dataset so a run
with another tokenizer is caught. Options that only change speed (`hf`'s `fast`) are not part of it.

The `hf` tokenizer has a fast path for GPT-2-style byte-level BPE files: the same vocabulary and
merges run through tiktoken's BPE core (several times faster per thread). It is used only when the
file has nothing tiktoken would treat differently (see `tiktoken_equivalent`), and `pack` also
checks that both paths give identical ids on a sample of the corpus before it keeps what they wrote.

A text longer than `PIECE_CHARS` is encoded a piece at a time where the pre-tokenizer splits anyway
(see `text_pieces`), so an encoder's memory grows with the piece, not with the document.

This package's names are importable from `llmtrain.data_pack.tokenizer` itself (the plugins,
train-loop and downstream import them from here); importing it imports every backend, which is
what pack's worker processes want before their tokenizer arrives pickled.
"""

from llmtrain.data_pack.tokenizer.bpe_training import train_bpe
from llmtrain.data_pack.tokenizer.bytes_tokenizer import BytesOptions, BytesTokenizer
from llmtrain.data_pack.tokenizer.choice import choice_to_raw, tokenizer_choice, tokenizer_from_raw
from llmtrain.data_pack.tokenizer.common import (
    ENDOFTEXT,
    EOD_CANDIDATES,
    GPT2_PATTERN,
    TokenizerError,
    read_bytes,
)
from llmtrain.data_pack.tokenizer.fast_bpe import tiktoken_equivalent
from llmtrain.data_pack.tokenizer.hf_tokenizer import HFOptions, HFTokenizer
from llmtrain.data_pack.tokenizer.pieces import (
    PIECE_CHARS,
    cut_places,
    encode_in_pieces,
    pieces_match,
    text_pieces,
)
from llmtrain.data_pack.tokenizer.tiktoken_tokenizer import (
    TiktokenOptions,
    TiktokenTokenizer,
    parse_tiktoken_ranks,
)
from llmtrain.data_pack.tokenizer.tokenizer_json import tokenizer_json

__all__ = [
    "ENDOFTEXT",
    "EOD_CANDIDATES",
    "GPT2_PATTERN",
    "PIECE_CHARS",
    "BytesOptions",
    "BytesTokenizer",
    "HFOptions",
    "HFTokenizer",
    "TiktokenOptions",
    "TiktokenTokenizer",
    "TokenizerError",
    "choice_to_raw",
    "cut_places",
    "encode_in_pieces",
    "parse_tiktoken_ranks",
    "pieces_match",
    "read_bytes",
    "text_pieces",
    "tiktoken_equivalent",
    "tokenizer_choice",
    "tokenizer_from_raw",
    "tokenizer_json",
    "train_bpe",
]
