"""`llmtrain fit --mixture` and the report's mixture section on hand-made mixture sweeps whose
best mixture is known: three datasets, web and code, each the only help to its own held-out
loss, and junk, which only hurts (it takes share from both and adds to both losses):

    eval/web/loss  = 3.0 + 0.8 exp(-3 w_web)  + 0.5 w_junk
    eval/code/loss = 3.2 + 1.2 exp(-4 w_code) + 0.5 w_junk

Their mean is lowest with no junk and w_web = (4 - ln 2) / 7 = 0.4724 (where its derivative
along w_web + w_code = 1 vanishes). 32 runs at Dirichlet(1, 1, 1) mixtures, each loss with
noise of sd 0.005: the fit must find that mixture within 0.05, rank the runs it did not see
(cross-validated Spearman >= 0.8), give junk at most 0.1 and an interval holding the true
target there. Then every refusal, the JSON, `--at`, and the report's section.
"""

from __future__ import annotations

import base64
import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import yaml

from llmtrain.ablate import mixture_fit
from llmtrain.ablate.mixture_fit import MixtureData

TARGET = "eval/web/loss=0.5,eval/code/loss=0.5"
BEST_WEB = (4 - math.log(2)) / 7
OPTIMUM = np.array([BEST_WEB, 1 - BEST_WEB, 0.0])  # web, code, junk
TOLERANCE = 0.05  # each chosen weight within this of OPTIMUM
DATASETS = ({"path": "/data/web.zarr"}, {"path": "/data/code.zarr"}, {"path": "/d/junk.zarr"})


def losses(weights):
    """(web, code) held-out losses of mixtures (rows of web, code, junk weights)."""
    w = np.atleast_2d(weights)
    web = 3.0 + 0.8 * np.exp(-3 * w[:, 0]) + 0.5 * w[:, 2]
    code = 3.2 + 1.2 * np.exp(-4 * w[:, 1]) + 0.5 * w[:, 2]
    return np.column_stack([web, code])


def true_target(weights):
    return float((losses(weights) @ [0.5, 0.5])[0])


def write_sweep(root, mixtures, values=None, datasets=DATASETS, status="finished", extra=None):
    """A sweep as `llmtrain sweep --mixtures` leaves it: per run config.yaml with data.train,
    metrics.jsonl ending with the held-out losses (`values`, default `losses` plus noise),
    summary.json; manifest.json listing the runs."""
    mixtures = np.asarray(mixtures)
    if values is None:
        rng = np.random.default_rng(7)
        values = losses(mixtures) + rng.normal(0, 0.005, (len(mixtures), 2))
    root.mkdir(parents=True)
    ids = []
    for k, (weights, (web, code)) in enumerate(zip(mixtures, values, strict=True)):
        run_id = f"mix={k:03d}"
        ids.append({"id": run_id})
        train = [{**d, "weight": float(w)} for d, w in zip(datasets, weights, strict=True)]
        config = {"name": run_id, "seed": 0, "data": {"train": train, "seq_len": 64}}
        config["data"].update(extra or {})
        (root / run_id).mkdir()
        (root / run_id / "config.yaml").write_text("# header\n" + yaml.safe_dump(config))
        lines = [
            {"step": 1, "loss": 5.0, "tokens": 100},
            {"step": 2, "loss": 4.0, "tokens": 200, "eval/web/loss": web, "eval/code/loss": code},
        ]
        (root / run_id / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
        summary = {"status": status, "step": 2, "tokens": 200}
        (root / run_id / "summary.json").write_text(json.dumps(summary))
    (root / "manifest.json").write_text(json.dumps({"runs": ids}))
    return root


def dirichlet(count, sources=3, seed=1):
    """Mixtures as the sweep draws them: rounded to 1e-4 (the fit normalises them)."""
    return np.round(np.random.default_rng(seed).dirichlet(np.ones(sources), count), 4)


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    return write_sweep(tmp_path_factory.mktemp("mixtures") / "swarm", dirichlet(32))


def test_the_fit_finds_the_known_best_mixture(swarm, run_cli, tmp_path):
    code, out, err = run_cli(
        "fit", swarm, "--mixture", "--target", TARGET, "--json", "--at", "1,1,0", "--at", "1,1,2"
    )
    assert code == 0, err
    fit = json.loads(out)
    chosen = np.array(fit["weights"])
    assert chosen.sum() == pytest.approx(1.0)
    assert np.allclose(chosen, np.round(chosen, 2))  # hundredths
    assert np.abs(chosen - OPTIMUM).max() <= TOLERANCE, chosen
    assert chosen[2] <= 0.1
    assert fit["cv_spearman"] >= 0.8
    truth = true_target(chosen)
    low, high = fit["interval"]
    assert low <= truth <= high and low <= fit["predicted"] <= high
    assert fit["predicted"] == pytest.approx(truth, abs=0.1)
    assert fit["model"] in mixture_fit.MODELS
    assert fit["data_weights"] == "data.weights=[" + ",".join(f"{w:g}" for w in chosen) + "]"
    assert fit["sources"] == ["web", "code", "junk"]
    assert fit["target"] == TARGET
    assert fit["folds"] == 5 and len(fit["runs"]) == 32
    # every model cross-validated, the chosen one with the lowest error; the trees did split
    models = fit["models"]
    assert set(models) == set(mixture_fit.MODELS)
    assert fit["cv_rmse"] == min(m["cv_rmse"] for m in models.values())
    assert models["lightgbm"]["cv_spearman"] >= 0.8
    # --at: normalised, predicted within its interval of the truth; junk costs what it should
    half, junky = fit["at"]
    assert half["weights"] == [0.5, 0.5, 0.0] and half["outside"] == ["junk"]
    assert junky["weights"] == [0.25, 0.25, 0.5] and junky["outside"] == []
    for row in (half, junky):
        assert row["interval"][0] <= true_target(row["weights"]) <= row["interval"][1]
    assert junky["predicted"] - half["predicted"] == pytest.approx(
        true_target([0.25, 0.25, 0.5]) - true_target([0.5, 0.5, 0]), abs=0.1
    )
    print(f"chosen {chosen} vs {OPTIMUM.round(4)}; cv_spearman {fit['cv_spearman']:.3f}")


def test_the_text_names_the_answer_first_and_plots(swarm, run_cli, tmp_path):
    code, out, err = run_cli(
        "fit", swarm, "--mixture", "--plot", tmp_path / "mix.png", "-o", tmp_path / "mix.json"
    )
    assert code == 0, err
    lines = out.splitlines()
    # no --target: the mean of the named held-out sets' losses, the same fit as above's
    assert lines[0] == (
        "mixture fit: 32 runs, 3 datasets; target 0.5 eval/code/loss + 0.5 eval/web/loss "
        "(the mean of the 2 held-out sets' losses), lower is better"
    )
    written = json.loads((tmp_path / "mix.json").read_text())
    weights = written["weights"]
    shown = ", ".join(f"{name} {w:g}" for name, w in zip(written["sources"], weights, strict=True))
    assert lines[1].startswith(f"best mixture: {shown}; predicted ")
    assert f"= {written['predicted']:.4f} (95% interval {written['interval'][0]:.4f}" in lines[1]
    assert lines[2] == written["data_weights"]
    chosen_row = next(line for line in lines if line.endswith("chosen"))
    assert chosen_row.split()[0] == written["model"]
    assert "5-fold cross-validation (seed 0)" in out
    assert (tmp_path / "mix.png").read_bytes().startswith(b"\x89PNG")
    assert "fits of 32 runs ->" in err


def test_lightgbm_is_chosen_where_no_law_fits():
    """One metric with cliffs: a unit worse wherever web or code has less than 0.25. No smooth
    law (mixing, log-linear, linear) follows a step; the trees do, and stay off both cliffs."""
    w = dirichlet(48)
    w = w / w.sum(1, keepdims=True)
    rng = np.random.default_rng(3)
    cliffs = 3 + 1.0 * (w[:, 0] < 0.25) + 1.0 * (w[:, 1] < 0.25) + 0.5 * w[:, 2]
    data = MixtureData(w, (cliffs + rng.normal(0, 0.005, 48))[:, None], np.array([1.0]))
    fit = mixture_fit.fit_mixture(data, seed=0)
    assert fit.model == "lightgbm"
    assert fit.score.spearman >= 0.9
    assert fit.weights[0] >= 0.25 and fit.weights[1] >= 0.25 and fit.weights[2] <= 0.1


def test_the_log_linear_law_is_chosen_where_a_small_share_costs_most():
    """Each loss falls with the log of its own source's share (diminishing returns, and a
    steep cost near 0, as small proxy runs show): the log-linear law recovers the best mixture
    of the mean, w_web = 0.6 / (0.6 + 0.4) when each loss is -b log(w + 0.01)."""
    w = dirichlet(24)
    w = w / w.sum(1, keepdims=True)
    web = 4.0 - 0.6 * np.log(w[:, 0] + 0.01) + 0.3 * w[:, 2]
    code = 3.0 - 0.4 * np.log(w[:, 1] + 0.01) + 0.3 * w[:, 2]
    rng = np.random.default_rng(5)
    metrics = np.column_stack([web, code]) + rng.normal(0, 0.005, (24, 2))
    fit = mixture_fit.fit_mixture(MixtureData(w, metrics, np.array([0.5, 0.5])), seed=0)
    assert fit.model == "log_linear"
    assert fit.score.spearman >= 0.95
    # the optimum on w_web + w_code = 1 - junk, junk 0: 0.6 / (w + .01) = 0.4 / (1 - w + .01)
    best_web = (0.6 * 1.01 - 0.4 * 0.01) / 1.0
    assert np.abs(fit.weights - [best_web, 1 - best_web, 0.0]).max() <= TOLERANCE


def test_a_higher_is_better_target_is_maximised():
    """Scores that mirror the losses (1 - loss, as accuracies go up): the same best mixture."""
    w = dirichlet(24)
    data = MixtureData(w / w.sum(1, keepdims=True), 1 - losses(w), np.array([0.5, 0.5]), True)
    fit = mixture_fit.fit_mixture(data)
    assert fit.model == "mixing_law"  # with k < 0: c - |k| exp(t . w)
    assert np.abs(fit.weights - OPTIMUM).max() <= TOLERANCE


def test_the_fewest_runs_let_every_fold_fit_the_law():
    assert [mixture_fit.min_runs(s) for s in (2, 3, 4, 10)] == [4, 5, 7, 14]
    for sources in range(2, 30):
        runs = mixture_fit.min_runs(sources)
        kept = [runs - len(held) for held in mixture_fit.folds(runs, 0)]
        assert min(kept) >= sources + 1
        fewer = [runs - 1 - len(held) for held in mixture_fit.folds(runs - 1, 0)]
        assert runs - 1 < max(4, sources + 2) or min(fewer) < sources + 1


def test_rounded_weights_are_hundredths_that_sum_to_one():
    for weights in ([0.333, 0.333, 0.334], [0.004, 0.4956, 0.5004], [1.0, 0.0, 0.0]):
        rounded = mixture_fit.rounded(np.array(weights))
        assert rounded.sum() == pytest.approx(1.0)
        assert np.abs(rounded - weights).max() <= 0.01
        assert np.allclose(rounded * 100, np.round(rounded * 100))


def one_line_error(run_cli, *argv):
    code, _, err = run_cli(*argv)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, (argv, code, err)
    return lines[0]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--target", "eval/web/loss="], "eval/web/loss's weight (none) is not a positive"),
        (["--target", "=0.5"], "--target =0.5: a term without a metric name"),
        (["--target", "eval/web/loss=-1"], "eval/web/loss's weight -1 is not a positive"),
        (["--target", "eval/web/loss,eval/web/loss=2"], "eval/web/loss is named twice"),
        (["--isoflop"], "--isoflop: for the scaling-law fits only"),
        (["--predict", "N=1e9,D=1e10", "--loss", "loss"], "--predict, --loss: for the scaling"),
        (["--bootstrap", "0"], "--bootstrap: for the scaling-law fits only"),
        (["--at", "1,1"], "--at 1,1: 2 weights for 3 datasets (web, code, junk)"),
        (["--at=-1,1,1"], "--at -1,1,1: a weight below 0"),
        (["--at", "0,0,0"], "--at 0,0,0: every weight is 0"),
        (["--at", "a,b,c"], "--at a,b,c: give one weight per data.train dataset"),
        (["--target", "eval/math/loss"], "runs that logged no eval/math/loss: mix=000, mix=001"),
    ],
)
def test_bad_mixture_requests_are_refused_in_one_line(swarm, run_cli, args, message):
    assert message in one_line_error(run_cli, "fit", swarm, "--mixture", *args)


def test_mixture_options_need_mixture(swarm, run_cli):
    line = one_line_error(run_cli, "fit", swarm, "--target", "eval_loss", "--at", "1,1,1")
    assert line == "error: --target, --at: for the mixture fit only; add --mixture"


def test_sweeps_the_fit_cannot_use_are_refused_by_name(tmp_path, run_cli):
    few = write_sweep(tmp_path / "few", dirichlet(4))
    line = one_line_error(run_cli, "fit", few, "--mixture")
    assert "4 finished runs are fewer than the 5 a mixture fit of 3 sources needs" in line

    same = write_sweep(tmp_path / "same", np.tile([0.5, 0.3, 0.2], (8, 1)))
    line = one_line_error(run_cli, "fit", same, "--mixture")
    assert "all train on the same mixture (web 0.5, code 0.3, junk 0.2)" in line

    other = write_sweep(tmp_path / "other", dirichlet(8))
    config = yaml.safe_load((other / "mix=003" / "config.yaml").read_text())
    config["data"]["train"][2]["path"] = "/d/math.zarr"
    (other / "mix=003" / "config.yaml").write_text(yaml.safe_dump(config))
    line = one_line_error(run_cli, "fit", other, "--mixture")
    assert "different data.train lists (mix=000, mix=001, mix=002 and 4 more: /data/" in line
    assert "; mix=003: /data/web.zarr, /data/code.zarr, /d/math.zarr)" in line

    phases = {"phases": [{"weights": [1, 0, 0], "until_fraction": 0.5}, {"weights": [0, 1, 1]}]}
    scheduled = write_sweep(tmp_path / "scheduled", dirichlet(8), extra=phases)
    line = one_line_error(run_cli, "fit", scheduled, "--mixture")
    assert "a mixture schedule (data.phases): mix=000" in line
    assert "fit --mixture needs one mixture per run" in line

    diverged = write_sweep(tmp_path / "diverged", dirichlet(8))
    metrics = diverged / "mix=005" / "metrics.jsonl"
    metrics.write_text(metrics.read_text() + '{"step": 3, "eval/web/loss": NaN}\n')
    line = one_line_error(run_cli, "fit", diverged, "--mixture")
    assert "final eval/code/loss or eval/web/loss is NaN or inf (diverged?): mix=005" in line

    mixed = write_sweep(tmp_path / "mixed", dirichlet(8))
    for run in mixed.glob("mix=*"):
        with (run / "metrics.jsonl").open("a") as lines:
            lines.write('{"step": 2, "downstream/arc/acc": 0.3}\n')
    line = one_line_error(
        run_cli, "fit", mixed, "--mixture", "--target", "eval/web/loss,downstream/arc/acc"
    )
    assert "improve upwards (downstream/arc/acc) to ones that improve downwards" in line


def test_unfinished_runs_are_left_out_and_named(tmp_path, run_cli):
    sweep = write_sweep(tmp_path / "sweep", dirichlet(8))
    write_sweep(tmp_path / "killed", dirichlet(1, seed=9), status="failed")
    (tmp_path / "killed" / "mix=000").rename(sweep / "killed")
    code, out, err = run_cli("fit", sweep, sweep / "killed", "--mixture")
    assert code == 0, err
    assert "8 runs, 3 datasets" in out and "left out, not finished: killed (failed)" in out


def test_without_lightgbm_the_extra_is_named(swarm, run_cli, monkeypatch):
    monkeypatch.setitem(sys.modules, "lightgbm", None)  # import lightgbm raises ImportError
    line = one_line_error(run_cli, "fit", swarm, "--mixture")
    assert "needs LightGBM: pip install 'llmtrain-ablate[mixture]'" in line
    assert "pip install './packages/ablate[mixture]'" in line


def test_lightgbm_without_its_openmp_runtime_says_what_to_install(swarm, run_cli, monkeypatch):
    """lib_lightgbm.so links libgomp.so.1, which a bare machine may lack: ctypes then raises
    OSError while `import lightgbm` runs."""

    class NoRuntime:
        def find_spec(self, name, path=None, target=None):
            if name == "lightgbm":
                raise OSError("libgomp.so.1: cannot open shared object file")
            return None

    monkeypatch.delitem(sys.modules, "lightgbm", raising=False)
    monkeypatch.setattr(sys, "meta_path", [NoRuntime(), *sys.meta_path])
    line = one_line_error(run_cli, "fit", swarm, "--mixture")
    assert "LightGBM is installed but cannot load its library (libgomp.so.1" in line
    assert "apt install libgomp1" in line


def test_the_mixture_fit_runs_without_torch_and_the_plugin_loads_no_lightgbm(swarm, tmp_path):
    """In a child whose `import torch` finds a package that raises ImportError (first on
    PYTHONPATH, as if torch were not installed): loading ablate's plugin imports neither scipy
    nor LightGBM, and `fit --mixture` imports LightGBM and no torch."""
    (tmp_path / "blocked" / "torch").mkdir(parents=True)
    (tmp_path / "blocked" / "torch" / "__init__.py").write_text("raise ImportError('blocked')\n")
    child = (
        "import sys, llmtrain.ablate.plugin\n"
        "assert not {'scipy', 'lightgbm'} & set(sys.modules), 'the plugin loads too much'\n"
        "from llmtrain.core_mesh.cli import main\n"
        "code = main(sys.argv[1:])\n"
        "assert 'torch' not in sys.modules and 'lightgbm' in sys.modules\n"
        "sys.exit(code)\n"
    )
    path = os.pathsep.join([str(tmp_path / "blocked"), os.environ.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", child, "fit", str(swarm), "--mixture", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": path},
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["model"] in mixture_fit.MODELS


# --- the report ---


def section(page, element, css_id):
    found = re.search(rf'<{element} id="{css_id}"[^>]*>(.*?)</{element}>', page, re.S)
    assert found, f"no {element}#{css_id}"
    return found.group(1)


def test_the_report_names_the_mixture_first(swarm, run_cli, tmp_path):
    out = tmp_path / "report.html"
    code, _, err = run_cli("report", swarm, "-o", out, "--target", TARGET)
    assert code == 0, err
    page = out.read_text(encoding="utf-8")
    _, fitted, _ = run_cli("fit", swarm, "--mixture", "--target", TARGET, "--json")
    fit = json.loads(fitted)
    shown = ", ".join(f"{n} {w:g}" for n, w in zip(fit["sources"], fit["weights"], strict=True))
    verdict = section(page, "p", "mixture-verdict")
    assert verdict.startswith(f"Best data mixture: {shown}; predicted ")
    assert f"{fit['predicted']:.4f} (95% interval" in verdict
    assert fit["data_weights"] in verdict
    # the section: the answer before its tables and figure, the target said, the models' table
    mixture = section(page, "section", "mixture")
    answer = mixture.index('id="mixture-answer"')
    assert answer < mixture.index("<table") < mixture.index('id="mixture-plot"')
    assert page.index('id="mixture"') < page.index("<h2>Compare</h2>")
    assert "(given with --target), lower is better" in mixture
    models = section(page, "table", "mixture-models")
    assert models.count("<tr>") == 1 + len(mixture_fit.MODELS) and "chosen" in models
    weights = section(page, "table", "mixture-weights")
    assert all(f"<td>{name}</td>" in weights for name in fit["sources"])
    image = re.search(
        r'<img id="mixture-plot" alt="[^"]*" src="data:image/png;base64,([^"]+)"', page
    )
    assert image and base64.b64decode(image.group(1)).startswith(b"\x89PNG")


def test_the_report_defaults_its_target_and_skips_sweeps_without_mixtures(tmp_path, run_cli):
    sweep = write_sweep(tmp_path / "sweep", dirichlet(8))
    code, _, err = run_cli("report", sweep, "-o", tmp_path / "a.html")
    assert code == 0, err
    mixture = section((tmp_path / "a.html").read_text(encoding="utf-8"), "section", "mixture")
    assert "(the mean of the 2 held-out sets&#39; losses)" in mixture

    same = write_sweep(tmp_path / "same", np.tile([0.5, 0.3, 0.2], (8, 1)))
    code, _, err = run_cli("report", same, "-o", tmp_path / "b.html")
    assert code == 0, err
    page = (tmp_path / "b.html").read_text(encoding="utf-8")
    assert 'id="mixture' not in page

    few = write_sweep(tmp_path / "few", dirichlet(3))
    code, _, err = run_cli("report", few, "-o", tmp_path / "c.html")
    assert code == 0, err
    no_fit = section((tmp_path / "c.html").read_text(encoding="utf-8"), "p", "no-mixture")
    assert "3 finished runs are fewer than the 5" in no_fit

    line = one_line_error(run_cli, "report", few, "-o", tmp_path / "d.html", "--target", "a=")
    assert "--target a=: a's weight (none) is not a positive number" in line
