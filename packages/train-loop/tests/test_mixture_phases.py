"""Mixture schedules and named eval sets in real `llmtrain run`s of a tiny model, in this process.

Two datasets of different text (so a batch's source shows in its tokens) are mixed in phases;
each held-out set logs its own metrics and its last value lands in summary.json. A run resumed
from a checkpoint before a phase boundary trains the uninterrupted run's losses exactly; a
resume that would change the data of trained steps is refused in one line, or kept with
`training.on_extend: keep`."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from llmtrain.core_mesh.config import ConfigError, ConfigValueError, structure
from llmtrain.core_mesh.errors import UserError
from llmtrain.data_pack.store import PackedDataset
from llmtrain.train_loop.mixture_schedule import on_resume
from llmtrain.train_loop.run_config import DataConfig

PHASES = [{"weights": [0.9, 0.1], "until_step": 5}, {"weights": [0.1, 0.9]}]


@pytest.fixture(scope="module")
def two_datasets(tmp_path_factory) -> list[Path]:
    """Two packed datasets of different text: sentences, and digits."""
    from llmtrain.data_pack.pack import pack
    from llmtrain.train_loop.experiments.quickstart import write_corpus

    root = tmp_path_factory.mktemp("mix")
    write_corpus(root / "words.jsonl", 60, seed=0)
    with (root / "digits.jsonl").open("w") as f:
        for i in range(60):
            f.write(json.dumps({"text": " ".join(str(i * j % 97) for j in range(80))}) + "\n")
    paths = []
    for name in ("words", "digits"):
        pack([str(root / f"{name}.jsonl")], str(root / f"{name}.zarr"), {"kind": "bytes"})
        paths.append(root / f"{name}.zarr")
    return paths


def write_config(tmp_path: Path, paths: list[Path], **data: Any) -> Path:
    config = {
        "name": "r",
        "run_dir": str(tmp_path / "runs"),
        "device": "cpu",
        "model": {"kind": "tiny", "max_seq_len": 32, "d_model": 16, "n_layers": 1},
        "data": {
            "train": [{"path": str(p)} for p in paths],
            "seq_len": 32,
            "micro_batch": 4,
            "phases": PHASES,
            **data,
        },
        "optimizer": {"kind": "adamw", "lr": 1e-3},
        "loggers": [{"kind": "jsonl"}],
        "checkpoint": {"keep_last": 10},
        "training": {"steps": 10, "log_every": 1, "checkpoint_every": 3},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def logged(tmp_path: Path) -> dict[int, dict[str, float]]:
    """Each step's logged metrics (the last line of a step logged twice)."""
    lines = (tmp_path / "runs" / "r" / "metrics.jsonl").read_text().splitlines()
    return {m["step"]: m for m in map(json.loads, lines)}


def error_line(code: int, err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1, err
    return lines[0]


def test_a_resume_before_a_phase_boundary_trains_the_uninterrupted_runs_losses(
    run_cli, two_datasets, tmp_path
):
    path = write_config(tmp_path, two_datasets)
    code, _, err = run_cli("run", path)
    assert code == 0, err
    whole = {step: m["loss"] for step, m in logged(tmp_path).items()}
    assert sorted(whole) == list(range(1, 11))
    info = json.loads((tmp_path / "runs/r/checkpoints/step-10/llmtrain.json").read_text())
    assert info["info"]["data"]["mixture"] == [
        {"weights": [0.9, 0.1], "until_step": 5},
        {"weights": [0.1, 0.9], "until_step": None},
    ]
    for step in (6, 9, 10):
        shutil.rmtree(tmp_path / "runs" / "r" / "checkpoints" / f"step-{step}")
    code, _, err = run_cli("run", path)  # from step 3, across the boundary at 5
    assert code == 0, err
    assert "run.resumed" in err and "data.mixture_" not in err
    assert {step: m["loss"] for step, m in logged(tmp_path).items()} == whole


def test_the_phases_read_their_own_mixtures_and_which_names_them(run_cli, two_datasets, tmp_path):
    """Steps 1-5 read mostly words, steps 6-10 mostly digits (the digits text has no letters)."""
    path = write_config(tmp_path, two_datasets)
    code, _, err = run_cli("run", path)
    assert code == 0, err
    run_dir = tmp_path / "runs" / "r"
    sources = {}
    for step in range(1, 11):
        code, out, err = run_cli("which", run_dir, "--step", step, "--json", "--words", 0)
        assert code == 0, err
        sources[step] = [s["dataset"] for s in json.loads(out)["samples"]]
    early = sum(s.count(1) for step, s in sources.items() if step <= 5)
    late = sum(s.count(1) for step, s in sources.items() if step > 5)
    # 5 steps x 4 samples each side: exact counts within a block's shuffle of 0.1 / 0.9
    assert early <= 5 and late >= 15, sources


def test_named_eval_sets_log_their_own_metrics_and_the_summary_keeps_the_last(
    run_cli, two_datasets, tmp_path
):
    words, digits = two_datasets
    evals = [
        {"name": "words", "path": str(words), "every": 4, "batches": 1},
        {"name": "digits", "path": str(digits), "every": 5, "batches": 2, "at_end": False},
    ]
    path = write_config(tmp_path, two_datasets, eval=evals)
    code, _, err = run_cli("run", path)
    assert code == 0, err
    metrics = logged(tmp_path)
    assert {s for s, m in metrics.items() if "eval/words/loss" in m} == {4, 8, 10}
    assert {s for s, m in metrics.items() if "eval/digits/loss" in m} == {5, 10}
    last = metrics[10]
    for name in ("words", "digits"):
        loss = last[f"eval/{name}/loss"]
        assert last[f"eval/{name}/ppl"] == pytest.approx(2.718281828459045**loss)
    assert "eval_loss" not in last
    for name, path in (("words", words), ("digits", digits)):
        packed = PackedDataset(str(path))  # bytes tokenizer: a token a byte, and one eod a doc
        assert packed.n_bytes == packed.n_tokens - packed.n_documents
        bits = last[f"eval/{name}/loss"] / math.log(2)
        assert last[f"eval/{name}/bpb"] == pytest.approx(bits * packed.n_tokens / packed.n_bytes)
    summary = json.loads((tmp_path / "runs" / "r" / "summary.json").read_text())
    assert summary["eval"]["eval/words/loss"] == last["eval/words/loss"]
    assert summary["eval"]["eval/digits/loss"] == last["eval/digits/loss"]
    assert summary["better"]["eval/words/loss"] == "lower"


def test_a_resume_that_changes_trained_steps_data_is_refused_or_kept(
    run_cli, two_datasets, tmp_path
):
    path = write_config(tmp_path, two_datasets)
    code, _, err = run_cli("run", path)
    assert code == 0, err
    # a later phase end: steps 6..7 were trained on the second phase's weights
    moved = [{**PHASES[0], "until_step": 7}, PHASES[1]]
    code, _, err = run_cli("run", path, f"data.phases={json.dumps(moved)}", "training.steps=12")
    line = error_line(code, err)
    assert "checkpoint step 10 was trained on the mixture schedule [0.9, 0.1] to step 5" in line
    assert "training.on_extend=keep" in line
    code, _, err = run_cli(
        "run",
        path,
        f"data.phases={json.dumps(moved)}",
        "training.steps=12",
        "training.on_extend=keep",
    )
    assert code == 0, err
    assert "data.mixture_kept" in err
    # a new phase from the step the run goes on at changes no trained step
    later = [PHASES[0], {"weights": [0.1, 0.9], "until_step": 12}, {"weights": [0.5, 0.5]}]
    code, _, err = run_cli("run", path, f"data.phases={json.dumps(later)}", "training.steps=14")
    assert code == 0, err
    assert "data.mixture_changed" in err and "from step 13" in err


def test_on_resume_compares_only_the_trained_steps():
    trained = [{"weights": [1, 1], "until_step": 5}, {"weights": [1, 3], "until_step": None}]
    same_past = [{"weights": [1, 1], "until_step": 5}, {"weights": [1, 3], "until_step": 9}]
    same_past.append({"weights": [3, 1], "until_step": None})
    assert on_resume(trained, same_past, 9, "refuse").schedule == same_past
    assert on_resume(trained, same_past, 4, "refuse").schedule == same_past
    # resumed at step 4, before the end that moved: steps 1-4 read the same data
    moved = [{"weights": [1, 1], "until_step": 6}, {"weights": [1, 3], "until_step": None}]
    assert on_resume(trained, moved, 4, "refuse").schedule == moved
    assert on_resume(trained, moved, 5, "refuse").schedule == moved  # step 6 is new
    assert on_resume(trained, moved, 6, "keep").schedule == trained
    with pytest.raises(UserError, match="changes the data of steps already trained"):
        on_resume(trained, moved, 6, "recompute")


BAD_DATA = [
    (
        {"phases": [{"weights": [1, 1], "until_step": 3}, {"weights": [1, 1, 1]}]},
        "phases[1].weights: lists 3 weights for 2",
    ),
    (
        {"phases": [{"weights": [1, 1]}, {"weights": [1, 2]}]},
        "phases[0]: give where the phase ends",
    ),
    (
        {
            "phases": [
                {"weights": [1, 1], "until_step": 3, "until_fraction": 0.5},
                {"weights": [1, 2]},
            ]
        },
        "one of them, not both",
    ),
    (
        {"phases": [{"weights": [1, 1], "until_step": 3}, {"weights": [1, 2], "until_step": 5}]},
        "phases[1].until_step: the last phase",
    ),
    (
        {"phases": [{"weights": [0, 0], "until_step": 3}, {"weights": [1, 2]}]},
        "at least one weight must be positive",
    ),
    (
        {"phases": [{"weights": [-1, 1], "until_step": 3}, {"weights": [1, 2]}]},
        "phases[0].weights[0]: must be at least 0",
    ),
    (
        {"phases": [{"weights": [1, 1], "until_fraction": 1.5}, {"weights": [1, 2]}]},
        "until_fraction: must be between 0 and 1",
    ),
    (
        {"phases": [{"weights": [1e-9, 1], "until_step": 3}, {"weights": [1, 2]}]},
        "phases[0].weights[0]: 1e-09 is below",
    ),
    ({"train_weight": 0.5}, "train[0].weight: with data.phases the weights are given per phase"),
    ({"one_dataset": True}, "phases: a mixture schedule needs at least two"),
    (
        {"eval": [{"name": "a", "path": "x"}, {"path": "y"}]},
        "eval[1].name: each eval set of a list needs a name",
    ),
    (
        {"eval": [{"name": "a", "path": "x"}, {"name": "a", "path": "y"}]},
        "eval[1].name: 'a' names two",
    ),
    ({"eval": [{"name": "a/b", "path": "x"}]}, "eval[0].name: must be letters"),
    ({"eval": []}, "eval: an empty list"),
    ({"eval": "x.zarr"}, "eval: expected a mapping or a list of mappings"),
]


@pytest.mark.parametrize(("change", "message"), BAD_DATA)
def test_bad_phases_and_eval_sets_name_the_key(change: dict[str, Any], message: str):
    raw: dict[str, Any] = {
        "train": [{"path": "a.zarr"}, {"path": "b.zarr"}],
        "seq_len": 8,
        "phases": [{"weights": [1, 1], "until_step": 3}, {"weights": [1, 2]}],
    }
    if change.pop("train_weight", None):
        raw["train"][0]["weight"] = 0.5
    if change.pop("one_dataset", None):
        raw["train"] = raw["train"][:1]
        raw["phases"] = [{"weights": [1], "until_step": 3}, {"weights": [1]}]
    raw.update(change)
    with pytest.raises(ConfigError) as caught:
        structure(raw, DataConfig)
    assert message in str(caught.value), str(caught.value)


def test_phase_ends_resolve_against_the_run_and_must_fit_it():
    data = structure(
        {
            "train": [{"path": "a.zarr"}, {"path": "b.zarr"}],
            "seq_len": 8,
            "phases": [
                {"weights": [1, 1], "until_fraction": 0.25},
                {"weights": [1, 2], "until_step": 90},
                {"weights": [0, 1]},
            ],
        },
        DataConfig,
    )
    assert data.phase_ends(100) == [25, 90, None]
    with pytest.raises(
        ConfigValueError, match=r"ends at step 90, outside steps 21\.\.79"
    ) as caught:
        data.phase_ends(80)
    assert caught.value.field == "phases[1].until_step"
    with pytest.raises(ConfigValueError, match="ends at step 0") as caught:
        data.phase_ends(1)
    assert caught.value.field == "phases[0].until_fraction"


def test_bad_phases_are_one_line_exit_2_from_the_commands(run_cli, two_datasets, tmp_path):
    """A bad phase in the file names its file:line and key; an end outside the run (known only
    once the run's length is) is refused before the run starts."""
    path = write_config(tmp_path, two_datasets)
    bad = [{"weights": [1, 1, 1], "until_step": 3}, {"weights": [1, 2]}]
    code, _, err = run_cli("config", "validate", path, f"data.phases={json.dumps(bad)}")
    line = error_line(code, err)
    assert "data.phases[0].weights: lists 3 weights for 2 data.train datasets" in line
    late = [{"weights": [1, 1], "until_step": 10}, {"weights": [1, 2]}]
    code, _, err = run_cli("run", path, f"data.phases={json.dumps(late)}")
    line = error_line(code, err)
    assert "data.phases[0].until_step: ends at step 10, outside steps 1..9" in line
    assert not (tmp_path / "runs" / "r" / "checkpoints").exists()
