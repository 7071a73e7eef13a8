"""Bad input to `llmtrain run`: each is refused before any training with one `error:` line that
says what is wrong and what to do (exit 2, no traceback), and a refused resume leaves the run's
files as they were. The runs are in-process (`run_cli`); the run with checkpoints that the resume
cases start from is a real `python -m llmtrain run`."""

from __future__ import annotations

import shutil

import pytest
import train_support as ts
from shared_fixtures import run_cli  # noqa: F401

# another tokenizer with the same 258 ids: only the fingerprint tells them apart
OTHER_BYTES = {"kind": "bytes", "special_tokens": ["<|endoftext|>", "<|other|>"]}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A 10-step run with checkpoints at steps 5 and 10, and data from another tokenizer."""
    tmp = tmp_path_factory.mktemp("errors")
    data = ts.pack_corpus(tmp / "data")
    other = ts.pack_corpus(tmp / "other", OTHER_BYTES)
    config = ts.run_config(data, tmp / "runs", name="base")
    config["training"]["steps"] = 10
    path = ts.write_config(tmp / "run.yaml", config)
    ts.run(ts.llmtrain("run", path), timeout=600)
    return {"tmp": tmp, "data": data, "other": other, "path": path}


@pytest.fixture(autouse=True)
def no_process_group_left():
    """A refusal raised after the trainer started its (one-process) group must not leak it
    into the next test."""
    yield
    from llmtrain.core_mesh.world import shutdown_distributed

    shutdown_distributed()


def refused(run_cli, *argv) -> str:  # noqa: F811
    code, out, err = run_cli(*argv)
    assert code == 2, f"exit {code}\n{out}\n{err}"
    assert "Traceback" not in err and "this is a bug" not in err, err
    errors = ts.error_lines(err)
    assert len(errors) == 1, err
    return errors[0]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["model.vocab_size=200"],
            "was packed with a tokenizer of 258 ids, but model.vocab_size is 200; set "
            "model.vocab_size: 258 (or more)",
        ),
        (
            ["data.seq_len=128"],
            "data.seq_len: 128 is longer than the model's max_seq_len (64); raise "
            "model.max_seq_len or shorten data.seq_len",
        ),
        (
            ["mesh.tp=2"],
            "mesh pp=1 x dp_replicate=1 x dp_shard=-1 x cp=1 x tp=2 needs a multiple of 2 "
            "processes (dp_replicate x cp x tp x pp), but the world has 1",
        ),
    ],
    ids=["vocab", "seq_len", "layout"],
)
def test_refused_before_training(base, run_cli, tmp_path, overrides, expected):  # noqa: F811
    error = refused(run_cli, "run", base["path"], f"run_dir={tmp_path}", *overrides)
    assert expected in error
    assert not (tmp_path / "base" / "metrics.jsonl").exists()


def test_missing_dataset(base, run_cli, tmp_path):  # noqa: F811
    absent = tmp_path / "absent.zarr"
    error = refused(
        run_cli, "run", base["path"], f"run_dir={tmp_path}", f"data.train=[{{path: {absent}}}]"
    )
    assert f"{absent}: not a packed dataset" in error
    assert "does not exist" in error


def test_global_batch_that_does_not_split_into_micro_batches(base, run_cli, tmp_path):  # noqa: F811
    """A config error, not a crash: exit 2 and the key to change."""
    error = refused(run_cli, "run", base["path"], f"run_dir={tmp_path}", "data.global_batch=10")
    assert "data.global_batch" in error
    assert "use a multiple of 4" in error


def test_eval_data_from_another_tokenizer(base, run_cli, tmp_path):  # noqa: F811
    """Like `llmtrain eval`, a run refuses eval data packed with another tokenizer than its
    training data: its eval loss would mean nothing."""
    error = refused(
        run_cli, "run", base["path"], f"run_dir={tmp_path}", f"data.eval.path={base['other'].valid}"
    )
    assert "tokenizer" in error and base["other"].valid in error


@pytest.fixture
def resumable(base, tmp_path):
    """(run_dir override, run dir) of a copy of the base run, so that no test changes the
    others' starting point."""
    runs = tmp_path / "runs"
    shutil.copytree(base["tmp"] / "runs" / "base", runs / "base")
    return f"run_dir={runs}", runs / "base"


def refused_resume(run_cli, resumable, *argv) -> str:  # noqa: F811
    """The error line of a refused resume, after checking the run's files are untouched."""
    run_dir_override, run_dir = resumable
    kept = {p: p.read_bytes() for p in run_dir.glob("*.*")}
    assert set(kept) == {run_dir / n for n in ("config.yaml", "metrics.jsonl", "summary.json")}
    error = refused(run_cli, "run", *argv[:1], run_dir_override, *argv[1:])
    for path, content in kept.items():
        assert path.read_bytes() == content, f"the refused run changed {path.name}"
    assert ts.committed_steps(run_dir / "checkpoints") == [5, 10]
    return error


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["data.global_batch=16"],
            "checkpoint step 10 was trained with a global batch of 8 sequences, this run uses "
            "16: the data order would differ; keep the batch size to resume",
        ),
        (
            ["data.seq_len=16"],
            "checkpoint step 10 was trained with data.seq_len 32, this run uses 16: the windows "
            "and their order would differ; keep the sequence length to resume",
        ),
        (
            ["--no-resume"],
            "checkpoints already has checkpoints (newest: step 10); resume (--resume or "
            "checkpoint.resume: auto), or choose another run name",
        ),
        (
            ["checkpoint.resume=never"],
            "checkpoints already has checkpoints (newest: step 10)",
        ),
        (
            ["model.d_model=64", "training.steps=20"],
            "checkpoints/step-10: tensor 'train.model.tok_emb.weight' has shape (320, 32) in the "
            "checkpoint but (320, 64) in this model; the checkpoint is from a different model "
            "shape",
        ),
    ],
    ids=["global-batch", "seq-len", "no-resume", "resume-never", "model-shape"],
)
def test_refused_resume(base, resumable, run_cli, overrides, expected):  # noqa: F811
    assert expected in refused_resume(run_cli, resumable, base["path"], *overrides)


def test_resume_on_data_from_another_tokenizer(base, resumable, run_cli):  # noqa: F811
    error = refused_resume(
        run_cli,
        resumable,
        base["path"],
        f"data.train=[{{path: {base['other'].train}}}]",
        "data.eval=null",
    )
    assert "checkpoint step 10 was trained on data packed with another tokenizer" in error


def test_resume_with_other_micro_batches_continues(base, resumable, run_cli):  # noqa: F811
    """Not an error: the global batch decides the data order, micro-batches only split it."""
    run_dir_override, run_dir = resumable
    extend = ("training.steps=12", "training.on_extend=recompute")  # the lr is not tested
    code, _, err = run_cli("run", base["path"], run_dir_override, "data.micro_batch=2", *extend)
    assert code == 0, err
    assert [m["step"] for m in ts.read_metrics(run_dir)][-3:] == [10, 11, 12]
