"""A training step reads nothing from the device: llmtrain's code calls no `item`, `tolist`,
`__float__`, `__bool__`, `cpu`, ... on a tensor inside a step, nor after a step that is neither
logged nor saved. Counted by a TorchFunctionMode over real runs (host_sync_worker.py), in one
process and in two FSDP ranks; torch's own calls (its CPU optimizers read their step counters
with `item()`) are not ours and not counted."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from support import torchrun
from train_support import by_step, pack_corpus, read_metrics, run, run_config, write_config

WORKER = Path(__file__).with_name("host_sync_worker.py")
STEPS, LOG_EVERY, SAVE_EVERY, EVAL_EVERY = 12, 4, 6, 12


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("syncs")
    config = run_config(pack_corpus(tmp / "data"), tmp / "runs")
    config["data"]["eval"]["every"] = EVAL_EVERY
    config["training"].update(steps=STEPS, log_every=LOG_EVERY, checkpoint_every=SAVE_EVERY)
    return config


def check(record: dict) -> None:
    logged = {s for s in range(1, STEPS + 1) if s % LOG_EVERY == 0 or s == STEPS}
    saved = {s for s in range(1, STEPS + 1) if s % SAVE_EVERY == 0}
    assert record["logged"] == sorted(logged)
    assert record["inside"] == {}, "host reads inside a step"
    after = {int(step): calls for step, calls in record["after"].items()}
    quiet = {step: calls for step, calls in after.items() if step not in logged | saved}
    assert quiet == {}, "host reads after a step that is neither logged nor saved"
    # a logged step reads its metrics once: one tolist, whatever the number of metrics
    for step in logged:
        reads = [c for c in after.get(step, []) if "metrics.py" in c]
        assert len(reads) == 1, (step, after.get(step))


def test_one_process_reads_the_device_only_at_logged_and_saved_steps(config, tmp_path):
    config = {**config, "name": "one", "run_dir": str(tmp_path / "runs")}
    path = write_config(tmp_path / "run.yaml", config)
    out = tmp_path / "reads.json"
    run([sys.executable, str(WORKER), str(path), str(out)], timeout=600)
    check(json.loads(out.read_text()))
    recorded(tmp_path / "runs" / "one", data_ranks=1)


def test_debug_host_syncs_reads_inside_every_step_as_before(config, tmp_path):
    """`debug.host_syncs` puts back the reads a step made before (what the GPU kit's *-syncs
    steps measure), and the counter sees them: the count before the forward and the finite
    check before the optimizer step, at every step."""
    config = {**config, "name": "syncs", "run_dir": str(tmp_path / "runs")}
    config["debug"] = {"host_syncs": True}
    path = write_config(tmp_path / "run.yaml", config)
    out = tmp_path / "reads.json"
    run([sys.executable, str(WORKER), str(path), str(out)], timeout=600)
    inside = json.loads(out.read_text())["inside"]
    assert sorted(map(int, inside)) == list(range(1, STEPS + 1))
    for calls in inside.values():
        assert [c.split()[0] for c in calls] == ["__float__", "__bool__"], calls
        assert all("trainer.py" in c and "train_step" in c for c in calls), calls


def test_fsdp_ranks_read_the_device_only_at_logged_and_saved_steps(config, tmp_path):
    config = {**config, "name": "fsdp", "run_dir": str(tmp_path / "runs")}
    config["mesh"] = {"dp_shard": 2}
    path = write_config(tmp_path / "run.yaml", config)
    out = tmp_path / "reads.json"
    torchrun(WORKER, path, out, nproc=2, timeout=600)
    for rank in (0, 1):
        check(json.loads(Path(f"{out}.rank{rank}").read_text()))
    recorded(tmp_path / "runs" / "fsdp", data_ranks=2)


def recorded(run_dir: Path, data_ranks: int) -> None:
    """The worker's `record_metric("probe/steps", step, reduce="sum", better="higher")`: in the
    logged lines, summed over the data ranks, and its direction in summary.json beside the
    built-in metrics'."""
    metrics = by_step(read_metrics(run_dir))
    assert {s: m["probe/steps"] for s, m in metrics.items()} == {
        s: float(s * data_ranks) for s in (4, 8, 12)
    }
    better = json.loads((run_dir / "summary.json").read_text())["better"]
    assert better["probe/steps"] == "higher"
    assert better["loss"] == better["eval_loss"] == "lower"
    assert better["tokens_per_s"] == "higher"
