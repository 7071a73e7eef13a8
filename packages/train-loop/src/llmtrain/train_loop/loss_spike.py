"""The loss-spike monitor (callback kind `loss_spike`): a step whose loss exceeds `factor` x the
median of the recent losses is a spike. It is logged on every rank with what was in the batch
(the global sequence range of the data order, each data rank's own loss, each rank's sample
indices), marked in the step's metrics, and optionally stops the run. Judging every step reads
every step's loss on the host: a sync per step that runs without this callback do not make.

The judged loss is the run's (the same number on every rank), so every rank decides alike and
may gather at a spike. The window of recent losses and the spike count travel in checkpoints: a
resumed run judges exactly as an uninterrupted one. Loading this module imports no torch.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Any

import attrs
import structlog

from llmtrain.core_mesh.config import ConfigValueError
from llmtrain.core_mesh.interfaces import Callback, TrainingRun
from llmtrain.core_mesh.plugins import Register
from llmtrain.train_loop.run_config import _positive

log = structlog.get_logger("llmtrain.train")


def _above_one(instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if value <= 1:
        raise ValueError(f"must be more than 1, got {value}")


@attrs.frozen(kw_only=True)
class LossSpikeOptions:
    """A step whose loss is more than `factor` x the median of the last `window` non-spike
    steps is a spike; nothing is judged before `min_steps` losses are in the window. `stop`:
    a spike ends the run after its step (without saving; summary status `stopped`)."""

    factor: float = attrs.field(default=3.0, validator=_above_one)
    window: int = attrs.field(default=50, validator=_positive)
    min_steps: int = attrs.field(default=10, validator=_positive)
    stop: bool = False

    def __attrs_post_init__(self) -> None:
        if self.min_steps > self.window:
            raise ConfigValueError(
                "min_steps",
                f"must be at most window={self.window} (the window never holds more), "
                f"got {self.min_steps}",
            )


class LossSpikeMonitor(Callback):
    def __init__(self, options: LossSpikeOptions):
        self.options = options
        self.recent: deque[float] = deque(maxlen=options.window)
        self.spikes = 0

    # --- checkpointed state (plain data, the same on every rank) ---
    def state_dict(self) -> dict[str, Any]:
        return {"recent": list(self.recent), "spikes": self.spikes}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.recent = deque((float(x) for x in state["recent"]), maxlen=self.options.window)
        self.spikes = int(state["spikes"])

    # --- events ---
    def after_step(self, run: TrainingRun, step: int, metrics: dict[str, Any]) -> None:
        if "loss" not in metrics:
            return
        # judged at every step, so read at every step: the one host sync this monitor costs
        loss = float(metrics["loss"])
        if not math.isfinite(loss):
            return  # nothing counted, or non-finite: training.non_finite deals with those
        median = self.judge(loss)
        if median is None:
            return
        self.spikes += 1
        ratio = loss / median
        metrics["loss_spike"] = 1.0
        metrics["loss_spike_ratio"] = ratio
        what = (
            f"loss {loss:.4g} is {ratio:.2f} x the median {median:.4g} of the last "
            f"{len(self.recent)} steps"
        )
        self._report(run, step, loss, median, ratio, what)
        if self.options.stop:
            run.request_stop(f"loss spike at step {step}: {what} (callback loss_spike, stop: true)")

    def on_log(
        self, run: TrainingRun, step: int, metrics: dict[str, float], rank_metrics: dict[str, float]
    ) -> None:
        # a spike between logged steps shows in the metrics as this count going up
        metrics["loss_spikes"] = float(self.spikes)

    def judge(self, loss: float) -> float | None:
        """The median of the window when `loss` is a spike; else None, and the loss joins the
        window."""
        if len(self.recent) >= self.options.min_steps:
            median = statistics.median(self.recent)
            if median > 0 and loss > self.options.factor * median:
                return median
        self.recent.append(loss)
        return None

    # --- what was in the batch ---
    def _report(
        self, run: TrainingRun, step: int, loss: float, median: float, ratio: float, what: str
    ) -> None:
        """Every rank logs its own samples; rank 0 also the batch's place in the data order and
        each data rank's own loss (a gather: every rank gets here at the same step)."""
        from llmtrain.train_loop.observe import gather_floats  # imports torch

        model = run.model
        if run.last_local_loss is None:
            raise RuntimeError("loss_spike: a step was reported before any step's loss was kept")
        local_sum, local_count = run.last_local_loss
        count = float(local_count)
        mine = float(local_sum) / count if count else math.nan
        by_data_rank: dict[int, float] = {}
        for data_rank, rank_loss in gather_floats([float(model.data_rank), mine], run.device):
            by_data_rank.setdefault(int(data_rank), rank_loss)  # ranks sharing data share it
        rank_losses = [by_data_rank.get(r, math.nan) for r in range(model.data_world)]
        samples = [micro.tolist() for micro in run.plan.step(step - 1)]
        sampler = run.train_data.sampler
        fields: dict[str, Any] = {
            "step": step,
            "loss": loss,
            "ratio": ratio,
            "data_rank": model.data_rank,
            "samples": samples,
        }
        # which dataset and window each sample read
        sources, windows = sampler.lookup([s for micro in samples for s in micro])
        fields.update(sources=sources.tolist(), windows=windows.tolist())
        if run.world.is_main:
            start, end = (step - 1) * run.global_batch, step * run.global_batch
            finite = [r for r, x in enumerate(rank_losses) if math.isfinite(x)]
            highest = max(finite, key=lambda r: rank_losses[r]) if finite else None
            fields.update(
                median=median,
                sequences=[start, end],
                rank_losses=rank_losses,
                highest_data_rank=highest,
                message=f"step {step}: {what}; the batch is global sequences [{start}, {end}) "
                f"of the data order; data rank {highest} has the highest loss; each rank's "
                "log names its samples",
            )
            # passes over each dataset before this batch
            epochs = [int(e) for e in sampler.epochs_at(start)]
            fields["epoch"] = epochs[0] if len(epochs) == 1 else epochs
        log.warning("loss.spike", **fields)


def register_callbacks(register: Register) -> None:
    """train-loop's `llmtrain_callbacks` hook calls this."""
    register(
        "loss_spike",
        LossSpikeMonitor,
        options=LossSpikeOptions,
        help="warn (or stop) when a step's loss exceeds factor x the median of recent steps",
    )
