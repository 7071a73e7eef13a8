"""`llmtrain estimate cfg.yaml [--world-size N]`: memory per rank before anything runs.

The model is built on the meta device (no memory), so sizes are exact where they can be:
- parameters and gradients: counted per module, divided the way the layout divides them
  (TP over tp, pipeline stages over pp, FSDP over dp_shard x cp; with expert parallelism,
  `mesh.ep > 1`, a rank holds n_experts / ep of every MoE layer's experts, the parameters of the
  modules that conform to core-mesh's `ExpertParallel`, and FSDP shards those over dp_shard / ep);
- optimizer state: the configured optimizer takes one step on the meta model, and its state is
  measured (the experts' part apart);
- activations: a forward of one micro-batch on the meta device records every tensor autograd
  saves for backward, block by block; activation checkpointing, pipeline micro-batches in flight,
  sequence parallelism and context parallelism then scale that;
- transients: the logits and their gradient, and FSDP's gathered blocks.
Attention is counted as the fused kernels (flash, memory-efficient, CPU flash) keep it: a row
statistic per query, not the T x T matrix.
Nothing is allocated and no process group is needed. CPU numbers leave out the runtime itself
(the Python process and torch: a few hundred MiB).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs

from llmtrain.core_mesh.cli import Context
from llmtrain.core_mesh.cli_conventions import deprecated_alias, main_object
from llmtrain.core_mesh.config import ConfigError, ConfigValueError, Problem
from llmtrain.core_mesh.errors import UserError
from llmtrain.core_mesh.interfaces import ExpertParallel
from llmtrain.core_mesh.mesh import MeshError
from llmtrain.core_mesh.plugins import MODEL, OPTIMIZER, PluginManager
from llmtrain.parallel.options import ParallelOptions
from llmtrain.train_loop.model_source import load_run_config
from llmtrain.train_loop.run_config import RunConfig, checked_model_options, resolved

if TYPE_CHECKING:
    import torch

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
MIB = 2**20


@attrs.frozen
class Estimate:
    """Bytes per rank (the most loaded rank where ranks differ)."""

    world: int
    layout: str
    params: int
    grads: int
    optimizer: int
    activations: int
    transient: int
    n_params: int
    rank_params: int
    notes: tuple[str, ...] = ()
    # of rank_params, the experts this rank holds (ExpertParallel modules; n_experts / ep of each)
    rank_expert_params: int = 0

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.transient

    def rows(self) -> list[tuple[str, int]]:
        return [
            ("parameters", self.params),
            ("gradients", self.grads),
            ("optimizer state", self.optimizer),
            ("activations", self.activations),
            ("transient (logits, gathers)", self.transient),
            ("total", self.total),
        ]


def _count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def expert_parameter_ids(model: torch.nn.Module) -> set[int]:
    """The parameters expert parallelism splits: those of the modules that hold experts."""
    holders: list[torch.nn.Module] = [m for m in model.modules() if isinstance(m, ExpertParallel)]
    return {id(p) for m in holders for p in m.parameters()}


def _count_experts(module: torch.nn.Module, experts: set[int]) -> int:
    return sum(p.numel() for p in module.parameters() if id(p) in experts)


def saved_activation_bytes(
    model: torch.nn.Module, blocks: Sequence[torch.nn.Module], batch: int, seq_len: int
) -> tuple[list[int], int, int, int]:
    """(bytes saved for backward inside each block, bytes saved outside the blocks, bytes of one
    block's input, elements of the output) for one forward of [batch, seq_len] tokens on the
    meta device."""
    import torch

    saved: list[int] = [0]
    seen: set[int] = set()
    keep: list[torch.Tensor] = []
    per_block: list[int] = []
    marks: dict[int, int] = {}
    block_input: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t if t._base is None else t._base  # a view shares its base's memory
        if id(base) not in seen and not isinstance(base, torch.nn.Parameter):
            seen.add(id(base))
            keep.append(base)  # ids stay unique while the forward runs
            size = base.numel() * base.element_size()
            if "Softmax" in type(t.grad_fn).__name__ and t.shape[-1] == t.shape[-2] == seq_len:
                # attention on the meta device takes the math path and keeps the T x T
                # probabilities; the fused kernels real runs use keep a row statistic instead
                size //= seq_len
            saved[0] += size
        return t

    def before(module: torch.nn.Module, args: tuple[object, ...]) -> None:
        marks[id(module)] = saved[0]
        if not block_input and args and torch.is_tensor(args[0]):
            block_input.append(args[0].numel() * args[0].element_size())

    def after(module: torch.nn.Module, args: tuple[object, ...], out: object) -> None:
        per_block.append(saved[0] - marks[id(module)])

    hooks = []
    for block in blocks:
        hooks.append(block.register_forward_pre_hook(before))
        hooks.append(block.register_forward_hook(after))
    tokens = torch.zeros(batch, seq_len, dtype=torch.long, device="meta")
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logits = model(tokens)
    finally:
        for h in hooks:
            h.remove()
    outside = saved[0] - sum(per_block)
    return per_block, outside, block_input[0] if block_input else 0, logits.numel()


def optimizer_state_bytes(
    plugins: PluginManager,
    config: RunConfig,
    model: torch.nn.Module,
    experts: frozenset[int] = frozenset(),
) -> tuple[int, int]:
    """Build the configured optimizer on the meta model, step once with meta gradients, and
    measure its state: (bytes for the other parameters, bytes for the `experts` parameter ids)."""
    import torch

    for p in model.parameters():
        p.grad = torch.empty_like(p)
    total = [0, 0]
    for opt in plugins.build(OPTIMIZER, config.optimizer, model):
        opt.step()
        for param, state in opt.state.items():
            size = sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v))
            total[id(param) in experts] += size
    for p in model.parameters():
        p.grad = None
    return total[0], total[1]


def estimate(config: RunConfig, plugins: PluginManager, world: int) -> Estimate:
    import torch

    config = resolved(config, plugins)
    spec = config.mesh.resolve(world)
    dp = spec.dp
    _, accum = config.data.batch_sizes(dp)
    micro, seq = config.data.micro_batch, config.data.seq_len
    notes = []
    options = plugins.options_of("parallel", config.parallel)
    if not isinstance(options, ParallelOptions):
        notes.append(
            f"parallel.kind {config.parallel.kind!r} is estimated as the default strategy with "
            "its default options"
        )
        options = ParallelOptions()
    ac = options.activation_checkpointing
    param_bytes = DTYPE_BYTES[options.param_dtype]
    reduce_bytes = DTYPE_BYTES[options.reduce_dtype]

    model_options = checked_model_options(plugins, config.model)
    if seq > model_options.max_seq_len:
        raise ConfigValueError(
            "seq_len",
            f"data.seq_len={seq} is longer than the model's max_seq_len "
            f"({model_options.max_seq_len}); raise model.max_seq_len or shorten data.seq_len",
        )
    with torch.device("meta"):
        model = plugins.build(MODEL, config.model)
    desc = model.describe()
    blocks = list(desc.blocks)
    n_blocks = len(blocks)
    n_params = _count(model)
    block_params = [_count(b) for b in blocks]
    other_params = n_params - sum(block_params)
    experts = {i for b in blocks for i in expert_parameter_ids(b)}
    block_experts = [_count_experts(b, experts) for b in blocks]
    n_experts = sum(block_experts)

    # this rank's parameters: a pipeline stage (the heaviest), a TP shard, then the experts this
    # rank holds (n_experts / ep of each layer's); FSDP shards the rest over dp_shard x cp and,
    # with ep > 1, the experts over the dp_shard / ep ranks that hold the same ones
    pp, tp, cp, ep = spec.pp, spec.tp, spec.cp, spec.ep
    shard = spec.dp_shard * cp
    expert_shard = shard if ep == 1 else spec.dp_shard // ep
    stage_blocks = math.ceil(n_blocks / pp)
    heaviest = max(range(n_blocks), key=block_params.__getitem__, default=None)
    biggest_block = block_params[heaviest] if heaviest is not None else 0
    biggest_experts = block_experts[heaviest] if heaviest is not None else 0
    stage_other = stage_blocks * (biggest_block - biggest_experts) + (
        other_params if pp == 1 else other_params // 2
    )
    stage_experts = stage_blocks * biggest_experts
    rank_other = math.ceil(stage_other / tp)
    rank_experts = math.ceil(stage_experts / tp / ep)
    rank_params = rank_other + rank_experts
    params = (math.ceil(rank_other / shard) + math.ceil(rank_experts / expert_shard)) * 4
    grads = params  # fp32 master weights and their gradients, sharded alike
    other_state, expert_state = optimizer_state_bytes(plugins, config, model, frozenset(experts))
    optimizer = math.ceil(other_state * rank_other / max(n_params - n_experts, 1) / shard)
    optimizer += math.ceil(expert_state * rank_experts / max(n_experts, 1) / expert_shard)

    # activations of one micro-batch on this rank, then how many are alive at once
    per_block, outside, block_input, logit_count = saved_activation_bytes(model, blocks, micro, seq)
    scale = (param_bytes / 4) / cp  # autocast / FSDP compute dtype; a cp-th of each sequence
    blocks_here = per_block[:stage_blocks]
    tp_div = (
        tp if options.sequence_parallel else 1
    )  # without SP the norms' activations are whole on every TP rank
    kept: list[float] = []
    for i, whole in enumerate(blocks_here):
        size = whole / tp if tp > 1 else whole
        if ac.mode == "full" or (ac.mode == "blocks" and i % ac.every == 0):
            kept.append(block_input / tp_div)
        elif ac.mode == "ops":
            kept.append(size / 2)  # roughly: matmul and attention outputs kept, the rest recomputed
        else:
            kept.append(size)
    recompute = max(per_block[:stage_blocks], default=0) / tp if ac.mode != "none" else 0
    one_micro = (sum(kept) + outside / max(pp, 1) / tp_div) * scale
    in_flight = (
        1 if pp == 1 else (accum if options.pipeline.schedule == "GPipe" else min(accum, pp))
    )
    activations = math.ceil(one_micro * in_flight + recompute * scale)

    # transients: logits (fp32), their log-softmax and gradient; FSDP's gathered blocks
    loss_tp = tp if options.loss_parallel else 1
    logits = logit_count / cp * 4 * 3 / loss_tp
    gathered = 0.0
    unsharded_blocks = stage_blocks if options.reshard_after_forward == "never" else 2
    if shard > 1:
        gathered += (biggest_block - biggest_experts) / tp
    if expert_shard > 1:  # a gathered block holds this rank's experts only
        gathered += biggest_experts / tp / ep
    gathered *= unsharded_blocks * (param_bytes + reduce_bytes)
    transient = math.ceil(logits + gathered)

    layout = (
        f"world {world}: dp_replicate {spec.dp_replicate} x dp_shard {spec.dp_shard} x cp {cp} "
        f"x tp {tp} x pp {pp}, ep {ep}; micro-batch {micro} x seq {seq}, {accum} micro-batches per step, "
        f"activation checkpointing {ac.mode}, params {options.param_dtype}"
    )
    if config.training.init == "full":
        notes.append(
            "training.init: full also builds one whole fp32 model per process on the host at start "
            f"({n_params * 4 / MIB:,.0f} MiB, freed before training)"
        )
    return Estimate(
        world=world,
        layout=layout,
        params=params,
        grads=grads,
        optimizer=optimizer,
        activations=activations,
        transient=transient,
        n_params=n_params,
        rank_params=rank_params,
        notes=tuple(notes),
        rank_expert_params=rank_experts,
    )


def configure(parser: argparse.ArgumentParser) -> None:
    main_object(parser, "config", metavar="CONFIG", help="the run config (YAML)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="e.g. data.micro_batch=4")
    parser.add_argument(
        "--world-size", type=int, default=1, help="the number of processes to estimate for"
    )
    deprecated_alias(parser, "--world", "--world-size")


def run(args: argparse.Namespace, ctx: Context) -> int:
    if args.world_size < 1:
        raise UserError(f"--world-size must be at least 1, got {args.world_size}")
    config = load_run_config(args.config, ctx.plugins, args.overrides)
    try:
        est = estimate(config, ctx.plugins, args.world_size)
    except MeshError as exc:
        raise ConfigError([Problem(("mesh",), str(exc), args.config)], args.config) from None
    except ConfigValueError as exc:
        problem = Problem(("data", exc.field), str(exc), args.config)
        raise ConfigError([problem], args.config) from None
    experts = f" ({est.rank_expert_params:,} of them experts)" if est.rank_expert_params else ""
    print(
        f"{config.name}: {est.n_params:,} parameters, {est.rank_params:,} on the busiest rank "
        f"before FSDP{experts}"
    )
    print(est.layout)
    for name, size in est.rows():
        line = f"  {name:<28} {size / MIB:>12,.1f} MiB"
        print(("  " + "-" * 43 + "\n" if name == "total" else "") + line)
    for note in est.notes:
        print(f"note: {note}", file=sys.stderr)
    return 0
