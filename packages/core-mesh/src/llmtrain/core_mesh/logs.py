"""Logging, set up once by the application; libraries only call `structlog.get_logger()`.

- Console (stderr): human-readable lines on rank 0; only warnings and errors on other ranks.
- File: JSON lines, one file per rank (`<log_dir>/rank<k>.jsonl`), everything from `file_level` up.
- Every event carries rank, world_size and run_id.
- stdlib loggers (torch's, fsspec's, ...) go through the same handlers and formats; third-party
  records only from `library_level` up (default WARNING, `$LLMTRAIN_LIBRARY_LOG_LEVEL`): the
  debug output of botocore and friends is most of a log and full of request headers.
- Credentials are masked in every event, on the console and in the file (`redact.py`).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import TextIO

import structlog
from structlog.typing import EventDict, Processor

from llmtrain.core_mesh.errors import UserError, no_space
from llmtrain.core_mesh.redact import environment_secrets, redact_event

_HANDLER_TAG = "_llmtrain"
LIBRARY_LEVEL_ENV = "LLMTRAIN_LIBRARY_LOG_LEVEL"
# our own stdlib loggers (plugins written the way a third party would) count as llmtrain's
_OUR_LOGGERS = ("llmtrain.", "llmtrain_")


def configure_logging(
    *,
    rank: int = 0,
    world_size: int = 1,
    run_id: str | None = None,
    log_dir: str | Path | None = None,
    level: str | int = "INFO",
    file_level: str | int = "DEBUG",
    console: TextIO | None = None,
    library_level: str | int | None = None,
    secrets: Iterable[str] = (),
) -> Path | None:
    """Route structlog and stdlib logging to the console and a per-rank JSON file.

    `library_level`: the lowest level of the records of other libraries' stdlib loggers that
    are kept (None: `$LLMTRAIN_LIBRARY_LOG_LEVEL`, else WARNING). `secrets`: values masked
    wherever they appear (a run's storage credentials), on top of anything that looks like a
    credential and the values of the environment's secret-looking variables.

    Calling it again replaces the previous set-up (so tests and repeated runs in one process work).
    Returns the JSON log file's path, if any.
    """
    static: dict[str, int | str] = {"rank": rank, "world_size": world_size}
    if run_id is not None:
        static["run_id"] = run_id

    def add_static(_: object, __: str, event: EventDict) -> EventDict:
        for key, value in static.items():
            event.setdefault(key, value)
        return event

    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        add_static,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    structlog.configure(
        processors=[
            *shared,
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )

    root = logging.getLogger()
    for handler in [h for h in root.handlers if getattr(h, _HANDLER_TAG, False)]:
        root.removeHandler(handler)
        handler.close()

    # tracebacks are text before redaction: a rendered traceback (rich's shows locals) would
    # bypass it
    redacted: list[Processor] = [
        structlog.stdlib.ProcessorFormatter.remove_processors_meta,
        structlog.processors.format_exc_info,
        _redactor(secrets),
    ]
    console_level = _level(level) if rank == 0 else max(_level(level), logging.WARNING)
    console_handler = logging.StreamHandler(console or sys.stderr)
    console_handler.setLevel(console_level)
    console_handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=shared,
            processors=[
                *redacted,
                _drop_keys(
                    "timestamp", "logger", "world_size", "run_id", *(("rank",) if rank == 0 else ())
                ),
                structlog.dev.ConsoleRenderer(colors=_is_tty(console or sys.stderr)),
            ],
        )
    )
    handlers: list[logging.Handler] = [console_handler]

    path = None
    if log_dir is not None:
        path = Path(log_dir) / f"rank{rank}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        file_handler = _RankLogFile(path, encoding="utf-8")
        file_handler.setLevel(_level(file_level))
        file_handler.setFormatter(
            structlog.stdlib.ProcessorFormatter(
                foreign_pre_chain=shared,
                processors=[*redacted, structlog.processors.JSONRenderer(default=str)],
            )
        )
        handlers.append(file_handler)

    libraries = _LibraryFilter(_library_level(library_level))
    for handler in handlers:
        setattr(handler, _HANDLER_TAG, True)
        handler.addFilter(libraries)
        root.addHandler(handler)
    root.setLevel(min(h.level for h in handlers))
    return path


class _RankLogFile(logging.FileHandler):
    """The rank's JSON log file. On a full disk it stops with one warning on stderr instead of
    a traceback for every record: the run goes on, and its next write that matters (a metric,
    a checkpoint) ends it with one line naming the file."""

    def __init__(self, path: Path, *, encoding: str):
        super().__init__(path, encoding=encoding)
        self.full = False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.full:
            super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:
        if no_space(sys.exc_info()[1] or Exception()) is None:
            super().handleError(record)
            return
        self.full = True
        print(
            f"warning: {self.baseFilename}: no space left on device; this log stops here",
            file=sys.stderr,
        )


# asyncio's complaints when a garbage-collected s3fs filesystem's aiohttp session was not
# closed in time: s3fs closes it from a finalizer that waits 0.1 s, which a loaded machine
# misses. Logged at ERROR though nothing failed and nobody can act on it, so kept at DEBUG.
_GC_NOISE = ("Unclosed client session", "Unclosed connector")


class _LibraryFilter(logging.Filter):
    """Keeps llmtrain's records (structlog's, and stdlib loggers named `llmtrain...`) and other
    libraries' records from `level` up (asyncio's unclosed-session notes only at DEBUG)."""

    def __init__(self, level: int):
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "asyncio" and str(record.msg).startswith(_GC_NOISE):
            return self.level <= logging.DEBUG
        return record.levelno >= self.level or _is_ours(record)


def _is_ours(record: logging.LogRecord) -> bool:
    from_structlog = hasattr(record, "_logger")  # set by structlog's `wrap_for_formatter`
    return from_structlog or record.name == "llmtrain" or record.name.startswith(_OUR_LOGGERS)


def _library_level(given: str | int | None) -> int:
    if given is not None:
        return _level(given)
    from_env = os.environ.get(LIBRARY_LEVEL_ENV, "").strip()
    try:
        return _level(from_env or "WARNING")
    except ValueError:
        raise UserError(
            f"{LIBRARY_LEVEL_ENV}={from_env!r}: unknown log level; use DEBUG, INFO, WARNING or "
            "ERROR"
        ) from None


def _redactor(secrets: Iterable[str]) -> Processor:
    # the longest first, so a value that contains another is masked whole
    known = sorted({*secrets, *environment_secrets(os.environ)}, key=len, reverse=True)

    def redact(_: object, __: str, event: EventDict) -> dict[str, object]:
        return redact_event(event, known)

    return redact


def _level(level: str | int) -> int:
    if isinstance(level, int):
        return level
    value = logging.getLevelName(level.upper())
    if not isinstance(value, int):
        raise ValueError(f"unknown log level {level!r}; use DEBUG, INFO, WARNING or ERROR")
    return value


def _drop_keys(*keys: str) -> Processor:
    def drop(_: object, __: str, event: EventDict) -> EventDict:
        for key in keys:
            event.pop(key, None)
        return event

    return drop


def _is_tty(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())
