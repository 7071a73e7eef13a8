"""The installed `llmtrain` command with every package: fast start, no broken built-ins, one version."""

from __future__ import annotations

import importlib.metadata
import sys

from support import ROOT, run

DISTS = [
    "llmtrain",
    *(
        f"llmtrain-{p}"
        for p in ("core-mesh", "data-pack", "models", "parallel", "checkpoint", "train-loop")
    ),
]


def test_help_does_not_import_torch():
    probe = (
        "import sys, contextlib, io\n"
        "from llmtrain.core_mesh.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
        "    try: main(['--help'])\n"
        "    except SystemExit: pass\n"
        "print('config' in out.getvalue(), 'torch' in sys.modules)\n"
    )
    assert run([sys.executable, "-c", probe]).stdout == "True False\n"


def test_builtin_plugins_are_healthy():
    out = run(["llmtrain", "plugins", "--check"]).stdout
    assert "command  config" in out and "llmtrain-train-loop" in out


def test_all_distributions_share_the_repo_version():
    expected = (ROOT / "VERSION").read_text().split('"')[1]
    assert {d: importlib.metadata.version(d) for d in DISTS} == dict.fromkeys(DISTS, expected)
