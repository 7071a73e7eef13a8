"""The hang watchdog: every thread's stack written out when an activity runs past its limit."""

from __future__ import annotations

import faulthandler
import statistics
import threading
import time
from collections import deque
from pathlib import Path

import structlog

from llmtrain.train_loop.run_config import WatchdogConfig

log = structlog.get_logger("llmtrain.train_loop")


class Watchdog:
    """A thread that watches the current activity (a step, an eval, a save). One that runs past
    its limit gets every thread's Python stack written to `logs/stacks-rank<k>.txt` (faulthandler)
    and an error line in the rank's JSON log naming the file. Each activity is reported once."""

    def __init__(self, config: WatchdogConfig, log_dir: Path, rank: int):
        self.config = config
        self.file = log_dir / f"stacks-rank{rank}.txt"
        self.rank = rank
        self.recent: deque[float] = deque(maxlen=50)
        self.lock = threading.Lock()
        self.current: tuple[str, int, float, float] | None = None  # what, step, start, limit
        self.reported = False
        self.stalls = 0
        self.stop_event = threading.Event()
        self.thread = None
        if config.enabled:
            self.thread = threading.Thread(target=self._run, name="llmtrain-watchdog", daemon=True)
            self.thread.start()

    def limit(self, what: str) -> float:
        c = self.config
        if what != "step" or len(self.recent) < c.warmup_steps:
            return c.startup_seconds
        return max(c.min_seconds, c.multiple * statistics.median(self.recent))

    def start(self, what: str, step: int) -> None:
        with self.lock:
            self.current = (what, step, time.monotonic(), self.limit(what))
            self.reported = False

    def end(self) -> None:
        with self.lock:
            if self.current is not None and self.current[0] == "step":
                self.recent.append(time.monotonic() - self.current[2])
            self.current = None

    def _run(self) -> None:
        while not self.stop_event.wait(0.25):
            with self.lock:
                if self.current is None or self.reported:
                    continue
                what, step, start, limit = self.current
                elapsed = time.monotonic() - start
                if elapsed <= limit:
                    continue
                self.reported = True
                self.stalls += 1
            self._report(what, step, elapsed, limit)

    def _report(self, what: str, step: int, elapsed: float, limit: float) -> None:
        self.file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.file, "a") as f:
            f.write(
                f"=== rank {self.rank}: step {step} ({what}) running for {elapsed:.1f} s "
                f"(limit {limit:.1f} s) at {time.strftime('%Y-%m-%d %H:%M:%S')} ===\n"
            )
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
            f.write("\n")
        median = statistics.median(self.recent) if self.recent else None
        log.error(
            "watchdog.stall",
            message=f"rank {self.rank}: {what} of step {step} has run {elapsed:.1f} s, over its "
            f"limit of {limit:.1f} s; every thread's stack is in {self.file}",
            step=step,
            activity=what,
            seconds=round(elapsed, 3),
            limit_s=round(limit, 3),
            median_step_s=None if median is None else round(median, 6),
            stacks=str(self.file),
        )

    def close(self) -> None:
        self.stop_event.set()
        if self.thread is not None:
            self.thread.join(timeout=2)
