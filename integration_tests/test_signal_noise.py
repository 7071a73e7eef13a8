"""Signal and noise on a real sweep (issue 49): `llmtrain sweep` trains 2 variants x 2 seeds of a
tiny model (16 steps, a checkpoint and an evaluation every 4), `llmtrain eval-tasks --last 4`
scores each run's last 4 checkpoints, and `llmtrain compare --json` gives each task's signal,
checkpoint noise, seed noise and signal-to-noise ratio equal to a recomputation by hand from
each run's `eval_tasks.json` (and the eval loss's from `metrics.jsonl`), with numpy alone."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import train_support as ts
import yaml
from test_downstream_eval import write_tasks

STEPS, EVERY, LAST = 16, 4, 4


def test_compare_gives_each_tasks_signal_and_noise_of_a_real_sweep(tmp_path):
    data = ts.pack_corpus(tmp_path / "data")
    tasks = write_tasks(tmp_path)
    config = ts.run_config(data, tmp_path / "unused", "sn")
    config["data"]["eval"]["every"] = EVERY
    config["training"].update(steps=STEPS, log_every=4, checkpoint_every=EVERY)
    base = ts.write_config(tmp_path / "base.yaml", config)
    sweeps = tmp_path / "sweeps"
    ts.run(
        ts.llmtrain("sweep", base, "--grid", "model.n_layers=1,2", "--seeds", 2, "--dir", sweeps),
        timeout=600,
    )
    (manifest,) = sweeps.glob("*/manifest.json")
    run_dirs = [manifest.parent / r["id"] for r in json.loads(manifest.read_text())["runs"]]
    assert len(run_dirs) == 4

    spec = f"hellaswag={tasks['hellaswag']},lambada={tasks['lambada']}"
    procs = [
        ts.start(ts.llmtrain("eval-tasks", d / "checkpoints", "--last", LAST, "--tasks", spec))
        for d in run_dirs
    ]
    for proc in procs:
        done = ts.finish(proc, 600)
        assert done.returncode == 0, done.stderr[-3000:]

    document = json.loads(ts.run(ts.llmtrain("compare", manifest.parent, "--json")).stdout)
    got = {entry["metric"]: entry for entry in document["signal_noise"]}
    metrics = [f"downstream/{t}/{m}" for t in ("hellaswag", "lambada") for m in ("acc",)]
    metrics += ["downstream/hellaswag/acc_norm", "downstream/lambada/perplexity", "eval_loss"]
    assert set(metrics) <= set(got), sorted(got)

    def values(run_dir, metric):
        if metric == "eval_loss":
            lines = ts.read_metrics(run_dir)
            return [m["eval_loss"] for m in lines if "eval_loss" in m][-LAST:]
        _, task, name = metric.split("/")
        evaluations = json.loads((run_dir / "eval_tasks.json").read_text())["evaluations"]
        assert [e["step"] for e in evaluations] == [4, 8, 12, 16]
        return [e["tasks"][task][name] for e in evaluations][-LAST:]

    variants: dict[int, list[str]] = {}
    for d in run_dirs:
        n_layers = yaml.safe_load((d / "config.yaml").read_text())["model"]["n_layers"]
        variants.setdefault(n_layers, []).append(d)
    for metric in metrics:
        x = {v: [np.array(values(d, metric)) for d in ds] for v, ds in variants.items()}
        runs_x = [r for rs in x.values() for r in rs]
        assert all(len(r) == LAST for r in runs_x)
        ckpt = math.sqrt(sum(((r - r.mean()) ** 2).sum() for r in runs_x) / (4 * (LAST - 1)))
        m_v = {v: np.mean([r.mean() for r in rs]) for v, rs in x.items()}
        s_b2 = sum((r.mean() - m_v[v]) ** 2 for v, rs in x.items() for r in rs) / 2
        seed = math.sqrt(max(0.0, s_b2 - ckpt**2 / LAST))
        signal = abs(m_v[1] - m_v[2])
        entry = got[metric]
        assert entry["signal"] == pytest.approx(signal, rel=1e-9, abs=1e-12), metric
        assert entry["checkpoint_noise"] == pytest.approx(ckpt, rel=1e-9, abs=1e-12), metric
        assert entry["seed_noise"] == pytest.approx(seed, rel=1e-9, abs=1e-12), metric
        if ckpt > 0:
            assert entry["snr"] == pytest.approx(signal / ckpt, rel=1e-9), metric
        else:  # a task of a few items whose score never moved: an infinite ratio, null in JSON
            assert entry["snr"] is None
        se = math.sqrt(2 * (seed**2 / 2 + ckpt**2 / (2 * LAST)))
        assert entry["decided"] == bool(signal > 0 and signal >= 1.959963984540054 * se)
        assert entry["sentence"].startswith(f"{metric}: signal ")

    table = ts.run(ts.llmtrain("compare", manifest.parent)).stdout
    assert "signal and noise" in table and "downstream/hellaswag/acc_norm" in table
