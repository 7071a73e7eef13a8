"""Shared test setup for ablate's unit tests: `run_cli` runs `llmtrain ...` in this process;
`make_run` writes a run directory as training writes it."""

from __future__ import annotations

import json

import pytest
import yaml
from shared_fixtures import run_cli  # noqa: F401


@pytest.fixture
def make_run():
    """`make_run(root, name, config, losses, evals=(), summary=None, tokens_per_s=1000.0)`:
    a run directory with config.yaml, one metrics line per loss (the eval loss where `evals`
    has one) and a half-written last line, and summary.json when given."""
    return _make_run


def _make_run(root, name, config, losses, evals=(), summary=None, tokens_per_s=1000.0):
    path = root / name
    path.mkdir(parents=True)
    (path / "config.yaml").write_text("# header\n" + yaml.safe_dump(config))
    lines = []
    for step, loss in enumerate(losses, 1):
        row = {"step": step, "loss": loss, "tokens": step * 100, "tokens_per_s": tokens_per_s}
        if step - 1 < len(evals) and evals[step - 1] is not None:
            row["eval_loss"] = evals[step - 1]
        lines.append(json.dumps(row))
    (path / "metrics.jsonl").write_text("\n".join(lines) + "\n{half-writ")
    if summary is not None:
        (path / "summary.json").write_text(json.dumps(summary))
    return path
