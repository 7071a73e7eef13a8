"""The README's "From a sweep to a verdict" on a laptop, command for command (the `laptop`
fixture of laptop_ladder.py runs them as printed): the six rungs the sweep planned trained, `fit`
found two IsoFLOP profiles, `report` wrote the page. test_verdict.py looks at the page in a
browser; this test checks that the documented commands do what the README says."""

from __future__ import annotations

import json

import pytest
from laptop_ladder import RUNGS
from train_support import read_metrics

pytestmark = pytest.mark.slow


def test_the_sweep_trains_the_six_rungs_it_planned(laptop):
    work, outputs = laptop
    sweep = work / "sweeps" / "laptop"
    manifest = json.loads((sweep / "manifest.json").read_text())
    assert [run["id"] for run in manifest["runs"]] == RUNGS
    assert "--preset laptop" in manifest["command"]
    planned = {f"C={row['label']['C']},r={row['label']['r']}": row for row in manifest["ladder"]}
    for rung in RUNGS:
        summary = json.loads((sweep / rung / "summary.json").read_text())
        assert summary["status"] == "finished", rung
        assert summary["non_embedding_params"] == planned[rung]["params"], rung
        assert summary["tokens"] == planned[rung]["tokens"], rung
        # the example evaluates once, after the last step (eval.at_end): the loss the rung ends at
        evaluated = [m["step"] for m in read_metrics(sweep / rung) if "eval_loss" in m]
        assert evaluated == [summary["total_steps"]], rung
    # the table on stderr, then every run finished
    err = outputs["ladder"]["sweep"].stderr
    assert all(rung in err for rung in RUNGS)
    assert "sweep laptop: all 6 runs finished" in err


def test_fit_and_report_are_written(laptop):
    work, outputs = laptop
    assert (
        "alpha" in outputs["ladder"]["fit"].stdout and "IsoFLOP" in outputs["ladder"]["fit"].stdout
    )
    fit = json.loads((work / "fit.json").read_text())
    assert sorted(run["name"] for run in fit["runs"]) == sorted(RUNGS)
    # each budget's three rungs cost the same FLOPs as the fit counts them: two IsoFLOP profiles
    budgets = fit["isoflop"]["budgets"]
    assert [sorted(b["runs"]) for b in budgets] == [sorted(RUNGS[:3]), sorted(RUNGS[3:])]
    assert [b["rejected"] for b in budgets] == [None, None]
    assert (work / "fit.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = (work / "report.html").read_text(encoding="utf-8")
    assert page.lstrip().lower().startswith("<!doctype html")
    assert all(rung in page for rung in RUNGS)


def test_the_ablation_states_its_verdict(laptop):
    """The README's ablation on the quickstart's data: 2 learning rates x 3 seeds. `compare`
    prints the verdict sentence with the numbers the runs ended at (the paired t-test over the
    seeds' final eval losses, as scipy computes it), and the report's page opens with it."""
    from scipy import stats

    work, outputs = laptop
    sweep = work / "sweeps" / "lr"
    finals = {}
    for lr in ("0.001", "0.003"):
        for seed in range(3):
            run = sweep / f"lr={lr},seed={seed}"
            assert json.loads((run / "summary.json").read_text())["status"] == "finished"
            losses = [m["eval_loss"] for m in read_metrics(run) if "eval_loss" in m]
            finals.setdefault(lr, []).append(losses[-1])
    diff = sum(finals["0.003"]) / 3 - sum(finals["0.001"]) / 3
    p = stats.ttest_rel(finals["0.003"], finals["0.001"]).pvalue
    verdict = " ".join(outputs["ablation"]["compare"].stdout.split())
    assert "lr=0.003 vs lr=0.001: final_eval_loss" in verdict, verdict
    assert f"difference {diff:.4f}" in verdict and f"p = {p:.3g}" in verdict, verdict
    assert "n = 3 vs 3 seeds" in verdict and "weak" not in verdict
    word = "better" if diff < 0 else "worse"
    assert (f"{word}, significant" if p < 0.05 else "within seed noise") in verdict, verdict
    page = (work / "lr.html").read_text(encoding="utf-8")
    first = page.index("lr=0.003 vs lr=0.001")
    assert first < page.index("<table"), "the verdict comes before the tables"
