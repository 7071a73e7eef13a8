"""Decay branches of a ladder by size, trained for real in this process: 2 sizes x 5 ratios with
a wsd base. The branched ladder trains at most 65% of the tokens of the same ladder from scratch
(the table says so), every branch logs exactly the losses of its rung trained alone, and `fit
--compare` of it against the same ladder at a third of the lr predicts the difference the
trained rungs show."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

LADDER = ["--ladder", "--params", "1e3,4e3", "--tokens-per-param", "1,2,4,8,16"]
LADDER += ["--aspect-ratio", "2,64"]


def write_base(tmp_path: Path, dataset: Path, **changes: object) -> Path:
    config = {
        "name": "lad",
        "device": "cpu",
        "model": {
            "kind": "tiny",
            "vocab_size": 260,
            "max_seq_len": 32,
            "d_model": 8,
            "n_heads": 2,
            "n_kv_heads": 1,
        },
        "data": {
            "train": [{"path": str(dataset)}],
            "eval": {"path": str(dataset), "every": 1000000, "batches": 2},
            "seq_len": 32,
            "micro_batch": 8,
        },
        "optimizer": {"kind": "adamw", "lr": 3e-3},
        "lr_scheduler": {"kind": "wsd", "warmup_steps": 5},
        "training": {"steps": 1, "log_every": 1},
        "loggers": [{"kind": "jsonl"}],
        **changes,
    }
    path = tmp_path / "base.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def launch(run_cli, base: Path, sweeps: Path, name: str, *flags: str) -> list[str]:
    """The sweep's runs, in the order it launches them: each run's config path."""
    code, out, err = run_cli(
        "sweep", base, *flags, *LADDER, "--name", name, "--dir", sweeps, "--launch", "print"
    )
    assert code == 0, err
    commands = [shlex.split(line) for line in out.splitlines() if line.startswith("llmtrain run")]
    return [next(word for word in words if word.endswith("config.yaml")) for words in commands]


def losses(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {m["step"]: m["loss"] for m in map(json.loads, lines)}


@pytest.fixture(scope="module")
def ladders(tmp_path_factory, dataset):
    """The branched ladder, and the rungs its branches stand for trained alone."""
    from llmtrain.core_mesh.cli import main

    tmp = tmp_path_factory.mktemp("branches")
    base, sweeps = write_base(tmp, dataset), tmp / "sweeps"

    def run_all(configs: list[str]) -> None:
        for config in configs:
            assert main(["run", config]) == 0, config

    class Cli:  # run_cli is function-scoped; this fixture drives main() itself
        def __call__(self, *argv: object) -> tuple[int, str, str]:
            import contextlib
            import io

            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = main([str(a) for a in argv])
            return code, out.getvalue(), err.getvalue()

    cli = Cli()
    branched = launch(cli, base, sweeps, "br", "--branch-decays", "0.2")
    run_all(branched)
    manifest = json.loads((sweeps / "br" / "manifest.json").read_text())
    alone = launch(cli, base, sweeps, "alone", "lr_scheduler.decay_fraction=0.2")
    run_all([c for c in alone if Path(c).parent.name in manifest["branches"]])
    # the same ladder with a known change, for fit --compare: a third of the lr
    run_all(launch(cli, base, sweeps, "lowlr", "optimizer.lr=1e-3", "--branch-decays", "0.2"))
    return {"base": base, "sweeps": sweeps, "manifest": manifest, "order": branched, "cli": cli}


def test_the_branched_ladder_trains_at_most_65_percent_of_the_tokens(ladders, run_cli):
    code, out, err = run_cli(
        "sweep", ladders["base"], *LADDER, "--branch-decays", "0.2", "--dry-run"
    )
    assert code == 0, err
    trained, scratch = (
        int(n.replace(",", ""))
        for n in re.search(r"tokens trained: ([\d,]+) of the ([\d,]+)", out).groups()
    )
    assert trained / scratch <= 0.65
    rows = {line.split()[0]: line.split() for line in out.splitlines()[1:11]}
    assert sum(int(row[-1].replace(",", "")) for row in rows.values()) == trained
    assert sum(int(row[4].replace(",", "")) for row in rows.values()) == scratch
    # each size's longest rung is its trunk; the others branch off it where their decay starts
    branches = ladders["manifest"]["branches"]
    assert len(branches) == 8
    assert {b["trunk"] for b in branches.values()} == {"N=1e3,r=16", "N=4e3,r=16"}
    for run_id, branch in branches.items():
        steps = next(
            r["steps"]
            for r in ladders["manifest"]["ladder"]
            if f"r={r['label']['r']}" in run_id and r["label"]["N"] in run_id
        )
        assert branch["start"] == steps - round(0.2 * steps), run_id
    # trunks first: a branch starts from a checkpoint its trunk saved before
    order = [Path(c).parent.name for c in ladders["order"]]
    assert order[:2] == ["N=1e3,r=16", "N=4e3,r=16"]


def test_every_branch_logs_the_losses_of_its_rung_trained_alone(ladders):
    sweeps = ladders["sweeps"]
    for run_id, branch in ladders["manifest"]["branches"].items():
        got, want = losses(sweeps / "br" / run_id), losses(sweeps / "alone" / run_id)
        assert min(got) == branch["start"] + 1, run_id
        assert got == {step: loss for step, loss in want.items() if step > branch["start"]}
        summary = json.loads((sweeps / "br" / run_id / "summary.json").read_text())
        alone = json.loads((sweeps / "alone" / run_id / "summary.json").read_text())
        assert summary["eval"]["eval_loss"] == alone["eval"]["eval_loss"], run_id
        assert (summary["status"], summary["tokens"]) == ("finished", alone["tokens"])


def test_fit_and_compare_read_the_branched_ladder_like_any(ladders, run_cli, tmp_path):
    sweep = ladders["sweeps"] / "br"
    code, out, err = run_cli("fit", sweep, "--bootstrap", "20", "-o", tmp_path / "fit.json")
    assert code == 0, err
    fitted = json.loads((tmp_path / "fit.json").read_text())
    assert len(fitted["runs"]) == 10 and fitted["parametric"] is not None
    code, out, err = run_cli("compare", sweep, "--json")
    assert code == 0, err
    shown = json.loads(out)
    assert shown["keys"] == ["model.n_layers", "training.steps"]  # not the branches' init


@pytest.mark.parametrize(
    ("flags", "changes", "message"),
    [
        (["--branch-decays", "1.2"], {}, "--branch-decays 1.2: give the decay's fraction"),
        (["--branch-decays", "0"], {}, "--branch-decays 0: give the decay's fraction"),
        (
            ["--branch-decays", "0.2"],
            {"lr_scheduler": {"kind": "cosine"}},
            "--branch-decays needs the base's lr schedule to be wsd",
        ),
        (
            ["--branch-decays", "0.2"],
            {"lr_scheduler": {"kind": "wsd", "decay_steps": 10}},
            "lr_scheduler.decay_steps 10 would fix it in steps",
        ),
        (["--budgets", "1e9"], {}, "--budgets and --params each size the rungs"),
    ],
)
def test_bad_branches_are_one_line(tmp_path, dataset, run_cli, flags, changes, message):
    base = write_base(tmp_path, dataset, **changes)
    code, _, err = run_cli("sweep", base, *LADDER, *flags, "--dry-run")
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1 and message in lines[0], err


def test_branch_flags_need_a_ladder(tmp_path, dataset, run_cli):
    code, _, err = run_cli("sweep", write_base(tmp_path, dataset), "--branch-decays", "0.2")
    assert code == 2 and "--branch-decays size a model ladder: add --ladder" in err


def test_a_branch_whose_trunk_has_not_saved_its_start_says_so(tmp_path, dataset, run_cli):
    base = write_base(tmp_path, dataset)
    configs = launch(run_cli, base, tmp_path / "sweeps", "x", "--branch-decays", "0.2")
    code, _, err = run_cli("run", configs[-1])  # a branch, before its trunk ran
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1, err
    assert (
        "has no committed step" in lines[0] and "train the run it branches from first" in lines[0]
    )


@pytest.mark.parametrize(
    ("init", "message"),
    [
        ({"from": "x", "state": "all"}, "init.step: init.state: all (a branch) names the step"),
        ({"from": "x", "step": 3, "state": "all", "format": "hf"}, "init.format: init.state: all"),
        ({"from": "x", "step": 3, "state": "some"}, "init.state"),
    ],
)
def test_a_branch_names_its_step_of_an_llmtrain_checkpoint(tiny_run_config, run_cli, init, message):
    code, _, err = run_cli("run", tiny_run_config(init=init))
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1 and message in lines[0], err


def test_under_slurm_the_branches_wait_for_their_trunks(tmp_path, dataset, run_cli):
    base, sweeps = write_base(tmp_path, dataset), tmp_path / "sweeps"
    code, out, err = run_cli(
        "sweep", base, *LADDER, "--branch-decays", "0.2", "--name", "s", "--dir", sweeps,
        "--launch", "slurm",
    )  # fmt: skip
    assert code == 0, err
    trunks, branches = sweeps / "s" / "sweep.sbatch", sweeps / "s" / "branches.sbatch"
    assert out.strip() == (
        f"job=$(sbatch --parsable {trunks}) && sbatch --dependency=afterok:${{job%%;*}} {branches}"
    )
    manifest = json.loads((sweeps / "s" / "manifest.json").read_text())

    def configs(script: Path) -> set[str]:
        return {
            Path(line.strip().strip("'")).parent.name
            for line in script.read_text().splitlines()
            if line.strip().strip("'").endswith("config.yaml")
        }

    assert configs(branches) == set(manifest["branches"])
    assert configs(trunks) == {"N=1e3,r=16", "N=4e3,r=16"}


def test_fit_compare_predicts_the_sign_the_trained_rungs_show(ladders, run_cli):
    sweeps = ladders["sweeps"]

    def final(sweep: str) -> dict[str, float]:
        return {
            run_id: json.loads((sweeps / sweep / run_id / "summary.json").read_text())["eval"][
                "eval_loss"
            ]
            for run_id in ladders["manifest"]["branches"] | {"N=1e3,r=16": 0, "N=4e3,r=16": 0}
        }

    trained = {k: final("lowlr")[k] - v for k, v in final("br").items()}
    assert all(diff > 0 for diff in trained.values()), trained  # a third of the lr: worse
    largest = json.loads((sweeps / "br" / "N=4e3,r=16" / "summary.json").read_text())
    at = f"N={largest['non_embedding_params']},D={largest['tokens']}"
    code, out, err = run_cli(
        "fit", "--compare", sweeps / "br", sweeps / "lowlr", "--predict", at,
        "--bootstrap", "20", "--json",
    )  # fmt: skip
    assert code == 0, err
    (prediction,) = json.loads(out)["predictions"]
    assert prediction["difference"][0] > 0 and prediction["lower"] == "baseline"
