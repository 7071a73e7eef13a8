"""The tiny preset learns: it memorises one fixed batch, with gradients reaching every parameter."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from llmtrain.models.presets import preset_config
from llmtrain.models.transformer import Transformer


def test_tiny_preset_overfits_one_batch():
    cfg = preset_config("tiny", vocab_size=64, max_seq_len=64)
    torch.manual_seed(0)
    model = Transformer(cfg)
    model.init_weights(torch.Generator().manual_seed(0))
    model.train()
    batch = torch.randint(0, 64, (4, 33), generator=torch.Generator().manual_seed(1))
    inputs, targets = batch[:, :-1], batch[:, 1:]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

    def loss_of(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    losses = []
    for step in range(200):
        optimizer.zero_grad(set_to_none=True)
        loss = loss_of(model(inputs))
        loss.backward()
        if step == 0:
            # untrained: close to uniform over the 64 ids; every parameter gets a gradient
            assert abs(loss.item() - math.log(64)) < 0.2
            for name, p in model.named_parameters():
                assert p.grad is not None and torch.isfinite(p.grad).all(), name
                assert p.grad.abs().sum() > 0, name
        optimizer.step()
        losses.append(loss.item())
        if loss.item() < 0.05:
            break
    assert losses[-1] < 0.05, f"loss after {len(losses)} steps: {losses[-1]:.4f}"
    with torch.no_grad():
        assert loss_of(model(inputs)).item() < 0.05
