"""`llmtrain which`: the documents it lists for a step are exactly the tokens each rank trained on
at that step, before and after a resume at another world size, and each is the record it names.

A 2-process gloo run (torchrun) trains on a mixture of a JSONL and a Parquet dataset packed in
small chunks, whose weights change at step 4 (a mixture schedule), then resumes in one process
with the same global batch. A callback plugin, found
through a real entry point (a module and its dist-info on PYTHONPATH), records every rank's batch
of each step, with the step number the run logs it under, as the Trainer's prefetcher reads it
(the run's plan read from its training windows; the Trainer asserts each batch it trains on is
the prefetcher's batch of that step)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import train_support as ts
from shared_fixtures import run_cli  # noqa: F401

RECORDER = '''
"""Writes each batch a rank trains on, with the step it is logged as, to consumed/rank<k>.jsonl."""
import json
from pathlib import Path

import attrs
import numpy as np
from llmtrain.core_mesh.interfaces import Callback
from llmtrain.core_mesh.plugins import hookimpl


@attrs.frozen
class NoOptions:
    pass


class RecordBatches(Callback):
    def __init__(self, options):
        pass

    def before_step(self, run, step):
        # the rank's batch of this step as the Trainer's prefetcher reads it: the run's plan,
        # read from the run's training windows
        batch = run.train_data.read(np.concatenate(run.plan.step(step - 1)))
        path = Path(run.run_dir) / "consumed" / f"rank{run.world.rank}.jsonl"
        path.parent.mkdir(exist_ok=True)
        line = {
            "step": step,
            "world": run.world.world_size,
            "samples": batch["samples"].tolist(),
            "tokens": batch["tokens"].tolist(),
        }
        with path.open("a") as f:
            f.write(json.dumps(line) + "\\n")


@hookimpl
def llmtrain_callbacks(register):
    register("record_batches", RecordBatches, options=NoOptions, help="record batches")
'''

STEPS_AT_TWO, STEPS = 6, 10
GLOBAL_BATCH = 8


@pytest.fixture(scope="module")
def recorder(tmp_path_factory):
    """A directory for PYTHONPATH holding the recorder module and its distribution's metadata."""
    base = tmp_path_factory.mktemp("recorder")
    (base / "record_batches.py").write_text(RECORDER)
    info = base / "llmtrain_record_batches-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: llmtrain-record-batches\nVersion: 1.0\n"
    )
    (info / "entry_points.txt").write_text("[llmtrain]\nrecord_batches = record_batches\n")
    return base


def _pack_inputs(directory: Path) -> dict:
    """A JSONL corpus (ids are line - 1) and a Parquet one (ids "p-<row>"), packed with the bytes
    tokenizer in chunks of 256 tokens; returns their paths and records by line or row."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from llmtrain.data_pack.pack import pack
    from llmtrain.train_loop.experiments.quickstart import write_corpus

    jsonl = directory / "a.jsonl"
    write_corpus(jsonl, 300, seed=0)
    lines = [json.loads(line) for line in jsonl.read_text(encoding="utf-8").splitlines()]
    write_corpus(directory / "b.jsonl", 200, seed=1)
    texts = [json.loads(line)["text"] for line in (directory / "b.jsonl").read_text().splitlines()]
    parquet = directory / "b.parquet"
    pq.write_table(pa.table({"id": [f"p-{i}" for i in range(len(texts))], "text": texts}), parquet)
    for source, name in ((jsonl, "a.zarr"), (parquet, "b.zarr")):
        pack([str(source)], str(directory / name), ts.BYTES, workers=1, chunk_tokens=256)
    return {
        "paths": [str(directory / "a.zarr"), str(directory / "b.zarr")],
        "records": [
            {number: (str(r["id"]), r["text"]) for number, r in enumerate(lines, 1)},
            {row: (f"p-{row}", text) for row, text in enumerate(texts)},
        ],
    }


@pytest.fixture(scope="module")
def trained(tmp_path_factory, recorder):
    """Steps 1-6 on 2 gloo processes, then steps 7-10 in one, recording what each rank read."""
    base = tmp_path_factory.mktemp("which")
    data = _pack_inputs(base)
    packed = SimpleNamespace(train=data["paths"][0], valid=data["paths"][0])
    config = ts.run_config(packed, base / "runs", name="mix")
    del config["data"]["eval"]
    config["data"]["train"] = [{"path": data["paths"][0]}, {"path": data["paths"][1]}]
    # a mixture schedule whose boundary the 2-process part crosses: `which` follows it
    config["data"]["phases"] = [{"weights": [0.7, 0.3], "until_step": 4}, {"weights": [0.2, 0.8]}]
    config["data"]["seed"] = 17
    config["training"] = {"steps": STEPS_AT_TWO, "log_every": 1, "checkpoint_every": 3}
    config["callbacks"] = [{"kind": "record_batches"}]
    path = ts.write_config(base / "run.yaml", config)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PYTHONPATH", str(recorder))
        ts.run(ts.torchrun(2, "run", path), timeout=900)
        # more steps than the cosine schedule was trained with: recomputed, as the test wants
        extend = (f"training.steps={STEPS}", "training.on_extend=recompute")
        resumed = ts.run(ts.llmtrain("run", path, *extend), timeout=900)
    assert "run.resumed" in resumed.stderr
    run_dir = base / "runs" / "mix"
    consumed = {}  # (step, rank) -> (samples, tokens)
    for rank in (0, 1):
        for line in (run_dir / "consumed" / f"rank{rank}.jsonl").read_text().splitlines():
            got = json.loads(line)
            consumed[got["step"], rank] = (got["samples"], np.asarray(got["tokens"]))
    return {**data, "run_dir": run_dir, "consumed": consumed}


def which(run_cli, *args) -> dict:  # noqa: F811 - the fixture, passed on
    code, out, err = run_cli("which", *map(str, args), "--json")
    assert code == 0, err
    return json.loads(out)


def listed_tokens(trained, sample: dict) -> np.ndarray:
    """The tokens of a listed sample, put back together from its documents' spans."""
    from llmtrain.data_pack.store import PackedDataset

    dataset = PackedDataset(trained["paths"][sample["dataset"]])
    return np.concatenate([dataset.read(*d["tokens"]) for d in sample["documents"]])


def test_the_run_logged_each_step_once_per_rank_at_each_world_size(trained):
    consumed = trained["consumed"]
    two = [(s, r) for s in range(1, STEPS_AT_TWO + 1) for r in (0, 1)]
    one = [(s, 0) for s in range(STEPS_AT_TWO + 1, STEPS + 1)]
    assert sorted(consumed) == sorted(two + one)
    logged = [m["step"] for m in ts.read_metrics(trained["run_dir"])]
    assert logged == list(range(1, STEPS + 1))


def test_each_rank_s_share_is_the_tokens_it_trained_on(trained, run_cli):  # noqa: F811
    for (step, rank), (samples, tokens) in sorted(trained["consumed"].items()):
        report = which(run_cli, trained["run_dir"], "--step", step, "--rank", rank)
        ranks = 2 if step <= STEPS_AT_TWO else 1
        assert (report["data_ranks"], report["data_step"]) == (ranks, step - 1)
        assert "logs/rank0.jsonl" in report["data_ranks_from"]
        assert [s["sample"] for s in report["samples"]] == samples, (step, rank)
        assert {s["rank"] for s in report["samples"]} == {rank}
        for sample, row in zip(report["samples"], tokens, strict=True):
            np.testing.assert_array_equal(listed_tokens(trained, sample), row, f"step {step}")
            assert sample["tokens"][1] - sample["tokens"][0] == 33


def test_the_whole_batch_is_the_ranks_shares_in_order(trained, run_cli):  # noqa: F811
    consumed = trained["consumed"]
    for step in (1, STEPS_AT_TWO, STEPS_AT_TWO + 1, STEPS):
        report = which(run_cli, trained["run_dir"], "--step", step)
        ranks = (0, 1) if step <= STEPS_AT_TWO else (0,)
        assert [s["sample"] for s in report["samples"]] == [
            sample for rank in ranks for sample in consumed[step, rank][0]
        ]
        per_rank = GLOBAL_BATCH // len(ranks)
        assert [s["rank"] for s in report["samples"]] == [
            i // per_rank for i in range(GLOBAL_BATCH)
        ]
        assert {s["dataset"] for s in report["samples"]} <= {0, 1}


def test_data_ranks_given_split_the_same_batch(trained, run_cli):  # noqa: F811
    consumed, run_dir = trained["consumed"], trained["run_dir"]
    # after the resume, as if read by two ranks: rank 1 takes the second half of the batch
    samples, tokens = consumed[STEPS, 0]
    report = which(run_cli, run_dir, "--step", STEPS, "--rank", 1, "--data-ranks", 2)
    assert report["data_ranks_from"] == "--data-ranks"
    assert [s["sample"] for s in report["samples"]] == samples[GLOBAL_BATCH // 2 :]
    for sample, row in zip(report["samples"], tokens[GLOBAL_BATCH // 2 :], strict=True):
        np.testing.assert_array_equal(listed_tokens(trained, sample), row)
    # before it, the two ranks' shares in one
    report = which(run_cli, run_dir, "--step", 2, "--rank", 0, "--data-ranks", 1)
    rows = np.concatenate([consumed[2, 0][1], consumed[2, 1][1]])
    for sample, row in zip(report["samples"], rows, strict=True):
        np.testing.assert_array_equal(listed_tokens(trained, sample), row)


def test_each_listed_document_is_the_record_it_names(trained, run_cli):  # noqa: F811
    from llmtrain.data_pack.store import PackedDataset
    from llmtrain.data_pack.tokenizer import BytesTokenizer

    tokenizer = BytesTokenizer()
    datasets = [PackedDataset(p) for p in trained["paths"]]
    seen = set()
    for step in (1, 4, STEPS):
        for sample in which(run_cli, trained["run_dir"], "--step", step, "--words", 3)["samples"]:
            for document in sample["documents"]:
                record_id, text = trained["records"][sample["dataset"]][document["number"]]
                assert document["id"] == record_id
                assert document["source"].endswith(("a.jsonl", "b.parquet")[sample["dataset"]])
                assert document["unit"] == ("line", "row")[sample["dataset"]]
                dataset = datasets[sample["dataset"]]
                assert tokenizer.decode(dataset.document(document["document"])) == text
                assert document["words"] == " ".join(text.split()[:3])
                start, stop = document["tokens"]
                window = [start - sample["tokens"][0], stop - sample["tokens"][0]]
                assert document["window"] == window
                doc_start, doc_stop = document["document_tokens"]
                assert document["cut_start"] == (doc_start < start)
                assert document["cut_end"] == (doc_stop > stop)
                seen.add(sample["dataset"])
    assert seen == {0, 1}


def test_the_text_report_names_files_lines_rows_and_ids(trained):
    proc = ts.run(ts.llmtrain("which", trained["run_dir"], "--step", 3, "--rank", 1), timeout=600)
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(f"{trained['run_dir']} step 3 (data step 2), rank 1's share: 4 ")
    assert sum(line.startswith("sample ") for line in lines) == GLOBAL_BATCH // 2
    assert any("a.jsonl:" in line for line in lines)
    header = next(line for line in lines if "first words" in line)
    assert header.split() == ["window", "document", "from", "id", "cut", "first", "words"]


def test_what_cannot_be_traced_is_one_clear_error(trained, run_cli, tmp_path):  # noqa: F811
    run_dir = trained["run_dir"]

    def error(*args) -> str:
        code, _, err = run_cli("which", *map(str, args))
        assert code == 2 and "Traceback" not in err, err
        [line] = ts.error_lines(err)
        return line

    assert (
        error(tmp_path, "--step", 1)
        == f"error: {tmp_path}: not a run directory (it has no config.yaml)"
    )
    assert (
        error(run_dir, "--step", STEPS + 1)
        == f"error: --step {STEPS + 1} is beyond the run's {STEPS} steps"
    )
    assert "steps count from 1" in error(run_dir, "--step", 0)
    assert error(run_dir, "--step", STEPS, "--rank", 1).startswith(
        f"error: --rank 1 is outside 0..0: step {STEPS}'s global batch was split over 1 data rank"
    )
    # a copy of the run whose first dataset lost its provenance
    bare = tmp_path / "bare.zarr"
    shutil.copytree(trained["paths"][0], bare)
    shutil.rmtree(bare / "doc_source")
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("checkpoints"))
    config = (copy / "config.yaml").read_text().replace(trained["paths"][0], str(bare))
    (copy / "config.yaml").write_text(config)
    line = error(copy, "--step", 1)
    assert line.startswith(f"error: data.train[0].path: {bare} records no provenance")
    assert "pack it again with `llmtrain data pack`" in line
    # without the logs, the world size of summary.json (the resumed, 1-process start)
    shutil.rmtree(copy / "logs")
    (copy / "config.yaml").write_text(config.replace(str(bare), trained["paths"][0]))
    report = which(run_cli, copy, "--step", STEPS)
    assert (report["data_ranks"], report["data_ranks_from"]) == (
        1,
        "summary.json: world size 1, the config's mesh",
    )
    (copy / "summary.json").unlink()
    assert "pass --data-ranks D" in error(copy, "--step", STEPS)
