"""Shared test setup for the models package."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread():
    # the test models are tiny: threads buy nothing, and two OpenMP threads on a busy 2-core
    # machine run ~100x slower than one
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
