"""Chat data: conversations rendered with a chat template into tokens and a per-token loss mask.

A conversation is a JSONL record holding a list of messages (`{role, content}`; the field names
are configurable). A chat template renders it to text: the built-in ChatML template, or the Jinja
`chat_template` of a Hugging Face `tokenizer_config.json` (or a `.jinja` file). Which text belongs
to which message is found by rendering growing prefixes of the conversation, so any template
works whose rendering of a conversation's first messages is the start of its rendering of the
whole; no markup inside the template is needed. Each piece of text is tokenized on its own, with
the special tokens the template uses (`<|im_start|>`, `<|im_end|>`, ...) turned into their ids, so
every token belongs to exactly one piece and the mask is exact.

What counts: the tokens of every message whose role is in `train_roles` (assistant by default).
For an assistant turn that is the text after the template's generation prompt (the role header)
up to and including its end-of-turn (stop) token; the headers, whatever the template writes after
the stop token, and the other messages do not count.

Sequences: conversations are laid into blocks of `seq_len` tokens, none across a block boundary
(`pack.py` does the layout), so a training window of `seq_len` (or a multiple) never cuts one.
"""

from __future__ import annotations

import functools
import itertools
import json
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import attrs
import numpy as np

from llmtrain.core_mesh.errors import UserError

if TYPE_CHECKING:
    import jinja2

CHATML_SOURCE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHATML_TOKENS = ("<|im_start|>", "<|im_end|>")
_SURROGATE = re.compile("[\ud800-\udfff]")
# what special tokens usually look like: <|name|> (a template's markers the tokenizer may lack)
_MARKER = re.compile(r"<\|[A-Za-z0-9_.-]+\|>")
ASSISTANT = "assistant"
DEFAULT_ROLES = ("system", "user", "assistant", "tool")
# tokenizer_config.json entries handed to the template as variables
TEMPLATE_VARIABLES = ("bos_token", "eos_token", "pad_token", "unk_token")


class TemplateError(UserError):
    """A chat template that cannot be read, compiled or used with the tokenizer."""


class RenderError(Exception):
    """A conversation the template refuses (the caller names the file:line)."""


# -- templates -------------------------------------------------------------------------------------


def _token_text(value: Any) -> str | None:
    """A tokenizer_config.json token entry: a string, or an AddedToken object with `content`."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping):
        content = value.get("content")
        if isinstance(content, str):
            return content
    return None


@attrs.frozen
class ChatTemplate:
    """A Jinja chat template with the variables it is rendered with and the tokens that end an
    assistant turn. Plain data (stored in dataset metadata and checkpoints)."""

    name: str
    source: str
    variables: dict[str, str] = attrs.Factory(dict)
    stop: list[str] = attrs.Factory(list)
    origin: str = "built-in"

    @classmethod
    def chatml(cls, stop: Sequence[str] = ()) -> ChatTemplate:
        return cls("chatml", CHATML_SOURCE, {}, list(stop) or [CHATML_TOKENS[1]])

    @classmethod
    def load(
        cls, spec: str | None, *, stop: Sequence[str] = (), name: str | None = None
    ) -> ChatTemplate:
        """`chatml` (or None); a tokenizer_config.json (its `chat_template` and bos/eos tokens);
        a Hugging Face model directory (tokenizer_config.json's template, else its
        `chat_template.jinja` or `chat_template.json`; `name` picks one of
        `additional_chat_templates/`); or a Jinja file. `stop` gives the end-of-turn tokens
        (default: ChatML's <|im_end|>, or the config's eos_token)."""
        if spec in (None, "", "chatml"):
            return cls.chatml(stop)
        from fsspec.core import url_to_fs

        fs, path = url_to_fs(spec)
        variables: dict[str, str] = {}
        if fs.isdir(path):
            source, origin, variables = _from_directory(spec.rstrip("/"), fs, path, name)
        elif spec.endswith(".json"):
            config = _read_json(spec)
            source, origin = (
                _pick(config.get("chat_template"), spec, name),
                f"{spec} (chat_template)",
            )
            variables = _variables(config)
        else:
            source, origin = _read_text(spec), spec
        if not stop:
            stop = [variables["eos_token"]] if "eos_token" in variables else []
        if not stop:
            raise TemplateError(
                f"{spec}: which token ends an assistant turn? pass --stop TOKEN (e.g. <|im_end|> "
                "or <|eot_id|>)"
            )
        template = cls(
            name or spec.rstrip("/").rsplit("/", 1)[-1], source, variables, list(stop), origin
        )
        _ = template.compiled  # a syntax error is reported now, with its line
        return template

    def to_meta(self) -> dict[str, Any]:
        return attrs.asdict(self)

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> ChatTemplate:
        return cls(**{f.name: meta[f.name] for f in attrs.fields(cls) if f.name in meta})

    @property
    def compiled(self) -> jinja2.Template:
        return _compile(self.source, self.origin)

    def render(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = False
    ) -> str:
        """The conversation as text; RenderError when the template refuses it."""
        import jinja2

        try:
            return self.compiled.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                **self.variables,
            )
        except RenderError as exc:  # the template's own raise_exception
            raise RenderError(f"the chat template ({self.origin}) refused it: {exc}") from None
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError) as exc:
            raise RenderError(f"the chat template ({self.origin}) failed: {exc}") from None

    def special_ids(self, tokenizer: Any) -> dict[str, int]:
        """The tokenizer's special tokens that the template writes (its text or variables): these
        become their ids; any other special-token text in a message stays plain text."""
        used = self.source + "".join(self.variables.values()) + "".join(self.stop)
        found = {}
        for token in getattr(tokenizer, "special_tokens", None) or []:
            if token and token in used:
                token_id = tokenizer.token_id(token)
                if token_id is not None:
                    found[token] = token_id
        return found

    def check_tokenizer(self, tokenizer: Any) -> list[int]:
        """The ids of the stop tokens; an error when the tokenizer lacks a token the template
        needs whole."""
        specials = self.special_ids(tokenizer)
        needed = list(self.stop) + (list(CHATML_TOKENS) if self.source == CHATML_SOURCE else [])
        missing = [t for t in dict.fromkeys(needed) if t not in specials]
        if missing:
            hint = (
                "for the bytes tokenizer pass --tokenizer-option "
                '\'special_tokens=["<|endoftext|>","<|pad|>","<|im_start|>","<|im_end|>"]\'; '
                "train-tokenizer takes --special-token"
            )
            raise TemplateError(
                f"the chat template {self.name} needs {', '.join(missing)} as special tokens "
                f"(one id each), but tokenizer {tokenizer.name} does not have "
                f"{'it' if len(missing) == 1 else 'them'}: {hint}; or choose a template "
                "written for this tokenizer"
            )
        return [specials[t] for t in self.stop]

    def plain_markers(self, tokenizer: Any) -> list[str]:
        """Special-token-looking text the template writes (`<|name|>`) that the tokenizer has no
        single id for: it will be tokenized as plain text (worth a warning)."""
        text = self.source + "".join(self.variables.values())
        specials = self.special_ids(tokenizer)
        return sorted({m for m in _MARKER.findall(text) if m not in specials})


def _read_text(url: str) -> str:
    from llmtrain.data_pack.tokenizer import read_bytes

    try:
        return read_bytes(url).decode("utf-8")
    except UnicodeDecodeError:
        raise TemplateError(f"{url}: not UTF-8 text") from None


def _read_json(url: str) -> dict[str, Any]:
    try:
        value = json.loads(_read_text(url))
    except json.JSONDecodeError as exc:
        raise TemplateError(f"{url}:{exc.lineno}: not valid JSON ({exc.msg})") from None
    if not isinstance(value, dict):
        raise TemplateError(f"{url}: not a JSON object")
    return value


def _variables(config: Mapping[str, Any]) -> dict[str, str]:
    found = {key: _token_text(config.get(key)) for key in TEMPLATE_VARIABLES}
    return {key: value for key, value in found.items() if value is not None}


def _from_directory(
    url: str, fs: Any, path: str, name: str | None
) -> tuple[str, str, dict[str, str]]:
    """(source, origin, variables) of a Hugging Face model directory's chat template."""

    def has(file: str) -> bool:
        return bool(fs.exists(f"{path.rstrip('/')}/{file}"))

    config_url = f"{url}/tokenizer_config.json"
    config = _read_json(config_url) if has("tokenizer_config.json") else {}
    variables = _variables(config)
    if name is not None and has(f"additional_chat_templates/{name}.jinja"):
        named = f"{url}/additional_chat_templates/{name}.jinja"
        return _read_text(named), named, variables
    if config.get("chat_template") is not None:
        source = _pick(config["chat_template"], config_url, name)
        return source, f"{config_url} (chat_template)", variables
    if has("chat_template.jinja"):
        return _read_text(f"{url}/chat_template.jinja"), f"{url}/chat_template.jinja", variables
    if has("chat_template.json"):
        text = _read_json(f"{url}/chat_template.json").get("chat_template")
        if not isinstance(text, str):
            raise TemplateError(f"{url}/chat_template.json: no chat_template text in it")
        return text, f"{url}/chat_template.json", variables
    raise TemplateError(
        f"{url}: no chat template in this directory (looked for chat_template in "
        "tokenizer_config.json, chat_template.jinja and chat_template.json); give a template "
        "file, or --template chatml"
    )


def _pick(value: Any, spec: str, name: str | None) -> str:
    """`chat_template` is one template, or a list of named ones (`default` unless `name`)."""
    if isinstance(value, str) and name is None:
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        chosen = named.get(name or "default")
        if isinstance(chosen, str):
            return chosen
        raise TemplateError(
            f"{spec}: no chat template named {name or 'default'!r}; it has "
            f"{', '.join(map(str, named)) or 'none'} (--template-name)"
        )
    if value is None:
        raise TemplateError(
            f"{spec}: no chat_template in it; give a tokenizer_config.json with one, a .jinja "
            "file, or --template chatml"
        )
    raise TemplateError(f"{spec}: chat_template is neither text nor a list of named templates")


def _raise(message: str) -> None:
    raise RenderError(message)


@functools.lru_cache(maxsize=8)
def _compile(source: str, origin: str) -> jinja2.Template:
    """A sandboxed Jinja template, with the conventions chat templates are written for
    (trimmed blocks, `raise_exception`, `tojson`, `strftime_now`)."""
    import datetime

    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda value, indent=None, **_: json.dumps(
        value, indent=indent, ensure_ascii=False
    )
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise TemplateError(f"{origin}: line {exc.lineno}: {exc.message}") from None


# -- conversations ---------------------------------------------------------------------------------


@attrs.frozen
class ChatSettings:
    """How `pack-chat` reads, renders, masks and fits conversations (plain data for workers)."""

    template: dict[str, Any]  # ChatTemplate.to_meta()
    seq_len: int
    messages_field: str = "messages"
    role_field: str = "role"
    content_field: str = "content"
    roles: tuple[str, ...] = DEFAULT_ROLES
    train_roles: tuple[str, ...] = (ASSISTANT,)
    too_long: Literal["skip", "truncate", "error"] = "skip"

    def __attrs_post_init__(self) -> None:
        if self.seq_len < 2:
            raise UserError(f"--seq-len {self.seq_len}: must be at least 2")
        if self.too_long not in ("skip", "truncate", "error"):
            raise UserError(f"--too-long {self.too_long!r}: use skip, truncate or error")
        unknown = [r for r in self.train_roles if r not in self.roles]
        if unknown or not self.train_roles:
            raise UserError(
                f"--train-roles {','.join(self.train_roles) or '(none)'}: each must be one of "
                f"the roles ({','.join(self.roles)})"
            )

    def to_meta(self) -> dict[str, Any]:
        meta = attrs.asdict(self)
        meta["roles"], meta["train_roles"] = list(self.roles), list(self.train_roles)
        return meta


def messages_of(record: Any, settings: ChatSettings) -> list[dict[str, Any]]:
    """The record's messages as `{role, content, ...}` dicts; RenderError on bad input."""
    from llmtrain.data_pack.sources import field_getter

    try:
        messages = field_getter(settings.messages_field)(record)
    except KeyError:
        raise RenderError(f"no field {settings.messages_field!r}") from None
    if not isinstance(messages, list) or not messages:
        what = "an empty list" if isinstance(messages, list) else type(messages).__name__
        raise RenderError(f"{settings.messages_field!r} is {what}, not a list of messages")
    out = []
    for number, message in enumerate(messages, 1):
        where = f"message {number}"
        if not isinstance(message, dict):
            raise RenderError(f"{where} is {type(message).__name__}, not an object")
        role = message.get(settings.role_field)
        content = message.get(settings.content_field)
        if not isinstance(role, str):
            raise RenderError(f"{where} has no {settings.role_field!r} string")
        if role not in settings.roles:
            raise RenderError(
                f"{where} has the unknown role {role!r} (roles: {', '.join(settings.roles)}; "
                "--roles sets them)"
            )
        if not isinstance(content, str):
            raise RenderError(f"{where} ({role}) has no {settings.content_field!r} string")
        if (bad := _SURROGATE.search(content)) is not None:
            raise RenderError(
                f"{where} has an unpaired surrogate \\u{ord(bad.group()):04x} in its content "
                "(not valid Unicode)"
            )
        if role in settings.train_roles and not content.strip():
            raise RenderError(f"{where} is an empty {role} turn")
        rest = {
            k: v
            for k, v in message.items()
            if k not in (settings.role_field, settings.content_field)
        }
        out.append({**rest, "role": role, "content": content})
    if not any(m["role"] in settings.train_roles for m in out):
        raise RenderError(
            f"no {'/'.join(settings.train_roles)} turn: nothing to train on (--train-roles)"
        )
    return out


def pieces(
    template: ChatTemplate, messages: Sequence[Mapping[str, Any]], train_roles: Sequence[str]
) -> list[tuple[str, bool]]:
    """The rendered conversation as (text, counts) pieces, in order. The pieces join to the
    whole rendering; see the module docstring for what counts."""
    before = _empty(template.source, tuple(sorted(template.variables.items())), template.origin)
    out: list[tuple[str, bool]] = [(before, False)] if before else []
    for i, message in enumerate(messages):
        whole = template.render(messages[: i + 1])
        if not whole.startswith(before):
            raise RenderError(
                f"the chat template renders the first {i} message(s) differently on their own "
                f"than followed by message {i + 1}, so it cannot say which tokens are whose "
                "(templates that rewrite earlier turns are not supported)"
            )
        counts = message["role"] in train_roles
        turn = whole[len(before) :]
        if counts and message["role"] == ASSISTANT:
            try:
                prompt = template.render(messages[:i], add_generation_prompt=True)
            except RenderError:
                prompt = before
            if prompt.startswith(before) and whole.startswith(prompt):
                header = prompt[len(before) :]
                out.append((header, False))
                turn = whole[len(prompt) :]
        end = max((turn.rfind(t) + len(t) for t in template.stop if t in turn), default=-1)
        if counts and end > 0:  # the turn counts up to its end-of-turn token, not what follows
            out.extend([(turn[:end], True), (turn[end:], False)])
        else:
            out.append((turn, counts))
        before = whole
    return [(text, counts) for text, counts in out if text]


@functools.lru_cache(maxsize=8)
def _empty(source: str, variables: tuple[tuple[str, str], ...], origin: str) -> str:
    """What a template writes before any message (the same for every conversation)."""
    try:
        return ChatTemplate("", source, dict(variables), [], origin).render([])
    except RenderError:
        return ""  # templates may refuse an empty conversation; the first turn carries it


class Encoder:
    """Text pieces to ids, with the template's special tokens as their ids: pieces of a batch
    are split at those tokens and the plain text goes through one `encode_batch` call."""

    def __init__(self, tokenizer: Any, template: ChatTemplate):
        self.tokenizer = tokenizer
        self.specials = template.special_ids(tokenizer)
        names = sorted(self.specials, key=len, reverse=True)
        self.split = re.compile("(" + "|".join(map(re.escape, names)) + ")") if names else None

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        parts: list[list[str]] = [
            [p for p in self.split.split(t) if p] if self.split else [t] for t in texts
        ]
        plain = [p for ps in parts for p in ps if p not in self.specials]
        encoded = iter(self.tokenizer.encode_batch(plain) if plain else [])
        out = []
        for ps in parts:
            ids: list[int] = []
            for p in ps:
                special = self.specials.get(p)
                if special is not None:
                    ids.append(special)
                else:
                    ids.extend(next(encoded))
            out.append(ids)
        return out


def tokenize_conversations(
    conversations: Sequence[list[tuple[str, bool]]], encoder: Encoder, eod_id: int
) -> list[tuple[np.ndarray, np.ndarray]]:
    """(ids with a final eod, mask) per conversation: mask[i] says token i is a counted target.
    The first token never counts (nothing precedes it in its conversation), nor the eod."""
    if not conversations:
        return []
    encoded = encoder.encode([text for conv in conversations for text, _ in conv])
    lengths = np.fromiter(map(len, encoded), np.int64, len(encoded))
    ids = np.fromiter(itertools.chain.from_iterable(encoded), np.int64, int(lengths.sum()))
    counts = np.fromiter((c for conv in conversations for _, c in conv), bool, len(encoded))
    mask = np.repeat(counts, lengths)
    pieces_per = np.fromiter(map(len, conversations), np.int64, len(conversations))
    piece_ends = np.cumsum(pieces_per)
    token_ends = np.concatenate([[0], np.cumsum(lengths)])[piece_ends]
    out = []
    start = 0
    for end in token_ends.tolist():
        conv_ids = np.append(ids[start:end], eod_id)
        conv_mask = np.append(mask[start:end], False)
        conv_mask[0] = False
        out.append((conv_ids, conv_mask))
        start = end
    return out


class BlockPacker:
    """Lays conversations (each with its eod, at most `block` tokens) into blocks of `block`
    tokens, none across a block boundary; a block's unused end is eod padding that counts for no
    loss, added to its last conversation. Each conversation goes to the open block it fills best
    (of at most `open_blocks`; when none has room and all are open, the fullest is written), so
    the order stays near the input order and depends only on it. The dataset ends with one more
    padding token, so its last block is a whole window (a window reads `seq_len + 1` tokens)."""

    def __init__(self, writer: Any, block: int, eod_id: int, open_blocks: int = 64):
        self.writer, self.block, self.eod = writer, block, eod_id
        self.open_blocks = open_blocks
        self.open: list[list[tuple[np.ndarray, np.ndarray]]] = []
        self.free: list[int] = []
        self.held: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self.padding = 0
        self.counted = 0

    def add(self, tokens: np.ndarray, lengths: np.ndarray, mask: np.ndarray) -> None:
        start = 0
        for length in lengths.tolist():
            self._place(tokens[start : start + length], mask[start : start + length])
            start += length

    def _place(self, tokens: np.ndarray, mask: np.ndarray) -> None:
        n = len(tokens)
        if not 0 < n <= self.block:
            raise ValueError(f"a conversation of {n} tokens does not fit a block of {self.block}")
        fits = [i for i, free in enumerate(self.free) if free >= n]
        if fits:
            i = min(fits, key=lambda i: self.free[i])
        else:
            if len(self.open) >= self.open_blocks:
                self._close(min(range(len(self.open)), key=lambda i: self.free[i]))
            self.open.append([])
            self.free.append(self.block)
            i = len(self.open) - 1
        self.open[i].append((tokens, mask))
        self.free[i] -= n
        self.counted += int(mask.sum())
        if self.free[i] == 0:
            self._close(i)

    def _close(self, i: int) -> None:
        docs, free = self.open.pop(i), self.free.pop(i)
        pad = free
        tokens = np.concatenate([t for t, _ in docs] + [np.full(pad, self.eod, np.int64)])
        mask = np.concatenate([m for _, m in docs] + [np.zeros(pad, bool)])
        lengths = np.asarray([len(t) for t, _ in docs], np.int64)
        lengths[-1] += pad
        self.padding += pad
        self._hold(tokens, lengths, mask)

    def _hold(self, tokens: np.ndarray, lengths: np.ndarray, mask: np.ndarray) -> None:
        """Keep the newest block back, so the final padding token can still join it."""
        if self.held is not None:
            self.writer.add(*self.held)
        self.held = (tokens, lengths, mask)

    def close(self) -> None:
        while self.open:
            self._close(0)
        if self.held is None:
            return
        tokens, lengths, mask = self.held
        self.held = None
        lengths = lengths.copy()
        lengths[-1] += 1
        self.padding += 1
        self.writer.add(np.append(tokens, self.eod), lengths, np.append(mask, False))
