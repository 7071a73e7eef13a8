"""The exponential moving average of the weights (callback kind `ema`).

From step `start` on, a float32 average of the trainable weights follows them: it starts equal
to the weights after step `start` and, every `every` steps t after it, moves
`average += (1 - decay**every) x (weights_t - average)`; `decay` is per step, so `every` changes
how often the average is updated, not the span it covers (about 1 / (1 - decay) steps). The
average is laid out like the weights at every layout (`averaged_weights.py`), is saved with each
checkpoint in its shards (`ema.weights.<name>`: `llmtrain export`, `hf export` and `eval-tasks`
take `--weights ema`) and restored on resume, so a resumed run's average equals an
uninterrupted one's. Where the run evaluates held-out data, the average is evaluated right
after the weights, on the same batches: `eval_loss` gets `eval/ema/loss`, `eval/<name>/loss`
gets `eval/ema/<name>/loss` (and likewise ppl, bpb). Loading this module imports no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs
import structlog

from llmtrain.core_mesh.interfaces import Callback, TrainingRun
from llmtrain.core_mesh.plugins import Register
from llmtrain.train_loop.run_config import _positive

if TYPE_CHECKING:
    from llmtrain.train_loop.averaged_weights import AveragedWeights

log = structlog.get_logger("llmtrain.train")


def _decay(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not 0 < value < 1:
        raise ValueError(f"must be between 0 and 1 (e.g. 0.999), got {value}")


def _step(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value < 0:
        raise ValueError(f"must be a step number of at least 0, got {value}")


@attrs.frozen(kw_only=True)
class EmaOptions:
    """`decay` per step; the average starts at the weights after step `start` (0: the initial
    weights) and is updated every `every` steps after it."""

    decay: float = attrs.field(default=0.999, validator=_decay)
    start: int = attrs.field(default=0, validator=_step)
    every: int = attrs.field(default=1, validator=_positive)


def ema_metric(name: str) -> str:
    """The metric of the average that stands beside the weights' `name`: `eval_loss` ->
    `eval/ema/loss`, `eval/<set>/loss` -> `eval/ema/<set>/loss`."""
    if name.startswith("eval_"):
        return f"eval/ema/{name.removeprefix('eval_')}"
    return f"eval/ema/{name.removeprefix('eval/')}"


class Ema(Callback):
    def __init__(self, options: EmaOptions):
        self.options = options
        self.since: int | None = None  # the step the average started at; None: not yet
        self._weights: AveragedWeights | None = None

    def _averages(self, run: TrainingRun) -> AveragedWeights:
        if self._weights is None:
            from llmtrain.train_loop.averaged_weights import AveragedWeights

            self._weights = AveragedWeights(run.model.parts)
        return self._weights

    # the step the average started at travels in llmtrain.json, the average in the shards
    def state_dict(self) -> dict[str, Any]:
        return {"since": self.since}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.since = state.get("since")

    def tensor_state(self, run: TrainingRun) -> AveragedWeights | None:
        """What the checkpoint saves in its shards (None: no average yet)."""
        return None if self.since is None else self._averages(run)

    def on_run_start(self, run: TrainingRun) -> None:
        if self.since is not None or run.step < self.options.start:
            return
        if run.step > self.options.start:  # resumed from a checkpoint saved without it
            log.warning(
                "ema.restarted",
                step=run.step,
                message=f"the checkpoint of step {run.step} holds no moving average (the ema "
                f"callback was added after it was saved): the average starts at step "
                f"{run.step}, not at start {self.options.start}",
            )
        self._begin(run)

    def _begin(self, run: TrainingRun) -> None:
        self._averages(run).reset()
        self.since = run.step

    def after_step(self, run: TrainingRun, step: int, metrics: Any) -> None:
        if self.since is None:
            if step == self.options.start:
                self._begin(run)
            return
        every = self.options.every
        if (step - self.since) % every == 0:
            self._averages(run).update(1 - self.options.decay**every)

    def after_eval(self, run: TrainingRun, step: int, metrics: Any) -> None:
        if self.since is None:
            return
        sets = run.config.data.eval_sets
        due = [i for i, evaluation in enumerate(sets) if evaluation.metric("loss") in metrics]
        with self._averages(run).swapped_in():
            values = run.evaluate(due)
        metrics.update({ema_metric(name): value for name, value in values.items()})


def register_callbacks(register: Register) -> None:
    """train-loop's `llmtrain_callbacks` hook calls this."""
    register(
        "ema",
        Ema,
        options=EmaOptions,
        help="a float32 moving average of the weights: saved in checkpoints, evaluated beside "
        "them (eval/ema/...), exported with --weights ema",
    )
