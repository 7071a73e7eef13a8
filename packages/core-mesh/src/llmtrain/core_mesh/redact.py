"""Credentials never reach a log or a dump: one place that decides what looks secret.

- `redact(mapping)`: a copy with the values of secret-looking keys (`key`, `secret`, `token`,
  `password`, `aws_session_token`, `api_key`, `Authorization`, ... at any depth) replaced by
  `MARKER`, and credentials inside URLs masked. For what llmtrain writes: a run's config.yaml
  and the config its loggers get (TensorBoard's text, W&B's run config).
- `redact_text(text)`: secret-looking substrings of free text masked (AWS access key ids,
  `Authorization:` headers, `X-Amz-Security-Token`, `Credential=...`, `secret='...'`, URL
  passwords): for log messages and tracebacks, whose form nobody controls.
- `refuse_redacted(raw, source)`: a config read back that holds `MARKER` is an error, so a
  redacted value is never sent as a credential.

A key is secret-looking by its words (`aws_secret_access_key`, `SSECustomerKey` and
`X-Amz-Security-Token` split into words), not by substrings: `tokens`, `eod_token`,
`flops_per_token` and `loss_key` are ordinary names in a training framework and stay readable.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from typing import TypeVar

from llmtrain.core_mesh.errors import UserError

MARKER = "<redacted>"

_T = TypeVar("_T")
_K = TypeVar("_K")

# a word that makes any name secret (`client_secret`, `db_password`, `X-Amz-Credential`)
_SECRET_WORDS = frozenset(
    {
        "secret",
        "secrets",
        "password",
        "passwords",
        "passwd",
        "passphrase",
        "credential",
        "credentials",
        "authorization",
        "apikey",
        "cookie",
        "signature",
    }
)
# `key` and `token` name vocabulary and tokenizer ids too: secret alone, or after one of these
_AMBIGUOUS_WORDS = frozenset({"key", "token"})
_QUALIFIERS = frozenset(
    {
        "access",
        "secret",
        "session",
        "security",
        "api",
        "auth",
        "account",
        "private",
        "client",
        "customer",
        "sas",
        "bearer",
        "refresh",
        "oauth",
        "id",
        "master",
        "signing",
        "encryption",
        "storage",
        "sse",
        "hf",
        "github",
        "gh",
        "wandb",
        "subscription",
    }
)
_WHOLE_NAMES = frozenset({"connectionstring"})  # Azure's, with AccountKey= inside
_WORD = re.compile(r"[A-Z]+(?=[A-Z][a-z])|[A-Z]?[a-z]+|[A-Z]+|[0-9]+")


def _words(name: str) -> list[str]:
    return [w.lower() for w in _WORD.findall(name)]


def is_secret_key(name: object) -> bool:
    """Whether a key (a config option, a log field, a header, an environment variable) names a
    credential, by its words: case, `_`, `-` and camelCase do not matter."""
    if not isinstance(name, str):
        return False
    words = _words(name)
    if not words:
        return False
    if "".join(words) in _WHOLE_NAMES or any(w in _SECRET_WORDS for w in words):
        return True
    if words in (["key"], ["token"]) or words[-1] == "auth":  # `http_auth`, not `auth_type`
        return True
    return any(
        w in _AMBIGUOUS_WORDS and i > 0 and words[i - 1] in _QUALIFIERS for i, w in enumerate(words)
    )


def _is_header_secret(name: str) -> bool:
    """`Name: value` up to the end of the line is masked only for header-like names: a colon
    after a plain word is too common in messages (`missing key: x`)."""
    return is_secret_key(name) and ("-" in name or "authorization" in name.lower())


def _masked_value(is_secret: Callable[[str], bool]) -> Callable[[re.Match[str]], str]:
    """A `re.sub` callback: the match with its `value` group masked when its `name` group is
    secret-looking."""

    def replace(match: re.Match[str]) -> str:
        if not is_secret(match.group("name")):
            return match.group(0)
        text, offset = match.group(0), match.start(0)
        start, end = match.span("value")
        return text[: start - offset] + MARKER + text[end - offset :]

    return replace


# certain wherever they appear, so safe inside config values too
_STRONG = [
    # AWS access key ids (long-term AKIA, temporary ASIA, ...)
    (re.compile(r"\b(?:AKIA|ASIA|AIDA|AROA|AGPA|ANPA|ANVA|AIPA|ABIA|ACCA)[A-Z0-9]{16}\b"), MARKER),
    # a password in a URL: scheme://user:password@host
    (re.compile(r"(\b[A-Za-z][A-Za-z0-9+.\-]{0,30}://[^/\s:@'\"]+:)[^@\s/'\"]+@"), rf"\1{MARKER}@"),
]
# names are bounded: an unbounded one makes a long run of `a-b-c-...` quadratic to scan
_NAME = r"(?P<name>[A-Za-z][\w\-]{0,99})"
_QUERY = re.compile(r"[?&]" + _NAME + r"=(?P<value>[^&\s'\"#]+)")
# log messages: reprs of dicts, `name=value`, HTTP headers
_QUOTED_VALUE = r"b?(?P<v>['\"])(?P<value>(?:\\.|(?!(?P=v)).)*)(?P=v)"  # escapes included
_QUOTED_PAIR = re.compile(
    r"(?P<q>['\"])(?P<name>[A-Za-z][\w.\-]{0,99})(?P=q)\s*:\s*" + _QUOTED_VALUE
)
_QUOTED_ASSIGNMENT = re.compile(r"\b" + _NAME + "=" + _QUOTED_VALUE)
_ASSIGNMENT = re.compile(r"\b" + _NAME + r"=(?P<value>[^\s&,;'\")\]}<>]+)")
# only names with a secret-looking part start a match: `host: ...` must not swallow the line
_HEADER = re.compile(
    r"\b(?P<name>(?:[A-Za-z][\w\-]{0,50}?)?(?:authorization|token|credential|secret|key|cookie)"
    r"[\w\-]{0,50})"
    r":[ \t]*(?P<value>[^\s'\"][^\r\n'\"]*)",
    re.IGNORECASE,
)


def _redact_strong(text: str) -> str:
    for pattern, replacement in _STRONG:
        text = pattern.sub(replacement, text)
    return _QUERY.sub(_masked_value(is_secret_key), text)


def redact_text(text: str, known: Iterable[str] = (), *, assignments: bool = True) -> str:
    """`text` with secret-looking substrings, and each of the `known` secret values, masked.
    `assignments=False` leaves `name=value` and `Name: value` forms alone (messages written by
    llmtrain say `KEY=VALUE` as syntax): only the known values, key ids and URL credentials."""
    for value in known:
        if value in text:
            text = text.replace(value, MARKER)
    text = _redact_strong(text)
    if not assignments:
        return text
    text = _QUOTED_PAIR.sub(_masked_value(is_secret_key), text)
    text = _QUOTED_ASSIGNMENT.sub(_masked_value(is_secret_key), text)
    text = _ASSIGNMENT.sub(_masked_value(is_secret_key), text)
    return _HEADER.sub(_masked_value(_is_header_secret), text)


def _hides_something(value: object) -> bool:
    # None, true/false and "" say nothing about a credential, and keep `anon: true` readable
    return value is not None and not isinstance(value, bool) and value != ""


def _redacted_mapping(
    mapping: Mapping[_K, object], scrub: Callable[[str], str], *, as_text: bool = False
) -> dict[_K, object]:
    """`_redacted` of a mapping: a dict with the values of secret-looking keys masked."""
    return {
        k: MARKER
        if is_secret_key(k) and _hides_something(v)
        else _redacted(v, scrub, as_text=as_text)
        for k, v in mapping.items()
    }


def _redacted(value: object, scrub: Callable[[str], str], *, as_text: bool = False) -> object:
    """`value` with secrets masked. `as_text`: any other object (an exception, bytes, an attrs
    instance) becomes its scrubbed `str`, which is what a log renderer would print of it."""
    if isinstance(value, Mapping):
        return _redacted_mapping(value, scrub, as_text=as_text)
    if isinstance(value, list | tuple):
        sequence = type(value)  # taken before `len` narrows a tuple to a pair
        if len(value) == 2 and is_secret_key(value[0]) and _hides_something(value[1]):
            return sequence((value[0], MARKER))  # a (name, value) pair, as headers come
        return sequence(_redacted(v, scrub, as_text=as_text) for v in value)
    if isinstance(value, str):
        return scrub(value)
    if as_text and not isinstance(value, int | float | bool | type(None)):
        return scrub(value.decode(errors="replace") if isinstance(value, bytes) else str(value))
    return value


def redact(mapping: Mapping[str, object]) -> dict[str, object]:
    """A copy of `mapping` for writing out: values of secret-looking keys, at any depth, are
    `MARKER`; passwords in URLs, signed-URL credentials and AWS key ids in strings are masked.
    Other values are kept as they are, so a config without credentials dumps unchanged."""
    return _redacted_mapping(mapping, _redact_strong)


def redact_event(event: Mapping[str, object], known: Iterable[str] = ()) -> dict[str, object]:
    """A log event with secret-looking fields masked and every string scrubbed as free text."""
    known = tuple(known)
    return _redacted_mapping(event, lambda text: redact_text(text, known), as_text=True)


def secret_values(mapping: Mapping[_K, object], min_length: int = 8) -> set[str]:
    """The string values of secret-looking keys in `mapping`, at any depth, of at least
    `min_length` characters (shorter ones would mask ordinary words): what a log must never
    show, whatever form it is printed in."""
    found: set[str] = set()
    for key, value in mapping.items():
        if isinstance(value, Mapping):
            found |= secret_values(value, min_length)
        elif is_secret_key(key) and isinstance(value, str) and len(value) >= min_length:
            found.add(value)
    return found


# an environment variable named `..._TOKEN` or `..._KEY` holds a credential (HF_HUB_TOKEN,
# CI_JOB_TOKEN, OPENAI_API_KEY): in the environment these words are not vocabulary
_ENVIRONMENT_SECRET_ENDINGS = frozenset({"token", "key", "secret", "password"})


def environment_secrets(environ: Mapping[str, str], min_length: int = 8) -> set[str]:
    """The values of the environment's credential variables (see `secret_values`)."""
    return {
        value
        for name, value in environ.items()
        if len(value) >= min_length and _is_environment_secret(name)
    }


def _is_environment_secret(name: str) -> bool:
    words = _words(name)
    return is_secret_key(name) or (bool(words) and words[-1] in _ENVIRONMENT_SECRET_ENDINGS)


def redacted_paths(raw: object, path: str = "") -> list[str]:
    """The dotted paths of a parsed config whose values hold `MARKER`."""
    if isinstance(raw, Mapping):
        items = [(f"{path}.{k}" if path else str(k), v) for k, v in raw.items()]
    elif isinstance(raw, list):
        items = [(f"{path}[{i}]", v) for i, v in enumerate(raw)]
    else:
        return [path] if isinstance(raw, str) and MARKER in raw else []
    return [found for where, value in items for found in redacted_paths(value, where)]


def refuse_redacted(raw: _T, source: str) -> _T:
    """`raw` (a parsed config), unless it holds redacted values: those would be sent as
    credentials, so reading them back is an error that says what to do instead."""
    paths = redacted_paths(raw)
    if paths:
        raise UserError(
            f"{source}: {', '.join(paths)}: the credentials were redacted when this config was "
            "written; pass them through the environment (AWS_ACCESS_KEY_ID, "
            "AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN or AWS_PROFILE for S3) and delete these "
            "keys from the config"
        )
    return raw
