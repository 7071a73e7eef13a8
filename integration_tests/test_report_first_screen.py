"""Every report leads with its answer (issue 51, point 3): `llmtrain report` (a real `python -m
llmtrain` subprocess) on an ablation, a ladder (by size, with decay branches) and a µP transfer
sweep (report_sweeps.py: the run-directory layout, no training), each page opened in Debian's
headless chromium (driven by Playwright) at a laptop's 1280x800: its answer's element starts on
the first screen (bounding box top < 800 px) and the page never scrolls sideways. The ablation's
answer is its verdict; the ladder's its fit (the law and its warnings) and the loss-against-
compute figure; the µP sweep's the lr-against-width figure and its transfer verdict. A
screenshot of each first screen goes to the test's folder, and to $LLMTRAIN_REPORT_SCREENS
where that is set."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import train_support as ts
from report_sweeps import ablation_sweep, ladder_sweep, transfer_sweep

WIDTH, HEIGHT = 1280, 800
# per kind: the sweep, report's extra arguments, and the elements that answer it
KINDS = {
    "ablation": (ablation_sweep, ["--baseline", "lr=0.001"], ["verdict"]),
    "ladder": (
        lambda root: ladder_sweep(root, by_size=True, branches=True),
        [],
        ["fit-law", "fit-warnings", "loss-compute"],
    ),
    "transfer": (transfer_sweep, [], ["transfer-verdict", "transfer"]),
}


@pytest.fixture(scope="module")
def browser():
    chromium = shutil.which("chromium")
    assert chromium, "needs Debian's chromium: apt-get install chromium (the nox session does)"
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            yield launched
        finally:
            launched.close()


@pytest.mark.parametrize("kind", list(KINDS))
def test_each_report_kind_shows_its_answer_on_the_first_screen(kind, browser, tmp_path):
    write, extra, answers = KINDS[kind]
    sweep = write(tmp_path / kind)
    report = tmp_path / f"{kind}.html"
    ts.run(ts.llmtrain("report", sweep, "-o", report, *extra), timeout=300)
    page = report.read_text(encoding="utf-8")
    assert ("No baseline named" in page) == (kind == "ablation" and not extra)

    view = browser.new_page(viewport={"width": WIDTH, "height": HEIGHT})
    problems: list[str] = []
    view.on("pageerror", lambda error: problems.append(f"page error: {error}"))
    view.goto(report.as_uri(), wait_until="load")
    for css_id in answers:
        box = view.locator(f"#{css_id}").bounding_box()
        assert box is not None, f"{kind}: no #{css_id}"
        assert 0 <= box["y"] < HEIGHT, (kind, css_id, box)  # on the first screen
        assert box["x"] >= 0 and box["x"] + box["width"] <= WIDTH, (kind, css_id, box)
    images = view.eval_on_selector_all("img", "images => images.map(i => i.naturalWidth)")
    assert images and all(width > 100 for width in images), images  # every figure decoded
    assert view.evaluate("document.documentElement.scrollWidth") <= WIDTH
    shot = tmp_path / f"report-{kind}-1280x800.png"
    view.screenshot(path=str(shot))  # the first screen only
    view.close()
    assert problems == []
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
    if screens := os.environ.get("LLMTRAIN_REPORT_SCREENS"):
        Path(screens).mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, Path(screens) / shot.name)
    print(f"{kind} report, first screen: {shot}")
