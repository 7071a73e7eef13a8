"""Setup for every integration test: one torch thread in this process and one OpenMP thread in
every process a test starts (llmtrain runs, sweeps, workers), as torchrun gives its ranks."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from laptop_ladder import laptop  # noqa: F401
from shared_fixtures import one_torch_thread  # noqa: F401


@pytest.fixture(autouse=True, scope="session")
def one_thread_per_process() -> Iterator[None]:
    """The tests start runs side by side on a 2-core machine, where processes of two OpenMP
    threads each run far slower than processes of one (3 runs of 60 steps side by side: 50 s
    against 23 s). Every run a test compares starts under this setting."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
        yield
