"""Tokenizers: bytes, hf (with its tiktoken fast path) and tiktoken; CLI spellings; BPE training."""

from __future__ import annotations

import base64
import json
import random
from pathlib import Path

import pytest

from llmtrain.core_mesh.config import ConfigError
from llmtrain.core_mesh.errors import UserError
from llmtrain.core_mesh.plugins import PluginManager
from llmtrain.data_pack.tokenizer import (
    ENDOFTEXT,
    GPT2_PATTERN,
    BytesOptions,
    BytesTokenizer,
    HFOptions,
    HFTokenizer,
    TiktokenOptions,
    TiktokenTokenizer,
    TokenizerError,
    choice_to_raw,
    tiktoken_equivalent,
    tokenizer_choice,
    tokenizer_from_raw,
    train_bpe,
)
from llmtrain.data_pack.tokenizer.fast_bpe import bytes_to_unicode

# a cl100k-style split regex, different from GPT-2's (digits in threes, case-insensitive contractions)
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TRICKY = [
    "",
    "plain ascii",
    "naïve café über straße",
    "日本語のテキスト、中文字符。한국어",
    "emoji 😀🚀 👩‍💻 🇫🇷 🏳️‍🌈",
    "combining e\u0301 a\u0308\u0301 Z\u0335\u0321\u0334 and \u200b zero width",
    "spaces   \t\n\r\n  and trailing   ",
    "math \U0001d518\U0001d52b ½ x² Ⅻ ﬁ",
    "RTL مرحبا שלום",
]


@pytest.fixture(scope="module")
def plugins() -> PluginManager:
    return PluginManager().load_entry_points()


def _spec(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def _write_spec(path: Path, spec: dict) -> Path:
    path.write_text(json.dumps(spec), encoding="utf-8")
    return path


def _ranks_file(path: Path, ranks: dict[bytes, int]) -> Path:
    lines = [f"{base64.b64encode(token).decode()} {rank}" for token, rank in ranks.items()]
    path.write_text("\n".join(lines) + "\n", encoding="ascii")
    return path


def _ranks_of(spec: dict) -> dict[bytes, int]:
    """The byte-level BPE vocabulary of a tokenizer.json as tiktoken ranks (added tokens left out)."""
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    added = {t["content"] for t in spec["added_tokens"]}
    return {
        bytes(byte_of[c] for c in token): i
        for token, i in spec["model"]["vocab"].items()
        if token not in added
    }


# -- bytes ------------------------------------------------------------------------------------------


def test_bytes_tokenizer_ids_vocab_and_eod():
    tok = BytesTokenizer()
    assert tok.name == "bytes"
    assert tok.vocab_size == 258
    assert tok.eod_id == 256
    assert tok.token_id(ENDOFTEXT) == 256
    assert tok.token_id("<|pad|>") == 257
    assert tok.token_id("<|nope|>") is None
    assert tok.encode_batch(["hé", "", "😀"]) == [[104, 195, 169], [], [240, 159, 152, 128]]
    assert tok.decode([104, 256, 105, 257]) == "h<|endoftext|>i<|pad|>"
    # a multi-byte character cut by a special token decodes with a replacement character
    assert tok.decode([195, 256]) == "\ufffd<|endoftext|>"

    custom = BytesTokenizer(BytesOptions(special_tokens=["</s>", "<a>", "<b>"]))
    assert (custom.vocab_size, custom.eod_id, custom.token_id("<b>")) == (259, 256, 258)


def test_bytes_round_trip(texts):
    tok = BytesTokenizer()
    for text in [*TRICKY, *texts]:
        [ids] = tok.encode_batch([text])
        assert ids == list(text.encode("utf-8"))
        assert tok.decode(ids) == text


@pytest.mark.parametrize(
    ("special_tokens", "message"),
    [([], "needs at least the end-of-document token"), (["<a>", "<a>"], "has duplicates")],
)
def test_bytes_options_are_validated(plugins, special_tokens, message):
    with pytest.raises(ConfigError, match=message) as info:
        tokenizer_choice("bytes", plugins, [f"special_tokens={json.dumps(special_tokens)}"])
    assert "special_tokens" in str(info.value)


def test_bytes_fingerprint():
    a, b = BytesTokenizer(), BytesTokenizer()
    assert a.fingerprint == b.fingerprint
    assert len(a.fingerprint) == 32
    other = {
        BytesTokenizer(BytesOptions([ENDOFTEXT])).fingerprint,
        BytesTokenizer(BytesOptions(["<|pad|>", ENDOFTEXT])).fingerprint,  # another eod
        BytesTokenizer(BytesOptions([ENDOFTEXT, "<|pad|>", "<x>"])).fingerprint,
    }
    assert len(other) == 3
    assert a.fingerprint not in other


# -- hf -------------------------------------------------------------------------------------------


def test_hf_tokenizer_basics(tokenizer_json):
    tok = HFTokenizer(HFOptions(str(tokenizer_json)))
    assert tok.name == "hf:tokenizer.json"
    assert tok.vocab_size == 400
    assert tok.eod_id == 0
    assert tok.token_id(ENDOFTEXT) == 0
    assert tok.fast
    assert tok.fast_reason == "tiktoken BPE core"
    reference = HFTokenizer(HFOptions(str(tokenizer_json), fast="off"))
    assert not reference.fast
    assert reference.fast_reason == "disabled (fast: off)"
    assert HFTokenizer(HFOptions(str(tokenizer_json), fast="on")).fast


@pytest.mark.parametrize("fast", ["auto", "off"])
def test_hf_round_trip(tokenizer_json, texts, fast):
    tok = HFTokenizer(HFOptions(str(tokenizer_json), fast=fast))
    docs = [*TRICKY, *texts]
    for text, ids in zip(docs, tok.encode_batch(docs), strict=True):
        assert all(0 <= i < 400 for i in ids)
        assert tok.decode(ids) == text
    # the eod token's text inside a document is plain text: only the packer's eod ends documents
    assert tok.encode_batch([f"a{ENDOFTEXT}b"])[0].count(0) == 0
    assert tok.decode(tok.encode_batch([f"a{ENDOFTEXT}b"])[0]) == f"a{ENDOFTEXT}b"
    # parse_special (for chat templates) turns it into the special id
    parsing = HFTokenizer(HFOptions(str(tokenizer_json), fast=fast, parse_special=True))
    assert parsing.encode_batch([f"a{ENDOFTEXT}b"])[0].count(0) == 1
    assert parsing.fingerprint != tok.fingerprint


def test_hf_fast_path_gives_reference_ids(tokenizer_json, corpus):
    tok = HFTokenizer(HFOptions(str(tokenizer_json)))
    docs = [*TRICKY, *corpus(3000, seed=7, max_words=80)]
    fast = tok.encode_batch(docs)
    assert fast == tok.encode_batch_hf(docs)
    assert fast == HFTokenizer(HFOptions(str(tokenizer_json), fast="off")).encode_batch(docs)
    assert sum(map(len, fast)) < sum(len(d.encode()) for d in docs)  # merges really happen


def test_fast_copies_are_made_while_another_thread_encodes(tokenizer_json, corpus):
    """The pack checks the fast encoder in a thread while it makes the workers' fast copy; the
    copy shares the Rust tokenizer, and setting its special-token switch then raised "Already
    borrowed" (a CI run failed on it; tokenizers 0.22, which transformers 4 brings, raises it
    here every time, 0.23 tolerates it)."""
    import threading

    tok = HFTokenizer(HFOptions(str(tokenizer_json)))
    docs = corpus(400, seed=3, max_words=200)
    done = threading.Event()

    def encode_until_done() -> None:
        while not done.is_set():
            tok.encode_batch_hf(docs)

    worker = threading.Thread(target=encode_until_done)
    worker.start()
    try:
        twins = [tok.with_fast(True) for _ in range(3000)]
    finally:
        done.set()
        worker.join()
    assert twins[-1].encode_batch(docs[:5]) == tok.encode_batch_hf(docs[:5])


def test_fast_path_on_random_code_points(tokenizer_json):
    """Letters, digits, marks and spaces of many scripts and Unicode versions, incl. unassigned
    code points: the regex engines (oniguruma in HF, fancy-regex in tiktoken) must agree."""
    rng = random.Random(5)
    blocks = [
        (0x0, 0x24F), (0x300, 0x36F), (0x370, 0x4FF), (0x590, 0x6FF), (0x900, 0x97F),
        (0x1680, 0x1680), (0x2000, 0x206F), (0x3000, 0x30FF), (0x4E00, 0x4E80), (0xAC00, 0xAC80),
        (0xFE00, 0xFE0F), (0xFFF0, 0xFFFD), (0x10000, 0x1007F), (0x1D400, 0x1D7FF),
        (0x1F300, 0x1F6FF), (0x1FA70, 0x1FAFF), (0x2EBF0, 0x2EE5D), (0x31350, 0x323AF),
        (0xE0000, 0xE007F),
    ]  # fmt: skip
    spaces = [" ", "  ", "\n", "\t", "\u00a0", "\u3000", "'s", "'S", "1234", "\r\n"]
    docs = []
    for _ in range(5000):
        chars = []
        for _ in range(rng.randint(1, 30)):
            low, high = rng.choice(blocks)
            chars.append(chr(rng.randint(low, high)))
            if rng.random() < 0.25:
                chars.append(rng.choice(spaces))
        docs.append("".join(chars))
    tok = HFTokenizer(HFOptions(str(tokenizer_json)))
    assert tok.fast
    ids = tok.encode_batch(docs)
    assert ids == tok.encode_batch_hf(docs)
    assert [tok.decode(i) for i in ids[:500]] == docs[:500]


def test_fast_path_with_split_regex_pretokenizer(tmp_path, corpus, split_regex_bpe):
    path = tmp_path / "split.json"
    path.write_text(split_regex_bpe(corpus(2000, seed=3), 450, SPLIT_PATTERN), encoding="utf-8")
    assert _spec(path)["pre_tokenizer"]["type"] == "Sequence"
    tok = HFTokenizer(HFOptions(str(path), fast="on"))
    assert tok.fast
    docs = [*TRICKY, *corpus(3000, seed=8, max_words=80), "12345678 can'T I'M 1,234,567"]
    ids = tok.encode_batch(docs)
    assert ids == tok.encode_batch_hf(docs)
    assert [tok.decode(i) for i in ids] == docs
    encoding, why = tiktoken_equivalent(_spec(path))
    assert why == ""
    assert encoding._pat_str == SPLIT_PATTERN


def test_fast_path_only_when_ids_really_match(crafted_tokenizer):
    path = crafted_tokenizer
    reference = HFTokenizer(HFOptions(str(path), fast="off"))
    assert reference.encode_batch(["abc"]) == [[98, 257]]  # "a", "bc": no merge "a bc"
    encoding, _ = tiktoken_equivalent(_spec(path))
    if encoding is not None:
        # an encoding offered as equivalent must give the reference ids
        assert encoding.encode("abc") == [98, 257], "tiktoken_equivalent accepted a BPE it changes"
    tok = HFTokenizer(HFOptions(str(path)))
    assert tok.encode_batch(["abc", "xabcx abc"]) == reference.encode_batch(["abc", "xabcx abc"])


def _set(spec: dict, dotted: str, value: object) -> dict:
    *parents, last = dotted.split(".")
    node = spec
    for key in parents:
        node = node[key]
    node[last] = value
    return spec


def _word_level(spec: dict) -> dict:
    spec["model"] = {
        "type": "WordLevel",
        "vocab": {ENDOFTEXT: 0, "a": 1, "[UNK]": 2},
        "unk_token": "[UNK]",
    }
    return spec


REFUSED = {
    "normalizer": (
        lambda s: _set(s, "normalizer", {"type": "NFC"}),
        "it has a normalizer",
    ),
    "add_prefix_space": (
        lambda s: _set(s, "pre_tokenizer.add_prefix_space", True),
        "the pre-tokenizer is not byte-level BPE with a split regex",
    ),
    "no_regex": (
        lambda s: _set(s, "pre_tokenizer.use_regex", False),
        "the pre-tokenizer is not byte-level BPE with a split regex",
    ),
    "no_pre_tokenizer": (
        lambda s: _set(s, "pre_tokenizer", None),
        "the pre-tokenizer is not byte-level BPE with a split regex",
    ),
    "word_level": (_word_level, "model type 'WordLevel' is not BPE"),
    "dropout": (lambda s: _set(s, "model.dropout", 0.1), "BPE option dropout is set"),
    "byte_fallback": (lambda s: _set(s, "model.byte_fallback", True), "byte_fallback is set"),
    "lstrip": (
        lambda s: _set(s, "added_tokens", [{**s["added_tokens"][0], "lstrip": True}]),
        "an added token is not special, strips, or matches single words",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_fast_path_refused(tmp_path, tokenizer_json, case):
    change, reason = REFUSED[case]
    spec = change(_spec(tokenizer_json))
    encoding, why = tiktoken_equivalent(spec)
    assert encoding is None
    assert why == reason
    path = _write_spec(tmp_path / f"{case}.json", spec)

    auto = HFTokenizer(HFOptions(str(path)))
    assert not auto.fast
    assert auto.fast_reason == reason
    if case != "dropout":  # dropout makes BPE random; the other cases encode deterministically
        assert auto.encode_batch(["some text"]) == auto.encode_batch_hf(["some text"])
    with pytest.raises(TokenizerError, match="fast: on, but") as info:
        HFTokenizer(HFOptions(str(path), fast="on"))
    assert str(path) in str(info.value)
    assert reason in str(info.value)


def test_fast_path_refused_for_split_with_other_behavior(tmp_path, corpus, split_regex_bpe):
    spec = json.loads(split_regex_bpe(corpus(300, seed=3), 300, SPLIT_PATTERN))
    spec["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Removed"
    encoding, why = tiktoken_equivalent(spec)
    assert encoding is None
    assert why == "the pre-tokenizer is not byte-level BPE with a split regex"


def test_fast_path_refused_when_merges_disagree_with_ids(tokenizer_json):
    spec = _spec(tokenizer_json)
    spec["model"]["merges"] = list(reversed(spec["model"]["merges"]))
    assert tiktoken_equivalent(spec) == (None, "merge order and token ids disagree")


def test_hf_fingerprint(tmp_path, tokenizer_json, corpus):
    path = str(tokenizer_json)
    fingerprint = HFTokenizer(HFOptions(path)).fingerprint
    assert HFTokenizer(HFOptions(path)).fingerprint == fingerprint
    # speed options are not part of it
    assert HFTokenizer(HFOptions(path, fast="off")).fingerprint == fingerprint
    # a copy elsewhere is the same tokenizer
    copy = tmp_path / "copy.json"
    copy.write_bytes(tokenizer_json.read_bytes())
    assert HFTokenizer(HFOptions(str(copy))).fingerprint == fingerprint

    other_vocab = tmp_path / "vocab350.json"
    other_vocab.write_text(train_bpe(corpus(2000, seed=1), 350), encoding="utf-8")
    two_specials = tmp_path / "specials.json"
    two_specials.write_text(
        train_bpe(corpus(2000, seed=1), 400, special_tokens=[ENDOFTEXT, "<|pad|>"]),
        encoding="utf-8",
    )
    spec = _spec(tokenizer_json)
    spec["pre_tokenizer"] = {
        "type": "Sequence",
        "pretokenizers": [
            {
                "type": "Split",
                "pattern": {"Regex": SPLIT_PATTERN},
                "behavior": "Isolated",
                "invert": False,
            },
            {
                "type": "ByteLevel",
                "add_prefix_space": False,
                "trim_offsets": True,
                "use_regex": False,
            },
        ],
    }
    other_pattern = _write_spec(tmp_path / "pattern.json", spec)
    others = [
        HFTokenizer(HFOptions(str(other_vocab))),
        HFTokenizer(HFOptions(str(two_specials))),
        HFTokenizer(HFOptions(str(two_specials), eod_token="<|pad|>")),
        HFTokenizer(HFOptions(str(other_pattern))),
    ]
    assert others[2].eod_id == 1
    fingerprints = {t.fingerprint for t in others}
    assert len(fingerprints) == 4
    assert fingerprint not in fingerprints


def test_hf_vocab_size_covers_every_id(tmp_path, tokenizer_json):
    """Ids need not be contiguous: a tokenizer.json whose end-of-text token sits at id 70000 has
    ids up to 70000, so its vocab (what the token dtype must hold) is at least 70001."""
    spec = _spec(tokenizer_json)
    spec["added_tokens"][0]["id"] = 70000
    spec["model"]["vocab"][ENDOFTEXT] = 70000
    tok = HFTokenizer(HFOptions(str(_write_spec(tmp_path / "sparse.json", spec))))
    assert tok.eod_id == 70000
    assert tok.token_id(ENDOFTEXT) == 70000
    assert tok.vocab_size > 70000


def test_hf_eod_token(tmp_path, corpus):
    path = tmp_path / "s.json"
    path.write_text(train_bpe(corpus(300), 300, special_tokens=["<pad>", "</s>"]), encoding="utf-8")
    tok = HFTokenizer(HFOptions(str(path)))
    assert tok.eod_id == 1  # "</s>" is a known end-of-document name; "<pad>" is not
    assert HFTokenizer(HFOptions(str(path), eod_token="<pad>")).eod_id == 0
    with pytest.raises(TokenizerError, match=r"no token '<\|eot\|>' \(eod_token\)"):
        HFTokenizer(HFOptions(str(path), eod_token="<|eot|>"))

    none = tmp_path / "none.json"
    none.write_text(train_bpe(corpus(300), 300, special_tokens=["<pad>", "<mask>"]), "utf-8")
    with pytest.raises(TokenizerError, match="no end-of-document token found") as info:
        HFTokenizer(HFOptions(str(none)))
    assert "added tokens: <pad>, <mask>" in str(info.value)
    assert "set eod_token" in str(info.value)


def test_hf_bad_files(tmp_path):
    with pytest.raises(TokenizerError, match="no such tokenizer file"):
        HFTokenizer(HFOptions(str(tmp_path / "missing.json")))
    broken = tmp_path / "broken.json"
    broken.write_text('{"model": ', encoding="utf-8")
    with pytest.raises(TokenizerError, match=r"not a valid tokenizer\.json"):
        HFTokenizer(HFOptions(str(broken)))


# -- tiktoken -------------------------------------------------------------------------------------


def test_tiktoken_ranks_from_trained_bpe(tmp_path, tokenizer_json, texts):
    spec = _spec(tokenizer_json)
    ranks = _ranks_of(spec)
    path = _ranks_file(tmp_path / "bpe.tiktoken", ranks)
    assert len(ranks) == 399

    # the trained tokenizer's own special token id: the same ids as the hf tokenizer
    tok = TiktokenTokenizer(TiktokenOptions(str(path), special_tokens={ENDOFTEXT: 0}))
    hf = HFTokenizer(HFOptions(str(tokenizer_json), fast="off"))
    docs = [*TRICKY, *texts]
    ids = tok.encode_batch(docs)
    assert ids == hf.encode_batch(docs)
    assert [tok.decode(i) for i in ids] == docs
    assert (tok.vocab_size, tok.eod_id, tok.name) == (400, 0, "tiktoken:bpe.tiktoken")
    assert tok.token_id(ENDOFTEXT) == 0
    assert tok.token_id("the") == hf.token_id("the")
    assert tok.token_id("no such token at all") is None

    # by default the eod token comes right after the ranks
    default = TiktokenTokenizer(TiktokenOptions(str(path)))
    assert (default.vocab_size, default.eod_id) == (401, 400)
    assert default.token_id(ENDOFTEXT) == 400
    assert 400 not in default.encode_batch([f"x{ENDOFTEXT}"])[0]  # text, not the special
    parsing = TiktokenTokenizer(TiktokenOptions(str(path), parse_special=True))
    assert parsing.encode_batch([f"x{ENDOFTEXT}"])[0][-1] == 400
    assert default.decode(default.encode_batch(["héllo wörld 😀"])[0]) == "héllo wörld 😀"


def test_tiktoken_fingerprint(tmp_path, tokenizer_json):
    ranks = _ranks_of(_spec(tokenizer_json))
    path = str(_ranks_file(tmp_path / "a.tiktoken", ranks))
    fingerprint = TiktokenTokenizer(TiktokenOptions(path)).fingerprint
    assert TiktokenTokenizer(TiktokenOptions(path)).fingerprint == fingerprint
    fewer = dict(list(ranks.items())[:-1])
    others = [
        TiktokenTokenizer(TiktokenOptions(str(_ranks_file(tmp_path / "b.tiktoken", fewer)))),
        TiktokenTokenizer(TiktokenOptions(path, pattern=SPLIT_PATTERN)),
        TiktokenTokenizer(TiktokenOptions(path, special_tokens={ENDOFTEXT: 0})),
        TiktokenTokenizer(
            TiktokenOptions(path, special_tokens={ENDOFTEXT: 400, "<|x|>": 401}, eod_token="<|x|>")
        ),
    ]
    fingerprints = {t.fingerprint for t in others}
    assert len(fingerprints) == 4
    assert fingerprint not in fingerprints


@pytest.fixture
def digit_ranks(tmp_path) -> Path:
    ranks = {bytes([b]): b for b in range(256)}
    ranks.update({b"12": 256, b"123": 257, b"1234": 258, b"12345": 259, b"45": 260})
    return _ranks_file(tmp_path / "digits.tiktoken", ranks)


def test_tiktoken_published_encoding_pattern_offline(monkeypatch, digit_ranks):
    import tiktoken.load

    def no_download(*args, **kwargs):
        raise AssertionError("tried to download")

    monkeypatch.setattr(tiktoken.load, "read_file", no_download)
    monkeypatch.setattr(tiktoken.load, "read_file_cached", no_download)

    gpt2_style = TiktokenTokenizer(TiktokenOptions(str(digit_ranks)))
    assert gpt2_style.encode_batch(["12345"]) == [[259]]
    cl100k = TiktokenTokenizer(TiktokenOptions(str(digit_ranks), encoding="cl100k_base"))
    assert cl100k.encode_batch(["12345"]) == [[257, 260]]  # cl100k splits digits in threes
    assert cl100k.eod_id == 100257
    assert cl100k.vocab_size == 100277
    assert cl100k.token_id("<|endofprompt|>") == 100276
    assert cl100k.decode([257, 260, 100257]) == "12345<|endoftext|>"
    assert cl100k.fingerprint != gpt2_style.fingerprint
    # an explicit pattern wins over the published one
    explicit = TiktokenTokenizer(
        TiktokenOptions(str(digit_ranks), encoding="cl100k_base", pattern=GPT2_PATTERN)
    )
    assert explicit.encode_batch(["12345"]) == [[259]]


@pytest.mark.parametrize("name", ["gpt2", "cl101k_base"])
def test_tiktoken_unknown_encoding(digit_ranks, name):
    with pytest.raises(TokenizerError, match=f"unknown tiktoken encoding '{name}'") as info:
        TiktokenTokenizer(TiktokenOptions(str(digit_ranks), encoding=name))
    assert "cl100k_base" in str(info.value)
    assert "o200k_base" in str(info.value)


def test_tiktoken_eod_must_be_special(digit_ranks):
    with pytest.raises(TokenizerError, match=r"eod_token '</s>' is not a special token"):
        TiktokenTokenizer(TiktokenOptions(str(digit_ranks), eod_token="</s>"))


@pytest.mark.parametrize(
    "bad_line", ["YWJj", "YWJj 7 8", "YWJj seven", "!!notbase64!! 7", "YWJ 7"], ids=str
)
def test_tiktoken_bad_ranks_file_names_file_and_line(tmp_path, bad_line):
    path = tmp_path / "bad.tiktoken"
    good = [f"{base64.b64encode(bytes([b])).decode()} {b}" for b in range(3)]
    path.write_text("\n".join([*good, "", bad_line, "Zg== 5"]) + "\n", encoding="ascii")
    with pytest.raises(TokenizerError) as info:
        TiktokenTokenizer(TiktokenOptions(str(path)))
    assert str(info.value).startswith(f"{path}:5: expected 'base64-token rank'")


def test_tiktoken_empty_or_missing_ranks_file(tmp_path):
    empty = tmp_path / "empty.tiktoken"
    empty.write_text("\n\n", encoding="ascii")
    with pytest.raises(TokenizerError, match="no ranks in the file"):
        TiktokenTokenizer(TiktokenOptions(str(empty)))
    with pytest.raises(TokenizerError, match="no such tokenizer file"):
        TiktokenTokenizer(TiktokenOptions(str(tmp_path / "missing.tiktoken")))


# -- choosing a tokenizer -------------------------------------------------------------------------


def test_tokenizer_choice_spellings(plugins, tokenizer_json, digit_ranks):
    def raw(text, *extra):
        return choice_to_raw(tokenizer_choice(text, plugins, extra), plugins)

    assert raw("bytes") == {"kind": "bytes", "special_tokens": [ENDOFTEXT, "<|pad|>"]}
    hf = {
        "kind": "hf",
        "path": str(tokenizer_json),
        "eod_token": None,
        "fast": "auto",
        "parse_special": False,
    }
    assert raw(f"hf:{tokenizer_json}") == hf
    assert raw(str(tokenizer_json)) == hf
    assert raw(str(tokenizer_json), "fast=off", "eod_token=</s>") == {
        **hf,
        "fast": "off",
        "eod_token": "</s>",
    }
    tiktoken_raw = {
        "kind": "tiktoken",
        "path": str(digit_ranks),
        "encoding": None,
        "pattern": None,
        "special_tokens": None,
        "eod_token": ENDOFTEXT,
        "parse_special": False,
    }
    assert raw(str(digit_ranks)) == tiktoken_raw
    assert raw(f"tiktoken:{digit_ranks}") == tiktoken_raw
    assert raw(str(digit_ranks), 'special_tokens={"<|e|>": 300}', "eod_token=<|e|>") == {
        **tiktoken_raw,
        "special_tokens": {"<|e|>": 300},
        "eod_token": "<|e|>",
    }
    assert raw("bytes", 'special_tokens=["</s>"]')["special_tokens"] == ["</s>"]
    # URLs: a bare one by its suffix, or with the kind in front
    for spelled in ("s3://bucket/dir/tok.json", "hf:s3://bucket/dir/tok.json"):
        assert raw(spelled) == {**hf, "path": "s3://bucket/dir/tok.json"}
    assert raw("tiktoken:gs://b/x.tiktoken")["path"] == "gs://b/x.tiktoken"

    # the spelled choice builds the tokenizer it names
    built = tokenizer_from_raw(raw(str(tokenizer_json)), plugins)
    assert isinstance(built, HFTokenizer)
    assert built.eod_id == 0
    assert isinstance(tokenizer_from_raw(raw(str(digit_ranks)), plugins), TiktokenTokenizer)
    assert isinstance(tokenizer_from_raw({"kind": "bytes"}, plugins), BytesTokenizer)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("byts", "unknown tokenizer 'byts' (did you mean 'bytes'?); known: bytes, hf, tiktoken"),
        ("tiktokn:x.bin", "unknown tokenizer 'tiktokn:x.bin'"),
        ("vocab.txt", "unknown tokenizer 'vocab.txt'"),
    ],
)
def test_tokenizer_choice_unknown_kind(plugins, text, message):
    with pytest.raises(ConfigError) as info:
        tokenizer_choice(text, plugins)
    assert message in str(info.value)
    assert "--tokenizer" in str(info.value)


def test_tokenizer_choice_bad_options(plugins, tokenizer_json):
    with pytest.raises(UserError, match="tokenizer option 'fast': expected key=value"):
        tokenizer_choice(str(tokenizer_json), plugins, ["fast"])
    with pytest.raises(ConfigError, match="unknown key") as info:
        tokenizer_choice(str(tokenizer_json), plugins, ["eod_tokn=</s>"])
    assert (
        "eod_tokn: unknown key (did you mean 'eod_token'?); allowed: path, eod_token, fast"
        in str(info.value)
    )
    with pytest.raises(ConfigError, match="fast"):
        tokenizer_choice(str(tokenizer_json), plugins, ["fast=sometimes"])


# -- training ---------------------------------------------------------------------------------------


def test_train_bpe_vocab_size_limits(corpus):
    docs = corpus(200)
    with pytest.raises(UserError, match="vocab size 256 is too small") as info:
        train_bpe(docs, 256)
    assert "256 + 1 special tokens" in str(info.value)
    with pytest.raises(UserError, match="vocab size 258 is too small"):
        train_bpe(docs, 258, special_tokens=[ENDOFTEXT, "<a>", "<b>"])
    smallest = json.loads(train_bpe(docs, 257))
    assert len(smallest["model"]["vocab"]) == 257
    assert smallest["model"]["merges"] == []


def test_train_tokenizer_cli(tmp_path, run_cli, write_jsonl, corpus):
    docs = corpus(400, seed=11)
    data = write_jsonl("train.jsonl", docs, field="meta.body")
    out = tmp_path / "tok.json"
    logs = tmp_path / "logs"
    argv = ["data", "train-tokenizer", data, "-o", out, "--vocab-size", 320]
    argv += ["--field", "meta.body", "--special-token", "</s>", "--special-token", "<pad>"]
    code, stdout, _ = run_cli(*argv, "--log-dir", logs)
    assert code == 0
    assert stdout == f"{out}: byte-level BPE, 320 tokens\n"
    tok = HFTokenizer(HFOptions(str(out)))
    assert (tok.vocab_size, tok.eod_id, tok.token_id("<pad>")) == (320, 0, 1)
    assert tok.fast
    ids = tok.encode_batch(docs)
    assert ids == tok.encode_batch_hf(docs)
    assert [tok.decode(i) for i in ids] == docs
    events = [json.loads(line) for line in (logs / "rank0.jsonl").read_text().splitlines()]
    trained = [e for e in events if e["event"] == "tokenizer.trained"]
    assert trained[0]["documents"] == 400
    assert trained[0]["vocab_size"] == 320

    before = out.read_bytes()
    code, _, stderr = run_cli(*argv, "--log-dir", logs)
    assert code == 2
    assert f"error: {out} already exists; pass --overwrite" in stderr
    assert out.read_bytes() == before
    code, _, _ = run_cli(*argv, "--max-documents", 50, "--overwrite", "--log-dir", logs)
    assert code == 0
    assert out.read_bytes() != before


def test_train_tokenizer_cli_errors(tmp_path, run_cli, write_jsonl):
    logs = tmp_path / "logs"
    out = tmp_path / "tok.json"
    bad = write_jsonl("bad.jsonl", ["fine", "also fine", {"body": "no text field"}])
    code, _, stderr = run_cli(
        "data", "train-tokenizer", bad, "-o", out, "--vocab-size", 300, "--log-dir", logs
    )
    assert code == 2
    assert f"error: {bad}:3: no field 'text'" in stderr
    assert not out.exists()

    empty = write_jsonl("empty.jsonl", ["", ""])
    code, _, stderr = run_cli(
        "data", "train-tokenizer", empty, "-o", out, "--vocab-size", 300, "--log-dir", logs
    )
    assert code == 2
    assert "no documents with field 'text'" in stderr
    assert not out.exists()

    code, _, stderr = run_cli(
        "data", "train-tokenizer", empty, "-o", out, "--vocab-size", 200, "--log-dir", logs
    )
    assert code == 2
    assert "vocab size 200 is too small" in stderr


@pytest.mark.parametrize("parse_special", [False, True])
@pytest.mark.parametrize("fast", ["auto", "off", "on"])
def test_hf_tokenizer_pickles_with_its_behaviour(tokenizer_json, texts, parse_special, fast):
    """pack sends its workers the tokenizer pickled: the copy encodes exactly as the original,
    special-token text and the fast path's state included."""
    import pickle

    tok = HFTokenizer(HFOptions(str(tokenizer_json), fast=fast, parse_special=parse_special))
    docs = [*texts[:20], "a <|endoftext|> in the text", "<|endoftext|>"]
    copy = pickle.loads(pickle.dumps(tok))
    assert copy.encode_batch(docs) == tok.encode_batch(docs)
    assert (copy.eod_id in copy.encode_batch(docs[-1:])[0]) == parse_special
