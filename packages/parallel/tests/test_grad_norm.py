"""Global gradient clipping on plain tensors agrees with torch.nn.utils.clip_grad_norm_."""

from __future__ import annotations

import pytest
import torch

from llmtrain.parallel.grad_norm import clip_grad_norm_


def make_params(seed: int, scale: float = 1.0, with_missing_grad: bool = False):
    g = torch.Generator().manual_seed(seed)
    shapes = [(5, 3), (7,), (2, 3, 4), ()]
    params = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.randn(shape, generator=g))
        p.grad = torch.randn(shape, generator=g) * scale
        params.append(p)
    if with_missing_grad:
        params.append(torch.nn.Parameter(torch.randn(3, generator=g)))  # grad None: skipped
    return params


def twins(seed: int, **kw):
    ours, theirs = make_params(seed, **kw), make_params(seed, **kw)
    return ours, theirs


@pytest.mark.parametrize("max_norm", [0.1, 1.0, 3.0, 1e6])
@pytest.mark.parametrize("scale", [0.01, 1.0, 30.0])
def test_clipping_matches_torch(max_norm, scale):
    ours, theirs = twins(0, scale=scale, with_missing_grad=True)
    norm_tensor = clip_grad_norm_(ours, max_norm)
    expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm)
    # a float32 tensor, not read: the step that clips waits for nothing
    assert isinstance(norm_tensor, torch.Tensor) and norm_tensor.dtype == torch.float32
    norm = norm_tensor.item()
    assert norm == pytest.approx(expected.item(), rel=1e-6)
    for p, q in zip(ours, theirs, strict=True):
        if q.grad is None:
            assert p.grad is None
        else:
            torch.testing.assert_close(p.grad, q.grad)
    clipped = torch.sqrt(sum(p.grad.pow(2).sum() for p in ours if p.grad is not None))
    assert clipped.item() == pytest.approx(min(norm, max_norm), rel=1e-5)


def test_none_only_measures():
    params = make_params(1, scale=10.0)
    before = [p.grad.clone() for p in params]
    expected = torch.linalg.vector_norm(torch.cat([g.flatten() for g in before]))
    norm = clip_grad_norm_(params, None).item()
    assert norm == pytest.approx(expected.item(), rel=1e-6)
    assert norm > 1.0  # large enough that clipping would have changed something
    for p, g in zip(params, before, strict=True):
        assert torch.equal(p.grad, g)


def test_generator_of_parameters_and_no_gradients():
    ours, theirs = twins(2)
    norm = clip_grad_norm_(iter(ours), 0.5).item()
    assert norm == pytest.approx(torch.nn.utils.clip_grad_norm_(theirs, 0.5).item(), rel=1e-6)
    no_grads = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
    assert clip_grad_norm_(no_grads, 1.0).item() == 0.0
    assert all(p.grad is None for p in no_grads)
    assert clip_grad_norm_([], None).item() == 0.0
