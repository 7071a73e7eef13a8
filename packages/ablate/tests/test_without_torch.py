"""`llmtrain compare` and `llmtrain ranks` with torch not importable: a sweep written here in the
layout training writes (manifest.json; per run config.yaml with its provenance header,
metrics.jsonl, summary.json, logs/rank<k>.jsonl) prints the tables the commands printed when they
lived in train-loop. The `ablate` nox session installs only core-mesh and this package; the
command also runs in a child process that blocks `import torch`, so the check holds anywhere."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

# `llmtrain ARGS` in a fresh interpreter where `import torch` raises ImportError, as where it
# is not installed (a None in sys.modules would look like an imported torch to libraries that
# check sys.modules, as scipy does)
BLOCKED = textwrap.dedent(
    """\
    import sys

    class NoTorch:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "torch":
                raise ImportError(f"{name} is blocked")

    sys.meta_path.insert(0, NoTorch())
    from llmtrain.core_mesh.cli import main
    code = main(sys.argv[1:])
    assert "torch" not in sys.modules, "torch was imported"
    sys.exit(code)
    """
)

# the compare table as rich draws it, the narrow default columns: the final eval loss with its
# 95% interval over the seeds (two seeds: t(0.975, 1 dof) = 12.706, so 3.0 ± 12.706 x 0.1414 /
# sqrt(2) = [1.7294, 4.2706]) and tokens/s without one (an interval of throughput means nothing)
COMPARE_TABLE = """\
n_layers  runs  status      final_eval_loss                   tokens_per_s
──────────────────────────────────────────────────────────────────────────
1         2     2 finished  3.0000 ± 0.1414 [1.7294, 4.2706]  10,300 ± 424
2         2     2 finished  2.5500 ± 0.0707 [1.9147, 3.1853]  7,350 ± 212
"""
RANKS_TABLE = """\
rank  windows  step s (median)        p90  data wait  sync wait   late by   peak MiB
   0       11           0.0414     0.0422      1.00%      4.00%     0.00%        612
   1       11           0.0454     0.0462      1.50%      0.50%     4.00%        624  <- slowest
slowest: rank 1; the others wait for it 4.0% of the time (it arrives last at the collectives); its data wait is 1.50%
"""
STEPS = 12


def resolved_config(name: str, sweep: Path, n_layers: int, seed: int) -> dict:
    """A run's resolved config, as `llmtrain run` writes it (every section filled)."""
    return {
        "name": name,
        "seed": seed,
        "run_dir": str(sweep),
        "device": "cpu",
        "model": {"kind": "tiny", "vocab_size": 320, "max_seq_len": 64, "n_layers": n_layers},
        "data": {
            "train": [{"path": "/data/train.zarr", "weight": 1.0}],
            "seq_len": 32,
            "micro_batch": 4,
            "global_batch": 8,
            "eval": {"path": "/data/valid.zarr", "every": 6, "batches": 2},
        },
        "optimizer": {"kind": "adamw", "lr": 0.003, "weight_decay": 0.1},
        "lr_scheduler": {"kind": "cosine", "warmup_steps": 3, "min_ratio": 0.1},
        "mesh": {"dp_replicate": 1, "dp_shard": -1, "cp": 1, "tp": 1, "pp": 1},
        "training": {"steps": STEPS, "log_every": 1, "checkpoint_every": 6},
        "checkpoint": {"dir": None, "keep_last": 10, "resume": "auto"},
        "loggers": [{"kind": "console"}, {"kind": "jsonl"}],
    }


def write_run(run: Path, config: dict, final: float, speed: float, wall: float) -> None:
    """config.yaml, metrics.jsonl (a line per step, eval at 6 and 12), summary.json and one JSON
    log per rank (2 ranks; rank 1 arrives late at the collectives)."""
    (run / "logs").mkdir(parents=True)
    header = "# written by llmtrain run\n# llmtrain-core-mesh 0.1.0\n# torch 2.13.0\n"
    (run / "config.yaml").write_text(header + yaml.safe_dump(config, sort_keys=False))
    lines = []
    for step in range(1, STEPS + 1):
        row = {
            "step": step,
            "loss": round(final + 0.1 + 0.2 * (STEPS - step), 4),
            "lr": 0.003,
            "grad_norm": 1.5,
            "tokens": step * 256,
            "tokens_per_s": speed if step > 1 else 100.0,
            "step_time_s": 0.04,
            "data_wait": 0.01,
            "peak_memory_mib": 600.0,
            "mfu": speed / 60_000 if step > 1 else 0.001,
        }
        if step % 6 == 0:
            row |= {"eval_loss": final + (0.3 if step == 6 else 0.0), "eval_ppl": 10.0}
        lines.append(json.dumps(row))
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    summary = {
        "status": "finished",
        "step": STEPS,
        "total_steps": STEPS,
        "tokens": STEPS * 256,
        "wall_time_s": wall,
        "world_size": 2,
        "error": None,
    }
    (run / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    for rank in (0, 1):
        log = [{"event": "run.start", "rank": rank, "level": "info"}]
        for step in range(1, STEPS + 1):
            log.append(
                {
                    "event": "step",
                    "level": "debug",
                    "rank": rank,
                    "step": step,
                    "step_time_s": 0.04 + 0.004 * rank + 0.0002 * step,
                    "data_wait": 0.01 + 0.005 * rank,
                    "sync_wait": 0.04 if rank == 0 else 0.005,
                    "arrival_lag": 0.04 * rank,
                    "peak_memory_mib": 600.0 + 12 * rank + step,
                }
            )
        text = "\n".join(json.dumps(entry) for entry in log) + "\n"
        (run / "logs" / f"rank{rank}.jsonl").write_text(text)


@pytest.fixture
def sweep(tmp_path) -> Path:
    return write_sweep(tmp_path / "sweeps" / "abl")


def write_sweep(sweep: Path) -> Path:
    """A sweep of model.n_layers=1,2 with 2 seeds each, with its manifest."""
    results = {  # (n_layers, seed): final eval loss, tokens/s, wall time
        (1, 0): (2.9, 10_000.0, 12.0),
        (1, 1): (3.1, 10_600.0, 15.0),
        (2, 0): (2.5, 7_200.0, 19.0),
        (2, 1): (2.6, 7_500.0, 21.0),
    }
    runs = []
    for (n_layers, seed), (final, speed, wall) in results.items():
        run_id = f"n_layers={n_layers},seed={seed}"
        config = resolved_config(run_id, sweep, n_layers, seed)
        write_run(sweep / run_id, config, final, speed, wall)
        runs.append({"id": run_id, "settings": {"model.n_layers": n_layers, "seed": seed}})
    manifest = {"name": "abl", "varied": ["model.n_layers", "seed"], "runs": runs}
    (sweep / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return sweep


def llmtrain_without_torch(*args: object) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", BLOCKED, *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)


def test_compare_prints_the_same_table_without_torch(sweep):
    proc = llmtrain_without_torch("compare", sweep)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == COMPARE_TABLE


def test_ranks_prints_the_same_table_without_torch(sweep):
    proc = llmtrain_without_torch("ranks", sweep / "n_layers=2,seed=0")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == RANKS_TABLE


def test_the_commands_are_ablates():
    """They come from this package's plugin, whatever else is installed."""
    proc = llmtrain_without_torch("plugins", "--json")
    assert proc.returncode == 0, proc.stderr
    entries = json.loads(proc.stdout)["entries"]
    owners = {e["name"]: (e["plugin"], e["package"]) for e in entries if e["kind"] == "command"}
    for name in ("compare", "plot", "profile", "ranks"):
        assert owners[name] == ("ablate", "llmtrain-ablate"), owners
