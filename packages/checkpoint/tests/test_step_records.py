"""A checkpoint path or a step record that cannot be right is one `error:` line, exit 2, before
anything is read or written (issue 52): `llmtrain checkpoints PATH --verify` of a path that does
not exist or is a file, and a step whose llmtrain.json records a step that is not its own (huge,
negative, not an integer), sealed or from before manifests, for the listing, `--verify`, `export`
and a resume."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from llmtrain.checkpoint.manager import STEP_DIR, Checkpointer, CorruptCheckpointError
from llmtrain.checkpoint.state import ModelState, Values

WHAT_IT_IS = (
    "; give a checkpoint directory (runs/<name>/checkpoints), which holds one step-<n> "
    "directory per saved step, each with llmtrain.json, .metadata and COMMITTED"
)


def one_error_line(code: int, err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1, err
    return lines[0]


@pytest.fixture(scope="module")
def saved(tmp_path_factory, tiny) -> Path:
    root = tmp_path_factory.mktemp("records") / "ckpt"
    model, optimizer = tiny.make(seed=0, steps=1)
    checkpoints = Checkpointer(str(root), python_rng=random.Random(0))
    for step in (1, 2):
        state = {"train": ModelState(model, [optimizer]), "counters": Values(step=step)}
        checkpoints.save(step, state, info={"model": {"kind": "tiny"}})
    checkpoints.close()
    return root


@pytest.mark.parametrize("verify", [True, False])
def test_checkpoints_of_a_path_that_does_not_exist(tmp_path, run_cli, verify):
    missing = tmp_path / "nowhere"
    code, out, err = run_cli("checkpoints", missing, *(["--verify"] if verify else []))
    if not verify:  # a run that has not saved yet: nothing to list
        assert (code, out) == (0, f"no checkpoints in {missing}\n")
        return
    assert one_error_line(code, err) == f"error: {missing} does not exist{WHAT_IT_IS}"
    assert not missing.exists()


def test_checkpoints_verify_of_a_plain_file(tmp_path, run_cli):
    file = tmp_path / "notes.txt"
    file.write_text("not a checkpoint")
    code, out, err = run_cli("checkpoints", file, "--verify")
    assert one_error_line(code, err) == (
        f"error: {file} is a file, not a checkpoint directory{WHAT_IT_IS}"
    )
    assert file.read_text() == "not a checkpoint" and out == ""


@pytest.mark.parametrize("sealed", [True, False], ids=["sealed", "before-manifests"])
@pytest.mark.parametrize("recorded", [10**15, -1, 2.5, "2", True, None])
def test_a_recorded_step_that_is_not_the_directorys_is_damage(
    saved, tmp_path, run_cli, tiny, recorded, sealed
):
    root = tmp_path / "ckpt"
    shutil.copytree(saved, root)
    step_dir = root / "step-2"
    if not sealed:  # a commit from before manifests: no sizes, no hashes to catch the edit
        commit = json.loads((step_dir / "COMMITTED").read_text())
        del commit["files"], commit["xxh3"]
        (step_dir / "COMMITTED").write_text(json.dumps(commit))
    info = json.loads((step_dir / "llmtrain.json").read_text())
    info["step"] = recorded
    (step_dir / "llmtrain.json").write_text(json.dumps(info))
    before = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}

    code, out, err = run_cli("checkpoints", root, "--verify")
    line = one_error_line(code, err)
    assert line == f"error: {root}: damaged: step-2 (see the list above)"
    assert f"step-2  committed, DAMAGED: {step_dir / 'llmtrain.json'}" in out

    code, _, err = run_cli("export", root, "-o", tmp_path / "out")
    line = one_error_line(code, err)
    assert line.startswith(f"error: {step_dir / 'llmtrain.json'} ")
    assert "checkpoint step-2 is damaged" in line
    if not sealed:  # read, so judged on what it says: the step, not the file's size
        expected = "which is no count" if recorded != 10**15 else "not 2: it belongs to another"
        assert expected in line or (recorded is None and "records no step" in line)
    assert not (tmp_path / "out").exists()

    model, optimizer = tiny.make(seed=1)
    with pytest.raises(CorruptCheckpointError, match=r"llmtrain\.json"):
        Checkpointer(str(root)).load({"train": ModelState(model, [optimizer])})
    assert {p: p.read_bytes() for p in root.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize("name", ["step-2", "step-0", "step-10"])
def test_step_directory_names_are_plain_numbers(name):
    assert STEP_DIR.match(name)


@pytest.mark.parametrize("name", ["step-02", "step-\u0662", "step--1", "step-1.5", "step-"])
def test_other_names_are_not_steps(name):
    assert not STEP_DIR.match(name)
