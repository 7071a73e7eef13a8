"""Every bad run input is one clear line and exit 2, through the real CLI, before anything runs.

A table generated from the run config's own classes feeds wrong values to every field of a small
valid run config: a value of the wrong type for each field (read from its annotation, the chosen
plugins' options classes included, so a new field is covered the day it is added), values out
of range for the fields that have a range, paths taken by a file or a directory of the wrong
kind, and damaged config files (binary, not UTF-8, truncated YAML, the wrong top-level type,
duplicate keys). Each goes through `llmtrain config validate`; a few go through `llmtrain run`,
which must refuse them before anything is written that looks like a run (no summary.json of a
finished run, no committed checkpoint). For every case: exit 2, one `error:` line naming the
config file and the key, no traceback, no "this is a bug".
"""

from __future__ import annotations

import copy
import random
import re
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import attrs
import pytest
import yaml

from llmtrain.core_mesh.config import Choice
from llmtrain.core_mesh.plugins import PluginManager
from llmtrain.train_loop.run_config import RunConfig

# a structlog console line the run prints before its error (`[info     ] run.start ...`)
LOG_LINE = re.compile(r"^\[\s*(debug|info|warning|error|critical)\s*\] ")
MISSING = object()


def base_config(run_dir: Path) -> dict[str, Any]:
    """A small valid run config with every section, so every field has a place in the file.
    Nothing in it is read by `config validate` (no dataset, no checkpoint)."""
    return {
        "name": "bad",
        "seed": 3,
        "run_dir": str(run_dir),
        "device": "cpu",
        "model": {"kind": "tiny", "max_seq_len": 64, "d_model": 32},
        "data": {
            "train": [{"path": "train.zarr", "weight": 1.0}],
            "eval": {"path": "valid.zarr", "every": 10, "batches": 2, "at_end": True},
            "seq_len": 32,
            "micro_batch": 4,
            "global_batch": 8,
            "seed": 5,
            "shuffle": True,
            "cache_mib": 64,
            "storage_options": {"anon": "true"},
        },
        "optimizer": {"kind": "adamw", "lr": 3e-3},
        "lr_scheduler": {"kind": "cosine", "warmup_steps": 3, "min_ratio": 0.1},
        "loggers": [{"kind": "console"}, {"kind": "jsonl", "file": "metrics.jsonl"}],
        "mesh": {"dp_shard": -1, "tp": 1},
        "parallel": {"kind": "default"},
        "training": {
            "steps": 30,
            "log_every": 1,
            "checkpoint_every": 5,
            "objective": {"kind": "cross_entropy", "z_loss": 0.0},
            "non_finite": {"action": "skip", "max_skips": 3},
        },
        "checkpoint": {"keep_last": 3, "io_threads": 2},
        "profile": {"every": 10, "active": 2, "warmup": 1, "ranks": [0]},
        "debug": {"watchdog": {"multiple": 5.0, "min_seconds": 1.0}},
        "init": {"from": "elsewhere/checkpoints", "step": 2},
        "callbacks": [{"kind": "loss_spike", "factor": 3.0}],
    }


# --- the generated table ---


def _wrong_types(annotation: Any) -> list[Any]:
    """Values that are not of `annotation` (YAML can write them all)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            wrong = _wrong_types(rest[0])
        elif len(rest) == 2 and list[rest[0]] == rest[1]:  # one item or a list of them
            wrong = ["x", 5, [1]]
        else:
            wrong = [[1, 2], {"a": [1]}]
        # null is right for an optional field
        return [v for v in wrong if v is not None] if type(None) in args else wrong
    wrong: list[Any] = [None]
    if annotation is int:
        wrong += ["three", 1.5, True, [1]]
    elif annotation is float:
        wrong += ["fast", True, float("nan"), {"a": 1}]
    elif annotation is bool:
        wrong += ["maybe", 1, "true"]
    elif annotation is str:
        wrong += [5, True, ["a"], {"a": "b"}]
    elif origin is Literal:
        wrong += ["nope", 1]
    elif origin is list:
        wrong += ["x", {"a": 1}, 5]
    elif origin is dict:
        wrong += ["x", [1], {"k": 1}]
    elif origin is tuple:
        wrong += ["x", [0.5], [0.5, "a"]]
    else:  # an attrs section or a plugin's section (a Choice)
        wrong += ["x", [1], 5]
    return wrong


def _options_class(plugins: PluginManager, annotation: Any, section: Any) -> Any:
    """The attrs class that structures `section`: the annotation's, or for a `kind:` choice the
    chosen entry's options class."""
    if isinstance(annotation, type) and issubclass(annotation, Choice):
        return plugins.registry(annotation.plugin_kind).get(section["kind"]).options
    return annotation if isinstance(annotation, type) and attrs.has(annotation) else None


def _fields(plugins: PluginManager, cls: type, section: dict, path: tuple) -> Iterator[tuple]:
    """(path, annotation) of every field of `cls` and, in the base config, of its sections."""
    hints = typing.get_type_hints(cls)
    for field in attrs.fields(cls):
        key = field.metadata.get("llmtrain.yaml_key") or field.name
        annotation = hints[field.name]
        yield (*path, key), annotation
        value = section.get(key, MISSING)
        if value is MISSING or value is None:
            continue
        member = annotation
        if typing.get_origin(annotation) in (typing.Union, types.UnionType):
            member = next(a for a in typing.get_args(annotation) if a is not type(None))
        if typing.get_origin(member) is list and isinstance(value, list):
            (item_type,) = typing.get_args(member)
            for i, item in enumerate(value):
                item_cls = _options_class(plugins, item_type, item)
                if item_cls is not None:
                    yield from _fields(plugins, item_cls, item, (*path, key, i))
            continue
        sub = _options_class(plugins, member, value)
        if sub is not None:
            yield from _fields(plugins, sub, value, (*path, key))


# values out of range (or refused for what they would do), by key; a list index is a number
OUT_OF_RANGE: dict[str, list[Any]] = {
    "seed": [-1, 2**64],
    "name": ["", "a/b", "..", ".", " x"],
    "run_dir": ["", "   "],
    "data.train": [[]],
    "data.train.0.path": ["", " "],
    "data.train.0.weight": [-1, 0],
    "data.eval.path": [""],
    "data.eval.every": [0, -5],
    "data.eval.batches": [0],
    "data.seq_len": [0, -32],
    "data.micro_batch": [0, -1],
    "data.global_batch": [0, -8],
    "data.seed": [-1, 2**70],
    "data.cache_mib": [0, -1],
    "optimizer.lr": [0, -1e-3],
    "optimizer.betas": [[1.0, 0.9], [0.9, -0.1], [0.9]],
    "optimizer.eps": [0, -1e-8],
    "optimizer.weight_decay": [-0.1],
    "lr_scheduler.warmup_steps": [-1],
    "lr_scheduler.min_ratio": [-0.1, 1.5],
    "training.steps": [0, -10],
    "training.log_every": [0],
    "training.checkpoint_every": [0, -5],
    "training.max_grad_norm": [-1.0],  # 0 is a zero update, on purpose
    "training.z_loss": [-1e-4],
    "training.objective.z_loss": [-1e-4],
    "training.peak_tflops": [0, -100.0],
    "training.init": ["lazy"],
    "training.non_finite.action": ["ignore"],
    "training.non_finite.max_skips": [-1],
    "checkpoint.dir": ["", "  "],
    "checkpoint.keep_last": [0, -3],
    "checkpoint.keep_every": [0],
    "checkpoint.io_threads": [0, -2],
    "checkpoint.resume": ["maybe"],
    "profile.every": [0],
    "profile.active": [0],
    "profile.warmup": [-1, 9],
    "profile.ranks": [[-1], [0, -2]],
    "debug.watchdog.multiple": [0, 1, -2.0],
    "debug.watchdog.min_seconds": [-1.0],
    "debug.watchdog.warmup_steps": [0],
    "debug.watchdog.startup_seconds": [0, -5.0],
    "init.from": ["", " "],
    "init.step": [-1],
    "init.format": [""],
    "mesh.dp_shard": [0, -2],
    "mesh.tp": [0, -1],
    "mesh.pp": [0],
    "model.n_layers": [0, -2],
    "model.d_model": [0],
    "model.n_heads": [0, 5],
    "model.max_seq_len": [0],
    "model.dropout": [1.0, -0.1],
    "model.pad_vocab_to": [0],
    "loggers.1.file": ["../x.jsonl", "logs/../../x.jsonl", "", "..", "config.yaml", "logs"],
    "loggers.1.kind": ["nope"],
    "callbacks.0.factor": [1.0, 0, -3.0],
}


def _dotted(path: tuple) -> str:
    return ".".join(map(str, path))


def _shown(path: tuple) -> str:
    """The key as errors name it: `data.train[0].weight`."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


def _set(config: dict, path: tuple, value: Any) -> None:
    node = config
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = copy.deepcopy(value)


def field_cases() -> list[tuple[str, tuple, Any]]:
    """(id, path, bad value): every field's wrong types, and the out-of-range table."""
    plugins = PluginManager().load_entry_points()
    base = base_config(Path("runs"))
    cases = []
    for path, annotation in _fields(plugins, RunConfig, base, ()):
        # null (where it is wrong) and two of the field's other wrong values, drawn by its key:
        # every kind of wrong value meets some fields, and the table stays fast
        wrong = _wrong_types(annotation)
        drawn = random.Random(_dotted(path)).sample(
            [v for v in wrong if v is not None], k=min(2, len(wrong))
        )
        for value in [v for v in wrong if v is None] + drawn:
            cases.append((f"{_dotted(path)}={value!r}", path, value))
    for key, values in OUT_OF_RANGE.items():
        path = tuple(int(p) if p.isdigit() else p for p in key.split("."))
        for value in values:
            cases.append((f"{key}={value!r}[range]", path, value))
    return cases


FIELD_CASES = field_cases()


def _error_line(code: int, err: str, *, listing: bool = False) -> str:
    """The one `error:` line of a refused command; nothing else on stderr but the run's log
    lines before it (and, with `listing`, the problems of a config error that has several, one
    indented line each: a file cut short misses several keys at once)."""
    assert code == 2, err
    assert "Traceback" not in err and "this is a bug" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1, err
    others = [line for line in lines if line not in errors]
    if listing and errors[0].endswith(" config problems:"):
        others = others[: lines.index(errors[0])]
        assert all(line.startswith("  ") for line in lines[lines.index(errors[0]) + 1 :]), err
    assert all(LOG_LINE.match(line) for line in others), err
    return errors[0]


def _failure(case_id: str, code: int, err: str) -> str:
    said = " | ".join(err.strip().splitlines()) or "nothing on stderr"
    return f"{case_id}: exit {code}: {said}"[:400]


def test_the_table_covers_every_section_and_hundreds_of_cases():
    keys = {_dotted(path) for _, path, _ in FIELD_CASES}
    for key in (
        "seed",
        "data.train.0.weight",
        "data.eval.every",
        "model.d_model",
        "optimizer.betas",
        "lr_scheduler.min_ratio",
        "loggers.1.file",
        "mesh.tp",
        "parallel.compile",
        "training.non_finite.max_skips",
        "checkpoint.io_threads",
        "profile.ranks",
        "debug.watchdog.multiple",
        "init.from",
        "callbacks.0.factor",
    ):
        assert key in keys, key
    assert len(FIELD_CASES) > 400


def test_the_base_config_is_valid(run_cli, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(base_config(tmp_path / "runs"), sort_keys=False))
    assert run_cli("config", "validate", config) == (0, f"{config}: ok\n", "")


@pytest.fixture(scope="module")
def validate_many(tmp_path_factory):
    """validate(config dict or text) -> (exit code, stderr) of `llmtrain config validate` run in
    this process, each case in a file of its own. The plugins are loaded once for all cases
    (`main(plugins=)`: what `llmtrain` does at every start, minus reading the entry points)."""
    from llmtrain.core_mesh.cli import main

    plugins = PluginManager().load_entry_points()
    root = tmp_path_factory.mktemp("cases")
    count = iter(range(10**6))

    def validate(content: dict | str | bytes, capsys) -> tuple[Path, int, str]:
        path = root / f"case{next(count)}.yaml"
        if isinstance(content, dict):
            content = yaml.safe_dump(content, sort_keys=False)
        if isinstance(content, str):
            content = content.encode()
        path.write_bytes(content)
        capsys.readouterr()
        code = main(["config", "validate", str(path)], plugins=plugins)
        _, err = capsys.readouterr()
        return path, code, err

    return SimpleValidate(root, validate)


@attrs.frozen
class SimpleValidate:
    root: Path
    run: Any


def test_a_bad_value_in_any_field_is_one_line_naming_the_file_line_and_key(validate_many, capsys):
    """Several hundred cases in one test (each a few milliseconds): one failure report lists
    every case that broke the rule."""
    failures = []
    for case_id, path, value in FIELD_CASES:
        config = base_config(validate_many.root / "runs")
        _set(config, path, value)
        where, code, err = validate_many.run(config, capsys)
        try:
            line = _error_line(code, err)
            assert f"{where}:" in line, line
            # the key, or the section above it when the section's type is wrong
            named = _shown(path)
            shown = [_shown(path[:n]) for n in range(len(path), 0, -1)]
            assert any(f": {key}" in line for key in shown), f"{named} not in {line}"
            # the line of the key in the file, not only the file
            assert re.search(rf"{re.escape(str(where))}:\d+: ", line), line
        except AssertionError:
            failures.append(_failure(case_id, code, err))
    assert not failures, f"{len(failures)} of {len(FIELD_CASES)} cases:\n" + "\n".join(failures)


def _truncations(text: str, n: int, seed: int) -> list[str]:
    """`text` cut at `n` places before its last closing brace (so no cut is the whole file)."""
    end = text.rindex("}")
    cuts = sorted(random.Random(seed).sample(range(1, end), n))
    return [text[:cut] for cut in cuts]


def damaged_files(run_dir: Path) -> list[tuple[str, bytes]]:
    """(id, content) of config files that are damaged or not a run config at all."""
    config = base_config(run_dir)
    training = config.pop("training")
    text = yaml.safe_dump(config, sort_keys=False)
    # the last line is a flow mapping: every cut before its `}` is invalid or loses it
    text += f"training: {{steps: {training['steps']}, log_every: 1}}\n"
    rng = random.Random(36)
    cases = [
        ("binary", bytes(rng.randrange(256) for _ in range(300))),
        ("binary-zip-header", b"PK\x03\x04" + bytes(rng.randrange(256) for _ in range(200))),
        ("nul-byte", text.replace("seed: 3", "seed: 3\0").encode()),
        ("utf-16", text.encode("utf-16")),
        ("latin-1", ("name: caf\xe9\n" + text.split("\n", 1)[1]).encode("latin-1")),
        ("empty", b""),
        ("top-level-list", b"- name: bad\n- seed: 3\n"),
        ("top-level-int", b"42\n"),
        ("top-level-string", b"just some words\n"),
        ("duplicate-top-key", (text + "seed: 4\n").encode()),
        (
            "duplicate-nested-key",
            text.replace("  seq_len: 32\n", "  seq_len: 32\n  seq_len: 16\n").encode(),
        ),
        ("tab-indent", text.replace("  seq_len", "\tseq_len").encode()),
        ("unclosed-quote", text.replace("name: bad", 'name: "bad').encode()),
        ("python-tag", b"!!python/object/apply:os.system ['true']\n"),
        ("recursive-alias", b"a: &x [*x]\n"),
    ]
    for i, cut in enumerate(_truncations(text, 40, seed=36)):
        cases.append((f"truncated-{i}-at-{len(cut)}", cut.encode()))
    return cases


def test_a_damaged_config_file_is_one_error_naming_it(validate_many, capsys):
    failures = []
    cases = damaged_files(validate_many.root / "runs")
    for case_id, content in cases:
        where, code, err = validate_many.run(content, capsys)
        try:
            # a file cut short or empty misses several keys: one error, listing them
            several = case_id.startswith(("truncated", "empty"))
            line = _error_line(code, err, listing=several)
            assert line.startswith(f"error: {where}"), line
            if not several:
                assert len(err.splitlines()) == 1, err
        except AssertionError:
            failures.append(_failure(case_id, code, err))
    assert not failures, f"{len(failures)} of {len(cases)} cases:\n" + "\n".join(failures)


# --- `llmtrain run`: refused before it starts ---


def run_base(dataset: Path, run_dir: Path) -> dict[str, Any]:
    return {
        "name": "bad",
        "run_dir": str(run_dir),
        "device": "cpu",
        "model": {"kind": "tiny", "max_seq_len": 32, "d_model": 16, "n_layers": 1},
        "data": {
            "train": [{"path": str(dataset)}],
            "seq_len": 32,
            "micro_batch": 2,
            "global_batch": 4,
        },
        "optimizer": {"kind": "adamw"},
        "training": {"steps": 2, "checkpoint_every": 1},
    }


def _file_in(where: Path) -> Path:
    where.mkdir(parents=True, exist_ok=True)
    (where / "a-file").write_text("not a directory\n")
    return where / "a-file"


# (id, the change to the base config, what the error line says after the config's file:line)
RUN_CASES = [
    (
        "negative-seed",
        lambda c, tmp: c.update(seed=-1),
        ": seed: must be a whole number from 0 to 2**64 - 1, got -1",
    ),
    (
        "run-dir-is-a-file",
        lambda c, tmp: c.update(run_dir=str(_file_in(tmp))),
        ": run_dir: {tmp}/a-file exists and is not a directory",
    ),
    (
        "run-is-a-file",
        lambda c, tmp: _file_in(tmp / "runs").rename(tmp / "runs" / "bad"),
        ": name: {tmp}/runs/bad exists and is not a directory",
    ),
    (
        "only-dataset-weighs-0",
        lambda c, tmp: c["data"]["train"][0].update(weight=0),
        ": data.train[0].weight: at least one dataset needs a positive weight",
    ),
    (
        "jsonl-outside",
        lambda c, tmp: c.update(loggers=[{"kind": "jsonl", "file": "../../x.jsonl"}]),
        ": loggers[0].file: '../../x.jsonl' leaves the run directory",
    ),
    (
        "checkpoint-dir-is-a-file",
        lambda c, tmp: c.update(checkpoint={"dir": str(_file_in(tmp))}),
        ": checkpoint.dir: {tmp}/a-file exists and is not a directory",
    ),
    (
        "data-is-not-a-dataset",
        lambda c, tmp: c["data"]["train"][0].update(path=str(tmp)),
        None,  # data-pack's own line, naming the path
    ),
    (
        "seq-len-over-the-model",
        lambda c, tmp: c["data"].update(seq_len=64),
        ": data.seq_len: 64 is longer than the model's max_seq_len (32)",
    ),
    (
        "batch-that-does-not-divide",
        lambda c, tmp: c["data"].update(global_batch=5),
        ": data.global_batch: 5 sequences per step do not divide into 1 data-parallel ranks",
    ),
]


@pytest.mark.parametrize(
    ("change", "says"), [c[1:] for c in RUN_CASES], ids=[c[0] for c in RUN_CASES]
)
def test_a_run_with_a_bad_input_stops_before_it_starts(run_cli, dataset, tmp_path, change, says):
    config = run_base(dataset, tmp_path / "runs")
    change(config, tmp_path)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    code, out, err = run_cli("run", path)
    assert out == ""
    line = _error_line(code, err)
    if says is not None:
        assert re.match(
            rf"error: {re.escape(str(path))}:\d+{re.escape(says.format(tmp=tmp_path))}", line
        ), line
    else:
        assert str(tmp_path) in line, line
    # nothing that looks like a run that went somewhere: no summary, no committed checkpoint
    assert not list(tmp_path.rglob("summary.json")), line
    assert not list(tmp_path.rglob("COMMITTED")), line
    assert not list(tmp_path.parent.glob("x.jsonl")), "a logger wrote outside the run"


def test_a_binary_file_given_as_the_run_config_is_named(run_cli, tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(bytes(range(256)) * 4)
    for command in (("run",), ("config", "validate"), ("config", "show")):
        code, out, err = run_cli(*command, path)
        assert _error_line(code, err) == (
            f"error: {path}: not a YAML text file: byte 0x80 at offset 128 is not UTF-8 (a binary "
            "file, or text in another encoding?)"
        )
        assert out == ""


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs /proc")
def test_a_place_the_file_system_refuses_later_is_one_line_naming_the_key(
    run_cli, dataset, tmp_path
):
    """/proc takes no new directory, whatever its permissions say (root may write anywhere
    else): the run's own mkdir fails, and that is one line naming `run_dir`, not a bug."""
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(run_base(dataset, Path("/proc/llmtrain-runs")), sort_keys=False))
    code, out, err = run_cli("run", path)
    line = _error_line(code, err)
    assert re.match(rf"error: {re.escape(str(path))}(:\d+)?: run_dir: /proc/llmtrain-runs", line)
    assert out == ""
