"""The MoE layer under torch.compile: the grouped path (dropless) compiles as ONE graph, so the
token permutation, the grouped matmuls, the routing statistics and the auxiliary losses run
without a host sync or a graph break, and its numbers, gradients included, are eager's. The
loop path (one matmul per expert, CPU's default) compiles with breaks and gives eager's numbers
too. `aot_eager` traces forward and backward as inductor would, without generating kernels, so
the check takes seconds on CPU (the grouped matmul's tracing needs bf16, as its CUDA kernel)."""

from __future__ import annotations

import pytest
import torch
from llmtrain_moe.model import MoE
from llmtrain_moe.options import preset_options


def layer_and_input(dtype: torch.dtype, **options) -> tuple[MoE, torch.Tensor]:
    cfg = preset_options("moe-tiny", d_model=32, mlp_hidden=32, **options)
    torch.manual_seed(0)
    layer = MoE(cfg)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(std=0.1)
    layer.to(dtype).train()
    x = torch.randn(2, 16, 32, dtype=dtype, requires_grad=True)
    return layer, x


def forward_backward(layer: MoE, fn, x: torch.Tensor) -> list[torch.Tensor]:
    layer.zero_grad()
    x.grad = None
    y = fn(x)
    (y.float().square().sum() + layer.aux_loss.float()).backward()
    return [y.detach(), x.grad, *(p.grad for p in layer.parameters())]


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"shared_expert": True, "router_z_loss": 0.001},
        {"bias_update_rate": 0.001, "top_k": 3},
    ],
)
def test_grouped_dropless_layer_compiles_as_one_graph_with_eager_numbers(options):
    layer, x = layer_and_input(torch.bfloat16, expert_matmul="grouped", **options)
    layer.inject_aux_loss = False  # the aux loss is added below, as an objective does
    eager = forward_backward(layer, layer, x)
    # fullgraph: any graph break (a host sync, a data-dependent shape) is an error
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    got = forward_backward(layer, compiled, x)
    for want, have in zip(eager, got, strict=True):
        torch.testing.assert_close(have, want, rtol=0, atol=0)
    assert layer.stats is not None and layer.stats.load.sum().item() == pytest.approx(1.0)


def test_loop_path_compiles_with_eager_numbers():
    layer, x = layer_and_input(torch.float32, expert_matmul="loop")
    layer.inject_aux_loss = False
    eager = forward_backward(layer, layer, x)
    got = forward_backward(layer, torch.compile(layer, backend="aot_eager"), x)
    for want, have in zip(eager, got, strict=True):
        torch.testing.assert_close(have, want, rtol=1e-6, atol=1e-7)
