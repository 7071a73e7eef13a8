"""The Checkpointer in one process: round trips (local and S3), async saves, the keep policy,
commit markers, errors people can act on, safe loading, export and the preemption flag."""

from __future__ import annotations

import copy
import json
import os
import pickle
import random
import signal
import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import fsspec
import pytest
import torch
from fsspec.implementations.local import LocalFileSystem
from hypothesis import given
from hypothesis import strategies as st

from llmtrain.checkpoint.integrity import file_entry, seal
from llmtrain.checkpoint.manager import (
    Checkpointer,
    CheckpointError,
    CorruptCheckpointError,
    KeepPolicy,
)
from llmtrain.checkpoint.preemption import Preemption
from llmtrain.checkpoint.state import ModelState, Values
from llmtrain.checkpoint.stream_storage import SUFFIX

# -- helpers -------------------------------------------------------------------------------------


def reseal(step_dir: Path, name: str) -> None:
    """Rewrite the step's COMMITTED for file `name` as it is now (what a tamperer would do)."""
    commit = json.loads((step_dir / "COMMITTED").read_text())
    files = commit.pop("files")
    del commit["xxh3"]
    files[name] = file_entry((step_dir / name).read_bytes())
    (step_dir / "COMMITTED").write_bytes(seal(commit, files))


def snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Deep copies of the model's tensors and the optimizer's state, to compare with later."""
    taken = {"model": {k: v.detach().clone() for k, v in model.state_dict().items()}}
    if optimizer is not None:
        taken["optim"] = copy.deepcopy(optimizer.state_dict())
    return taken


def assert_model_equals(model: torch.nn.Module, expected: dict) -> None:
    got = model.state_dict()
    assert list(got) == list(expected["model"])
    for key, value in expected["model"].items():
        assert torch.equal(got[key], value), key


def assert_optim_equals(optimizer: torch.optim.Optimizer, expected: dict) -> None:
    got, want = optimizer.state_dict(), expected["optim"]
    assert sorted(got["state"]) == sorted(want["state"])
    for index, moments in want["state"].items():
        assert sorted(got["state"][index]) == sorted(moments)
        for name, value in moments.items():
            assert torch.equal(
                torch.as_tensor(got["state"][index][name]), torch.as_tensor(value)
            ), (
                index,
                name,
            )
    for group, want_group in zip(got["param_groups"], want["param_groups"], strict=True):
        for name in ("lr", "betas", "eps", "weight_decay", "params"):
            assert group[name] == want_group[name], name


def step_dirs(root: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in root.glob("step-*"))


def in_thread(action) -> threading.Thread:
    """Run `action` in a daemon thread (so a test can see whether it returns); errors are kept
    on the thread as `.error`."""

    def run():
        try:
            action()
        except BaseException as exc:
            thread.error = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.error = None
    thread.start()
    return thread


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RunsCode:
    """Pickles to a call of os.system: unpickling it runs a shell command that creates `path`."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


class Position:
    """A harmless custom class: still not plain data, so weights_only loading must refuse it."""

    def __init__(self, shard: int, offset: int):
        self.shard, self.offset = shard, offset


class GatedFS(LocalFileSystem):
    """The local filesystem under `gated://`, whose tensor-data writes wait for `gate` (or fail while
    `failures` is above zero, counting down): it makes a save's write last as long as a test
    needs, or fail like a full disk. Every file opened for writing is recorded in `writes`."""

    protocol = ("gated",)
    gate = threading.Event()
    failures = 0
    writes: list[str] = []

    @classmethod
    def _strip_protocol(cls, path):
        if isinstance(path, str) and path.startswith("gated://"):
            path = path[len("gated://") :]
        return super()._strip_protocol(path)

    def _open(self, path, mode="rb", **kwargs):
        if "w" in mode or "a" in mode:
            type(self).writes.append(str(path))
            if str(path).endswith(SUFFIX):
                if type(self).failures > 0:
                    type(self).failures -= 1
                    raise OSError(f"no space left on device: {path}")
                type(self).gate.wait(timeout=60)
        return super()._open(path, mode, **kwargs)


@pytest.fixture
def gated(tmp_path):
    GatedFS.gate, GatedFS.failures, GatedFS.writes = threading.Event(), 0, []
    GatedFS.clear_instance_cache()
    fsspec.register_implementation("gated", GatedFS, clobber=True)
    try:
        yield SimpleNamespace(url=f"gated://{tmp_path}/ckpt", path=tmp_path / "ckpt", fs=GatedFS)
    finally:
        GatedFS.gate.set()


def wait_for(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


# -- round trips -----------------------------------------------------------------------------------


def test_round_trip_restores_model_optimizer_counters_and_rng(location, tiny):
    model, optimizer = tiny.make(seed=0, steps=3)
    counters = Values(step=3, tokens=3 * 24, lr_scale=0.5, data_position="shard-2:17")
    saved = snapshot(model, optimizer)
    run_random = random.Random(5)
    run_random.random()
    Checkpointer(location, python_rng=run_random).save(
        3,
        {"train": ModelState(model, [optimizer]), "counters": counters},
        info={"model": {"dim": 16, "vocab": 32}},
    )
    after_save = (torch.rand(5), run_random.random())
    # the run goes on: what a resumed run must reproduce
    expected_losses = [tiny.train_step(model, optimizer, seed=s) for s in (50, 51)]

    torch.manual_seed(123)
    fresh_random = random.Random(123)
    fresh, _ = tiny.make(seed=7)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.123)
    fresh_counters = Values(step=0, tokens=0, lr_scale=1.0, data_position="")
    # a new process would build a new one
    checkpoints = Checkpointer(location, python_rng=fresh_random)
    assert checkpoints.latest_step() == 3
    step = checkpoints.load(
        {"train": ModelState(fresh, [fresh_optimizer]), "counters": fresh_counters}
    )

    assert step == 3
    after_load = (torch.rand(5), fresh_random.random())
    assert torch.equal(after_load[0], after_save[0])
    assert after_load[1] == after_save[1]
    assert_model_equals(fresh, saved)
    assert fresh.head.weight is fresh.embed.weight, "loading untied the tied weights"
    assert_optim_equals(fresh_optimizer, saved)
    assert fresh_counters.values == {
        "step": 3,
        "tokens": 72,
        "lr_scale": 0.5,
        "data_position": "shard-2:17",
    }
    assert type(fresh_counters["step"]) is int
    assert checkpoints.info(3)["info"] == {"model": {"dim": 16, "vocab": 32}}
    losses = [tiny.train_step(fresh, fresh_optimizer, seed=s) for s in (50, 51)]
    assert losses == expected_losses


def _retried_request_to_a_closed_port() -> None:
    """A real botocore S3 request to a port nothing listens on, retried once by botocore (its
    retry jitter draws from the global `random`)."""
    import botocore.config
    import botocore.exceptions
    import botocore.session

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = botocore.session.get_session().create_client(
        "s3",
        endpoint_url=f"http://127.0.0.1:{port}",
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        config=botocore.config.Config(retries={"max_attempts": 2, "mode": "standard"}),
    )
    with pytest.raises(botocore.exceptions.EndpointConnectionError):
        client.list_buckets()


def test_a_library_drawing_from_global_random_leaves_the_checkpointed_rng_alone(tmp_path, tiny):
    """Between two saves an S3 request is retried: the random state the checkpoints record (the
    run's own generator, torch) is what it would have been without the retry."""
    model, optimizer = tiny.make(seed=0, steps=1)
    state = {"train": ModelState(model, [optimizer])}
    checkpoints = Checkpointer(str(tmp_path), python_rng=random.Random(4))
    checkpoints.save(1, state)
    global_before = random.getstate()
    _retried_request_to_a_closed_port()
    assert random.getstate() != global_before, "botocore no longer draws from the global random"
    checkpoints.save(2, state)

    recorded = [
        json.loads((tmp_path / f"step-{s}" / "rng" / "rank0.json").read_text()) for s in (1, 2)
    ]
    assert recorded[0] == recorded[1]
    assert recorded[0]["python"] == json.loads(json.dumps(random.Random(4).getstate()))


def test_weights_only_load_keeps_this_process_rng(tmp_path, tiny):
    """A warm start loads a model part alone and must not take over the saver's random state."""
    model, optimizer = tiny.make(seed=0, steps=2)
    saved = snapshot(model, optimizer)
    Checkpointer(str(tmp_path), python_rng=random.Random(9)).save(
        2, {"train": ModelState(model, [optimizer])}
    )
    fresh, _ = tiny.make(seed=7)
    torch.manual_seed(123)
    expected = (torch.rand(5), random.Random(123).random())
    torch.manual_seed(123)
    own_random = random.Random(123)
    checkpoints = Checkpointer(str(tmp_path), python_rng=own_random)
    step = checkpoints.load({"train": ModelState(fresh)}, restore_rng=False)
    assert step == 2
    assert_model_equals(fresh, saved)
    got = (torch.rand(5), own_random.random())
    assert torch.equal(got[0], expected[0]) and got[1] == expected[1]


def test_nothing_to_load_returns_none(tmp_path, tiny):
    model, _ = tiny.make()
    before = snapshot(model)
    assert Checkpointer(str(tmp_path / "empty")).load({"train": ModelState(model)}) is None
    assert_model_equals(model, before)


# -- async saves -----------------------------------------------------------------------------------


def test_async_save_returns_while_writing_and_writes_what_a_sync_save_writes(gated, tiny, tmp_path):
    model, optimizer = tiny.make(seed=0, steps=2)
    twin, twin_optimizer = tiny.make(seed=0, steps=2)
    assert_model_equals(twin, snapshot(model))
    saved = snapshot(model, optimizer)
    counters = Values(step=2, tokens=48)
    checkpoints = Checkpointer(gated.url, async_save=True)

    save = in_thread(
        lambda: checkpoints.save(2, {"train": ModelState(model, [optimizer]), "counters": counters})
    )
    save.join(timeout=30)
    assert not save.is_alive(), "async save() blocked until the write finished"
    assert save.error is None
    # the write is still held at the gate: nothing is committed yet
    assert checkpoints.latest_step() is None
    assert not (gated.path / "step-2" / "COMMITTED").exists()
    # training goes on and changes every parameter, moment and counter in place
    tiny.train_step(model, optimizer, seed=99)
    counters["step"], counters["tokens"] = 3, 72
    assert not torch.equal(model.fc1.weight, saved["model"]["fc1.weight"])

    gated.fs.gate.set()
    checkpoints.close()
    assert checkpoints.committed_steps() == [2]

    reference = tmp_path / "sync"
    Checkpointer(str(reference)).save(
        2, {"train": ModelState(twin, [twin_optimizer]), "counters": Values(step=2, tokens=48)}
    )
    written = sorted(p.name for p in (gated.path / "step-2").glob(f"*{SUFFIX}"))
    assert written == sorted(p.name for p in (reference / "step-2").glob(f"*{SUFFIX}"))
    assert written
    for name in written:
        assert (gated.path / "step-2" / name).read_bytes() == (
            reference / "step-2" / name
        ).read_bytes(), name

    for url in (str(gated.path), str(reference)):
        fresh, _ = tiny.make(seed=5)
        fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.5)
        fresh_counters = Values(step=0, tokens=0)
        Checkpointer(url).load(
            {"train": ModelState(fresh, [fresh_optimizer]), "counters": fresh_counters}
        )
        assert_model_equals(fresh, saved)
        assert_optim_equals(fresh_optimizer, saved)
        assert fresh_counters.values == {"step": 2, "tokens": 48}


def test_only_one_async_save_in_flight_the_next_waits(gated, tiny):
    model, optimizer = tiny.make(seed=0, steps=1)
    state = {"train": ModelState(model, [optimizer])}
    checkpoints = Checkpointer(gated.url, async_save=True, keep=KeepPolicy(last=5))
    first_state = snapshot(model)
    first = in_thread(lambda: checkpoints.save(1, state))
    first.join(timeout=30)
    assert not first.is_alive() and first.error is None

    tiny.train_step(model, optimizer, seed=5)
    second_state = snapshot(model)
    second = in_thread(lambda: checkpoints.save(2, state))
    second.join(timeout=1.0)
    assert second.is_alive(), "a second save started while the first was still being written"
    assert not [w for w in gated.fs.writes if "step-2" in w]

    gated.fs.gate.set()
    second.join(timeout=30)
    assert not second.is_alive() and second.error is None
    checkpoints.close()  # waits for the second save
    assert checkpoints.committed_steps() == [1, 2]
    writes = gated.fs.writes
    first_commit = writes.index(next(w for w in writes if "step-1/COMMITTED" in w))
    first_of_second = writes.index(next(w for w in writes if "step-2" in w))
    assert first_commit < first_of_second

    for step, expected in ((1, first_state), (2, second_state)):
        fresh, _ = tiny.make(seed=9)
        Checkpointer(str(gated.path)).load({"train": ModelState(fresh)}, step=step)
        assert_model_equals(fresh, expected)


def test_a_failed_background_write_is_reported_and_commits_nothing(gated, tiny):
    model, optimizer = tiny.make(seed=0, steps=1)
    gated.fs.gate.set()
    checkpoints = Checkpointer(gated.url, async_save=True)
    checkpoints.save(1, {"train": ModelState(model, [optimizer])})
    checkpoints.wait()
    saved = snapshot(model)

    tiny.train_step(model, optimizer, seed=3)
    gated.fs.failures = 10**6
    checkpoints.save(2, {"train": ModelState(model, [optimizer])})
    with pytest.raises(CheckpointError, match="not committed") as failure:
        checkpoints.wait()
    assert "step-2" in str(failure.value)
    checkpoints.close()
    assert checkpoints.committed_steps() == [1]
    fresh, _ = tiny.make(seed=4)
    assert Checkpointer(str(gated.path)).load({"train": ModelState(fresh)}) == 1
    assert_model_equals(fresh, saved)


def test_a_failing_sync_save_is_retried_with_backoff_then_a_clear_error(gated, tiny):
    model, optimizer = tiny.make(seed=0, steps=1)
    gated.fs.gate.set()
    checkpoints = Checkpointer(gated.url, retries=2, backoff_s=0.01)
    checkpoints.save(1, {"train": ModelState(model, [optimizer])})
    saved = snapshot(model)

    tiny.train_step(model, optimizer, seed=3)
    gated.fs.failures = 10**6
    with pytest.raises(CheckpointError, match="3 attempts") as failure:
        checkpoints.save(2, {"train": ModelState(model, [optimizer])})
    assert "step-2" in str(failure.value)
    # every attempt opens rank 0's first data file (and its other threads' files)
    assert len([w for w in gated.fs.writes if w.endswith(f"step-2/__0_0{SUFFIX}")]) == 3
    assert checkpoints.committed_steps() == [1]
    fresh, _ = tiny.make(seed=4)
    assert Checkpointer(str(gated.path)).load({"train": ModelState(fresh)}) == 1
    assert_model_equals(fresh, saved)


def test_a_transient_write_failure_is_retried_and_the_save_commits(gated, tiny):
    model, optimizer = tiny.make(seed=0, steps=1)
    gated.fs.gate.set()
    gated.fs.failures = 1
    checkpoints = Checkpointer(gated.url, retries=2, backoff_s=0.01)
    checkpoints.save(1, {"train": ModelState(model, [optimizer])})
    assert checkpoints.committed_steps() == [1]
    fresh, _ = tiny.make(seed=4)
    assert Checkpointer(str(gated.path)).load({"train": ModelState(fresh)}) == 1
    assert_model_equals(fresh, snapshot(model))


# -- keep policy and commit markers ------------------------------------------------------------


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize(
    ("last", "every", "saves", "expected"),
    [
        (1, 0, 5, [5]),
        (2, 0, 6, [5, 6]),
        (2, 3, 10, [3, 6, 9, 10]),
        (1, 4, 9, [4, 8, 9]),
        (3, 5, 4, [2, 3, 4]),
        (2, 5, 10, [5, 9, 10]),
    ],
)
def test_keep_policy_leaves_exactly_the_expected_steps(
    tmp_path, last, every, saves, expected, async_save
):
    root = tmp_path / "ckpt"
    model = torch.nn.Linear(4, 4)
    checkpoints = Checkpointer(str(root), keep=KeepPolicy(last, every), async_save=async_save)
    for step in range(1, saves + 1):
        with torch.no_grad():
            model.weight.fill_(step)
        checkpoints.save(step, {"m": ModelState(model)})
        if not async_save:
            assert checkpoints.latest_step() == step
    checkpoints.close()
    assert checkpoints.committed_steps() == expected
    assert step_dirs(root) == expected
    for step in expected:
        fresh = torch.nn.Linear(4, 4)
        Checkpointer(str(root)).load({"m": ModelState(fresh)}, step=step)
        assert torch.equal(fresh.weight, torch.full((4, 4), float(step)))


@given(
    committed=st.sets(st.integers(0, 200), min_size=1, max_size=30),
    last=st.integers(1, 6),
    every=st.integers(0, 12),
)
def test_keep_policy_never_deletes_the_newest_and_keeps_exactly_what_it_says(
    committed, last, every
):
    steps = sorted(committed)
    doomed = KeepPolicy(last, every).deletable(steps)
    kept = set(steps) - set(doomed)
    assert steps[-1] in kept
    assert set(doomed) <= set(steps)
    expected = set(steps[-last:]) | ({s for s in steps if s % every == 0} if every else set())
    assert kept == expected


def test_keep_policy_must_keep_at_least_one():
    with pytest.raises(ValueError, match="at least 1"):
        KeepPolicy(last=0)


def test_uncommitted_steps_are_invisible_and_cleaned_up_by_the_next_commit(tmp_path, tiny):
    root = tmp_path / "ckpt"
    model, optimizer = tiny.make(seed=0, steps=1)
    checkpoints = Checkpointer(str(root), keep=KeepPolicy(last=10))
    expected = {}
    for step in (1, 2, 3):
        tiny.train_step(model, optimizer, seed=step)
        expected[step] = snapshot(model)
        checkpoints.save(step, {"train": ModelState(model, [optimizer]), "c": Values(step=step)})
    # step 3 was written but its commit marker never was; step 4 died in the middle of its data
    (root / "step-3" / "COMMITTED").unlink()
    partial = root / "step-4"
    (partial / "rng").mkdir(parents=True)
    (partial / "rng" / "rank0.json").write_text("{}")
    (partial / "__0_0.distcp").write_bytes(b"\x00" * 100)

    restarted = Checkpointer(str(root), keep=KeepPolicy(last=10))
    assert restarted.committed_steps() == [1, 2]
    assert restarted.latest_step() == 2
    fresh, _ = tiny.make(seed=8)
    counters = Values(step=0)
    assert restarted.load({"train": ModelState(fresh), "c": counters}) == 2
    assert_model_equals(fresh, expected[2])
    assert counters["step"] == 2
    for unfinished in (3, 4):
        with pytest.raises(CheckpointError, match="not committed") as refused:
            restarted.load({"train": ModelState(fresh)}, step=unfinished)
        assert f"step-{unfinished}" in str(refused.value)
        assert str(refused.value).endswith("1, 2")

    restarted.save(5, {"train": ModelState(model, [optimizer]), "c": Values(step=5)})
    assert step_dirs(root) == [1, 2, 5]


def test_a_leftover_of_the_same_step_is_replaced(tmp_path, tiny):
    root = tmp_path / "ckpt"
    (root / "step-3").mkdir(parents=True)
    (root / "step-3" / "__0_0.distcp").write_bytes(b"garbage")
    (root / "step-3" / "stale.txt").write_text("from a crashed run")
    model, optimizer = tiny.make(seed=0, steps=1)
    checkpoints = Checkpointer(str(root))
    assert checkpoints.latest_step() is None
    checkpoints.save(3, {"train": ModelState(model, [optimizer])})
    assert not (root / "step-3" / "stale.txt").exists()
    fresh, _ = tiny.make(seed=3)
    assert checkpoints.load({"train": ModelState(fresh)}) == 3
    assert_model_equals(fresh, snapshot(model))


# -- errors ----------------------------------------------------------------------------------------


def test_a_missing_step_is_an_error_listing_what_exists(tmp_path, tiny):
    model, _ = tiny.make()
    empty = Checkpointer(str(tmp_path / "empty"))
    with pytest.raises(CheckpointError, match=r"step-1 does not exist.*none"):
        empty.load({"train": ModelState(model)}, step=1)

    checkpoints = Checkpointer(str(tmp_path / "ckpt"))
    for step in (10, 20):
        checkpoints.save(step, {"train": ModelState(model)})
    with pytest.raises(CheckpointError) as missing:
        checkpoints.load({"train": ModelState(model)}, step=15)
    message = str(missing.value)
    assert "step-15" in message and "does not exist" in message
    assert message.endswith("10, 20")


def test_a_different_model_shape_names_the_first_mismatching_tensor_and_both_shapes(tmp_path, tiny):
    model, optimizer = tiny.make(seed=0, steps=1, hidden=32)
    checkpoints = Checkpointer(str(tmp_path / "ckpt"))
    checkpoints.save(1, {"train": ModelState(model, [optimizer])})

    wider, wider_optimizer = tiny.make(seed=1, steps=1, hidden=64)
    before = snapshot(wider, wider_optimizer)
    with pytest.raises(CheckpointError) as mismatch:
        checkpoints.load({"train": ModelState(wider, [wider_optimizer])})
    message = str(mismatch.value)
    # embed and norm match; fc1.weight is the first tensor that does not
    assert "'train.model.fc1.weight'" in message
    assert "(32, 16)" in message and "(64, 16)" in message
    assert "fc2" not in message
    assert_model_equals(wider, before)
    assert_optim_equals(wider_optimizer, before)


def test_saving_over_a_committed_step_is_refused(tmp_path, tiny):
    root = tmp_path / "ckpt"
    model, optimizer = tiny.make(seed=0, steps=1)
    checkpoints = Checkpointer(str(root))
    checkpoints.save(1, {"train": ModelState(model, [optimizer])})
    saved = snapshot(model)
    tiny.train_step(model, optimizer, seed=2)
    with pytest.raises(CheckpointError, match="already committed"):
        checkpoints.save(1, {"train": ModelState(model, [optimizer])})
    fresh, _ = tiny.make(seed=4)
    assert Checkpointer(str(root)).load({"train": ModelState(fresh)}) == 1
    assert_model_equals(fresh, saved)


@pytest.mark.timeout(90)
def test_an_unreachable_object_store_is_a_clear_error_and_leaves_checkpoints_intact(moto_s3, tiny):
    model, optimizer = tiny.make(seed=0, steps=1)
    Checkpointer(moto_s3).save(1, {"train": ModelState(model, [optimizer])})
    saved = snapshot(model)

    tiny.train_step(model, optimizer, seed=2)
    unreachable = Checkpointer(
        moto_s3,
        storage_options={
            "endpoint_url": f"http://127.0.0.1:{closed_port()}",
            "config_kwargs": {
                "retries": {"max_attempts": 1, "mode": "standard"},
                "connect_timeout": 1,
                "read_timeout": 1,
            },
        },
        retries=1,
        backoff_s=0.01,
    )
    with pytest.raises(CheckpointError) as failure:
        unreachable.save(2, {"train": ModelState(model, [optimizer])})
    assert moto_s3 in str(failure.value)

    good = Checkpointer(moto_s3)
    assert good.committed_steps() == [1]
    fresh, _ = tiny.make(seed=3)
    assert good.load({"train": ModelState(fresh)}) == 1
    assert_model_equals(fresh, saved)


# -- loading never runs code from the checkpoint ---------------------------------------------------


@pytest.mark.parametrize("where", ["whole", "nested"])
def test_metadata_that_names_a_foreign_global_is_refused_and_never_runs(
    tmp_path, tiny, run_cli, where
):
    # the payload is live: plain unpickling runs it
    control = tmp_path / "control"
    pickle.loads(pickle.dumps(RunsCode(control)))
    assert control.exists()

    root = tmp_path / "ckpt"
    model, optimizer = tiny.make(seed=0, steps=1)
    Checkpointer(str(root)).save(1, {"train": ModelState(model, [optimizer])})
    marker = tmp_path / "pwned"
    metadata_file = root / "step-1" / ".metadata"
    if where == "whole":
        metadata_file.write_bytes(pickle.dumps(RunsCode(marker)))
    else:
        with metadata_file.open("rb") as f:
            metadata = pickle.load(f)
        metadata.planner_data = {"note": RunsCode(marker)}
        metadata_file.write_bytes(pickle.dumps(metadata))

    fresh, _ = tiny.make(seed=2)
    before = snapshot(fresh)
    # as it is, the file is not the one its commit recorded: refused before it is unpickled
    with pytest.raises(CorruptCheckpointError) as refused:
        Checkpointer(str(root)).load({"train": ModelState(fresh)})
    assert refused.value.file == f"{root}/step-1/.metadata"
    assert not marker.exists()
    # a tamperer rewrites the commit's manifest too (its hashes are no defence against that):
    # the allow-list refuses what the metadata names
    reseal(root / "step-1", ".metadata")
    with pytest.raises(CheckpointError, match=r"system.*refusing"):
        Checkpointer(str(root)).load({"train": ModelState(fresh)})
    assert not marker.exists()
    assert_model_equals(fresh, before)

    code, _, err = run_cli("export", root, "-o", tmp_path / "export")
    assert not marker.exists()
    assert code == 2, err
    assert "refusing" in err
    assert not (tmp_path / "export" / "model.safetensors").exists()


@pytest.mark.parametrize("kind", ["runs-code", "custom-class"])
def test_a_value_that_is_not_plain_data_is_never_unpickled(tmp_path, kind):
    marker = tmp_path / "pwned"
    value = RunsCode(marker) if kind == "runs-code" else Position(shard=2, offset=17)
    checkpoints = Checkpointer(str(tmp_path / "ckpt"))
    checkpoints.save(1, {"counters": Values(step=1, position=value)})
    assert not marker.exists()
    counters = Values(step=0, position=None)
    with pytest.raises(BaseException) as refused:
        checkpoints.load({"counters": counters})
    assert not marker.exists()
    assert counters["position"] is None
    message = str(refused.value)
    assert "weights_only" in message or "Weights only" in message
    assert ("posix.system" if kind == "runs-code" else "Position") in message
    # a checkpoint that cannot be loaded is a CheckpointError, like unsafe metadata is
    assert isinstance(refused.value, CheckpointError), type(refused.value)


# -- export and the checkpoints command ------------------------------------------------------------


def test_export_writes_the_model_weights_and_config_and_they_load_back(tmp_path, tiny, run_cli):
    from safetensors.torch import load_file

    root = tmp_path / "ckpt"
    model, optimizer = tiny.make(seed=0, steps=2)
    config = {"kind": "tiny", "dim": 16, "hidden": 32, "vocab": 32}
    checkpoints = Checkpointer(str(root))
    checkpoints.save(
        2,
        {"train": ModelState(model, [optimizer]), "counters": Values(step=2)},
        info={"model": config},
    )
    at_step_2 = copy.deepcopy(model)
    tiny.train_step(model, optimizer, seed=3)
    checkpoints.save(
        3,
        {"train": ModelState(model, [optimizer]), "counters": Values(step=3)},
        info={"model": config},
    )

    out = tmp_path / "export"
    code, stdout, err = run_cli("export", root, "-o", out, "--step", 2)
    assert code == 0, err
    assert "step-2" in stdout
    # model_options.json, not config.json: this is no transformers directory
    assert sorted(p.name for p in out.iterdir()) == [
        "llmtrain.json",
        "model.safetensors",
        "model_options.json",
    ]
    assert json.loads((out / "model_options.json").read_text()) == config
    assert json.loads((out / "llmtrain.json").read_text())["step"] == 2
    weights = load_file(out / "model.safetensors")
    # the model's tensors only: no optimizer moments, no counters
    assert sorted(weights) == sorted(at_step_2.state_dict())
    loaded = tiny.TinyLM()
    loaded.load_state_dict(weights, strict=True)
    tokens = tiny.batch(seed=77)
    with torch.no_grad():
        assert torch.equal(loaded(tokens), at_step_2(tokens))
        assert not torch.equal(loaded(tokens), model(tokens))

    code, _, err = run_cli("export", root, "-o", out)
    assert code == 2
    assert "--overwrite" in err
    code, stdout, err = run_cli("export", root, "-o", out, "--overwrite")
    assert code == 0, err
    newest = tiny.TinyLM()
    newest.load_state_dict(load_file(out / "model.safetensors"))
    with torch.no_grad():
        assert torch.equal(newest(tokens), model(tokens))

    # a transformers directory is never overwritten with llmtrain's format
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    code, _, err = run_cli("export", root, "-o", tmp_path / "hf", "--overwrite")
    assert code == 2 and "holds a transformers model (config.json)" in err
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json"]

    code, _, err = run_cli("export", root, "-o", out, "--overwrite", "--dtype", "bfloat16")
    assert code == 0, err
    halved = load_file(out / "model.safetensors")
    assert {v.dtype for v in halved.values()} == {torch.bfloat16}
    for key, value in model.state_dict().items():
        assert torch.equal(halved[key], value.to(torch.bfloat16)), key


def test_export_from_object_storage(moto_s3, tmp_path, tiny, run_cli):
    from safetensors.torch import load_file

    model, optimizer = tiny.make(seed=0, steps=1)
    Checkpointer(moto_s3).save(
        1, {"train": ModelState(model, [optimizer])}, info={"model": {"dim": 16}}
    )
    code, _, err = run_cli("export", moto_s3, "-o", tmp_path / "export")
    assert code == 0, err
    weights = load_file(tmp_path / "export" / "model.safetensors")
    assert sorted(weights) == sorted(model.state_dict())
    for key, value in model.state_dict().items():
        assert torch.equal(weights[key], value), key
    assert json.loads((tmp_path / "export" / "model_options.json").read_text()) == {"dim": 16}


def test_checkpoints_command_lists_committed_and_unfinished_steps(tmp_path, run_cli):
    root = tmp_path / "ckpt"
    code, out, _ = run_cli("checkpoints", root)
    assert code == 0
    assert "no checkpoints" in out
    checkpoints = Checkpointer(str(root), keep=KeepPolicy(last=5))
    model = torch.nn.Linear(2, 2)
    for step in (1, 2, 3):
        checkpoints.save(step, {"m": ModelState(model)})
    (root / "step-3" / "COMMITTED").unlink()

    code, out, _ = run_cli("checkpoints", root, "--json")
    assert code == 0
    assert json.loads(out) == [
        {"step": 1, "committed": True, "damaged": None},
        {"step": 2, "committed": True, "damaged": None},
        {"step": 3, "committed": False, "damaged": None},
    ]
    code, out, _ = run_cli("checkpoints", root)
    assert code == 0
    lines = out.strip().splitlines()
    assert len(lines) == 3
    assert lines[0].startswith("step-1") and lines[0].endswith("committed")
    assert lines[1].startswith("step-2") and lines[1].endswith("committed")
    assert lines[2].startswith("step-3") and "unfinished" in lines[2]


# -- preemption ------------------------------------------------------------------------------------


def test_sigusr1_requests_a_stop_and_restore_puts_the_old_handler_back():
    calls = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: calls.append(signum))
    try:
        preemption = Preemption()
        assert not preemption.should_stop()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert wait_for(lambda: preemption.requested)
        assert preemption.should_stop()
        assert preemption.signal_name == "SIGUSR1"
        assert calls == []
        preemption.restore()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert wait_for(lambda: calls == [signal.SIGUSR1])
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_sigterm_requests_a_stop_and_restore_puts_the_old_handler_back():
    before = signal.getsignal(signal.SIGTERM)
    preemption = Preemption()
    try:
        assert signal.getsignal(signal.SIGTERM) is not before
        os.kill(os.getpid(), signal.SIGTERM)
        assert wait_for(lambda: preemption.requested)
        assert preemption.should_stop()
        assert preemption.signal_name == "SIGTERM"
    finally:
        preemption.restore()
    assert signal.getsignal(signal.SIGTERM) == before


def test_a_world_of_one_reads_its_flag_without_a_collective(monkeypatch):
    """One rank has nobody to ask: should_stop() is the flag, with no all-reduce (whose result
    the host would have to read from the device every step)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    preemption = Preemption(signals=(signal.SIGUSR1,))
    try:

        def no_collective(*args, **kwargs):
            raise AssertionError("a world of one voted")

        monkeypatch.setattr(dist, "all_reduce", no_collective)
        assert not preemption.should_stop()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert wait_for(lambda: preemption.requested)
        assert preemption.should_stop()
    finally:
        preemption.restore()
        dist.destroy_process_group()


def test_a_signal_that_arrives_during_the_stop_vote_is_not_lost(monkeypatch):
    """should_stop() all-reduces the flag across ranks; SLURM's signal can land while that
    collective runs (here: a world of one that says it has two ranks, so the vote runs, and the
    signal sent as the all-reduce starts)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    preemption = Preemption(signals=(signal.SIGUSR1,))
    try:
        monkeypatch.setattr(dist, "get_world_size", lambda *args, **kwargs: 2)
        all_reduce = dist.all_reduce

        def signalled_during(tensor, *args, **kwargs):
            os.kill(os.getpid(), signal.SIGUSR1)
            return all_reduce(tensor, *args, **kwargs)

        monkeypatch.setattr(dist, "all_reduce", signalled_during)
        first_vote = preemption.should_stop()
        monkeypatch.setattr(dist, "all_reduce", all_reduce)
        assert preemption.signal_name == "SIGUSR1"
        # the vote under way may still say no, but the request must survive it
        assert first_vote or preemption.should_stop(), "the SIGUSR1 was forgotten"
        assert preemption.requested
    finally:
        preemption.restore()
        dist.destroy_process_group()
