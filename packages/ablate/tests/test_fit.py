"""Scaling-law fits (`llmtrain.ablate.fit`) and `llmtrain fit`: losses drawn from a known law
L = E + A/N^alpha + B/D^beta (Chinchilla's fitted values) are fitted back, exactly without
noise and within the bootstrap intervals with it; IsoFLOP optima match the law's analytic optimum
and the exponents b/(alpha+beta), alpha/(alpha+beta); every bad input is refused by name; and the
command reads fake run directories, prints the tables, writes JSON and a plot."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
import yaml

from llmtrain.ablate import fit
from llmtrain.core_mesh.errors import UserError

CHINCHILLA = (1.69, 406.4, 410.7, 0.34, 0.28)  # E, A, B, alpha, beta (Hoffmann et al. 2022)
ALPHA, BETA = CHINCHILLA[3], CHINCHILLA[4]
SIZES = np.geomspace(1e7, 3e9, 5)
TOKENS = np.geomspace(1e9, 3e11, 5)
BUDGETS = (1e18, 1e19, 1e20, 1e21)


def chinchilla_n_opt(compute, params):
    """The law's analytic optimum, what the fits are checked against: the N that minimises
    E + A/N^alpha + B/D^beta on C = 6ND is G (C/6)^(beta/(alpha+beta)), with
    G = (alpha A / (beta B))^(1/(alpha+beta))."""
    _, big_a, big_b, alpha, beta = params
    g = (alpha * big_a / (beta * big_b)) ** (1 / (alpha + beta))
    return g * (compute / 6) ** (beta / (alpha + beta))


def grid(sizes=SIZES, tokens=TOKENS):
    n, d = np.meshgrid(sizes, tokens)
    return n.ravel(), d.ravel()


def isoflop_points(budgets=BUDGETS, spread=4.0, sizes_per_budget=7):
    """Runs along each budget's IsoFLOP curve (D = C / 6N), sizes spread evenly in log N
    around the law's optimum: from N_opt / spread to N_opt * spread."""
    n, d, compute = [], [], []
    for budget in budgets:
        n_opt = chinchilla_n_opt(budget, CHINCHILLA)
        for size in n_opt * np.geomspace(1 / spread, spread, sizes_per_budget):
            n.append(size)
            d.append(budget / (6 * size))
            compute.append(budget)
    return np.array(n), np.array(d), np.array(compute)


# --- the parametric fit ---


def test_parametric_fit_recovers_the_law_exactly_without_noise():
    n, d = grid()
    result = fit.fit_parametric(n, d, fit.chinchilla_loss(n, d, CHINCHILLA), n_boot=0)
    assert result.n_points == 25
    assert list(result.params.values()) == pytest.approx(CHINCHILLA, rel=1e-5)
    # no bootstrap: no intervals, and predictions say so
    assert all(math.isnan(i.low) for i in result.intervals.values())
    assert math.isnan(result.predict(1e10, 1e12).low)


def test_parametric_fit_with_noise_lies_within_its_bootstrap_intervals():
    n, d = grid(np.geomspace(1e7, 3e9, 6), np.geomspace(1e9, 3e11, 6))
    rng = np.random.default_rng(7)
    true_loss = fit.chinchilla_loss(n, d, CHINCHILLA)
    loss = true_loss * np.exp(rng.normal(0.0, 0.003, len(n)))  # 0.3% noise on each run's loss
    result = fit.fit_parametric(n, d, loss, n_boot=100, seed=0)
    assert result.bootstrap.shape == (100, 5)
    tolerance = {"E": 0.05, "A": 0.3, "B": 0.3, "alpha": 0.05, "beta": 0.05}  # relative
    for name, truth in zip(fit.PARAMETERS, CHINCHILLA, strict=True):
        assert truth in result.intervals[name], (name, result.intervals[name])
        assert getattr(result, name) == pytest.approx(truth, rel=tolerance[name])
        assert result.intervals[name].low < getattr(result, name) < result.intervals[name].high
    # an extrapolation 3x past the largest model and tokens: the truth within the interval
    target = fit.chinchilla_loss(1e10, 1e12, CHINCHILLA)
    predicted = result.predict(1e10, 1e12)
    assert predicted.low <= target <= predicted.high
    assert predicted.value == pytest.approx(target, rel=0.01)
    # arrays in, arrays out
    assert result.predict(np.array([1e8, 1e9]), np.array([1e10, 1e11])).value.shape == (2,)


def test_bootstrap_is_seeded():
    n, d = grid()
    loss = fit.chinchilla_loss(n, d, CHINCHILLA) * np.exp(
        np.random.default_rng(1).normal(0, 0.005, len(n))
    )
    first = fit.fit_parametric(n, d, loss, n_boot=8, seed=3)
    again = fit.fit_parametric(n, d, loss, n_boot=8, seed=3)
    other = fit.fit_parametric(n, d, loss, n_boot=8, seed=4)
    assert np.array_equal(first.bootstrap, again.bootstrap)
    assert not np.array_equal(first.bootstrap, other.bootstrap)


def test_parametric_fit_refuses_bad_points_by_name():
    n, d = grid()
    loss = fit.chinchilla_loss(n, d, CHINCHILLA)
    names = [f"run{i}" for i in range(len(n))]
    with pytest.raises(UserError, match=r"4 runs \(run0, run1, run2, run3\) are fewer than the 5"):
        fit.fit_parametric(n[:4], d[:4], loss[:4], names=names[:4], n_boot=0)
    same_size = n == n[0]
    with pytest.raises(UserError, match="same model size N=1e\\+07 \\(run0, run5"):
        fit.fit_parametric(
            n[same_size],
            d[same_size],
            loss[same_size],
            names=[x for x, s in zip(names, same_size, strict=True) if s],
            n_boot=0,
        )
    same_tokens = d == d[0]
    with pytest.raises(UserError, match="same number of tokens D=1e\\+09 \\(run0, run1"):
        fit.fit_parametric(
            n[same_tokens],
            d[same_tokens],
            loss[same_tokens],
            n_boot=0,
            names=[x for x, s in zip(names, same_tokens, strict=True) if s],
        )
    broken = loss.copy()
    broken[[3, 7]] = [np.nan, np.inf]
    with pytest.raises(UserError, match=r"NaN or inf loss .*: run3, run7;"):
        fit.fit_parametric(n, d, broken, names=names, n_boot=0)


def test_a_fit_that_does_not_converge_is_an_error(monkeypatch):
    n, d = grid()
    real = fit.optimize.minimize

    def never_converges(*args, **kwargs):
        result = real(*args, **kwargs)
        result.success = False
        return result

    monkeypatch.setattr(fit.optimize, "minimize", never_converges)
    with pytest.raises(UserError, match="did not converge from any starting point"):
        fit.fit_parametric(n, d, fit.chinchilla_loss(n, d, CHINCHILLA), n_boot=0)


# --- IsoFLOP profiles ---


def test_budgets_group_runs_within_the_tolerance():
    groups = fit.group_budgets([1.0e18, 1.03e18, 1e19, 0.99e18 * 1.04, 1.02e19, 1e20])
    assert [sorted(g.tolist()) for g in groups] == [[0, 1, 3], [2, 4], [5]]
    assert len(fit.group_budgets([1.0, 1.1, 1.2], tolerance=0.25)) == 1


def test_isoflop_recovers_the_analytic_optimum_and_exponents():
    n, d, compute = isoflop_points()
    result = fit.fit_isoflop(n, d, fit.chinchilla_loss(n, d, CHINCHILLA), compute)
    assert [b.rejected for b in result.budgets] == [None] * 4
    for budget, c in zip(result.budgets, BUDGETS, strict=True):
        n_opt = chinchilla_n_opt(c, CHINCHILLA)
        # a parabola in log N is not the true curve: its vertex sits ~1% off for a 4x spread
        assert budget.n_opt == pytest.approx(n_opt, rel=0.02)
        assert budget.d_opt == pytest.approx(c / (6 * budget.n_opt), rel=1e-9)
        assert budget.loss_opt == pytest.approx(
            fit.chinchilla_loss(n_opt, c / (6 * n_opt), CHINCHILLA), rel=1e-3
        )
    assert result.n_opt.exponent == pytest.approx(BETA / (ALPHA + BETA), abs=1e-3)
    assert result.d_opt.exponent == pytest.approx(ALPHA / (ALPHA + BETA), abs=1e-3)
    n_pred, d_pred = result.predict(1e23)
    assert n_pred.value == pytest.approx(chinchilla_n_opt(1e23, CHINCHILLA), rel=0.03)
    assert n_pred.value * d_pred.value * 6 == pytest.approx(1e23, rel=1e-6)


def test_isoflop_d_opt_uses_the_runs_flops_per_token():
    """With C = k N D (k = flops_per_token / N, here 8 instead of 6), D_opt = C / (k N_opt)."""
    n, d, compute = isoflop_points(budgets=(1e18, 1e19, 1e20))
    result = fit.fit_isoflop(n, d, fit.chinchilla_loss(n, d, CHINCHILLA), compute * 8 / 6)
    for budget in result.budgets:
        assert budget.d_opt == pytest.approx(budget.compute / (8 * budget.n_opt), rel=1e-9)


def test_isoflop_exponent_intervals_with_noise():
    n, d, compute = isoflop_points(
        budgets=(1e18, 1e19, 1e20, 1e21, 1e22), spread=8.0, sizes_per_budget=9
    )
    rng = np.random.default_rng(2)
    loss = fit.chinchilla_loss(n, d, CHINCHILLA) * np.exp(rng.normal(0, 0.002, len(n)))
    result = fit.fit_isoflop(n, d, loss, compute)
    exponent = BETA / (ALPHA + BETA)
    assert exponent in result.n_opt.exponent_interval
    assert result.n_opt.exponent == pytest.approx(exponent, abs=0.03)
    assert 0 < result.n_opt.exponent_stderr < 0.03
    n_pred, _ = result.predict(1e24)
    assert n_pred.low < n_pred.value < n_pred.high


def test_isoflop_leaves_out_budgets_without_an_optimum_inside_them():
    n, d, compute = isoflop_points(budgets=(1e18, 1e19, 1e20))
    loss = fit.chinchilla_loss(n, d, CHINCHILLA)
    # the 1e20 budget's runs only below its optimum: the vertex falls outside their sizes
    low_side = (compute < 1e20) | (n < chinchilla_n_opt(1e20, CHINCHILLA) / 1.5)
    result = fit.fit_isoflop(n[low_side], d[low_side], loss[low_side], compute[low_side])
    assert [b.rejected is None for b in result.budgets] == [True, True, False]
    assert "outside the sizes run" in result.budgets[2].rejected
    assert result.n_opt.exponent_interval is None  # two budgets: no residual, no interval
    assert result.n_opt.exponent == pytest.approx(BETA / (ALPHA + BETA), abs=2e-3)


def test_isoflop_refuses_a_single_usable_budget_by_name():
    n, d, compute = isoflop_points(budgets=(1e18, 1e19))
    names = [f"c{int(math.log10(c))}-{i % 7}" for i, c in enumerate(compute)]
    loss = fit.chinchilla_loss(n, d, CHINCHILLA)
    one = compute == 1e18
    with pytest.raises(UserError, match=r"at least 2 compute budgets.* 1 budget\(s\) found"):
        fit.fit_isoflop(
            n[one],
            d[one],
            loss[one],
            compute[one],
            names=[x for x, o in zip(names, one, strict=True) if o],
        )
    # the 1e19 budget with two sizes only: named with its reason
    keep = one | np.isin(np.arange(len(n)), [7, 8])
    with pytest.raises(UserError, match=r"C=1e\+19 \(c19-0, c19-1\): 2 model sizes \(needs 3\)"):
        fit.fit_isoflop(
            n[keep],
            d[keep],
            loss[keep],
            compute[keep],
            names=[x for x, k in zip(names, keep, strict=True) if k],
        )
    downward = loss.copy()
    downward[7:] = 5.0 - (np.log(n[7:]) - np.log(n[10])) ** 2
    with pytest.raises(UserError, match="opens downward"):
        fit.fit_isoflop(n, d, downward, compute, names=names)


# --- `llmtrain fit` on run directories ---


def write_run(
    root,
    name,
    n,
    d,
    loss,
    *,
    status="finished",
    tokenizer="bytes",
    summary_extra=None,
    summary=True,
    train_loss=None,
):
    """A run as training writes one: config.yaml, metrics.jsonl (a train line and an eval line
    at the end), summary.json with params (embeddings: 1000 more), non_embedding_params,
    tokens and flops_per_token = 6 N (so C = 6 N D)."""
    path = root / name
    path.mkdir(parents=True)
    config = {
        "name": name,
        "model": {"kind": "tiny"},
        "data": {"tokenizer": tokenizer, "seq_len": 32},
    }
    (path / "config.yaml").write_text("# provenance\n" + yaml.safe_dump(config))
    train_loss = loss + 0.1 if train_loss is None else train_loss
    lines = [
        {"step": 1, "loss": loss + 1.0, "tokens": d / 2},
        {"step": 2, "loss": train_loss, "tokens": d},
        {"step": 2, "eval_loss": loss},
    ]
    (path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    if summary:
        content = {
            "status": status,
            "tokens": d,
            "params": n + 1000,
            "non_embedding_params": n,
            "flops_per_token": 6 * n,
        }
        content.update(summary_extra or {})
        (path / "summary.json").write_text(json.dumps(content))
    return path


def write_grid_sweep(root, sizes=(1e7, 4e7, 1.6e8, 6.4e8), tokens=(1e9, 4e9, 1.6e10, 6.4e10)):
    for i, size in enumerate(sizes):
        for j, count in enumerate(tokens):
            loss = float(fit.chinchilla_loss(size, count, CHINCHILLA))
            write_run(root, f"n{i}-d{j}", size, count, loss)
    return root


def write_isoflop_sweep(root):
    n, d, compute = isoflop_points(budgets=(1e18, 1e19, 1e20))
    for i, (size, count) in enumerate(zip(n, d, strict=True)):
        loss = float(fit.chinchilla_loss(size, count, CHINCHILLA))
        write_run(root, f"c{int(math.log10(compute[i]))}-{i % 7}", size, count, loss)
    return root


def test_fit_command_prints_writes_json_and_plots(tmp_path, run_cli):
    sweep = write_grid_sweep(tmp_path / "sweep")
    code, out, err = run_cli(
        "fit", sweep, "--bootstrap", "10", "--predict", "N=1e9,D=2e11", "-o", tmp_path / "fit.json"
    )
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("L(N, D) = E + A / N^alpha + B / D^beta: 16 runs, N = non_embedding")
    assert lines[1].split() == ["param", "value", "95%", "interval"]
    rows = {line.split()[0]: line.split() for line in lines[3:8]}
    assert list(rows) == ["E", "A", "B", "alpha", "beta"]
    assert float(rows["E"][1]) == pytest.approx(1.69, rel=1e-3)
    assert float(rows["alpha"][1]) == pytest.approx(0.34, rel=1e-3)
    assert "N=1e+09,D=2e+11" in out
    report = json.loads((tmp_path / "fit.json").read_text())
    assert report["parametric"]["n_points"] == 16 and report["parametric"]["n_boot"] == 10
    fitted = [report["parametric"]["params"][k] for k in fit.PARAMETERS]
    assert fitted == pytest.approx(CHINCHILLA, rel=1e-4)
    # losses exactly on the law: every resample refits the same law, the interval collapses
    assert report["parametric"]["intervals"]["beta"] == pytest.approx([0.28, 0.28], abs=1e-6)
    (prediction,) = report["predictions"]
    truth = float(fit.chinchilla_loss(1e9, 2e11, CHINCHILLA))
    assert prediction["loss"][0] == pytest.approx(truth, rel=1e-4)
    assert prediction["loss"][1:] == pytest.approx([truth, truth], rel=1e-4)
    assert {r["name"] for r in report["runs"]} == {f"n{i}-d{j}" for i in range(4) for j in range(4)}
    assert report["runs"][0]["compute"] == pytest.approx(6 * 1e7 * 1e9)
    # --json prints what -o writes
    code, out, err = run_cli(
        "fit", sweep, "--bootstrap", "10", "--predict", "N=1e9,D=2e11", "--json"
    )
    assert code == 0, err
    assert json.loads(out) == report

    code, _, err = run_cli(
        "fit",
        sweep,
        "--bootstrap",
        "4",
        "--predict",
        "N=1e9,D=2e11",
        "--plot",
        tmp_path / "fit.png",
    )
    assert code == 0, err
    assert (tmp_path / "fit.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "fit.png").stat().st_size > 10_000


def test_fit_command_isoflop_predicts_compute_optimal_n_and_d(tmp_path, run_cli):
    sweep = write_isoflop_sweep(tmp_path / "iso")
    code, out, err = run_cli(
        "fit",
        sweep,
        "--isoflop",
        "--bootstrap",
        "0",
        "--predict",
        "C=1e22",
        "-o",
        tmp_path / "iso.json",
        "--plot",
        tmp_path / "iso.svg",
    )
    assert code == 0, err
    assert "IsoFLOP profiles" in out
    budget_rows = [
        line.split() for line in out.splitlines() if line.startswith(("1e+18", "1e+19", "1e+20"))
    ]
    assert [row[:2] for row in budget_rows] == [["1e+18", "7"], ["1e+19", "7"], ["1e+20", "7"]]
    assert "N_opt = " in out and "D_opt = " in out
    report = json.loads((tmp_path / "iso.json").read_text())
    budgets = report["isoflop"]["budgets"]
    for budget in budgets:
        assert budget["n_opt"] == pytest.approx(
            chinchilla_n_opt(budget["compute"], CHINCHILLA), rel=0.02
        )
    assert report["isoflop"]["n_opt"]["exponent"] == pytest.approx(BETA / (ALPHA + BETA), abs=1e-3)
    (prediction,) = report["predictions"]
    assert prediction["target"] == "C=1e+22"
    assert prediction["n_opt"][0] == pytest.approx(chinchilla_n_opt(1e22, CHINCHILLA), rel=0.03)
    assert prediction["n"] * prediction["d"] * 6 == pytest.approx(1e22, rel=1e-6)

    assert (tmp_path / "iso.svg").read_text().lstrip().startswith("<?xml")


def test_fit_command_chooses_the_loss_and_the_parameter_count(tmp_path, run_cli):
    sweep = tmp_path / "sweep"
    for i, size in enumerate((1e7, 4e7, 1.6e8)):
        for j, count in enumerate((1e9, 4e9, 1.6e10)):
            # eval loss useless, train loss from the law on N counted with the embeddings
            train_loss = float(fit.chinchilla_loss(size + 1000, count, CHINCHILLA))
            write_run(sweep, f"n{i}-d{j}", size, count, 9.0, train_loss=train_loss)
    code, _, err = run_cli(
        "fit",
        sweep,
        "--loss",
        "loss",
        "--params",
        "all",
        "--bootstrap",
        "0",
        "-o",
        tmp_path / "fit.json",
    )
    assert code == 0, err
    report = json.loads((tmp_path / "fit.json").read_text())
    assert [r["n"] for r in report["runs"][:3:2]] == [1e7 + 1000, 1e7 + 1000]
    fitted = [report["parametric"]["params"][k] for k in fit.PARAMETERS]
    assert fitted == pytest.approx(CHINCHILLA, rel=1e-3)
    assert report["parametric"]["intervals"]["E"] == [None, None]  # no bootstrap: no interval


def test_fit_command_refuses_bad_runs_by_name(tmp_path, run_cli):
    sweep = write_grid_sweep(tmp_path / "sweep", sizes=(1e7, 1e8, 1e9), tokens=(1e9, 1e10))
    write_run(sweep, "failed-run", 1e8, 3e9, 3.0, status="failed")
    write_run(sweep, "killed-run", 1e8, 3e9, 3.0, summary=False)
    code, _, err = run_cli("fit", sweep)
    assert code == 2
    assert "runs that did not finish: failed-run (failed), killed-run (incomplete)" in err
    assert "--include-unfinished" in err
    # included: the killed run has no summary.json to read N and D from
    code, _, err = run_cli("fit", sweep, "--include-unfinished", "--bootstrap", "0")
    assert code == 2 and "runs without summary.json: killed-run" in err
    (sweep / "killed-run" / "summary.json").write_text(
        json.dumps({"status": "running", "tokens": 3e9})
    )
    code, _, err = run_cli("fit", sweep, "--include-unfinished", "--bootstrap", "0")
    assert code == 2
    assert "summary.json of killed-run has no non_embedding_params" in err and "re-run" in err

    other = write_grid_sweep(tmp_path / "other", sizes=(1e7, 1e8), tokens=(1e9, 1e10, 1e11))
    write_run(other, "gpt2-run", 1e8, 3e9, 3.0, tokenizer="gpt2")
    code, _, err = run_cli("fit", other, "--bootstrap", "0")
    assert code == 2
    assert "2 tokenizers" in err and "bytes: n0-d0, n0-d1, n0-d2, n1-d0 and 2 more" in err
    assert "gpt2: gpt2-run" in err and "--allow-mixed-tokenizers" in err
    code, out, err = run_cli("fit", other, "--bootstrap", "0", "--allow-mixed-tokenizers")
    assert code == 0, err
    assert "7 runs" in out

    nan = write_grid_sweep(tmp_path / "nan", sizes=(1e7, 1e8), tokens=(1e9, 1e10, 1e11))
    write_run(nan, "diverged", 1e8, 3e9, float("nan"))
    code, _, err = run_cli("fit", nan, "--bootstrap", "0")
    assert code == 2 and "NaN or inf loss (diverged?): diverged;" in err

    few = write_grid_sweep(tmp_path / "few", sizes=(1e7, 1e8), tokens=(1e9, 1e10))
    code, _, err = run_cli("fit", few, "--bootstrap", "0")
    assert code == 2 and "4 runs (n0-d0, n0-d1, n1-d0, n1-d1) are fewer than the 5" in err
    code, _, err = run_cli("fit", few, "--predict", "C=1e20")
    assert code == 2 and "--isoflop" in err
    code, _, err = run_cli("fit", few, "--predict", "N=1e9")
    assert code == 2 and "N and D together" in err

    grid_sweep = write_grid_sweep(tmp_path / "grid", sizes=(1e7, 1e8, 1e9), tokens=(1e9, 1e10))
    code, _, err = run_cli("fit", grid_sweep, "--isoflop", "--bootstrap", "0")
    assert code == 2 and "at least 2 compute budgets" in err


def test_compute_is_flops_per_token_times_tokens_else_6nd(tmp_path):
    from llmtrain.ablate import runs
    from llmtrain.ablate.fit_command import read_points

    write_run(tmp_path, "counted", 1e8, 1e10, 3.0, summary_extra={"flops_per_token": 7.5e8})
    write_run(tmp_path, "older", 1e8, 1e10, 3.0, summary_extra={"flops_per_token": None})
    counted, older = read_points(runs.find_runs([tmp_path]), "eval_loss", "non_embedding")
    assert counted.compute == pytest.approx(7.5e8 * 1e10)
    assert older.compute == pytest.approx(6 * 1e8 * 1e10)
    assert (counted.n, counted.d, counted.loss) == (1e8, 1e10, 3.0)


def test_tokenizer_is_read_from_the_packed_dataset_when_the_config_has_none(tmp_path):
    from llmtrain.ablate import runs
    from llmtrain.ablate.fit_command import check_tokenizers, tokenizer_of

    paths = []
    for name, tokenizer in (("a", "bytes"), ("b", "gpt2")):
        data = tmp_path / f"{name}.zarr"
        data.mkdir()
        meta = {"tokenizer": {"name": tokenizer, "fingerprint": f"fp-{tokenizer}"}}
        (data / "zarr.json").write_text(json.dumps({"attributes": {"llmtrain": meta}}))
        run = tmp_path / "runs" / name
        run.mkdir(parents=True)
        config = {
            "name": name,
            "data": {"train": [{"path": str(data)}], "eval": {"path": str(data)}},
        }
        (run / "config.yaml").write_text(yaml.safe_dump(config))
        paths.append(run)
    found = runs.find_runs(paths)
    assert [tokenizer_of(r) for r in found] == ["bytes (fp-bytes)", "gpt2 (fp-gpt2)"]
    with pytest.raises(UserError, match=r"bytes \(fp-bytes\): a; gpt2 \(fp-gpt2\): b"):
        check_tokenizers(found, allow_mixed=False)
    check_tokenizers(found, allow_mixed=True)


def test_fit_runs_without_torch(tmp_path):
    """ablate never imports torch: `llmtrain fit` in a child where `import torch` fails. (Not
    by `sys.modules["torch"] = None`: scipy takes a `torch` key in sys.modules for the module.)"""
    sweep = write_grid_sweep(tmp_path / "sweep", sizes=(1e7, 1e8, 1e9), tokens=(1e9, 1e10))
    blocked = (
        "import sys\n"
        "class NoTorch:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'torch':\n"
        "            raise ImportError('torch is blocked')\n"
        "sys.meta_path.insert(0, NoTorch())\n"
        "from llmtrain.core_mesh.cli import main\n"
        "code = main(sys.argv[1:])\n"
        "assert 'torch' not in sys.modules\n"
        "sys.exit(code)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", blocked, "fit", str(sweep), "--bootstrap", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "6 runs" in proc.stdout


def test_fit_command_fits_a_named_eval_sets_loss(tmp_path, run_cli):
    """Runs with data.eval as a list log eval/<name>/loss: `--loss eval/web/loss` fits it."""
    sweep = tmp_path / "sweep"
    for i, size in enumerate((1e7, 4e7, 1.6e8)):
        for j, count in enumerate((1e9, 4e9, 1.6e10)):
            path = write_run(sweep, f"n{i}-d{j}", size, count, 9.0)  # eval_loss useless
            web = float(fit.chinchilla_loss(size, count, CHINCHILLA))
            with (path / "metrics.jsonl").open("a") as f:
                f.write(json.dumps({"step": 2, "eval/web/loss": web}) + "\n")
    out = tmp_path / "fit.json"
    code, _, err = run_cli("fit", sweep, "--loss", "eval/web/loss", "--bootstrap", "0", "-o", out)
    assert code == 0, err
    fitted = [json.loads(out.read_text())["parametric"]["params"][k] for k in fit.PARAMETERS]
    assert fitted == pytest.approx(CHINCHILLA, rel=1e-3)
    code, _, err = run_cli("fit", sweep, "--loss", "eval/web")  # argparse's, in one line
    assert code == 2 and err.startswith("error: llmtrain fit: argument --loss: 'eval/web'"), err


def test_fit_says_when_it_cannot_be_trusted(tmp_path, run_cli):
    """6 runs (2 sizes x 3 token counts) for 5 parameters: too few points, alpha from 2 sizes,
    and a prediction far beyond the runs: warnings last in the text and as a
    list of strings in --json. A well-posed grid of 16 runs has none."""
    root = tmp_path / "few"
    for i, n in enumerate((1e7, 4e7)):
        for j, d in enumerate((1e9, 4e9, 1.6e10)):
            write_run(root, f"n{i}-d{j}", n, d, float(fit.chinchilla_loss(n, d, CHINCHILLA)))
    args = ["fit", root, "--bootstrap", "20", "--predict", "N=4e9,D=1e13"]
    code, out, err = run_cli(*args, "--json")
    assert code == 0, err
    warnings = json.loads(out)["warnings"]
    assert all(isinstance(w, str) for w in warnings)
    assert warnings[0].startswith("6 runs for 5 parameters (fewer than 3 per parameter, 15)")
    assert any(w.startswith("2 distinct model sizes N: alpha is not identified") for w in warnings)
    far = [w for w in warnings if w.startswith("predict N=4e+09,D=1e+13: N=4e+09 is 100x beyond")]
    assert far and "D=1e+13 is 625x beyond the runs' D (1e+09 - 1.6e+10)" in far[0]
    code, out, err = run_cli(*args)
    assert code == 0, err
    assert out.splitlines()[-len(warnings) :] == [f"warning: {w}" for w in warnings]

    code, out, err = run_cli("fit", write_grid_sweep(tmp_path / "grid"), "--json")
    assert code == 0, err
    assert json.loads(out)["warnings"] == []


def test_trust_warnings_name_wide_intervals_and_implausible_exponents():
    from llmtrain.ablate.fit_command import RunPoint, trust_warnings

    n, d = grid()
    points = [
        RunPoint(f"r{i}", x, y, 6 * x * y, 3.0) for i, (x, y) in enumerate(zip(n, d, strict=True))
    ]
    wild = fit.ParametricFit(
        E=0.84,
        A=11.3,
        B=2.56e9,
        alpha=0.47,
        beta=2.02,
        intervals={
            "E": fit.Interval(1e-112, 0.95),
            "A": fit.Interval(5e-4, 2.7e9),
            "B": fit.Interval(6e4, 1.2e25),
            "alpha": fit.Interval(0.24, 48.4),
            "beta": fit.Interval(1.03, 5.29),
        },
        n_points=len(points),
        objective=0.0,
        bootstrap=np.zeros((0, 5)),
    )
    warnings = trust_warnings(points, wild, [("N=1e+08,D=1e+10", 1e8, 1e10, 0.8947)])
    assert warnings[0] == (
        "95% intervals spanning more than an order of magnitude (or unbounded): E 1e-112 - "
        "0.95; A 0.0005 - 2.7e+09; B 6e+04 - 1.2e+25; alpha 0.24 - 48.4: the runs do not pin "
        "these down"
    )
    assert warnings[1].startswith("implausible exponents (beta = 2.02; published fits lie within")
    assert warnings[2] == (
        "predict N=1e+08,D=1e+10: the floor E = 0.84 is 94% of the predicted 0.8947: the "
        "prediction says little beyond E"
    )
    assert len(warnings) == 3
