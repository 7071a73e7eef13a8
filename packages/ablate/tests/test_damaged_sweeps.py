"""`compare`, `plot`, `report` and `fit` on a damaged sweep (issue 52): a run whose file cannot
be read (metrics.jsonl a folder or not UTF-8; summary.json not an object, cut short or holding a
string where a number belongs; config.yaml not YAML) is left out and named in one `warning:`
line, the other runs go on (exit 0); a damaged manifest.json, or no readable run left, is one
`error:` line naming the file (exit 2). Never a Python exception's name."""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmtrain.ablate.fit import chinchilla_loss

CHINCHILLA = (1.69, 406.4, 410.7, 0.34, 0.28)
SIZES = (1e7, 4e7, 1.6e8)
TOKENS = (1e9, 4e9, 1.6e10)
# summary.json's numbers that compare and fit read
NUMBERS = ("step", "tokens", "wall_time_s", "params", "non_embedding_params", "flops_per_token")


def write_sweep(root: Path, sizes=SIZES, tokens=TOKENS) -> list[str]:
    """A sweep of len(sizes) x len(tokens) finished runs, as training writes them (config.yaml,
    metrics.jsonl with an eval loss, summary.json with N and D for `fit`, manifest.json);
    returns the run names in order."""
    root.mkdir(parents=True)
    names = []
    for i, n in enumerate(sizes):
        for j, d in enumerate(tokens):
            name = f"n{i}-d{j}"
            names.append(name)
            path = root / name
            path.mkdir()
            config = {"name": name, "model": {"width": i}, "train": {"tokens": j}}
            config["data"] = {"tokenizer": "bytes", "seq_len": 32}
            (path / "config.yaml").write_text("# provenance\n" + yaml.safe_dump(config))
            loss = float(chinchilla_loss(n, d, CHINCHILLA))
            lines = [
                {"step": 1, "loss": loss + 1.0, "tokens": d / 2},
                {"step": 2, "loss": loss + 0.1, "tokens": d},
                {"step": 2, "eval_loss": loss},
            ]
            (path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
            summary = {"status": "finished", "step": 2, "tokens": d, "wall_time_s": 1.5}
            summary |= {"params": n + 1000, "non_embedding_params": n, "flops_per_token": 6 * n}
            (path / "summary.json").write_text(json.dumps(summary))
    (root / "manifest.json").write_text(json.dumps({"runs": [{"id": x} for x in names]}))
    return names


def _replace_by_folder(file: Path) -> None:
    file.unlink()
    file.mkdir()
    (file / "inside").write_text("{}")


def _summary_with(**fields: object):
    def damage(file: Path) -> None:
        file.write_text(json.dumps({**json.loads(file.read_text()), **fields}))

    return damage


# each damage: (the file it hits, what it does to it)
RUN_DAMAGES = {
    "metrics-folder": ("metrics.jsonl", _replace_by_folder),
    "metrics-not-utf8": (
        "metrics.jsonl",
        lambda f: f.write_bytes(b'{"step": 1, "loss": 2.0}\n\xff\xfe\xe9t\xe9\n{"step": 2}\n'),
    ),
    "metrics-binary": ("metrics.jsonl", lambda f: f.write_bytes(bytes(range(256)) * 3)),
    "summary-list": ("summary.json", lambda f: f.write_text('[{"status": "finished"}]')),
    "summary-string": ("summary.json", lambda f: f.write_text('"finished"')),
    "summary-folder": ("summary.json", _replace_by_folder),
    "summary-cut-short": ("summary.json", lambda f: f.write_text(f.read_text()[:25])),
    "summary-tokens-string": ("summary.json", _summary_with(tokens="many")),
    "summary-wall-time-string": ("summary.json", _summary_with(wall_time_s="x")),
    "summary-params-string": ("summary.json", _summary_with(non_embedding_params="x")),
    "config-not-yaml": ("config.yaml", lambda f: f.write_text("model: [1,\n  width: {")),
}
MANIFEST_DAMAGES = {
    "garbage": lambda f: f.write_bytes(b"\x00\xff\x89PNG garbage"),
    "cut-short": lambda f: f.write_text(f.read_text()[:30]),
    "folder": _replace_by_folder,
    "a-list": lambda f: f.write_text("[1, 2]"),
    "runs-a-string": lambda f: f.write_text('{"runs": "x"}'),
    "runs-of-strings": lambda f: f.write_text('{"runs": ["a"]}'),
    "run-id-a-number": lambda f: f.write_text('{"runs": [{"id": 3}]}'),
}
COMMANDS = ("compare", "plot", "report", "fit")


def run_command(run_cli, command: str, sweep: Path, tmp: Path) -> tuple[int, str, str, set[str]]:
    """(exit code, stdout, stderr, the runs the command went on with) of `llmtrain <command>`."""
    if command == "compare":
        code, out, err = run_cli("compare", sweep, "--per-run", "--json")
        used = {name for row in json.loads(out)["rows"] for name in row["runs"]} if out else set()
    elif command == "fit":
        code, out, err = run_cli("fit", sweep, "--bootstrap", "0", "--json")
        used = {run["name"] for run in json.loads(out)["runs"]} if out else set()
    elif command == "plot":
        code, out, err = run_cli("plot", sweep, "-o", tmp / "losses.png")
        count = int(err.split(" runs, ")[0].split()[-1]) if " runs, " in err else 0
        used = {f"run {i}" for i in range(count)}  # plot names no runs: as many as it drew
    else:
        code, out, err = run_cli("report", sweep, "-o", tmp / "report.html")
        page = (tmp / "report.html").read_text() if code == 0 else ""
        used = {name for name in _names(sweep) if f">{name}<" in page}
    return code, out, err, used


def _names(sweep: Path) -> list[str]:
    return sorted(p.name for p in sweep.iterdir() if p.is_dir())


def lines_of(err: str, prefix: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith(prefix)]


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("damage", sorted(RUN_DAMAGES))
def test_a_damaged_run_is_left_out_and_named_in_one_warning(tmp_path, run_cli, command, damage):
    sweep = tmp_path / "sweep"
    names = write_sweep(sweep)
    hit = names[sorted(RUN_DAMAGES).index(damage) % len(names)]  # a different run each time
    file, do = RUN_DAMAGES[damage]
    do(sweep / hit / file)
    code, _, err, used = run_command(run_cli, command, sweep, tmp_path)
    assert code == 0, err
    warnings = lines_of(err, "warning:")
    assert len(warnings) == 1, err
    assert str(sweep / hit / file) in warnings[0]
    assert "Error" not in err and "Traceback" not in err
    others = set(names) - {hit}
    if command == "plot":
        assert len(used) == len(others), err
    else:
        assert used == others


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("damage", sorted(MANIFEST_DAMAGES))
def test_a_damaged_manifest_is_one_error(tmp_path, run_cli, command, damage):
    sweep = tmp_path / "sweep"
    write_sweep(sweep, sizes=SIZES[:1])
    MANIFEST_DAMAGES[damage](sweep / "manifest.json")
    code, out, err, _ = run_command(run_cli, command, sweep, tmp_path)
    assert code == 2, err
    assert out == ""
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"error: {sweep / 'manifest.json'}"), err


@pytest.mark.parametrize("command", COMMANDS)
def test_nothing_readable_left_is_one_error_naming_the_files(tmp_path, run_cli, command):
    sweep = tmp_path / "sweep"
    names = write_sweep(sweep, sizes=SIZES[:1])
    for name in names:
        (sweep / name / "summary.json").write_text("[]")
    code, out, err, _ = run_command(run_cli, command, sweep, tmp_path)
    assert code == 2, err
    assert out == ""
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("error: no readable run")
    assert all(str(sweep / name / "summary.json") in err for name in names)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner),
    max_leaves=5,
)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    fields=st.dictionaries(st.sampled_from(NUMBERS), JSON, max_size=3),
    garbage=st.binary(max_size=64),
    which=st.integers(0, 2),
    command=st.sampled_from(("compare", "fit")),
)
def test_any_summary_fields_and_metrics_bytes_give_a_table_or_one_warning(
    run_cli, fields, garbage, which, command
):
    """Whatever summary.json's numbers hold and whatever bytes metrics.jsonl holds, the command
    answers: a run with a non-number among its numbers, or metrics lines before the last that are
    not UTF-8, is named in one warning and left out; the others are used."""
    with tempfile.TemporaryDirectory() as tmp:
        sweep = Path(tmp) / "sweep"
        names = write_sweep(sweep, sizes=SIZES, tokens=TOKENS[:2])
        hit = names[which]
        _summary_with(**fields)(sweep / hit / "summary.json")
        metrics = sweep / names[(which + 1) % 3] / "metrics.jsonl"
        metrics.write_bytes(garbage + b"\n" + metrics.read_bytes())
        bad_summary = any(v is not None and not _is_number(v) for v in fields.values())
        bad_metrics = _not_utf8(garbage)
        code, _, err, used = run_command(run_cli, command, sweep, Path(tmp))
        named = [p for bad, p in ((bad_summary, hit), (bad_metrics, metrics.parent.name)) if bad]
        assert "Traceback" not in err and "Error:" not in err
        if code == 2:  # fit refuses runs it cannot fit (too few, N <= 0, ...): as a user error
            assert command == "fit" and len(lines_of(err, "error:")) == 1, err
            return
        assert code == 0, err
        assert len(lines_of(err, "warning:")) == (1 if named else 0), err
        assert all(name in lines_of(err, "warning:")[0] for name in named)
        if command == "compare":
            assert used == set(names) - set(named)


def _not_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def test_fit_mixture_goes_on_without_the_damaged_runs(tmp_path, run_cli):
    """`fit --mixture` reads its runs with the same readers: two damaged runs of eight are named
    in one warning, and the mixture is fitted on the other six."""
    pytest.importorskip("lightgbm")
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    datasets = ("/data/web.zarr", "/data/code.zarr", "/data/junk.zarr")
    ids = []
    mixtures = np.random.default_rng(1).dirichlet([1.0, 1.0, 1.0], 8)
    for k, weights in enumerate(mixtures):
        run = sweep / f"mix={k:03d}"
        ids.append({"id": run.name})
        run.mkdir()
        train = [{"path": p, "weight": float(w)} for p, w in zip(datasets, weights, strict=True)]
        config = {"name": run.name, "seed": 0, "data": {"train": train, "seq_len": 64}}
        (run / "config.yaml").write_text(yaml.safe_dump(config))
        web, code = 3.0 + 0.8 * math.exp(-3 * weights[0]), 3.2 + 1.2 * math.exp(-4 * weights[1])
        line = {"step": 2, "loss": 4.0, "eval/web/loss": web, "eval/code/loss": code}
        (run / "metrics.jsonl").write_text(json.dumps(line) + "\n")
        (run / "summary.json").write_text('{"status": "finished", "step": 2, "tokens": 200}')
    (sweep / "manifest.json").write_text(json.dumps({"runs": ids}))
    (sweep / "mix=002" / "summary.json").write_text('{"status": "finished", "tokens": "many"}')
    (sweep / "mix=005" / "metrics.jsonl").write_bytes(b"\xff\xfe\n" * 2)
    code, out, err = run_cli("fit", sweep, "--mixture")
    assert code == 0, err
    (warning,) = lines_of(err, "warning:")
    assert str(sweep / "mix=002" / "summary.json") in warning
    assert str(sweep / "mix=005" / "metrics.jsonl") in warning
    assert "6 runs, 3 datasets" in out
