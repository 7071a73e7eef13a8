"""`llmtrain average` on a real run: the mean of its last three checkpoints is a checkpoint that
`eval`, `eval-tasks`, `generate` and `export` read like the run's own, its exported weights are
the mean of the three steps' exported weights (float64 sums, one rounding to float32), and a run
pointed at it to resume is refused in one line. One tiny run of 15 steps on CPU."""

from __future__ import annotations

import json
import math

import torch
import train_support as ts
import yaml
from safetensors.torch import load_file
from shared_fixtures import run_cli  # noqa: F401
from test_downstream_eval import write_tasks


def test_the_average_of_a_runs_last_checkpoints_evaluates_and_exports(tmp_path, run_cli):  # noqa: F811
    data = ts.pack_corpus(tmp_path / "data")
    config = ts.run_config(data, tmp_path / "runs", name="x")
    config["training"] |= {"steps": 15, "checkpoint_every": 5}
    config["data"].pop("eval")
    ts.run(ts.llmtrain("run", ts.write_config(tmp_path / "run.yaml", config)), timeout=600)
    checkpoints = tmp_path / "runs" / "x" / "checkpoints"
    assert ts.committed_steps(checkpoints) == [5, 10, 15]

    averaged = tmp_path / "averaged"
    code, out, err = run_cli("average", checkpoints, "--last", 3, "-o", averaged, "--json")
    assert code == 0, err
    done = json.loads(out)
    assert (done["steps"], done["step"]) == ([5, 10, 15], 15)
    assert done["checkpoint"] == f"{averaged}/step-15"

    # export: the averaged weights are the mean of the three steps' exported weights
    exported = {}
    for step in (5, 10, 15):
        code, _, err = run_cli("export", checkpoints, "--step", step, "-o", tmp_path / f"e{step}")
        assert code == 0, err
        exported[step] = load_file(tmp_path / f"e{step}" / "model.safetensors")
    code, _, err = run_cli("export", averaged, "-o", tmp_path / "e-avg")
    assert code == 0, err
    got = load_file(tmp_path / "e-avg" / "model.safetensors")
    assert got.keys() == exported[15].keys() and done["tensors"] == len(got)
    for name, value in got.items():
        expected = torch.stack([exported[s][name] for s in (5, 10, 15)]).double().mean(0).float()
        assert torch.equal(value, expected), name
    options = json.loads((tmp_path / "e-avg" / "model_options.json").read_text())
    assert options == json.loads((tmp_path / "e15" / "model_options.json").read_text())

    # eval and generate read it (model options and tokenizer from the newest step's info)
    code, out, err = run_cli("eval", averaged, "--data", data.valid, "--batches", 2)
    assert code == 0, err
    result = json.loads(out)
    assert result["step"] == 15 and math.isfinite(result["loss"])
    code, out, err = run_cli("generate", averaged, "--prompt", "The cat", "--max-new-tokens", 8)
    assert code == 0, err
    assert out.startswith("The cat")

    # eval-tasks scores it (seq_len from the info), recording nothing in the source run
    tasks = write_tasks(tmp_path)
    code, out, err = run_cli(
        "eval-tasks", averaged, "--tasks", f"hellaswag={tasks['hellaswag']}",
        "-o", tmp_path / "scores.json",
    )  # fmt: skip
    assert code == 0, err
    scores = json.loads((tmp_path / "scores.json").read_text())
    assert scores["step"] == 15 and "acc" in scores["tasks"]["hellaswag"]
    assert not (tmp_path / "runs" / "x" / "eval_tasks.json").exists()

    # a run whose checkpoint.dir is the average cannot resume from it: one line, nothing written
    config["name"], config["checkpoint"]["dir"] = "y", str(averaged)
    config["training"]["steps"] = 20
    path = tmp_path / "resume.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    proc = ts.run(ts.llmtrain("run", path, "--resume"), timeout=300, check=False)
    assert proc.returncode == 2, proc.stderr
    assert ts.error_lines(proc.stderr) == [
        f"error: {averaged}/step-15 is the mean of steps 5, 10, 15 of {checkpoints} (`llmtrain "
        "average`): it holds model weights only, no optimizer state or counters, so a run cannot "
        f"resume from it; resume from {checkpoints}, or start a new run from these weights with "
        f"init: {{from: {averaged}}}"
    ]
    assert ts.committed_steps(averaged) == [15]
    assert sorted(p.name for p in averaged.iterdir()) == ["step-15"]
