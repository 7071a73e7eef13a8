"""Expert parallelism (`mesh.ep > 1`): each of the ep ranks holds n_experts / ep experts of every
Mixture-of-Experts layer, and the layer itself sends each token to the rank holding its expert
and back (all-to-all). The ep ranks are data-parallel ranks (ep divides dp_shard): each reads its
own tokens. What this package does is generic, for any module that conforms to core-mesh's
`ExpertParallel`: tell it its ep mesh, then shard its (already split) experts over the data
ranks that hold the same experts (dp_shard_mod_ep; replicated over dp_replicate under HSDP).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard

from llmtrain.core_mesh.interfaces import ExpertParallel
from llmtrain.parallel.data_parallel import mixed_precision, should_reshard
from llmtrain.parallel.options import ParallelOptions

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def expert_modules(module: nn.Module) -> list[nn.Module]:
    """The modules of `module` that hold experts (conform to `ExpertParallel`)."""
    return [m for m in module.modules() if isinstance(m, ExpertParallel)]


def split_experts(experts: list[nn.Module], ep_mesh: DeviceMesh) -> None:
    """Each expert module keeps this rank's share of its experts (on the meta device: no copy)."""
    for module in experts:
        if not isinstance(module, ExpertParallel):
            raise TypeError(f"{type(module).__name__} does not hold experts (ExpertParallel)")
        module.shard_experts(ep_mesh)


def shard_expert_data(
    experts: list[nn.Module], device_mesh: DeviceMesh, options: ParallelOptions, *, pipelined: bool
) -> None:
    """FSDP over the ranks holding the same experts, before the blocks' FSDP (which then leaves
    the expert parameters alone)."""
    if not experts:
        return
    dims: str | tuple[str, str] = "dp_shard_mod_ep"
    if device_mesh["dp_replicate"].size() > 1:
        dims = ("dp_replicate", "dp_shard_mod_ep")  # HSDP: replicated across the groups
    # `Parallelized` scales the loss by every rank that saw different tokens (dp_cp), which
    # FSDP's own average over its mesh undoes for dense weights. An expert's gradient has
    # already been summed over the ep ranks' tokens by the all-to-all's backward, so it is
    # divided by all of dp_cp, not only by this smaller mesh.
    factor = float(device_mesh["dp_cp"].size())
    for module in experts:
        fully_shard(
            module,
            mesh=device_mesh[dims],
            mp_policy=mixed_precision(options),
            reshard_after_forward=should_reshard(options, pipelined, False),
        )
        if not isinstance(module, FSDPModule):  # fully_shard made it one
            raise TypeError(f"{type(module).__name__} was not wrapped by FSDP")
        module.set_gradient_divide_factor(factor)
        if device_mesh.device_type == "cpu" and device_mesh["dp_shard_mod_ep"].size() > 1:
            # a divisor other than the shard group's size is a pre-multiplied sum, which gloo
            # lacks. Where that group is one rank FSDP divides without a collective, and
            # forcing a sum there would divide a second time (torch 2.13, measured)
            module.set_force_sum_reduction_for_comms(True)
