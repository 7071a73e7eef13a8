"""The run config's cross-field checks (steps or tokens, one way to give the batch) and the batch
arithmetic: each error names the key and the line, all at once."""

from __future__ import annotations

import pytest
import yaml

from llmtrain.core_mesh.cli import main
from llmtrain.core_mesh.config import ConfigValueError, structure
from llmtrain.train_loop.run_config import (
    DataConfig,
    DatasetRef,
    RunConfig,
    TrainingConfig,
    warmup_outlasts,
)

BASE = """\
name: checks
model: {kind: tiny}
data:
  train: [{path: train.zarr}]
  seq_len: 32
optimizer: {kind: adamw}
training: {steps: 10}
"""


@pytest.fixture
def validate(installed, tmp_path, capsys):
    """validate(yaml_text, *overrides) -> (exit code, stderr) of `llmtrain config validate`."""

    def run(text: str, *overrides: str) -> tuple[int, str]:
        path = tmp_path / "run.yaml"
        path.write_text(text)
        code = main(["config", "validate", str(path), *overrides], plugins=installed)
        err = capsys.readouterr().err
        assert "Traceback" not in err
        return code, err.replace(str(path), "run.yaml")

    return run


def test_base_config_is_valid(validate):
    assert validate(BASE) == (0, "")


@pytest.mark.parametrize(
    ("training", "line"),
    [("{steps: 10, tokens: 5000}", 7), ("{log_every: 5}", 7)],
    ids=["both", "neither"],
)
def test_exactly_one_of_steps_and_tokens(validate, training, line):
    code, err = validate(BASE.replace("{steps: 10}", training))
    assert code == 2
    assert (
        f"run.yaml:{line}: training.steps: give exactly one of training.steps and training.tokens"
        in err
    )


def test_tokens_alone_is_a_target(validate):
    assert validate(BASE.replace("{steps: 10}", "{tokens: 5000}")) == (0, "")


@pytest.mark.parametrize(
    ("given", "named"),
    [
        ({"grad_accum": 2, "global_batch": 16}, "global_batch"),
        ({"grad_accum": 2, "global_batch_tokens": 512}, "global_batch_tokens"),
        ({"global_batch": 16, "global_batch_tokens": 512}, "global_batch_tokens"),
    ],
    ids=["accum+batch", "accum+tokens", "batch+tokens"],
)
def test_only_one_way_to_give_the_batch(validate, given, named):
    lines = "".join(f"  {key}: {value}\n" for key, value in given.items())
    code, err = validate(BASE.replace("  seq_len: 32\n", "  seq_len: 32\n" + lines))
    assert code == 2
    # the error sits on the line of the second key given
    assert f"run.yaml:7: data.{named}: give only one of {', '.join(given)}" in err


def test_global_batch_tokens_must_be_whole_sequences(validate):
    code, err = validate(BASE, "data.global_batch_tokens=100")
    assert code == 2
    assert (
        "data.global_batch_tokens: 100 tokens is not a whole number of sequences of seq_len=32"
        in err
    )
    assert validate(BASE, "data.global_batch_tokens=128") == (0, "")


def test_problems_in_several_sections_are_listed_together(validate):
    code, err = validate(
        BASE.replace("seq_len: 32", "seq_len: 32\n  micro_batch: 0").replace(
            "{steps: 10}", "{steps: 10, log_every: 0}"
        ),
        "checkpoint.resume=sometimes",
        "device=tpu",
    )
    assert code == 2
    assert "4 config problems" in err
    assert "run.yaml:6: data.micro_batch: must be at least 1, got 0" in err
    assert "run.yaml:8: training.log_every: must be at least 1, got 0" in err
    assert "checkpoint.resume: expected one of 'auto', 'never', got 'sometimes'" in err
    assert "device: expected one of 'auto', 'cpu', 'cuda', got 'tpu'" in err


def test_a_nested_problem_does_not_hide_the_others(validate):
    """All problems at once: a bad value deep in `training` must not hide the run name's."""
    code, err = validate(
        BASE.replace("name: checks", "name: a/b").replace(
            "{steps: 10}", "{steps: 10, log_every: 0, non_finite: {action: retry}}"
        )
    )
    assert code == 2
    assert "run.yaml:7: training.non_finite.action: expected one of 'stop', 'skip'" in err
    assert "run.yaml:7: training.log_every: must be at least 1, got 0" in err
    assert "run.yaml:1: name: must be one directory name (no '/', '\\', '.' or '..')" in err
    assert "3 config problems" in err


def test_zero_seq_len_is_reported_as_such(validate):
    """The cross-check of global_batch_tokens against seq_len must not divide by a bad seq_len."""
    code, err = validate(BASE, "data.seq_len=0", "data.global_batch_tokens=100")
    assert code == 2
    assert "data.seq_len: must be at least 1, got 0" in err
    assert "modulo" not in err


def test_train_needs_a_dataset_and_weights_are_not_negative(validate):
    code, err = validate(BASE.replace("[{path: train.zarr}]", "[]"))
    assert (code, "run.yaml:4: data.train: needs at least one dataset" in err) == (2, True)
    code, err = validate(BASE.replace("{path: train.zarr}", "{path: train.zarr, weight: -1}"))
    assert (code, "data.train[0].weight: must be at least 0, got -1" in err) == (2, True)


# --- the batch arithmetic ---


def data(**given) -> DataConfig:
    return DataConfig(train=[DatasetRef(path="train.zarr")], **{"seq_len": 128, **given})


@pytest.mark.parametrize(
    ("given", "dp", "expected"),
    [
        ({}, 1, (8, 1)),  # micro_batch 8 x 1 x dp
        ({}, 4, (32, 1)),
        ({"micro_batch": 2, "grad_accum": 3}, 2, (12, 3)),
        ({"micro_batch": 4, "global_batch": 64}, 2, (64, 8)),
        ({"micro_batch": 4, "global_batch": 64}, 16, (64, 1)),
        ({"micro_batch": 4, "global_batch_tokens": 4096}, 2, (32, 4)),  # 4096 / 128 = 32
        ({"micro_batch": 1, "global_batch_tokens": 128 * 6}, 3, (6, 2)),
    ],
)
def test_batch_sizes(given, dp, expected):
    assert data(**given).batch_sizes(dp) == expected


@pytest.mark.parametrize(
    ("given", "dp", "multiple"),
    [
        ({"micro_batch": 4, "global_batch": 10}, 1, 4),
        ({"micro_batch": 4, "global_batch": 16}, 3, 12),
        ({"micro_batch": 8, "global_batch": 8}, 2, 16),
    ],
)
def test_global_batch_that_does_not_divide(given, dp, multiple):
    with pytest.raises(ConfigValueError) as info:
        data(**given).batch_sizes(dp)
    assert info.value.field == "global_batch"
    message = str(info.value)
    assert f"{given['global_batch']} sequences per step do not divide into {dp} data-parallel" in (
        message
    )
    assert f"micro_batch {given['micro_batch']}; use a multiple of {multiple}" in message


def test_global_batch_tokens_that_does_not_divide_names_that_key():
    """The user gave global_batch_tokens, so the error must point there, not at global_batch."""
    config = data(micro_batch=8, global_batch_tokens=128 * 12)  # 12 sequences, 8 per step
    with pytest.raises(ConfigValueError) as info:
        config.batch_sizes(1)
    assert info.value.field == "global_batch_tokens"
    assert "12 sequences per step" in str(info.value)


def test_training_config_defaults():
    training = TrainingConfig(steps=5)
    assert (training.log_every, training.checkpoint_every, training.max_grad_norm) == (
        10,
        None,
        1.0,
    )
    assert (training.non_finite.action, training.non_finite.max_skips) == ("stop", 10)
    with pytest.raises(ConfigValueError) as info:
        TrainingConfig()
    assert info.value.field == "steps"


# --- init: a warm start (the YAML key `from` is a Python keyword) ---

INIT = (
    BASE
    + """\
init:
  from: runs/pretrain/checkpoints
  step: 200
  storage_options: {anon: "true"}
"""
)


def test_init_section_reads_the_from_key(installed, tmp_path):
    from llmtrain.core_mesh.config import dump_config, load_config, make_converter
    from llmtrain.train_loop.run_config import InitConfig, RunConfig

    path = tmp_path / "run.yaml"
    path.write_text(INIT)
    cfg = load_config(path, RunConfig, plugins=installed)
    assert cfg.init == InitConfig(
        from_="runs/pretrain/checkpoints", step=200, storage_options={"anon": "true"}
    )
    assert (cfg.init.format, cfg.init.check_tokenizer) == ("auto", True)
    text = dump_config(cfg, converter=make_converter(installed))
    assert "  from: runs/pretrain/checkpoints\n" in text and "from_" not in text
    path.write_text(text)
    assert load_config(path, RunConfig, plugins=installed).init == cfg.init
    path.write_text(BASE)
    assert load_config(path, RunConfig, plugins=installed).init is None
    # an override creates the section
    cfg = load_config(path, RunConfig, plugins=installed, overrides=["init.from=hf/llama"])
    assert cfg.init == InitConfig(from_="hf/llama")


def test_init_problems_name_the_key_and_line(validate):
    code, err = validate(
        INIT.replace("  step: 200", "  step: -1\n  fromm: x\n  chek_tokenizer: no")
    )
    assert code == 2
    assert "3 config problems" in err
    assert "run.yaml:10: init.step: must be at least 0, got -1" in err
    assert "run.yaml:11: init.fromm: unknown key (did you mean 'from'?); allowed: from," in err
    assert "run.yaml:12: init.chek_tokenizer: unknown key (did you mean 'check_tokenizer'?)" in err

    code, err = validate(INIT.replace("  from: runs/pretrain/checkpoints\n", ""))
    assert (code, "run.yaml:8: init.from: required key is missing" in err) == (2, True)
    code, err = validate(BASE, "init.from=")
    assert code == 2
    assert "override 'init.from=': init.from: must be a path or URL, got an empty string" in err
    code, err = validate(BASE, "init.from=3", "init.check_tokenizer=1")
    assert code == 2
    assert "override 'init.from=3': init.from: expected str, got int 3" in err
    assert "init.check_tokenizer: expected bool (true or false), got int 1" in err
    assert validate(BASE, "init.from=runs/a/checkpoints", "init.format=hf") == (0, "")


@pytest.mark.parametrize(
    ("override", "key"),
    [("optimizer.lr=.nan", "optimizer.lr"), ("optimizer.lr=.inf", "optimizer.lr")],
)
def test_a_non_finite_number_is_a_config_error(validate, override, key):
    """Before: lr .nan passed validation and failed inside torch; lr .inf ran a step."""
    code, err = validate(BASE, override)
    assert code == 2
    assert (
        f"override '{override}': {key}: expected a finite number, got {override.split('.')[-1]}"
        in err
    )


@pytest.mark.parametrize("name", ["..", ".", "a/b", "a\\b"])
def test_a_run_name_is_one_directory_name(validate, name):
    """Before: `name: ..` wrote the run into the parent of run_dir, `name: .` into run_dir."""
    code, err = validate(BASE.replace("name: checks", f"name: '{name}'"))
    assert code == 2
    assert "run.yaml:1: name: must be one directory name (no '/', '\\', '.' or '..')" in err


@pytest.mark.parametrize(
    ("file", "ok"),
    [
        ("../../../x.jsonl", False),
        ("logs/../../x.jsonl", False),
        ("..", False),
        ("logs/metrics.jsonl", True),
        ("/tmp/elsewhere/metrics.jsonl", True),  # absolute: on purpose
    ],
)
def test_a_jsonl_logger_writes_inside_the_run_unless_given_an_absolute_path(validate, file, ok):
    code, err = validate(BASE, f"loggers=[{{kind: jsonl, file: '{file}'}}]")
    if ok:
        assert (code, err) == (0, "")
    else:
        assert code == 2 and "loggers[0].file: " in err, err


def test_a_warmup_as_long_as_the_run_is_named_not_refused(validate, installed):
    """Documented, not an error: a smoke run of a long run's config keeps its warmup."""
    run = BASE + "lr_scheduler: {kind: cosine, warmup_steps: 10}\n"
    assert validate(run) == (0, "")
    config = structure(yaml.safe_load(run), RunConfig, plugins=installed)
    assert warmup_outlasts(config.lr_scheduler, 10) == (
        "lr_scheduler.warmup_steps 10 is not shorter than the run (10 steps): the lr never "
        "reaches its peak"
    )
    assert warmup_outlasts(config.lr_scheduler, 11) is None
    assert warmup_outlasts(None, 1) is None
