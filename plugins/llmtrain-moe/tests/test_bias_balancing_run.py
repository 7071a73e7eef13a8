"""Auxiliary-loss-free balancing through `llmtrain run` end to end: the parallel strategy moves
the routing bias after each optimizer step, the router statistics in metrics.jsonl show the
effect, and the bias is checkpointed: a run resumed from a checkpoint continues exactly.

Two runs of the moe-tiny shape of test_train_cli.py with no auxiliary loss, one without any
balancing (one expert ends in every token's top 2: `moe/max_load` 2.0, the most top-2 of 4
allows) and one with `bias_update_rate: 0.005` (measured: 1.46 over the last 10 steps). The
rate is 5x DeepSeek's 0.001 because the run has 30 steps; 0.03 and more overshoot (the bias is
one value per expert for all tokens) and balance worse."""

from __future__ import annotations

import shutil

import pytest
import torch
import train_support as ts

from llmtrain.core_mesh.plugins import PluginManager
from llmtrain.train_loop.saved_model import load_model

STEPS = 30
MODEL = {
    "kind": "moe-tiny",
    "max_seq_len": 64,
    "d_model": 32,
    "mlp_hidden": 32,
    "tied_embeddings": False,
    "aux_loss_weight": 0.0,
}
RATE = 0.005


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The two runs side by side: name -> (config path, run directory, metrics by step)."""
    tmp = tmp_path_factory.mktemp("bias")
    data = ts.pack_corpus(tmp / "data")
    paths = {}
    for name, rate in (("none", 0.0), ("bias", RATE)):
        config = ts.run_config(data, tmp / "runs", name=name)
        config["model"] = {**MODEL, "bias_update_rate": rate}
        config["callbacks"] = [{"kind": "moe_router_stats"}]
        paths[name] = ts.write_config(tmp / f"{name}.yaml", config)
    procs = ts.side_by_side(*(ts.llmtrain("run", path) for path in paths.values()), timeout=300)
    for proc in procs:
        assert proc.returncode == 0, proc.stderr[-2000:]
    return {
        name: (path, tmp / "runs" / name, ts.by_step(ts.read_metrics(tmp / "runs" / name)))
        for name, path in paths.items()
    }


def _late_max_load(metrics: dict[int, dict]) -> float:
    return sum(metrics[s]["moe/max_load"] for s in range(STEPS - 9, STEPS + 1)) / 10


def _biases(checkpoints, step: int) -> list[torch.Tensor]:
    model, _, _ = load_model(str(checkpoints), step, PluginManager(blocked=()).load_entry_points())
    return [moe.expert_bias for moe in model.moe_layers().values()]


def test_the_bias_keeps_the_router_from_collapsing(runs):
    none, bias = runs["none"][2], runs["bias"][2]
    assert list(none) == list(bias) == list(range(1, STEPS + 1))
    # the same start: the bias is zero until the first optimizer step
    assert bias[1]["moe/max_load"] == none[1]["moe/max_load"]
    assert _late_max_load(none) > 1.95, _late_max_load(none)
    assert _late_max_load(bias) < 1.65, _late_max_load(bias)
    assert bias[STEPS]["loss"] == pytest.approx(none[STEPS]["loss"], rel=0.02)  # learns alike


def test_the_bias_is_in_the_checkpoint_and_a_resume_continues_exactly(runs):
    path, run_dir, whole = runs["bias"]
    checkpoints = run_dir / "checkpoints"
    final = _biases(checkpoints, STEPS)
    halfway = _biases(checkpoints, 15)
    # each entry moved by whole multiples of the rate, up and down
    for b in (*final, *halfway):
        assert b.abs().sum() > 0 and torch.allclose(b / RATE, (b / RATE).round(), atol=1e-3)
    assert not all(torch.equal(a, b) for a, b in zip(final, halfway, strict=True))
    for step in (20, 25, 30):
        shutil.rmtree(checkpoints / f"step-{step}")
    proc = ts.run(ts.llmtrain("run", path), timeout=300)
    assert "run.resumed" in proc.stderr and "step=15" in proc.stderr
    resumed = ts.by_step(ts.read_metrics(run_dir))
    assert list(resumed) == list(whole)
    for step in range(16, STEPS + 1):
        for key in ("loss", "grad_norm", "moe/max_load", "moe/balance_loss"):
            assert resumed[step][key] == whole[step][key], (step, key)
    again = _biases(checkpoints, STEPS)
    assert all(torch.equal(a, b) for a, b in zip(again, final, strict=True))


def test_two_data_ranks_move_the_bias_as_one_process(runs):
    """FSDP over 2 gloo ranks, one micro-batch of 4 sequences each: the strategy sums both ranks'
    counts, which are the one process's 2 micro-batches, so the bias moves alike (bit for bit)
    and the losses follow (a bias moved on one rank's counts alone would route otherwise)."""
    path, run_dir, whole = runs["bias"]
    proc = ts.run(ts.torchrun(2, "run", path, "name=two-fsdp"), timeout=300)
    assert ts.error_lines(proc.stderr) == []
    two_dir = run_dir.parent / "two-fsdp"
    got = ts.by_step(ts.read_metrics(two_dir))
    ts.assert_close_runs(whole, got, 1e-4, ["loss", "grad_norm", "eval_loss"])
    # (the router figures are not compared: one process reports its last micro-batch of 4
    # sequences, the 2 ranks theirs of 8)
    final = _biases(run_dir / "checkpoints", STEPS)
    assert all(
        torch.equal(a, b)
        for a, b in zip(_biases(two_dir / "checkpoints", STEPS), final, strict=True)
    )
