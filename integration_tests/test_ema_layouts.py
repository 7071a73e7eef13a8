"""The `ema` callback at two gloo ranks, under FSDP, tensor parallelism and a 2-stage pipeline:
each run's saved average equals a hand computation from the weights it saved at every step (the
average is updated on each rank's own shards, pieces or stage), an average saved at one layout
resumes at another, and the average is scored and exported with `--weights ema` (`eval-tasks
--last` records each step's scores of it as `<task>@ema`; `hf export` writes it)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import train_support as ts
from test_downstream_eval import write_tasks

from llmtrain.checkpoint.export import load_model_weights

STEPS, DECAY, START = 8, 0.7, 2
LAYOUTS = {"fsdp": [], "pp": ["mesh.pp=2"], "tp": ["mesh.tp=2"]}


def weights(run_dir, step: int, which: str = "model") -> dict[str, torch.Tensor]:
    return load_model_weights(str(run_dir / "checkpoints"), step=step, weights=which)[0]


def by_hand(run_dir, last: int) -> dict[str, torch.Tensor]:
    average = {k: v.float().clone() for k, v in weights(run_dir, START).items()}
    for step in range(START + 1, last + 1):
        current = weights(run_dir, step)
        average = {k: torch.lerp(v, current[k].float(), 1 - DECAY) for k, v in average.items()}
    return average


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An 8-step run with the callback, saved at every step, at each layout (side by side)."""
    tmp = tmp_path_factory.mktemp("ema")
    data = ts.pack_corpus(tmp / "data")
    config = ts.run_config(data, tmp / "runs")
    config["training"] |= {"steps": STEPS, "checkpoint_every": 1}
    config["data"]["eval"] |= {"every": 4}
    config["checkpoint"]["keep_last"] = 20
    config["callbacks"] = [{"kind": "ema", "decay": DECAY, "start": START}]
    path = ts.write_config(tmp / "run.yaml", config)
    done = ts.side_by_side(
        *(ts.torchrun(2, "run", path, f"name={name}", *over) for name, over in LAYOUTS.items()),
        timeout=900,
    )
    for proc in done:
        assert proc.returncode == 0, proc.stderr[-6000:]
    return {"tmp": tmp, "path": path, **{name: tmp / "runs" / name for name in LAYOUTS}}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_average_equals_a_hand_computation_at_each_layout(runs, layout):
    run_dir = runs[layout]
    for step in (START, 5, STEPS):
        got, expected = weights(run_dir, step, "ema"), by_hand(run_dir, step)
        assert got.keys() == expected.keys()
        for name, value in expected.items():
            assert torch.equal(got[name], value), (layout, step, name)
    metrics = ts.by_step(ts.read_metrics(run_dir))
    for step in (4, 8):
        assert metrics[step]["eval/ema/loss"] != metrics[step]["eval_loss"]


def test_an_average_saved_by_the_pipeline_resumes_under_fsdp(runs):
    run_dir = runs["tmp"] / "runs" / "moved"
    (run_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(runs["pp"] / "checkpoints" / "step-5", run_dir / "checkpoints" / "step-5")
    proc = ts.run(ts.torchrun(2, "run", runs["path"], "name=moved"), timeout=600)
    assert "run.resumed" in proc.stderr
    got, want = weights(run_dir, STEPS, "ema"), weights(runs["pp"], STEPS, "ema")
    for name, value in want.items():  # another layout sums in another order: close, not equal
        torch.testing.assert_close(got[name], value, rtol=1e-4, atol=1e-5)


def test_eval_tasks_scores_the_last_averages_and_hf_export_writes_one(runs, tmp_path):
    from safetensors.torch import load_file

    run_dir = runs["fsdp"]
    tasks = write_tasks(tmp_path)
    spec = f"hellaswag={tasks['hellaswag']},lambada={tasks['lambada']}"
    out = tmp_path / "scores.json"
    ts.run(
        ts.llmtrain(
            "eval-tasks", run_dir / "checkpoints", "--last", 2, "--weights", "ema",
            "--tasks", spec, "-o", out,
        ),
        timeout=600,
    )  # fmt: skip
    report = json.loads(out.read_text())
    assert [e["step"] for e in report["evaluations"]] == [STEPS - 1, STEPS]
    assert {e["weights"] for e in report["evaluations"]} == {"ema"}
    recorded = json.loads((run_dir / "eval_tasks.json").read_text())["evaluations"]
    assert [e["step"] for e in recorded] == [STEPS - 1, STEPS]
    for entry, printed in zip(recorded, report["evaluations"], strict=True):
        assert set(entry["tasks"]) == {"hellaswag@ema", "lambada@ema"}
        assert entry["tasks"]["hellaswag@ema"]["acc"] == printed["tasks"]["hellaswag"]["acc"]

    exported = tmp_path / "hf"
    ts.run(
        ts.llmtrain("hf", "export", run_dir / "checkpoints", "-o", exported, "--weights", "ema"),
        timeout=600,
    )
    assert json.loads((exported / "llmtrain.json").read_text())["weights"] == "ema"
    tensors = load_file(str(exported / "model.safetensors"))
    average, own = weights(run_dir, STEPS, "ema"), weights(run_dir, STEPS)
    embedding = next(k for k in average if "emb" in k or k.startswith("tok"))
    (hf_embedding,) = [v for k, v in tensors.items() if k.endswith("embed_tokens.weight")]
    assert torch.equal(hf_embedding, average[embedding])
    assert not torch.equal(hf_embedding, own[embedding])
