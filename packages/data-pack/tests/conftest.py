"""Shared test setup for data-pack: generated JSONL corpora, a small trained tokenizer.json, an
in-process CLI runner and a real S3-compatible server (moto) on 127.0.0.1.

Nothing here imports torch: data-pack must work on machines without it.
"""

from __future__ import annotations

import gzip
import json
import random
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import pytest
from shared_fixtures import moto_endpoint, run_cli, s3_bucket, small_disk  # noqa: F401

# pieces chosen to stress tokenizers and JSON: accents, CJK, RTL scripts, emoji (with ZWJ and flag
# sequences), combining characters, escapes, control characters, and a special token's spelling
WORDS = [
    "hello", "world", "the", "of", "and", "data", "token", "packing",
    "naïve", "café", "über", "straße", "Ångström", "smörgåsbord",
    "日本語", "中文字符", "한국어", "Привет", "мир", "γειά", "σου", "مرحبا", "שלום", "हिन्दी", "ภาษาไทย",  # noqa: RUF001
    "😀", "🚀🚀", "👩‍💻", "🇫🇷", "🏳️‍🌈", "e\u0301", "a\u0308\u0301", "n\u0303o", "Z\u0335\u0321\u0334",
    "x²", "½", "42", "3.14159", "1,000,000", "0x1F", "can't", "it's", "WE'LL", "'s",
    '"quoted"', "back\\slash", "tab\there", "line\nbreak", "cr\r\nlf", "  spaced  ", "\u00a0nbsp",
    "UPPER", "MiXeD", "€100", "™", "zero\u200bwidth", "ﬁ", "Ⅻ", "…", "<|endoftext|>", "{json}",
    "\x01ctl", "ǅ", "İstanbul", "ß", "\U0001d518\U0001d52b\U0001d526",
]  # fmt: skip


def make_text(rng: random.Random, max_words: int = 40) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(1, max_words))]
    seps = [rng.choice([" ", " ", " ", "", "\n", "  ", "\t"]) for _ in words]
    return "".join(w + s for w, s in zip(words, seps, strict=True)).rstrip(" ")


def make_texts(n: int, seed: int = 0, max_words: int = 40) -> list[str]:
    rng = random.Random(seed)
    return [make_text(rng, max_words) for _ in range(n)]


def jsonl_bytes(records: Iterable[object], *, seed: int = 0) -> bytes:
    """JSON lines, some with non-ASCII written raw and some \\u-escaped (both are valid JSON)."""
    rng = random.Random(seed)
    lines = [json.dumps(r, ensure_ascii=rng.random() < 0.3) for r in records]
    return "".join(line + "\n" for line in lines).encode("utf-8")


def compress(data: bytes, suffix: str) -> bytes:
    if suffix.endswith(".gz"):
        return gzip.compress(data)
    if suffix.endswith(".zst"):
        import zstandard

        return zstandard.ZstdCompressor().compress(data)
    return data


@pytest.fixture(autouse=True)
def no_torch_imported():
    """data-pack must never import torch; catch any test that makes it do so."""
    had_torch = "torch" in sys.modules
    yield
    if not had_torch:
        assert "torch" not in sys.modules, "this test imported torch; data-pack must not"


@pytest.fixture(scope="session")
def corpus() -> Callable[..., list[str]]:
    """corpus(n, seed=0, max_words=40) -> n generated documents (deterministic for a seed)."""
    return make_texts


@pytest.fixture(scope="session")
def split_regex_bpe() -> Callable[..., str]:
    """split_regex_bpe(texts, vocab_size, pattern) -> tokenizer.json text of a BPE trained on
    `texts` whose pre-tokenizer is Sequence[Split(pattern), ByteLevel] (cl100k's form)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    from llmtrain.data_pack.tokenizer import ENDOFTEXT

    def train(texts: list[str], vocab_size: int, pattern: str) -> str:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[ENDOFTEXT],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(texts, trainer=trainer)
        return tok.to_str()

    return train


@pytest.fixture(scope="session")
def texts() -> list[str]:
    """300 varied unicode documents (the default corpus of most tests)."""
    return make_texts(300, seed=0)


@pytest.fixture
def write_jsonl(tmp_path: Path) -> Callable[..., Path]:
    """write_jsonl(name, texts_or_records, field="text") -> path; .gz / .zst names are compressed.

    Strings become {field: text} records (a dotted field nests them); anything else is written
    as given, so tests can mix in bad records.
    """

    def write(name: str, items: Sequence[object], field: str = "text", seed: int = 0) -> Path:
        records = []
        for item in items:
            if isinstance(item, str):
                record: object = item
                for key in reversed(field.split(".")):
                    record = {key: record}
                records.append(record)
            else:
                records.append(item)
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(compress(jsonl_bytes(records, seed=seed), name))
        return path

    return write


@pytest.fixture(scope="session")
def tokenizer_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE (vocab 400, eod <|endoftext|> = id 0) trained by train_bpe on the corpus."""
    from llmtrain.data_pack.tokenizer import train_bpe

    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    path.write_text(train_bpe(make_texts(2000, seed=1), 400), encoding="utf-8")
    return path


@pytest.fixture
def crafted_tokenizer(tmp_path: Path) -> Path:
    """A valid byte-level BPE tokenizer.json (vocab 260, eod id 0) whose merges are ordered like
    its ids, but where "abc" is made only from "ab" + "c": HF never merges "a" + "bc" (it encodes
    "abc" as [98, 257]); tiktoken's rank-based BPE core does (giving [259])."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from llmtrain.data_pack.tokenizer import ENDOFTEXT
    from llmtrain.data_pack.tokenizer.fast_bpe import bytes_to_unicode

    char = bytes_to_unicode()
    vocab = {ENDOFTEXT: 0, **{char[b]: b + 1 for b in range(256)}, "bc": 257, "ab": 258, "abc": 259}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("b", "c"), ("a", "b"), ("ab", "c")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([ENDOFTEXT])
    path = tmp_path / "crafted.json"
    path.write_text(tok.to_str(), encoding="utf-8")
    return path


@pytest.fixture
def moto_s3(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterable[str]:
    """A fresh bucket on the moto server; yields its URL (s3://bucket)."""
    endpoint = request.getfixturevalue("moto_endpoint")  # the session server (shared_fixtures)
    for bucket in s3_bucket(endpoint, monkeypatch, "test"):
        yield f"s3://{bucket}"
