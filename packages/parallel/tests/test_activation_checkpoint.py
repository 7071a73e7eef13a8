"""Activation checkpointing: which blocks each mode picks, that names and weights stay, and that
recomputing gives exactly the gradients of the plain model (dropout included)."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from llmtrain.parallel import context_parallel
from llmtrain.parallel.activation_checkpoint import apply_activation_checkpointing
from llmtrain.parallel.options import ActivationCheckpointing

MATMULS = {"mm", "addmm", "bmm"}
SDPA = "_scaled_dot_product_flash_attention_for_cpu"


class CountOps(TorchDispatchMode):
    """Counts the aten ops that actually run (ops a checkpoint serves from its cache do not)."""

    def __init__(self):
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    def matmuls(self) -> int:
        return sum(self.counts[name] for name in MATMULS)


def checkpointed(model, mode: str, every: int = 2, indices=None) -> int:
    options = ActivationCheckpointing(mode=mode, every=every)
    return apply_activation_checkpointing(list(model.blocks.values()), options, indices)


def block_runs(model, tokens, targets, loss_fn) -> list[int]:
    """How many times each block started (its first norm ran) over one forward and backward."""
    runs = Counter()
    # a pre-hook: a recompute stops early, once it has every tensor backward needs
    handles = [
        block.attn_norm.register_forward_pre_hook(lambda *_, i=i: runs.update([i]))
        for i, block in enumerate(model.blocks.values())
    ]
    loss_fn(model(tokens), targets).backward()
    for handle in handles:
        handle.remove()
    return [runs[i] for i in range(len(model.blocks))]


def grads_and_rng(model, tokens, targets, loss_fn, seed: int = 1):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss_fn(model(tokens), targets).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return grads, torch.get_rng_state()


@pytest.mark.parametrize(
    ("mode", "every", "indices", "chosen"),
    [
        ("none", 2, None, []),
        ("full", 2, None, [0, 1, 2, 3]),
        ("ops", 2, None, [0, 1, 2, 3]),
        ("blocks", 2, None, [0, 2]),
        ("blocks", 3, None, [0, 3]),
        ("blocks", 1, None, [0, 1, 2, 3]),
        ("blocks", 5, None, [0]),
        # a pipeline stage holding blocks 3..6 picks the blocks one process would pick
        ("blocks", 2, [3, 4, 5, 6], [1, 3]),
        ("blocks", 3, [3, 4, 5, 6], [0, 3]),
        ("full", 2, [3, 4, 5, 6], [0, 1, 2, 3]),
        ("none", 2, [3, 4, 5, 6], []),
    ],
)
def test_modes_choose_blocks(make_toy, toy_batch, loss_fn, mode, every, indices, chosen):
    model = make_toy(n_layers=4)
    assert checkpointed(model, mode, every, indices) == len(chosen)
    tokens, targets = toy_batch(2, 8)
    # a checkpointed block runs its forward again in backward
    assert block_runs(model, tokens, targets, loss_fn) == [
        2 if i in chosen else 1 for i in range(4)
    ]


def test_indices_must_match_the_blocks(make_toy):
    model = make_toy(n_layers=4)
    with pytest.raises(ValueError):
        checkpointed(model, "full", indices=[0, 1])


@pytest.mark.parametrize("mode", ["full", "blocks", "ops"])
def test_names_and_state_dict_unchanged(make_toy, mode):
    model = make_toy()
    before_names = [name for name, _ in model.named_modules()]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    checkpointed(model, mode)
    assert [name for name, _ in model.named_modules()] == before_names
    after = model.state_dict()
    assert list(after) == list(before)
    for key, value in before.items():
        assert torch.equal(after[key], value), key
    # and the checkpointed model loads a plain model's state dict as it is
    model.load_state_dict(make_toy(seed=5).state_dict())


@pytest.mark.parametrize("dropout", [0.0, 0.2])
@pytest.mark.parametrize(("mode", "every"), [("full", 2), ("blocks", 2), ("blocks", 3), ("ops", 2)])
def test_gradients_equal_the_plain_model(make_toy, toy_batch, loss_fn, mode, every, dropout):
    model = make_toy(dropout=dropout)
    model.train()
    plain = copy.deepcopy(model)
    assert checkpointed(model, mode, every) > 0
    tokens, targets = toy_batch(4, 16)
    expected, expected_rng = grads_and_rng(plain, tokens, targets, loss_fn)
    got, rng = grads_and_rng(model, tokens, targets, loss_fn)
    assert list(got) == list(expected)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], msg=name)
    # the recompute restores the RNG it used: the caller's random stream moves on as without it
    assert torch.equal(rng, expected_rng)


def test_dropout_is_really_random_in_these_runs(make_toy, toy_batch, loss_fn):
    # guards the test above: with dropout on, another seed gives other gradients
    model = make_toy(dropout=0.2)
    model.train()
    checkpointed(model, "full")
    tokens, targets = toy_batch(4, 16)
    one, _ = grads_and_rng(model, tokens, targets, loss_fn, seed=1)
    other, _ = grads_and_rng(model, tokens, targets, loss_fn, seed=2)
    assert not torch.allclose(one["blocks.0.mlp.w1.weight"], other["blocks.0.mlp.w1.weight"])


def test_ops_mode_keeps_attention_and_every_other_matmul(make_toy, toy_batch, loss_fn):
    tokens, targets = toy_batch(2, 16)
    n_blocks = 4
    backward_ops = {}
    for mode in ("none", "full", "ops"):
        model = make_toy(n_layers=n_blocks)
        checkpointed(model, mode)
        loss = loss_fn(model(tokens), targets)
        with CountOps() as counter:
            loss.backward()
        backward_ops[mode] = counter
    none, full, ops = backward_ops["none"], backward_ops["full"], backward_ops["ops"]
    # full recomputes each block's forward: all its matmuls, attention and the cheap ops
    per_block = (full.matmuls() - none.matmuls()) // n_blocks
    assert per_block >= 4 and full.matmuls() - none.matmuls() == per_block * n_blocks
    assert full.counts[SDPA] == n_blocks and none.counts[SDPA] == 0
    # ops keeps attention's output and every other matmul's, recomputes the rest
    assert ops.counts[SDPA] == 0
    assert ops.matmuls() - none.matmuls() == (per_block // 2) * n_blocks
    for cheap in ("native_layer_norm", "gelu"):
        assert ops.counts[cheap] == full.counts[cheap] > none.counts[cheap]


@pytest.mark.parametrize("mode", ["full", "ops"])
def test_a_recomputed_block_attends_under_context_parallelism_again(
    monkeypatch, make_toy, toy_batch, loss_fn, mode
):
    # backward runs outside the context-parallel attention (a TorchFunctionMode sets itself
    # aside while it runs `.backward()`), so the checkpoint's recompute re-enters it; otherwise
    # recomputed attention would see only this rank's keys (and torch refuses the recompute)
    model = make_toy()
    plain = copy.deepcopy(model)
    checkpointed(model, mode)
    gathers = Counter()

    def gather(tensor, gather_dim, group):  # a cp group of one: the keys are all here
        gathers["recompute" if torch.is_grad_enabled() and in_backward[0] else "forward"] += 1
        return tensor

    in_backward = [False]
    monkeypatch.setattr(context_parallel, "all_gather_tensor_autograd", gather)
    tokens, targets = toy_batch(2, 16)
    with context_parallel.attention_over("cp-group", 16, 0, 1, True, "cpu"):
        loss = loss_fn(model(tokens), targets)
        in_backward[0] = True
        loss.backward()
    # keys and values of 4 blocks in forward; `full` recomputes every block's attention, `ops`
    # keeps attention's output but recomputes the gathers before it
    assert gathers == {"forward": 8, "recompute": 8}
    loss_fn(plain(tokens), targets).backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
