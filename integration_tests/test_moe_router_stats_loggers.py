"""The `moe_router_stats` callback (llmtrain-moe) with the installed logger plugins: one
`llmtrain run` of moe-tiny logging to metrics.jsonl, TensorBoard and W&B (offline). TensorBoard's
own reader and wandb's give back every router metric of metrics.jsonl at its step; eval steps
and the other logged steps carry the same keys. (The figures themselves, at 1 and 2 ranks, are
llmtrain-moe's tests.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import train_support as ts

STEPS = 6
LAYER_KEYS = ("balance_loss", "max_load", "dropped_share", "z_loss")
ROUTER_KEYS = sorted(
    f"moe/{where}{key}" for where in ("layer0/", "layer1/", "") for key in LAYER_KEYS
)


@pytest.fixture
def hermetic_wandb(tmp_path, monkeypatch):
    """wandb's files and settings in a temporary home: no credentials, no network reporting."""
    import os

    for name in [n for n in os.environ if n.startswith("WANDB_")]:
        monkeypatch.delenv(name)
    home = tmp_path / "wandb-home"
    for name in ("DIR", "CACHE_DIR", "CONFIG_DIR", "DATA_DIR", "ARTIFACT_DIR"):
        (home / name.lower()).mkdir(parents=True)
        monkeypatch.setenv(f"WANDB_{name}", str(home / name.lower()))
    monkeypatch.setenv("HOME", str(home))
    for name, value in (("SILENT", "true"), ("ERROR_REPORTING", "false"),
                        ("DISABLE_GIT", "true"), ("DISABLE_CODE", "true")):  # fmt: skip
        monkeypatch.setenv(f"WANDB_{name}", value)


def tensorboard_values(log_dir) -> dict[tuple[int, str], float]:
    """(step, tag) -> value of the `moe/` scalars, as TensorBoard's Python loader reads them."""
    from tensorboard.backend.event_processing import plugin_event_accumulator as pea
    from tensorboard.util import tensor_util

    acc = pea.EventAccumulator(str(log_dir), size_guidance={pea.TENSORS: 0})
    acc.Reload()
    tags = [tag for tag in acc.Tags()["tensors"] if tag.startswith("moe/")]
    return {
        (e.step, tag): tensor_util.make_ndarray(e.tensor_proto).item()
        for tag in tags
        for e in acc.Tensors(tag)
    }


def wandb_values(run_dir) -> dict[tuple[int, str], float]:
    """(step, key) -> value of the `moe/` keys in the run's `.wandb` log (wandb's reader)."""
    (path,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    cmd = [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(path)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True).stdout
    history = [r["history"] for r in map(json.loads, out.splitlines()) if r["type"] == "history"]
    return {
        (h["step"]["num"], key): value
        for h in history
        for key, value in h["item"].items()
        if key.startswith("moe/")
    }


def test_router_metrics_reach_tensorboard_and_wandb(tmp_path, hermetic_wandb):
    data = ts.pack_corpus(tmp_path / "data")
    config = ts.run_config(data, tmp_path / "runs")
    config["model"] = {"kind": "moe-tiny", "max_seq_len": 64, "d_model": 32, "mlp_hidden": 32,
                       "capacity_factor": 1.0}  # fmt: skip
    config["data"]["eval"]["every"] = 3
    config["training"] = {"steps": STEPS, "log_every": 2}  # logged: 2, 3 (eval), 4, 6 (eval)
    config["callbacks"] = [{"kind": "moe_router_stats"}]
    config["loggers"] = [
        {"kind": "jsonl"},
        {"kind": "tensorboard"},
        {"kind": "wandb", "mode": "offline", "project": "llmtrain-tests"},
    ]
    path = ts.write_config(tmp_path / "run.yaml", config)
    proc = ts.run(ts.llmtrain("run", path), timeout=300)
    assert "Traceback" not in proc.stderr
    run_dir = tmp_path / "runs" / "run"

    metrics = ts.read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [2, 3, 4, 6]
    for line in metrics:
        assert sorted(k for k in line if k.startswith("moe/")) == ROUTER_KEYS, line["step"]
        assert 0.0 < line["moe/dropped_share"] < 1.0  # capacity 1.0 drops some choices
        assert line["moe/balance_loss"] >= 1.0 - 1e-6 and line["moe/max_load"] >= 1.0
    want = {(m["step"], k): v for m in metrics for k, v in m.items() if k.startswith("moe/")}
    assert tensorboard_values(run_dir / "tensorboard") == pytest.approx(want, rel=1e-6)
    assert wandb_values(run_dir) == pytest.approx(want, rel=1e-12)
