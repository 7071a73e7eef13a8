"""Confidence intervals over seeds, differences to a baseline (Welch's and paired t-tests) and
Holm's adjustment: the numbers against the textbook formulas on fixed values, and
`llmtrain compare --baseline` on hand-made runs."""

from __future__ import annotations

import csv
import math
import statistics

import pytest
from scipy import stats

from llmtrain.ablate import compare, runs
from llmtrain.ablate.baseline import compare_rows, find_baseline
from llmtrain.ablate.significance import difference, holm, mean_interval
from llmtrain.core_mesh.errors import UserError

A = [2.50, 2.52, 2.49, 2.51]
B = [2.60, 2.58, 2.61, 2.59]


def test_mean_interval_is_the_t_interval():
    low, high = mean_interval(A, 0.95)
    # mean 2.505, sample sd sqrt(5e-4 / 3), n 4: mean ± t(0.975, 3) sd / 2, t = 3.182446
    half = 3.182446305284263 * math.sqrt(5e-4 / 3) / 2
    assert low == pytest.approx(2.505 - half, abs=1e-9)
    assert high == pytest.approx(2.505 + half, abs=1e-9)
    assert mean_interval([1.0], 0.95) is None
    assert mean_interval([1.0, 1.0], 0.95) == (1.0, 1.0)


def test_welch_difference_by_the_formula():
    diff = difference(B, A, 0.95, paired=False)
    assert diff.test == "welch"
    # both variances 5e-4 / 3, n 4 each: se = sqrt(2 var / 4), Welch's df = 6
    var = 5e-4 / 3
    se = math.sqrt(var / 4 + var / 4)
    df = (var / 4 + var / 4) ** 2 / (2 * (var / 4) ** 2 / 3)
    assert df == pytest.approx(6.0)
    t = 0.09 / se
    assert diff.delta == pytest.approx(0.09)
    assert diff.p == pytest.approx(2 * stats.t.sf(t, df), rel=1e-9)
    half = stats.t.ppf(0.975, df) * se
    assert (diff.low, diff.high) == pytest.approx((0.09 - half, 0.09 + half), rel=1e-9)


def test_paired_difference_by_the_formula():
    after = [2.47, 2.485, 2.45, 2.475]  # A minus 0.03 to 0.04 on each seed: a steady gain
    diff = difference(after, A, 0.95, paired=True)
    gaps = [x - y for x, y in zip(after, A, strict=True)]
    se = statistics.stdev(gaps) / 2
    t = statistics.fmean(gaps) / se
    assert diff.test == "paired"
    assert diff.delta == pytest.approx(-0.035)
    assert diff.p == pytest.approx(2 * stats.t.sf(abs(t), 3), rel=1e-9)
    half = stats.t.ppf(0.975, 3) * se
    assert (diff.low, diff.high) == pytest.approx((-0.035 - half, -0.035 + half), rel=1e-9)
    # the same numbers unpaired: the seeds' spread hides the gain
    assert difference(after, A, 0.95, paired=False).p > 10 * diff.p
    assert difference([1.0], A, 0.95, paired=False) is None


def test_holm_by_hand():
    # sorted: 0.005 x 4 = 0.02, 0.01 x 3 = 0.03, 0.03 x 2 = 0.06, 0.04 x 1 = 0.04 -> 0.06 (the
    # running maximum keeps the order)
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.6, 0.5]) == pytest.approx([1.0, 1.0])
    assert holm([]) == []


def config(name, lr, seed):
    return {
        "name": name,
        "seed": seed,
        "run_dir": "/x",
        "model": {"kind": "tiny", "n_layers": 2},
        "optimizer": {"kind": "adamw", "lr": lr},
    }


# final eval losses per learning rate and seed: 3e-3 beats the baseline 1e-3 on every seed;
# 2e-3 is inside the seeds' noise
FINALS = {
    1e-3: [3.00, 3.10, 2.90],
    2e-3: [2.99, 3.12, 2.91],
    3e-3: [2.80, 2.91, 2.69],
}


@pytest.fixture
def lr_sweep(tmp_path, make_run):
    for lr, finals in FINALS.items():
        for seed, final in enumerate(finals):
            name = f"lr={lr:g},seed={seed}"
            summary = {"status": "finished", "tokens": 300}
            make_run(tmp_path, name, config(name, lr, seed), [4.0, final], [None, final], summary)
    return tmp_path


def test_compare_baseline_marks_what_is_beyond_seed_noise(lr_sweep, run_cli):
    code, out, err = run_cli("compare", lr_sweep, "--baseline", "lr=0.001")
    assert code == 0, err
    header, _, *lines = out.split("\n\n")[0].splitlines()  # the verdicts follow the table
    assert header.split()[-4:] == ["final_eval_loss", "diff", "p", "(holm)"]
    cells = {line.split()[0]: line for line in lines}
    assert cells["0.001"].split()[-1] == "baseline"
    # paired by seed: 3e-3 is 0.19 to 0.21 lower on every seed, 2e-3 is within the noise
    p_3 = stats.ttest_rel(FINALS[3e-3], FINALS[1e-3]).pvalue
    assert f"{-0.2:.4f}" in cells["0.003"]
    assert cells["0.003"].endswith(f"{2 * p_3:.4g} *")  # Holm: the smaller p of two x 2
    gaps = [x - y for x, y in zip(FINALS[2e-3], FINALS[1e-3], strict=True)]
    t = statistics.fmean(gaps) / (statistics.stdev(gaps) / math.sqrt(3))
    p_2 = 2 * stats.t.sf(abs(t), 2)
    assert cells["0.002"].endswith(f"{p_2:.4g} ns")  # the larger x 1 (above the smaller's x 2)


def test_compare_baseline_csv_holds_every_number(lr_sweep, run_cli, tmp_path):
    out = tmp_path / "x.csv"
    code, _, err = run_cli(
        "compare", lr_sweep, "--baseline", "lr=1e-3", "-o", out, "--alpha", "0.1"
    )
    assert code == 0, err
    table = {row["optimizer.lr"]: row for row in csv.DictReader(out.open())}
    assert table["0.001"]["test"] == "baseline"
    row = table["0.002"]
    assert row["test"] == "paired"
    result = stats.ttest_rel(FINALS[2e-3], FINALS[1e-3])
    interval = result.confidence_interval(0.9)
    assert float(row["diff"]) == pytest.approx(statistics.fmean(FINALS[2e-3]) - 3.0)
    assert float(row["diff_low"]) == pytest.approx(interval.low)
    assert float(row["diff_high"]) == pytest.approx(interval.high)
    assert float(row["p"]) == pytest.approx(result.pvalue)
    assert row["significant"] == "False"
    assert table["0.003"]["significant"] == "True"
    # the mean's 90% interval beside every result
    low, high = stats.t.interval(
        0.9, 2, loc=3.0, scale=statistics.stdev(FINALS[1e-3]) / math.sqrt(3)
    )
    assert float(table["0.001"]["final_eval_loss_ci_low"]) == pytest.approx(low)
    assert float(table["0.001"]["final_eval_loss_ci_high"]) == pytest.approx(high)


def test_unpaired_seeds_use_welch(tmp_path, make_run):
    for lr, seeds in ((1e-3, (0, 1, 2)), (3e-3, (5, 6, 7))):
        for seed, final in zip(seeds, FINALS[lr], strict=True):
            name = f"lr={lr:g},seed={seed}"
            make_run(tmp_path, name, config(name, lr, seed), [4.0, final], [None, final])
    found = runs.find_runs([tmp_path])
    keys, rows = compare.table(found)
    result = next(r for r in rows[0].results if r.name == "final_eval_loss")
    comparison = compare_rows(rows, find_baseline(keys, rows, "lr=0.001"), result, 0.05)
    (diff,) = [d for d in comparison.differences.values() if d is not None]
    assert diff.test == "welch"
    welch = stats.ttest_ind(FINALS[3e-3], FINALS[1e-3], equal_var=False)
    assert diff.p == pytest.approx(welch.pvalue) and diff.p_adjusted == pytest.approx(welch.pvalue)


def test_baseline_by_run_name_and_the_refusals(lr_sweep, run_cli):
    code, out, err = run_cli("compare", lr_sweep, "--baseline", "lr=0.003,seed=1")
    assert code == 0, err
    table = out.split("\n\n")[0].splitlines()  # the verdict sentences follow the table
    assert [line.split()[-1] for line in table[2:]].count("baseline") == 1
    for args, message in [
        (["--baseline", "lr=0.5"], "lr=0.5: no row matches; the rows: lr=0.001; lr=0.002; lr"),
        (["--baseline", "width=3"], "'width' is not a setting that varies; one of lr"),
        (["--baseline", "nobody"], "--baseline nobody: no row matches"),
        (["--baseline", "lr=0.001", "--on", "final_x"], "--on final_x: not a result column"),
        (["--on", "final_loss"], "--on final_loss: goes with --baseline"),
        (["--baseline", "lr=0.001", "--per-run"], "leave out --per-run"),
        (["--alpha", "1.5"], "--alpha 1.5: a significance level between 0 and 1"),
    ]:
        code, _, err = run_cli("compare", lr_sweep, *args)
        assert code != 0 and message in err, (args, err)


def test_find_baseline_matches_numbers_by_value(lr_sweep):
    keys, rows = compare.table(runs.find_runs([lr_sweep]))
    assert find_baseline(keys, rows, "optimizer.lr=0.0020") == 1
    with pytest.raises(UserError, match="3 rows match"):
        find_baseline(["optimizer.lr"], [rows[0]] * 3, "lr=0.001")


def test_a_mixture_baseline_is_named_as_the_sweep_sets_it(tmp_path, make_run):
    """`--baseline 'data.weights=[1,1,1]'` names the row whose datasets have those weights
    (`llmtrain sweep --grid data.weights=...` sets each data.train.<i>.weight)."""
    for weights in ([0.2, 0.7, 0.1], [1, 1, 1]):
        for seed in (0, 1):
            name = f"w={weights[0]},seed={seed}"
            run = config(name, 1e-3, seed)
            run["data"] = {"train": [{"path": f"d{i}", "weight": w} for i, w in enumerate(weights)]}
            make_run(tmp_path, name, run, [4.0, 3.0], [None, 3.0])
    keys, rows = compare.table(runs.find_runs([tmp_path]))
    assert "data.train.0.weight" in keys
    found = find_baseline(keys, rows, "data.weights=[1,1,1]")
    assert rows[found].settings["data.train.1.weight"] == 1
    assert rows[1 - found].settings["data.train.1.weight"] == 0.7
    with pytest.raises(UserError, match=r"write the mixture as data.weights=\[w0,w1,...\]"):
        find_baseline(keys, rows, "data.weights=[1,x")
    with pytest.raises(UserError, match="no row matches"):
        find_baseline(keys, rows, "data.weights=[0.5,0.5,0]")
