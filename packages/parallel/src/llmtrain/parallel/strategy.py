"""The `default` parallel strategy: the mesh decides, the options say how.

Per model part, in this order: float8 conversion → tensor parallelism (+ sequence parallelism)
→ activation checkpointing → torch.compile per block → FSDP2 per block and at the root (HSDP
when dp_replicate > 1), or DDP when the layout only replicates. Pipeline parallelism first cuts
the model into stages (one part per stage on this rank); context parallelism shards sequences at
run time. The result, `Parallelized`, runs a step's forward and backward whatever the layout.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol, runtime_checkable

import attrs
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    ValueType,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from llmtrain.core_mesh.interfaces import (
    AfterOptimizerStep,
    AttentionDescription,
    ModelDescription,
)
from llmtrain.core_mesh.mesh import DIM_NAMES, MeshSpec
from llmtrain.parallel import context_parallel, pipeline
from llmtrain.parallel.activation_checkpoint import apply_activation_checkpointing
from llmtrain.parallel.data_parallel import apply_ddp, apply_fsdp, set_gradient_sync
from llmtrain.parallel.expert_parallel import expert_modules, shard_expert_data, split_experts
from llmtrain.parallel.float8 import convert_to_float8, precompute_float8_scales
from llmtrain.parallel.grad_norm import clip_grad_norm_
from llmtrain.parallel.layout import check_layout
from llmtrain.parallel.options import V_SCHEDULES, ParallelOptions
from llmtrain.parallel.tensor_parallel import apply_tensor_parallel, resolve_plan

# loss_fn(logits, targets) -> the summed loss over those targets (a scalar tensor)
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# keyword inputs of the model's forward besides the tokens: tensors split with the batch, and
# numbers (context parallelism's `sequence_length`) passed to every piece as they are
ModelInputs = dict[str, torch.Tensor | int]
# what a step's loss is multiplied by: a number, or a float64 tensor on the device (the trainer's
# 1 / count, never read on the host)
Scale = float | torch.Tensor


def as_factor(scale: Scale) -> Scale:
    """The factor a float32 loss is multiplied by: a float64 tensor becomes float32 here, as a
    Python number is when it multiplies a float32 tensor, so both give the same bits."""
    return scale.float() if isinstance(scale, torch.Tensor) else scale


@runtime_checkable
class HiddenStateLoss(Protocol):
    """A loss that can also start from the final hidden states and the output matrix, so the
    batch's logits need not exist (train-loop's chunked cross-entropy): where the model takes a
    `head_fn` and no tensor or pipeline split reshapes its output, `Parallelized` uses it."""

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor, /) -> torch.Tensor: ...

    def from_hidden(
        self, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, /
    ) -> torch.Tensor: ...


@attrs.define(eq=False)
class Parallelized:
    """A model laid out over the device mesh: the parts this rank holds and how to run a step.

    Losses are sums over target tokens: `forward_backward` backpropagates `loss_sum * scale`
    (pass 1 / global target count), times the number of ranks data parallelism averages
    gradients over, so the gradient is the same for any layout, number of micro-batches or
    pipeline schedule.
    """

    parts: list[nn.Module]
    mesh: DeviceMesh
    device: torch.device
    options: ParallelOptions
    microbatches: int = 1
    schedule: Any = None  # a torch.distributed.pipelining schedule, exactly when pipelined
    has_first_stage: bool = True
    has_last_stage: bool = True
    autocast_dtype: torch.dtype | None = None
    # the model's forward takes `head_fn` and its output is whole on this rank (no TP, no PP)
    head_fn_ok: bool = False
    # what the model's attention masks (ModelDescription.attention)
    attention: AttentionDescription = attrs.field(factory=AttentionDescription)
    # the pipeline's loss and its factor; None as the factor: the loss's value, zero gradient
    _pp_loss: tuple[LossFn, Scale | None] | None = None
    _cp_seq_len: int = 0
    _dims: dict[str, DeviceMesh] = attrs.field(factory=dict)
    _step_hooks: list[nn.Module] | None = None

    # --- the layout ---
    def dim(self, name: str) -> DeviceMesh:
        """The 1-D mesh of one dimension (pp, dp_replicate, dp_shard, cp, tp, dp, dp_cp, ...)."""
        if name not in self._dims:
            self._dims[name] = self.mesh[name]
        return self._dims[name]

    def size(self, dim: str) -> int:
        return self.dim(dim).size()

    @property
    def spec(self) -> MeshSpec:
        return MeshSpec(**{name: self.size(name) for name in (*DIM_NAMES, "ep")})

    @property
    def data_rank(self) -> int:
        """Which slice of the global batch this rank reads (ranks that share data share it)."""
        return self.dim("dp").get_local_rank()

    @property
    def data_world(self) -> int:
        return self.size("dp")

    @property
    def _grad_average(self) -> int:
        """FSDP and DDP average gradients over every rank that saw different tokens."""
        return self.size("dp_cp")

    def parameters(self) -> Iterator[nn.Parameter]:
        for part in self.parts:
            yield from part.parameters()

    def train(self, mode: bool = True) -> None:
        for part in self.parts:
            part.train(mode)

    # --- a step ---
    def forward_backward(
        self,
        tokens: torch.Tensor,
        targets: torch.Tensor,
        loss_fn: LossFn,
        *,
        scale: Scale = 1.0,
        doc_starts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Forward and backward over this rank's batch (B, T) in `microbatches` pieces; returns
        the summed loss over these targets (the same on every rank that shares the batch)."""
        tokens, targets, kwargs = self._shard_sequence(tokens, targets, doc_starts)
        with self._attention(), self._loss_parallel(), self._autocast():
            if self.schedule is not None:
                total = self._pipeline_step(tokens, targets, loss_fn, scale, kwargs, train=True)
            else:
                total = self._micro_steps(tokens, targets, loss_fn, scale, kwargs)
        return self._reduce_shared(total)

    @torch.no_grad()
    def evaluate(
        self,
        tokens: torch.Tensor,
        targets: torch.Tensor,
        loss_fn: LossFn,
        *,
        doc_starts: torch.Tensor | None = None,
        inputs: Mapping[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The summed loss over these targets, without gradients. `inputs`: further keyword
        inputs of the model (only where no pipeline, sequence or tensor split reshapes them)."""
        tokens, targets, kwargs = self._shard_sequence(tokens, targets, doc_starts)
        if inputs:
            if self.schedule is not None or self.size("cp") > 1 or self.size("tp") > 1:
                raise ValueError(
                    f"model inputs {sorted(inputs)} need a layout that splits neither the model "
                    "nor the sequence (no pipeline, cp or tp)"
                )
            kwargs.update(inputs)
        with self._attention(), self._loss_parallel(), self._autocast():
            if self.schedule is not None:
                total = self._pipeline_step(tokens, targets, loss_fn, 1.0, kwargs, train=False)
            else:
                total = self._loss(tokens, targets, loss_fn, kwargs).detach().float()
        return self._reduce_shared(total)

    def sum_over_data(self, value: torch.Tensor) -> torch.Tensor:
        """Sum a per-batch number (a loss sum, a token count) over the data-parallel ranks."""
        value = value.clone()
        if self.size("dp") > 1:
            dist.all_reduce(value, group=self.dim("dp").get_group())
        return value

    def clip_grad_norm_(self, max_norm: float | None) -> torch.Tensor:
        """Clip to a global L2 norm across all ranks and stages (None: only measure it)."""
        pp_group = self.dim("pp").get_group() if self.size("pp") > 1 else None
        return clip_grad_norm_(self.parameters(), max_norm, pp_group)

    def after_optimizer_step(self, applied: torch.Tensor | None = None) -> None:
        """Float8 scales from the new weights, and the modules' own updates
        (`AfterOptimizerStep`); where `applied` is False (a skipped step, decided on the device)
        those modules' buffers keep their values: they are saved before and chosen after."""
        if self.options.float8:  # recomputed from the weights: the same for unchanged ones
            precompute_float8_scales(self.parts)
        if self._step_hooks is None:
            self._step_hooks = [
                m
                for part in self.parts
                for m in part.modules()
                if isinstance(m, AfterOptimizerStep)
            ]
        for module in self._step_hooks:
            before = None if applied is None else keep_buffers(module)
            assert isinstance(module, AfterOptimizerStep)
            module.after_optimizer_step(self._sum_over_token_ranks)
            if before is not None and applied is not None:
                restore_unless(applied, before)

    def _sum_over_token_ranks(self, value: torch.Tensor) -> torch.Tensor:
        """A per-rank count summed over every rank that saw different tokens (data and context
        parallel); tensor-parallel ranks share their tokens and pipeline stages their layers'."""
        value = value.clone()
        if self.size("dp_cp") > 1:
            dist.all_reduce(value, group=self.dim("dp_cp").get_group())
        return value

    # --- weights ---
    def materialize(self, init: Callable[[nn.Module], None]) -> None:
        """Allocate parts built on the meta device on this rank's device and initialise them."""
        for part in self.parts:
            part.to_empty(device=self.device)
            with torch.no_grad():
                init(part)

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load unsharded weights (every rank passes the same); each part takes its own keys."""
        for part in self.parts:
            own = get_model_state_dict(part, options=StateDictOptions(full_state_dict=False))
            subset: dict[str, ValueType] = {k: state[k] for k in own}
            set_model_state_dict(part, subset, options=StateDictOptions(full_state_dict=True))

    def full_state_dict(self) -> dict[str, ValueType]:
        """Unsharded weights of the parts this rank holds (every rank gets them)."""
        full: dict[str, ValueType] = {}
        for part in self.parts:
            full.update(get_model_state_dict(part, options=StateDictOptions(full_state_dict=True)))
        return full

    # --- internals ---
    def _shard_sequence(
        self, tokens: torch.Tensor, targets: torch.Tensor, doc_starts: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, ModelInputs]:
        """This rank's share of the batch and the model's further inputs. Under context
        parallelism: the shard's tokens and their global `positions`; a model whose attention is
        not plain causal also gets `sequence_length` and the whole sequence's `doc_starts`, from
        which it builds each block's mask over (its queries, every key in position order)."""
        kwargs: ModelInputs = {}
        if doc_starts is not None:
            kwargs["doc_starts"] = doc_starts
        if self.size("cp") > 1:
            if self.attention.plain_causal and doc_starts is not None:
                raise ValueError(
                    "context parallelism: document starts were given, but the model describes "
                    "plain causal attention (ModelDescription.attention); a model that masks "
                    "documents must say so, and build its mask over every key"
                )
            index = context_parallel.shard_index(
                tokens.size(1),
                self.dim("cp").get_local_rank(),
                self.size("cp"),
                self.options.context_parallel.load_balance,
            ).to(tokens.device)
            tokens, targets = tokens[:, index], targets[:, index]
            kwargs["positions"] = index.unsqueeze(0).expand(tokens.size(0), -1)
            self._cp_seq_len = index.numel() * self.size("cp")
            if not self.attention.plain_causal:
                kwargs["sequence_length"] = self._cp_seq_len
        elif self.size("pp") > 1 and doc_starts is None:
            # a later stage's input can be a sequence shard (SP): positions come with the data
            positions = torch.arange(tokens.size(1), device=tokens.device)
            kwargs["positions"] = positions.unsqueeze(0).expand(tokens.size(0), -1)
        return tokens, targets, kwargs

    @contextlib.contextmanager
    def _attention(self) -> Iterator[None]:
        if self.size("cp") == 1:
            yield
            return
        with context_parallel.attention_over(
            self.dim("cp").get_group(),
            self._cp_seq_len,
            self.dim("cp").get_local_rank(),
            self.size("cp"),
            self.options.context_parallel.load_balance,
            self.device,
        ):
            yield

    def _autocast(self) -> contextlib.AbstractContextManager[object]:
        """Low-precision compute where no FSDP/DDP wrapper casts the parameters (one process,
        TP or PP without data parallelism): the same param_dtype through autocast."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _loss_parallel(self) -> contextlib.AbstractContextManager[object]:
        use = self.options.loss_parallel and self.size("tp") > 1
        return loss_parallel() if use else contextlib.nullcontext()

    def _loss(
        self,
        tokens: torch.Tensor,
        targets: torch.Tensor,
        loss_fn: LossFn,
        kwargs: ModelInputs,
    ) -> torch.Tensor:
        """The summed loss of one (micro-)batch: from the hidden states where the loss and the
        layout allow (no logits of the whole batch), else from the logits."""
        if self.head_fn_ok and isinstance(loss_fn, HiddenStateLoss):

            def head_loss(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
                return loss_fn.from_hidden(hidden, weight, targets)

            loss: torch.Tensor = self.parts[0](tokens, head_fn=head_loss, **kwargs)
            return loss
        return loss_fn(self._logits(tokens, kwargs), targets)

    def _logits(self, tokens: torch.Tensor, kwargs: ModelInputs) -> torch.Tensor:
        logits: torch.Tensor = self.parts[0](tokens, **kwargs)
        if isinstance(logits, DTensor) and not self.options.loss_parallel:
            logits = logits.full_tensor()
        return logits

    def _micro_steps(
        self,
        tokens: torch.Tensor,
        targets: torch.Tensor,
        loss_fn: LossFn,
        scale: Scale,
        kwargs: ModelInputs,
    ) -> torch.Tensor:
        n = self.microbatches
        factor = as_factor(scale * self._grad_average)
        if tokens.size(0) % n:
            raise ValueError(
                f"a batch of {tokens.size(0)} sequences does not split into {n} micro-batches"
            )
        total = torch.zeros((), device=tokens.device)
        pieces = zip(
            tokens.chunk(n),
            targets.chunk(n),
            *(v.chunk(n) if isinstance(v, torch.Tensor) else [v] * n for v in kwargs.values()),
            strict=True,
        )
        for i, (tok, tgt, *extra) in enumerate(pieces):
            if n > 1:
                set_gradient_sync(self.parts[0], i == n - 1)
            loss = self._loss(tok, tgt, loss_fn, dict(zip(kwargs, extra, strict=True)))
            # torch's Tensor.backward has no annotations
            (loss * factor).backward()  # type: ignore[no-untyped-call]
            total = total + loss.detach().float()
        return total

    def _scaled_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self._pp_loss is None:
            raise RuntimeError("the pipeline schedule computed a loss outside a step")
        loss_fn, factor = self._pp_loss
        loss = loss_fn(output, target)
        if factor is None:
            return loss * 0.0 + loss.detach()  # the loss's value, a zero gradient
        return loss * factor

    def _pipeline_step(
        self,
        tokens: torch.Tensor,
        targets: torch.Tensor,
        loss_fn: LossFn,
        scale: Scale,
        kwargs: ModelInputs,
        *,
        train: bool,
    ) -> torch.Tensor:
        args = (tokens,) if self.has_first_stage else ()
        # the last stage computes the loss: the schedule fills `losses` there, nowhere else
        target: torch.Tensor | None = targets if self.has_last_stage else None
        losses: list[torch.Tensor] | None = [] if self.has_last_stage else None
        factor: Scale = 1.0
        if train:
            factor = as_factor(scale * self._grad_average)
            self._pp_loss = (loss_fn, factor)
            self.schedule.step(*args, target=target, losses=losses, **kwargs)
        elif self.options.pipeline.schedule in V_SCHEDULES:
            # torch's eval() of the V schedules still runs their backward actions; run a
            # training step whose gradient is zero instead (costs a backward; gradients keep
            # their values, parameters without one get zeros)
            self._pp_loss = (loss_fn, None)
            with torch.enable_grad():
                self.schedule.step(*args, target=target, losses=losses, **kwargs)
        else:
            self._pp_loss = (loss_fn, 1.0)
            self.schedule.eval(*args, target=target, losses=losses, **kwargs)
        total = torch.zeros((), device=self.device)
        for loss in losses or ():
            total = total + loss.detach().float() / factor
        return total

    def _reduce_shared(self, total: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks that split this batch: pipeline stages (only the last has the
        loss) and context-parallel shards."""
        for dim in ("pp", "cp"):
            if self.size(dim) > 1:
                dist.all_reduce(total, group=self.dim(dim).get_group())
        return total


@attrs.define
class DefaultStrategy:
    options: ParallelOptions

    def check(
        self,
        mesh: MeshSpec,
        world_size: int,
        model: ModelDescription,
        *,
        seq_len: int,
        device_type: str,
        microbatches: int = 1,
    ) -> MeshSpec:
        """See `check_layout` (it reads the model's attention from `model.attention`): call
        before starting process groups."""
        return check_layout(
            self.options,
            mesh,
            world_size,
            model,
            seq_len=seq_len,
            device_type=device_type,
            microbatches=microbatches,
        )

    def parallelize(
        self,
        model: ModelDescription,
        device_mesh: DeviceMesh,
        device: torch.device,
        *,
        microbatches: int = 1,
    ) -> Parallelized:
        options = self.options
        size = {name: device_mesh[name].size() for name in (*DIM_NAMES, "ep")}
        if size["tp"] > 1:
            resolve_plan(model.module, dict(model.tp_plan))  # whole model: every entry must match
        names = {id(m): n for n, m in model.module.named_modules()}
        block_paths = [names[id(b)] for b in model.blocks]
        parts: list[nn.Module] = [model.module]
        stage_ids, ranges = [0], [range(len(block_paths))]
        if size["pp"] > 1:
            if model.trim_to_stage is None:  # check_layout refuses such a model first
                raise ValueError("this model cannot be pipelined: it has no trim_to_stage")
            per_rank = options.pipeline.resolved_stages_per_rank
            ranges = pipeline.split_blocks(
                len(block_paths),
                size["pp"] * per_rank,
                options.pipeline.first_stage_weight,
                options.pipeline.last_stage_weight,
            )
            stage_ids = pipeline.stages_of_rank(
                device_mesh["pp"].get_local_rank(), size["pp"], per_rank, options.pipeline.schedule
            )
            parts = pipeline.build_stage_modules(
                model.module, model.trim_to_stage, stage_ids, ranges
            )
        for part, stage in zip(parts, stage_ids, strict=True):
            blocks = [(i, part.get_submodule(block_paths[i])) for i in ranges[stage]]
            self._apply(part, blocks, model, device_mesh, size)
        result = Parallelized(
            parts=parts,
            mesh=device_mesh,
            device=device,
            options=options,
            microbatches=microbatches,
            has_first_stage=0 in stage_ids,
            has_last_stage=len(ranges) - 1 in stage_ids,
            autocast_dtype=self._autocast_dtype(size),
            head_fn_ok=model.takes_head_fn and size["tp"] == 1 and size["pp"] == 1,
            attention=model.attention,
        )
        if size["pp"] > 1:
            result.schedule = pipeline.build_schedule(
                parts,
                stage_ids,
                len(ranges),
                options.pipeline,
                microbatches=microbatches,
                loss_fn=result._scaled_loss,
                device=device,
                group=device_mesh["pp"].get_group(),
            )
        return result

    def _autocast_dtype(self, size: dict[str, int]) -> torch.dtype | None:
        wrapped = size["dp_shard"] * size["cp"] > 1 or size["dp_replicate"] > 1
        dtype: torch.dtype = getattr(torch, self.options.param_dtype)  # one of options.DTYPES
        return None if wrapped or dtype == torch.float32 else dtype

    def _apply(
        self,
        part: nn.Module,
        blocks: list[tuple[int, nn.Module]],
        model: ModelDescription,
        device_mesh: DeviceMesh,
        size: dict[str, int],
    ) -> None:
        options = self.options
        data_sharded = size["dp_shard"] * size["cp"] > 1
        if options.float8:
            convert_to_float8(part, fsdp_all_gather=data_sharded)
        if size["tp"] > 1:
            apply_tensor_parallel(
                part,
                dict(model.tp_plan),
                device_mesh["tp"],
                sequence_parallel=options.sequence_parallel,
                loss_parallel=options.loss_parallel,
                strict=False,
            )
        experts = expert_modules(part) if size["ep"] > 1 else []
        split_experts(experts, device_mesh["ep"])
        apply_activation_checkpointing(
            [b for i, b in blocks], options.activation_checkpointing, [i for i, b in blocks]
        )
        if options.compile:
            for _, block in blocks:
                block.compile()
        modules = [b for _, b in blocks]
        if data_sharded:
            # the experts first: FSDP over the data ranks that hold the same experts, so the
            # blocks' FSDP below leaves their parameters alone
            shard_expert_data(experts, device_mesh, options, pipelined=size["pp"] > 1)
            dims = ("dp_replicate", "dp_shard_cp") if size["dp_replicate"] > 1 else "dp_shard_cp"
            apply_fsdp(part, modules, device_mesh[dims], options, pipelined=size["pp"] > 1)
        elif size["dp_replicate"] > 1:
            apply_ddp(part, modules, device_mesh["dp_replicate"], options)


def keep_buffers(module: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(buffer, a copy of its value) for each buffer of `module` itself."""
    return [(b, b.detach().clone()) for b in module.buffers(recurse=False)]


@torch.no_grad()
def restore_unless(applied: torch.Tensor, kept: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Each buffer takes back its kept value where `applied` is False, on the device."""
    for buffer, value in kept:
        torch.where(applied, buffer, value, out=buffer)
