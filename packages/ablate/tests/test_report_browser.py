"""The report in a real browser at a laptop's 1280x800: Debian's headless chromium lays the page
out; a small script added to a copy of it writes the bounding boxes of the verdict, its
sentences and the compare table's difference and p-value headers into the DOM, read back with
`--dump-dom`. The verdict must be visible without scrolling sideways (within the first 1280
pixels, starting within the first screen) and the page must not scroll sideways at all. A
screenshot of the page as it opens is taken, and its path printed (`pytest -s` shows it).
Needs Debian's chromium (`apt-get install chromium`): without it the test fails, saying so,
rather than passing unseen."""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess

import pytest

WIDTH, HEIGHT = 1280, 800
CHROMIUM = shutil.which("chromium")  # Debian's; nox -s ablate installs it where missing


@pytest.fixture(autouse=True)
def _chromium_installed():
    assert CHROMIUM, "needs Debian's chromium: apt-get install chromium (the nox session does)"


# run in the copy only: the report itself has no script
MEASURE = """<script>
const box = e => { const b = e.getBoundingClientRect();
  return {left: b.left, right: b.right, top: b.top, bottom: b.bottom}; };
const heads = [...document.querySelectorAll('#compare thead th')];
const layout = {
  width: window.innerWidth,
  scrollWidth: document.documentElement.scrollWidth,
  verdict: box(document.getElementById('verdict')),
  sentences: [...document.querySelectorAll('#verdict li')].map(box),
  diff: box(heads.find(h => h.textContent === 'diff')),
  p: box(heads.find(h => h.textContent === 'p (holm)')),
};
const out = document.createElement('pre');
out.id = 'layout';
out.textContent = JSON.stringify(layout);
document.body.appendChild(out);
</script>"""


def chromium(tmp_path, *args: str) -> subprocess.CompletedProcess:
    command = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--hide-scrollbars",
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
        f"--window-size={WIDTH},{HEIGHT}",
        *args,
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)


@pytest.fixture
def wide_sweep(tmp_path, make_run):
    """Four rows of two varied settings with long names, two seeds each: long verdicts with
    the weak-test warning, and a wide table of every result."""
    finals = {(1e-3, 2): [3.00, 3.10], (3e-3, 2): [2.80, 2.93], (1e-3, 4): [2.95, 3.02],
              (3e-3, 4): [2.70, 2.78]}  # fmt: skip
    for (lr, layers), values in finals.items():
        for seed, final in enumerate(values):
            name = f"lr={lr:g},n_layers={layers},seed={seed}"
            config = {"name": name, "seed": seed, "model": {"n_layers": layers},
                      "optimizer": {"lr": lr, "weight_decay_schedule": "cosine"}}  # fmt: skip
            summary = {"status": "finished", "tokens": 300, "wall_time_s": 51.5 + seed}
            losses = [4.0 - 0.1 * seed, 3.5 - 0.05 * seed, final + 0.05]
            make_run(tmp_path / "sweep", name, config, losses, [None, final + 0.3, final],
                     summary, tokens_per_s=12_345.0 + 100 * seed)  # fmt: skip
    return tmp_path / "sweep"


def test_the_verdict_is_visible_at_1280x800_without_scrolling_sideways(
    wide_sweep, run_cli, tmp_path
):
    page = tmp_path / "report.html"
    code, _, err = run_cli(
        "report",
        wide_sweep,
        "-o",
        page,
        "--baseline",
        "lr=0.001,n_layers=2",
        "--title",
        "lr x depth",
    )
    assert code == 0, err
    text = page.read_text(encoding="utf-8")
    assert "<script" not in text
    measured = tmp_path / "measured.html"
    measured.write_text(text.replace("</body>", MEASURE + "</body>"), encoding="utf-8")
    dom = chromium(tmp_path, "--dump-dom", measured.as_uri()).stdout
    found = re.search(r'<pre id="layout">(.*?)</pre>', dom, re.S)
    assert found, dom[-2000:]
    layout = json.loads(html.unescape(found.group(1)))
    assert layout["width"] == WIDTH, layout
    assert layout["scrollWidth"] <= WIDTH, layout  # the page never scrolls sideways
    verdict = layout["verdict"]
    assert 0 <= verdict["left"] and verdict["right"] <= WIDTH, layout
    assert verdict["top"] < HEIGHT / 2, layout  # it opens the page
    assert len(layout["sentences"]) == 3
    for sentence in layout["sentences"]:  # every sentence within the first screen's width
        assert 0 <= sentence["left"] and sentence["right"] <= WIDTH, layout
    assert layout["sentences"][0]["top"] < HEIGHT, layout
    for column in ("diff", "p"):  # the compare table's verdict columns on screen too
        assert layout[column]["right"] <= WIDTH, (column, layout)
    assert "Warning: with 2 seeds on a side this test is weak" in dom

    shot = tmp_path / "report-1280x800.png"
    chromium(tmp_path, f"--screenshot={shot}", page.as_uri())
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
    print(f"report screenshot (1280x800): {shot}")
