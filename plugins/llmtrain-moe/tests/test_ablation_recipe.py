"""The README's sweep recipe (expert granularity x balancing scheme) plans the runs it promises:
the command written in examples/moe-ablation.yaml, which the README shows too, checked by
`llmtrain sweep --dry-run` (every run's config built and validated, nothing written)."""

from __future__ import annotations

import itertools
import shlex
from pathlib import Path

import torch
from llmtrain_moe.model import build_model
from llmtrain_moe.options import preset_options
from shared_fixtures import run_cli  # noqa: F401

PLUGIN = Path(__file__).resolve().parents[1]
EXAMPLE = PLUGIN / "examples" / "moe-ablation.yaml"


def recipe() -> list[str]:
    """The `llmtrain sweep` command of the example's header, as argv (without `llmtrain`)."""
    lines = [line.removeprefix("#").strip() for line in EXAMPLE.read_text().splitlines()]
    start = next(i for i, line in enumerate(lines) if line.startswith("llmtrain sweep"))
    command = ""
    for line in lines[start:]:
        command += " " + line.removesuffix("\\").strip()
        if not line.endswith("\\"):
            break
    return shlex.split(command)[1:]


def test_the_readme_shows_the_examples_command():
    readme = " ".join((PLUGIN / "README.md").read_text().replace("\\\n", " ").split())
    assert " ".join(["llmtrain", *recipe()]) in readme


def test_the_recipe_plans_granularity_times_balancing_times_seeds(run_cli, tmp_path, monkeypatch):  # noqa: F811
    argv = recipe()
    assert argv[:2] == ["sweep", "plugins/llmtrain-moe/examples/moe-ablation.yaml"]
    monkeypatch.chdir(tmp_path)  # nothing is written, and the data need not exist
    code, out, err = run_cli("sweep", EXAMPLE, *argv[2:], "--dry-run")
    assert code == 0, err
    runs = [line for line in out.splitlines() if "seed=" in line]
    assert "sweep moe-ablation: 24 runs" in out + err
    shapes = [(4, 1, 128), (16, 4, 32), (32, 8, 16)]
    expected = {
        f"aux_loss_weight={aux},bias_update_rate={bias},n_experts={e},top_k={k},"
        f"mlp_hidden={h},seed={seed}"
        for aux, bias, (e, k, h), seed in itertools.product(
            ("0", "0.01"), ("0", "0.001"), shapes, (0, 1)
        )
    }
    assert set(runs) == expected and len(runs) == 24
    assert not (tmp_path / "sweeps").exists()
    # the granularities keep olmoe-tiny's total and active parameters, but for the routers
    # (2 layers of d_model 64 x n_experts)
    counts = set()
    for e, k, h in shapes:
        with torch.device("meta"):
            model = build_model(preset_options("olmoe-tiny", n_experts=e, top_k=k, mlp_hidden=h))
        total = model.describe().n_params - 2 * 64 * e
        counts.add((total, total - model.inactive_params()))
    assert counts == {(272_960 - 2 * 64 * 16, 125_504 - 2 * 64 * 16)}
