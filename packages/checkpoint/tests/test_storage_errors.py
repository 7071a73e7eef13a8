"""Checkpoint storage that cannot be used is one line naming the checkpoint's URL and what to
do. (A bucket that does not exist is created by s3fs's first write, where the credentials may.)"""

from __future__ import annotations

import socket

import pytest

from llmtrain.checkpoint.manager import Checkpointer, CheckpointError
from llmtrain.checkpoint.state import ModelState, Values


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def save(checkpoints: Checkpointer, tiny) -> None:
    model, optimizer = tiny.make(seed=0, steps=1)
    checkpoints.save(1, {"train": ModelState(model, [optimizer]), "counters": Values(step=1)})


def test_an_endpoint_that_does_not_answer_is_named_for_loads_and_saves(tiny, monkeypatch):
    s3fs = pytest.importorskip("s3fs")
    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)  # s3fs's own retries, on top
    port = closed_port()
    options = {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}", "region_name": "us-east-1"},
        # one try (the checkpointer's default is 5 with backoff: a real outage takes longer)
        "config_kwargs": {"retries": {"max_attempts": 1}},
    }
    checkpoints = Checkpointer("s3://bucket/run", storage_options=options, retries=1, backoff_s=0.0)
    expected = (
        f"^s3://bucket/run: cannot reach the storage endpoint http://127.0.0.1:{port} "
        r"\(Could not connect to the endpoint URL\): check the endpoint_url storage option"
    )
    with pytest.raises(CheckpointError, match=expected):
        checkpoints.latest_step()
    with pytest.raises(CheckpointError, match=expected) as failed:
        save(checkpoints, tiny)
    assert "\n" not in str(failed.value)
