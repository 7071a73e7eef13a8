"""Check a parallel layout against the world, the model and the run before any process group
exists: every problem in one message, each naming the config key to change. What the model's
attention computes comes from its description (`ModelDescription.attention`)."""

from __future__ import annotations

from llmtrain.core_mesh.errors import UserError
from llmtrain.core_mesh.interfaces import AttentionDescription, ExpertParallel, ModelDescription
from llmtrain.core_mesh.mesh import MeshError, MeshSpec
from llmtrain.parallel.float8 import float8_problem
from llmtrain.parallel.options import SINGLE_STAGE_SCHEDULES, V_SCHEDULES, ParallelOptions


class LayoutError(UserError):
    pass


def check_layout(
    options: ParallelOptions,
    mesh: MeshSpec,
    world_size: int,
    model: ModelDescription,
    *,
    seq_len: int,
    device_type: str,
    microbatches: int = 1,
) -> MeshSpec:
    """The resolved mesh spec, or a LayoutError listing every problem."""
    problems: list[str] = []
    try:
        mesh = mesh.resolve(world_size)
    except MeshError as e:
        problems.append(str(e))
    problems += _tensor_parallel(options, mesh, model, seq_len)
    problems += _pipeline(options, mesh, model, microbatches)
    problems += _context_parallel(options, mesh, seq_len, model.attention)
    problems += _expert_parallel(mesh, model)
    if options.float8 and (why := float8_problem(device_type)):
        problems.append(f"parallel.float8: {why}; set parallel.float8: false")
    if problems:
        raise LayoutError(
            "the parallel layout cannot run:\n" + "\n".join(f"  - {p}" for p in problems)
        )
    return mesh


def _tensor_parallel(
    options: ParallelOptions, mesh: MeshSpec, model: ModelDescription, seq_len: int
) -> list[str]:
    problems = []
    if mesh.tp > 1 and not model.tp_plan:
        problems.append(
            f"mesh.tp={mesh.tp}: the model has no tensor-parallel plan (its options, e.g. a "
            "query/key norm over all heads or norms after each sublayer, cannot be split across "
            "ranks); use mesh.tp: 1 and shard with FSDP instead"
        )
        return problems
    local = seq_len // mesh.cp
    if options.sequence_parallel and mesh.tp > 1 and local % mesh.tp:
        problems.append(
            f"mesh.tp={mesh.tp}: with parallel.sequence_parallel the sequence length {local}"
            + (" (per cp rank)" if mesh.cp > 1 else "")
            + f" must be divisible by {mesh.tp}; change the length or set "
            "parallel.sequence_parallel: false"
        )
    for count, what in ((model.n_heads, "attention heads"), (model.n_kv_heads, "key/value heads")):
        # None: a model without attention heads, nothing of them to divide (its tp_plan says
        # what tensor parallelism splits)
        if count is not None and count % mesh.tp:
            problems.append(
                f"mesh.tp={mesh.tp} does not divide the model's {count} {what}; "
                "choose a tp degree that divides both head counts"
            )
    return problems


def _pipeline(
    options: ParallelOptions, mesh: MeshSpec, model: ModelDescription, microbatches: int
) -> list[str]:
    if mesh.pp == 1:
        return []
    pipe = options.pipeline
    per_rank = pipe.resolved_stages_per_rank
    problems = []
    if model.trim_to_stage is None:
        reason = (
            "its output layer shares the embedding's weight; set model.tied_embeddings: false"
            if model.tied_embeddings
            else "it does not say how to cut itself into stages"
        )
        problems.append(f"mesh.pp={mesh.pp}: this model cannot be pipelined: {reason}")
    if pipe.schedule in SINGLE_STAGE_SCHEDULES and per_rank != 1:
        problems.append(
            f"parallel.pipeline.stages_per_rank={per_rank}: schedule {pipe.schedule} runs one "
            "stage per rank; use Interleaved1F1B or another multi-stage schedule"
        )
    if pipe.schedule in V_SCHEDULES and per_rank != 2:
        problems.append(
            f"parallel.pipeline.stages_per_rank={per_rank}: schedule {pipe.schedule} runs "
            "exactly 2 stages per rank"
        )
    n_stages = mesh.pp * per_rank
    n_blocks = len(model.blocks)
    if n_stages > n_blocks:
        problems.append(
            f"mesh.pp={mesh.pp} x {per_rank} stages per rank = {n_stages} pipeline stages, but "
            f"the model has only {n_blocks} blocks; lower mesh.pp or stages_per_rank"
        )
    if microbatches < mesh.pp:
        problems.append(
            f"{microbatches} micro-batches per step cannot fill a pipeline of {mesh.pp} ranks; "
            f"set the gradient accumulation (data.grad_accum) to at least {mesh.pp} so every "
            "stage has work"
        )
    return problems


def _context_parallel(
    options: ParallelOptions, mesh: MeshSpec, seq_len: int, attention: AttentionDescription
) -> list[str]:
    if mesh.cp == 1:
        return []
    problems = []
    pieces = 2 * mesh.cp if options.context_parallel.load_balance else mesh.cp
    if seq_len % pieces:
        problems.append(
            f"mesh.cp={mesh.cp}: the sequence length {seq_len} must be divisible by {pieces} "
            + (
                "(2 x cp chunks for load balancing)"
                if options.context_parallel.load_balance
                else ""
            )
        )
    # a compiled block's checkpoint traces attention without the gathered keys: the numbers come
    # out wrong without an error (seen on gloo), so the combination is refused
    checkpointing = options.activation_checkpointing.mode
    if options.compile and checkpointing != "none":
        problems.append(
            f"mesh.cp={mesh.cp} with parallel.compile and activation_checkpointing.mode="
            f"{checkpointing}: a compiled, checkpointed block attends without the other ranks' "
            "keys; set parallel.compile: false or activation_checkpointing.mode: none"
        )
    # masks (documents, windows) are the model's: it builds them over every key and context
    # parallelism gathers the keys for them. A change to the scores is not a mask: the gathered
    # attention runs through scaled_dot_product_attention, which cannot apply one
    if attention.score_mod is not None:
        problems.append(
            f"mesh.cp={mesh.cp}: the model's attention changes its scores before the softmax "
            f"({attention.score_mod}), which context parallelism cannot do over the gathered "
            "keys (it attends through scaled_dot_product_attention); set mesh.cp: 1 and "
            "shard with FSDP or tp, or turn the score change off"
            + (
                " (model.attention.softcap: null)"
                if attention.score_mod.startswith("softcap")
                else ""
            )
        )
    return problems


def _expert_parallel(mesh: MeshSpec, model: ModelDescription) -> list[str]:
    if mesh.ep == 1:
        return []
    experts = [m for m in model.module.modules() if isinstance(m, ExpertParallel)]
    if not experts:
        return [
            f"mesh.ep={mesh.ep}: the model has no Mixture-of-Experts layers to split; "
            "set mesh.ep: 1"
        ]
    problems = []
    counts = sorted({m.n_experts for m in experts})
    if any(n % mesh.ep for n in counts):
        problems.append(
            f"mesh.ep={mesh.ep} must divide the model's expert count "
            f"({', '.join(map(str, counts))}); choose an ep that divides it"
        )
    # the MoE layers route whole sequences on every tp rank and each cp shard balances its own
    # tokens: expert parallelism over those ranks is not built
    for degree, name in ((mesh.tp, "tp"), (mesh.cp, "cp")):
        if degree > 1:
            problems.append(
                f"mesh.ep={mesh.ep} with mesh.{name}={degree}: expert parallelism composes with "
                f"FSDP, HSDP and pipelines only; set mesh.{name}: 1 or mesh.ep: 1"
            )
    return problems
