"""Shared test setup for the checkpoint package: one torch thread, a tiny language model built from
torch.nn only (checkpoint must not depend on llmtrain.models), a real S3-compatible server (moto)
on 127.0.0.1, and an in-process `llmtrain` CLI runner."""

from __future__ import annotations

from collections.abc import Iterable
from types import SimpleNamespace

import pytest
import torch
from shared_fixtures import moto_endpoint, one_torch_thread, run_cli, s3_bucket  # noqa: F401
from torch import nn

VOCAB, DIM = 32, 16


class TinyLM(nn.Module):
    """Embedding → norm → MLP (residual) → head tied to the embedding: the tensor kinds a real model
    checkpoints (weights, biases, norm parameters, tied weights)."""

    def __init__(self, dim: int = DIM, hidden: int = 2 * DIM, vocab: int = VOCAB):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = h + self.fc2(torch.relu(self.fc1(self.norm(h))))
        return self.head(h)


def batch(seed: int, size: int = 4, length: int = 6) -> torch.Tensor:
    """A deterministic batch of token ids (inputs and next-token targets)."""
    return torch.randint(
        0, VOCAB, (size, length + 1), generator=torch.Generator().manual_seed(seed)
    )


def loss_on(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].flatten()
    )


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> float:
    optimizer.zero_grad()
    loss = loss_on(model, batch(seed))
    loss.backward()
    optimizer.step()
    return loss.item()


def make_model(seed: int = 0, steps: int = 0, hidden: int = 2 * DIM):
    """(TinyLM, AdamW) from `seed`, trained `steps` steps so the optimizer has moments to save."""
    torch.manual_seed(seed)
    model = TinyLM(hidden=hidden)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(steps):
        train_step(model, optimizer, seed=1000 + step)
    return model, optimizer


@pytest.fixture(scope="session")
def tiny() -> SimpleNamespace:
    """The tiny model and its helpers: make(seed, steps, hidden), batch(seed), loss_on(model,
    tokens), train_step(model, optimizer, seed)."""
    return SimpleNamespace(
        make=make_model, batch=batch, loss_on=loss_on, train_step=train_step, TinyLM=TinyLM
    )


@pytest.fixture
def moto_s3(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterable[str]:
    """A prefix in a fresh bucket on the moto server: s3://bucket/runs/a."""
    endpoint = request.getfixturevalue("moto_endpoint")  # the session server (shared_fixtures)
    for bucket in s3_bucket(endpoint, monkeypatch, "checkpoints"):
        yield f"s3://{bucket}/runs/a"


@pytest.fixture(params=["local", "s3"])
def location(request: pytest.FixtureRequest, tmp_path) -> str:
    """A checkpoint directory: a local path, or a prefix in a bucket on the moto server."""
    if request.param == "s3":
        return request.getfixturevalue("moto_s3")
    return str(tmp_path / "checkpoints")
