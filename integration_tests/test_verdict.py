"""From a base config to a report, as the README's three commands do it: `llmtrain sweep
--ladder` sizes 3 tiny models for each of 2 compute budgets, the 6 runs train on CPU, `llmtrain
fit` fits them and `llmtrain report` writes the page, which a real headless browser (Debian's
chromium, driven by Playwright) loads with no console error, its tables holding the runs.

The base (tied embeddings, head_dim 8, two query heads per kv head) has exact shapes near
25k, 49k, 99k and 203k non-embedding parameters; the budgets 1.17e11 and 4.67e11 FLOPs at 2, 8
and 32 tokens per parameter ask for those sizes (N = sqrt(C / 6r))."""

from __future__ import annotations

import json
import re
import shlex
import shutil

import pytest
import train_support as ts

pytestmark = pytest.mark.slow
BUDGETS = "1.17e11,4.67e11"
RATIOS = "2,8,32"
RUNGS = [f"C={c},r={r}" for c in ("1.17e11", "4.67e11") for r in (2, 8, 32)]


@pytest.fixture(scope="module")
def ladder(tmp_path_factory):
    work = tmp_path_factory.mktemp("verdict")
    data = ts.pack_corpus(work / "data")
    config = ts.run_config(data, work / "unused", "ladder")
    config["model"].update(d_model=32, n_heads=4, n_kv_heads=2, tied_embeddings=True)
    config["data"].update(seq_len=64, micro_batch=16, global_batch=32)
    # one evaluation, after the last step (eval.at_end): the loss each rung ends at
    config["data"]["eval"] = {"path": data.valid, "every": 100_000, "batches": 4}
    config["training"] = {"steps": 1, "log_every": 50}
    config["lr_scheduler"] = {"kind": "cosine", "warmup_steps": 10, "min_ratio": 0.1}
    config.pop("checkpoint")
    base = ts.write_config(work / "base.yaml", config)
    sweep = ["sweep", base, "--ladder", "--budgets", BUDGETS, "--tokens-per-param", RATIOS]
    dry = ts.run(ts.llmtrain(*sweep, "--dir", work / "sweeps", "--dry-run"), timeout=300)
    printed = ts.run(
        ts.llmtrain(*sweep, "--dir", work / "sweeps", "--launch", "print"), timeout=300
    )
    commands = [shlex.split(line) for line in printed.stdout.splitlines()]
    assert len(commands) == 6, printed.stdout
    trained = ts.side_by_side(*(ts.llmtrain(*command[1:]) for command in commands), timeout=1200)
    for proc in trained:
        assert proc.returncode == 0, f"{proc.args} exited {proc.returncode}\n{proc.stderr}"
    return work, work / "sweeps" / "ladder", dry.stdout


def test_the_ladder_trains_the_sizes_it_planned(ladder):
    _, sweep, table = ladder
    assert [line.split()[0] for line in table.splitlines() if line.startswith("C=")] == RUNGS
    manifest = json.loads((sweep / "manifest.json").read_text())
    planned = {f"C={row['label']['C']},r={row['label']['r']}": row for row in manifest["ladder"]}
    sizes = set()
    for rung in RUNGS:
        summary = json.loads((sweep / rung / "summary.json").read_text())
        assert summary["status"] == "finished"
        assert summary["non_embedding_params"] == planned[rung]["params"], rung
        assert summary["tokens"] == planned[rung]["tokens"], rung
        sizes.add(summary["non_embedding_params"])
        metrics = ts.read_metrics(sweep / rung)
        # evaluated once, at the last step (not a multiple of eval.every)
        evaluated = [m["step"] for m in metrics if "eval_loss" in m]
        assert evaluated == [summary["total_steps"]], rung
    assert len(sizes) == 4  # 3 per budget, 2 shared between the budgets


def test_fit_and_report_and_the_page_in_a_browser(ladder):
    work, sweep, _ = ladder
    fitted = ts.run(
        ts.llmtrain("fit", sweep, "-o", work / "fit.json", "--predict", "N=1e6,D=2e7"),
        timeout=300,
    )
    fit = json.loads((work / "fit.json").read_text())
    assert len(fit["runs"]) == 6 and "alpha" in fitted.stdout
    params = fit["parametric"]["params"]
    assert all(params[name] > 0 for name in ("E", "A", "B", "alpha", "beta")), params
    (prediction,) = fit["predictions"]
    low, value, high = sorted(prediction["loss"])
    assert prediction["loss"][0] == value and 0 < low <= high, prediction
    report = work / "report.html"
    ts.run(ts.llmtrain("report", sweep, "-o", report, "--predict", "N=1e6,D=2e7"), timeout=300)
    page = report.read_text(encoding="utf-8")
    assert "<script" not in page and not re.search(r"(src|href)=\"https?:", page)
    # each budget's rungs cost the same FLOPs as the fit counts them: two IsoFLOP profiles (an
    # optimum inside both is up to what these tiny runs learned)
    isoflop = re.search(r'<p id="no-isoflop"[^>]*>(.*?)</p>', page, re.S)
    assert isoflop is None or "2 budget(s) found" in isoflop.group(1), isoflop.group(1)

    chromium = shutil.which("chromium")
    assert chromium, "needs Debian's chromium: apt-get install chromium (the nox session does)"
    from playwright.sync_api import sync_playwright

    problems: list[str] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            view = browser.new_page(viewport={"width": 1300, "height": 900})

            def console(message) -> None:
                if message.type in ("error", "warning"):
                    problems.append(f"{message.type}: {message.text}")

            view.on("console", console)
            view.on("pageerror", lambda error: problems.append(f"page error: {error}"))
            view.on("requestfailed", lambda request: problems.append(f"failed: {request.url}"))
            view.goto(report.as_uri(), wait_until="load")
            assert view.locator("#compare tbody tr").count() == 6  # one row per rung
            assert view.locator("#runs tbody tr").count() == 6
            assert "N=1e+06,D=2e+07" in view.locator("#fit").inner_text()
            # every figure decoded: a broken data: URL leaves naturalWidth 0
            widths = view.eval_on_selector_all("img", "images => images.map(i => i.naturalWidth)")
            assert len(widths) == 2 and all(w > 100 for w in widths), widths
            shot = work / "report.png"
            view.screenshot(path=str(shot), full_page=True)
        finally:
            browser.close()
    assert problems == []
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
    print(f"report screenshot: {shot}")
