"""The parallel layout: how many ways each of pp, dp_replicate, dp_shard, cp and tp split the world.

`MeshSpec` is plain config (no torch). `resolve(world_size)` fills `dp_shard: -1` and checks that
the degrees multiply to the world size; `build_device_mesh` makes the torch DeviceMesh with named
dimensions in the order pp, dp_replicate, dp_shard, cp, tp (tp innermost, so it stays within a
node), plus the flattened "dp" (all data parallel), "dp_shard_cp" (what FSDP shards over) and
"dp_cp" (every rank that sees different tokens: loss and token counts are summed over it).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import attrs

from llmtrain.core_mesh.errors import UserError

if TYPE_CHECKING:  # torch is imported where a mesh is built, not with the config
    from torch.distributed.device_mesh import DeviceMesh

DIM_NAMES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


class MeshError(UserError):
    pass


def _degree(instance: Any, attribute: attrs.Attribute[int], value: int) -> None:
    allowed = -1 if attribute.name == "dp_shard" else 1
    if value < 1 and value != allowed:
        extra = " or -1 (infer from the world size)" if allowed == -1 else ""
        raise ValueError(f"must be a positive integer{extra}, got {value}")


@attrs.frozen(kw_only=True)
class MeshSpec:
    dp_replicate: int = attrs.field(default=1, validator=_degree)
    dp_shard: int = attrs.field(default=-1, validator=_degree)
    cp: int = attrs.field(default=1, validator=_degree)
    tp: int = attrs.field(default=1, validator=_degree)
    pp: int = attrs.field(default=1, validator=_degree)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, name) for name in DIM_NAMES)

    @property
    def size(self) -> int:
        """Processes this layout needs (only meaningful once resolved)."""
        return math.prod(self.shape)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    def resolve(self, world_size: int) -> MeshSpec:
        """Fill an inferred dp_shard and check the layout against the world size."""
        others = self.dp_replicate * self.cp * self.tp * self.pp
        layout = self._describe()
        if self.dp_shard == -1:
            if world_size % others:
                raise MeshError(
                    f"mesh {layout} needs a multiple of {others} processes "
                    f"(dp_replicate x cp x tp x pp), but the world has {world_size}; "
                    "change the degrees or the number of processes"
                )
            return attrs.evolve(self, dp_shard=world_size // others)
        if self.size != world_size:
            raise MeshError(
                f"mesh {layout} multiplies to {self.size} processes, but the world has "
                f"{world_size}; make the product equal the world size or set dp_shard: -1"
            )
        return self

    def _describe(self) -> str:
        return " x ".join(f"{name}={getattr(self, name)}" for name in DIM_NAMES)


def build_device_mesh(
    spec: MeshSpec, device_type: str, world_size: int | None = None
) -> DeviceMesh:
    """The torch DeviceMesh for a (resolved or resolvable) spec; needs a started process group."""
    import warnings

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    # torch warns that slicing flattened dims off the root mesh will change in a later release;
    # every slice we take goes through this module's names, so one place changes with it
    warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh")

    world_size = world_size or (dist.get_world_size() if dist.is_initialized() else 1)
    spec = spec.resolve(world_size)
    mesh = init_device_mesh(device_type, spec.shape, mesh_dim_names=DIM_NAMES)
    mesh["dp_replicate", "dp_shard"]._flatten("dp")
    mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
    return mesh
