"""`DefaultStrategy` in a world of one process: `Parallelized` steps give the plain model's loss
and gradients, weights load and come back exactly, and a pipeline of several stages on one rank
trains like the whole model."""

from __future__ import annotations

import copy

import attrs
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from llmtrain.core_mesh.mesh import DIM_NAMES, MeshSpec
from llmtrain.parallel import pipeline
from llmtrain.parallel.options import ActivationCheckpointing, ParallelOptions, Pipeline
from llmtrain.parallel.strategy import DefaultStrategy, Parallelized

CPU = torch.device("cpu")


def parallelize(model, mesh, microbatches=1, options=None) -> Parallelized:
    strategy = DefaultStrategy(options or ParallelOptions())
    return strategy.parallelize(model.describe(), mesh, CPU, microbatches=microbatches)


def plain_mean_loss_grads(model, tokens, targets, doc_starts=None):
    logits = model(tokens, doc_starts)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def grads_of(parts) -> dict[str, torch.Tensor]:
    return {n: p.grad for part in parts for n, p in part.named_parameters()}


def assert_same_grads(got: dict, expected: dict) -> None:
    assert set(got) == set(expected)
    for name, grad in expected.items():
        assert got[name] is not None, name
        torch.testing.assert_close(got[name], grad, msg=name)


@pytest.mark.parametrize("microbatches", [1, 2, 4])
def test_forward_backward_equals_plain_mean_loss(
    one_process_mesh, make_toy, toy_batch, loss_fn, microbatches
):
    model = make_toy()
    plain = copy.deepcopy(model)
    tokens, targets = toy_batch(4, 16)
    par = parallelize(model, one_process_mesh, microbatches)
    assert par.parts == [model] and par.schedule is None
    total = par.forward_backward(tokens, targets, loss_fn, scale=1.0 / targets.numel())
    expected_loss, expected_grads = plain_mean_loss_grads(plain, tokens, targets)
    assert total.shape == () and total.dtype == torch.float32 and not total.requires_grad
    torch.testing.assert_close(total / targets.numel(), expected_loss)
    assert_same_grads(grads_of(par.parts), expected_grads)


def test_gradients_accumulate_over_calls(one_process_mesh, make_toy, toy_batch, loss_fn):
    model = make_toy()
    plain = copy.deepcopy(model)
    tokens, targets = toy_batch(4, 16)
    par = parallelize(model, one_process_mesh, microbatches=2)
    n = targets.numel()
    first = par.forward_backward(tokens[:2], targets[:2], loss_fn, scale=1.0 / n)
    second = par.forward_backward(tokens[2:], targets[2:], loss_fn, scale=1.0 / n)
    expected_loss, expected_grads = plain_mean_loss_grads(plain, tokens, targets)
    torch.testing.assert_close((first + second) / n, expected_loss)
    assert_same_grads(grads_of(par.parts), expected_grads)


def test_document_starts_are_split_with_the_micro_batches(
    one_process_mesh, make_toy, toy_batch, loss_fn
):
    model = make_toy()
    plain = copy.deepcopy(model)
    tokens, targets = toy_batch(4, 16)
    g = torch.Generator().manual_seed(3)
    doc_starts = torch.rand(4, 16, generator=g) < 0.2
    doc_starts[0, 5] = doc_starts[3, 9] = True
    par = parallelize(model, one_process_mesh, microbatches=2)
    total = par.forward_backward(
        tokens, targets, loss_fn, scale=1.0 / targets.numel(), doc_starts=doc_starts
    )
    expected_loss, expected_grads = plain_mean_loss_grads(plain, tokens, targets, doc_starts)
    torch.testing.assert_close(total / targets.numel(), expected_loss)
    assert_same_grads(grads_of(par.parts), expected_grads)
    # guard: the document starts did change the loss
    unmasked = loss_fn(copy.deepcopy(plain)(tokens), targets) / targets.numel()
    assert abs(unmasked.item() - expected_loss.item()) > 1e-4


def test_activation_checkpointing_through_the_strategy(
    one_process_mesh, make_toy, toy_batch, loss_fn
):
    model = make_toy(dropout=0.1)
    plain = copy.deepcopy(model)
    tokens, targets = toy_batch(4, 16)
    options = ParallelOptions(activation_checkpointing=ActivationCheckpointing(mode="blocks"))
    par = parallelize(model, one_process_mesh, microbatches=1, options=options)
    runs = [0] * len(model.blocks)
    for i, block in enumerate(model.blocks.values()):
        block.attn_norm.register_forward_pre_hook(lambda *_, i=i: runs.__setitem__(i, runs[i] + 1))
    torch.manual_seed(7)
    total = par.forward_backward(tokens, targets, loss_fn, scale=1.0 / targets.numel())
    # `blocks` with every 2: blocks 0 and 2 ran again in backward, 1 and 3 did not
    assert runs == [2, 1, 2, 1]
    torch.manual_seed(7)
    expected_loss, expected_grads = plain_mean_loss_grads(plain, tokens, targets)
    torch.testing.assert_close(total / targets.numel(), expected_loss)
    assert_same_grads(grads_of(par.parts), expected_grads)


def test_evaluate_gives_the_loss_without_gradients(one_process_mesh, make_toy, toy_batch, loss_fn):
    model = make_toy()
    tokens, targets = toy_batch(4, 16)
    par = parallelize(model, one_process_mesh, microbatches=2)
    par.train(False)
    assert not model.training
    with torch.no_grad():
        expected = loss_fn(copy.deepcopy(model)(tokens), targets)
    got = par.evaluate(tokens, targets, loss_fn)
    torch.testing.assert_close(got, expected)
    assert not got.requires_grad
    assert all(p.grad is None for p in par.parameters())
    # after a training step, evaluating leaves its gradients alone
    par.train(True)
    assert model.training
    par.forward_backward(tokens, targets, loss_fn, scale=0.5)
    before = {n: g.clone() for n, g in grads_of(par.parts).items()}
    torch.testing.assert_close(par.evaluate(tokens, targets, loss_fn), expected)
    for name, grad in grads_of(par.parts).items():
        assert torch.equal(grad, before[name]), name


def test_evaluate_passes_further_model_inputs(one_process_mesh, make_toy, toy_batch, loss_fn):
    model = make_toy()
    tokens, targets = toy_batch(2, 8)
    positions = torch.arange(3, 11).unsqueeze(0)  # what a packed row's continuation gets
    with torch.no_grad():
        expected = loss_fn(copy.deepcopy(model)(tokens, positions=positions), targets)
    par = parallelize(model, one_process_mesh)
    got = par.evaluate(tokens, targets, loss_fn, inputs={"positions": positions})
    torch.testing.assert_close(got, expected)
    assert not torch.allclose(got, par.evaluate(tokens, targets, loss_fn))


def test_evaluate_refuses_further_inputs_on_a_pipeline(
    one_process_mesh, make_toy, toy_batch, loss_fn
):
    tokens, targets = toy_batch(4, 16)
    par = one_rank_pipeline(make_toy(), one_process_mesh, "GPipe", 2)
    with pytest.raises(ValueError, match=r"model inputs \['positions'\] need a layout"):
        par.evaluate(tokens, targets, loss_fn, inputs={"positions": torch.arange(16)[None]})


def test_clip_grad_norm_is_torchs(one_process_mesh, make_toy, toy_batch, loss_fn):
    model = make_toy()
    plain = copy.deepcopy(model)
    tokens, targets = toy_batch(4, 16)
    par = parallelize(model, one_process_mesh)
    par.forward_backward(tokens, targets, loss_fn, scale=1.0)
    loss_fn(plain(tokens), targets).backward()
    measured = par.clip_grad_norm_(None).item()
    expected = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.25)
    assert measured == pytest.approx(expected.item(), rel=1e-5)
    assert measured > 0.25
    assert par.clip_grad_norm_(0.25).item() == pytest.approx(measured, rel=1e-6)
    assert_same_grads(grads_of(par.parts), {n: p.grad for n, p in plain.named_parameters()})
    assert par.clip_grad_norm_(None).item() == pytest.approx(0.25, rel=1e-4)


def test_materialize_a_model_built_on_the_meta_device(
    one_process_mesh, make_toy, toy_batch, loss_fn
):
    with torch.device("meta"):
        model = make_toy()
    assert all(p.is_meta for p in model.parameters())
    par = parallelize(model, one_process_mesh)
    calls = []

    def init(part):
        calls.append(part)
        # in place on parameters that require grad: materialize runs this under no_grad
        for i, p in enumerate(part.parameters()):
            p.fill_(0.01 * (i % 7) - 0.02)

    par.materialize(init)
    assert calls == par.parts == [model]
    for i, p in enumerate(model.parameters()):
        assert p.device == CPU and not p.is_meta and p.requires_grad
        assert torch.all(p == 0.01 * (i % 7) - 0.02)
    tokens, targets = toy_batch(2, 8)
    total = par.forward_backward(tokens, targets, loss_fn)
    assert torch.isfinite(total) and total > 0
    assert all(p.grad is not None and p.grad.device == CPU for p in model.parameters())


def test_full_state_dict_round_trip(one_process_mesh, make_toy):
    model = make_toy()
    par = parallelize(model, one_process_mesh)
    source = make_toy(seed=11).state_dict()
    state = {k: v.clone() for k, v in source.items()}
    state["not.this.model.weight"] = torch.ones(3)  # another part's key: left alone
    par.load_full_state_dict(state)
    full = par.full_state_dict()
    assert set(full) == set(source) == set(model.state_dict())
    for key, value in source.items():
        assert torch.equal(full[key], value), key
        assert torch.equal(model.state_dict()[key], value), key


def test_layout_facts_of_one_process(one_process_mesh, make_toy):
    par = parallelize(make_toy(), one_process_mesh)
    assert par.data_rank == 0 and par.data_world == 1
    assert par.spec == MeshSpec(**dict.fromkeys(DIM_NAMES, 1))
    assert all(par.size(name) == 1 for name in (*DIM_NAMES, "dp", "dp_cp", "dp_shard_cp"))
    assert par.has_first_stage and par.has_last_stage
    value = torch.tensor([3.0, 4.0])
    summed = par.sum_over_data(value)
    assert torch.equal(summed, value) and summed is not value
    assert sum(p.numel() for p in par.parameters()) == par.parts[0].describe().n_params


def test_a_batch_that_does_not_split_into_micro_batches(
    one_process_mesh, make_toy, toy_batch, loss_fn
):
    par = parallelize(make_toy(), one_process_mesh, microbatches=2)
    tokens, targets = toy_batch(3, 8)
    with pytest.raises(ValueError, match="a batch of 3 sequences does not split into 2 micro"):
        par.forward_backward(tokens, targets, loss_fn)
    assert all(p.grad is None for p in par.parameters())


# -- several pipeline stages on this one rank ----------------------------------------------------


def one_rank_pipeline(model, mesh, schedule: str, microbatches: int) -> Parallelized:
    options = ParallelOptions(pipeline=Pipeline(schedule=schedule))
    ranges = pipeline.split_blocks(len(model.blocks), 2)
    stage_ids = pipeline.stages_of_rank(0, 1, 2, schedule)
    parts = pipeline.build_stage_modules(model, type(model).trim_to_stage, stage_ids, ranges)
    result = Parallelized(parts, mesh, CPU, options, microbatches=microbatches)
    result.schedule = pipeline.build_schedule(
        parts,
        stage_ids,
        len(ranges),
        options.pipeline,
        microbatches=microbatches,
        loss_fn=result._scaled_loss,
        device=CPU,
        group=dist.group.WORLD,
    )
    return result


MULTI_STAGE = [
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
]


@pytest.mark.parametrize("microbatches", [2, 4])
@pytest.mark.parametrize("schedule", MULTI_STAGE)
def test_pipeline_schedule_on_one_rank_trains_like_the_whole_model(
    one_process_mesh, make_toy, toy_batch, loss_fn, schedule, microbatches
):
    model = make_toy()
    plain = copy.deepcopy(model)
    tokens, targets = toy_batch(4, 16)
    par = one_rank_pipeline(model, one_process_mesh, schedule, microbatches)
    assert len(par.parts) == 2
    total = par.forward_backward(tokens, targets, loss_fn, scale=1.0 / targets.numel())
    expected_loss, expected_grads = plain_mean_loss_grads(plain, tokens, targets)
    torch.testing.assert_close(total / targets.numel(), expected_loss)
    assert_same_grads(grads_of(par.parts), expected_grads)
    assert par.clip_grad_norm_(None).item() == pytest.approx(
        torch.nn.utils.get_total_norm(list(expected_grads.values())).item(), rel=1e-5
    )


@pytest.mark.parametrize("schedule", ["ZBVZeroBubble", "DualPipeV"])
def test_v_pipeline_evaluate_gives_the_loss_and_leaves_gradients(
    one_process_mesh, make_toy, toy_batch, loss_fn, schedule
):
    model = make_toy()
    plain = copy.deepcopy(model)
    tokens, targets = toy_batch(4, 16)
    par = one_rank_pipeline(model, one_process_mesh, schedule, 2)
    with torch.no_grad():
        expected = loss_fn(plain(tokens), targets)
    torch.testing.assert_close(par.evaluate(tokens, targets, loss_fn), expected)
    par.forward_backward(tokens, targets, loss_fn, scale=1.0 / targets.numel())
    before = {n: g.clone() for n, g in grads_of(par.parts).items()}
    torch.testing.assert_close(par.evaluate(tokens, targets, loss_fn), expected)
    for name, grad in grads_of(par.parts).items():
        assert torch.equal(grad, before[name]), name


@pytest.mark.parametrize("microbatches", [1, 2])
def test_a_loss_that_takes_hidden_states_gets_them_and_the_same_gradients(
    one_process_mesh, make_toy, toy_batch, hidden_state_loss, microbatches
):
    model = make_toy()
    plain = copy.deepcopy(model)
    tokens, targets = toy_batch(4, 16)
    par = parallelize(model, one_process_mesh, microbatches)
    assert par.head_fn_ok
    total = par.forward_backward(tokens, targets, hidden_state_loss, scale=1.0 / targets.numel())
    assert hidden_state_loss.calls == {"logits": 0, "hidden": microbatches}
    expected_loss, expected_grads = plain_mean_loss_grads(plain, tokens, targets)
    torch.testing.assert_close(total / targets.numel(), expected_loss)
    assert_same_grads(grads_of(par.parts), expected_grads)
    evaluated = par.evaluate(tokens, targets, hidden_state_loss)
    assert hidden_state_loss.calls["hidden"] == microbatches + 1
    torch.testing.assert_close(evaluated, total)


def test_a_model_without_head_fn_hands_the_loss_logits(
    one_process_mesh, make_toy, toy_batch, hidden_state_loss
):
    description = attrs.evolve(make_toy().describe(), takes_head_fn=False)
    par = DefaultStrategy(ParallelOptions()).parallelize(description, one_process_mesh, CPU)
    assert not par.head_fn_ok
    tokens, targets = toy_batch(2, 16)
    par.forward_backward(tokens, targets, hidden_state_loss)
    assert hidden_state_loss.calls == {"logits": 1, "hidden": 0}
