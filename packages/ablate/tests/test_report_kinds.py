"""`llmtrain report` opens with its sweep's answer: a ladder (manifest `ladder`; by budget or by
size, with decay branches) with its fit, its warnings and the loss-against-compute figure, and a
runs table that says which rung each run is; a µP transfer sweep with the lr-against-width figure
and its verdict; an ablation with its verdict. The baseline hint leads only an ablation. Hand-made
sweeps in the layout `llmtrain sweep` writes (integration_tests/report_sweeps.py, which
integration_tests/test_report_first_screen.py opens in a browser too)."""

from __future__ import annotations

import html
import re

from report_sweeps import ablation_sweep, ladder_sweep, transfer_sweep

from llmtrain.ablate.runs import find_runs


def element(page: str, tag: str, css_id: str) -> str:
    found = re.search(rf'<{tag}[^>]*\bid="{css_id}"[^>]*>(.*?)</{tag}>', page, re.S)
    assert found, f"no {tag}#{css_id}"
    return html.unescape(found.group(1))


def report(run_cli, sweep, tmp_path, *args):
    out = tmp_path / "report.html"
    code, _, err = run_cli("report", sweep, "-o", out, *args)
    assert code == 0, err
    return out.read_text(encoding="utf-8")


def test_a_ladder_by_budget_leads_with_its_fit_and_loss_against_compute(tmp_path, run_cli):
    page = report(run_cli, ladder_sweep(tmp_path / "ladder", branches=False), tmp_path)
    assert "No baseline named" not in page and 'id="verdict"' not in page
    answer = page.index('id="answer"')
    assert answer < page.index('id="fit"') < page.index('id="compare"') < page.index('id="runs"')
    assert page.index('id="loss-compute"') < page.index('id="curves"')
    law_line = element(page, "p", "fit-law")
    assert law_line.startswith("<strong>L = 1.69") and "fitted to 9 runs" in law_line
    # 9 runs for 5 parameters: fewer than 3 a parameter, said in the answer
    assert "9 runs for 5 parameters" in element(page, "ul", "fit-warnings")
    assert 'src="data:image/png;base64,' in page[answer : page.index('id="fit"')]
    # the runs table: which rung each run is, what it trained
    runs = element(page, "table", "runs")
    heads = re.findall(r"<th>(.*?)</th>", runs)
    assert heads == ["run", "rung", "budget C asked", "tokens/param", "N", "D", "C", "status",
                     "final eval_loss"]  # fmt: skip
    rows = re.findall(r"<tr>(.*?)</tr>", runs.split("</thead>")[1])
    cells = [re.findall(r"<td[^>]*>(.*?)</td>", row) for row in rows]
    assert len(cells) == 9 and len({tuple(c[1:7]) for c in cells}) == 9  # each rung its own
    first = next(c for c in cells if c[4] == "2e+06" and c[3] == "20")
    assert first[1].startswith("C=") and first[1].endswith(", r=20") and first[5] == "4e+07"
    assert first[6] == f"{6 * 1.1 * 2e6 * 4e7:.3g}"
    # eval_loss is logged once per run: no one-point curves, and the page says why
    assert "Not drawn: eval_loss, logged once per run" in page
    assert 'alt="curves of loss"' in page


def test_a_ladder_by_size_with_decay_branches_names_rungs_and_trunks(tmp_path, run_cli):
    sweep = ladder_sweep(tmp_path / "sizes", by_size=True, branches=True)
    page = report(run_cli, sweep, tmp_path)
    runs = element(page, "table", "runs")
    heads = re.findall(r"<th>(.*?)</th>", runs)
    assert heads[2] == "size N asked" and heads[7] == "decay branch of"
    rows = re.findall(r"<tr>(.*?)</tr>", runs.split("</thead>")[1])
    cells = {c[0]: c for c in (re.findall(r"<td[^>]*>(.*?)</td>", row) for row in rows)}
    assert cells["N=2e+06,r=5"][1] == "N=2e+06, r=5"
    assert cells["N=2e+06,r=5"][7] == "N=2e+06,r=20 at step 8000"
    assert cells["N=2e+06,r=20"][7] == ""  # the trunk
    assert page.index('id="answer"') < page.index('id="runs"')
    # the branches' curves start at their start step; the figure and fit use every rung
    found = find_runs([sweep])
    branch = next(r for r in found if r.name == "N=2e+06,r=5")
    assert branch.metrics[0]["step"] == 8000
    assert "fitted to 9 runs" in element(page, "p", "fit-law")


def test_a_transfer_sweep_leads_with_lr_against_width_and_its_verdict(tmp_path, run_cli):
    page = report(run_cli, transfer_sweep(tmp_path / "mup"), tmp_path)
    assert "No baseline named" not in page and 'id="verdict"' not in page
    assert page.index('id="answer"') < page.index('id="transfer"') < page.index('id="compare"')
    verdict = element(page, "ul", "transfer-verdict")
    assert "parametrization=mup: the best optimizer.lr is the same at every width" in verdict
    assert "it transfers." in verdict
    assert "parametrization=standard: the best optimizer.lr moves by 2 grid steps" in verdict
    assert "it does not transfer." in verdict
    # the 24-row table is folded below the answer
    assert re.search(r"<details><summary>The table \(24 rows\)</summary>\s*<div", page)


def test_an_ablation_still_leads_with_its_verdict_and_the_baseline_hint(tmp_path, run_cli):
    root = ablation_sweep(tmp_path / "abl")
    page = report(run_cli, root, tmp_path)
    assert 'id="answer"' not in page
    assert page.index('id="verdict"') < page.index('id="compare"')
    assert "No baseline named" in element(page, "section", "verdict")
    page = report(run_cli, root, tmp_path, "--baseline", "lr=0.001")
    assert "lr=0.003 vs lr=0.001" in element(page, "section", "verdict")
    assert "No baseline named" not in page


def test_two_ladders_compared_keep_their_rung_table(tmp_path, run_cli):
    """`report --compare BASELINE VARIANT` opens with the comparison's verdict and its runs
    table still says which rung each run is (one ladder by budget, one by size)."""
    base = ladder_sweep(tmp_path / "base", branches=False)
    variant = ladder_sweep(tmp_path / "variant", by_size=True, branches=False)
    out = tmp_path / "compare.html"
    code, _, err = run_cli(
        "report", "--compare", base, variant, "--predict", "N=1e8,D=2e9", "-o", out
    )
    assert code == 0, err
    page = out.read_text(encoding="utf-8")
    assert page.index('id="verdict"') < page.index('id="scale-compare"')
    assert "No baseline named" not in page
    heads = re.findall(r"<th>(.*?)</th>", element(page, "table", "runs"))
    assert heads[:3] == ["run", "rung", "budget C or size N asked"]  # one ladder of each
