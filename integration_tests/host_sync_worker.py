"""Trains a run config (argv[1]) in this process, or as one rank of torchrun, counting the
calls llmtrain's own code makes that read a tensor on the host (`HOST_READS`), by the step they
happen in; writes them to argv[2] (with `.rank<N>` appended under torchrun) as JSON:
{"logged": [...], "inside": {step: [callers]}, "after": {step: [callers]}}. Each step also
records `probe/steps` (the step number, summed over the data ranks) with `record_metric`.

`inside` holds the calls between a step's `before_step` and `after_step` (the step itself);
`after` the calls between `after_step` and the next step (the logging, saving and stop votes).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

from llmtrain.core_mesh.interfaces import Callback
from llmtrain.core_mesh.plugins import PluginManager
from llmtrain.core_mesh.world import World
from llmtrain.train_loop.callbacks import Callbacks, Named
from llmtrain.train_loop.model_source import load_run_config
from llmtrain.train_loop.trainer import Trainer

# what reads a tensor's value on the host: on a GPU each waits for the queue of kernels
HOST_READS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.__float__,
    torch.Tensor.__int__,
    torch.Tensor.__bool__,
    torch.Tensor.cpu,
    torch.Tensor.numpy,
}


# torch's dispatch of a Tensor method to the mode: between the caller and the mode
DISPATCH = (
    str(Path(torch.__file__).parent / "overrides.py"),
    str(Path(torch.__file__).parent / "_tensor.py"),
)


def our_caller() -> str | None:
    """'file:line function' of the code that called the tensor method, when it is llmtrain's
    (torch's own calls, e.g. its optimizers reading their step counters, are not ours)."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if frame.filename.startswith(DISPATCH) or frame.filename == __file__:
            continue
        ours = "/llmtrain/" in frame.filename or "/llmtrain_" in frame.filename
        return f"{Path(frame.filename).name}:{frame.lineno} {frame.name}" if ours else None
    return None


class Counter(TorchFunctionMode, Callback):
    def __init__(self) -> None:
        super().__init__()
        self.phase: tuple[str, int] = ("setup", 0)
        self.calls: dict[str, dict[int, list[str]]] = {"inside": {}, "after": {}, "setup": {}}
        self.logged: list[int] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOST_READS:
            caller = our_caller()
            if caller is not None:
                where, step = self.phase
                self.calls[where].setdefault(step, []).append(f"{func.__name__} {caller}")
        return func(*args, **(kwargs or {}))

    # the callback events mark the phases
    def before_step(self, run, step):
        self.phase = ("inside", step)

    def after_step(self, run, step, metrics):
        self.phase = ("after", step)
        # a metric of this rank, summed over the data ranks when a logged step reads it
        run.record_metric("probe/steps", torch.tensor(float(step)), reduce="sum", better="higher")

    def on_log(self, run, step, metrics, rank_metrics):
        self.logged.append(step)


def main() -> None:
    config_path, out = sys.argv[1], sys.argv[2]
    plugins = PluginManager().load_entry_points()
    world = World.from_env()
    config = load_run_config(config_path, plugins, world_size=world.world_size)
    trainer = Trainer(config, plugins)
    counter = Counter()
    # first, so the step's phase is set before any other callback runs
    trainer.callbacks = Callbacks([Named("host_reads", counter, "test"), *trainer.callbacks.named])
    try:
        with counter:
            trainer.train()
    finally:
        trainer.close()
    suffix = f".rank{world.rank}" if "LOCAL_RANK" in os.environ else ""
    record = {
        "logged": counter.logged,
        "inside": counter.calls["inside"],
        "after": counter.calls["after"],
    }
    Path(out + suffix).write_text(json.dumps(record))


if __name__ == "__main__":
    main()
