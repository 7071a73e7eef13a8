"""`llmtrain average`: the mean of committed steps' model weights, exact (float64 sums, one
rounding to float32), written as a committed step that the weight readers load; every refusal is
one `error:` line and exit 2, with nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from llmtrain.checkpoint.average import average
from llmtrain.checkpoint.export import load_model_weights, model_prefix
from llmtrain.checkpoint.integrity import COMMIT_FILE
from llmtrain.checkpoint.manager import Checkpointer, CheckpointError, KeepPolicy
from llmtrain.checkpoint.state import ModelState, Values

MODEL = {"kind": "tiny-lm", "dim": 16, "hidden": 32}
KEEP = KeepPolicy(last=100)  # every step saved stays
DATA = {"fingerprint": "data-a", "seq_len": 6, "tokenizer": {"spec": {"kind": "bytes"}}}


def info(step: int, model: dict | None = None, data: dict | None = None) -> dict:
    """What the trainer stores with a step (the parts the averaging reads)."""
    return {
        "model": model or MODEL,
        "data": data or DATA,
        "callbacks": {"summary": {"step": step}},
        "note": f"step {step}",
    }


def save_run(root: Path, tiny, steps=(1, 2, 3, 4), **kw) -> dict[int, dict[str, torch.Tensor]]:
    """A run of the tiny model (with its optimizer and counters) trained one step between saves;
    returns each step's model weights as they were saved."""
    model, optimizer = tiny.make(seed=0, steps=1, hidden=kw.pop("hidden", 32))
    checkpoints = Checkpointer(str(root), keep=KEEP)
    saved = {}
    for step in steps:
        tiny.train_step(model, optimizer, seed=step)
        saved[step] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        state = {"train": ModelState(model, [optimizer]), "counters": Values(step=step)}
        checkpoints.save(step, state, info=info(step, **kw))
    checkpoints.close()
    return saved


def save_weights(root: Path, step: int, weights: dict[str, torch.Tensor], **kw) -> None:
    """One committed step holding exactly `weights` as the model's."""
    checkpoints = Checkpointer(str(root), keep=KEEP)
    checkpoints.save(step, {"train": {"model": weights}}, info=info(step, **kw))
    checkpoints.close()


def mean(saved: dict[int, dict[str, torch.Tensor]], steps, name: str) -> torch.Tensor:
    return torch.stack([saved[s][name] for s in steps]).double().mean(0).float()


@pytest.fixture
def run(tmp_path, tiny) -> tuple[Path, dict[int, dict[str, torch.Tensor]]]:
    root = tmp_path / "checkpoints"
    return root, save_run(root, tiny)


def one_error(code: int, out: str, err: str) -> str:
    """The refusal's single line (exit 2, nothing else on stderr, nothing on stdout)."""
    assert code == 2, (code, out, err)
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert out == ""
    return lines[0].removeprefix("error: ")


# -- what it writes ------------------------------------------------------------------------------


def test_the_newest_k_steps_average_exactly_into_a_committed_step(run, tmp_path, run_cli):
    root, saved = run
    out = tmp_path / "averaged"
    code, stdout, err = run_cli("average", root, "--last", 3, "-o", out)
    assert code == 0, err
    weights, record, step = load_model_weights(str(out))
    assert step == 4
    assert list(weights) == list(saved[4])
    for name, value in weights.items():
        assert value.dtype == torch.float32, name
        assert torch.equal(value, mean(saved, (2, 3, 4), name)), name
    # a committed step laid out as the trainer's: the model's tensors under train.model.
    checkpoints = Checkpointer(str(out))
    assert checkpoints.committed_steps() == [4] and (out / "step-4" / COMMIT_FILE).is_file()
    assert checkpoints.damage(4, full=True) is None  # the manifest covers every byte
    _, metadata = checkpoints.open_step(4)
    assert model_prefix(list(metadata.state_dict_metadata)) == "train.model."
    assert all(k.startswith("train.model.") for k in metadata.state_dict_metadata)
    # the newest step's info (model options, data) with what was averaged; no callback state
    assert record["step"] == 4
    stored = record["info"]
    assert stored["model"] == MODEL and stored["data"] == DATA and stored["note"] == "step 4"
    assert stored["averaged"] == {"source": str(root), "steps": [2, 3, 4]}
    assert "callbacks" not in stored
    assert stdout.splitlines() == [
        f"{out}/step-4: the mean of steps 2, 3, 4 of {root}: {len(saved[4])} tensors, "
        f"{sum(v.numel() for v in saved[4].values()):,} parameters (model weights only: for "
        "eval, eval-tasks, generate and export, not for resuming training)"
    ]


def test_the_average_loads_into_the_model_like_any_checkpoint(run, tmp_path, tiny):
    root, saved = run
    average(str(root), str(tmp_path / "avg"), last=2)
    model = tiny.TinyLM()
    Checkpointer(str(tmp_path / "avg")).load({"train": ModelState(model)}, restore_rng=False)
    for name, value in model.state_dict().items():
        assert torch.equal(value, mean(saved, (3, 4), name)), name


def test_a_resume_from_the_average_is_refused_in_one_line(run, tmp_path, tiny):
    """It holds no optimizer state or counters: a load asking for them (a resume) says what the
    checkpoint is and what to do instead."""
    root, _ = run
    out = tmp_path / "avg"
    average(str(root), str(out), last=3)
    model, optimizer = tiny.make(seed=1, steps=1)
    state = {"train": ModelState(model, [optimizer]), "counters": Values(step=0)}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError) as refused:
        Checkpointer(str(out)).load(state)
    assert str(refused.value) == (
        f"{out}/step-4 is the mean of steps 2, 3, 4 of {root} (`llmtrain average`): it holds "
        "model weights only, no optimizer state or counters, so a run cannot resume from it; "
        f"resume from {root}, or start a new run from these weights with init: {{from: {out}}}"
    )
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_steps_choose_which_checkpoints_and_json_says_what_was_done(run, tmp_path, run_cli):
    root, saved = run
    out = tmp_path / "avg"
    code, stdout, err = run_cli("average", root, "--steps", "3, 1", "-o", out, "--json")
    assert code == 0, err
    done = json.loads(stdout)
    assert done == {
        "source": str(root),
        "steps": [1, 3],
        "step": 3,
        "output": str(out),
        "checkpoint": f"{out}/step-3",
        "tensors": len(saved[3]),
        "parameters": sum(v.numel() for v in saved[3].values()),
    }
    weights, record, step = load_model_weights(str(out))
    assert step == 3 and record["info"]["averaged"]["steps"] == [1, 3]
    for name, value in weights.items():
        assert torch.equal(value, mean(saved, (1, 3), name)), name


def test_the_sum_is_in_float64_not_float32(tmp_path):
    """Values where float32 sums round differently: the result is the float64 mean, rounded
    once."""
    generator = torch.Generator().manual_seed(0)
    values = [torch.randn(4096, generator=generator) * 10 ** (i % 3) for i in range(3)]
    for step, value in enumerate(values, start=1):
        save_weights(tmp_path / "src", step, {"w": value})
    average(str(tmp_path / "src"), str(tmp_path / "avg"), steps=[1, 2, 3])
    got = load_model_weights(str(tmp_path / "avg"))[0]["w"]
    assert torch.equal(got, torch.stack(values).double().mean(0).float())
    assert not torch.equal(got, (values[0] + values[1] + values[2]) / 3)  # float32's sum


def test_tensors_that_are_not_floating_point_must_be_equal(tmp_path, run_cli):
    src = tmp_path / "src"
    ids = torch.arange(5)
    save_weights(src, 1, {"w": torch.ones(3), "ids": ids})
    save_weights(src, 2, {"w": torch.zeros(3), "ids": ids.clone()})
    average(str(src), str(tmp_path / "avg"), last=2)
    weights = load_model_weights(str(tmp_path / "avg"))[0]
    assert torch.equal(weights["ids"], ids) and weights["ids"].dtype == torch.int64
    assert torch.equal(weights["w"], torch.full((3,), 0.5))
    save_weights(src, 3, {"w": torch.zeros(3), "ids": ids + 1})
    line = one_error(*run_cli("average", src, "--last", 2, "-o", tmp_path / "avg2"))
    assert line == (
        f"{src}: tensor 'ids' (torch.int64, not floating point) differs between steps 2 and 3; "
        "only equal values of it can be averaged"
    )


def test_overwrite_replaces_what_the_output_held(run, tmp_path, run_cli):
    root, saved = run
    out = tmp_path / "avg"
    assert run_cli("average", root, "--steps", "1,2", "-o", out)[0] == 0
    line = one_error(*run_cli("average", root, "--last", 2, "-o", out))
    assert line == (
        f"-o {out} already holds a committed checkpoint (step 2); pass --overwrite to replace "
        "it, or choose another directory"
    )
    code, _, err = run_cli("average", root, "--last", 2, "-o", out, "--overwrite")
    assert code == 0, err
    assert Checkpointer(str(out)).committed_steps() == [4]
    assert sorted(p.name for p in out.iterdir()) == ["step-4"]
    weights = load_model_weights(str(out))[0]
    assert all(torch.equal(v, mean(saved, (3, 4), k)) for k, v in weights.items())


# -- refusals ------------------------------------------------------------------------------------


def listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--last", 1], "averaging needs at least 2 checkpoints; 1 chosen (step 4) of {root} "
         "(committed: 1, 2, 3, 4)"),
        (["--steps", 2], "averaging needs at least 2 checkpoints; 1 chosen (step 2) of {root} "
         "(committed: 1, 2, 3, 4)"),
        (["--last", 5], "--last 5: {root} has 4 committed steps (committed: 1, 2, 3, 4)"),
        (["--steps", "1,7"], "--steps: step 7 is not a committed step of {root} "
         "(committed: 1, 2, 3, 4)"),
        (["--steps", "1,1"], "llmtrain average: argument --steps: '1,1' names a step twice; name "
         "each step once; see llmtrain average --help"),
        (["--steps", "1,x"], "llmtrain average: argument --steps: 'x' is not a step number "
         "(N,N,...); see llmtrain average --help"),
        (["--last", 0], "llmtrain average: argument --last: '0' is not a whole number of at "
         "least 1; see llmtrain average --help"),
        ([], "llmtrain average: one of the arguments --last --steps is required; see llmtrain "
         "average --help"),
        (["--last", 2, "--steps", "1,2"], "llmtrain average: argument --steps: not allowed with "
         "argument --last; see llmtrain average --help"),
    ],
    ids=["last-1", "one-step", "last-too-many", "not-committed", "twice", "not-a-number",
         "last-0", "neither", "both"],
)  # fmt: skip
def test_a_bad_choice_of_steps_is_one_line(run, tmp_path, run_cli, argv, expected):
    root, _ = run
    before = listing(root)
    line = one_error(*run_cli("average", root, *argv, "-o", tmp_path / "avg"))
    assert line == expected.format(root=root)
    assert not (tmp_path / "avg").exists() and listing(root) == before


def test_an_unfinished_step_is_not_averaged(run, tmp_path, run_cli):
    root, _ = run
    (root / "step-3" / COMMIT_FILE).unlink()  # a save that never committed
    line = one_error(*run_cli("average", root, "--steps", "2,3", "-o", tmp_path / "avg"))
    assert line == f"--steps: step 3 is not a committed step of {root} (committed: 1, 2, 4)"
    line = one_error(*run_cli("average", tmp_path / "none", "--last", 2, "-o", tmp_path / "avg"))
    assert line == f"{tmp_path / 'none'} has no committed checkpoint"


def test_the_output_may_not_be_the_source(run, tmp_path, run_cli):
    root, _ = run
    before = listing(root)
    line = one_error(*run_cli("average", root, "--last", 2, "-o", root))
    assert line == (
        f"-o {root}: that is the source checkpoint directory {root}; write the average to a "
        "directory of its own"
    )
    line = one_error(*run_cli("average", root, "--last", 2, "-o", f"{root}/./", "--overwrite"))
    assert line.startswith(f"-o {root}/.: that is the source checkpoint directory {root};")
    inside = root / "step-4" / "avg"
    line = one_error(*run_cli("average", root, "--last", 2, "-o", inside))
    assert line == (
        f"-o {inside}: that lies inside the source checkpoint directory {root}; write the "
        "average to a directory of its own"
    )
    assert listing(root) == before


def test_checkpoints_of_other_shapes_models_or_data_are_refused(tmp_path, tiny, run_cli):
    def refused(src: Path, *argv) -> str:
        line = one_error(*run_cli("average", src, *argv, "-o", tmp_path / "avg"))
        assert not (tmp_path / "avg").exists()
        return line

    # the same stored model options, another shape: the tensor is named with both shapes
    src = tmp_path / "shape"
    save_run(src, tiny, steps=(1,))
    save_run(src, tiny, steps=(2,), hidden=24)
    assert refused(src, "--last", 2) == (
        f"{src}: tensor 'fc1.weight' has shape (24, 16) at step 2 but (32, 16) at step 1: the "
        "checkpoints are of different model shapes"
    )
    # a tensor one step has and the other has not
    src = tmp_path / "names"
    save_weights(src, 1, {"a": torch.ones(2), "b": torch.ones(2)})
    save_weights(src, 2, {"a": torch.ones(2)})
    save_weights(src, 3, {"a": torch.ones(2), "b": torch.ones(2), "c": torch.ones(2)})
    assert refused(src, "--steps", "1,2") == (
        f"{src}: step 2 has no tensor 'b', which step 1 has: the checkpoints are of different "
        "model shapes"
    )
    assert refused(src, "--steps", "1,3") == (
        f"{src}: step 3 has a tensor 'c', which step 1 has not: the checkpoints are of "
        "different model shapes"
    )
    # another model (the stored model options differ)
    src = tmp_path / "model"
    save_weights(src, 1, {"a": torch.ones(2)})
    save_weights(src, 2, {"a": torch.ones(2)}, model={**MODEL, "hidden": 64})
    assert refused(src, "--last", 2) == (
        f"{src}: steps 1 and 2 hold different models (model hidden: 32 vs 64); average "
        "checkpoints of one model"
    )
    # another run's data
    src = tmp_path / "data"
    save_weights(src, 1, {"a": torch.ones(2)})
    save_weights(src, 2, {"a": torch.ones(2)}, data={**DATA, "fingerprint": "data-b"})
    assert refused(src, "--last", 2) == (
        f"{src}: steps 1 and 2 were trained on different data (data fingerprint data-a vs "
        "data-b): they are not checkpoints of one run; average the steps of one run"
    )


def test_storage_that_cannot_be_written_is_one_line(run, tmp_path, run_cli):
    root, _ = run
    (tmp_path / "afile").write_text("not a folder")
    line = one_error(*run_cli("average", root, "--last", 2, "-o", tmp_path / "afile" / "avg"))
    assert line == (
        f"{tmp_path / 'afile' / 'avg'}: {tmp_path / 'afile'} is a file, not a folder: choose a "
        "path below a folder"
    )


def test_the_function_refuses_a_choice_of_neither_or_both(run, tmp_path):
    root, _ = run
    for kw in ({}, {"last": 2, "steps": [1, 2]}):
        with pytest.raises(CheckpointError, match="one of --last K or --steps"):
            average(str(root), str(tmp_path / "avg"), **kw)
    with pytest.raises(CheckpointError, match="name each step once"):
        average(str(root), str(tmp_path / "avg"), steps=[1, 1])


def test_checkpoints_on_object_storage_average_there(moto_s3, tiny, run_cli):
    """A source and an output on S3 (moto): the same mean, and the source refused as output."""
    model, optimizer = tiny.make(seed=0, steps=1)
    checkpoints = Checkpointer(moto_s3, keep=KEEP)
    saved = {}
    for step in (1, 2):
        tiny.train_step(model, optimizer, seed=step)
        saved[step] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        checkpoints.save(step, {"train": ModelState(model, [optimizer])}, info=info(step))
    checkpoints.close()
    out = f"{moto_s3}-avg"
    code, stdout, err = run_cli("average", moto_s3, "--last", 2, "-o", out, "--json")
    assert code == 0, err
    assert json.loads(stdout)["checkpoint"] == f"{out}/step-2"
    weights, record, _ = load_model_weights(out)
    assert record["info"]["averaged"] == {"source": moto_s3, "steps": [1, 2]}
    assert all(torch.equal(v, mean(saved, (1, 2), k)) for k, v in weights.items())
    line = one_error(*run_cli("average", moto_s3, "--last", 2, "-o", f"{moto_s3}/"))
    assert line.startswith(f"-o {moto_s3}: that is the source checkpoint directory")
