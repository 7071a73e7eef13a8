"""`llmtrain report`: the page's sections and numbers on hand-made runs, self-contained (no
script, no network reference, figures inline). The page in a real browser, on a ladder trained
for it, is integration_tests/test_verdict.py's."""

from __future__ import annotations

import base64
import re

import pytest

from llmtrain.ablate import fit

CHINCHILLA = (1.69, 406.4, 410.7, 0.34, 0.28)
SIZES = (2e6, 8e6, 3.2e7)
TOKENS = (4e7, 1.6e8, 6.4e8)


def summary(n, d):
    return {
        "status": "finished",
        "tokens": d,
        "params": n + 1000,
        "non_embedding_params": n,
        "flops_per_token": 6 * n,
        "wall_time_s": 12.5,
    }


@pytest.fixture
def ladder(tmp_path, make_run):
    """Nine runs of three sizes and three token counts, their eval losses on Chinchilla's law."""
    for i, n in enumerate(SIZES):
        for j, d in enumerate(TOKENS):
            loss = float(fit.chinchilla_loss(n, d, CHINCHILLA))
            name = f"n{i}-d{j}"
            config = {"name": name, "seed": 0, "model": {"d_model": 64 * 2**i}}
            config["training"] = {"steps": 100 * 4**j}
            make_run(tmp_path, name, config, [loss + 1, loss + 0.1], [None, loss], summary(n, d))
    return tmp_path


def section(page: str, element: str, css_id: str) -> str:
    found = re.search(rf'<{element} id="{css_id}"[^>]*>(.*?)</{element}>', page, re.S)
    assert found, f"no {element}#{css_id}"
    return found.group(1)


def image(page: str, css_id: str) -> bytes:
    found = re.search(rf'<img id="{css_id}" alt="[^"]*" src="data:image/png;base64,([^"]+)"', page)
    assert found, f"no inline image #{css_id}"
    return base64.b64decode(found.group(1))


def test_a_ladder_report_holds_table_curves_fits_and_runs(ladder, run_cli, tmp_path):
    out = tmp_path / "out" / "report.html"
    code, _, err = run_cli(
        "report", ladder, "-o", out, "--predict", "N=1e8,D=2e9", "--title", "ladder <1>"
    )
    assert code == 0, err
    assert f"9 runs -> {out}" in err
    page = out.read_text(encoding="utf-8")
    assert "<title>ladder &lt;1&gt;</title>" in page  # escaped
    assert "<script" not in page and "http://" not in page and "https://" not in page
    assert section(page, "table", "compare").count("<tr>") == 1 + 9
    assert image(page, "curves").startswith(b"\x89PNG")
    fits = section(page, "pre", "fit")
    assert "E + A / N^alpha + B / D^beta: 9 runs" in fits and "N=1e+08,D=2e+09" in fits
    # the fit recovers the law it was drawn from: E to its printed digits
    e_line = next(line for line in fits.splitlines() if line.split()[:1] == ["E"])
    assert float(e_line.split()[1]) == pytest.approx(1.69, rel=1e-2)
    expected = float(fit.chinchilla_loss(1e8, 2e9, CHINCHILLA))
    assert f"{expected:.4g}"[:4] in fits
    assert image(page, "fit-plot").startswith(b"\x89PNG")
    runs_table = section(page, "table", "runs")
    assert runs_table.count("<tr>") == 1 + 9
    assert "n2-d2" in runs_table and "640,000,000" in runs_table


@pytest.fixture
def seeds(tmp_path, make_run):
    """Three learning rates x three seeds, one size: 3e-3 wins on every seed, 2e-3 does not."""
    finals = {1e-3: [3.00, 3.10, 2.90], 2e-3: [2.99, 3.12, 2.91], 3e-3: [2.80, 2.91, 2.69]}
    for lr, values in finals.items():
        for seed, final in enumerate(values):
            name = f"lr={lr:g},seed={seed}"
            config = {"name": name, "seed": seed, "optimizer": {"lr": lr}}
            make_run(tmp_path, name, config, [4.0, final], [None, final], summary(1e6, 1e7))
    return tmp_path


def test_the_baseline_marks_the_win_and_a_sweep_without_sizes_has_no_fit(seeds, run_cli):
    out = seeds / "report.html"
    code, _, err = run_cli("report", seeds, "-o", out, "--baseline", "lr=0.001")
    assert code == 0, err
    page = out.read_text(encoding="utf-8")
    table = section(page, "table", "compare")
    rows = re.findall(r"<tr>(.*?)</tr>", table, re.S)[1:]
    assert len(rows) == 3
    marked = [row for row in rows if 'class="significant"' in row]
    assert len(marked) == 1 and marked[0].startswith("<td>0.003</td>")
    assert any("<td>baseline</td>" in row for row in rows)
    no_fit = section(page, "p", "no-fit")
    assert "every run has the same model size N=1e+06 (lr=0.001,seed=0," in no_fit, no_fit


def test_bad_requests_are_refused_before_anything_is_written(seeds, run_cli, tmp_path):
    for args, message in [
        (["-o", tmp_path / "r.png"], "the report is HTML"),
        (["-o", tmp_path / "r.html", "--predict", "N=x"], "--predict N=x"),
        (["-o", tmp_path / "r.html", "--alpha", "0"], "--alpha 0.0: a significance level"),
        (["-o", tmp_path / "r.html", "--baseline", "lr=9"], "--baseline lr=9: no row matches"),
    ]:
        code, _, err = run_cli("report", seeds, *args)
        assert code != 0 and message in err, (args, err)
    assert not list(tmp_path.glob("r.*"))
