"""From a base config to a verdict, as the README's laptop commands do it (the `laptop` fixture
of laptop_ladder.py: `llmtrain sweep --ladder --preset laptop` sizes 3 tiny models for each of
2 compute budgets, the 6 runs train on CPU, `llmtrain fit` fits them with a prediction and
`llmtrain report` writes the page): the fit's numbers are sane, and a real headless browser
(Debian's chromium, driven by Playwright) loads the page with no console error, its tables
holding the runs, its figures decoded."""

from __future__ import annotations

import json
import re
import shutil

import pytest

pytestmark = pytest.mark.slow


def test_the_fit_and_the_report_in_a_browser(laptop):
    work, outputs = laptop
    fit = json.loads((work / "fit.json").read_text())
    assert len(fit["runs"]) == 6 and "alpha" in outputs["ladder"]["fit"].stdout
    params = fit["parametric"]["params"]
    assert all(params[name] > 0 for name in ("E", "A", "B", "alpha", "beta")), params
    (prediction,) = fit["predictions"]
    low, value, high = sorted(prediction["loss"])
    assert prediction["loss"][0] == value and 0 < low <= high, prediction
    report = work / "report.html"
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
            assert len(widths) == 3 and all(w > 100 for w in widths), widths  # + loss vs C
            shot = work / "report.png"
            view.screenshot(path=str(shot), full_page=True)
        finally:
            browser.close()
    assert problems == []
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
    print(f"report screenshot: {shot}")
