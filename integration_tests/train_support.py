"""Helpers for the `test_train_*.py` integration tests: a small packed corpus, the run config they
share, `llmtrain` and torchrun command lines, and processes that are killed with all their
descendants when they overrun (a hung torchrun must not leave its ranks behind)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import yaml

# vocab 258 (256 bytes + 2 special tokens): the tiny model's 320 ids cover it
BYTES = {"kind": "bytes"}


def pack_corpus(directory: Path, tokenizer: dict | None = None) -> SimpleNamespace:
    """train.zarr (300 generated documents, ~67k tokens) and valid.zarr (50) in `directory`."""
    from llmtrain.data_pack.pack import pack
    from llmtrain.train_loop.experiments.quickstart import write_corpus

    directory.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, documents, seed in (("train", 300, 0), ("valid", 50, 1)):
        source = directory / f"{split}.jsonl"
        write_corpus(source, documents, seed=seed)
        paths[split] = str(directory / f"{split}.zarr")
        pack([str(source)], paths[split], tokenizer or BYTES, overwrite=True, workers=1)
    return SimpleNamespace(**paths, dir=directory)


def run_config(data: SimpleNamespace, run_dir: Path, name: str = "run") -> dict:
    """30 steps of an 8-sequence global batch (micro-batches of 4: two per step in one process)
    with a cosine schedule, a log line per step, eval every 10 and a checkpoint every 5 steps.
    Untied embeddings, so a pipeline can cut the model."""
    return {
        "name": name,
        "seed": 3,
        "run_dir": str(run_dir),
        "device": "cpu",
        "model": {"kind": "tiny", "max_seq_len": 64, "d_model": 32, "tied_embeddings": False},
        "data": {
            "train": [{"path": data.train}],
            "eval": {"path": data.valid, "every": 10, "batches": 2},
            "seq_len": 32,
            "micro_batch": 4,
            "global_batch": 8,
        },
        "optimizer": {"kind": "adamw", "lr": 3e-3},
        "lr_scheduler": {"kind": "cosine", "warmup_steps": 3, "min_ratio": 0.1},
        "training": {"steps": 30, "log_every": 1, "checkpoint_every": 5},
        "checkpoint": {"keep_last": 10},
    }


def one_process_run(tmp: Path, config: dict) -> dict:
    """`config` (named "ref", run_dir tmp/runs) trained by `llmtrain run` in one process: what
    the layout tests compare their multi-rank runs with."""
    path = write_config(tmp / "run.yaml", config)
    proc = run(llmtrain("run", path), timeout=600)
    run_dir = tmp / "runs" / "ref"
    return {
        "tmp": tmp,
        "config": config,
        "path": path,
        "proc": proc,
        "dir": run_dir,
        "metrics": by_step(read_metrics(run_dir)),
    }


def write_config(path: Path, config: dict) -> Path:
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def llmtrain(*args: object) -> list[str]:
    return [sys.executable, "-m", "llmtrain", *map(str, args)]


def torchrun(nproc: int, *args: object) -> list[str]:
    """`llmtrain ARGS` in `nproc` gloo processes on this machine."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "llmtrain",
        *map(str, args),
    ]


def start(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def stop_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process and all its descendants, each by its pid (torchrun starts its ranks
    in sessions of their own, so a process-group kill would leave them running)."""
    import psutil

    try:
        family = [*psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        family = []
    for pid in [proc.pid, *(p.pid for p in family)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def finish(proc: subprocess.Popen, timeout: float) -> subprocess.CompletedProcess:
    """Wait for a started process; past `timeout` kill its group and fail with its output."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_group(proc)
        out, err = proc.communicate()
        raise AssertionError(
            f"{' '.join(proc.args)} did not finish in {timeout} s (killed)\n"
            f"--- stdout\n{out[-3000:]}\n--- stderr\n{err[-6000:]}"
        ) from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def side_by_side(*commands: list[str], timeout: float = 600) -> list:
    """Run the commands at once (each `llmtrain` start is seconds of imports, on one core);
    returns their CompletedProcesses, leaving none running if one overruns."""
    procs = [start(command) for command in commands]
    try:
        return [finish(proc, timeout) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                stop_group(proc)
                proc.communicate()


def run(cmd: list[str], *, timeout: float = 120, check: bool = True):
    proc = finish(start(cmd), timeout)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n"
            f"--- stderr\n{proc.stderr[-6000:]}"
        )
    return proc


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def by_step(metrics: list[dict]) -> dict[int, dict]:
    return {m["step"]: m for m in metrics}


def last_logged_step(path: Path) -> int:
    """The step of the last complete line of a metrics file being written (0 if none)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return 0
    complete = text[: text.rfind("\n") + 1].splitlines()
    return json.loads(complete[-1])["step"] if complete else 0


def wait_for_step(path: Path, step: int, proc: subprocess.Popen, timeout: float = 120) -> int:
    """Poll a run's metrics.jsonl until it has logged `step`; returns the step it shows."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen = last_logged_step(path)
        if seen >= step:
            return seen
        if proc.poll() is not None:
            _, err = proc.communicate()
            raise AssertionError(f"the run ended ({proc.returncode}) before step {step}:\n{err}")
        time.sleep(0.002)
    stop_group(proc)
    raise AssertionError(f"no step {step} in {path} after {timeout} s")


def committed_steps(checkpoints: Path) -> list[int]:
    return sorted(
        int(p.parent.name.removeprefix("step-")) for p in checkpoints.glob("step-*/COMMITTED")
    )


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def assert_close_runs(expected: dict[int, dict], got: dict[int, dict], rtol: float, keys) -> None:
    """Every step of `got` matches `expected` in `keys` within `rtol`, with a readable diff."""
    bad = []
    for step, metrics in sorted(got.items()):
        for key in keys:
            if key not in expected[step] and key not in metrics:
                continue
            a, b = expected[step].get(key), metrics.get(key)
            if a is None or b is None or abs(a - b) > rtol * abs(a):
                bad.append(f"step {step} {key}: expected {a}, got {b}")
    assert not bad, f"{len(bad)} values differ (rtol {rtol}):\n" + "\n".join(bad[:20])
