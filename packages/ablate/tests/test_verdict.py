"""What `llmtrain compare` concludes, and how it shows it: the verdict sentence per row (its
difference, interval and Holm-corrected p-value equal to scipy's computed here; the warning and
the seeds needed when a side has fewer than 3 seeds), the narrow default table (at most 100
characters; `--columns` for more), no intervals on throughput or wall time, `--baseline`
without `--on` on the train loss of runs that never evaluated, `--json`, the mean ± CI band of a
group of seeds in the curves, and `llmtrain eval-tasks`' scores (`eval_tasks.json` in the run
directory) in `compare --downstream`. All on hand-made run directories."""

from __future__ import annotations

import csv
import io
import json
import math
import statistics

import pytest
from scipy import stats

from llmtrain.ablate import compare, plot, runs
from llmtrain.ablate.runs import EVAL_TASKS
from llmtrain.ablate.verdict import MIN_SEEDS, POWER, seeds_needed

# final eval losses per learning rate and seed: 3e-3 beats the baseline 1e-3 on every seed,
# 2e-3 is inside the seeds' noise
FINALS = {1e-3: [3.00, 3.10, 2.90], 2e-3: [2.99, 3.12, 2.91], 3e-3: [2.80, 2.91, 2.69]}
SPEED = {1e-3: 10_000.0, 2e-3: 12_500.0, 3e-3: 9_000.0}


def config(name, lr, seed, **extra):
    model = {"kind": "tiny", "n_layers": 2, "d_model": 64}
    return {"name": name, "seed": seed, "run_dir": "/x", "model": model,
            "optimizer": {"kind": "adamw", "lr": lr}, **extra}  # fmt: skip


@pytest.fixture
def lr_sweep(tmp_path, make_run):
    """Three learning rates x three seeds, evaluated at the last step."""
    for lr, finals in FINALS.items():
        for seed, final in enumerate(finals):
            name = f"lr={lr:g},seed={seed}"
            summary = {"status": "finished", "tokens": 300, "wall_time_s": 100.0 + 20 * seed}
            speed = SPEED[lr] + 500 * seed
            make_run(tmp_path, name, config(name, lr, seed), [4.0, final + 0.1, final],
                     [None, None, final], summary, tokens_per_s=speed)  # fmt: skip
    return tmp_path


def compare_json(run_cli, *args):
    code, out, err = run_cli("compare", *args, "--json")
    assert code == 0, err
    return json.loads(out)


def test_the_verdict_numbers_are_scipys(lr_sweep, run_cli):
    document = compare_json(run_cli, lr_sweep, "--baseline", "lr=0.001")
    rows = {row["settings"]["lr"]: row for row in document["rows"]}
    assert document["baseline"]["result"] == "final_eval_loss"
    p_values = {}
    for lr in (2e-3, 3e-3):
        test = stats.ttest_rel(FINALS[lr], FINALS[1e-3])  # the same seeds: paired
        got = rows[lr]["comparison"]
        interval = test.confidence_interval(0.95)
        assert got["test"] == "paired"
        assert got["diff"] == pytest.approx(statistics.fmean(FINALS[lr]) - 3.0, abs=1e-12)
        assert got["diff_low"] == pytest.approx(interval.low, rel=1e-12)
        assert got["diff_high"] == pytest.approx(interval.high, rel=1e-12)
        assert got["p"] == pytest.approx(test.pvalue, rel=1e-12)
        p_values[lr] = test.pvalue
    # Holm over the two rows: the smaller p x 2, the larger x 1 (but not below the smaller's)
    small, large = sorted(p_values.values())
    holm = {lr: (2 * small if p == small else max(large, 2 * small)) for lr, p in p_values.items()}
    for lr in (2e-3, 3e-3):
        assert rows[lr]["comparison"]["p_holm"] == pytest.approx(holm[lr], rel=1e-12)
    assert rows[3e-3]["comparison"]["significant"] and not rows[2e-3]["comparison"]["significant"]

    verdicts = {v["label"]: v for v in document["verdicts"]}
    assert set(verdicts) == {"lr=0.002", "lr=0.003"}
    win = verdicts["lr=0.003"]
    interval = stats.ttest_rel(FINALS[3e-3], FINALS[1e-3]).confidence_interval(0.95)
    assert win["text"] == (
        f"lr=0.003 vs lr=0.001: final_eval_loss {statistics.fmean(FINALS[3e-3]):.4f} vs "
        f"3.0000, difference {-0.2:.4f} (95% CI [{interval.low:.4f}, {interval.high:.4f}]; "
        f"p = {holm[3e-3]:.3g}, paired t-test, Holm-corrected over 2 rows; n = 3 vs 3 seeds): "
        "better, significant at alpha 0.05."
    )
    assert win["significant"] and not win["weak"] and (win["n"], win["n_baseline"]) == (3, 3)
    noise = verdicts["lr=0.002"]["text"]
    assert "within seed noise (not significant at alpha 0.05)." in noise
    assert "Warning" not in noise

    # the same sentences follow the terminal table
    _, out, _ = run_cli("compare", lr_sweep, "--baseline", "lr=0.001")
    assert " ".join(out.split("\n\n")[1].split()) == " ".join(
        v["text"] for v in document["verdicts"]
    )


def test_two_seeds_make_a_weak_test_and_the_verdict_says_how_many_would_do(tmp_path, make_run):
    for lr, finals in ((1e-3, [3.00, 3.10]), (3e-3, [2.85, 2.97])):
        for seed, final in enumerate(finals):
            name = f"lr={lr:g},seed={seed}"
            make_run(tmp_path, name, config(name, lr, seed), [4.0, final], [None, final])
    found = runs.find_runs([tmp_path])
    keys, rows = compare.table(found)
    comparison = compare.comparison_of(keys, rows, [], "lr=0.001", None, 0.05)
    (verdict,) = compare.verdicts_of(keys, rows, comparison)
    assert verdict.weak and verdict.n == 2 < MIN_SEEDS
    assert "Warning: with 2 seeds on a side this test is weak" in verdict.text
    needed = verdict.seeds_needed
    assert f"about {needed} seeds per side would find a difference this size 80%" in verdict.text
    # the power of the paired t-test (noncentral t) at `needed` seeds reaches 80%, one fewer not
    gaps = [2.85 - 3.00, 2.97 - 3.10]
    effect = abs(statistics.fmean(gaps)) / statistics.stdev(gaps)

    def power(n):  # the far tail (wrong sign) left out: below 1e-20 here (scipy: NaN at n 2)
        return stats.nct.sf(stats.t.ppf(0.975, n - 1), n - 1, effect * math.sqrt(n))

    assert power(needed) >= POWER > power(needed - 1)
    assert seeds_needed([1.0, 1.0], [1.0, 1.0], paired=True, alpha=0.05) is None  # no spread


def test_a_row_of_one_run_is_untested_and_says_why(tmp_path, make_run, run_cli):
    for lr, seeds in ((1e-3, (0, 1, 2)), (3e-3, (0,))):
        for seed in seeds:
            name = f"lr={lr:g},seed={seed}"
            make_run(tmp_path, name, config(name, lr, seed), [4.0, 3.0], [None, 3.0 - seed / 10])
    document = compare_json(run_cli, tmp_path, "--baseline", "lr=0.001")
    (verdict,) = document["verdicts"]
    assert verdict["significant"] is None and verdict["weak"]
    assert "untested: 1 run with a value against the baseline's 3" in verdict["text"]


def test_the_default_table_fits_100_columns_and_columns_all_shows_every_result(
    lr_sweep, run_cli, tmp_path, make_run
):
    for args in ((), ("--baseline", "lr=0.001"), ("--per-run",)):
        code, out, err = run_cli("compare", lr_sweep, *args)
        assert code == 0, err
        assert max(len(line) for line in out.splitlines()) <= compare.TABLE_WIDTH, (args, out)
    # two settings that vary, long statuses, a baseline: still within 100 characters
    grid = tmp_path / "grid"
    for lr in (1e-3, 3e-3):
        for layers in (2, 12):
            for seed in range(3):
                name = f"lr={lr:g},n_layers={layers},seed={seed}"
                settings = config(name, lr, seed, data={"seq_len": 64 * layers})
                noise = ((seed * 31 + layers * 17 * (seed + 1) + int(lr * 1e4) * 7) % 11) / 100
                final = 3.0 - seed / 7 - layers / 100 - noise
                make_run(grid, name, settings, [4.0, 3.0 + seed / 10], [None, final])
    code, out, err = run_cli("compare", grid, "--baseline", "lr=0.001,seq_len=128")
    assert code == 0, err
    assert max(len(line) for line in out.splitlines()) <= compare.TABLE_WIDTH, out
    header, _, *lines = out.split("\n\n")[0].splitlines()
    assert header.split() == ["seq_len", "lr", "runs", "status", "final_eval_loss", "diff", "p",
                              "(holm)"]  # fmt: skip
    means = slice(header.index("final_eval_loss"), header.index("diff"))
    assert all("3 incomplete" in line and "[" not in line[means] for line in lines), out
    assert sum("[" in line for line in lines) == 3  # the differences' intervals
    code, out, _ = run_cli("compare", lr_sweep)
    assert out.splitlines()[0].split() == [
        "lr",
        "runs",
        "status",
        "final_eval_loss",
        "tokens_per_s",
    ]
    code, out, _ = run_cli("compare", lr_sweep, "--columns", "all")
    header = out.splitlines()[0].split()
    assert header[3:] == [r.name for r in compare.RESULTS if r.name != "mfu"]  # none logged it
    assert max(len(line) for line in out.splitlines()) > compare.TABLE_WIDTH
    code, out, _ = run_cli("compare", lr_sweep, "--columns", "final_loss,wall_time_s")
    assert out.splitlines()[0].split()[3:] == ["final_loss", "wall_time_s"]
    code, _, err = run_cli("compare", lr_sweep, "--columns", "final_los")
    assert code == 2 and "--columns final_los: final_los is not a result column" in err


def test_no_interval_on_throughput_tokens_or_wall_time(lr_sweep, run_cli):
    _, out, _ = run_cli("compare", lr_sweep, "--columns", "all")
    header, _, *lines = out.splitlines()
    starts = {name: header.index(name) for name in ("final_eval_loss", "tokens_per_s")}
    speeds = [SPEED[1e-3] + 500 * s for s in range(3)]
    row = lines[0]
    assert f"{statistics.fmean(speeds):,.0f} ± {statistics.stdev(speeds):,.0f}" in row
    speed_cell = row[starts["tokens_per_s"] :]
    assert "[" not in speed_cell  # tokens/s, tokens and wall time come after: none has one
    assert "[" in row[starts["final_eval_loss"] : starts["tokens_per_s"]]  # the losses do

    _, out, _ = run_cli("compare", lr_sweep, "--format", "csv")
    table = list(csv.DictReader(io.StringIO(out)))
    for name in ("tokens", "tokens_per_s", "wall_time_s"):
        assert all(r[f"{name}_ci_low"] == r[f"{name}_ci_high"] == "" for r in table), name
        assert all(r[f"{name}_std"] != "" for r in table if name != "tokens"), name
    assert all(r["final_eval_loss_ci_low"] and r["final_loss_ci_high"] for r in table)
    document = compare_json(run_cli, lr_sweep)
    results = document["rows"][0]["results"]
    assert results["wall_time_s"]["ci_low"] is None and results["tokens_per_s"]["ci_high"] is None
    low, high = stats.t.interval(
        0.95, 2, loc=3.0, scale=statistics.stdev(FINALS[1e-3]) / math.sqrt(3)
    )
    got = results["final_eval_loss"]
    assert (got["ci_low"], got["ci_high"]) == (pytest.approx(low), pytest.approx(high))
    assert compare.has_interval("downstream/hellaswag/acc_norm") and compare.has_interval("loss")
    assert not compare.has_interval("tokens_per_s") and not compare.has_interval("mfu")


def test_baseline_without_on_uses_the_train_loss_of_runs_without_eval(tmp_path, make_run, run_cli):
    finals = {1e-3: [3.00, 3.10, 2.90], 3e-3: [2.80, 2.91, 2.69]}
    for lr, values in finals.items():
        for seed, final in enumerate(values):
            name = f"lr={lr:g},seed={seed}"
            make_run(tmp_path, name, config(name, lr, seed), [4.0, final])  # no eval at all
    document = compare_json(run_cli, tmp_path, "--baseline", "lr=0.001")
    assert document["baseline"]["result"] == "final_loss"
    row = next(r for r in document["rows"] if r["settings"]["lr"] == 3e-3)
    test = stats.ttest_rel(finals[3e-3], finals[1e-3])
    assert row["comparison"]["p"] == pytest.approx(test.pvalue, rel=1e-12)
    assert row["comparison"]["diff"] == pytest.approx(-0.2)
    code, out, err = run_cli("compare", tmp_path, "--baseline", "lr=0.001")
    assert code == 0, err
    assert out.splitlines()[0].split()[3:] == ["final_loss", "diff", "p", "(holm)"]
    assert "lr=0.003 vs lr=0.001: final_loss 2.8000 vs 3.0000" in out


def test_json_and_format_are_one_choice_and_o_json_writes_json(lr_sweep, run_cli, tmp_path, capsys):
    code, _, err = run_cli("compare", lr_sweep, "--json", "--format", "csv")
    assert code == 2 and "--json and --format csv: choose one" in err
    code, out, err = run_cli("compare", lr_sweep, "-o", tmp_path / "t.json")
    assert code == 0 and out == "", err
    assert len(json.loads((tmp_path / "t.json").read_text())["rows"]) == 3
    # 0.1's --format: hidden from the help, still works after one deprecation line
    code, out, err = run_cli("compare", lr_sweep, "--format", "csv")
    assert code == 0 and out.startswith("run_dirs,optimizer.lr,runs,status,"), err
    assert err.splitlines() == [
        "warning: llmtrain compare: --format csv is deprecated; use -o FILE.csv, or --json "
        "(the old spelling goes away after 0.2)"
    ]
    with pytest.raises(SystemExit):
        run_cli("compare", "--help")
    out = capsys.readouterr().out
    assert "--format" not in out and "--json" in out


def test_the_curves_band_is_the_t_interval_of_the_seeds(lr_sweep, tmp_path):
    found = runs.find_runs([lr_sweep])
    members = [run for run in found if run.settings["optimizer.lr"] == 1e-3]
    xs, means, lows, highs = plot.band(members, "loss", "step")
    assert xs == [1, 2, 3]
    at_two = [v + 0.1 for v in FINALS[1e-3]]
    low, high = stats.t.interval(
        0.95, 2, loc=statistics.fmean(at_two), scale=statistics.stdev(at_two) / math.sqrt(3)
    )
    assert means[1] == pytest.approx(statistics.fmean(at_two))
    assert (lows[1], highs[1]) == (pytest.approx(low), pytest.approx(high))
    assert lows[0] == highs[0] == 4.0  # no spread at step 1
    assert plot.band(members[:1], "loss") is None
    drawn = plot.plot(found, tmp_path / "bands.svg", metrics=["loss", "eval_loss"])
    svg = (tmp_path / "bands.svg").read_text()
    assert drawn == ["loss", "eval_loss"] and "lr=0.001 (3 seeds): mean, 95% CI" in svg


def write_eval_tasks(run_dir, evaluations):
    document = {"format": 1, "evaluations": evaluations}
    (run_dir / EVAL_TASKS).write_text(json.dumps(document))


def test_eval_tasks_scores_join_compare_downstream(lr_sweep, run_cli):
    """`llmtrain eval-tasks` on a run's checkpoint writes `<run>/eval_tasks.json`; its scores
    are columns of `compare --downstream` like the downstream callback's, and where the callback
    logged the same metric at the same step its value is kept."""
    scores = {}
    for lr, finals in FINALS.items():
        for seed in range(len(finals)):
            acc = 0.30 + 100 * lr + 0.01 * seed
            scores[lr, seed] = acc
            task = {"scoring": "multiple_choice", "items": 200, "truncated": 0, "acc": acc,
                    "acc_stderr": 0.03, "shots": 0}  # fmt: skip
            write_eval_tasks(lr_sweep / f"lr={lr:g},seed={seed}", [
                {"step": 1, "tasks": {"hellaswag": {**task, "acc": 0.25}}},
                {"step": 3, "tasks": {"hellaswag": task}},
            ])  # fmt: skip
    # one run's own callback logged hellaswag at step 3 too: the callback's value stays
    run_dir = lr_sweep / "lr=0.001,seed=0"
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write("\n" + json.dumps({"step": 3, "downstream/hellaswag/acc": 0.99}) + "\n")
    found = runs.find_runs([lr_sweep])
    assert runs.downstream_metrics(found) == ["downstream/hellaswag/acc"]
    code, out, err = run_cli("compare", lr_sweep, "--downstream")
    assert code == 0, err
    header = out.splitlines()[0].split()
    assert header == ["lr", "runs", "status", "final_eval_loss", "final_downstream/hellaswag/acc",
                      "tokens_per_s"]  # fmt: skip
    document = compare_json(run_cli, lr_sweep, "--downstream")
    for row in document["rows"]:
        lr = row["settings"]["lr"]
        finals = [scores[lr, s] for s in range(3)]
        if lr == 1e-3:
            finals[0] = 0.99
        got = row["results"]["final_downstream/hellaswag/acc"]
        assert got["mean"] == pytest.approx(statistics.fmean(finals)) and got["n"] == 3
        assert row["results"]["best_downstream/hellaswag/acc"]["mean"] == pytest.approx(
            statistics.fmean(finals)
        )
    # the score lines sit in step order among the logged lines, step taken from eval-tasks
    run = runs.read_run(lr_sweep / "lr=0.002,seed=1")
    assert [m["step"] for m in run.metrics] == [1, 1, 2, 3, 3]
    assert run.series("downstream/hellaswag/acc", "tokens") == ([100, 300], [0.25, scores[2e-3, 1]])
    (run_dir / EVAL_TASKS).write_text("{half")  # unreadable: no scores, no error
    assert runs.read_eval_tasks(run_dir) == []
