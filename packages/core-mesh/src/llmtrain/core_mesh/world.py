"""The world: which process this is among how many, read from torchrun's (or SLURM's) environment.

A process started without those variables is a world of one. torch is imported only by the
functions that start or stop a process group, so this module loads without torch.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Mapping
from datetime import timedelta
from typing import TYPE_CHECKING

import attrs

from llmtrain.core_mesh.errors import UserError

if TYPE_CHECKING:  # torch is imported by the functions that use it
    import torch

_TORCHRUN = ("RANK", "LOCAL_RANK", "WORLD_SIZE")
_SLURM = ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS")


class WorldError(UserError):
    pass


@attrs.frozen
class World:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> World:
        """Read torchrun's variables; else SLURM's (srun without torchrun); else a world of one."""
        env = os.environ if environ is None else environ
        for names in (_TORCHRUN, _SLURM):
            present = [n for n in names if n in env]
            if not present:
                continue
            if len(present) != len(names):
                missing = ", ".join(n for n in names if n not in env)
                raise WorldError(
                    f"incomplete launcher environment: {', '.join(present)} set but {missing} "
                    "missing; start with torchrun (or srun), or unset them for a single process"
                )
            rank, local_rank, size = (_env_int(env, n) for n in names)
            local_size_name = "LOCAL_WORLD_SIZE" if names is _TORCHRUN else "SLURM_NTASKS_PER_NODE"
            local_size = _env_int(env, local_size_name) if local_size_name in env else size
            if not 0 <= rank < size or not 0 <= local_rank < local_size:
                raise WorldError(
                    f"inconsistent launcher environment: rank {rank}, local rank {local_rank}, "
                    f"world size {size}, local world size {local_size}"
                )
            return cls(rank, local_rank, size, local_size)
        return cls()


def _env_int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name].split("(")[0])  # SLURM writes e.g. "4(x2)" for per-node counts
    except ValueError:
        raise WorldError(f"environment variable {name}={env[name]!r} is not an integer") from None


def default_device_type() -> str:
    """'cuda' when a GPU is usable, else 'cpu'."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def backend_for(device_type: str) -> str:
    return {"cuda": "nccl", "cpu": "gloo"}.get(device_type, "gloo")


def init_distributed(
    world: World, device_type: str | None = None, *, timeout_s: float = 600.0
) -> torch.device:
    """Start the default process group and return this process's device.

    On CUDA each process takes the GPU of its local rank. A world of one gets an in-memory group;
    larger worlds need MASTER_ADDR/MASTER_PORT (torchrun sets them).
    """
    import torch
    import torch.distributed as dist

    device_type = device_type or default_device_type()
    if device_type == "cuda":
        torch.cuda.set_device(world.local_rank)
        device = torch.device("cuda", world.local_rank)
    else:
        device = torch.device(device_type)
    if dist.is_initialized():
        return device
    backend = backend_for(device_type)
    timeout = timedelta(seconds=timeout_s)
    device_id = device if device_type == "cuda" else None
    if not world.distributed:
        # a group of one (in-memory store), so mesh and sharding code runs unchanged
        dist.init_process_group(
            backend,
            # torch.distributed imports HashStore without `as HashStore`, so its own stubs do
            # not export it
            store=dist.HashStore(),  # type: ignore[attr-defined]
            rank=0,
            world_size=1,
            timeout=timeout,
            device_id=device_id,
        )
        return device
    missing = [n for n in ("MASTER_ADDR", "MASTER_PORT") if n not in os.environ]
    if missing:
        raise WorldError(
            f"{' and '.join(missing)} not set for a world of {world.world_size} processes; "
            "start with torchrun, or export them (SLURM: the first node's address and a free port)"
        )
    dist.init_process_group(
        backend,
        rank=world.rank,
        world_size=world.world_size,
        timeout=timeout,
        device_id=device_id,
    )
    return device


def shutdown_distributed(*, barrier: bool = True) -> None:
    """Stop the process group. With `barrier` every rank first finishes its collectives (a rank
    leaving early aborts a peer whose background work still uses the group); a failing rank
    passes False, as its peers may never reach the barrier."""
    import torch.distributed as dist

    if dist.is_initialized():
        if barrier:
            dist.barrier()
        dist.destroy_process_group()
        # groups still referenced by device meshes would otherwise be freed during interpreter
        # exit, where gloo's threads can abort the process
        gc.collect()
