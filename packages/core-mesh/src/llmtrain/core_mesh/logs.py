"""Logging, set up once by the application; libraries only call `structlog.get_logger()`.

- Console (stderr): human-readable lines on rank 0; only warnings and errors on other ranks.
- File: JSON lines, one file per rank (`<log_dir>/rank<k>.jsonl`), everything from `file_level` up.
- Every event carries rank, world_size and run_id.
- stdlib loggers (torch's, fsspec's, ...) go through the same handlers and formats.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any, TextIO

import structlog

_HANDLER_TAG = "_llmtrain"


def configure_logging(
    *,
    rank: int = 0,
    world_size: int = 1,
    run_id: str | None = None,
    log_dir: str | Path | None = None,
    level: str | int = "INFO",
    file_level: str | int = "DEBUG",
    console: TextIO | None = None,
) -> Path | None:
    """Route structlog and stdlib logging to the console and a per-rank JSON file.

    Calling it again replaces the previous set-up (so tests and repeated runs in one process work).
    Returns the JSON log file's path, if any.
    """
    static = {"rank": rank, "world_size": world_size}
    if run_id is not None:
        static["run_id"] = run_id

    def add_static(_: Any, __: str, event: dict[str, Any]) -> dict[str, Any]:
        for key, value in static.items():
            event.setdefault(key, value)
        return event

    shared = [
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

    console_level = _level(level) if rank == 0 else max(_level(level), logging.WARNING)
    console_handler = logging.StreamHandler(console or sys.stderr)
    console_handler.setLevel(console_level)
    console_handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=shared,
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
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
        file_handler = logging.FileHandler(path, encoding="utf-8")
        file_handler.setLevel(_level(file_level))
        file_handler.setFormatter(
            structlog.stdlib.ProcessorFormatter(
                foreign_pre_chain=shared,
                processors=[
                    structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    structlog.processors.format_exc_info,
                    structlog.processors.JSONRenderer(default=str),
                ],
            )
        )
        handlers.append(file_handler)

    for handler in handlers:
        setattr(handler, _HANDLER_TAG, True)
        root.addHandler(handler)
    root.setLevel(min(h.level for h in handlers))
    return path


def _level(level: str | int) -> int:
    if isinstance(level, int):
        return level
    value = logging.getLevelName(level.upper())
    if not isinstance(value, int):
        raise ValueError(f"unknown log level {level!r}; use DEBUG, INFO, WARNING or ERROR")
    return value


def _drop_keys(*keys: str) -> Any:
    def drop(_: Any, __: str, event: dict[str, Any]) -> dict[str, Any]:
        for key in keys:
            event.pop(key, None)
        return event

    return drop


def _is_tty(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())
