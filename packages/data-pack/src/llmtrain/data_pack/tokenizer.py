"""Tokenizers (plugins of kind `tokenizer`): `bytes`, `hf` (tokenizer.json) and `tiktoken`.

Every tokenizer has a `fingerprint`: a hash of everything that decides its ids (vocabulary,
merges, pattern, special tokens, end-of-document id), stored with each packed dataset so a run
with another tokenizer is caught. Options that only change speed (`hf`'s `fast`) are not part of it.

The `hf` tokenizer has a fast path for GPT-2-style byte-level BPE files: the same vocabulary and
merges run through tiktoken's BPE core (several times faster per thread). It is used only when the
file has nothing tiktoken would treat differently (see `tiktoken_equivalent`), and `pack` also
checks that both paths give identical ids on a sample of the corpus before enabling it.

A text longer than `PIECE_CHARS` is encoded a piece at a time where the pre-tokenizer splits anyway
(see `text_pieces`), so an encoder's memory grows with the piece, not with the document.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import itertools
import json
import os
import re
import sys
import unicodedata
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import attrs
import fsspec
import numpy as np

from llmtrain.core_mesh.errors import UserError
from llmtrain.core_mesh.storage_errors import storage_errors

if TYPE_CHECKING:
    from llmtrain.core_mesh.config import Choice
    from llmtrain.core_mesh.plugins import PluginManager

ENDOFTEXT = "<|endoftext|>"
# names tried, in order, when an `hf` tokenizer is given no `eod_token`
EOD_CANDIDATES = (ENDOFTEXT, "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[EOS]")
# the pre-tokenization regex of GPT-2's byte-level BPE (HF `ByteLevel(use_regex=True)`)
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


class TokenizerError(UserError):
    """A tokenizer file or option that cannot be used."""


def _hash(*parts: Any) -> str:
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


# -- long texts ------------------------------------------------------------------------------------
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


_Ids = TypeVar("_Ids")  # one text's ids: a list of ints or an array


def _join_lists(parts: list[list[int]]) -> list[int]:
    return list(itertools.chain.from_iterable(parts))


def _join_arrays(parts: list[np.ndarray]) -> np.ndarray:
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def encode_in_pieces(
    texts: Sequence[str],
    encode: Callable[[Sequence[str]], list[_Ids]],
    join: Callable[[list[_Ids]], _Ids],
) -> list[_Ids]:
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


# -- bytes ---------------------------------------------------------------------------------------


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
        return _hash("bytes", self._specials)

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


# -- hf (tokenizer.json) ---------------------------------------------------------------------------


@attrs.frozen
class HFOptions:
    """A Hugging Face `tokenizer.json` (local path or fsspec URL)."""

    path: str
    eod_token: str | None = None
    fast: Literal["auto", "on", "off"] = "auto"
    # False: a special token's text inside a document ("<|endoftext|>") is encoded as plain text,
    # so only the packer's eod ends documents; True: it becomes the special id (chat templates)
    parse_special: bool = False


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (how byte-level BPE stores tokens)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += range(ord("®"), ord("ÿ") + 1)
    chars = list(keep)
    extra = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(keep, map(chr, chars), strict=True))


def _pattern_of(pre: dict[str, Any] | None) -> str | None:
    """The regex a byte-level pre-tokenizer splits with, or None if tiktoken cannot mirror it."""
    if pre is None:
        return None
    if pre.get("type") == "ByteLevel":
        if pre.get("add_prefix_space") or not pre.get("use_regex", True):
            return None
        return GPT2_PATTERN
    if pre.get("type") == "Sequence":
        steps = pre.get("pretokenizers") or []
        if len(steps) == 1:
            return _pattern_of(steps[0])
        if len(steps) == 2:
            split, byte_level = steps
            if (
                split.get("type") == "Split"
                and "Regex" in (split.get("pattern") or {})
                and split.get("behavior") == "Isolated"
                and not split.get("invert")
                and byte_level.get("type") == "ByteLevel"
                and not byte_level.get("add_prefix_space")
                and not byte_level.get("use_regex", True)
            ):
                regex = split["pattern"]["Regex"]
                return regex if isinstance(regex, str) else None
    return None


def tiktoken_equivalent(spec: dict[str, Any], tokenizer: Any = None) -> tuple[Any | None, str]:
    """A tiktoken Encoding with the same ids as this tokenizer.json, or (None, why not).

    tiktoken merges any adjacent pair whose concatenation is a token; HF merges only listed
    pairs. They agree when token ids follow the merge order and every token is what HF's own BPE
    makes of its bytes (true of tokenizers trained by BPE); `tokenizer` is the loaded HF tokenizer
    (built from `spec` if not given). `pack` still compares both on a sample of the corpus."""
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        return None, f"model type {model.get('type')!r} is not BPE"
    for key in ("dropout", "continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(key):
            return None, f"BPE option {key} is set"
    if model.get("byte_fallback"):
        return None, "byte_fallback is set"
    if spec.get("normalizer") is not None:
        return None, "it has a normalizer"
    pattern = _pattern_of(spec.get("pre_tokenizer"))
    if pattern is None:
        return None, "the pre-tokenizer is not byte-level BPE with a split regex"
    byte_of = {c: b for b, c in _bytes_to_unicode().items()}
    added = {t["content"]: t["id"] for t in spec.get("added_tokens") or []}
    if any(
        t.get("lstrip") or t.get("rstrip") or t.get("single_word") or not t.get("special")
        for t in spec.get("added_tokens") or []
    ):
        return None, "an added token is not special, strips, or matches single words"
    ranks: dict[bytes, int] = {}
    for token, i in model.get("vocab", {}).items():
        if token in added:
            continue
        try:
            ranks[bytes(byte_of[c] for c in token)] = i
        except KeyError:
            return None, f"vocab entry {token!r} is not byte-level"
    if any(bytes([b]) not in ranks for b in range(256)):
        return None, "not every byte has a token"
    last = -1
    for merge in model.get("merges", []):
        a, b = merge.split(" ", 1) if isinstance(merge, str) else merge
        merged = ranks.get(bytes(byte_of[c] for c in a + b))
        if merged is None or merged <= last:
            return None, "merge order and token ids disagree"
        last = merged
    if tokenizer is None:
        import tokenizers

        tokenizer = tokenizers.Tokenizer.from_str(json.dumps(spec))
    bpe = tokenizer.model
    for token, i in model.get("vocab", {}).items():
        if token not in added and [t.id for t in bpe.tokenize(token)] != [i]:
            return None, f"token {token!r} is not reachable by the merges"
    import tiktoken

    encoding = tiktoken.Encoding(
        name="hf-bpe", pat_str=pattern, mergeable_ranks=ranks, special_tokens=added
    )
    return encoding, ""


_GIVE_TOKENIZER_JSON = 'give the tokenizer.json of a Hugging Face tokenizer, or "bytes"'
# keys of a Hugging Face tokenizer_config.json, none of which a tokenizer.json has at its top
_TOKENIZER_CONFIG_KEYS = {
    "tokenizer_class",
    "chat_template",
    "added_tokens_decoder",
    "model_max_length",
    "bos_token",
    "eos_token",
}
_JSON_TYPES = {list: "an array", str: "a string", int: "a number", float: "a number"}


def tokenizer_json(raw: bytes, path: str) -> dict[str, Any]:
    """The parsed tokenizer.json, or a TokenizerError that says what the file is instead: the
    tokenizers library reads any other JSON as a broken tokenizer ("expected `,` or `}` at line
    1 column 9" for `{"a": 1}`)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TokenizerError(
            f"{path}: not a tokenizer.json: binary, not UTF-8 text (byte {exc.start}; a "
            f"SentencePiece .model file?); {_GIVE_TOKENIZER_JSON}"
        ) from None
    if not text.strip():
        raise TokenizerError(f"{path}: an empty file, not a tokenizer.json; {_GIVE_TOKENIZER_JSON}")
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TokenizerError(
            f"{path}:{exc.lineno}:{exc.colno}: not a valid tokenizer.json: malformed JSON "
            f"({exc.msg}); {_GIVE_TOKENIZER_JSON}"
        ) from None
    except RecursionError:
        raise TokenizerError(f"{path}: JSON nested too deeply to be a tokenizer.json") from None
    if isinstance(spec, dict) and isinstance(spec.get("model"), dict) and "vocab" in spec["model"]:
        return spec
    raise TokenizerError(f"{path}: valid JSON but not a tokenizer.json{_what_it_is(spec, path)}")


def _what_it_is(spec: Any, path: str) -> str:
    """What a JSON file that is no tokenizer.json looks like, and what to give instead."""
    if isinstance(spec, dict) and ("model_type" in spec or "architectures" in spec):
        kind = spec.get("model_type") or ", ".join(map(str, spec.get("architectures") or []))
        return f": it looks like a model's config.json ({kind}); {_beside(path)}"
    if isinstance(spec, dict) and _TOKENIZER_CONFIG_KEYS & spec.keys():
        return (
            ": it looks like a tokenizer_config.json, a tokenizer's settings and chat template "
            f"but not its vocabulary (pack-chat takes it as --template); {_beside(path)}"
        )
    if isinstance(spec, dict) and len(spec) >= 256 and all(type(v) is int for v in spec.values()):
        return (
            ": it looks like a vocab.json, a vocabulary without its merges; save the tokenizer "
            "as one tokenizer.json (transformers' save_pretrained writes one) and give that"
        )
    if isinstance(spec, dict):
        keys = ", ".join(json.dumps(k) for k in list(spec)[:5]) or "none"
        held = f"an object with keys {keys}{', ...' if len(spec) > 5 else ''}"
    else:
        held = _JSON_TYPES.get(type(spec), json.dumps(spec))  # true, false or null
    return f' ({held}; no "model" with a "vocab"/"merges"); {_GIVE_TOKENIZER_JSON}'


def _beside(path: str) -> str:
    """Where the tokenizer.json of a Hugging Face model directory holding `path` would be."""
    folder = path.rpartition("/")[0] or "."
    candidate = f"{folder}/tokenizer.json"
    try:
        there = fsspec.core.url_to_fs(candidate)[0].exists(candidate)
    except Exception:  # noqa: BLE001 - only a hint: a storage that cannot tell us is "unknown"
        there = False
    if there:
        return f"give the tokenizer.json beside it: {candidate}"
    return (
        f"give the model's tokenizer.json: there is none beside it in {folder} "
        "(transformers' save_pretrained writes one)"
    )


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
        # `auto` builds the fast encoder but uses it only after `verify_fast` (which `pack` runs
        # on a sample of the corpus); `on` uses it at once
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
        return _hash("hf", self._spec, self._eod, self.options.parse_special)

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
        return self._by_pieces(texts, self._fast_whole, _join_arrays)

    def _fast_whole(self, texts: Sequence[str]) -> list[np.ndarray]:
        return _tiktoken_arrays(self._fast, texts, self.options.parse_special)

    def encode_batch_arrays(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Like encode_batch, as numpy arrays (a list of ints costs several times the memory)."""
        if self._fast is not None and self._fast_verified:
            return self._fast_arrays(texts)
        return self._by_pieces(texts, self._hf_whole_arrays, _join_arrays)

    def encode_batch_hf(self, texts: Sequence[str]) -> list[list[int]]:
        """The reference encoder: the tokenizers library's own."""
        return self._by_pieces(texts, self._hf_whole, _join_lists)

    def _hf_whole(self, texts: Sequence[str]) -> list[list[int]]:
        encodings = self._tok.encode_batch_fast(list(texts), add_special_tokens=False)
        return [e.ids for e in encodings]

    def _hf_whole_arrays(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.asarray(ids, np.uint32) for ids in self._hf_whole(texts)]

    def _by_pieces(
        self,
        texts: Sequence[str],
        encode: Callable[[Sequence[str]], list[_Ids]],
        join: Callable[[list[_Ids]], _Ids],
    ) -> list[_Ids]:
        """`encode(texts)`, with long texts encoded in pieces when that gives the same ids."""
        if all(len(text) <= PIECE_CHARS for text in texts) or not self.pieces_safe:
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
            and _pattern_of(self._spec.get("pre_tokenizer")) is not None
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


def _tiktoken_arrays(encoding: Any, texts: Sequence[str], parse_special: bool) -> list[np.ndarray]:
    """Ids as numpy arrays; special-token text is plain text unless `parse_special`."""
    special = "all" if parse_special else set()
    return [
        encoding.encode_to_numpy(t, allowed_special=special, disallowed_special=()) for t in texts
    ]


# -- tiktoken ----------------------------------------------------------------------------------


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
        self._ranks_hash = _hash(data)
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
        return _hash(
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
        if all(len(text) <= PIECE_CHARS for text in texts) or not self.pieces_safe:
            return self._whole_arrays(texts)
        return encode_in_pieces(texts, self._whole_arrays, _join_arrays)

    def _whole_arrays(self, texts: Sequence[str]) -> list[np.ndarray]:
        return _tiktoken_arrays(self._enc, texts, self.options.parse_special)

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


# -- building from a config ------------------------------------------------------------------------
# The config and plugin machinery is imported when first used, not with this module: pack's
# worker processes import this module to unpickle their tokenizer, and its start is pack's cost.


@functools.cache
def _tokenizer_choice_type() -> type[Choice]:
    from llmtrain.core_mesh.config import Choice

    return Choice.of("tokenizer")


def tokenizer_choice(text: str, plugins: PluginManager, extra: Sequence[str] = ()) -> Choice:
    """A CLI spelling of a tokenizer: `bytes`, `hf:PATH`, `tiktoken:PATH`, or a bare file path
    (`*.json` is hf, `*.tiktoken` is tiktoken); `extra` holds `key=value` options."""
    kind, sep, path = text.partition(":")
    if not (sep and kind in plugins.registry("tokenizer")):
        if text.endswith(".json"):
            kind, path = "hf", text
        elif text.endswith(".tiktoken"):
            kind, path = "tiktoken", text
        elif text.endswith(".model"):
            raise TokenizerError(
                f"{text}: a SentencePiece .model file, which llmtrain does not read; give the "
                "model's tokenizer.json (transformers' AutoTokenizer.from_pretrained(...)"
                ".save_pretrained(DIR) writes one)"
            )
        else:
            kind, path = text, ""
    raw: dict[str, Any] = {"kind": kind}
    if path:
        raw["path"] = path
    for item in extra:
        key, sep, value = item.partition("=")
        if not sep:
            raise UserError(f"tokenizer option {item!r}: expected key=value")
        raw[key] = json.loads(value) if value[:1] in "[{" or value in ("true", "false") else value
    from llmtrain.core_mesh.config import structure

    return structure(raw, _tokenizer_choice_type(), plugins=plugins, source="--tokenizer")


def choice_to_raw(choice: Choice, plugins: PluginManager) -> dict[str, Any]:
    """Plain data for a tokenizer choice (stored in dataset metadata, sent to worker processes)."""
    from llmtrain.core_mesh.config import make_converter, unstructure

    raw: dict[str, Any] = unstructure(choice, converter=make_converter(plugins))  # attrs: a dict
    return raw


def tokenizer_from_raw(raw: dict[str, Any], plugins: PluginManager | None = None) -> Any:
    """The tokenizer a plugin builds (Any: plugins' tokenizers have more than the core
    `Tokenizer` protocol, e.g. `token_id`, `with_fast`)."""
    from llmtrain.core_mesh.config import structure
    from llmtrain.core_mesh.plugins import PluginManager

    if plugins is None:
        plugins = PluginManager().load_entry_points()
    choice = structure(raw, _tokenizer_choice_type(), plugins=plugins)
    return plugins.build("tokenizer", choice)


# -- training --------------------------------------------------------------------------------------


def train_bpe(
    texts: Iterable[str],
    vocab_size: int,
    *,
    special_tokens: Sequence[str] = (ENDOFTEXT,),
    min_frequency: int = 2,
    show_progress: bool = False,
) -> str:
    """Train a GPT-2-style byte-level BPE and return its tokenizer.json text. `show_progress`:
    the tokenizers library's bars for the training phase (words, pairs, merges) on a terminal;
    its bar for reading `texts` stays hidden, the caller shows its own."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 256 + len(special_tokens):
        raise UserError(
            f"vocab size {vocab_size} is too small: byte-level BPE needs at least 256 + "
            f"{len(special_tokens)} special tokens"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    reading = _training_bars_only(texts) if show_progress else contextlib.nullcontext(texts)
    with reading as documents:
        tok.train_from_iterator(documents, trainer=trainer)
    return tok.to_str()


@contextlib.contextmanager
def _training_bars_only(texts: Iterable[str]) -> Iterator[Iterable[str]]:
    """`texts`, for training with the tokenizers library's bars, less two of its habits. Its
    pre-processing bar counts documents against an unknown total, over the caller's bar of bytes
    read: the library draws a bar only if stderr is a terminal when it makes the bar, and it
    makes this one before it asks for the first document, so stderr (fd 2) points at the null
    device from the call until that request. And it ends each bar with a newline on stdout, which
    carries the command's result: stdout (fd 1) points at stderr during the call."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved_out, saved_err = os.dup(1), os.dup(2)

    def reading() -> Iterator[str]:
        os.dup2(saved_err, 2)
        yield from texts

    os.dup2(saved_err, 1)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    os.close(null)
    try:
        yield reading()
    finally:
        os.dup2(saved_err, 2)
        os.dup2(saved_out, 1)
        os.close(saved_out)
        os.close(saved_err)
