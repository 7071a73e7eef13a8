"""The parallel layout: how many ways each of pp, dp_replicate, dp_shard, cp and tp split the world,
and how many of the dp_shard ranks split a Mixture-of-Experts layer's experts (ep).

`MeshSpec` is plain config (no torch). `resolve(world_size)` fills `dp_shard: -1` and checks that
the degrees multiply to the world size; `build_device_mesh` makes the torch DeviceMesh with named
dimensions in the order pp, dp_replicate, dp_shard_mod_ep, ep, cp, tp (tp innermost, so it stays
within a node; ep next, so expert all-to-alls stay as local as the layout allows), plus the
flattened "dp_shard" (dp_shard_mod_ep x ep), "dp" (all data parallel), "dp_shard_cp" (what FSDP
shards over) and "dp_cp" (every rank that sees different tokens: loss and token counts are
summed over it). Expert parallelism borrows its ranks from dp_shard: each ep rank reads its own
tokens, holds n_experts / ep experts, and FSDP shards those over dp_shard_mod_ep.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import attrs

from llmtrain.core_mesh.errors import UserError

if TYPE_CHECKING:  # torch is imported where a mesh is built, not with the config
    from torch.distributed.device_mesh import DeviceMesh

# the degrees a layout sets (`MeshSpec`'s fields), in the order of the device mesh
DIM_NAMES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
# the device mesh's own dimensions: dp_shard is split into dp_shard_mod_ep x ep
MESH_DIM_NAMES = ("pp", "dp_replicate", "dp_shard_mod_ep", "ep", "cp", "tp")


class MeshError(UserError):
    pass


def _degree(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
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
    # expert parallelism: how many of the dp_shard ranks split each MoE layer's experts
    ep: int = attrs.field(default=1, validator=_degree)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, name) for name in DIM_NAMES)

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """The device mesh's shape, in MESH_DIM_NAMES' order (only meaningful once resolved)."""
        return (self.pp, self.dp_replicate, self.dp_shard // self.ep, self.ep, self.cp, self.tp)

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
            return attrs.evolve(self, dp_shard=world_size // others)._check_ep()
        if self.size != world_size:
            raise MeshError(
                f"mesh {layout} multiplies to {self.size} processes, but the world has "
                f"{world_size}; make the product equal the world size or set dp_shard: -1"
            )
        return self._check_ep()

    def _check_ep(self) -> MeshSpec:
        if self.dp_shard % self.ep:
            raise MeshError(
                f"mesh.ep={self.ep} must divide mesh.dp_shard={self.dp_shard}: expert "
                "parallelism splits the experts over some of the ranks that shard the data; "
                "choose an ep that divides dp_shard"
            )
        return self

    def _describe(self) -> str:
        ep = [] if self.ep == 1 else [f"ep={self.ep}"]
        return " x ".join([f"{name}={getattr(self, name)}" for name in DIM_NAMES] + ep)


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
    mesh = init_device_mesh(device_type, spec.mesh_shape, mesh_dim_names=MESH_DIM_NAMES)
    mesh["dp_shard_mod_ep", "ep"]._flatten("dp_shard")
    mesh["dp_replicate", "dp_shard_mod_ep", "ep"]._flatten("dp")
    mesh["dp_shard_mod_ep", "ep", "cp"]._flatten("dp_shard_cp")
    mesh["dp_replicate", "dp_shard_mod_ep", "ep", "cp"]._flatten("dp_cp")
    return mesh
