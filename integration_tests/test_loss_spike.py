"""The loss-spike monitor (callback kind `loss_spike`) in real `llmtrain run` processes. The
training data is read in stored order (`data.shuffle: false`) from a corpus packed so that the
global batch of exactly one step is random symbols the text never has: that step's loss jumps
to about twice the recent median, the steps around it are ordinary. The monitor fires there and
only there, on 2 gloo ranks too (each rank logs its own samples, rank 0 the batch and both data
ranks' losses), not at all on the same corpus without the garbage, and `stop: true` ends the run
after the spike with summary status `stopped`."""

from __future__ import annotations

import json
import random

import pytest
import train_support as ts

SEQ_LEN, GLOBAL_BATCH = 32, 8
STEP_TOKENS = SEQ_LEN * GLOBAL_BATCH  # bytes tokenizer: a token per byte, plus one per document
SPIKE_STEP, STEPS = 20, 22
GARBAGE = "BCDEFGHJKLMNPQRUVWXYZ#$%&*+<=>@^_~|012456789"  # none is in the generated text
SPIKE = {"kind": "loss_spike", "factor": 1.5, "window": 8, "min_steps": 5}


def write_corpus(path, garbage_step: int | None, documents: int = 400) -> None:
    """Sentences (quickstart's grammar); with `garbage_step`, one document of STEP_TOKENS
    garbage symbols starts exactly at that step's first token (a filler document before it
    ends where it must), so the step's windows are all garbage and no other window is."""
    from llmtrain.train_loop.experiments.quickstart import sentence

    rng = random.Random(0)
    texts, offset = [], 0
    target = None if garbage_step is None else (garbage_step - 1) * STEP_TOKENS
    while len(texts) < documents:
        text = " ".join(sentence(rng) for _ in range(rng.randint(2, 12)))
        size = len(text.encode()) + 1  # its bytes and the end-of-document token
        if target is not None and offset + size + 2 > target:
            filler = text.encode("ascii", "ignore").decode() * 8
            texts.append(filler[: target - offset - 1])
            texts.append("".join(rng.choice(GARBAGE) for _ in range(STEP_TOKENS)))
            offset, target = target + STEP_TOKENS + 1, None
            continue
        texts.append(text)
        offset += size
    with open(path, "w", encoding="utf-8") as f:
        for i, text in enumerate(texts):
            f.write(json.dumps({"id": i, "text": text}) + "\n")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from llmtrain.data_pack.loader import open_windows
    from llmtrain.data_pack.pack import pack

    directory = tmp_path_factory.mktemp("data")
    paths = {}
    for name, garbage_step in (("clean", None), ("garbage", SPIKE_STEP)):
        write_corpus(directory / f"{name}.jsonl", garbage_step)
        paths[name] = str(directory / f"{name}.zarr")
        pack([str(directory / f"{name}.jsonl")], paths[name], ts.BYTES, workers=1)
    # the placement, checked on what was packed: the spike step's 8 windows are garbage
    windows = open_windows([paths["garbage"]], SEQ_LEN, shuffle=False)
    tokens = windows.read(list(range(400)))["tokens"]
    symbols = set(GARBAGE.encode())
    garbage = [i for i, row in enumerate(tokens) if sum(int(t) in symbols for t in row) > 1]
    assert garbage == list(range((SPIKE_STEP - 1) * GLOBAL_BATCH, SPIKE_STEP * GLOBAL_BATCH))
    return paths


def config(data_path: str, tmp_path, name: str, **spike) -> tuple:
    run_dir = tmp_path / "runs"
    config = {
        "name": name,
        "seed": 3,
        "run_dir": str(run_dir),
        "device": "cpu",
        "model": {"kind": "tiny", "max_seq_len": 64, "d_model": 32},
        "data": {
            "train": [{"path": data_path}],
            "seq_len": SEQ_LEN,
            "micro_batch": 4,
            "global_batch": GLOBAL_BATCH,
            "shuffle": False,  # the stored order: step s reads windows 8(s-1) .. 8s-1
        },
        "optimizer": {"kind": "adamw", "lr": 1e-2},
        "lr_scheduler": {"kind": "constant", "warmup_steps": 3},
        "training": {"steps": STEPS, "log_every": 1},
        "callbacks": [{**SPIKE, **spike}],
    }
    return ts.write_config(tmp_path / f"{name}.yaml", config), run_dir / name


def events(run_dir, rank: int, name: str) -> list[dict]:
    lines = (run_dir / "logs" / f"rank{rank}.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == name]


def summary(run_dir) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def test_a_normal_run_has_no_spike(data, tmp_path):
    path, run_dir = config(data["clean"], tmp_path, "clean")
    ts.run(ts.llmtrain("run", path), timeout=300)
    metrics = ts.read_metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert not [m["step"] for m in metrics if "loss_spike" in m or "loss_spike_ratio" in m]
    assert [m["loss_spikes"] for m in metrics] == [0.0] * STEPS
    assert events(run_dir, 0, "loss.spike") == []
    assert summary(run_dir)["status"] == "finished"


def test_the_garbage_step_is_a_spike_on_two_ranks(data, tmp_path):
    path, run_dir = config(data["garbage"], tmp_path, "two")
    proc = ts.run(ts.torchrun(2, "run", path), timeout=300)
    assert ts.error_lines(proc.stderr) == []
    metrics = ts.by_step(ts.read_metrics(run_dir))
    assert list(metrics) == list(range(1, STEPS + 1))
    fired = {s: m["loss_spike_ratio"] for s, m in metrics.items() if "loss_spike" in m}
    assert list(fired) == [SPIKE_STEP], fired
    assert fired[SPIKE_STEP] > 1.5 and metrics[SPIKE_STEP]["loss_spike"] == 1.0
    assert [m["loss_spikes"] for m in metrics.values()] == [0.0] * (SPIKE_STEP - 1) + [1.0] * (
        STEPS - SPIKE_STEP + 1
    )
    (main,) = events(run_dir, 0, "loss.spike")
    first = (SPIKE_STEP - 1) * GLOBAL_BATCH
    assert main["step"] == SPIKE_STEP and main["loss"] == pytest.approx(
        metrics[SPIKE_STEP]["loss"], rel=1e-6
    )
    assert main["ratio"] == pytest.approx(fired[SPIKE_STEP], rel=1e-6)
    assert main["sequences"] == [first, first + GLOBAL_BATCH] and main["epoch"] == 0
    # each data rank read half of the garbage: both losses are high, their mean is the loss
    losses = main["rank_losses"]
    assert len(losses) == 2 and min(losses) > 1.5 * main["median"]
    assert sum(losses) / 2 == pytest.approx(main["loss"], rel=1e-5)
    assert main["highest_data_rank"] == losses.index(max(losses))
    (other,) = events(run_dir, 1, "loss.spike")
    assert other["step"] == SPIKE_STEP and "rank_losses" not in other
    halves = [list(range(first, first + 4)), list(range(first + 4, first + 8))]
    assert [main["samples"], other["samples"]] == [[halves[0]], [halves[1]]]
    assert [main["windows"], other["windows"]] == halves  # stored order: sample i is window i
    assert summary(run_dir)["status"] == "finished"


def test_stop_true_ends_the_run_after_the_spike(data, tmp_path):
    path, run_dir = config(data["garbage"], tmp_path, "stop", stop=True)
    ts.run(ts.llmtrain("run", path), timeout=300)
    done = summary(run_dir)
    assert (done["status"], done["step"]) == ("stopped", SPIKE_STEP)
    assert ts.read_metrics(run_dir)[-1]["step"] == SPIKE_STEP
    (stopped,) = events(run_dir, 0, "run.stopped")
    assert stopped["message"].startswith(f"loss spike at step {SPIKE_STEP}: loss ")
    assert ts.committed_steps(run_dir / "checkpoints") == []  # stopped without saving
