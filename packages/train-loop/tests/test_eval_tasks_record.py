"""`llmtrain eval-tasks` records a checkpoint's scores in its run directory
(`<run>/eval_tasks.json`) where `llmtrain compare --downstream` reads them (ablate's run
reader): the run directory found from `<run>/checkpoints` or one of its steps (and not for a
checkpoint elsewhere), a task scored again at a step replacing its scores there, steps kept in
order, the file rewritten whole (no temporary file left), and the scores read back as
`downstream/<task>/<metric>` lines. No model is needed: the writing part alone."""

from __future__ import annotations

import json

from llmtrain.ablate import compare, runs
from llmtrain.train_loop.eval_tasks import RUN_SCORES, record_in_run, run_dir_of


def make_run_dir(root):
    run = root / "runs" / "x"
    (run / "checkpoints" / "step-20").mkdir(parents=True)
    (run / "config.yaml").write_text("name: x\nseed: 0\n")
    lines = [{"step": s, "loss": 4.0 - s / 10, "tokens": 64 * s} for s in (10, 20)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    return run


def test_the_run_directory_of_a_checkpoint(tmp_path):
    run = make_run_dir(tmp_path)
    assert run_dir_of(str(run / "checkpoints")) == run.resolve()
    assert run_dir_of(str(run / "checkpoints" / "step-20")) == run.resolve()
    assert run_dir_of(str(tmp_path / "elsewhere" / "checkpoints")) is None
    assert run_dir_of(str(run)) is None  # a run directory is not a checkpoint
    assert run_dir_of("s3://bucket/runs/x/checkpoints") is None


def test_scores_are_recorded_and_read_back_by_compare(tmp_path):
    run = make_run_dir(tmp_path)
    settings = {"shots": 0, "seed": 1234, "limit": None, "max_len": 64}
    hellaswag = {"scoring": "multiple_choice", "items": 50, "truncated": 0, "acc": 0.3,
                 "acc_stderr": 0.06, "acc_norm": 0.32, "acc_norm_stderr": 0.07}  # fmt: skip
    path = record_in_run(run, 20, {"hellaswag": {**hellaswag, **settings}})
    assert path == run / RUN_SCORES
    record_in_run(run, 10, {"hellaswag": {**hellaswag, "acc": 0.25, **settings}})
    wiki = {"scoring": "perplexity", "items": 5, "truncated": 0, "bits_per_byte": 2.5}
    record_in_run(run, 20, {"wiki": {**wiki, **settings}})
    record_in_run(run, 20, {"hellaswag": {**hellaswag, "acc": 0.35, **settings}})  # again
    document = json.loads(path.read_text())
    assert document["format"] == 1
    assert [e["step"] for e in document["evaluations"]] == [10, 20]
    at_20 = document["evaluations"][1]["tasks"]
    assert set(at_20) == {"hellaswag", "wiki"} and at_20["hellaswag"]["acc"] == 0.35
    assert at_20["hellaswag"]["shots"] == 0 and at_20["wiki"]["evaluated"].endswith("Z")
    assert sorted(p.name for p in run.iterdir()) == [
        "checkpoints", "config.yaml", "eval_tasks.json", "eval_tasks.json.lock", "metrics.jsonl"
    ]  # fmt: skip

    found = runs.find_runs([run])
    assert runs.downstream_metrics(found) == [
        "downstream/hellaswag/acc",
        "downstream/hellaswag/acc_norm",
        "downstream/wiki/bits_per_byte",
    ]
    _, rows = compare.table(found, metrics=runs.downstream_metrics(found))
    (row,) = rows
    assert row.stats("final_downstream/hellaswag/acc") == (0.35, None)
    assert row.stderr("final_downstream/hellaswag/acc") == 0.06
    assert row.stats("best_downstream/hellaswag/acc") == (0.35, None)
    assert row.stats("final_downstream/wiki/bits_per_byte") == (2.5, None)
    assert found[0].series("downstream/hellaswag/acc", "tokens") == ([640, 1280], [0.25, 0.35])
