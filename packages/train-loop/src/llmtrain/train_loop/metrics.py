"""A step's metrics, kept on the device until a logged step reads them all at once.

Reading a device tensor on the host (`.item()`, `float(x)`, `.tolist()`) waits for every kernel
queued before it, so a step that reads a number stalls the GPU's queue. The step's values (the
loss, the gradient norm, the objective's and callbacks' numbers) are recorded here as they are
computed; a step that is not logged drops them unread, and a logged step reduces them over the
data ranks (one collective per kind of reduction) and reads them with one host sync.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from llmtrain.core_mesh.interfaces import REDUCTIONS, Better, Reduce
from llmtrain.core_mesh.metric_names import better_of

# reduce(values, op) -> the values (a float64 vector) combined over the data ranks with `op`
# ("sum" or "max")
Combine = Callable[[torch.Tensor, str], torch.Tensor]


class StepMetrics(dict[str, Any]):
    """One step's record: name -> a number or a one-element device tensor, with how each
    recorded tensor reduces over the data ranks (absent: it is the run's value already)."""

    def __init__(self) -> None:
        super().__init__()
        self.reductions: dict[str, Reduce] = {}


class MetricRecorder:
    """`record(name, value, reduce=..., better=...)` for the current step (the run's
    `record_metric`); `read(step_metrics)` at a logged step. `combine` reduces over the data
    ranks; `data_world` is their number (the mean divides the sum by it)."""

    def __init__(self, combine: Combine, data_world: int):
        self.combine = combine
        self.data_world = data_world
        self.current = StepMetrics()
        # which way each metric recorded so far improves, for summary.json
        self.directions: dict[str, str] = {}

    def new_step(self) -> StepMetrics:
        self.current = StepMetrics()
        return self.current

    def record(
        self, name: str, value: Any, /, *, reduce: Reduce = "mean", better: Better = None
    ) -> None:
        if reduce not in REDUCTIONS:
            raise ValueError(
                f"record_metric({name!r}): reduce must be one of "
                f"{', '.join(map(repr, REDUCTIONS))}, got {reduce!r}"
            )
        if better not in ("higher", "lower", None):
            raise ValueError(
                f"record_metric({name!r}): better must be 'higher', 'lower' or None, got {better!r}"
            )
        if isinstance(value, torch.Tensor) and value.numel() != 1:
            raise ValueError(
                f"record_metric({name!r}): a metric is one number, got a tensor of shape "
                f"{tuple(value.shape)}"
            )
        self.current[name] = value
        self.current.reductions[name] = reduce
        self.directions[name] = better or self.directions.get(name) or better_of(name)

    def seen(self, names: Iterable[str]) -> None:
        """Logged names recorded without a direction get the rule's (`better_of`)."""
        for name in names:
            self.directions.setdefault(name, better_of(name))

    def read(
        self, metrics: Mapping[str, Any], extra: Mapping[str, torch.Tensor] | None = None
    ) -> dict[str, Any]:
        """Every value of `metrics` as a number: its tensors reduced as recorded (a tensor
        `metrics` got another way is the run's value), then read with one host sync, in which
        `extra` (the run's values, not reduced) is read too."""
        reductions = getattr(metrics, "reductions", {})
        metrics = {**metrics, **(extra or {})}
        numbers: dict[str, Any] = {}
        groups: dict[Reduce, list[tuple[str, torch.Tensor]]] = {}
        for name, value in metrics.items():
            if isinstance(value, torch.Tensor):
                groups.setdefault(reductions.get(name), []).append((name, value))
            else:
                numbers[name] = value
        names: list[str] = []
        parts: list[torch.Tensor] = []
        for reduce, entries in groups.items():
            names += [name for name, _ in entries]
            parts.append(self._reduced(reduce, [value for _, value in entries]))
        if parts:
            # the one host sync of a logged step
            values = torch.cat(parts).tolist()
            numbers.update(zip(names, values, strict=True))
        return {name: numbers[name] for name in metrics}

    def _reduced(self, reduce: Reduce, values: list[torch.Tensor]) -> torch.Tensor:
        # float64 holds every float32 and every count below 2**53 exactly
        device = values[0].device
        stacked = torch.stack([v.detach().reshape(()).to(device, torch.float64) for v in values])
        if reduce is None or self.data_world == 1:
            return stacked
        combined = self.combine(stacked, "max" if reduce == "max" else "sum")
        return combined / self.data_world if reduce == "mean" else combined


def combine_over(group: Any) -> Combine:
    """`Combine` over a process group (None: one data rank, nothing to combine)."""

    def combine(values: torch.Tensor, op: str) -> torch.Tensor:
        if group is None:
            return values
        values = values.clone()
        kind = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
        dist.all_reduce(values, op=kind, group=group)
        return values

    return combine
