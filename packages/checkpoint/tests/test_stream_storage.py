"""Format 2 (raw tensor bytes, `stream_storage`): what it writes, that damage is an error naming
the file and the tensor, that format-1 checkpoints written by earlier versions still load, and
that reads land in the destination tensors."""

from __future__ import annotations

import json
import pickle
import shutil
from hashlib import sha256
from pathlib import Path

import pytest
import torch
import xxhash

from llmtrain.checkpoint.export import load_model_weights
from llmtrain.checkpoint.manager import Checkpointer, CheckpointError, CorruptCheckpointError
from llmtrain.checkpoint.state import ModelState, Values
from llmtrain.checkpoint.stream_storage import (
    FORMAT,
    SUFFIX,
    StoredItem,
    StreamReader,
    _landing,
)

DATA = Path(__file__).parent / "data"


def damaged_line(root: Path | str, name: str, problem: str) -> str:
    """The one line a damaged file `name` of step 2 in checkpoint directory `root` gets."""
    return (
        f"{root}/step-2/{name} {problem}: checkpoint step-2 is damaged (it was left as it is); "
        f"use an earlier step (`llmtrain checkpoints {root}` lists them; a resume takes the "
        "newest, so rename step-2, e.g. to step-2.damaged) or restore the file from a copy"
    )


def saved(tmp_path, tiny, *, threads: int = 4):
    """A committed step 2 of the tiny model (trained 2 steps) and its snapshot."""
    model, optimizer = tiny.make(seed=0, steps=2)
    checkpoints = Checkpointer(str(tmp_path / "ckpt"), io_threads=threads)
    checkpoints.save(
        2, {"train": ModelState(model, [optimizer]), "counters": Values(step=2, tokens=48)}
    )
    checkpoints.close()
    return tmp_path / "ckpt" / "step-2", model, optimizer


def stored_items(step_dir: Path) -> dict[str, StoredItem]:
    """fqn -> where its bytes are, from the step's metadata (read here without the allow-list
    on purpose: the test wrote it)."""
    metadata = pickle.loads((step_dir / ".metadata").read_bytes())
    return {index.fqn: info for index, info in metadata.storage_data.items()}


def load_into_fresh(url: str, tiny):
    fresh, _ = tiny.make(seed=7)
    optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    counters = Values(step=0, tokens=0)
    step = Checkpointer(url).load({"train": ModelState(fresh, [optimizer]), "counters": counters})
    return step, fresh, optimizer, counters


def test_a_rank_writes_one_file_per_thread_of_raw_tensor_bytes_with_their_hash(tmp_path, tiny):
    step_dir, model, _ = saved(tmp_path, tiny, threads=3)
    assert sorted(p.name for p in step_dir.glob(f"*{SUFFIX}")) == [
        f"__0_{i}{SUFFIX}" for i in range(3)
    ]
    items = stored_items(step_dir)
    weight = items["train.model.fc1.weight"]
    assert (weight.dtype, weight.shape) == ("torch.float32", (32, 16))
    raw = (step_dir / weight.relative_path).read_bytes()[
        weight.offset : weight.offset + weight.length
    ]
    # the tensor's own bytes, nothing around them, and the XXH3 hash of exactly those
    assert raw == model.fc1.weight.detach().numpy().tobytes()
    assert weight.xxh3 == xxhash.xxh3_64_intdigest(raw)
    # the threads' files hold about equal bytes: within one tensor, plus the small pickled
    # values (step counters, optimizer settings) dealt round-robin
    sizes = sorted(p.stat().st_size for p in step_dir.glob(f"*{SUFFIX}"))
    values = sum(i.length for i in items.values() if i.dtype is None)
    largest = max(i.length for i in items.values() if i.dtype is not None)
    assert sizes[-1] - sizes[0] <= largest + values
    record = json.loads((step_dir / "COMMITTED").read_text())
    assert record["format"] == FORMAT == 2


@pytest.mark.parametrize("threads", [1, 4])
def test_a_round_trip_is_bit_identical(tmp_path, tiny, threads):
    step_dir, model, optimizer = saved(tmp_path, tiny, threads=threads)
    step, fresh, fresh_optimizer, counters = load_into_fresh(str(step_dir.parent), tiny)
    assert step == 2 and (counters["step"], counters["tokens"]) == (2, 48)
    for name, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value), name
    theirs, ours = optimizer.state_dict()["state"], fresh_optimizer.state_dict()["state"]
    for key in theirs:
        for moment in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(ours[key][moment], theirs[key][moment])


def digest(tensor: torch.Tensor) -> dict:
    """Shaped like `data/format1.expected.json`'s tensor entries (see `data/record_format1.py`)."""
    data = tensor.detach().contiguous()
    raw = data.reshape(-1).view(torch.uint8).numpy().tobytes()
    return {"dtype": str(data.dtype), "shape": list(data.shape), "sha256": sha256(raw).hexdigest()}


def test_a_checkpoint_of_the_previous_format_still_loads(tmp_path, tiny):
    """`data/format1` was written by the Checkpointer before format 2 (DCP's FileSystemWriter,
    torch.save per tensor): the tiny model of seed 0 after 2 steps, counters 2 / 48. What it holds
    is recorded beside it (`format1.expected.json`, read by torch's own DCP reader): the load must
    give those exact bytes. A fresh training is no reference: it is bitwise equal only on the CPU
    that wrote the file."""
    expected = json.loads((DATA / "format1.expected.json").read_text())
    assert "format" not in json.loads((DATA / "format1" / "step-2" / "COMMITTED").read_text())
    step, fresh, fresh_optimizer, counters = load_into_fresh(str(DATA / "format1"), tiny)
    assert step == 2 and (counters["step"], counters["tokens"]) == (2, 48)
    assert (expected["counters.step"], expected["counters.tokens"]) == (2, 48)
    model_state = fresh.state_dict()
    assert len(model_state) == len([k for k in expected if k.startswith("train.model.")])
    for name, value in model_state.items():
        assert digest(value) == expected[f"train.model.{name}"], name
    names = {id(p): n for n, p in fresh.named_parameters()}
    for param, state in fresh_optimizer.state.items():
        for moment in ("exp_avg", "exp_avg_sq", "step"):
            key = f"train.optim.state.{names[id(param)]}.{moment}"
            assert digest(state[moment]) == expected[key], key
    weights, _, _ = load_model_weights(str(DATA / "format1"))
    assert digest(weights["fc2.bias"]) == expected["train.model.fc2.bias"]


def test_a_checkpoint_of_a_newer_format_is_refused_naming_it(tmp_path, tiny):
    shutil.copytree(DATA / "format1", tmp_path / "newer")
    info = tmp_path / "newer" / "step-2" / "llmtrain.json"
    info.write_text(json.dumps({**json.loads(info.read_text()), "format": 3}))
    with pytest.raises(CheckpointError) as refused:
        load_into_fresh(str(tmp_path / "newer"), tiny)
    assert str(refused.value) == (
        f"{tmp_path / 'newer'}/step-2 is in checkpoint format 3, written by a newer llmtrain; "
        "this one reads formats 1 to 2: upgrade llmtrain-checkpoint"
    )


def _load_error(url: str, tiny) -> str:
    with pytest.raises(CheckpointError) as failed:
        load_into_fresh(url, tiny)
    return str(failed.value)


def test_a_flipped_byte_is_an_error_naming_the_file_and_the_tensor(tmp_path, tiny):
    step_dir, _, _ = saved(tmp_path, tiny)
    item = stored_items(step_dir)["train.model.fc2.weight"]
    path = step_dir / item.relative_path
    data = bytearray(path.read_bytes())
    data[item.offset + item.length // 2] ^= 0x10
    path.write_bytes(bytes(data))
    message = _load_error(str(step_dir.parent), tiny)
    got = xxhash.xxh3_64_intdigest(bytes(data[item.offset : item.offset + item.length]))
    assert message == damaged_line(
        step_dir.parent,
        item.relative_path,
        "does not match the checksum of 'train.model.fc2.weight' "
        f"(XXH3 {got:016x}, written {item.xxh3:016x})",
    )
    # the export reads through the same check
    with pytest.raises(CorruptCheckpointError) as refused:
        load_model_weights(str(step_dir.parent))
    assert str(refused.value) == message


def test_a_truncated_shard_is_an_error_naming_the_file_and_the_tensor(tmp_path, tiny):
    step_dir, _, _ = saved(tmp_path, tiny, threads=1)
    items = stored_items(step_dir)
    last = max(items.items(), key=lambda kv: kv[1].offset)
    path = step_dir / last[1].relative_path
    path.write_bytes(path.read_bytes()[: last[1].offset + 10])
    message = _load_error(str(step_dir.parent), tiny)
    # found before any tensor is read: the file's size is not the one its commit recorded
    recorded = last[1].offset + last[1].length
    assert message == damaged_line(
        step_dir.parent,
        last[1].relative_path,
        f"is truncated: {last[1].offset + 10} bytes, its commit recorded {recorded}",
    )


def test_a_missing_shard_is_an_error_naming_the_file(tmp_path, tiny):
    step_dir, _, _ = saved(tmp_path, tiny, threads=2)
    (step_dir / f"__0_1{SUFFIX}").unlink()
    message = _load_error(str(step_dir.parent), tiny)
    assert message == damaged_line(step_dir.parent, f"__0_1{SUFFIX}", "is missing")


def test_reads_land_in_the_destination_unless_it_is_a_slice_or_another_dtype():
    stored = StoredItem("f", 0, 64, 0, "torch.float32", (4, 4))

    class Whole:
        storage_offsets, lengths = (0, 0), (4, 4)

    class Rows:
        storage_offsets, lengths = (2, 0), (2, 4)

    target = torch.empty(4, 4)
    assert _landing(target, Whole, stored) is target
    assert _landing(target.t(), Whole, stored) is not target  # not contiguous
    assert _landing(target.to(torch.bfloat16), Whole, stored).dtype == torch.float32
    half = torch.empty(2, 4)
    landing = _landing(half, Rows, stored)
    assert landing is not half and landing.shape == (4, 4)


def test_the_reader_reads_metadata_through_the_allow_list(tmp_path, tiny):
    step_dir, _, _ = saved(tmp_path, tiny)
    metadata = StreamReader(str(step_dir)).read_metadata()
    assert isinstance(next(iter(metadata.storage_data.values())), StoredItem)


def test_damage_on_object_storage_is_found_the_same_way(moto_s3, tiny):
    """The object-storage path (one ranged request per file) checks the same hashes."""
    import fsspec

    model, optimizer = tiny.make(seed=0, steps=2)
    Checkpointer(moto_s3).save(2, {"train": ModelState(model, [optimizer])})
    fresh, _ = tiny.make(seed=7)
    assert Checkpointer(moto_s3).load({"train": ModelState(fresh)}) == 2
    assert torch.equal(fresh.fc1.weight, model.fc1.weight)

    fs = fsspec.filesystem("s3")
    step = moto_s3.removeprefix("s3://") + "/step-2"
    metadata = pickle.loads(fs.cat_file(f"{step}/.metadata"))
    items = {index.fqn: info for index, info in metadata.storage_data.items()}
    item = items["train.model.fc1.weight"]
    data = bytearray(fs.cat_file(f"{step}/{item.relative_path}"))
    data[item.offset + 5] ^= 0x01
    fs.pipe_file(f"{step}/{item.relative_path}", bytes(data))
    with pytest.raises(CorruptCheckpointError) as failed:
        Checkpointer(moto_s3).load({"train": ModelState(fresh)})
    got = xxhash.xxh3_64_intdigest(bytes(data[item.offset : item.offset + item.length]))
    assert str(failed.value) == damaged_line(
        moto_s3,
        item.relative_path,
        "does not match the checksum of 'train.model.fc1.weight' "
        f"(XXH3 {got:016x}, written {item.xxh3:016x})",
    )


def test_tied_weights_are_read_into_buffers_of_their_own(tmp_path, tiny, monkeypatch):
    """The embedding and the head it is tied to are two stored items read into one storage, by
    two threads at once: each lands in a buffer of its own, so each hash is checked against its
    own bytes (read straight into the shared memory, a damaged embedding was once hashed as the
    head's intact copy overwrote it, and passed). Untied tensors still land in place."""
    import llmtrain.checkpoint.stream_storage as storage

    model, optimizer = tiny.make(seed=0, steps=1)
    assert model.head.weight.data_ptr() == model.embed.weight.data_ptr()
    checkpoints = Checkpointer(str(tmp_path / "ckpt"), io_threads=2)
    checkpoints.save(1, {"train": ModelState(model, [optimizer]), "counters": Values(step=1)})
    checkpoints.close()

    landed: dict[str, bool] = {}
    real = storage._landing

    def landing(target, req, stored, private=False):
        landed[req.storage_index.fqn] = private
        return real(target, req, stored, private)

    monkeypatch.setattr(storage, "_landing", landing)
    fresh, fresh_optimizer = tiny.make(seed=5)
    Checkpointer(str(tmp_path / "ckpt")).load(
        {"train": ModelState(fresh, [fresh_optimizer]), "counters": Values(step=0)}
    )
    assert landed["train.model.embed.weight"] and landed["train.model.head.weight"]
    assert not any(
        private for fqn, private in landed.items() if "embed" not in fqn and "head" not in fqn
    )
    assert torch.equal(fresh.embed.weight, model.embed.weight)
    assert fresh.head.weight.data_ptr() == fresh.embed.weight.data_ptr()
