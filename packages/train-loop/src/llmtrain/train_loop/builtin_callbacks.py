"""The callbacks every run has, set by the config sections they always had (`debug.watchdog`,
`profile`, ...), in the order they run: summary, watchdog, profiler, throughput, stragglers.

They wrap the tools of the `observe` package; the loop itself knows none of them.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import structlog
import torch

from llmtrain.core_mesh.errors import naming_file
from llmtrain.core_mesh.interfaces import Callback, TrainingRun
from llmtrain.core_mesh.redact import redact_text
from llmtrain.train_loop import observe
from llmtrain.train_loop.callbacks import Named

# dense bf16 peak of the GPUs we know, for MFU (override with training.peak_tflops); a
# substring of the device name, the first match wins (so the PCIe and NVL H100s before H100)
PEAK_TFLOPS = {
    "H100 PCIe": 756.0,
    "H100 NVL": 835.0,
    "H100": 989.0,
    "H200": 989.0,
    "H800": 989.0,
    "A100": 312.0,
    "L40S": 362.0,
}
ORIGIN = "llmtrain-train-loop (built in)"

log = structlog.get_logger("llmtrain.train")


def builtin_callbacks(run: TrainingRun) -> list[Named]:
    callbacks = [
        ("summary", Summary()),
        ("watchdog", WatchdogCallback()),
        ("profiler", ProfilerCallback()),
        ("throughput", Throughput(run)),
    ]
    if run.world.world_size > 1:
        callbacks.append(("stragglers", Stragglers()))
    return [Named(key, callback, ORIGIN) for key, callback in callbacks]


# the space `summary.json` is written into, taken when the run starts: a run that fills its
# disk still says how it ended
SUMMARY_RESERVE_BYTES = 16 << 10


class Summary(Callback):
    """`summary.json` beside the metrics, written by rank 0 when the run ends (finished,
    stopped, failed or interrupted); absent while the run runs (sweeps skip finished runs).

    Its space is taken when the run starts (`summary.json.tmp`, filled with blanks), and the
    summary is written over it: on a disk the run has filled, the run still records how it
    ended. A failed run whose summary cannot be written anyway says so in one warning line;
    the run's own error is what ends it.

    `eval` holds the last value of each held-out metric (`eval_loss`, `eval/<name>/loss`, ...),
    carried by checkpoints so that a resumed run still reports the ones evaluated before."""

    def __init__(self) -> None:
        self.last_eval: dict[str, float] = {}

    def on_log(
        self,
        run: TrainingRun,
        step: int,
        metrics: dict[str, float],
        rank_metrics: dict[str, float],
    ) -> None:
        # at the logged step, not after_eval: callbacks after this one add held-out metrics
        # of their own (the ema callback's eval/ema/...), and a step that evaluates is logged
        self.last_eval.update(
            (name, float(value))
            for name, value in metrics.items()
            if name.startswith(("eval_", "eval/"))
        )

    def state_dict(self) -> dict[str, Any]:
        return {"eval": dict(self.last_eval)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_eval = {str(k): float(v) for k, v in state.get("eval", {}).items()}

    def on_run_start(self, run: TrainingRun) -> None:
        if run.world.is_main:
            (run.run_dir / "summary.json").unlink(missing_ok=True)
            _reserve(run.run_dir / "summary.json.tmp", SUMMARY_RESERVE_BYTES)

    def on_run_end(self, run: TrainingRun, status: str) -> None:
        self._write(run, status)

    def on_failure(self, run: TrainingRun, error: BaseException) -> None:
        status = "interrupted" if isinstance(error, KeyboardInterrupt) else "failed"
        # errors echo what they were given (a signed URL, a client's arguments)
        text = redact_text(f"{type(error).__name__}: {error}", getattr(run, "secrets", ()))
        try:
            self._write(run, status, error=text)
        except OSError as exc:  # the run's own error matters more: one line, no traceback
            log.warning(
                "summary.not_written",
                message=f"{run.run_dir / 'summary.json'} could not be written: "
                f"{exc.strerror or exc}",
            )

    def _write(self, run: TrainingRun, status: str, error: str | None = None) -> None:
        if not run.world.is_main:
            return
        step = int(run.counters["step"])  # applied steps (a rejected non-finite one is not)
        summary = {
            "status": status,
            "step": step,
            "total_steps": run.total_steps,
            "tokens": step * run.global_batch * run.config.data.seq_len,
            "wall_time_s": round(float(run.counters["elapsed_s"]), 3),
            "world_size": run.world.world_size,
            "error": error,
            # what scaling-law fits (`llmtrain fit`) read: N with and without embeddings, C/D
            "params": run.description.n_params,
            "non_embedding_params": run.description.n_non_embedding_params,
            "flops_per_token": run.description.flops_per_token(run.config.data.seq_len),
            # which way each logged metric improves, for `compare` and `report` to rank by
            "better": dict(sorted(run.metric_directions.items())),
            "eval": dict(sorted(self.last_eval.items())),
        }
        data = (json.dumps(summary, indent=1) + "\n").encode()
        tmp = run.run_dir / "summary.json.tmp"
        try:
            with naming_file(run.run_dir / "summary.json"):
                run.run_dir.mkdir(parents=True, exist_ok=True)
                if tmp.is_file() and tmp.stat().st_size >= len(data):
                    with tmp.open("r+b") as f:  # over the reserved space: no new blocks needed
                        f.write(data)
                        f.truncate()
                else:
                    tmp.write_bytes(data)
        except OSError:
            tmp.unlink(missing_ok=True)  # a full disk: no half-written summary left behind
            raise
        tmp.replace(run.run_dir / "summary.json")


def _reserve(path: Path, size: int) -> None:
    """Take `size` bytes of disk at `path` (best effort: a disk already full gets none)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("wb") as f:
            f.write(b" " * size)
    except OSError:
        path.unlink(missing_ok=True)


class ClosedAtTheEnd(Callback):
    """Closes what it opened when the run ends, however it ends."""

    def on_run_end(self, run: TrainingRun, status: str) -> None:
        self.close()

    def on_failure(self, run: TrainingRun, error: BaseException) -> None:
        self.close()

    def close(self) -> None:
        raise NotImplementedError


class WatchdogCallback(ClosedAtTheEnd):
    """The hang watchdog (`debug.watchdog`) times each step, evaluation and save."""

    watchdog: observe.Watchdog | None = None

    def on_run_start(self, run: TrainingRun) -> None:
        self.watchdog = observe.Watchdog(
            run.config.debug.watchdog, run.run_dir / "logs", run.world.rank
        )

    def _started(self) -> observe.Watchdog:
        if self.watchdog is None:
            raise RuntimeError("the watchdog callback got a step or eval event before on_run_start")
        return self.watchdog

    def before_step(self, run: TrainingRun, step: int) -> None:
        self._started().start("step", step)

    def after_step(self, run: TrainingRun, step: int, metrics: dict[str, Any]) -> None:
        self._started().end()

    def before_eval(self, run: TrainingRun, step: int) -> None:
        self._started().start("eval", step)

    def after_eval(self, run: TrainingRun, step: int, metrics: dict[str, float]) -> None:
        self._started().end()

    def before_save(self, run: TrainingRun, step: int) -> None:
        if self.watchdog is not None:  # the save of a run that never started its loop
            self.watchdog.start("save", step)

    def after_save(self, run: TrainingRun, step: int) -> None:
        if self.watchdog is not None:
            self.watchdog.end()

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.end()
            self.watchdog.close()
            self.watchdog = None


class ProfilerCallback(ClosedAtTheEnd):
    """torch.profiler windows (`profile:`), one trace per rank and window."""

    profiler: observe.StepProfiler | None = None

    def on_run_start(self, run: TrainingRun) -> None:
        self.profiler = observe.StepProfiler(
            run.config.profile, run.run_dir, run.world.rank, run.device
        )

    def _started(self) -> observe.StepProfiler:
        if self.profiler is None:
            raise RuntimeError("the profiler callback got a step event before on_run_start")
        return self.profiler

    def before_step(self, run: TrainingRun, step: int) -> None:
        self._started().before_step(step, run.total_steps)

    def after_step(self, run: TrainingRun, step: int, metrics: dict[str, Any]) -> None:
        self._started().after_step()

    def close(self) -> None:
        if self.profiler is not None:
            self.profiler.close()


class Throughput(Callback):
    """Per logging window: tokens/s, step time, the shares of time spent waiting for data and
    at the step's first collective, memory, and MFU where the peak FLOP rate is known."""

    def __init__(self, run: TrainingRun):
        self.tokens_per_step = run.global_batch * run.config.data.seq_len
        self.flops_per_token = run.description.flops_per_token(run.config.data.seq_len)
        self.peak_flops = peak_flops(run.config.training.peak_tflops, run.device)
        self.world_size = run.world.world_size

    def on_run_start(self, run: TrainingRun) -> None:
        self._new_window(run, time.perf_counter())

    def after_step(self, run: TrainingRun, step: int, metrics: dict[str, Any]) -> None:
        self.steps += 1

    def on_log(
        self, run: TrainingRun, step: int, metrics: dict[str, float], rank_metrics: dict[str, float]
    ) -> None:
        now = time.perf_counter()
        elapsed = max(now - self.started, 1e-9)
        tokens_per_s = self.steps * self.tokens_per_step / elapsed
        metrics.update(
            tokens_per_s=tokens_per_s,
            step_time_s=elapsed / max(self.steps, 1),
            data_wait=(run.data_wait_s - self.data_wait_s) / elapsed,
            sync_wait=(run.sync_wait_s - self.sync_wait_s) / elapsed,
            **observe.memory_mib(run.device),
        )
        if self.peak_flops:
            metrics["mfu"] = (
                tokens_per_s * self.flops_per_token / (self.peak_flops * self.world_size)
            )
        self._new_window(run, now)

    def _new_window(self, run: TrainingRun, now: float) -> None:
        self.started, self.steps = now, 0
        self.data_wait_s, self.sync_wait_s = run.data_wait_s, run.sync_wait_s


def peak_flops(peak_tflops: float | None, device: torch.device) -> float | None:
    """The device's dense bf16 FLOP/s: `training.peak_tflops`, or known from the GPU's name."""
    if peak_tflops is not None:
        return peak_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, tflops in PEAK_TFLOPS.items():
        if key in name:
            return tflops * 1e12
    return None


class Stragglers(ClosedAtTheEnd):
    """With several ranks: at each logged step the run's metrics get the worst rank's data
    wait (`data_wait_max`) and peak memory, and `slowest_rank`; each rank's own log line gets
    its `arrival_lag` (the share of the window the others waited for it at collectives)."""

    clock: observe.CollectiveClock | None = None

    def on_run_start(self, run: TrainingRun) -> None:
        self.clock = observe.CollectiveClock()
        self.clock.install()
        self.started = time.perf_counter()

    def on_log(
        self, run: TrainingRun, step: int, metrics: dict[str, float], rank_metrics: dict[str, float]
    ) -> None:
        now = time.perf_counter()
        elapsed = max(now - self.started, 1e-9)
        self.started = now
        if self.clock is None:
            raise RuntimeError("the stragglers callback got on_log before on_run_start")
        keys = ("data_wait", "sync_wait", "peak_memory_mib")
        ranks = self.clock.gather([metrics[k] for k in keys], run.device)
        lag = observe.arrival_lag(ranks)
        if lag is not None:
            rank_metrics["arrival_lag"] = lag[run.world.rank] / elapsed
            slowest = max(range(len(ranks)), key=lambda r: lag[r])
        else:  # different collectives per rank (pipeline stages): the one that waits least
            slowest = min(range(len(ranks)), key=lambda r: ranks[r][1])
        rank_metrics["peak_memory_mib"] = metrics["peak_memory_mib"]
        metrics["slowest_rank"] = slowest
        metrics["data_wait_max"] = max(r[0] for r in ranks)
        metrics["peak_memory_mib"] = max(r[2] for r in ranks)

    def close(self) -> None:
        if self.clock is not None:
            self.clock.remove()
            self.clock = None
