"""`check_layout`: every problem of a parallel layout in one UserError, each naming the key to
change; a good layout comes back resolved."""

from __future__ import annotations

import sys
import types

import attrs
import pytest
import torch

from llmtrain.core_mesh.errors import UserError
from llmtrain.core_mesh.interfaces import AttentionDescription
from llmtrain.core_mesh.mesh import MeshSpec
from llmtrain.parallel.float8 import float8_problem
from llmtrain.parallel.layout import LayoutError, check_layout
from llmtrain.parallel.options import (
    ActivationCheckpointing,
    ContextParallel,
    ParallelOptions,
    Pipeline,
)
from llmtrain.parallel.strategy import DefaultStrategy

HEADER = "the parallel layout cannot run:\n"


@pytest.fixture
def describe(make_toy):
    """`describe(**config)`: the toy model's description (4 heads, 2 key/value heads)."""

    def make(**config):
        return make_toy(**config).describe()

    return make


def problems_of(
    describe,
    *,
    options=None,
    mesh=None,
    world_size=1,
    model=None,
    seq_len=16,
    device_type="cpu",
    microbatches=1,
) -> list[str]:
    with pytest.raises(LayoutError) as info:
        check_layout(
            options or ParallelOptions(),
            mesh or MeshSpec(),
            world_size,
            model or describe(),
            seq_len=seq_len,
            device_type=device_type,
            microbatches=microbatches,
        )
    assert isinstance(info.value, UserError)
    message = str(info.value)
    assert message.startswith(HEADER)
    lines = message.removeprefix(HEADER).split("\n")
    assert all(line.startswith("  - ") for line in lines)
    return [line.removeprefix("  - ") for line in lines]


def test_good_layouts_come_back_resolved(describe):
    model = describe(n_layers=4)
    run = {"seq_len": 16, "device_type": "cpu"}
    assert check_layout(ParallelOptions(), MeshSpec(), 1, model, **run) == MeshSpec(dp_shard=1)
    got = check_layout(ParallelOptions(), MeshSpec(tp=2, cp=2), 16, model, **run)
    assert got == MeshSpec(dp_shard=4, tp=2, cp=2)
    assert got.size == 16
    got = check_layout(ParallelOptions(), MeshSpec(pp=2, tp=2), 8, model, microbatches=2, **run)
    assert got.shape == (2, 1, 2, 1, 2)
    explicit = MeshSpec(dp_replicate=2, dp_shard=2)
    assert check_layout(ParallelOptions(), explicit, 4, model, **run) == explicit
    # the strategy's check is the same check
    strategy = DefaultStrategy(ParallelOptions())
    assert strategy.check(MeshSpec(tp=2), 4, model, **run) == MeshSpec(tp=2, dp_shard=2)


def test_world_the_mesh_cannot_hold(describe):
    [problem] = problems_of(describe, mesh=MeshSpec(dp_replicate=3, tp=2), world_size=8)
    assert problem.startswith("mesh pp=1 x dp_replicate=3 x dp_shard=-1 x cp=1 x tp=2")
    assert "needs a multiple of 6 processes" in problem and "the world has 8" in problem
    [problem] = problems_of(describe, mesh=MeshSpec(dp_shard=2, tp=2), world_size=8)
    assert problem.startswith("mesh ")
    assert "multiplies to 4 processes, but the world has 8" in problem


def test_tp_must_divide_both_head_counts(describe):
    # 4 attention heads, 2 key/value heads
    [problem] = problems_of(describe, mesh=MeshSpec(tp=4), world_size=4)
    assert problem.startswith("mesh.tp=4 does not divide the model's 2 key/value heads")
    both = problems_of(describe, mesh=MeshSpec(tp=3), world_size=3, seq_len=48)
    assert both == [
        "mesh.tp=3 does not divide the model's 4 attention heads; "
        "choose a tp degree that divides both head counts",
        "mesh.tp=3 does not divide the model's 2 key/value heads; "
        "choose a tp degree that divides both head counts",
    ]
    model = describe(n_heads=8, n_kv_heads=8)
    assert check_layout(
        ParallelOptions(), MeshSpec(tp=4), 4, model, seq_len=16, device_type="cpu"
    ) == MeshSpec(tp=4, dp_shard=1)


def test_a_model_without_attention_heads_is_laid_out_by_its_tp_plan(describe):
    # ModelDescription's n_heads / n_kv_heads are optional: a model without attention (the
    # reference plugin llmtrain-toy-lm is one) leaves them None, and no head count is checked
    model = attrs.evolve(describe(), n_heads=None, n_kv_heads=None)
    assert check_layout(
        ParallelOptions(), MeshSpec(tp=3), 3, model, seq_len=48, device_type="cpu"
    ) == MeshSpec(tp=3, dp_shard=1)


def test_a_model_without_a_tp_plan_refuses_tensor_parallelism(describe):
    # what a model says when its options cannot be split across tensor-parallel ranks
    model = attrs.evolve(describe(), tp_plan={})
    [problem] = problems_of(describe, mesh=MeshSpec(tp=2), world_size=2, model=model)
    assert problem.startswith("mesh.tp=2: the model has no tensor-parallel plan")
    assert problem.endswith("use mesh.tp: 1 and shard with FSDP instead")
    # the same model shards with FSDP
    got = check_layout(ParallelOptions(), MeshSpec(), 2, model, seq_len=16, device_type="cpu")
    assert got == MeshSpec(dp_shard=2)


def test_more_pipeline_stages_than_blocks(describe):
    [problem] = problems_of(
        describe, mesh=MeshSpec(pp=8), world_size=8, model=describe(n_layers=4), microbatches=8
    )
    assert problem.startswith("mesh.pp=8 x 1 stages per rank = 8 pipeline stages")
    assert "only 4 blocks" in problem
    looped = ParallelOptions(pipeline=Pipeline(schedule="Interleaved1F1B", stages_per_rank=3))
    [problem] = problems_of(
        describe, options=looped, mesh=MeshSpec(pp=2), world_size=2, microbatches=2
    )
    assert problem.startswith("mesh.pp=2 x 3 stages per rank = 6 pipeline stages")
    # exactly as many stages as blocks is fine
    ok = ParallelOptions(pipeline=Pipeline(schedule="Interleaved1F1B", stages_per_rank=2))
    run = {"seq_len": 16, "device_type": "cpu", "microbatches": 2}
    assert check_layout(ok, MeshSpec(pp=2), 2, describe(n_layers=4), **run).pp == 2


def test_single_stage_schedule_takes_one_stage_per_rank(describe):
    for schedule in ("GPipe", "1F1B"):
        options = ParallelOptions(pipeline=Pipeline(schedule=schedule, stages_per_rank=2))
        [problem] = problems_of(
            describe, options=options, mesh=MeshSpec(pp=2), world_size=2, microbatches=2
        )
        assert problem.startswith(
            f"parallel.pipeline.stages_per_rank=2: schedule {schedule} runs one stage per rank"
        )


@pytest.mark.parametrize("schedule", ["ZBVZeroBubble", "DualPipeV"])
@pytest.mark.parametrize("per_rank", [1, 3])
def test_v_schedules_take_two_stages_per_rank(describe, schedule, per_rank):
    options = ParallelOptions(pipeline=Pipeline(schedule=schedule, stages_per_rank=per_rank))
    [problem] = problems_of(
        describe,
        options=options,
        mesh=MeshSpec(pp=2),
        world_size=2,
        model=describe(n_layers=8),
        microbatches=2,
    )
    assert problem == (
        f"parallel.pipeline.stages_per_rank={per_rank}: schedule {schedule} runs exactly 2 "
        "stages per rank"
    )
    # left unset, the V schedules resolve to 2 and pass
    default = ParallelOptions(pipeline=Pipeline(schedule=schedule))
    run = {"seq_len": 16, "device_type": "cpu", "microbatches": 2}
    assert check_layout(default, MeshSpec(pp=2), 2, describe(n_layers=4), **run).pp == 2


def test_pipeline_needs_enough_micro_batches(describe):
    [problem] = problems_of(describe, mesh=MeshSpec(pp=4), world_size=4, microbatches=3)
    assert problem.startswith("3 micro-batches per step cannot fill a pipeline of 4 ranks")
    assert "gradient accumulation (data.grad_accum) to at least 4" in problem
    run = {"seq_len": 16, "device_type": "cpu", "microbatches": 4}
    assert check_layout(ParallelOptions(), MeshSpec(pp=4), 4, describe(), **run).pp == 4


def test_tied_embeddings_cannot_be_pipelined(describe):
    model = describe(tied_embeddings=True)
    assert model.tied_embeddings and model.trim_to_stage is None
    [problem] = problems_of(
        describe, mesh=MeshSpec(pp=2), world_size=2, model=model, microbatches=2
    )
    assert problem.startswith("mesh.pp=2: this model cannot be pipelined")
    assert "set model.tied_embeddings: false" in problem


def test_model_that_cannot_cut_itself_cannot_be_pipelined(describe):
    model = describe(can_trim=False)
    [problem] = problems_of(
        describe, mesh=MeshSpec(pp=2), world_size=2, model=model, microbatches=2
    )
    assert problem == (
        "mesh.pp=2: this model cannot be pipelined: it does not say how to cut itself into stages"
    )
    # without pipeline parallelism neither matters
    run = {"seq_len": 16, "device_type": "cpu"}
    assert check_layout(ParallelOptions(), MeshSpec(dp_shard=2), 2, model, **run).dp_shard == 2
    tied = describe(tied_embeddings=True)
    assert check_layout(ParallelOptions(), MeshSpec(tp=2), 2, tied, **run).tp == 2


def test_pipeline_options_do_not_matter_without_pp(describe):
    options = ParallelOptions(pipeline=Pipeline(schedule="1F1B", stages_per_rank=5))
    got = check_layout(options, MeshSpec(), 2, describe(), seq_len=16, device_type="cpu")
    assert got == MeshSpec(dp_shard=2)


def test_context_parallel_sequence_length_with_load_balancing(describe):
    # load balancing cuts each sequence into 2 x cp chunks
    [problem] = problems_of(describe, mesh=MeshSpec(cp=2), world_size=2, seq_len=6)
    assert problem.startswith("mesh.cp=2: the sequence length 6 must be divisible by 4")
    assert "2 x cp chunks for load balancing" in problem
    run = {"device_type": "cpu"}
    assert check_layout(ParallelOptions(), MeshSpec(cp=2), 2, describe(), seq_len=8, **run).cp == 2


def test_context_parallel_sequence_length_without_load_balancing(describe):
    options = ParallelOptions(context_parallel=ContextParallel(load_balance=False))
    run = {"device_type": "cpu"}
    # 6 splits into 2 shards (only load balancing would need 4 pieces)
    assert check_layout(options, MeshSpec(cp=2), 2, describe(), seq_len=6, **run).cp == 2
    [problem] = problems_of(describe, options=options, mesh=MeshSpec(cp=2), world_size=2, seq_len=7)
    assert problem.startswith("mesh.cp=2: the sequence length 7 must be divisible by 2")
    assert "load balancing" not in problem


def with_attention(description, *layers, score_mod=None):
    """The description with its attention said to be `layers` (one tuple a block), e.g. Gemma 2's
    local and global blocks over packed documents."""
    return attrs.evolve(description, attention=AttentionDescription(layers, score_mod))


GEMMA_LIKE = (("causal", "document", "window=4"), ("causal", "document"))


@pytest.mark.parametrize(
    "layers",
    [
        (("causal", "document"),),
        (("causal", "window=4"), ("causal",)),
        GEMMA_LIKE,
    ],
)
def test_context_parallel_takes_document_masks_and_windows(describe, layers):
    # the model builds each block's mask over every key; context parallelism gathers the keys
    model = with_attention(describe(), *layers)
    assert not model.attention.plain_causal
    run = {"seq_len": 8, "device_type": "cpu"}
    assert check_layout(ParallelOptions(), MeshSpec(cp=2), 2, model, **run).cp == 2
    assert check_layout(ParallelOptions(), MeshSpec(cp=2, tp=2), 4, model, **run).cp == 2


def test_context_parallel_refuses_a_change_to_the_scores(describe):
    model = with_attention(describe(), *GEMMA_LIKE, score_mod="softcap=50.0")
    [problem] = problems_of(describe, mesh=MeshSpec(cp=2), world_size=2, seq_len=8, model=model)
    assert problem == (
        "mesh.cp=2: the model's attention changes its scores before the softmax "
        "(softcap=50.0), which context parallelism cannot do over the gathered keys (it attends "
        "through scaled_dot_product_attention); set mesh.cp: 1 and shard with FSDP or tp, or "
        "turn the score change off (model.attention.softcap: null)"
    )
    # another score change is named as it is, without the soft-capping key
    model = with_attention(describe(), score_mod="alibi")
    [problem] = problems_of(describe, mesh=MeshSpec(cp=2), world_size=2, seq_len=8, model=model)
    assert "(alibi)" in problem and problem.endswith("or turn the score change off")
    # without cp, every other split computes the scores where the model does
    model = with_attention(describe(), *GEMMA_LIKE, score_mod="softcap=50.0")
    run = {"seq_len": 8, "device_type": "cpu", "microbatches": 2}
    for mesh in (MeshSpec(), MeshSpec(tp=2), MeshSpec(pp=2)):
        assert check_layout(ParallelOptions(), mesh, 2, model, **run).cp == 1


@pytest.mark.parametrize("mode", ["full", "blocks", "ops"])
def test_context_parallel_refuses_compiled_checkpointed_blocks(describe, mode):
    # torch.compile's checkpoint traces the block's attention without the gathered keys (the
    # losses of a cp=2 run came out wrong, without an error)
    options = ParallelOptions(
        compile=True, activation_checkpointing=ActivationCheckpointing(mode=mode)
    )
    [problem] = problems_of(describe, options=options, mesh=MeshSpec(cp=2), world_size=2, seq_len=8)
    assert problem == (
        f"mesh.cp=2 with parallel.compile and activation_checkpointing.mode={mode}: a compiled, "
        "checkpointed block attends without the other ranks' keys; set parallel.compile: false "
        "or activation_checkpointing.mode: none"
    )
    # either alone is fine, and so are both without cp
    run = {"seq_len": 8, "device_type": "cpu"}
    for ok in (
        ParallelOptions(compile=True),
        ParallelOptions(activation_checkpointing=ActivationCheckpointing(mode=mode)),
    ):
        assert check_layout(ok, MeshSpec(cp=2), 2, describe(), **run).cp == 2
    assert check_layout(options, MeshSpec(dp_shard=2), 2, describe(), **run).dp_shard == 2


def test_float8_needs_a_gpu(describe):
    [problem] = problems_of(describe, options=ParallelOptions(float8=True))
    assert problem == (
        "parallel.float8: float8 training needs a CUDA GPU; this run is on cpu; "
        "set parallel.float8: false"
    )
    assert float8_problem("mps") == "float8 training needs a CUDA GPU; this run is on mps"


@pytest.fixture
def fake_cuda(monkeypatch):
    """`fake_cuda(capability)`: torch.cuda reports one GPU of that compute capability, or, with
    None, behaves as a torch without CUDA does (asking for the capability raises)."""

    def install(capability):
        def get_device_capability(device=None):
            if capability is None:
                raise AssertionError("Torch not compiled with CUDA enabled")
            return capability

        monkeypatch.setattr(torch.cuda, "is_available", lambda: capability is not None)
        monkeypatch.setattr(torch.cuda, "get_device_capability", get_device_capability)

    return install


def test_float8_needs_a_recent_gpu(fake_cuda):
    fake_cuda((8, 0))
    assert float8_problem("cuda") == (
        "float8 training needs compute capability 8.9 or newer (Ada, Hopper); this GPU has 8.0"
    )


def test_float8_needs_torchao(fake_cuda, monkeypatch):
    fake_cuda((9, 0))
    monkeypatch.setitem(sys.modules, "torchao", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    assert float8_problem("cuda") == (
        "float8 training needs torchao: pip install 'llmtrain-parallel[float8]'"
    )
    fake_torchao = types.ModuleType("torchao")
    fake_torchao.float8 = types.ModuleType("torchao.float8")
    monkeypatch.setitem(sys.modules, "torchao", fake_torchao)
    monkeypatch.setitem(sys.modules, "torchao.float8", fake_torchao.float8)
    assert float8_problem("cuda") is None


def test_float8_on_cuda_without_a_gpu_is_a_layout_problem(describe, fake_cuda):
    # e.g. `llmtrain config validate` of a cuda run on a login node without GPUs: the layout
    # check must list the problem, not crash inside torch.cuda
    fake_cuda(None)
    [problem] = problems_of(describe, options=ParallelOptions(float8=True), device_type="cuda")
    assert problem.startswith("parallel.float8: float8 training needs a CUDA GPU")


def test_sequence_parallel_needs_a_sequence_length_divisible_by_tp(describe):
    # with sequence parallelism (the default) each tp rank holds seq_len / tp positions; with 15
    # positions over tp=2 the ranks' collectives disagree on sizes and gloo aborts the process
    # (checked with torchrun: "Received data size doesn't match expected size", SIGABRT)
    problems = problems_of(describe, mesh=MeshSpec(tp=2), world_size=2, seq_len=15)
    assert len(problems) == 1
    assert "mesh.tp=2" in problems[0] and "15" in problems[0]


def test_without_sequence_parallelism_any_length_splits_over_tp(describe):
    options = ParallelOptions(sequence_parallel=False)
    run = {"seq_len": 15, "device_type": "cpu"}
    assert check_layout(options, MeshSpec(tp=2), 2, describe(), **run) == MeshSpec(tp=2, dp_shard=1)


def test_every_problem_at_once(describe):
    options = ParallelOptions(float8=True, pipeline=Pipeline(schedule="GPipe", stages_per_rank=2))
    problems = problems_of(
        describe,
        options=options,
        mesh=MeshSpec(pp=2, tp=4, cp=2, dp_shard=2),
        world_size=8,
        model=with_attention(
            describe(tied_embeddings=True, n_layers=3), *GEMMA_LIKE, score_mod="softcap=30.0"
        ),
        seq_len=10,
        microbatches=1,
    )
    expected_starts = [
        "mesh pp=2 x dp_replicate=1 x dp_shard=2 x cp=2 x tp=4 multiplies to 32 processes",
        "mesh.tp=4: with parallel.sequence_parallel the sequence length 5 (per cp rank) must be",
        "mesh.tp=4 does not divide the model's 2 key/value heads",
        "mesh.pp=2: this model cannot be pipelined: its output layer shares",
        "parallel.pipeline.stages_per_rank=2: schedule GPipe runs one stage per rank",
        "mesh.pp=2 x 2 stages per rank = 4 pipeline stages, but the model has only 3 blocks",
        "1 micro-batches per step cannot fill a pipeline of 2 ranks",
        "mesh.cp=2: the sequence length 10 must be divisible by 4",
        "mesh.cp=2: the model's attention changes its scores before the softmax (softcap=30.0)",
        "parallel.float8: float8 training needs a CUDA GPU",
    ]
    assert len(problems) == len(expected_starts)
    for problem, start in zip(problems, expected_starts, strict=True):
        assert problem.startswith(start), (problem, start)


class ToyExperts(torch.nn.Module):
    """Conforms to core-mesh's ExpertParallel: what the layout check looks for."""

    def __init__(self, n_experts: int):
        super().__init__()
        self.n_experts = n_experts

    def shard_experts(self, ep_mesh, /) -> None:
        raise AssertionError("the layout check splits nothing")


def with_experts(description, n_experts: int):
    module = torch.nn.ModuleDict({"toy": description.module, "experts": ToyExperts(n_experts)})
    return attrs.evolve(description, module=module)


def test_expert_parallelism_takes_its_ranks_from_dp_shard(describe):
    model = with_experts(describe(), 8)
    got = check_layout(ParallelOptions(), MeshSpec(ep=2), 4, model, seq_len=16, device_type="cpu")
    assert got == MeshSpec(dp_shard=4, ep=2)
    assert got.size == 4  # ep borrows ranks: it is not a factor of the world
    assert got.mesh_shape == (1, 1, 2, 2, 1, 1)  # pp, dp_replicate, dp_shard_mod_ep, ep, cp, tp
    got = check_layout(
        ParallelOptions(), MeshSpec(ep=4, pp=2), 8, model, seq_len=16, device_type="cpu",
        microbatches=2,
    )  # fmt: skip
    assert got.mesh_shape == (2, 1, 1, 4, 1, 1)
    hsdp = MeshSpec(dp_replicate=2, ep=2)
    got = check_layout(ParallelOptions(), hsdp, 8, model, seq_len=16, device_type="cpu")
    assert got.mesh_shape == (1, 2, 2, 2, 1, 1)


def test_expert_parallelism_must_divide_dp_shard(describe):
    model = with_experts(describe(), 6)
    [problem] = problems_of(describe, mesh=MeshSpec(ep=3), world_size=4, model=model)
    assert problem.startswith("mesh.ep=3 must divide mesh.dp_shard=4")


def test_expert_parallelism_needs_experts_it_divides(describe):
    [problem] = problems_of(describe, mesh=MeshSpec(ep=2), world_size=2)
    assert problem == (
        "mesh.ep=2: the model has no Mixture-of-Experts layers to split; set mesh.ep: 1"
    )
    [problem] = problems_of(
        describe, mesh=MeshSpec(ep=4), world_size=4, model=with_experts(describe(), 6)
    )
    assert problem.startswith("mesh.ep=4 must divide the model's expert count (6)")


@pytest.mark.parametrize(
    ("mesh", "name"),
    [
        (MeshSpec(ep=2, tp=2), "tp"),
        (MeshSpec(ep=2, cp=2), "cp"),
    ],
)
def test_expert_parallelism_composes_with_data_parallelism_and_pipelines_only(describe, mesh, name):
    model = with_experts(describe(), 8)
    [problem] = problems_of(describe, mesh=mesh, world_size=4, model=model)
    assert problem == (
        f"mesh.ep=2 with mesh.{name}=2: expert parallelism composes with FSDP, HSDP and "
        f"pipelines only; set mesh.{name}: 1 or mesh.ep: 1"
    )
