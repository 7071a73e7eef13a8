"""Tensor-parallel plans: globs resolved to module paths, styles checked, and the styles applied on
a one-rank `tp` mesh computing exactly what the plain model computes."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from llmtrain.parallel.grad_norm import clip_grad_norm_
from llmtrain.parallel.tensor_parallel import STYLES, apply_tensor_parallel, resolve_plan


def expected_toy_plan(n_layers: int) -> dict[str, str]:
    plan = {
        "tok_emb": "embedding",
        "pos_emb": "embedding",
        "norm": "sequence_parallel",
        "head": "colwise_output",
    }
    for i in range(n_layers):
        b = f"blocks.{i}"
        plan |= {
            f"{b}.attn_norm": "sequence_parallel",
            f"{b}.attn": "gather_input",
            f"{b}.attn.wq": "colwise",
            f"{b}.attn.wk": "colwise",
            f"{b}.attn.wv": "colwise",
            f"{b}.attn.wo": "rowwise",
            f"{b}.mlp_norm": "sequence_parallel",
            f"{b}.mlp": "gather_input",
            f"{b}.mlp.w1": "colwise",
            f"{b}.mlp.w2": "rowwise",
        }
    return plan


def test_globs_resolve_to_exactly_the_named_modules(make_toy):
    model = make_toy(n_layers=3)
    resolved = resolve_plan(model, model.describe().tp_plan)
    assert resolved == expected_toy_plan(3)
    # `blocks.*.attn` names the attention modules, not their projections or dropout
    assert "blocks.0.attn.drop" not in resolved
    assert set(resolved.values()) <= set(STYLES)


def test_glob_forms(make_toy):
    model = make_toy(n_layers=3)
    assert resolve_plan(model, {"blocks.1.mlp.w?": "colwise"}) == {
        "blocks.1.mlp.w1": "colwise",
        "blocks.1.mlp.w2": "colwise",
    }
    assert resolve_plan(model, {"blocks.[02].attn.wo": "rowwise"}) == {
        "blocks.0.attn.wo": "rowwise",
        "blocks.2.attn.wo": "rowwise",
    }
    # exact names are case-sensitive paths, never the root module
    assert resolve_plan(model, {"head": "colwise_output"}) == {"head": "colwise_output"}
    assert "" not in resolve_plan(model, {"*": "colwise"})
    # a later entry overrides an earlier one for the same module
    plan = {"blocks.*.mlp.w1": "colwise", "blocks.0.mlp.w1": "rowwise"}
    resolved = resolve_plan(model, plan)
    assert resolved["blocks.0.mlp.w1"] == "rowwise"
    assert resolved["blocks.1.mlp.w1"] == resolved["blocks.2.mlp.w1"] == "colwise"


def test_unknown_style_names_the_entry(make_toy):
    model = make_toy()
    with pytest.raises(ValueError) as info:
        resolve_plan(model, {"tok_emb": "embedding", "blocks.*.attn.wq": "columnwise"})
    assert str(info.value) == (
        "tp_plan entry 'blocks.*.attn.wq': unknown style 'columnwise'; known: "
        "embedding, colwise, rowwise, sequence_parallel, sequence_parallel_residual, "
        "gather_input, colwise_output"
    )


def test_entry_that_matches_no_module_is_an_error(make_toy):
    # resolve_plan's docstring: "unknown styles and entries that match nothing are errors (a
    # plan out of step with its model)". A typo must not silently leave a layer unsharded.
    model = make_toy()
    with pytest.raises(ValueError, match=r"blocks\.\*\.attn\.w_q"):
        resolve_plan(model, {"blocks.*.attn.w_q": "colwise"})


@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_styles_on_a_one_rank_mesh_compute_what_the_plain_model_does(
    one_process_mesh, make_toy, toy_batch, loss_fn, sequence_parallel
):
    model = make_toy()
    plain = copy.deepcopy(model)
    apply_tensor_parallel(
        model,
        model.describe().tp_plan,
        one_process_mesh["tp"],
        sequence_parallel=sequence_parallel,
        loss_parallel=False,
    )
    assert isinstance(model.blocks["0"].attn.wq.weight, DTensor)
    assert isinstance(model.head.weight, DTensor)
    assert not isinstance(plain.head.weight, DTensor)
    tokens, targets = toy_batch(4, 16)
    logits = model(tokens)
    assert not isinstance(logits, DTensor)  # replicated logits come back as a plain tensor
    torch.testing.assert_close(logits, plain(tokens))
    loss_fn(logits, targets).backward()
    loss_fn(plain(tokens), targets).backward()
    plain_params = dict(plain.named_parameters())
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        torch.testing.assert_close(grad, plain_params[name].grad, msg=name)
    # the global norm over DTensor gradients is the plain model's norm
    expected = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5)
    norm = clip_grad_norm_(model.parameters(), 0.5).item()
    assert norm == pytest.approx(expected.item(), rel=1e-6)
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        torch.testing.assert_close(grad, plain_params[name].grad, msg=name)


def test_loss_parallel_leaves_logits_vocab_sharded(one_process_mesh, make_toy, toy_batch, loss_fn):
    model = make_toy()
    plain = copy.deepcopy(model)
    apply_tensor_parallel(
        model,
        model.describe().tp_plan,
        one_process_mesh["tp"],
        sequence_parallel=True,
        loss_parallel=True,
    )
    tokens, targets = toy_batch(2, 8)
    logits = model(tokens)
    assert isinstance(logits, DTensor)
    assert [str(p) for p in logits.placements] == ["S(2)"]
    with loss_parallel():
        loss = loss_fn(logits, targets)
        loss.backward()
    reference = loss_fn(plain(tokens), targets)
    reference.backward()
    torch.testing.assert_close(loss.full_tensor(), reference)
    torch.testing.assert_close(model.head.weight.grad.full_tensor(), plain.head.weight.grad)


def test_a_norm_whose_output_joins_the_residual_gives_a_plain_tensor(one_process_mesh, make_toy):
    # Gemma's norms after each sublayer: their output is added to the residual stream, which
    # under sequence parallelism is this rank's positions as a plain tensor (the embedding's and
    # the row-wise layers' outputs); a norm that feeds attention or the head stays a DTensor
    model = make_toy(n_layers=1)
    plain = copy.deepcopy(model)
    plan = {
        "blocks.0.attn_norm": "sequence_parallel",
        "blocks.0.mlp_norm": "sequence_parallel_residual",
    }
    apply_tensor_parallel(
        model, plan, one_process_mesh["tp"], sequence_parallel=True, loss_parallel=False
    )
    block, reference = model.blocks["0"], plain.blocks["0"]
    assert isinstance(block.mlp_norm.weight, DTensor)
    x = torch.randn(2, 8, 32)
    out = block.mlp_norm(x)
    assert not isinstance(out, DTensor)
    torch.testing.assert_close(out, reference.mlp_norm(x))
    residual = x + out  # no mixing of DTensors and tensors
    torch.testing.assert_close(residual, x + reference.mlp_norm(x))
    assert isinstance(block.attn_norm(x), DTensor)
    # without sequence parallelism it is left alone, as `sequence_parallel` is
    other = make_toy(n_layers=1)
    apply_tensor_parallel(
        other, plan, one_process_mesh["tp"], sequence_parallel=False, loss_parallel=False
    )
    assert not isinstance(other.blocks["0"].mlp_norm.weight, DTensor)


def test_gather_input_and_sequence_parallel_are_left_alone_without_sp(one_process_mesh, make_toy):
    model = make_toy(n_layers=2)
    apply_tensor_parallel(
        model,
        {"blocks.*.attn": "gather_input", "norm": "sequence_parallel", "head": "colwise_output"},
        one_process_mesh["tp"],
        sequence_parallel=False,
        loss_parallel=False,
    )
    assert not model.blocks["0"].attn._forward_pre_hooks
    assert not isinstance(model.norm.weight, DTensor)
    assert isinstance(model.head.weight, DTensor)
