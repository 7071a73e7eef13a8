"""Shared test setup for the checkpoint package: one torch thread, a tiny language model built from
torch.nn only (checkpoint must not depend on llmtrain.models), a real S3-compatible server (moto)
on 127.0.0.1, and an in-process `llmtrain` CLI runner."""

from __future__ import annotations

import logging
import urllib.request
import uuid
from collections.abc import Callable, Iterable
from types import SimpleNamespace

import pytest
import torch
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


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread():
    # the test models are tiny: threads buy nothing on a small, busy machine
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_model(seed: int = 0, steps: int = 0, hidden: int = 2 * DIM):
    """(TinyLM, AdamW) from `seed`, trained `steps` steps so the optimizer has moments to save."""
    torch.manual_seed(seed)
    model = TinyLM(hidden=hidden)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(steps):
        train_step(model, optimizer, seed=1000 + step)
    return model, optimizer


@pytest.fixture
def tiny() -> SimpleNamespace:
    """The tiny model and its helpers: make(seed, steps, hidden), batch(seed), loss_on(model,
    tokens), train_step(model, optimizer, seed)."""
    return SimpleNamespace(
        make=make_model, batch=batch, loss_on=loss_on, train_step=train_step, TinyLM=TinyLM
    )


@pytest.fixture
def moto_s3(monkeypatch: pytest.MonkeyPatch) -> Iterable[str]:
    """A bucket on a fresh moto S3 server; yields a URL under it (s3://bucket/prefix). The AWS_*
    variables point at the server, so s3fs in this process and in subprocesses use it."""
    import fsspec
    from moto.server import ThreadedMotoServer
    from s3fs import S3FileSystem

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://{host}:{port}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    # cached filesystems remember an earlier server's endpoint (the cache key ignores the env)
    S3FileSystem.clear_instance_cache()
    # moto keeps its buckets in process-wide state: a fresh name per test, and a reset after
    bucket = f"checkpoints-{uuid.uuid4().hex[:12]}"
    fsspec.filesystem("s3").mkdir(bucket)
    try:
        yield f"s3://{bucket}/runs/a"
    finally:
        S3FileSystem.clear_instance_cache()
        reset = urllib.request.Request(f"http://{host}:{port}/moto-api/reset", method="POST")
        urllib.request.urlopen(reset, timeout=10).close()
        server.stop()


@pytest.fixture(params=["local", "s3"])
def location(request: pytest.FixtureRequest, tmp_path) -> str:
    """A checkpoint directory: a local path, or a prefix in a bucket on the moto server."""
    if request.param == "s3":
        return request.getfixturevalue("moto_s3")
    return str(tmp_path / "checkpoints")


@pytest.fixture
def run_cli(capsys: pytest.CaptureFixture[str]) -> Iterable[Callable[..., tuple[int, str, str]]]:
    """run_cli(*argv) -> (exit code, stdout, stderr) of `llmtrain ...` run in this process."""
    from llmtrain.core_mesh.cli import main

    def run(*argv: object) -> tuple[int, str, str]:
        capsys.readouterr()
        code = main([str(a) for a in argv])
        out, err = capsys.readouterr()
        return code, out, err

    yield run
    root = logging.getLogger()
    for handler in [h for h in root.handlers if getattr(h, "_llmtrain", False)]:
        root.removeHandler(handler)
        handler.close()
    import structlog

    structlog.reset_defaults()
