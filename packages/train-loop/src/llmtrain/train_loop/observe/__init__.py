"""What a run tells about itself while it runs, one module per concern: `memory` (memory per
rank, the allocator's snapshot on an out-of-memory), `stragglers` (per-rank numbers gathered at
log steps, arrival times at collectives), `profiler` (profiler windows), `watchdog` (the hang
watchdog), `determinism` (seeds and the determinism switch) and `flight_recorder` (NCCL's).
The trainer and the built-in callbacks use them through this package's names."""

from llmtrain.train_loop.observe.determinism import restore_determinism, seed_everything
from llmtrain.train_loop.observe.flight_recorder import flight_recorder_env
from llmtrain.train_loop.observe.memory import (
    dump_memory_snapshot,
    memory_mib,
    out_of_memory_error,
    start_memory_history,
)
from llmtrain.train_loop.observe.profiler import StepProfiler
from llmtrain.train_loop.observe.stragglers import (
    COLLECTIVES,
    CollectiveClock,
    arrival_lag,
    gather_floats,
)
from llmtrain.train_loop.observe.watchdog import Watchdog

__all__ = [
    "COLLECTIVES",
    "CollectiveClock",
    "StepProfiler",
    "Watchdog",
    "arrival_lag",
    "dump_memory_snapshot",
    "flight_recorder_env",
    "gather_floats",
    "memory_mib",
    "out_of_memory_error",
    "restore_determinism",
    "seed_everything",
    "start_memory_history",
]
