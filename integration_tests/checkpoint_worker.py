"""Processes for test_checkpoint_dist.py.

    reshard OUT CKPT_A CKPT_B   (torchrun, 2 ranks) train an MLP 2 steps under FSDP2 and save it to
                                CKPT_A; load CKPT_A under tensor parallelism; load CKPT_B (saved by
                                one process) under tensor parallelism. Results go to OUT.
    save-loop                   a fork server: each JSON line on stdin ({url, start, async_save,
                                mib}) starts one saver process that saves steps start, start+1, ...
                                until it is killed (the test kills it with SIGKILL). Forking skips
                                the seconds of imports per trial.
    preempt CKPT OUT            (torchrun, 2 ranks) a training loop that saves every few steps and
                                stops, saves and exits 0 when any rank gets SIGTERM.
    stop-vote OUT               (torchrun, 2 ranks) rank 0 is signalled during should_stop()'s
                                all-reduce; each rank writes what that vote and the next said.

The test imports this module for MLP, batch and crash_state (what each saved step holds).
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
from torch import nn

# -- shared with the test -------------------------------------------------------------------------


class MLP(nn.Module):
    def __init__(self, dim: int = 8, hidden: int = 16):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def make_mlp(seed: int, parallelize=None) -> tuple[MLP, torch.optim.Optimizer]:
    """The MLP from `seed`, parallelized by `parallelize(model)` if given, and its AdamW (made
    after parallelizing: FSDP and TP replace the parameters)."""
    torch.manual_seed(seed)
    model = MLP()
    if parallelize is not None:
        parallelize(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> float:
    x, y = batch(step)
    optimizer.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    return loss.item()


def eval_loss(model: nn.Module, step: int) -> float:
    x, y = batch(step)
    with torch.no_grad():
        return nn.functional.mse_loss(model(x), y).item()


def continuation(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[float]:
    """The losses of one more training step (3) and of the model it leaves (on batch 4): the
    first checks the weights, the second the optimizer state."""
    return [train_step(model, optimizer, 3), eval_loss(model, 4)]


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in model.named_parameters()
    }


def crash_state(step: int, mib: int = 4) -> dict[str, torch.Tensor]:
    """The tensors (`mib` MiB in all) a saver writes at `step`: every element depends on it."""
    n, m = mib * 128 * 1024, mib * 64 * 1024  # float32 and int64: half the bytes each
    return {
        "weights": torch.arange(n, dtype=torch.float32) * 1e-3 + step,
        "moments": torch.arange(m, dtype=torch.int64) * 7 + step * 1_000_003,
    }


def emit(**record) -> None:
    print(json.dumps(record), flush=True)


# -- reshard -----------------------------------------------------------------------------------------


def reshard(out: str, ckpt_a: str, ckpt_b: str) -> None:
    import structlog.testing
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from llmtrain.checkpoint.manager import Checkpointer
    from llmtrain.checkpoint.state import ModelState, Values
    from llmtrain.core_mesh.world import World, init_distributed, shutdown_distributed

    world = World.from_env()
    init_distributed(world, "cpu")
    rank = world.rank
    mesh = init_device_mesh("cpu", (2,))
    result: dict = {}

    def fsdp(model: MLP) -> None:
        fully_shard(model.fc1, mesh=mesh)
        fully_shard(model.fc2, mesh=mesh)
        fully_shard(model, mesh=mesh)

    def tensor_parallel(model: MLP) -> None:
        parallelize_module(model, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})

    # FSDP2: train 2 steps, save (async, the background write has its own gloo group)
    model, optimizer = make_mlp(0, fsdp)
    result["fsdp_losses"] = [train_step(model, optimizer, s) for s in (1, 2)]
    torch.manual_seed(100 + rank)  # each rank's own random stream, saved per rank
    checkpoints = Checkpointer(ckpt_a, async_save=True)
    checkpoints.save(2, {"train": ModelState(model, [optimizer]), "counters": Values(step=2)})
    result["fsdp_rand_after_save"] = torch.rand(4).tolist()
    checkpoints.close()
    saved = full_params(model)
    result["fsdp_continuation"] = continuation(model, optimizer)
    if rank == 0:
        torch.save(saved, f"{out}/fsdp_params.pt")

    # tensor parallel, from the FSDP checkpoint
    model, optimizer = make_mlp(123, tensor_parallel)
    torch.manual_seed(1000 + rank)  # to be replaced by the state this rank saved
    counters = Values(step=0)
    with structlog.testing.capture_logs() as logs:
        result["tp_loaded_step"] = Checkpointer(ckpt_a).load(
            {"train": ModelState(model, [optimizer]), "counters": counters}
        )
    result["tp_rand_after_load"] = torch.rand(4).tolist()
    result["tp_counters"] = counters.values
    result["tp_warnings"] = [e["event"] for e in logs if e["log_level"] == "warning"]
    loaded = full_params(model)
    result["tp_continuation"] = continuation(model, optimizer)
    if rank == 0:
        torch.save(loaded, f"{out}/tp_params.pt")

    # tensor parallel, from a checkpoint one process saved: rank 1 has no RNG state there
    model, optimizer = make_mlp(456, tensor_parallel)
    torch.manual_seed(2000 + rank)  # rank 0's is replaced; rank 1 has none saved and keeps it
    with structlog.testing.capture_logs() as logs:
        result["tp_b_loaded_step"] = Checkpointer(ckpt_b).load(
            {"train": ModelState(model, [optimizer])}
        )
    result["tp_b_rand_after_load"] = torch.rand(4).tolist()
    result["tp_b_warnings"] = [e["event"] for e in logs if e["log_level"] == "warning"]
    loaded = full_params(model)
    if rank == 0:
        torch.save(loaded, f"{out}/tp_b_params.pt")

    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(result, f)
    dist.barrier()
    shutdown_distributed()


# -- save-loop (crash safety) -------------------------------------------------------------------------


def save_until_killed(url: str, start: int, async_save: bool, mib: int) -> None:
    from llmtrain.checkpoint.manager import Checkpointer, KeepPolicy
    from llmtrain.checkpoint.state import Values

    torch.set_num_threads(1)
    checkpoints = Checkpointer(url, keep=KeepPolicy(last=2), async_save=async_save)
    tensors = crash_state(start, mib)
    counters = Values(step=start)
    # a resuming run looks for the newest checkpoint first (and so sets up its storage client)
    found = checkpoints.latest_step()
    if found != start - 1:
        raise SystemExit(f"expected step {start - 1} to be the newest committed, found {found}")
    emit(started=os.getpid())
    deadline = time.monotonic() + 60
    step = start
    while time.monotonic() < deadline:
        for name, value in crash_state(step, mib).items():
            # in place: with async saves this overwrites tensors while the last write is in flight
            tensors[name].copy_(value)
        counters["step"] = step
        checkpoints.save(step, {"tensors": tensors, "counters": counters}, info={"step": step})
        step += 1
    os._exit(3)  # never killed: the test failed to kill it


def save_loop() -> None:
    # torch.distributed.checkpoint takes seconds to import, which every saver would otherwise
    # spend after its fork, in every trial. s3fs is imported after the fork: a fork of a process
    # that imported it leaves most S3 saves hanging until the kill (2 of 10 trials committed)
    import structlog

    import llmtrain.checkpoint.manager  # noqa: F401

    # stdout carries this protocol's JSON lines; logs go to stderr
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            try:
                save_until_killed(**request)
            finally:
                os._exit(4)
        emit(child=pid)
        _, status = os.waitpid(pid, 0)
        emit(
            exited=pid,
            signal=os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
            code=os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
        )


# -- preempt -------------------------------------------------------------------------------------------


def preempt(ckpt: str, out: str) -> None:
    import torch.distributed as dist

    from llmtrain.checkpoint.manager import Checkpointer, KeepPolicy
    from llmtrain.checkpoint.preemption import Preemption
    from llmtrain.checkpoint.state import Values
    from llmtrain.core_mesh.world import World, init_distributed, shutdown_distributed

    world = World.from_env()
    init_distributed(world, "cpu")
    rank = world.rank
    preemption = Preemption()
    checkpoints = Checkpointer(ckpt, keep=KeepPolicy(last=100), async_save=True)
    weights = torch.zeros(1000)
    counters = Values(step=0)
    saved = []
    step = 0
    while step < 600:
        step += 1
        update = torch.full((1000,), float(rank + step))
        dist.all_reduce(update)  # a data-parallel gradient: every rank applies the same update
        weights += update
        counters["step"] = step
        if step % 5 == 0:
            checkpoints.save(step, {"weights": {"w": weights}, "counters": counters})
            saved.append(step)
        if step == 3:
            with open(f"{out}/pid{rank}", "w") as f:
                f.write(str(os.getpid()))
        if preemption.should_stop():
            break
        time.sleep(0.01)
    else:
        sys.exit(5)  # nobody stopped it
    if not saved or saved[-1] != step:
        checkpoints.save(step, {"weights": {"w": weights}, "counters": counters}, blocking=True)
        saved.append(step)
    checkpoints.close()
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(
            {
                "stopped_at": step,
                "requested": preemption.requested,
                "signal": preemption.signal_name,
                "saved": saved,
            },
            f,
        )
    preemption.restore()
    dist.barrier()
    shutdown_distributed()


def stop_vote(out: str) -> None:
    """Rank 0 is signalled while the stop vote's all-reduce runs; every rank records its answers
    to that vote and the next."""
    import signal

    import torch.distributed as dist

    from llmtrain.checkpoint.preemption import Preemption
    from llmtrain.core_mesh.world import World, init_distributed, shutdown_distributed

    world = World.from_env()
    init_distributed(world, "cpu")
    preemption = Preemption(signals=(signal.SIGUSR1,))
    all_reduce = dist.all_reduce

    def signalled_during(tensor, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGUSR1)
        return all_reduce(tensor, *args, **kwargs)

    if world.rank == 0:
        dist.all_reduce = signalled_during
    votes = [preemption.should_stop()]
    dist.all_reduce = all_reduce
    votes.append(preemption.should_stop())
    with open(f"{out}/rank{world.rank}.json", "w") as f:
        json.dump({"votes": votes, "signal": preemption.signal_name}, f)
    preemption.restore()
    dist.barrier()
    shutdown_distributed()


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    commands = {"reshard": reshard, "save-loop": save_loop, "preempt": preempt}
    commands["stop-vote"] = stop_vote
    commands[command](*args)
