"""`llmtrain quickstart` replaces its previous run only when that run trained no more steps than
asked: a longer one (trained on with `llmtrain run ... training.steps=1200`) is refused in one
line unless `--overwrite`, before anything in --dir is written."""

from __future__ import annotations

import json

from llmtrain.train_loop.experiments.quickstart import trained_steps


def fake_run(work, *, committed=(), logged=()):
    run_dir = work / "runs" / "quickstart"
    (run_dir / "checkpoints").mkdir(parents=True)
    for step in committed:
        (run_dir / "checkpoints" / f"step-{step:08d}").mkdir()
        (run_dir / "checkpoints" / f"step-{step:08d}" / "COMMITTED").touch()
    (run_dir / "checkpoints" / "step-00099999").mkdir()  # not committed: not counted
    with open(run_dir / "metrics.jsonl", "w") as f:
        for step in logged:
            f.write(json.dumps({"step": step, "loss": 1.0}) + "\n")
        f.write('{"step": 99')  # cut short by a kill
    return run_dir


def test_trained_steps_counts_committed_checkpoints_and_logged_steps(tmp_path):
    assert trained_steps(tmp_path / "none") == 0
    assert trained_steps(fake_run(tmp_path / "a", committed=[300, 600], logged=[590])) == 600
    assert trained_steps(fake_run(tmp_path / "b", committed=[600], logged=[600, 610])) == 610


def test_a_longer_run_is_refused_without_overwrite(run_cli, tmp_path):
    work = tmp_path / "qs"
    run_dir = fake_run(work, committed=[600, 1200], logged=[1200])
    code, out, err = run_cli("quickstart", "--dir", work, "--steps", 10)
    assert code == 2 and out == ""
    assert err == (
        f"error: {run_dir} holds a quickstart run that trained 1200 steps, more than --steps 10; "
        "not replacing it: pass --overwrite to replace it, or use another --dir\n"
    )
    # nothing written: no data, no run config, the run as it was
    assert sorted(p.name for p in work.iterdir()) == ["runs"]
    assert trained_steps(run_dir) == 1200


def test_a_run_of_as_many_steps_or_overwrite_is_replaced(run_cli, tmp_path):
    work = tmp_path / "qs"
    run_dir = fake_run(work, committed=[4], logged=[4])
    code, _, err = run_cli("quickstart", "--dir", work, "--steps", 4, "--documents", 60)
    assert code == 0, err
    assert f"(replacing the previous quickstart run in {run_dir}, 4 steps)" in err
    fake_longer = work / "runs" / "quickstart" / "checkpoints" / "step-00000900"
    fake_longer.mkdir()
    (fake_longer / "COMMITTED").touch()
    code, _, err = run_cli("quickstart", "--dir", work, "--steps", 4, "--documents", 60)
    assert code == 2 and "trained 900 steps" in err
    code, _, err = run_cli(
        "quickstart", "--dir", work, "--steps", 4, "--documents", 60, "--overwrite"
    )
    assert code == 0, err
    assert f"(replacing the previous quickstart run in {run_dir}, 900 steps)" in err
    assert trained_steps(run_dir) == 4
