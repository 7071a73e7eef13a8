"""How the long data commands (pack, pack-chat, train-tokenizer) report progress over their input
bytes: a bar on stderr when it is a terminal; otherwise, for a batch job's log, a log line every
so often; or nothing."""

from __future__ import annotations

import sys
import time
from typing import Any

import attrs
import structlog

log = structlog.get_logger("llmtrain.data_pack")

LOG_EVERY_SECONDS = 30.0


@attrs.frozen
class ProgressSettings:
    """`bar`: a tqdm bar on stderr; `log_every`: seconds between progress log lines (None: no
    lines). The default reports nothing."""

    bar: bool = False
    log_every: float | None = None

    @classmethod
    def for_stderr(cls, enabled: bool, log_every: float = LOG_EVERY_SECONDS) -> ProgressSettings:
        """A bar when stderr is a terminal, log lines when it is not, nothing when not enabled."""
        if not enabled:
            return cls()
        isatty = getattr(sys.stderr, "isatty", None)
        if isatty is not None and isatty():
            return cls(bar=True)
        return cls(log_every=log_every)


class Progress:
    """Progress over `total` input bytes. `update(n_bytes, **counts)` adds bytes done and sets the
    counts so far (shown beside the bar, or logged as event `event` with `bytes_done` and
    `bytes_total`)."""

    def __init__(self, settings: ProgressSettings, total: int, *, event: str, desc: str):
        from tqdm import tqdm

        self.settings, self.total, self.event = settings, total, event
        self.done = 0
        self.last_log = time.monotonic()
        self.bar = tqdm(
            total=total,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            disable=not settings.bar,
            desc=desc,
            dynamic_ncols=True,
        )

    def update(self, n_bytes: int, **counts: Any) -> None:
        self.done += n_bytes
        self.bar.update(n_bytes)
        self.bar.set_postfix(counts, refresh=False)
        every = self.settings.log_every
        if every is not None and time.monotonic() - self.last_log >= every:
            self.last_log = time.monotonic()
            log.info(self.event, bytes_done=self.done, bytes_total=self.total, **counts)

    def reset(self) -> None:
        """Start again from nothing (a pack that restarts with another encoder)."""
        self.done = 0
        self.bar.reset()

    def close(self) -> None:
        self.bar.close()
