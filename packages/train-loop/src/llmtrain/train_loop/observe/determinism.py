"""Seeding every generator and the determinism switch (before any CUDA work)."""

from __future__ import annotations

import os
import random

import numpy as np
import structlog
import torch

from llmtrain.train_loop.run_config import DebugConfig

log = structlog.get_logger("llmtrain.train_loop")


def seed_everything(seed: int, debug: DebugConfig) -> bool:
    """Seed Python, NumPy and torch; with `debug.deterministic` switch torch to deterministic
    algorithms. Returns the switch's previous state (for `restore_determinism`)."""
    previous = torch.are_deterministic_algorithms_enabled()
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if debug.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        log.info("debug.deterministic", message="deterministic algorithms on; every seed set")
    return previous


def restore_determinism(previous: bool) -> None:
    """Put the process-wide switch back (a program that runs several trainers in turn)."""
    if torch.are_deterministic_algorithms_enabled() != previous:
        torch.use_deterministic_algorithms(previous)
