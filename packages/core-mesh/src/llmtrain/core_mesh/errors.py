"""The one exception type the CLI shows as a plain message: errors a person can fix.

Anything raised as a `UserError` (or a subclass) reaches the user as its message alone, with a
non-zero exit and no traceback; every other exception is a bug and keeps its traceback under
`--debug`.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class UserError(Exception):
    """Bad input: the message says what was wrong, where, and what to do."""


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """' (did you mean 'x'?)' for the closest known name, or '' when nothing is close."""
    close = difflib.get_close_matches(name, list(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
