"""The one exception type the CLI shows as a plain message: errors a person can fix.

Anything raised as a `UserError` (or a subclass) reaches the user as its message alone, with a
non-zero exit and no traceback; every other exception is a bug and keeps its traceback under
`--debug`.
"""

from __future__ import annotations

import contextlib
import difflib
import errno
from collections.abc import Iterable, Iterator


class UserError(Exception):
    """Bad input: the message says what was wrong, where, and what to do."""


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """' (did you mean 'x'?)' for the closest known name, or '' when nothing is close."""
    close = difflib.get_close_matches(name, list(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


# a full disk, or the user's quota on it
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def no_space(exc: BaseException) -> OSError | None:
    """The out-of-space OSError behind `exc`, if that is what it comes down to: followed through
    causes, contexts and the per-rank `failures` of a distributed checkpoint's error."""
    pending: list[BaseException | None] = [exc]
    seen: set[int] = set()
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in _NO_SPACE:
            return current
        failures = getattr(current, "failures", None)
        if isinstance(failures, dict):
            pending.extend(f[0] if isinstance(f, tuple) else f for f in failures.values())
        pending.extend((current.__cause__, current.__context__))
    return None


def no_space_message(full: OSError) -> str:
    """The one line a full disk gets: which file could not be written, and what to do."""
    where = f" writing {full.filename}" if full.filename else ""
    return f"no space left on device{where}: free some space (or write elsewhere) and run again"


@contextlib.contextmanager
def naming_file(path: object) -> Iterator[None]:
    """OSErrors raised inside name `path` (a failed write() to an open file names none)."""
    try:
        yield
    except OSError as exc:
        if exc.filename is None:
            exc.filename = str(path)
        raise
