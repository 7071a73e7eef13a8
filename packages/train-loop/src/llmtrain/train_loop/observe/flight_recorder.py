"""NCCL's flight recorder: its environment, set before the process group starts."""

from __future__ import annotations

import os
from pathlib import Path

from llmtrain.train_loop.run_config import DebugConfig


def flight_recorder_env(debug: DebugConfig, log_dir: Path) -> None:
    """NCCL keeps a ring of recent collectives per rank and writes it out when a collective
    times out (`logs/nccl_trace_rank_<k>`); users' own settings win."""
    if not debug.flight_recorder:
        return
    os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", str(log_dir / "nccl_trace_rank_"))
