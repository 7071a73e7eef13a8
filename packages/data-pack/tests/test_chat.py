"""`pack-chat`: conversations rendered with a chat template into tokens and a loss mask, laid
into blocks no conversation crosses. Exact ids and masks written out by hand (ChatML on the bytes
tokenizer, a Llama-3-like Jinja template on a trained tokenizer.json), bad input named by
file:line with nothing written, the block layout on random conversations, and the readers
(windows, document starts, mixtures, inspect, merge) on chat datasets."""

from __future__ import annotations

import itertools
import json
import os
import re

import numpy as np
import pytest

from llmtrain.data_pack.chat import ChatSettings, ChatTemplate, TemplateError
from llmtrain.data_pack.errors import DatasetError
from llmtrain.data_pack.loader import open_windows
from llmtrain.data_pack.pack import PackError, pack
from llmtrain.data_pack.report import inspect_dataset
from llmtrain.data_pack.store import PackedDataset
from llmtrain.data_pack.tokenizer import (
    BytesOptions,
    BytesTokenizer,
    HFOptions,
    HFTokenizer,
    train_bpe,
)
from llmtrain.data_pack.windows import TokenWindows

CHAT_TOKENS = ["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
BYTES_CHAT = {"kind": "bytes", "special_tokens": CHAT_TOKENS}
BYTES_CHAT_OPTION = "special_tokens=" + json.dumps(CHAT_TOKENS, separators=(",", ":"))
EOD, PAD, IM_START, IM_END = 256, 257, 258, 259
NL = 10

# a Llama-3-like tokenizer: its template writes these (bos and eos come from the config's
# variables); the reserved token is special but no template writes it
LLAMA_SPECIALS = [
    "<|end_of_text|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|reserved_special_token_0|>",
]
BOS, HEADER, END_HEADER, EOT, RESERVED = 1, 2, 3, 4, 5
LLAMA_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{% if not loop.first %}{{ raise_exception('a system message must come first') }}{% endif %}"
    "{% elif (message['role'] == 'user') != "
    "((loop.index0 - (messages[0]['role'] == 'system')) % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] }}{{ eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def _conv(*turns: tuple[str, str]) -> dict:
    return {"messages": [{"role": role, "content": content} for role, content in turns]}


def _write(path, records) -> None:
    """JSON lines; bytes are written as the line itself (bad input)."""
    lines = [
        r if isinstance(r, bytes) else json.dumps(r, ensure_ascii=False).encode() for r in records
    ]
    path.write_bytes(b"".join(line + b"\n" for line in lines))


def _chatml(seq_len: int, **options) -> ChatSettings:
    return ChatSettings(ChatTemplate.chatml().to_meta(), seq_len, **options)


def _arrays(ds: PackedDataset) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    tokens = ds.read(0, ds.n_tokens).astype(np.int64)
    mask = np.asarray(ds.loss_mask[:], dtype=bool)
    return tokens, mask, np.asarray(ds.doc_offsets[:], dtype=np.int64)


def _conversations(ds: PackedDataset) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """(start, ids without eod, mask without eod) of every conversation: a document is one
    conversation, its eod, and (last in its block) the block's eod padding."""
    tokens, mask, offsets = _arrays(ds)
    eod = ds.eod_id
    out = []
    for start, stop in itertools.pairwise(offsets.tolist()):
        end = start + int(np.flatnonzero(tokens[start:stop] == eod)[0])
        out.append((start, tokens[start:end], mask[start:end]))
    return out


def _runs(positions: np.ndarray) -> list[np.ndarray]:
    """Consecutive positions, grouped."""
    return (
        np.split(positions, np.flatnonzero(np.diff(positions) != 1) + 1) if len(positions) else []
    )


def _assert_nothing_written(tmp_path, out) -> None:
    assert not out.exists()
    assert [n for n in os.listdir(tmp_path) if n.startswith(out.name)] == []
    with pytest.raises(DatasetError, match="not a packed dataset"):
        PackedDataset(str(out))


def _pack_chat(run_cli, tmp_path, inputs, out, *extra, seq_len=64, tokenizer=None):
    """`llmtrain data pack-chat` in this process, on the bytes tokenizer with the ChatML tokens
    unless `tokenizer` (a --tokenizer value) is given."""
    tok = ["--tokenizer", "bytes", "--tokenizer-option", BYTES_CHAT_OPTION]
    if tokenizer is not None:
        tok = ["--tokenizer", tokenizer]
    return run_cli(
        "data",
        "pack-chat",
        *inputs,
        "-o",
        out,
        *tok,
        "--seq-len",
        seq_len,
        "--workers",
        1,
        "--log-dir",
        tmp_path / "logs",
        *extra,
    )


# -- ChatML on bytes, by hand ------------------------------------------------------------------------

FIRST = _conv(
    ("system", "Be brief."),
    ("user", "Hi"),
    ("assistant", "Héllo!"),
    ("user", "2+2?"),
    ("assistant", "4"),
)
SECOND = _conv(("user", "Q"), ("assistant", "A"))

# every token written out: bytes are their UTF-8 values ("é" is 195 169), specials 256..259
FIRST_IDS = [
    *[IM_START, *b"system", NL, *b"Be brief.", IM_END, NL],  # 0-18
    *[IM_START, *b"user", NL, *b"Hi", IM_END, NL],  # 19-28
    *[IM_START, *b"assistant", NL],  # 29-39: the header does not count
    *[72, 195, 169, 108, 108, 111, 33, IM_END],  # 40-47: "Héllo!" and its <|im_end|> count
    NL,  # 48: what follows <|im_end|> does not count
    *[IM_START, *b"user", NL, *b"2+2?", IM_END, NL],  # 49-60
    *[IM_START, *b"assistant", NL],  # 61-71
    *[52, IM_END],  # 72-73: "4" and <|im_end|>
    NL,  # 74
    EOD,  # 75
]
SECOND_IDS = [
    *[IM_START, *b"user", NL, *b"Q", IM_END, NL],  # 80-88
    *[IM_START, *b"assistant", NL],  # 89-99
    *[65, IM_END],  # 100-101: "A" and <|im_end|>
    NL,  # 102
    EOD,  # 103
]
# blocks of 80: the first conversation (76 tokens) and 4 padding, the second (24) and 56
# padding, then the dataset's one extra padding token
HAND_IDS = [*FIRST_IDS, *[EOD] * 4, *SECOND_IDS, *[EOD] * 56, EOD]
HAND_COUNTED = [*range(40, 48), 72, 73, 100, 101]


def test_chatml_ids_and_mask_by_hand(tmp_path, run_cli):
    data = tmp_path / "chat.jsonl"
    _write(data, [FIRST, SECOND])
    assert (len(FIRST_IDS), len(SECOND_IDS), len(HAND_IDS)) == (76, 24, 161)
    out = tmp_path / "ds"
    summary = pack([str(data)], str(out), BYTES_CHAT, workers=1, chat=_chatml(80), chunk_tokens=32)
    assert (summary.documents, summary.tokens) == (2, 161)

    ds = PackedDataset(str(out))
    tokens, mask, offsets = _arrays(ds)
    assert tokens.tolist() == HAND_IDS
    assert np.flatnonzero(mask).tolist() == HAND_COUNTED
    assert offsets.tolist() == [0, 80, 161]  # each block's padding belongs to its conversation
    assert ds.meta["version"] == 2
    assert ds.meta["field"] is None
    assert ds.meta["counts"] == {
        "documents": 2,
        "tokens": 161,
        "empty_documents": 0,
        "blank_lines": 0,
        "bad_lines": 0,
        "counted_tokens": 12,
        "padding_tokens": 61,
        "too_long": 0,
    }
    assert ds.n_bytes is None and summary.n_bytes is None  # chat counts no bytes (README)
    assert ds.block == 80
    assert ds.chat["template"] == ChatTemplate.chatml().to_meta()
    assert ds.chat["template"]["stop"] == ["<|im_end|>"]
    assert ChatTemplate.from_meta(ds.chat["template"]) == ChatTemplate.chatml()
    assert (ds.chat["roles"], ds.chat["train_roles"]) == (
        ["system", "user", "assistant", "tool"],
        ["assistant"],
    )
    assert sorted(os.listdir(out)) == [
        "chunk_docs",
        "chunk_heads",
        "doc_offsets",
        "loss_mask",
        "tokens",
        "zarr.json",
    ]
    for chunk in range(ds.n_chunks):  # chunks of 32: masks read a chunk at a time
        np.testing.assert_array_equal(ds.read_mask_chunk(chunk), mask[chunk * 32 : chunk * 32 + 32])

    # windows of one block: window i is tokens [80i, 80i + 81), its mask beside them
    windows = TokenWindows(str(out), 80)
    assert len(windows) == 2
    got, _ = windows.read([1, 0])
    got_mask = windows.read_mask([1, 0])
    assert got.shape == got_mask.shape == (2, 81)
    assert got[1].tolist() == HAND_IDS[0:81]
    assert got[0].tolist() == HAND_IDS[80:161]
    expected_mask = np.zeros(161, bool)
    expected_mask[HAND_COUNTED] = True
    np.testing.assert_array_equal(got_mask[1], expected_mask[0:81])
    np.testing.assert_array_equal(got_mask[0], expected_mask[80:161])
    # the trainer's targets are tokens[:, 1:] under mask[:, 1:]; each is predicted from the
    # token before it (the first of each assistant turn from the header's "\n")
    tok = BytesTokenizer(BytesOptions(CHAT_TOKENS))
    targets, inputs = got[1, 1:][got_mask[1, 1:]], got[1, :-1][got_mask[1, 1:]]
    assert tok.decode(targets) == "Héllo!<|im_end|>4<|im_end|>"
    assert inputs.tolist() == [NL, 72, 195, 169, 108, 108, 111, 33, NL, 52]
    assert tok.decode(got[0, 1:][got_mask[0, 1:]]) == "A<|im_end|>"
    # the last input of window 0 is the next block's first token: never a target
    assert (got[1, 80], got_mask[1, 80]) == (IM_START, False)
    # a window of two blocks reads the whole dataset
    whole = TokenWindows(str(out), 160)
    assert whole.read([0])[0][0].tolist() == HAND_IDS
    np.testing.assert_array_equal(whole.read_mask([0])[0], expected_mask)

    # the CLI writes the same dataset and says what it counted
    code, stdout, _ = _pack_chat(run_cli, tmp_path, [data], tmp_path / "cli", seq_len=80)
    assert code == 0
    assert stdout.startswith(
        f"{tmp_path / 'cli'}: 2 conversations, 161 tokens (12 counted by the loss, 61 padding; "
        "0 too long skipped) in "
    )
    cli = PackedDataset(str(tmp_path / "cli"))
    for a, b in zip(_arrays(cli), _arrays(ds), strict=True):
        np.testing.assert_array_equal(a, b)
    assert cli.fingerprint == ds.fingerprint


def test_train_roles_user_and_assistant_by_hand(tmp_path, run_cli):
    data = tmp_path / "chat.jsonl"
    _write(data, [FIRST, SECOND])
    out = tmp_path / "ds"
    code, _, stderr = _pack_chat(
        run_cli, tmp_path, [data], out, "--train-roles", "user,assistant", seq_len=80
    )
    assert code == 0, stderr
    ds = PackedDataset(str(out))
    tokens, mask, _ = _arrays(ds)
    assert tokens.tolist() == HAND_IDS  # the ids do not depend on what counts
    # a user turn counts whole up to its <|im_end|>, header included, except a conversation's
    # first token (nothing before it predicts it)
    user = [*range(19, 28), *range(49, 60), *range(81, 88)]
    assert np.flatnonzero(mask).tolist() == sorted(user + HAND_COUNTED)
    tok = BytesTokenizer(BytesOptions(CHAT_TOKENS))
    assert tok.decode(tokens[19:28]) == "<|im_start|>user\nHi<|im_end|>"
    assert tok.decode(tokens[81:88]) == "user\nQ<|im_end|>"
    assert ds.chat["train_roles"] == ["user", "assistant"]
    assert ds.meta["counts"]["counted_tokens"] == 12 + 9 + 11 + 7


def test_roles_restrict_and_name_custom_roles(tmp_path, run_cli):
    data = tmp_path / "chat.jsonl"
    _write(data, [SECOND, FIRST])
    out = tmp_path / "ds"
    # system is no longer a role: line 2 is refused, by name
    code, _, stderr = _pack_chat(run_cli, tmp_path, [data], out, "--roles", "user,assistant")
    assert code == 2
    assert (
        f"error: {data}:2: message 1 has the unknown role 'system' (roles: user, assistant; "
        "--roles sets them)" in stderr
    )
    _assert_nothing_written(tmp_path, out)

    # a custom role, trained on instead of the assistant: its whole turn counts
    critic = tmp_path / "critic.jsonl"
    _write(critic, [_conv(("user", "Q"), ("critic", "ok"), ("assistant", "A"))])
    code, _, stderr = _pack_chat(
        run_cli,
        tmp_path,
        [critic],
        out,
        "--roles",
        "user,assistant,critic",
        "--train-roles",
        "critic",
    )
    assert code == 0, stderr
    ds = PackedDataset(str(out))
    (_, ids, mask), *_ = _conversations(ds)
    tok = BytesTokenizer(BytesOptions(CHAT_TOKENS))
    assert tok.decode(ids[mask]) == "<|im_start|>critic\nok<|im_end|>"

    # a train role that is no role is refused before any work
    code, _, stderr = _pack_chat(
        run_cli,
        tmp_path,
        [data],
        tmp_path / "x",
        "--roles",
        "user,assistant",
        "--train-roles",
        "tool",
    )
    assert code == 2
    assert "error: --train-roles tool: each must be one of the roles (user,assistant)" in stderr
    _assert_nothing_written(tmp_path, tmp_path / "x")


def test_unused_special_text_in_content_stays_bytes(tmp_path):
    """<|endoftext|> and <|pad|> are special but ChatML does not write them: in a message they
    are plain bytes, so the eod (256) only ever ends a conversation."""
    data = tmp_path / "chat.jsonl"
    content = "a<|endoftext|>b<|pad|>"
    _write(data, [_conv(("user", content), ("assistant", content))])
    pack([str(data)], str(tmp_path / "ds"), BYTES_CHAT, workers=1, chat=_chatml(80))
    (_, ids, mask), *_ = _conversations(PackedDataset(str(tmp_path / "ds")))
    assert ids.tolist() == [
        *[IM_START, *b"user", NL, *content.encode(), IM_END, NL],
        *[IM_START, *b"assistant", NL, *content.encode(), IM_END, NL],
    ]
    assert EOD not in ids.tolist() and PAD not in ids.tolist()
    tok = BytesTokenizer(BytesOptions(CHAT_TOKENS))
    assert tok.decode(ids[mask]) == content + "<|im_end|>"


def test_field_options_read_other_layouts(tmp_path, run_cli):
    """ShareGPT-like records: messages under a dotted path, with other role and content keys;
    the ids and mask are those of the same conversations in the default layout."""
    data = tmp_path / "chat.jsonl"
    _write(data, [FIRST, SECOND])
    other = tmp_path / "other.jsonl"
    _write(
        other,
        [
            {"data": {"turns": [{"from": m["role"], "value": m["content"], "id": i}
                                for i, m in enumerate(r["messages"])]}}
            for r in (FIRST, SECOND)
        ],
    )  # fmt: skip
    code, _, stderr = _pack_chat(run_cli, tmp_path, [data], tmp_path / "a", seq_len=80)
    assert code == 0, stderr
    code, _, stderr = _pack_chat(
        run_cli, tmp_path, [other], tmp_path / "b",
        "--messages-field", "data.turns", "--role-field", "from", "--content-field", "value",
        seq_len=80,
    )  # fmt: skip
    assert code == 0, stderr
    a, b = PackedDataset(str(tmp_path / "a")), PackedDataset(str(tmp_path / "b"))
    for x, y in zip(_arrays(a), _arrays(b), strict=True):
        np.testing.assert_array_equal(x, y)
    assert _arrays(b)[0].tolist() == HAND_IDS
    assert (b.chat["messages_field"], b.chat["role_field"], b.chat["content_field"]) == (
        "data.turns",
        "from",
        "value",
    )
    # an empty list of turns is named by its line and the field
    _write(other, [{"data": {"turns": []}}])
    code, _, stderr = _pack_chat(
        run_cli, tmp_path, [other], tmp_path / "c", "--messages-field", "data.turns"
    )
    assert code == 2
    assert f"error: {other}:1: 'data.turns' is an empty list, not a list of messages" in stderr


def test_special_tokens_missing_from_the_tokenizer(tmp_path, run_cli):
    data = tmp_path / "chat.jsonl"
    _write(data, [SECOND])
    out = tmp_path / "ds"
    code, _, stderr = run_cli(
        "data", "pack-chat", data, "-o", out, "--tokenizer", "bytes", "--seq-len", 64,
        "--log-dir", tmp_path / "logs",
    )  # fmt: skip
    assert code == 2
    assert (
        "error: the chat template chatml needs <|im_end|>, <|im_start|> as special tokens (one id "
        "each), but tokenizer bytes does not have them" in stderr
    )
    assert BYTES_CHAT_OPTION in stderr
    _assert_nothing_written(tmp_path, out)


def test_encoder_follows_the_tokenizer_of_each_pack(tmp_path, monkeypatch):
    """Two packs in one process (workers=1) with the same template and different tokenizers:
    each must use its own tokenizer's ids."""
    import llmtrain.data_pack.pack_worker as pack_module

    monkeypatch.setattr(pack_module, "_worker", {})  # what this test caches stays here
    data = tmp_path / "chat.jsonl"
    _write(data, [SECOND])
    pack([str(data)], str(tmp_path / "a"), BYTES_CHAT, workers=1, chat=_chatml(32))
    reordered = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
    pack(
        [str(data)],
        str(tmp_path / "b"),
        {"kind": "bytes", "special_tokens": reordered},
        workers=1,
        chat=_chatml(32),
    )
    (_, ids, _), *_ = _conversations(PackedDataset(str(tmp_path / "b")))
    # <|im_start|> is 257 and <|im_end|> 258 for this tokenizer (259 is its <|pad|>)
    assert ids[0] == 257
    assert ids.tolist() == [
        257 if t == IM_START else 258 if t == IM_END else t for t in SECOND_IDS[:-1]
    ]


# -- a Hugging Face template from tokenizer_config.json ----------------------------------------------


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(tokenizer.json, tokenizer_config.json): a byte-level BPE with the Llama-3 special tokens
    as added tokens, and a config whose chat_template uses bos_token and eos_token."""
    folder = tmp_path_factory.mktemp("llama")
    texts = [
        "hello world, the assistant and the user talk. What is two plus two? It is four.",
        "system: be brief and kind; café über naïve 日本語",
    ] * 40
    tokenizer = folder / "tokenizer.json"
    tokenizer.write_text(train_bpe(texts, 320, special_tokens=LLAMA_SPECIALS), encoding="utf-8")
    config = folder / "tokenizer_config.json"
    config.write_text(
        json.dumps(
            {
                "chat_template": LLAMA_TEMPLATE,
                "bos_token": "<|begin_of_text|>",
                "eos_token": {"content": "<|eot_id|>", "special": True},  # an AddedToken entry
                "pad_token": None,
            },
            indent=1,
        ),
        encoding="utf-8",
    )
    return tokenizer, config


LLAMA_CONVERSATIONS = [
    _conv(
        ("system", "Be brief."),
        ("user", "hi <|reserved_special_token_0|> there"),
        ("assistant", "Hello! What is two plus two?"),
        ("user", "2+2?"),
        ("assistant", "It is four."),
    ),
    _conv(("user", "Café?"), ("assistant", "Café ☕ — 日本語 👩‍💻")),
    _conv(("user", "spaces"), ("assistant", "  kept as is\n")),
]


def _llama_expected(tok: HFTokenizer, messages: list[dict]) -> tuple[list[int], list[bool]]:
    """The ids and mask, piece by piece: the template's special tokens are single ids and the
    text between them is tokenized on its own; an assistant turn counts after its header."""

    def enc(text: str) -> list[int]:
        return tok.encode_batch([text])[0]

    ids, mask = [BOS], [False]
    for m in messages:
        header = [HEADER, *enc(m["role"]), END_HEADER]
        if m["role"] == "assistant":
            body = [*enc(m["content"]), EOT]
            ids += [*header, *enc("\n\n"), *body]
            mask += [False] * (len(header) + len(enc("\n\n"))) + [True] * len(body)
        else:
            turn = [*header, *enc("\n\n" + m["content"]), EOT]
            ids += turn
            mask += [False] * len(turn)
    return [*ids, 0], [*mask, False]


def test_hf_template_from_tokenizer_config(tmp_path, run_cli, llama):
    tokenizer, config = llama
    data = tmp_path / "chat.jsonl"
    _write(data, LLAMA_CONVERSATIONS)
    out = tmp_path / "ds"
    code, _, stderr = _pack_chat(
        run_cli,
        tmp_path,
        [data],
        out,
        "--template",
        config,
        seq_len=128,
        tokenizer=f"hf:{tokenizer}",
    )
    assert code == 0, stderr

    template = ChatTemplate.load(str(config))
    assert template.stop == ["<|eot_id|>"]
    assert template.variables == {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    tok = HFTokenizer(HFOptions(str(tokenizer)))
    assert tok.eod_id == 0
    assert template.special_ids(tok) == {
        "<|begin_of_text|>": BOS,
        "<|start_header_id|>": HEADER,
        "<|end_header_id|>": END_HEADER,
        "<|eot_id|>": EOT,
    }
    header = template.render(
        [{"role": "user", "content": "x"}], add_generation_prompt=True
    ).removeprefix(template.render([{"role": "user", "content": "x"}]))
    assert header == "<|start_header_id|>assistant<|end_header_id|>\n\n"

    ds = PackedDataset(str(out))
    assert ds.chat["template"] == template.to_meta()
    assert ds.meta["counts"]["too_long"] == 0
    found = {tuple(ids.tolist()): mask for _, ids, mask in _conversations(ds)}
    assert len(found) == 3
    for record in LLAMA_CONVERSATIONS:
        messages = record["messages"]
        ids, mask = _llama_expected(tok, messages)
        assert tuple(ids[:-1]) in found, template.render(messages)
        got_mask = found[tuple(ids[:-1])]
        assert got_mask.tolist() == mask[:-1]
        # the whole conversation decodes to the template's rendering
        assert tok.decode(ids[:-1]) == template.render(messages)
        # each run of counted tokens is one assistant turn: its content and the stop token
        positions = np.flatnonzero(got_mask)
        assert [tok.decode(np.asarray(ids)[run]) for run in _runs(positions)] == [
            m["content"] + "<|eot_id|>" for m in messages if m["role"] == "assistant"
        ]
        # the template's specials are one id each, as often as the template writes them
        assert ids.count(BOS) == 1 and ids[0] == BOS
        assert ids.count(HEADER) == ids.count(END_HEADER) == ids.count(EOT) == len(messages)

    # a special token's text in a message that the template does not write stays plain text
    tokens, _, _ = _arrays(ds)
    assert RESERVED not in tokens.tolist()
    first = _llama_expected(tok, LLAMA_CONVERSATIONS[0]["messages"])[0]
    assert "hi <|reserved_special_token_0|> there" in tok.decode(first)
    assert tok.encode_batch(["<|reserved_special_token_0|>"])[0] != [RESERVED]


def test_named_templates_in_a_config(tmp_path):
    config = tmp_path / "tokenizer_config.json"
    config.write_text(
        json.dumps(
            {
                "chat_template": [
                    {
                        "name": "default",
                        "template": "{% for m in messages %}{{ m.content }}{% endfor %}",
                    },
                    {"name": "tool_use", "template": "tools: {{ messages | length }}"},
                ],
                "eos_token": "</s>",
            }
        ),
        encoding="utf-8",
    )
    assert ChatTemplate.load(str(config)).render([{"role": "user", "content": "a"}]) == "a"
    chosen = ChatTemplate.load(str(config), name="tool_use")
    assert (chosen.name, chosen.stop) == ("tool_use", ["</s>"])
    assert chosen.render([{"role": "user", "content": "a"}]) == "tools: 1"
    with pytest.raises(
        TemplateError, match=r"no chat template named 'other'; it has default, tool_use"
    ):
        ChatTemplate.load(str(config), name="other")
    # a model directory: its tokenizer_config.json
    assert ChatTemplate.load(str(tmp_path)).source == ChatTemplate.load(str(config)).source
    config.write_text(json.dumps({"eos_token": "</s>"}), encoding="utf-8")
    with pytest.raises(TemplateError, match=rf"^{re.escape(str(config))}: no chat_template in it"):
        ChatTemplate.load(str(config))


def test_template_of_a_model_directory(tmp_path):
    """A config without chat_template gives the variables; chat_template.jinja the template;
    additional_chat_templates/NAME.jinja a named one."""
    model = tmp_path / "model"
    (model / "additional_chat_templates").mkdir(parents=True)
    (model / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>"}), encoding="utf-8"
    )
    (model / "chat_template.jinja").write_text(
        "{{ bos_token }}{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}",
        encoding="utf-8",
    )
    (model / "additional_chat_templates" / "tool_use.jinja").write_text("tools", encoding="utf-8")
    template = ChatTemplate.load(str(model))
    assert (template.stop, template.variables) == (
        ["</s>"],
        {"bos_token": "<s>", "eos_token": "</s>"},
    )
    assert template.render([{"role": "user", "content": "a"}]) == "<s>a</s>"
    assert ChatTemplate.load(str(model), name="tool_use").render([]) == "tools"
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TemplateError, match=rf"^{re.escape(str(empty))}: no chat template in this"):
        ChatTemplate.load(str(empty), stop=["</s>"])


# -- bad input -------------------------------------------------------------------------------------

GOOD = _conv(("user", "hi"), ("assistant", "yo"))
BAD_CONVERSATIONS = {
    "unknown_role": (
        _conv(("robot", "beep"), ("assistant", "yo")),
        "message 1 has the unknown role 'robot' (roles: system, user, assistant, tool; --roles "
        "sets them)",
    ),
    "empty_assistant": (
        _conv(("user", "hi"), ("assistant", " \n ")),
        "message 2 is an empty assistant turn",
    ),
    "no_assistant": (
        _conv(("system", "s"), ("user", "hi")),
        "no assistant turn: nothing to train on (--train-roles)",
    ),
    "not_a_list": ({"messages": {"role": "user"}}, "'messages' is dict, not a list of messages"),
    "empty_list": ({"messages": []}, "'messages' is an empty list, not a list of messages"),
    "no_messages": ({"text": "plain"}, "no field 'messages'"),
    "not_an_object": (["a", "list"], "no field 'messages'"),
    "message_not_object": ({"messages": ["hi"]}, "message 1 is str, not an object"),
    "content_not_string": (
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": 4}]},
        "message 2 (assistant) has no 'content' string",
    ),
    "no_role": ({"messages": [{"content": "q"}]}, "message 1 has no 'role' string"),
    "malformed": (b'{"messages": [', "malformed JSON (Expecting value at column 15)"),
    "utf8": (b'{"messages": "\xff"}', "invalid UTF-8 at byte 14"),
}


@pytest.mark.parametrize("kind", sorted(BAD_CONVERSATIONS))
def test_bad_conversation_names_file_and_line(tmp_path, run_cli, kind):
    record, reason = BAD_CONVERSATIONS[kind]
    data = tmp_path / "chat.jsonl"
    _write(data, [GOOD, b"", GOOD, GOOD, record, GOOD])  # the blank line counts as a line
    out = tmp_path / "ds"
    code, _, stderr = _pack_chat(run_cli, tmp_path, [data], out)
    assert code == 2
    assert (
        f"error: {data}:5: {reason}; fix the line, or pass --on-bad-line skip to skip and count "
        "such lines\n" in stderr
    )
    _assert_nothing_written(tmp_path, out)


def test_unreadable_content_is_a_bad_line(tmp_path, run_cli):
    """A lone surrogate escape is valid JSON but no Unicode: a bad line, as in `pack`."""
    data = tmp_path / "chat.jsonl"
    bad = b'{"messages": [{"role": "user", "content": "bad \\ud800"}, {"role": "assistant", "content": "a"}]}'
    _write(data, [GOOD, GOOD, GOOD, bad, GOOD])
    out = tmp_path / "ds"
    code, _, stderr = _pack_chat(run_cli, tmp_path, [data], out)
    assert (code, stderr.count(f"error: {data}:4: ")) == (2, 1), stderr
    _assert_nothing_written(tmp_path, out)
    code, _, stderr = _pack_chat(run_cli, tmp_path, [data], out, "--on-bad-line", "skip")
    assert code == 0, stderr
    counts = PackedDataset(str(out)).meta["counts"]
    assert (counts["documents"], counts["bad_lines"]) == (4, 1)


def test_bad_line_in_second_file_counts_that_files_lines(tmp_path, run_cli):
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    _write(first, [GOOD] * 5)
    _write(second, [GOOD, GOOD, _conv(("user", "a"))])
    code, _, stderr = _pack_chat(run_cli, tmp_path, [first, second], tmp_path / "ds")
    assert code == 2
    assert f"error: {second}:3: no assistant turn: nothing to train on (--train-roles)" in stderr
    _assert_nothing_written(tmp_path, tmp_path / "ds")


def test_bad_line_with_workers_and_small_splits(tmp_path):
    records = [_conv(("user", f"question {i}"), ("assistant", f"answer {i}")) for i in range(300)]
    records.insert(250, _conv(("user", "a"), ("assistant", "")))
    data = tmp_path / "chat.jsonl"
    _write(data, records)
    assert data.stat().st_size > 20 * 1000
    out = tmp_path / "ds"
    with pytest.raises(
        PackError, match=rf"^{re.escape(str(data))}:251: message 2 is an empty assistant turn; "
    ):
        pack([str(data)], str(out), BYTES_CHAT, workers=2, split_bytes=1000, chat=_chatml(64))
    _assert_nothing_written(tmp_path, out)


def test_template_that_raises_names_the_line_and_the_template(tmp_path, run_cli, llama):
    tokenizer, config = llama
    data = tmp_path / "chat.jsonl"
    _write(
        data,
        [GOOD, GOOD, _conv(("user", "a"), ("user", "b"), ("assistant", "c")), GOOD],
    )
    out = tmp_path / "ds"
    code, _, stderr = _pack_chat(
        run_cli, tmp_path, [data], out, "--template", config, tokenizer=f"hf:{tokenizer}"
    )
    assert code == 2
    assert f"error: {data}:3: " in stderr
    assert "Conversation roles must alternate user/assistant/user/assistant/..." in stderr
    _assert_nothing_written(tmp_path, out)
    # the message says the template refused the conversation, and which template
    assert f"error: {data}:3: the chat template ({config}" in stderr
    assert ") refused it: Conversation roles must alternate" in stderr


def test_template_that_rewrites_earlier_turns_is_refused(tmp_path, run_cli):
    template = tmp_path / "count.jinja"
    template.write_text(
        "{{ messages | length }}{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>"
        "{% endfor %}",
        encoding="utf-8",
    )
    data = tmp_path / "chat.jsonl"
    _write(data, [GOOD])
    out = tmp_path / "ds"
    code, _, stderr = _pack_chat(
        run_cli, tmp_path, [data], out, "--template", template, "--stop", "<|im_end|>"
    )
    assert code == 2
    assert (
        f"error: {data}:1: the chat template renders the first 0 message(s) differently on "
        "their own than followed by message 1" in stderr
    )
    _assert_nothing_written(tmp_path, out)


BROKEN_TEMPLATE = "{% for m in messages %}\n{{ m['content'] }\n{% endfor %}\n"


@pytest.mark.parametrize("kind", ["jinja", "config"])
def test_template_syntax_error_names_template_and_line(tmp_path, run_cli, kind):
    if kind == "jinja":
        template = tmp_path / "broken.jinja"
        template.write_text(BROKEN_TEMPLATE, encoding="utf-8")
        where, stop = f"{template}: line 2: ", ["--stop", "<|im_end|>"]
    else:
        template = tmp_path / "tokenizer_config.json"
        template.write_text(
            json.dumps({"chat_template": BROKEN_TEMPLATE, "eos_token": "<|im_end|>"}),
            encoding="utf-8",
        )
        where, stop = f"{template}", []
    data = tmp_path / "chat.jsonl"
    _write(data, [GOOD])
    out = tmp_path / "ds"
    code, _, stderr = _pack_chat(run_cli, tmp_path, [data], out, "--template", template, *stop)
    assert code == 2
    assert f"error: {where}" in stderr
    assert "line 2: unexpected '}'\n" in stderr  # the template's line
    _assert_nothing_written(tmp_path, out)


def test_jinja_file_needs_a_stop_token(tmp_path, run_cli):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}", encoding="utf-8")
    data = tmp_path / "chat.jsonl"
    _write(data, [GOOD])
    code, _, stderr = _pack_chat(run_cli, tmp_path, [data], tmp_path / "ds", "--template", template)
    assert code == 2
    assert f"error: {template}: which token ends an assistant turn? pass --stop TOKEN" in stderr
    _assert_nothing_written(tmp_path, tmp_path / "ds")


def _long(content_bytes: int) -> dict:
    """user "Q", then an assistant turn of `content_bytes` x's: 23 + content_bytes tokens."""
    return _conv(("user", "Q"), ("assistant", "x" * content_bytes))


LONG = _long(100)  # 123 tokens
EXACT = _long(41)  # 64 tokens with its eod: fits a block of 64 exactly
# 63 tokens of system turn before anything counted: nothing left once cut to 64
HOPELESS = _conv(("system", "s" * 100), ("user", "Q"), ("assistant", "A"))


def test_too_long_error_names_the_line(tmp_path, run_cli):
    data = tmp_path / "chat.jsonl"
    _write(data, [GOOD, EXACT, LONG, GOOD])
    out = tmp_path / "ds"
    code, _, stderr = _pack_chat(run_cli, tmp_path, [data], out, "--too-long", "error")
    assert code == 2
    assert (
        f"error: {data}:3: 123 tokens (with its eod), longer than the sequence length 64; pass "
        "--too-long skip or truncate to fit such conversations, or a larger --seq-len\n" in stderr
    )
    _assert_nothing_written(tmp_path, out)


def test_first_problem_of_a_file_is_the_one_reported(tmp_path, run_cli):
    """A conversation too long (with --too-long error) on line 2 comes before a malformed line 4."""
    data = tmp_path / "chat.jsonl"
    _write(data, [GOOD, LONG, GOOD, b"{bad"])
    out = tmp_path / "ds"
    code, _, stderr = _pack_chat(run_cli, tmp_path, [data], out, "--too-long", "error")
    assert code == 2
    assert f"error: {data}:2: 123 tokens (with its eod)" in stderr, stderr
    _assert_nothing_written(tmp_path, out)


@pytest.mark.parametrize("too_long", ["skip", "truncate"])
def test_skip_and_truncate_count_exactly(tmp_path, run_cli, too_long):
    data = tmp_path / "chat.jsonl"
    first = _conv(("user", "one"), ("assistant", "1"))
    third = _conv(("user", "three"), ("assistant", "3"))
    records = [
        first,  # 1
        _conv(("robot", "r"), ("assistant", "a")),  # 2: bad
        EXACT,  # 3: fits
        LONG,  # 4: too long
        b"",  # 5
        b"{bad",  # 6: bad
        HOPELESS,  # 7: too long; truncated, nothing counts
        third,  # 8
    ]
    _write(data, records)
    out = tmp_path / "ds"
    code, stdout, stderr = _pack_chat(
        run_cli, tmp_path, [data], out, "--too-long", too_long, "--on-bad-line", "skip"
    )
    assert code == 0, stderr
    ds = PackedDataset(str(out))
    counts = ds.meta["counts"]
    kept = 3 if too_long == "skip" else 4
    assert (counts["bad_lines"], counts["too_long"], counts["blank_lines"]) == (2, 2, 1)
    assert counts["documents"] == kept
    assert ds.meta["bad_lines"] == [
        {
            "file": str(data),
            "line": 2,
            "reason": "message 1 has the unknown role 'robot' (roles: system, user, assistant, "
            "tool; --roles sets them)",
        },
        {
            "file": str(data),
            "line": 6,
            "reason": "malformed JSON (Expecting property name enclosed in double quotes at "
            "column 2)",
        },
    ]
    verb = {"skip": "skipped", "truncate": "truncated"}[too_long]
    assert f"; 2 too long {verb}, 2 bad lines skipped) in " in stdout

    tok = BytesTokenizer(BytesOptions(CHAT_TOKENS))
    template = ChatTemplate.chatml()
    got = {tok.decode(ids): (ids, mask) for _, ids, mask in _conversations(ds)}
    expected = [template.render(r["messages"]) for r in (first, EXACT, third)]
    long_ids = [
        *[IM_START, *b"user", NL, *b"Q", IM_END, NL],  # 0-8
        *[IM_START, *b"assistant", NL],  # 9-19
        *b"x" * 100,  # 20-119
        *[IM_END, NL],
    ]
    assert len(long_ids) + 1 == 123
    if too_long == "truncate":
        # the first 63 tokens, then the eod; the header does not count, the x's do
        truncated = tok.decode(long_ids[:63])
        expected.append(truncated)
        ids, mask = got[truncated]
        assert ids.tolist() == long_ids[:63]
        assert np.flatnonzero(mask).tolist() == list(range(20, 63))
    assert sorted(got) == sorted(expected)
    _, mask, _ = _arrays(ds)
    assert int(mask.sum()) == counts["counted_tokens"]
    # EXACT fills a block alone; the truncated conversation too
    starts = [s for s, ids, _ in _conversations(ds) if len(ids) + 1 == 64]
    assert all(s % 64 == 0 for s in starts) and len(starts) == (1 if too_long == "skip" else 2)


def test_nothing_kept_is_an_error(tmp_path, run_cli):
    data = tmp_path / "chat.jsonl"
    _write(data, [LONG, LONG])
    out = tmp_path / "ds"
    code, _, stderr = _pack_chat(run_cli, tmp_path, [data], out)
    assert code == 2
    assert (
        f"error: no conversation of {data} was kept (2 too long, 0 bad); nothing was written"
        in stderr
    )
    _assert_nothing_written(tmp_path, out)


# -- block layout on random conversations -------------------------------------------------------------

ALPHABET = [*"abcdefghij klmnop\n", "é", "日本", "😀"]
L = 256  # the block (seq_len) of the layout tests


def _text(rng: np.random.Generator, tag: str, most: int) -> str:
    return tag + "".join(rng.choice(ALPHABET, size=int(rng.integers(0, most))))


def _random_conversations(n: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        turns = [("system", _text(rng, "s", 30))] if rng.random() < 0.3 else []
        for t in range(int(rng.integers(1, 4))):
            turns += [
                ("user", _text(rng, f"u{i}.{t} ", 30)),
                ("assistant", _text(rng, f"a{i}.{t} ", 50)),
            ]
        out.append(_conv(*turns))
    return out


def _chatml_length(record: dict) -> int:
    """Tokens of a ChatML conversation on the bytes tokenizer, with its eod."""
    return 1 + sum(len(m["role"]) + len(m["content"].encode()) + 4 for m in record["messages"])


@pytest.fixture(scope="module")
def layout(tmp_path_factory):
    """400 random conversations packed three ways: (records, {name: dataset path})."""
    folder = tmp_path_factory.mktemp("layout")
    records = _random_conversations(400, seed=7)
    data = folder / "chat.jsonl"
    _write(data, records)
    paths = {}
    for name, workers, split in (("w1-1500", 1, 1500), ("w2-5000", 2, 5000), ("w1-whole", 1, None)):
        paths[name] = str(folder / name)
        pack(
            [str(data)],
            paths[name],
            BYTES_CHAT,
            workers=workers,
            split_bytes=split,
            chunk_tokens=1000,  # no multiple of the block: blocks and windows cross chunks
            chat=_chatml(L),
        )
    return records, paths


def test_block_layout(layout):
    records, paths = layout
    lengths = [_chatml_length(r) for r in records]
    kept = [r for r, n in zip(records, lengths, strict=True) if n <= L]
    assert 250 < len(kept) < 400  # some are too long for a block, most fit
    ds = PackedDataset(paths["w1-1500"])
    tokens, mask, offsets = _arrays(ds)
    counts = ds.meta["counts"]
    assert (counts["documents"], counts["too_long"]) == (len(kept), 400 - len(kept))

    n_blocks = ds.n_tokens // L
    assert ds.n_tokens == n_blocks * L + 1
    assert offsets[-1] == ds.n_tokens
    # every block starts a conversation; none crosses a block boundary
    assert set(range(0, n_blocks * L, L)) <= set(offsets[:-1].tolist())
    in_conversation = np.zeros(ds.n_tokens, bool)
    for start, ids, _ in _conversations(ds):
        end = start + len(ids) + 1  # with its eod
        assert start // L == (end - 1) // L, (start, end)
        in_conversation[start:end] = True
    # the rest is eod padding at the end of each block (and the one extra token), counting nothing
    padding = ~in_conversation
    assert (tokens[padding] == EOD).all() and not mask[padding].any()
    assert int(padding.sum()) == counts["padding_tokens"]
    assert int(in_conversation.sum()) == sum(_chatml_length(r) for r in kept)
    for end in offsets[1:-1].tolist():  # padding only closes a block
        if end % L:
            assert in_conversation[end - 1]
    assert int(mask.sum()) == counts["counted_tokens"]

    # the same conversations, each with exactly its assistant turns counted
    tok = BytesTokenizer(BytesOptions(CHAT_TOKENS))
    template = ChatTemplate.chatml()
    got = sorted((tok.decode(ids), tok.decode(ids[m])) for _, ids, m in _conversations(ds))
    expected = sorted(
        (
            template.render(r["messages"]),
            "".join(m["content"] + "<|im_end|>" for m in r["messages"] if m["role"] == "assistant"),
        )
        for r in kept
    )
    assert got == expected


def test_layout_does_not_depend_on_workers_or_splits(layout):
    _, paths = layout
    reference = PackedDataset(paths["w1-1500"])
    for name in ("w2-5000", "w1-whole"):
        other = PackedDataset(paths[name])
        for a, b in zip(_arrays(other), _arrays(reference), strict=True):
            np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(other.chunk_docs, reference.chunk_docs)
        assert other.meta["counts"] == reference.meta["counts"]


def test_document_starts_mark_each_conversation(layout):
    _, paths = layout
    ds = PackedDataset(paths["w1-1500"])
    tokens, _, offsets = _arrays(ds)
    is_start = np.zeros(ds.n_tokens, bool)
    is_start[offsets[:-1]] = True
    assert (tokens[is_start] == IM_START).all()  # every conversation opens with <|im_start|>
    for seq_len in (L, 2 * L):
        windows = TokenWindows(ds, seq_len)
        indices = np.arange(len(windows))[::-1]
        got, starts = windows.read(indices, doc_starts=True)
        for row, i in enumerate(indices.tolist()):
            span = slice(i * seq_len, i * seq_len + seq_len)
            np.testing.assert_array_equal(got[row, :-1], tokens[span])
            np.testing.assert_array_equal(starts[row], is_start[span])
            assert starts[row, 0]  # a window starts at a block, so with a conversation
            assert starts[row].sum() == len(
                set(offsets.tolist()) & set(range(span.start, span.stop))
            )


def test_open_windows_on_a_chat_dataset(layout):
    _, paths = layout
    ds = PackedDataset(paths["w1-1500"])
    tokens, mask, _ = _arrays(ds)
    data = open_windows([paths["w1-1500"]], 2 * L, shuffle=False)
    samples = np.arange(len(data))
    batch = data.read(samples)
    assert set(batch) >= {"tokens", "loss_mask"}
    _, windows = data.sampler.lookup(samples)
    for row, i in enumerate(windows.tolist()):
        span = slice(i * 2 * L, i * 2 * L + 2 * L + 1)
        np.testing.assert_array_equal(batch["tokens"][row], tokens[span])
        np.testing.assert_array_equal(batch["loss_mask"][row], mask[span])
        assert not batch["loss_mask"][row, -1]  # the next block's first token: never a target

    for seq_len in (L + L // 2, L // 2):
        with pytest.raises(DatasetError) as info:
            open_windows([paths["w1-1500"]], seq_len)
        assert str(info.value) == (
            f"{paths['w1-1500']} holds conversations packed for seq_len {L} (none crosses a block "
            f"of {L} tokens), but windows of {seq_len} would cut them; use a seq_len that is a "
            f"multiple of {L}, or pack the data again with --seq-len {seq_len}"
        )


def test_mixture_of_chat_and_plain(layout, tmp_path):
    records, paths = layout
    plain = tmp_path / "plain.jsonl"
    _write(plain, [{"text": m["content"]} for r in records for m in r["messages"]])
    pack([str(plain)], str(tmp_path / "plain"), BYTES_CHAT, workers=1, chunk_tokens=1000)
    data = open_windows(
        [paths["w1-1500"], str(tmp_path / "plain")], 2 * L, weights=[0.5, 0.5], seed=3
    )
    samples = np.arange(64)
    batch = data.read(samples)
    sources, windows = data.sampler.lookup(samples)
    assert set(sources.tolist()) == {0, 1}
    for row in range(64):
        source = data.sources[int(sources[row])]
        tokens, _ = source.read([windows[row]])
        np.testing.assert_array_equal(batch["tokens"][row], tokens[0])
        if sources[row] == 1:
            assert batch["loss_mask"][row].all()
        else:
            np.testing.assert_array_equal(
                batch["loss_mask"][row], source.read_mask([windows[row]])[0]
            )
    assert not batch["loss_mask"][sources == 0].all()


# -- merge, inspect, object storage ---------------------------------------------------------------------


def test_merge_refuses_chat_datasets(tmp_path, run_cli):
    data = tmp_path / "chat.jsonl"
    _write(data, [FIRST, SECOND])
    pack([str(data)], str(tmp_path / "chat"), BYTES_CHAT, workers=1, chat=_chatml(80))
    plain = tmp_path / "plain.jsonl"
    _write(plain, [{"text": "hello"}])
    pack([str(plain)], str(tmp_path / "plain"), BYTES_CHAT, workers=1)
    out = tmp_path / "merged"
    code, _, stderr = run_cli(
        "data", "merge", tmp_path / "plain", tmp_path / "chat", "-o", out,
        "--log-dir", tmp_path / "logs",
    )  # fmt: skip
    assert code == 2
    assert (
        f"error: {tmp_path / 'chat'} is a chat dataset (conversations in blocks of 80 tokens "
        "with a loss mask), which merge does not join" in stderr
    )
    assert not out.exists()
    assert [n for n in os.listdir(tmp_path) if n.startswith("merged")] == []


def test_inspect_chat_dataset(tmp_path, run_cli):
    data = tmp_path / "chat.jsonl"
    _write(data, [FIRST, SECOND, LONG])
    out = tmp_path / "ds"
    pack([str(data)], str(out), BYTES_CHAT, workers=1, chat=_chatml(80))
    ds = PackedDataset(str(out))
    tokens, mask, _ = _arrays(ds)
    padding = ds.n_tokens - sum(len(ids) + 1 for _, ids, _ in _conversations(ds))
    assert (int(mask.sum()), padding) == (12, 61)

    code, stdout, _ = run_cli(
        "data", "inspect", out, "--json", "--window", 80, "--seed", 1,
        "--log-dir", tmp_path / "logs",
    )  # fmt: skip
    assert code == 0
    report = json.loads(stdout)
    assert report["counts"]["counted_tokens"] == int(mask.sum())
    assert report["counts"]["padding_tokens"] == padding
    assert report["counts"]["too_long"] == 1
    assert report["chat"] == {
        "template": "chatml",
        "stop": ["<|im_end|>"],
        "seq_len": 80,
        "roles": ["system", "user", "assistant", "tool"],
        "train_roles": ["assistant"],
        "too_long": "skip",
    }
    sample = report["sample"]
    # a chat sample starts at a block (a whole conversation): block 0 or 1 of 80 tokens
    start = int(np.random.default_rng(1).integers(0, 2)) * 80
    assert sample["start"] == start
    assert sample["ids"] == tokens[start : start + 80].tolist()
    assert sample["counted"] == np.flatnonzero(mask[start : start + 80]).tolist()
    # what the loss trains on, run by run, in both blocks
    for other in (0, 80):
        seed = next(k for k in range(20) if np.random.default_rng(k).integers(0, 2) * 80 == other)
        code, stdout, _ = run_cli(
            "data", "inspect", out, "--json", "--window", 80, "--seed", seed,
            "--log-dir", tmp_path / "logs",
        )  # fmt: skip
        got = json.loads(stdout)["sample"]["counted_text"]
        assert got == (["Héllo!<|im_end|>", "4<|im_end|>"] if other == 0 else ["A<|im_end|>"])

    code, stdout, _ = run_cli("data", "inspect", out, "--log-dir", tmp_path / "logs")
    assert code == 0
    assert (
        "  chat        template chatml (stop <|im_end|>), blocks of 80 tokens, training on "
        "assistant\n" in stdout
    )
    assert (
        f"  loss mask   12 tokens counted ({12 / 161:.1%}), 61 padding ({61 / 161:.1%}); "
        "1 conversations too long (skip)\n" in stdout
    )
    assert inspect_dataset(str(out)) == stdout.rstrip("\n")


def test_pack_chat_on_object_storage(tmp_path, moto_s3, run_cli):
    import fsspec

    data = tmp_path / "chat.jsonl"
    _write(data, [FIRST, SECOND, *_random_conversations(20, seed=1)])
    with fsspec.open(f"{moto_s3}/in/chat.jsonl", "wb") as f:
        f.write(data.read_bytes())
    remote = f"{moto_s3}/out/ds"
    code, _, stderr = _pack_chat(
        run_cli, tmp_path, [f"{moto_s3}/in/chat.jsonl"], remote, seq_len=80
    )
    assert code == 0, stderr
    pack([str(data)], str(tmp_path / "local"), BYTES_CHAT, workers=1, chat=_chatml(80))
    got, local = PackedDataset(remote), PackedDataset(str(tmp_path / "local"))
    for a, b in zip(_arrays(got), _arrays(local), strict=True):
        np.testing.assert_array_equal(a, b)
    assert got.meta["counts"] == local.meta["counts"]
    windows = TokenWindows(remote, 80)
    np.testing.assert_array_equal(
        windows.read_mask(np.arange(len(windows))),
        TokenWindows(str(tmp_path / "local"), 80).read_mask(np.arange(len(windows))),
    )
