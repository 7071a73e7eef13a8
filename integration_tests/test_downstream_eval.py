"""Downstream evaluation end to end: the `downstream` callback scores tasks inside real
`llmtrain run` processes, on one process and on 2 gloo ranks under FSDP, TP, a 2-stage
pipeline and cp=2, with the same log-likelihoods (to 1e-5) and the same accuracies for every
item; `llmtrain eval-tasks` scores a checkpoint offline with the numbers the run logged at that
step; bad task input stops both with one line naming file:line."""

from __future__ import annotations

import json
import math
import random

import pytest
import train_support as ts
from shared_fixtures import run_cli  # noqa: F401

from llmtrain.train_loop.experiments.quickstart import sentence

STEPS, EVERY = 4, 2
HELLASWAG_ITEMS, LAMBADA_ITEMS, DOCUMENTS = 13, 9, 5  # odd counts: ranks get unequal shares


def write_tasks(directory) -> dict[str, str]:
    """A HellaSwag-layout file (some contexts longer than the model's 32 tokens, so truncated),
    a LAMBADA-layout file and documents for rolling perplexity (longer than a window)."""
    rng = random.Random(7)
    paths = {name: directory / f"{name}.jsonl" for name in ("hellaswag", "lambada", "docs")}
    with open(paths["hellaswag"], "w") as f:
        for i in range(HELLASWAG_ITEMS):
            words = sentence(rng).split(" ")
            row = {
                "ind": i,
                "activity_label": "Pets",
                "ctx_a": " ".join(words[: 2 + i % 3])
                if i % 4
                else sentence(rng) + " " + sentence(rng),
                "ctx_b": "then",
                "ctx": "",
                "endings": [sentence(rng) for _ in range(4)],
                "source_id": f"x~{i}",
                "split": "val",
                "split_type": "indomain",
                "label": rng.randrange(4),
            }
            f.write(json.dumps(row) + "\n")
    with open(paths["lambada"], "w") as f:
        for _ in range(LAMBADA_ITEMS):
            f.write(json.dumps({"text": sentence(rng).rstrip(".!?")}) + "\n")
    with open(paths["docs"], "w") as f:
        for _ in range(DOCUMENTS):
            text = " ".join(sentence(rng) for _ in range(rng.randint(1, 4)))
            f.write(json.dumps({"text": text}) + "\n")
    return {name: str(path) for name, path in paths.items()}


def downstream_callback(tasks: dict[str, str]) -> dict:
    return {
        "kind": "downstream",
        "every": EVERY,
        "save_items": True,
        "tasks": [
            {"kind": "hellaswag", "path": tasks["hellaswag"], "shots": 1},
            {"kind": "lambada", "path": tasks["lambada"], "shots": 1},
            {"kind": "perplexity", "path": tasks["docs"]},
        ],
    }


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("downstream")
    data = ts.pack_corpus(tmp / "data")
    tasks = write_tasks(tmp)
    config = ts.run_config(data, tmp / "runs", name="ref")
    config["training"] |= {"steps": STEPS, "checkpoint_every": None}
    # a vanishing lr: every layout scores the same weights (training under another layout
    # moves them apart by ~1e-4, which would hide what is compared here, the scoring)
    config["optimizer"]["lr"] = 1e-12
    config["data"].pop("eval")
    config["callbacks"] = [downstream_callback(tasks)]
    path = ts.write_config(tmp / "run.yaml", config)
    proc = ts.run(ts.llmtrain("run", path), timeout=600)
    return {"tmp": tmp, "path": path, "tasks": tasks, "proc": proc, "dir": tmp / "runs" / "ref"}


def items_of(run_dir, step: int, task: str) -> list[dict]:
    path = run_dir / "downstream" / f"step-{step}" / f"{task}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def lls(item: dict) -> list[float]:
    return item["loglikelihoods"] if "loglikelihoods" in item else [item["loglikelihood"]]


def downstream_metrics(run_dir) -> dict[int, dict]:
    return {
        step: {
            k: v for k, v in m.items() if k.startswith("downstream/") and k != "downstream/seconds"
        }
        for step, m in ts.by_step(ts.read_metrics(run_dir)).items()
        if any(k.startswith("downstream/") for k in m)
    }


def test_the_run_logs_downstream_metrics_every_n_steps(reference):
    assert ts.error_lines(reference["proc"].stderr) == []
    metrics = downstream_metrics(reference["dir"])
    assert sorted(metrics) == [2, 4]
    for step in (2, 4):
        m = metrics[step]
        items = items_of(reference["dir"], step, "hellaswag")
        assert len(items) == HELLASWAG_ITEMS
        assert [i["where"].rsplit(":", 1)[1] for i in items] == [
            str(n) for n in range(1, HELLASWAG_ITEMS + 1)
        ]
        accuracies = [i["acc"] for i in items]
        assert m["downstream/hellaswag/acc"] == pytest.approx(sum(accuracies) / len(items))
        assert m["downstream/hellaswag/acc_stderr"] > 0
        assert m["downstream/hellaswag/truncated"] >= 1  # the long contexts were cut
        for item in items:
            lls = item["loglikelihoods"]
            assert item["acc"] == float(lls.index(max(lls)) == item["gold"])
        lambada = items_of(reference["dir"], step, "lambada")
        assert len(lambada) == LAMBADA_ITEMS
        assert m["downstream/lambada/acc"] == pytest.approx(
            sum(i["acc"] for i in lambada) / LAMBADA_ITEMS
        )
        docs = items_of(reference["dir"], step, "perplexity")
        total = sum(d["loglikelihood"] for d in docs)
        n_bytes = sum(d["bytes"] for d in docs)
        assert m["downstream/perplexity/bits_per_byte"] == pytest.approx(
            -total / n_bytes / 0.6931471805599453, rel=1e-9
        )
        # bytes tokenizer: a token per byte, every one scored once
        assert sum(d["tokens"] for d in docs) == n_bytes


@pytest.mark.parametrize(
    ("layout", "overrides"),
    [
        ("fsdp", []),
        ("tp", ["mesh.tp=2"]),
        ("pp", ["mesh.pp=2"]),
        ("cp", ["mesh.cp=2"]),
    ],
)
def test_two_ranks_score_every_item_as_one_process(reference, layout, overrides):
    name = f"two-{layout}"
    proc = ts.run(
        ts.torchrun(2, "run", reference["path"], f"name={name}", "training.steps=2", *overrides),
        timeout=600,
    )
    assert ts.error_lines(proc.stderr) == []
    run_dir = reference["tmp"] / "runs" / name
    expected, got = downstream_metrics(reference["dir"]), downstream_metrics(run_dir)
    assert sorted(got) == [2]
    for step in (2,):
        for task in ("hellaswag", "lambada", "perplexity"):
            mine, theirs = items_of(reference["dir"], step, task), items_of(run_dir, step, task)
            assert [i["where"] for i in theirs] == [i["where"] for i in mine]
            for a, b in zip(mine, theirs, strict=True):
                assert lls(b) == pytest.approx(lls(a), abs=1e-5, rel=1e-6), (task, a["where"])
                assert b.get("acc") == a.get("acc") and b.get("acc_norm") == a.get("acc_norm")
        for key, value in expected[step].items():
            if "perplexity" in key:  # exp(-mean log-likelihood): compare the log-likelihoods
                assert math.log(got[step][key]) == pytest.approx(math.log(value), rel=1e-5), key
            else:
                assert got[step][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


def test_eval_tasks_scores_a_checkpoint_like_the_run(reference, run_cli, tmp_path):  # noqa: F811
    tasks, out = reference["tasks"], tmp_path / "scores.json"
    code, stdout, err = run_cli(
        "eval-tasks", reference["dir"] / "checkpoints",
        "--tasks", f"hellaswag={tasks['hellaswag']},lambada={tasks['lambada']},perplexity={tasks['docs']}",
        "--shots", 1, "-o", out, "--per-item", "--batch-size", 5,
    )  # fmt: skip
    assert code == 0, err
    logged = downstream_metrics(reference["dir"])[STEPS]
    header, _, *lines = stdout.splitlines()
    assert header.split() == ["task", "items", "truncated", "metric", "value"]
    assert lines[0].split()[:4] == [
        "hellaswag",
        str(HELLASWAG_ITEMS),
        str(int(logged["downstream/hellaswag/truncated"])),
        "acc",
    ]
    acc, stderr = logged["downstream/hellaswag/acc"], logged["downstream/hellaswag/acc_stderr"]
    assert f"{acc:.4f} ± {stderr:.4f}" in lines[0]
    report = json.loads(out.read_text())
    assert report["step"] == STEPS and report["shots"] == 1
    for task in ("hellaswag", "lambada", "perplexity"):
        scored = report["tasks"][task]
        for key, value in scored.items():
            if key in ("scoring", "items", "truncated", "per_item"):
                continue
            expected = logged[f"downstream/{task}/{key}"]
            if "perplexity" in key:  # exp(-mean log-likelihood): compare the log-likelihoods
                value, expected = math.log(value), math.log(expected)
            assert value == pytest.approx(expected, rel=1e-5), (task, key)
        in_run = items_of(reference["dir"], STEPS, task)
        for a, b in zip(in_run, scored["per_item"], strict=True):
            assert lls(b) == pytest.approx(lls(a), rel=1e-6, abs=1e-5)


def test_bad_task_input_is_one_line(reference, run_cli, tmp_path):  # noqa: F811
    checkpoints = reference["dir"] / "checkpoints"
    code, _, err = run_cli("eval-tasks", checkpoints, "--tasks", "helaswag=x.jsonl")
    assert code != 0
    assert "did you mean 'hellaswag'" in err and "Traceback" not in err
    bad = tmp_path / "bad.jsonl"
    rows = [json.loads(line) for line in open(reference["tasks"]["hellaswag"])][:3]
    rows[1]["label"] = 7
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, out, err = run_cli("eval-tasks", checkpoints, "--tasks", f"hellaswag={bad}")
    assert code != 0 and out == ""
    assert f"{bad}:2: field 'label': 7 is not the index of one of 4 choices" in err
    # in a run: stopped before its first step, naming the file and line
    config = ts.write_config(
        tmp_path / "bad.yaml",
        {**__import__("yaml").safe_load(reference["path"].read_text()), "name": "bad-task"},
    )
    proc = ts.run(
        ts.llmtrain("run", config, f"callbacks.0.tasks.0.path={bad}"), timeout=600, check=False
    )
    assert proc.returncode != 0
    assert f"{bad}:2: field 'label'" in proc.stderr
    assert not (reference["tmp"] / "runs" / "bad-task" / "checkpoints").exists() or not list(
        (reference["tmp"] / "runs" / "bad-task" / "checkpoints").glob("step-*")
    )
