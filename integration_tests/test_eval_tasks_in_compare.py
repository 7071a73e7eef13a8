"""`llmtrain eval-tasks` on a real run's checkpoint, then `llmtrain compare --downstream` on the
run: the scores eval-tasks printed are the run's `final_downstream/...` columns (eval-tasks
records them in `<run>/eval_tasks.json`, ablate's run reader picks them up), with no downstream
callback in the run. One tiny run of 10 steps on CPU."""

from __future__ import annotations

import json

import train_support as ts
from test_downstream_eval import write_tasks


def test_eval_tasks_scores_show_in_compare_downstream(tmp_path):
    data = ts.pack_corpus(tmp_path / "data")
    tasks = write_tasks(tmp_path)
    config = ts.run_config(data, tmp_path / "runs", name="x")
    config["training"] |= {"steps": 10, "checkpoint_every": 10}
    config["data"].pop("eval")
    ts.run(ts.llmtrain("run", ts.write_config(tmp_path / "run.yaml", config)), timeout=600)
    run_dir = tmp_path / "runs" / "x"

    spec = f"hellaswag={tasks['hellaswag']},lambada={tasks['lambada']}"
    scored = ts.run(
        ts.llmtrain(
            "eval-tasks", run_dir / "checkpoints", "--tasks", spec, "-o", tmp_path / "s.json"
        ),
        timeout=600,
    )
    assert f"scores of step 10 -> {run_dir / 'eval_tasks.json'}" in scored.stderr
    printed = json.loads((tmp_path / "s.json").read_text())["tasks"]
    recorded = json.loads((run_dir / "eval_tasks.json").read_text())
    assert [e["step"] for e in recorded["evaluations"]] == [10]

    table = ts.run(ts.llmtrain("compare", run_dir, "--downstream", "--json"), timeout=300)
    (row,) = json.loads(table.stdout)["rows"]
    results = row["results"]
    for task, metric in (("hellaswag", "acc"), ("hellaswag", "acc_norm"), ("lambada", "acc")):
        got = results[f"final_downstream/{task}/{metric}"]
        assert got["mean"] == printed[task][metric], (task, metric)
        assert got["stderr"] == printed[task][f"{metric}_stderr"], (task, metric)
    assert "final_downstream/lambada/perplexity" in results
    header = ts.run(ts.llmtrain("compare", run_dir, "--downstream"), timeout=300).stdout
    assert "final_downstream/hellaswag/acc" in header.splitlines()[0]
