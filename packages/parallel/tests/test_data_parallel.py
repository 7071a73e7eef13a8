"""Data parallelism on a one-rank mesh: FSDP2 and DDP wrap the model without changing its numbers,
and `Parallelized` loads and returns full weights of sharded (DTensor) parameters."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from llmtrain.parallel.data_parallel import (
    apply_ddp,
    apply_fsdp,
    mixed_precision,
    set_gradient_sync,
    should_reshard,
)
from llmtrain.parallel.options import ParallelOptions
from llmtrain.parallel.strategy import Parallelized


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


@pytest.mark.parametrize(
    ("setting", "pipelined", "is_last", "expected"),
    [
        ("always", False, False, True),
        ("always", True, True, True),
        ("never", False, False, False),
        ("never", True, True, False),
        # default: free parameters after forward, except where they are needed again at once
        ("default", False, False, True),
        ("default", False, True, False),
        ("default", True, False, False),
        ("default", True, True, False),
    ],
)
def test_reshard_after_forward(setting, pipelined, is_last, expected):
    options = ParallelOptions(reshard_after_forward=setting)
    assert should_reshard(options, pipelined, is_last) is expected


def test_mixed_precision_policy():
    policy = mixed_precision(ParallelOptions(param_dtype="bfloat16", reduce_dtype="float32"))
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    policy = mixed_precision(ParallelOptions())
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.float32, torch.float32)


def test_gradient_sync_toggle_ignores_plain_modules(make_toy):
    model = make_toy(n_layers=1)
    set_gradient_sync(model, False)  # not an FSDP module: nothing to do, nothing raised
    assert not isinstance(model, FSDPModule)


@pytest.mark.parametrize("kind", ["fsdp", "ddp"])
def test_one_rank_data_parallel_keeps_the_numbers(
    one_process_mesh, make_toy, toy_batch, loss_fn, kind
):
    model = make_toy()
    plain = copy.deepcopy(model)
    blocks = list(model.blocks.values())
    options = ParallelOptions()
    if kind == "fsdp":
        apply_fsdp(model, blocks, one_process_mesh["dp_shard_cp"], options, pipelined=False)
    else:
        apply_ddp(model, blocks, one_process_mesh["dp_replicate"], options)
    assert isinstance(model.head.weight, DTensor)
    # DDP goes through FSDP2's machinery too, so micro-batches can skip its gradient sync
    assert isinstance(model, FSDPModule)
    par = Parallelized([model], one_process_mesh, torch.device("cpu"), options, microbatches=2)
    tokens, targets = toy_batch(4, 16)
    total = par.forward_backward(tokens, targets, loss_fn, scale=1.0 / targets.numel())

    loss = loss_fn(plain(tokens), targets)
    (loss / targets.numel()).backward()
    torch.testing.assert_close(total, loss.detach())
    plain_params = dict(plain.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(full(p.grad), plain_params[name].grad, msg=name)
    expected_norm = torch.nn.utils.get_total_norm([p.grad for p in plain.parameters()])
    assert par.clip_grad_norm_(None).item() == pytest.approx(expected_norm.item(), rel=1e-5)

    # full (unsharded) weights in, the same weights out
    state = {k: torch.randn_like(v) for k, v in plain.state_dict().items()}
    par.load_full_state_dict(state)
    got = par.full_state_dict()
    assert set(got) == set(state)
    for key, value in state.items():
        assert not isinstance(got[key], DTensor)
        assert torch.equal(got[key], value), key
    for name, p in model.named_parameters():
        assert torch.equal(full(p.detach()), state[name]), name
