"""Checkpoints across real processes (gloo on CPU): save under FSDP2 and load in one process and
under tensor parallelism with the same numbers; saver processes SIGKILLed at random moments never
leave a checkpoint that loads wrong (local disk and a moto S3 server); a SIGTERM to one rank stops
every rank at the same step with a final checkpoint."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path
from types import SimpleNamespace

import checkpoint_worker as worker
import fsspec
import pytest
import torch
from support import torchrun

from llmtrain.checkpoint.manager import Checkpointer, CheckpointError
from llmtrain.checkpoint.state import ModelState, Values
from llmtrain.checkpoint.stream_storage import SUFFIX

WORKER = Path(__file__).with_name("checkpoint_worker.py")
TOLERANCE = 1e-5

# -- reshard: FSDP2 (2 ranks) → 1 process, → tensor parallel (2 ranks) ----------------------------


@pytest.fixture(scope="module")
def reshard(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reshard")
    # checkpoint B, saved by one process, for the 2-rank load that finds no RNG state for rank 1
    model, optimizer = worker.make_mlp(5)
    worker.train_step(model, optimizer, 1)
    torch.manual_seed(77)
    Checkpointer(str(tmp / "b")).save(1, {"train": ModelState(model, [optimizer])})
    b_rand = torch.rand(4).tolist()
    b_params = {n: p.detach().clone() for n, p in model.named_parameters()}

    (tmp / "out").mkdir()
    torchrun(WORKER, "reshard", tmp / "out", tmp / "a", tmp / "b", nproc=2, timeout=600)
    ranks = [json.loads((tmp / "out" / f"rank{r}.json").read_text()) for r in range(2)]

    def tensors(name):
        return torch.load(tmp / "out" / name, weights_only=True)

    return SimpleNamespace(
        a=str(tmp / "a"),
        ranks=ranks,
        b_rand=b_rand,
        b_params=b_params,
        fsdp_params=tensors("fsdp_params.pt"),
        tp_params=tensors("tp_params.pt"),
        tp_b_params=tensors("tp_b_params.pt"),
    )


def assert_params_equal(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert got[name].shape == value.shape, name
        assert torch.equal(got[name], value), name


def assert_close(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert abs(g - w) <= TOLERANCE, (got, want)


def test_fsdp_training_matches_one_process_and_saves_one_shard_per_rank(reshard):
    model, optimizer = worker.make_mlp(0)
    losses = [worker.train_step(model, optimizer, s) for s in (1, 2)]
    for rank in reshard.ranks:
        assert_close(rank["fsdp_losses"], losses)
    for name, value in model.named_parameters():
        assert torch.allclose(reshard.fsdp_params[name], value, atol=TOLERANCE, rtol=0), name

    step_dir = Path(reshard.a) / "step-2"
    # each rank writes its shards into its own files (one per writer thread)
    files = sorted(p.name for p in step_dir.glob(f"*{SUFFIX}"))
    assert {name.split("_")[2] for name in files} == {"0", "1"}, files
    assert sorted(p.name for p in (step_dir / "rng").iterdir()) == ["rank0.json", "rank1.json"]
    checkpoints = Checkpointer(reshard.a)
    assert checkpoints.committed_steps() == [2]
    assert checkpoints.info(2)["world_size"] == 2


def test_fsdp_checkpoint_loads_in_one_process_and_training_continues_the_same(reshard):
    model, optimizer = worker.make_mlp(321)
    counters = Values(step=0)
    torch.manual_seed(999)
    assert (
        Checkpointer(reshard.a).load(
            {"train": ModelState(model, [optimizer]), "counters": counters}
        )
        == 2
    )
    # one process is rank 0: it gets rank 0's random state; rank 1's file is not used
    assert torch.rand(4).tolist() == reshard.ranks[0]["fsdp_rand_after_save"]
    assert counters.values == {"step": 2}
    assert_params_equal({n: p.detach() for n, p in model.named_parameters()}, reshard.fsdp_params)
    continued = worker.continuation(model, optimizer)
    assert_close(continued, reshard.ranks[0]["fsdp_continuation"])


def test_fsdp_checkpoint_loads_under_tensor_parallel_and_training_continues_the_same(reshard):
    assert_params_equal(reshard.tp_params, reshard.fsdp_params)
    for rank in reshard.ranks:
        assert rank["tp_loaded_step"] == 2
        assert rank["tp_counters"] == {"step": 2}
        assert rank["tp_warnings"] == []
        assert_close(rank["tp_continuation"], rank["fsdp_continuation"])
        # each rank gets back the random state it saved
        assert rank["tp_rand_after_load"] == rank["fsdp_rand_after_save"]
    assert reshard.ranks[0]["fsdp_rand_after_save"] != reshard.ranks[1]["fsdp_rand_after_save"]
    # the three layouts agree with each other, not just with the FSDP run
    assert_close(reshard.ranks[0]["tp_continuation"], reshard.ranks[1]["tp_continuation"])


def test_a_rank_the_checkpoint_has_no_random_state_for_warns_and_keeps_its_own(reshard):
    assert_params_equal(reshard.tp_b_params, reshard.b_params)
    rank0, rank1 = reshard.ranks
    assert rank0["tp_b_loaded_step"] == rank1["tp_b_loaded_step"] == 1
    assert rank0["tp_b_rand_after_load"] == reshard.b_rand
    assert rank0["tp_b_warnings"] == []
    assert rank1["tp_b_warnings"] == ["checkpoint.no_rng_state"]
    own = torch.rand(4, generator=torch.Generator().manual_seed(2001)).tolist()
    assert rank1["tp_b_rand_after_load"] == own


# -- crash safety: SIGKILL a saving process at random moments ------------------------------------


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server on 127.0.0.1 (port 0) with a fresh bucket; AWS_* point at it here and in
    the saver processes."""
    from moto.server import ThreadedMotoServer
    from s3fs import S3FileSystem

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    bucket = f"crash-{uuid.uuid4().hex[:12]}"
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN"):
            patch.delenv(name, raising=False)
        S3FileSystem.clear_instance_cache()
        fsspec.filesystem("s3").mkdir(bucket)
        try:
            yield SimpleNamespace(url=f"s3://{bucket}/run", env=env)
        finally:
            S3FileSystem.clear_instance_cache()
            reset = urllib.request.Request(f"http://{host}:{port}/moto-api/reset", method="POST")
            urllib.request.urlopen(reset, timeout=10).close()
            server.stop()


class Saver:
    """The `save-loop` fork server: start(url, step, async) starts a saver process; kill() SIGKILLs
    it and returns how it ended."""

    def __init__(self, env: dict[str, str], log: Path):
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER), "save-loop"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log.open("w"),
            text=True,
            env={**os.environ, **env},
        )

    def _expect(self, key: str) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise AssertionError(f"the saver server died; its log:\n{self.log.read_text()}")
            if not line.startswith("{"):
                continue
            record = json.loads(line)
            if key in record:
                return record
            if "exited" in record:
                raise AssertionError(
                    f"a saver ended before it was killed ({record}); the log:\n{self.log.read_text()}"
                )

    def start(self, url: str, step: int, *, async_save: bool, mib: int) -> int:
        request = {"url": url, "start": step, "async_save": async_save, "mib": mib}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        child = self._expect("child")["child"]
        self._expect("started")
        return child

    def kill(self, child: int) -> dict:
        os.kill(child, signal.SIGKILL)
        return self._expect("exited")

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def saver(s3, tmp_path_factory):
    server = Saver(s3.env, tmp_path_factory.mktemp("saver") / "stderr.log")
    try:
        yield server
    finally:
        server.close()


def step_dirs(url: str) -> list[int]:
    fs, root = fsspec.core.url_to_fs(url)
    fs.invalidate_cache()
    return sorted(
        int(name.rstrip("/").rsplit("-", 1)[1])
        for name in fs.ls(root, detail=False)
        if name.rstrip("/").rsplit("/", 1)[-1].startswith("step-")
    )


def load_crash_state(checkpoints: Checkpointer, mib: int, step: int | None = None):
    tensors = {name: torch.zeros_like(value) for name, value in worker.crash_state(0, mib).items()}
    counters = Values(step=-1)
    loaded = checkpoints.load({"tensors": tensors, "counters": counters}, step=step)
    return loaded, tensors, counters["step"]


def settle(url: str, quiet_s: float = 1.0, timeout: float = 120) -> None:
    """Wait until nothing under `url` changes any more. The S3 server answers the requests of a
    saver in threads of its own: one the saver had sent whole before its SIGKILL still lands
    after the kill, so the store is listed only once it has been still for `quiet_s`. A local
    disk needs no wait: a killed process writes nothing more."""
    if "://" not in url:
        return
    fs, root = fsspec.core.url_to_fs(url)

    def listing() -> list[tuple[str, int]]:
        fs.invalidate_cache()
        return sorted(
            (path, info.get("size", 0)) for path, info in fs.find(root, detail=True).items()
        )

    seen, since = listing(), time.monotonic()
    deadline = since + timeout
    while time.monotonic() - since < quiet_s:
        assert time.monotonic() < deadline, f"{url} still changed {timeout} s after the kill"
        time.sleep(0.1)
        now = listing()
        if now != seen:
            seen, since = now, time.monotonic()


def check_after_kill(url: str, previous: int, mib: int) -> tuple[int, bool]:
    """Everything a restarted run could load is exactly what its step wrote; returns the newest
    committed step and whether an unfinished save was left behind."""
    settle(url)
    checkpoints = Checkpointer(url)
    committed = checkpoints.committed_steps()
    latest = checkpoints.latest_step()
    assert latest is not None and latest == committed[-1]
    assert latest >= previous, "a committed checkpoint disappeared"
    unfinished = sorted(set(step_dirs(url)) - set(committed))
    newer = [s for s in unfinished if s > latest]
    # one save at a time: only the step after the newest commit can be half-written
    assert newer in ([], [latest + 1]), (committed, unfinished)

    loaded, tensors, counter = load_crash_state(checkpoints, mib)
    assert loaded == latest and counter == latest
    for name, value in worker.crash_state(latest, mib).items():
        assert torch.equal(tensors[name], value), (latest, name)
    assert checkpoints.info(latest)["info"] == {"step": latest}
    for step in committed[:-1]:
        loaded, tensors, counter = load_crash_state(checkpoints, mib, step)
        assert counter == step
        for name, value in worker.crash_state(step, mib).items():
            assert torch.equal(tensors[name], value), (step, name)
    for step in unfinished:
        with pytest.raises(CheckpointError, match="not committed"):
            load_crash_state(checkpoints, mib, step)
    return latest, bool(newer)


def first_commit_seconds(saver: Saver, url: str, latest: int, mib: int) -> float:
    """How long a fresh saver takes to commit its first step here and now (its fork, its
    storage client, one save), measured by watching for the commit; then it is killed."""
    child = saver.start(url, latest + 1, async_save=False, mib=mib)
    started = time.monotonic()
    checkpoints = Checkpointer(url)
    while checkpoints.latest_step() == latest:
        assert time.monotonic() - started < 300, "no save committed in 300 s"
        time.sleep(0.02)
    elapsed = time.monotonic() - started
    saver.kill(child)
    return elapsed


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("where", "mib", "trials", "max_delay_s", "seed"),
    [("local", 8, 12, 0.4, 1234), ("s3", 4, 10, 1.5, 4321)],
)
def test_sigkill_at_random_moments_never_leaves_a_bad_checkpoint(
    where, mib, trials, max_delay_s, seed, saver, s3, tmp_path
):
    url = str(tmp_path / "ckpt") if where == "local" else f"{s3.url}-{uuid.uuid4().hex[:8]}"
    tensors = worker.crash_state(0, mib)
    Checkpointer(url).save(0, {"tensors": tensors, "counters": Values(step=0)}, info={"step": 0})
    # kills land up to 4 first-commit times after a start, however slow this machine is right
    # now: on average a trial commits 1.5 steps and the kill lands in a save
    first_commit = first_commit_seconds(saver, url, 0, mib)
    latest, _ = check_after_kill(url, 0, mib)
    max_delay_s = max(max_delay_s, 4 * first_commit)
    delays = random.Random(seed)
    interrupted_saves = 0
    for trial in range(trials):
        child = saver.start(url, latest + 1, async_save=trial % 2 == 1, mib=mib)
        time.sleep(delays.uniform(0.0, max_delay_s))
        ended = saver.kill(child)
        assert ended["signal"] == signal.SIGKILL, (
            f"the saver ended by itself ({ended}); its log:\n{saver.log.read_text()}"
        )
        latest, interrupted = check_after_kill(url, latest, mib)
        interrupted_saves += interrupted
    # the kills meant something: saves committed between them, and some landed mid-save
    assert latest >= 5, (
        f"only {latest} steps committed in {trials} trials (kills up to {max_delay_s:.1f} s "
        f"after a start; a first commit took {first_commit:.1f} s)"
    )
    assert interrupted_saves >= 1, "no kill landed in the middle of a save"


# -- preemption: SIGTERM to one rank --------------------------------------------------------------


@pytest.mark.timeout(150)
def test_sigterm_to_rank_0_stops_both_ranks_at_one_step_with_a_final_checkpoint(tmp_path):
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    log = tmp_path / "torchrun.log"
    with log.open("w") as sink:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node=2",
                str(WORKER),
                "preempt",
                str(ckpt),
                str(out),
            ],
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 120
        while not all((out / f"pid{r}").exists() for r in range(2)):
            assert proc.poll() is None, f"the workers ended early:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"the workers never started:\n{log.read_text()}"
            time.sleep(0.05)
        time.sleep(0.2)  # a few steps and periodic saves later
        os.kill(int((out / "pid0").read_text()), signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    rank0, rank1 = (json.loads((out / f"rank{r}.json").read_text()) for r in range(2))
    step = rank0["stopped_at"]
    assert rank1["stopped_at"] == step
    assert rank0["signal"] == "SIGTERM" and rank0["requested"]
    assert rank1["signal"] is None and rank1["requested"], "rank 1 did not learn of the stop"
    assert rank0["saved"] == rank1["saved"] and rank0["saved"][-1] == step

    checkpoints = Checkpointer(str(ckpt))
    assert checkpoints.committed_steps() == rank0["saved"]
    assert checkpoints.latest_step() == step
    weights, counters = {"w": torch.zeros(1000)}, Values(step=0)
    assert checkpoints.load({"weights": weights, "counters": counters}) == step
    assert counters["step"] == step
    # every step added (0 + s) + (1 + s) to every element
    assert torch.equal(weights["w"], torch.full((1000,), float(step * step + 2 * step)))


def test_every_rank_gets_the_same_answer_when_a_signal_lands_during_the_stop_vote(tmp_path):
    # ranks that answer differently leave the loop at different steps and then hang in
    # mismatched collectives; a signal lost in the vote never stops the run
    torchrun(WORKER, "stop-vote", tmp_path, nproc=2, timeout=600)
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert rank0["signal"] == "SIGUSR1" and rank1["signal"] is None
    assert rank0["votes"] == rank1["votes"], (rank0, rank1)
    assert rank0["votes"][-1] is True, "the signal was lost"
