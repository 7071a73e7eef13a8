"""`llmtrain fit --compare BASELINE VARIANT` (fit_compare.py): ladders written as run directories
with losses drawn from known laws L = E + A/N^alpha + B/D^beta (Chinchilla's fitted values for
the baseline), the variant's law differing by a known amount. The sign of the predicted
difference follows the laws, its bootstrap interval excludes 0 for a clear difference and not for
the same law with other noise, the frontiers' crossing is found where the laws cross, the JSON
holds every number, every refusal is one line with exit 2, and `report --compare` draws both
fits."""

from __future__ import annotations

import base64
import html
import json
import math
import re

import numpy as np
import pytest
import yaml
from scipy import optimize

from llmtrain.ablate import fit

CHINCHILLA = (1.69, 406.4, 410.7, 0.34, 0.28)  # E, A, B, alpha, beta (Hoffmann et al. 2022)
LOWER_E = (1.64, *CHINCHILLA[1:])  # the variant 0.05 lower everywhere
# worse at small scale (A larger), better at large (E lower): the frontiers cross past the ladder
CROSSING = (1.59, 600.0, *CHINCHILLA[2:])
SIZES = (1e7, 4e7, 1.6e8, 6.4e8)
TOKENS = (1e9, 4e9, 1.6e10, 6.4e10)
BOOT = "40"


def write_run(root, name, n, d, loss, *, tokenizer="bytes", eval_path="/data/held-out.zarr"):
    """A finished run as training writes one: config.yaml (tokenizer, held-out set),
    metrics.jsonl (train lines, then the final eval line), summary.json with the parameter
    counts, tokens and flops_per_token = 6 N (so C = 6 N D)."""
    path = root / name
    path.mkdir(parents=True)
    config = {
        "name": name,
        "model": {"kind": "tiny"},
        "data": {
            "tokenizer": tokenizer,
            "seq_len": 32,
            "train": [{"path": "/data/train.zarr", "weight": 1.0}],
            "eval": {"path": eval_path},
        },
    }
    (path / "config.yaml").write_text("# provenance\n" + yaml.safe_dump(config))
    lines = [
        {"step": 1, "loss": loss + 1.0, "tokens": d / 2},
        {"step": 2, "loss": loss + 0.1, "tokens": d},
        {"step": 2, "eval_loss": loss},
    ]
    (path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    summary = {
        "status": "finished",
        "tokens": d,
        "params": n + 1000,
        "non_embedding_params": n,
        "flops_per_token": 6 * n,
    }
    (path / "summary.json").write_text(json.dumps(summary))
    return path


def write_ladder(root, law, *, noise=0.0, seed=0, sizes=SIZES, tokens=TOKENS, **run_options):
    """One run per (N, D) of the grid, its eval loss on `law` times lognormal noise of
    `noise` (relative)."""
    rng = np.random.default_rng(seed)
    for i, n in enumerate(sizes):
        for j, d in enumerate(tokens):
            loss = float(fit.chinchilla_loss(n, d, law)) * math.exp(rng.normal(0.0, noise))
            write_run(root, f"n{i}-d{j}", n, d, loss, **run_options)
    return root


@pytest.fixture(scope="module")
def ladders(tmp_path_factory):
    root = tmp_path_factory.mktemp("ladders")
    return {
        "base": write_ladder(root / "base", CHINCHILLA, noise=0.002, seed=1),
        "lower": write_ladder(root / "lower", LOWER_E, noise=0.002, seed=2),
        "same": write_ladder(root / "same", CHINCHILLA, noise=0.002, seed=3),
        "exact": write_ladder(root / "exact", CHINCHILLA),
        "crossing": write_ladder(root / "crossing", CROSSING),
    }


def frontier_gap(log_c):
    compute = np.exp(log_c)
    return (
        fit.compute_optimal(CROSSING, compute, 6.0).loss
        - fit.compute_optimal(CHINCHILLA, compute, 6.0).loss
    )


def compare_json(run_cli, baseline, variant, *predict, extra=()):
    argv = ["fit", "--compare", baseline, variant, "--bootstrap", BOOT, "--json", *extra]
    for target in predict:
        argv += ["--predict", target]
    code, out, err = run_cli(*argv)
    assert code == 0, err
    return json.loads(out)


# --- the compute-optimal frontier ---


def test_compute_optimal_is_the_law_lowest_on_the_budget():
    g = (0.34 * 406.4 / (0.28 * 410.7)) ** (1 / 0.62)
    for compute in (1e18, 1e21, 1e24):
        best = fit.compute_optimal(CHINCHILLA, compute, 6.0)
        assert best.n == pytest.approx(g * (compute / 6) ** (0.28 / 0.62), rel=1e-9)
        assert 6 * best.n * best.d == pytest.approx(compute, rel=1e-9)
        assert best.loss == pytest.approx(fit.chinchilla_loss(best.n, best.d, CHINCHILLA))
        # any other split of the budget is worse
        for factor in (0.8, 1.25):
            n = best.n * factor
            assert fit.chinchilla_loss(n, compute / (6 * n), CHINCHILLA) > best.loss
    # rows of laws against an array of budgets; a law with alpha <= 0 has no optimum
    rows = np.array([CHINCHILLA, LOWER_E, (1.0, 1.0, 1.0, -0.1, 0.2)])
    frontier = fit.compute_optimal(rows, np.array([1e20, 1e22]), 6.0)
    assert frontier.loss.shape == (3, 2)
    assert frontier.loss[1] == pytest.approx(frontier.loss[0] - 0.05)
    assert np.isnan(frontier.loss[2]).all()


# --- the command ---


def test_a_lower_variant_is_lower_beyond_the_interval(ladders, run_cli):
    report = compare_json(
        run_cli, ladders["base"], ladders["lower"], "N=1e9,D=1e11", "C=1e22", extra=["--seed", "3"]
    )
    at_nd, at_c = report["predictions"]
    for row in (at_nd, at_c):
        value, low, high = row["difference"]
        assert value == pytest.approx(-0.05, abs=0.02)
        assert low <= value <= high < 0
        assert row["excludes_zero"] is True and row["lower"] == "variant"
        assert row["draws"] == int(BOOT)
        for side in ("baseline", "variant"):
            loss, loss_low, loss_high = row[side]["loss"]
            assert loss_low <= loss <= loss_high
        assert row["variant"]["loss"][0] - row["baseline"]["loss"][0] == pytest.approx(value)
    truth = float(fit.chinchilla_loss(1e9, 1e11, CHINCHILLA))
    assert at_nd["baseline"]["loss"][0] == pytest.approx(truth, rel=0.01)
    assert (at_nd["baseline"]["n"], at_nd["baseline"]["d"]) == (1e9, 1e11)
    # C=: each fit's own compute-optimal N and D, on the budget
    for side in ("baseline", "variant"):
        assert 6 * at_c[side]["n"] * at_c[side]["d"] == pytest.approx(1e22, rel=1e-9)
    truth = float(fit.compute_optimal(CHINCHILLA, 1e22, 6.0).loss)
    assert at_c["baseline"]["loss"][0] == pytest.approx(truth, rel=0.02)
    frontier = report["frontier"]
    assert frontier["crossings"] == []
    assert frontier["lower_at_low"] == frontier["lower_at_high"] == "variant"
    assert frontier["range"] == pytest.approx([6 * 1e7 * 1e9, 1e4 * 6 * 6.4e8 * 6.4e10])
    # the difference's interval excludes 0 all along
    (segment,) = frontier["segments"]
    assert segment["lower"] == "variant"
    assert [segment["low"], segment["high"]] == pytest.approx(frontier["range"])
    # swapped: the same difference with the other sign
    swapped = compare_json(run_cli, ladders["lower"], ladders["base"], "N=1e9,D=1e11")
    value, low, high = swapped["predictions"][0]["difference"]
    assert value == pytest.approx(-at_nd["difference"][0], abs=1e-9)
    assert 0 < low <= value <= high


def test_the_same_law_with_other_noise_is_within_the_interval(ladders, run_cli):
    report = compare_json(run_cli, ladders["base"], ladders["same"], "N=1e9,D=1e11", "C=1e22")
    for row in report["predictions"]:
        value, low, high = row["difference"]
        assert low < 0 < high, row
        assert abs(value) < 0.02
        assert row["excludes_zero"] is False
    # nowhere along the frontiers can the ladders tell the two apart
    (segment,) = report["frontier"]["segments"]
    assert segment["lower"] is None


def test_the_frontiers_cross_where_the_laws_do(ladders, run_cli, tmp_path):
    truth = math.exp(optimize.brentq(frontier_gap, math.log(1e16), math.log(1e26)))
    assert 1e21 < truth < 1e22  # past the ladder's largest rung (2.5e20), within 1e4 x it
    report = compare_json(run_cli, ladders["exact"], ladders["crossing"], "C=1e23")
    (crossing,) = report["frontier"]["crossings"]
    assert crossing["compute"] == pytest.approx(truth, rel=0.01)
    assert crossing["lower_above"] == "variant"
    assert crossing["loss"] == pytest.approx(
        float(fit.compute_optimal(CHINCHILLA, truth, 6.0).loss), rel=1e-3
    )
    assert report["frontier"]["lower_at_low"] == "baseline"
    assert report["frontier"]["lower_at_high"] == "variant"
    # exact losses: every refit is the law, the interval is the curve, and it changes side there
    below, above = report["frontier"]["segments"]
    assert (below["lower"], above["lower"]) == ("baseline", "variant")
    assert below["high"] == above["low"] == pytest.approx(truth, rel=0.05)
    # the text says it
    code, out, err = run_cli(
        "fit",
        "--compare",
        ladders["exact"],
        ladders["crossing"],
        "--predict",
        "C=1e23",
        "--bootstrap",
        "4",
        "--plot",
        tmp_path / "compare.png",
    )
    assert code == 0, err
    assert f"the curves cross at C = {truth:.3g}" in out
    assert "the baseline is lower below it, the variant above it" in out
    assert (tmp_path / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_text_and_the_json(ladders, run_cli, tmp_path):
    out_file = tmp_path / "compare.json"
    code, out, err = run_cli(
        "fit",
        "--compare",
        ladders["base"],
        ladders["lower"],
        "--predict",
        "N=1e9,D=1e11",
        "--predict",
        "C=1e22",
        "--bootstrap",
        BOOT,
        "-o",
        out_file,
    )
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("variant against baseline across scale: final eval_loss")
    assert f"{BOOT} bootstrap refits of each ladder" in lines[0]
    assert lines[1].split()[:5] == ["ladder", "path", "runs", "fit", "C"]
    assert lines[3].split()[:3] == ["baseline", str(ladders["base"]), "16"]
    assert lines[4].split()[:3] == ["variant", str(ladders["lower"]), "16"]
    assert "6 N D" in lines[3]
    table = next(i for i, line in enumerate(lines) if line.startswith("at "))
    assert "variant - baseline (95%)" in lines[table] and "excludes 0" in lines[table]
    assert lines[table + 2].startswith("N=1e+09,D=1e+11") and lines[table + 2].endswith("yes")
    assert lines[table + 3].startswith("C=1e+22")
    assert any(line.startswith("at C=1e+22: baseline N_opt") for line in lines)
    verdicts = [line for line in lines if line.startswith("At ")]
    assert len(verdicts) == 2
    assert "the variant's predicted eval_loss is lower than the baseline's by 0.0" in verdicts[0]
    assert "the interval excludes 0, the variant is lower there." in verdicts[0]
    frontier = next(line for line in lines if line.startswith("Along the compute-optimal"))
    assert "the curves do not cross; the variant is lower throughout." in frontier
    assert frontier.endswith(
        "The 95% interval of the difference excludes 0 with the variant lower over the whole range."
    )

    report = json.loads(out_file.read_text())
    assert set(report) == {
        "loss",
        "params",
        "confidence",
        "n_boot",
        "baseline",
        "variant",
        "predictions",
        "frontier",
        "warnings",
    }
    assert (report["loss"], report["params"], report["confidence"]) == (
        "eval_loss",
        "non_embedding",
        0.95,
    )
    assert report["n_boot"] == int(BOOT)
    for side, seed in (("baseline", 0), ("variant", 1)):  # independent resamplings
        ladder = report[side]
        assert set(ladder) == {"path", "seed", "flops_per_token_per_param", "runs", "parametric"}
        assert ladder["seed"] == seed
        assert ladder["flops_per_token_per_param"] == pytest.approx(6.0)
        assert ladder["parametric"]["n_boot"] == int(BOOT)
        assert set(ladder["parametric"]["params"]) == set(fit.PARAMETERS)
        assert len(ladder["runs"]) == 16
    assert report["variant"]["parametric"]["params"]["E"] == pytest.approx(1.64, abs=0.05)
    row = report["predictions"][1]
    assert set(row) == {
        "target",
        "baseline",
        "variant",
        "difference",
        "excludes_zero",
        "lower",
        "draws",
    }
    assert row["target"] == "C=1e+22"
    assert set(row["baseline"]) == {"n", "d", "loss"} and len(row["baseline"]["loss"]) == 3
    assert set(report["frontier"]) == {
        "range",
        "crossings",
        "lower_at_low",
        "lower_at_high",
        "segments",
        "note",
    }
    # --json prints what -o writes
    again = compare_json(run_cli, ladders["base"], ladders["lower"], "N=1e9,D=1e11", "C=1e22")
    assert again == report


def test_bad_requests_are_one_line_and_exit_2(ladders, run_cli, tmp_path):
    base, lower = ladders["base"], ladders["lower"]
    other_tokenizer = write_ladder(tmp_path / "gpt2", LOWER_E, tokenizer="gpt2")
    other_data = write_ladder(tmp_path / "other-data", LOWER_E, eval_path="/data/other.zarr")
    few = write_ladder(tmp_path / "few", LOWER_E, sizes=SIZES[:2], tokens=TOKENS[:2])
    train_only = write_ladder(tmp_path / "train-only", LOWER_E)
    for metrics in train_only.glob("*/metrics.jsonl"):  # no eval line: train loss only
        metrics.write_text("".join(metrics.read_text().splitlines(keepends=True)[:2]))
    cases = [
        ((base,), "--compare takes two sweeps, BASELINE then VARIANT; got 1"),
        (
            (base, lower, ladders["same"]),
            "--compare takes two sweeps, BASELINE then VARIANT; got 3",
        ),
        ((base, base), "the baseline and the variant are the same directory"),
        ((base, base / "n0-d0", "--predict", "C=1e22"), "runs in both ladders (n0-d0)"),
        ((base, lower, "--mixture"), "--compare with --mixture"),
        ((base, lower, "--isoflop"), "--compare with --isoflop"),
        ((base, lower, "--predict", "C=1e22", "--bootstrap", "0"), "--bootstrap 0"),
        ((base, lower), "--compare needs --predict"),
        ((base, lower, "--predict", "N=1e9"), "--predict N=1e9: give N and D together"),
        ((base, lower, "--predict", "C=lots"), "--predict C=lots: give N=<params>,D=<tokens>"),
        (
            (base, other_tokenizer, "--predict", "C=1e22"),
            "the baseline's runs use the tokenizer bytes, the variant's gpt2",
        ),
        (
            (base, other_data, "--predict", "C=1e22"),
            "the baseline's eval_loss is measured on held-out set /data/held-out.zarr, the "
            "variant's on held-out set /data/other.zarr",
        ),
        ((base, few, "--predict", "C=1e22"), f"the variant {few}: 4 runs"),
        ((few, base, "--predict", "C=1e22"), f"the baseline {few}: 4 runs"),
        (
            (base, train_only, "--predict", "C=1e22"),
            f"the variant {train_only}: runs that logged no eval_loss",
        ),
    ]
    for argv, message in cases:
        code, out, err = run_cli("fit", "--compare", *argv)
        assert code == 2, (argv, err)
        assert out == ""
        assert len(err.strip().splitlines()) == 1, err
        assert err.startswith("error: ") and message in err, (message, err)
    # the train loss is measured on the training data, the same in both: comparable
    report = compare_json(run_cli, base, train_only, "C=1e22", extra=["--loss", "loss"])
    assert report["loss"] == "loss"


def test_without_bootstrap_draws_there_is_no_interval():
    """A fit whose every refit failed has no draws: its difference has no interval."""
    from llmtrain.ablate.fit_command import Target
    from llmtrain.ablate.fit_compare import Predicted, difference

    empty = np.zeros(0)
    diff = difference(
        Target(n=1e9, d=1e11), Predicted(1e9, 1e11, 2.0, empty), Predicted(1e9, 1e11, 1.9, empty)
    )
    assert diff.value == pytest.approx(-0.1)
    assert math.isnan(diff.low) and diff.excludes_zero is None and diff.draws == 0


# --- report --compare ---


def section_of(page, element, css_id):
    found = re.search(rf'<{element} id="{css_id}"[^>]*>(.*?)</{element}>', page, re.S)
    assert found, f"no {element}#{css_id}"
    return found.group(1)


def test_the_report_draws_both_fits(ladders, run_cli, tmp_path):
    out = tmp_path / "report.html"
    base, crossing = ladders["exact"], ladders["crossing"]
    code, _, err = run_cli("report", "--compare", base, crossing, "-o", out, "--predict", "C=1e22")
    assert code == 0, err
    page = out.read_text(encoding="utf-8")
    assert "<script" not in page
    part = section_of(page, "section", "scale-compare")
    assert "Variant against baseline across scale" in part
    text = html.unescape(section_of(part, "pre", "scale-compare-text"))
    assert text.startswith("variant against baseline across scale: final eval_loss")
    # both fits, each with its parameters and intervals
    for side, path in (("baseline", base), ("variant", crossing)):
        assert f"\n{side} {path}:\nL(N, D) = E + A / N^alpha + B / D^beta: 16 runs" in text
    assert "the curves cross at C = " in text and "C=1e+22" in text
    found = re.search(
        r'<img id="scale-compare-plot" alt="[^"]*" src="data:image/png;base64,([^"]+)"', part
    )
    assert found and base64.b64decode(found.group(1)).startswith(b"\x89PNG")
    # its sentences open the verdict; the two ladders are not fitted together
    verdict = html.unescape(section_of(page, "section", "verdict"))
    assert "At C=1e+22 (each fit's compute-optimal N, D): the variant's predicted" in verdict
    assert "Along the compute-optimal frontier" in verdict
    assert 'id="fit"' not in page and "Scaling-law fits" not in page
    # both ladders' runs in the tables
    assert section_of(page, "table", "runs").count("<tr>") == 1 + 32


def test_the_report_refuses_what_fit_compare_refuses(ladders, run_cli, tmp_path):
    out = tmp_path / "report.html"
    base = ladders["base"]
    for argv, message in (
        ((base,), "--compare takes two sweeps, BASELINE then VARIANT; got 1"),
        ((base, base), "the baseline and the variant are the same directory"),
    ):
        code, _, err = run_cli("report", "--compare", *argv, "-o", out)
        assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, err
        assert not out.exists()
    # ladders that cannot be compared: the page says why, as for a sweep the fit refuses
    other_data = write_ladder(tmp_path / "other-data", LOWER_E, eval_path="/data/other.zarr")
    code, _, err = run_cli("report", "--compare", base, other_data, "-o", out)
    assert code == 0, err
    reason = html.unescape(section_of(out.read_text(encoding="utf-8"), "p", "no-scale-compare"))
    assert "No comparison: the baseline's eval_loss is measured on held-out set" in reason


def test_huge_interval_ends_are_written_in_scientific_notation():
    """A degenerate refit's loss far off the scale is `1.73e+07`, not `17346265.4749`."""
    from llmtrain.ablate.fit_compare import _with_interval

    assert _with_interval(0.527, 0.1774, 17346265.4749) == "0.5270 (0.1774 - 1.73e+07)"
    shown = _with_interval(-0.3677, -0.7429, 4.339e32, signed=True)
    assert shown == "-0.3677 (-0.7429 - +4.34e+32)"
    assert _with_interval(0.9, math.nan, math.nan) == "0.9000"


def test_compare_warns_where_a_ladders_fit_cannot_be_trusted(tmp_path, run_cli):
    """Two ladders of 6 runs (3 sizes x 2 token counts) each: 5 parameters from 6 points, beta
    from 2 token counts, and a prediction 100x past the largest model: said in the text (last)
    and the JSON's `warnings`, each named by its ladder."""
    for name, shift in (("base", 0.0), ("lower", -0.05)):
        root = tmp_path / name
        for i, n in enumerate((1e7, 4e7, 1.6e8)):
            for j, d in enumerate((1e9, 1e10)):
                loss = float(fit.chinchilla_loss(n, d, CHINCHILLA)) + shift
                write_run(root, f"{name}-n{i}-d{j}", n, d, loss)
    args = ["fit", "--compare", tmp_path / "base", tmp_path / "lower"]
    args += ["--predict", "N=1.6e10,D=1e10", "--bootstrap", "20"]
    code, out, err = run_cli(*args, "--json")
    assert code == 0, err
    warnings = json.loads(out)["warnings"]
    assert all(isinstance(w, str) for w in warnings)
    for side in ("baseline", "variant"):
        said = [w for w in warnings if w.startswith(f"{side}: ")]
        assert f"{side}: 6 runs for 5 parameters (fewer than 3 per parameter, 15)" in said[0]
        assert any("2 distinct token counts D: beta is not identified" in w for w in said)
        assert any("predict N=1.6e+10,D=1e+10: N=1.6e+10 is 100x beyond" in w for w in said)
    code, out, err = run_cli(*args)
    assert code == 0, err
    assert out.splitlines()[-len(warnings) :] == [f"warning: {w}" for w in warnings]
