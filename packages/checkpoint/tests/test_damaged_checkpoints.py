"""Every damaged file of a committed step is one clear error naming it, never a crash or wrong
state, and the damaged step is left exactly as it was.

A table of generated cases (seeded, so a failure reproduces by its id) damages each file a step
holds in a copy of one real checkpoint saved per module: deleted, emptied, truncated at random
points, random bytes flipped, grown, replaced by binary garbage, by text, by other valid JSON
(another step's file, a JSON of the wrong shape), a directory in its place. Each case asserts that
the resume (`Checkpointer.load`), the weights-only read of `export` / `eval` / warm starts
(`load_model_weights`) and `Checkpointer.damage(full=True)` name the damaged file in one line with
what to do; a sample runs `llmtrain export` and `llmtrain checkpoints --verify` for exit 2.
"""

from __future__ import annotations

import json
import pickle
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import fsspec
import pytest
import torch

from llmtrain.checkpoint.export import load_model_weights
from llmtrain.checkpoint.manager import Checkpointer, CheckpointError, CorruptCheckpointError
from llmtrain.checkpoint.state import ModelState, Values
from llmtrain.core_mesh.errors import UserError

DATA = Path(__file__).parent / "data"
STEP = 2
FILES = ["COMMITTED", "llmtrain.json", ".metadata", "__0_0.bin", "__0_1.bin", "rng/rank0.json"]
# read whole and hashed in the commit's manifest (the data files carry a hash per item)
HASHED = {"llmtrain.json", ".metadata", "rng/rank0.json"}
SEED = 36


def advice(root: str, step: int = STEP) -> str:
    return (
        f": checkpoint step-{step} is damaged (it was left as it is); use an earlier step "
        f"(`llmtrain checkpoints {root}` lists them; a resume takes the newest, so rename "
        f"step-{step}, e.g. to step-{step}.damaged) or restore the file from a copy"
    )


# --- the saved checkpoint and the damage done to copies of it -------------------------------------


def state_of(tiny, seed: int) -> tuple[dict, torch.nn.Module]:
    model, optimizer = tiny.make(seed=seed)
    counters = Values(step=0, tokens=0)
    return {"train": ModelState(model, [optimizer]), "counters": counters}, model


@pytest.fixture(scope="module")
def saved(tmp_path_factory, tiny) -> Path:
    """Steps 1 and 2 of the tiny model (two data files each, and Python random states)."""
    root = tmp_path_factory.mktemp("saved") / "ckpt"
    model, optimizer = tiny.make(seed=0, steps=1)
    python_rng = random.Random(0)
    checkpoints = Checkpointer(str(root), io_threads=2, python_rng=python_rng)
    for step in (1, STEP):
        tiny.train_step(model, optimizer, seed=step)
        torch.rand(1), python_rng.random()  # each step's random states differ
        state = {"train": ModelState(model, [optimizer]), "counters": Values(step=step, tokens=9)}
        checkpoints.save(step, state, info={"model": {"kind": "tiny", "dim": 16}})
    checkpoints.close()
    assert sorted(
        str(p.relative_to(root / f"step-{STEP}")) for p in (root / f"step-{STEP}").rglob("*")
    ) == sorted([*FILES, "rng"])
    return root


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every path under `root` and its bytes (None for a directory)."""
    return {
        str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None)
        for p in sorted(root.rglob("*"))
    }


class Case:
    """One damage to file `name` of step 2: `apply(path, rng)` and the problem the error must
    state (`expected(size)`: a regex, given the file's original size)."""

    def __init__(self, name: str, kind: str, apply: Callable, expected: Callable[[int], str]):
        self.name, self.kind, self.apply, self.expected = name, kind, apply, expected
        self.at: float | None = None  # where a flipped byte is, as a fraction of the file

    def export_reads(self, saved: Path) -> bool:
        """Whether reading the weights only meets the damage: not the random states, and of a
        data file's flipped byte only one in a model tensor (the optimizer's are not read)."""
        if self.name.startswith("rng/"):
            return False
        if self.at is None or not self.name.endswith(".bin"):
            return True
        size = (saved / f"step-{STEP}" / self.name).stat().st_size
        offset = min(size - 1, int(self.at * size))
        metadata = pickle.loads((saved / f"step-{STEP}" / ".metadata").read_bytes())
        return any(
            stored.relative_path == self.name
            and stored.offset <= offset < stored.offset + stored.length
            and index.fqn.startswith("train.model.")
            for index, stored in metadata.storage_data.items()
        )

    @property
    def id(self) -> str:
        return f"{self.name}-{self.kind}"


def _write(data: bytes) -> Callable:
    def apply(path: Path, original: bytes) -> None:
        path.write_bytes(data)

    return apply


def _truncate(fraction: float) -> Callable:
    def apply(path: Path, original: bytes) -> None:
        path.write_bytes(original[: _cut(fraction, len(original))])

    return apply


def _cut(fraction: float, size: int) -> int:
    return min(size - 1, max(1, int(fraction * size)))


def _flip(fraction: float, mask: int) -> Callable:
    def apply(path: Path, original: bytes) -> None:
        data = bytearray(original)
        data[min(len(data) - 1, int(fraction * len(data)))] ^= mask
        path.write_bytes(bytes(data))

    return apply


def _delete(path: Path, original: bytes) -> None:
    path.unlink()


def _directory(path: Path, original: bytes) -> None:
    path.unlink()
    path.mkdir()
    (path / "x").write_text("{}")


def _grow(path: Path, original: bytes) -> None:
    path.write_bytes(original + b"\0" * 7)


def _from_step_1(name: str) -> Callable:
    """The same file of step 1 in its place."""

    def apply(path: Path, original: bytes) -> None:
        step_dir = path.parents[len(Path(name).parts) - 1]
        shutil.copyfile(step_dir.parent / "step-1" / name, path)

    return apply


def size_problem(got: int, recorded: int, name: str = "") -> str:
    """The problem of a file of `got` bytes where the commit recorded `recorded` (of the same
    size: its checksum)."""
    if got == recorded:
        return ITEM_CHECKSUM if name.endswith(".bin") else CHECKSUM
    if got == 0:
        return re.escape(f"is empty (its commit recorded {recorded} bytes)")
    if got < recorded:
        return re.escape(f"is truncated: {got} bytes, its commit recorded {recorded}")
    return re.escape(f"has {got} bytes, its commit recorded {recorded}")


CHECKSUM = (
    r"does not match the checksum its commit recorded \(XXH3 [0-9a-f]{16}, recorded [0-9a-f]{16}\)"
)
ITEM_CHECKSUM = (
    r"does not match the checksum of '[\w.]+' \(XXH3 [0-9a-f]{16}, written [0-9a-f]{16}\)"
)
NOT_COMMIT = r"is not a commit record \((not JSON: \w+Error: .+|a JSON \w+, not an object)\)"
GARBAGE = [
    b"\x00" * 64,
    bytes(range(256)) * 3,
    b"\x80\x81\xfe\xff not utf-8",
    b"not json {",
    b'{"step": 2,',
    b"[" * 5000,  # deeper than the JSON parser recurses
    pickle.dumps({"step": 2}),
]
OTHER_JSON = [b"[]", b"{}", b"null", b"3", b'"COMMITTED"', b'{"step": "2"}', b'{"step": 1}']


def cases() -> list[Case]:
    """The table: for every file kind, every way to damage it."""
    rng = random.Random(SEED)
    table: list[Case] = []
    for name in FILES:
        commit = name == "COMMITTED"

        def same_size(size: int, commit: bool = commit, name: str = name) -> str:
            if commit:
                return f"({NOT_COMMIT}|does not match its own checksum)"
            return size_problem(size, size, name)

        table.append(
            Case(
                name,
                "empty",
                _write(b""),
                lambda size, commit=commit: "is empty" if commit else size_problem(0, size),
            )
        )
        for _ in range(12):
            fraction = rng.random()
            table.append(
                Case(
                    name,
                    f"truncate-{fraction:.4f}",
                    _truncate(fraction),
                    lambda size, f=fraction, commit=commit: (
                        NOT_COMMIT if commit else size_problem(_cut(f, size), size)
                    ),
                )
            )
        for _ in range(24):
            fraction, mask = rng.random(), rng.randrange(1, 256)
            flip = Case(name, f"flip-{fraction:.4f}-{mask:02x}", _flip(fraction, mask), same_size)
            flip.at = fraction
            table.append(flip)
        for n, garbage in enumerate(GARBAGE):
            table.append(
                Case(
                    name,
                    f"garbage-{n}",
                    _write(garbage),
                    lambda size, g=garbage, commit=commit, name=name: (
                        NOT_COMMIT if commit else size_problem(len(g), size, name)
                    ),
                )
            )
        for n, other in enumerate(OTHER_JSON):
            table.append(
                Case(
                    name,
                    f"json-{n}",
                    _write(other),
                    lambda size, o=other, commit=commit, name=name: (
                        rf"({NOT_COMMIT}|records no step|records step '2', which is no count|"
                        r"records step 1, not 2: it belongs to another step)"
                        if commit
                        else size_problem(len(o), size, name)
                    ),
                )
            )
        table.append(
            Case(
                name,
                "step-1s",
                _from_step_1(name),
                lambda size, commit=commit, name=name: (
                    "does not match its own checksum|records step 1, not 2: it belongs to "
                    "another step"
                    if commit
                    else rf"({CHECKSUM}|{ITEM_CHECKSUM}|has \d+ bytes, its commit recorded \d+|"
                    r"is truncated: \d+ bytes, its commit recorded \d+)"
                ),
            )
        )
        if not commit:  # deleting COMMITTED un-commits the step (its own test below)
            table.append(Case(name, "deleted", _delete, lambda size: "is missing"))
            table.append(Case(name, "directory", _directory, lambda size: "is missing"))
            table.append(Case(name, "grown", _grow, lambda size: size_problem(size + 7, size)))
    return table


CASES = cases()


@pytest.fixture
def damaged_copy(saved, tmp_path, request) -> tuple[str, Case, dict]:
    """(checkpoint directory, case, its files once damaged): a copy of `saved` with the case's
    damage done."""
    case: Case = request.param
    root = tmp_path / "ckpt"
    shutil.copytree(saved, root)
    path = root / f"step-{STEP}" / case.name
    case.apply(path, path.read_bytes() if path.is_file() else b"")
    return str(root), case, snapshot(root)


def expect_damage(error: BaseException, root: str, case: Case, size: int) -> None:
    """`error` is the one line for the case's file."""
    assert isinstance(error, CorruptCheckpointError), repr(error)
    file = f"{root}/step-{STEP}/{case.name}"
    message = str(error)
    assert "\n" not in message
    assert error.file == file, message
    assert message == f"{file} {error.problem}{advice(root)}"
    assert re.fullmatch(case.expected(size), error.problem), (case.expected(size), error.problem)


# --- every case, every reader -----------------------------------------------------------------


@pytest.mark.parametrize("damaged_copy", CASES, ids=[c.id for c in CASES], indirect=True)
def test_a_damaged_file_is_one_line_naming_it_for_every_reader(damaged_copy, saved, tiny):
    root, case, files = damaged_copy
    size = (saved / f"step-{STEP}" / case.name).stat().st_size
    state, model = state_of(tiny, seed=5)
    before = {k: v.clone() for k, v in model.state_dict().items()}

    # resuming: refused before anything is loaded
    with pytest.raises(UserError) as resumed:
        Checkpointer(root).load(state)
    expect_damage(resumed.value, root, case, size)
    if not case.name.endswith(".bin"):  # a data file's bytes are checked as they are read
        assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())

    # reading the weights only (export, eval / generate, warm starts): the random states and
    # the optimizer's tensors are not read, and need not be intact
    if not case.export_reads(saved):
        weights, _, step = load_model_weights(root)
        assert step == STEP and sorted(weights) == sorted(model.state_dict())
    else:
        with pytest.raises(UserError) as exported:
            load_model_weights(root)
        expect_damage(exported.value, root, case, size)

    # the listing's check, every byte read
    expect_damage(Checkpointer(root).damage(STEP, full=True), root, case, size)
    # nothing was deleted, rewritten or added: the damaged step is as it was
    assert snapshot(Path(root)) == files


# every twelfth case through the command line as well
SAMPLE = CASES[::12]


@pytest.mark.parametrize("damaged_copy", SAMPLE, ids=[c.id for c in SAMPLE], indirect=True)
def test_the_commands_exit_2_with_one_line(damaged_copy, saved, run_cli, tmp_path):
    root, case, files = damaged_copy
    file = f"{root}/step-{STEP}/{case.name}"
    out = tmp_path / "export"
    code, stdout, err = run_cli("export", root, "-o", out)
    if not case.export_reads(saved):  # the weights are intact, and exported
        assert code == 0, err
        assert (out / "model.safetensors").exists()
    else:
        assert code == 2, err
        assert err.count("\n") == 1 and err.startswith(f"error: {file} "), err
        assert err.rstrip("\n").endswith(advice(root)), err
        assert "Traceback" not in err and "this is a bug" not in err
        assert not out.exists()

    code, stdout, err = run_cli("checkpoints", root, "--verify")
    assert code == 2, err
    assert stdout.splitlines()[0] == "step-1  committed"
    assert stdout.splitlines()[1].startswith(f"step-2  committed, DAMAGED: {file} ")
    assert err == f"error: {root}: damaged: step-2 (see the list above)\n"
    assert snapshot(Path(root)) == files


# --- the rest of the rows ---------------------------------------------------------------------


def test_only_committed_left_names_the_first_file_a_load_reads(saved, tmp_path, tiny):
    root = tmp_path / "ckpt"
    shutil.copytree(saved, root)
    for path in (root / "step-2").iterdir():
        if path.name != "COMMITTED":
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    state, _ = state_of(tiny, seed=5)
    with pytest.raises(CorruptCheckpointError) as refused:
        Checkpointer(str(root)).load(state)
    assert str(refused.value) == f"{root}/step-2/llmtrain.json is missing{advice(str(root))}"


def test_a_deleted_commit_marker_makes_the_step_unfinished_and_the_previous_one_loads(
    saved, tmp_path, tiny, run_cli
):
    """The marker is what commits a step: without it the step is an unfinished save (ignored,
    listed as such), and a resume takes the step before."""
    root = tmp_path / "ckpt"
    shutil.copytree(saved, root)
    (root / "step-2" / "COMMITTED").unlink()
    state, _ = state_of(tiny, seed=5)
    assert Checkpointer(str(root)).load(state) == 1
    with pytest.raises(CheckpointError, match="step-2 is not committed"):
        Checkpointer(str(root)).load(state, step=2)
    code, stdout, _ = run_cli("checkpoints", root)
    assert code == 0
    assert stdout.splitlines() == ["step-1  committed", "step-2  unfinished (ignored)"]


def test_the_listing_shows_damage_and_what_to_do_and_exits_0_without_verify(
    saved, tmp_path, run_cli
):
    root = tmp_path / "ckpt"
    shutil.copytree(saved, root)
    metadata = root / "step-2" / ".metadata"
    size = metadata.stat().st_size
    metadata.write_bytes(metadata.read_bytes()[:100])
    code, stdout, err = run_cli("checkpoints", root)
    assert code == 0, err
    assert stdout.splitlines() == [
        "step-1  committed",
        f"step-2  committed, DAMAGED: {metadata} is truncated: 100 bytes, its commit recorded "
        f"{size}",
        "damaged steps are left as they are; a resume takes the newest committed step, so rename "
        "a damaged one (e.g. step-2 to step-2.damaged) to resume from the step before it",
    ]
    code, stdout, _ = run_cli("checkpoints", root, "--json")
    assert json.loads(stdout) == [
        {"step": 1, "committed": True, "damaged": None},
        {
            "step": 2,
            "committed": True,
            "damaged": f"{metadata} is truncated: 100 bytes, its commit recorded {size}",
        },
    ]
    # renamed as the line says, the step before resumes, and nothing is deleted
    (root / "step-2").rename(root / "step-2.damaged")
    code, stdout, _ = run_cli("checkpoints", root, "--verify")
    assert code == 0
    assert stdout.splitlines() == ["step-1  committed"]
    assert (root / "step-2.damaged" / ".metadata").exists()


def test_a_byte_flipped_in_the_metadata_blames_the_metadata_before_unpickling(
    saved, tmp_path, tiny, monkeypatch
):
    root = tmp_path / "ckpt"
    shutil.copytree(saved, root)
    metadata = root / "step-2" / ".metadata"
    data = bytearray(metadata.read_bytes())
    data[len(data) // 2] ^= 0x04
    metadata.write_bytes(bytes(data))
    unpickled = []
    import llmtrain.checkpoint.stream_storage as stream_storage

    monkeypatch.setattr(stream_storage, "load_metadata", lambda f: unpickled.append(f))
    state, _ = state_of(tiny, seed=5)
    with pytest.raises(CorruptCheckpointError) as refused:
        Checkpointer(str(root)).load(state)
    assert refused.value.file == str(metadata)
    assert refused.value.problem.startswith("does not match the checksum its commit recorded")
    assert unpickled == []


def test_random_states_of_a_rank_the_save_had_are_required(saved, tmp_path, tiny):
    """A one-rank save's rng/rank0.json gone: that is damage, not a run that grew."""
    root = tmp_path / "ckpt"
    shutil.copytree(saved, root)
    (root / "step-2" / "rng" / "rank0.json").unlink()
    state, _ = state_of(tiny, seed=5)
    with pytest.raises(CorruptCheckpointError) as refused:
        Checkpointer(str(root)).load(state)
    assert str(refused.value) == (f"{root}/step-2/rng/rank0.json is missing{advice(str(root))}")
    # a weights-only load (a warm start) does not read them
    assert Checkpointer(str(root)).load(state, restore_rng=False) == 2


def test_a_refused_resume_leaves_every_step_as_it_was_and_saving_goes_on_elsewhere(
    saved, tmp_path, tiny
):
    """The damaged newest step is never removed: not by the refused load, not by the keep
    policy of the next commit (it is the newest), not by a save of the same step."""
    root = tmp_path / "ckpt"
    shutil.copytree(saved, root)
    (root / "step-2" / "llmtrain.json").write_text("{}")
    before = snapshot(root)
    state, _ = state_of(tiny, seed=5)
    checkpoints = Checkpointer(str(root))
    with pytest.raises(CorruptCheckpointError):
        checkpoints.load(state)
    with pytest.raises(CheckpointError, match="already committed; refusing to overwrite it"):
        checkpoints.save(2, state)
    assert snapshot(root) == before


def test_a_commit_of_a_newer_format_is_refused_as_newer_not_as_damage(saved, tmp_path, tiny):
    """A later version may record its manifest otherwise: its format is what is named."""
    root = tmp_path / "ckpt"
    shutil.copytree(saved, root)
    (root / "step-2" / "COMMITTED").write_text(json.dumps({"format": 3, "manifest": [1, 2]}))
    state, _ = state_of(tiny, seed=5)
    with pytest.raises(CheckpointError) as refused:
        Checkpointer(str(root)).load(state)
    assert not isinstance(refused.value, CorruptCheckpointError)
    assert str(refused.value) == (
        f"{root}/step-2 is in checkpoint format 3, written by a newer llmtrain; this one reads "
        "formats 1 to 2: upgrade llmtrain-checkpoint"
    )


# --- object storage ---------------------------------------------------------------------------

# per file: its first flip and its first truncation, and deleting it
S3_CASES = [
    next(c for c in CASES if c.name == name and c.kind.startswith(kind))
    for name in FILES
    for kind in ("flip", "truncate", "deleted")
    if not (name == "COMMITTED" and kind == "deleted")
]


def test_damage_on_object_storage_is_the_same_line(saved, moto_s3, tiny, tmp_path):
    """The same checks through s3fs: one bucket, each case's damaged object put in place of the
    original and restored after."""
    fs = fsspec.filesystem("s3")
    fs.put(f"{saved}/", moto_s3.removeprefix("s3://"), recursive=True)
    state, _ = state_of(tiny, seed=5)
    assert Checkpointer(moto_s3).load(state) == STEP
    for case in S3_CASES:
        key = f"{moto_s3.removeprefix('s3://')}/step-{STEP}/{case.name}"
        original = (saved / f"step-{STEP}" / case.name).read_bytes()
        local = tmp_path / "damaged"
        local.write_bytes(original)
        case.apply(local, original)
        if local.exists():
            fs.pipe_file(key, local.read_bytes())
        else:
            fs.rm(key)
        try:
            with pytest.raises(UserError) as resumed:
                Checkpointer(moto_s3).load(state)
            expect_damage(resumed.value, moto_s3, case, len(original))
            assert fs.exists(key) == local.exists(), case.id  # left as it was
        finally:
            fs.pipe_file(key, original)
    assert Checkpointer(moto_s3).load(state) == STEP


# --- a checkpoint of an earlier version (no manifest) -----------------------------------------

LEGACY = {
    "COMMITTED": [
        (b"", "is empty"),
        (b"{not json", NOT_COMMIT),
        (b"[]", NOT_COMMIT),
        (b"{}", "records no step"),
        (b'{"step": 3, "world_size": 1}', "records step 3, not 2: it belongs to another step"),
        (b'{"step": 2, "world_size": 2}', None),  # llmtrain.json says 1: named there
    ],
    "llmtrain.json": [
        (b"", "is empty"),
        (b"\x80abc", r"is not a step record \(not JSON: UnicodeDecodeError: .+\)"),
        (b"[1]", r"is not a step record \(a JSON list, not an object\)"),
        (b'{"step": 2, "info": []}', "holds an `info` that is not a JSON object"),
        (b'{"step": 2, "world_size": 1, "time": 1.5}', r"records time 1.5, its COMMITTED .+"),
        (None, "is missing"),
    ],
    ".metadata": [
        (b"", "is empty"),
        (b"garbage", r"is not checkpoint metadata \(unpickling: \w+: .+\)"),
        (pickle.dumps({"state": 1}), r"is not checkpoint metadata \(a dict, not Metadata\)"),
        (None, "is missing"),
        ("truncate", r"is not checkpoint metadata \(unpickling: \w+: .+\)"),
    ],
    "__0_0.distcp": [
        (None, r"is missing \(it holds '[\w.]+'\)"),
        ("truncate", r"is truncated: '[\w.]+' needs bytes up to \d+, the file has \d+"),
        # its first item's zip header (format 1 has no checksum a load checks: see the README)
        ("flip-0", r"cannot be read: \w+Error: .+"),
    ],
    "rng/rank0.json": [
        (None, re.escape("is missing (the step was saved by 1 rank, each with its file)")),
        (b"{}", re.escape('holds no random state (a JSON object with a "torch" state)')),
        (b'{"torch": "AAAA"}', r"holds no valid torch random state \(RuntimeError: .+\)"),
        (b"[", r"is not a random state \(not JSON: JSONDecodeError: .+\)"),
    ],
}
LEGACY_CASES = [(name, n) for name, damages in LEGACY.items() for n in range(len(damages))]


@pytest.mark.parametrize(("name", "n"), LEGACY_CASES, ids=[f"{n}-{i}" for n, i in LEGACY_CASES])
def test_damage_to_a_checkpoint_of_an_earlier_version_is_named_too(tmp_path, tiny, name, n):
    """`data/format1` predates the manifest: its files are checked for what they must be."""
    root = tmp_path / "format1"
    shutil.copytree(DATA / "format1", root)
    path = root / "step-2" / name
    damage, problem = LEGACY[name][n]
    if damage is None:
        path.unlink()
    elif damage == "truncate":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif damage == "flip-0":
        path.write_bytes(bytes([path.read_bytes()[0] ^ 0xFF]) + path.read_bytes()[1:])
    else:
        path.write_bytes(damage)
    if problem is None:  # the contradiction is found reading the other file
        name, problem = "llmtrain.json", "records world_size 1, its COMMITTED 2"
    before = snapshot(root)
    state, _ = state_of(tiny, seed=5)
    with pytest.raises(CorruptCheckpointError) as refused:
        Checkpointer(str(root)).load(state)
    assert refused.value.file == f"{root}/step-2/{name}", str(refused.value)
    assert re.fullmatch(problem, refused.value.problem), refused.value.problem
    assert str(refused.value).endswith(advice(str(root)))
    assert snapshot(root) == before


# --- what the commit records ----------------------------------------------------------------------


@pytest.mark.parametrize("how", ["sync", "async", "writer-unreported"])
def test_the_commit_lists_every_file_with_its_size_and_the_small_files_hashes(
    tmp_path, tiny, monkeypatch, how
):
    """COMMITTED names every file of the step: sizes for all, hashes for the files read whole,
    and a hash of itself. A writer that did not report what it wrote (DCP ran `finish` on a copy
    of it) gets the same manifest from the files as stored."""
    import xxhash

    from llmtrain.checkpoint.stream_storage import StreamWriter

    if how == "writer-unreported":
        finish = StreamWriter.finish

        def unreported(self, metadata, results):
            finish(self, metadata, results)
            self.written = None

        monkeypatch.setattr(StreamWriter, "finish", unreported)
    model, optimizer = tiny.make(seed=0, steps=1)
    checkpoints = Checkpointer(str(tmp_path), io_threads=2, async_save=how == "async")
    checkpoints.save(3, {"train": ModelState(model, [optimizer])}, info={"note": "x"})
    checkpoints.close()
    step_dir = tmp_path / "step-3"
    commit = json.loads((step_dir / "COMMITTED").read_text())
    files = commit.pop("files")
    claimed = commit.pop("xxh3")
    body = json.dumps({**commit, "files": files}, sort_keys=True, separators=(",", ":"))
    assert claimed == xxhash.xxh3_64_hexdigest(body.encode())
    assert commit.keys() == {"step", "world_size", "time", "format"}
    assert (commit["step"], commit["world_size"], commit["format"]) == (3, 1, 2)
    on_disk = {
        str(p.relative_to(step_dir)): p.read_bytes() for p in step_dir.rglob("*") if p.is_file()
    }
    assert sorted(files) == sorted(set(on_disk) - {"COMMITTED"})
    for name, entry in files.items():
        want = {"size": len(on_disk[name])}
        if not name.endswith(".bin"):
            want["xxh3"] = xxhash.xxh3_64_hexdigest(on_disk[name])
        assert entry == want, name
    assert Checkpointer(str(tmp_path)).damage(3, full=True) is None
