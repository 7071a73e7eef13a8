"""Pytest fixtures shared by the package test suites (imported from their conftest.py files;
`integration_tests/` is on pytest's pythonpath): `one_torch_thread` (autouse where imported),
`run_cli` runs `llmtrain ...` in-process, `moto_endpoint` / `s3_bucket` give a real
S3-compatible server on 127.0.0.1 (moto), and `small_disk` a real file system that fills up."""

from __future__ import annotations

import logging
import subprocess
import urllib.request
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import pytest


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread() -> Iterator[None]:
    """torch in this process uses one thread for the session: the test models are tiny, threads
    buy nothing, and two OpenMP threads on a busy 2-core machine run far slower than one."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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
    # the CLI routes logging to the (captured) stderr and a file; undo it for the next tests
    root = logging.getLogger()
    for handler in [h for h in root.handlers if getattr(h, "_llmtrain", False)]:
        root.removeHandler(handler)
        handler.close()
    import structlog

    structlog.reset_defaults()


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterable[str]:
    """One moto S3 server on 127.0.0.1 for the session (starting one costs ~0.5 s)."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    try:
        yield endpoint
    finally:
        # moto keeps its buckets in process-wide state that outlives the server
        request = urllib.request.Request(f"{endpoint}/moto-api/reset", method="POST")
        urllib.request.urlopen(request, timeout=10).close()
        server.stop()


def s3_bucket(endpoint: str, monkeypatch: pytest.MonkeyPatch, prefix: str) -> Iterator[str]:
    """A fresh bucket on the server (yields its name) with the AWS_* variables pointing at it,
    so s3fs in this process and in its subprocesses uses it."""
    import fsspec
    from s3fs import S3FileSystem

    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    # cached filesystems remember earlier settings (the cache key ignores the environment)
    S3FileSystem.clear_instance_cache()
    bucket = f"{prefix}-{uuid.uuid4().hex[:12]}"
    fsspec.filesystem("s3").mkdir(bucket)
    try:
        yield bucket
    finally:
        S3FileSystem.clear_instance_cache()


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Callable[[str], Path]]:
    """small_disk(size) -> a directory on a tmpfs of that size ("2m"), unmounted afterwards: a
    real disk that a write fills, with the kernel's own ENOSPC (tests run as root, as in CI)."""
    mounts: list[Path] = []

    def mount(size: str) -> Path:
        where = tmp_path / f"disk{len(mounts)}"
        where.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, f"cannot mount a tmpfs (needs root): {done.stderr.strip()}"
        mounts.append(where)
        return where

    yield mount
    for where in mounts:
        subprocess.run(["umount", "--lazy", str(where)], check=False)


def resize(disk: Path, size: str) -> None:
    """Give a `small_disk` another size (freeing space the way a user would)."""
    subprocess.run(["mount", "-o", f"remount,size={size}", str(disk)], check=True)
