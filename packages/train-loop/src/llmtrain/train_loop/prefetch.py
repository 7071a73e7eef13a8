"""Reading the next step's batch while this one computes."""

from __future__ import annotations

import queue
import threading
from typing import Protocol

import numpy as np

from llmtrain.data_pack.sampling import BatchPlan


class Batches(Protocol):
    """What the prefetcher reads from: a batch of samples by index (data-pack's datasets)."""

    def read(self, samples: np.ndarray, /) -> dict[str, np.ndarray]: ...


class Prefetcher:
    """Reads the next step's batch in a background thread while this one computes."""

    def __init__(self, dataset: Batches, plan: BatchPlan, start_step: int, depth: int = 2):
        self.dataset, self.plan = dataset, plan
        self.queue: queue.Queue[tuple[int, dict[str, np.ndarray] | BaseException]] = queue.Queue(
            maxsize=depth
        )
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(start_step,), daemon=True)
        self.thread.start()

    def _run(self, step: int) -> None:
        while not self.stop.is_set():
            item: tuple[int, dict[str, np.ndarray] | BaseException]
            try:
                item = (step, self.dataset.read(np.concatenate(self.plan.step(step))))
            except Exception as exc:  # noqa: BLE001 - re-raised in the training thread
                item = (step, exc)
            while not self.stop.is_set():
                try:
                    self.queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            step += 1

    def next(self) -> tuple[int, dict[str, np.ndarray]]:
        step, batch = self.queue.get()
        if isinstance(batch, BaseException):
            raise batch
        return step, batch

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
