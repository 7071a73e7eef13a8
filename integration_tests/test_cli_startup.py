"""The installed `llmtrain` command with every package: fast start, no broken built-ins, one version."""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import sys

from support import PACKAGES, ROOT, run

DISTS = ["llmtrain", *(f"llmtrain-{p}" for p in PACKAGES)]


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
    rows = {tuple(line.split()[:3]) for line in out.splitlines()[1:] if line.strip()}
    assert ("command", "config", "train_loop") in rows
    assert {("command", name, "data_pack") for name in ["data"]} <= rows
    assert {("command", name, "checkpoint") for name in ["export", "checkpoints"]} <= rows
    assert {("command", name, "ablate") for name in ["compare", "plot", "profile", "ranks"]} <= rows
    assert {("tokenizer", name, "data_pack") for name in ["bytes", "hf", "tiktoken"]} <= rows
    assert ("parallel", "default", "parallel") in rows
    listed = json.loads(run(["llmtrain", "plugins", "--json"]).stdout)
    assert listed["problems"] == []


def test_all_distributions_share_the_repo_version():
    expected = (ROOT / "VERSION").read_text().split('"')[1]
    assert {d: importlib.metadata.version(d) for d in DISTS} == dict.fromkeys(DISTS, expected)
