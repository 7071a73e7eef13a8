"""Per-rank numbers gathered at log steps, and when each rank arrives at its collectives: the
rank the others wait for."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def gather_floats(
    values: list[float],
    device: torch.device,
    *,
    all_gather: Callable[[list[torch.Tensor], torch.Tensor], object] | None = None,
) -> list[list[float]]:
    """Every rank's `values` (same length on all ranks), in rank order."""
    import torch.distributed as dist

    mine = torch.tensor(values, dtype=torch.float64, device=device)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [values]
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    (all_gather or dist.all_gather)(out, mine)
    return [t.tolist() for t in out]


COLLECTIVES = (
    "all_gather_single",
    "reduce_scatter_single",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "all_to_all_single",
)


class CollectiveClock:
    """Times when this rank calls torch.distributed's collectives (FSDP's gathers and
    reduce-scatters, DDP's and the trainer's all-reduces), relative to the end of the last
    per-rank gather, which all ranks leave together. Every rank makes the same calls in the same
    order, so the rank whose arrival times sum highest is the one the others wait for:
    `lag(r) = sum_r - min over ranks`, in seconds per window. Costs a clock read per call."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.originals: dict[str, Callable[..., object]] = {}
        self.calls = 0
        self.total = 0.0
        self.origin = time.perf_counter()

    def install(self) -> None:
        """Wrap the collectives; the first window starts as every rank leaves a barrier."""
        if self.dist.is_initialized():
            self.dist.barrier()
        self.origin = time.perf_counter()
        for name in COLLECTIVES:
            original = getattr(self.dist, name, None)
            if original is None or name in self.originals:
                continue
            self.originals[name] = original
            setattr(self.dist, name, self._timed(original))

    def _timed(self, original: Callable[..., object]) -> Callable[..., object]:
        def timed(*args: object, **kwargs: object) -> object:
            self.calls += 1
            self.total += time.perf_counter() - self.origin
            return original(*args, **kwargs)

        timed.__wrapped__ = original  # type: ignore[attr-defined]
        return timed

    def gather(self, values: list[float], device: torch.device) -> list[list[float]]:
        """Every rank's `values` plus (calls, summed arrival) of this window, in rank order;
        then a new window starts, at the same moment on every rank."""
        mine = [*values, float(self.calls), self.total]
        out = gather_floats(mine, device, all_gather=self.originals.get("all_gather"))
        self.calls, self.total, self.origin = 0, 0.0, time.perf_counter()
        return out

    def remove(self) -> None:
        for name, original in self.originals.items():
            setattr(self.dist, name, original)
        self.originals.clear()


def arrival_lag(ranks: list[list[float]]) -> list[float] | None:
    """Seconds each rank arrived later than the earliest at this window's collectives, from
    `CollectiveClock.gather`'s rows; None when the ranks made different calls (pipelines)."""
    calls = {row[-2] for row in ranks}
    if len(calls) != 1 or not calls.pop():
        return None
    earliest = min(row[-1] for row in ranks)
    return [row[-1] - earliest for row in ranks]
