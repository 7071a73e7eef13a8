"""Warm start (`init: {from: ...}`) end to end: a run pretrained in one process is fine-tuned
under FSDP on 2 gloo ranks starting from exactly its weights, with a fresh optimizer and counters
from 0; a fine-tune with a real learning rate starts at the pretrained loss; a fine-tune killed
with SIGKILL resumes its own checkpoint, not init.from; bad sources are refused by name. Every
run is a real `llmtrain run` (a subprocess, or in process for the refusals)."""

from __future__ import annotations

import json
import math
import os
import signal
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp
import train_support as ts
from shared_fixtures import run_cli  # noqa: F401

from llmtrain.checkpoint.export import load_model_weights
from llmtrain.checkpoint.safe_io import SafeLoadPlanner
from llmtrain.checkpoint.stream_storage import StreamReader
from llmtrain.data_pack.pack import pack
from llmtrain.train_loop.experiments.quickstart import write_corpus

PRETRAIN_STEPS = 20
# bytes plus one special token at the end: the same ids for text, another fingerprint
MORE_SPECIALS = {"kind": "bytes", "special_tokens": ["<|endoftext|>", "<|pad|>", "<|user|>"]}


def _pack(root: Path, tokenizer: dict, name: str) -> str:
    source = root / "train.jsonl"
    if not source.exists():
        write_corpus(source, 150, seed=0)
    out = str(root / f"{name}.zarr")
    pack([str(source)], out, tokenizer, overwrite=True, workers=1)
    return out


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A tiny model trained PRETRAIN_STEPS steps in one process (checkpoints every 10)."""
    root = tmp_path_factory.mktemp("warm")
    data = SimpleNamespace(train=_pack(root, ts.BYTES, "train"), valid=None)
    config = ts.run_config(data, root / "runs", name="pre")
    config["data"].pop("eval")
    config["training"].update(steps=PRETRAIN_STEPS, checkpoint_every=10)
    ts.run(ts.llmtrain("run", ts.write_config(root / "pre.yaml", config)), timeout=600)
    run_dir = root / "runs" / "pre"
    return SimpleNamespace(
        root=root,
        data=data,
        config=config,
        checkpoints=run_dir / "checkpoints",
        metrics=ts.by_step(ts.read_metrics(run_dir)),
    )


def fine_tune(pretrained, name: str, **training) -> dict:
    """The pretraining config as a new run starting from its checkpoints."""
    config = json.loads(json.dumps(pretrained.config))
    config.update(name=name, init={"from": str(pretrained.checkpoints)})
    config["training"].update({"checkpoint_every": None, **training})
    return config


def optimizer_steps(checkpoint: Path) -> set[float]:
    """The AdamW `step` of every parameter in a committed step directory."""
    reader = StreamReader(str(checkpoint))
    stored = reader.read_metadata().state_dict_metadata
    steps = {k: torch.empty(()) for k in stored if k.startswith("train.optim.state.")}
    steps = {k: v for k, v in steps.items() if k.endswith(".step")}
    assert steps, "no optimizer step counts in the checkpoint"
    with warnings.catch_warnings():  # one process without a process group: the intent
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(steps, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
    return {v.item() for v in steps.values()}


@pytest.mark.parametrize(
    ("layout", "mesh"),
    [("fsdp", {}), ("pp", {"pp": 2})],  # each pipeline stage reads only its own tensors
)
def test_two_rank_fine_tune_starts_from_exactly_the_pretrained_weights(pretrained, layout, mesh):
    """One step on 2 ranks whose update is zero (gradients clipped to norm 0, no weight decay):
    the saved weights are the pretrained ones bit for bit, the optimizer state is new."""
    name = f"ft-{layout}"
    config = fine_tune(pretrained, name, steps=1, max_grad_norm=0.0)
    config["optimizer"]["weight_decay"] = 0.0
    config["mesh"] = mesh
    proc = ts.run(ts.torchrun(2, "run", ts.write_config(pretrained.root / f"{name}.yaml", config)))
    assert ts.error_lines(proc.stderr) == []
    run_dir = pretrained.root / "runs" / name

    ours, record, step = load_model_weights(str(run_dir / "checkpoints"))
    theirs, _, _ = load_model_weights(str(pretrained.checkpoints), step=PRETRAIN_STEPS)
    assert step == 1 and sorted(ours) == sorted(theirs)
    different = [k for k in theirs if not torch.equal(ours[k], theirs[k])]
    assert different == []
    assert optimizer_steps(run_dir / "checkpoints" / "step-1") == {1.0}
    pretrain_step = pretrained.checkpoints / f"step-{PRETRAIN_STEPS}"
    assert optimizer_steps(pretrain_step) == {float(PRETRAIN_STEPS)}

    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["status"], summary["step"], summary["world_size"]) == ("finished", 1, 2)
    assert [m["step"] for m in ts.read_metrics(run_dir)] == [1]
    assert record["world_size"] == 2
    assert record["info"]["init"] == {
        "from": str(pretrained.checkpoints),
        "step": PRETRAIN_STEPS,
        "format": "llmtrain",
    }
    events = [json.loads(line) for line in (run_dir / "logs" / "rank0.jsonl").open()]
    [warm] = [e for e in events if e["event"] == "run.warm_start"]
    assert (warm["step"], warm["format"]) == (PRETRAIN_STEPS, "llmtrain")
    # the whole model's 21 tensors (tok_emb, 2 blocks x 9, norm, head), or the first stage's
    assert warm["tensors"] == {"fsdp": 21, "pp": 10}[layout]
    assert not any(e["event"] == "run.resumed" for e in events)


def test_killed_fine_tune_learns_from_the_pretrained_loss_and_resumes_its_own_checkpoint(
    pretrained,
):
    config = fine_tune(pretrained, "ft", steps=30, checkpoint_every=2)
    path = ts.write_config(pretrained.root / "ft.yaml", config)
    run_dir = pretrained.root / "runs" / "ft"
    proc = ts.start(ts.llmtrain("run", path))
    try:
        seen = ts.wait_for_step(run_dir / "metrics.jsonl", 5, proc)
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)
    finally:
        ts.stop_group(proc)
    assert seen < 30, "the run ended before it could be killed"
    first = ts.read_metrics(run_dir)[0]
    # the fine-tune's first loss is the pretrained model's (another batch: the data restarts),
    # far below an untrained model's
    untrained, last = pretrained.metrics[1]["loss"], pretrained.metrics[PRETRAIN_STEPS]["loss"]
    assert untrained == pytest.approx(math.log(320), rel=0.05)
    assert first["step"] == 1 and first["loss"] == pytest.approx(last, abs=0.15)
    assert first["loss"] < untrained - 1.0, (first["loss"], last, untrained)
    killed_at = ts.committed_steps(run_dir / "checkpoints")[-1]

    again = ts.run(ts.llmtrain("run", path), timeout=600)
    assert "run.resumed" in again.stderr and "init.from" in again.stderr
    assert "run.warm_start " not in again.stderr
    steps = [m["step"] for m in ts.read_metrics(run_dir)]
    assert steps == list(range(1, 31)), f"killed after step {seen}, checkpoint {killed_at}"
    weights, record, step = load_model_weights(str(run_dir / "checkpoints"))
    assert step == 30
    assert record["info"]["init"]["from"] == str(pretrained.checkpoints)  # kept across resume
    theirs, _, _ = load_model_weights(str(pretrained.checkpoints))
    assert not torch.equal(weights["tok_emb.weight"], theirs["tok_emb.weight"])  # it trained
    assert ts.read_metrics(run_dir)[-1]["loss"] < first["loss"]


def _refused(run_cli, pretrained, name: str, *overrides: str) -> str:  # noqa: F811
    path = ts.write_config(pretrained.root / f"{name}.yaml", fine_tune(pretrained, name, steps=1))
    code, _, err = run_cli("run", path, *overrides)
    assert code == 2, err
    assert "Traceback" not in err
    assert not (pretrained.root / "runs" / name / "checkpoints").exists()
    return " ".join(err.split())  # the message without its line breaks


def test_bad_sources_are_refused_by_name(run_cli, pretrained, tmp_path):  # noqa: F811
    err = _refused(run_cli, pretrained, "none", f"init.from={tmp_path / 'nope'}")
    assert f"init.from: {tmp_path / 'nope'} does not exist" in err

    (tmp_path / "notes.txt").write_text("not weights")
    err = _refused(run_cli, pretrained, "unknown", f"init.from={tmp_path}")
    assert f"init.from: {tmp_path} is in no format this installation reads" in err
    assert "llmtrain: committed step-<n>/ checkpoint directories" in err
    assert "hf: config.json and *.safetensors" in err and "installed formats: llmtrain" in err

    err = _refused(run_cli, pretrained, "wrong-step", "init.step=7")
    assert "init.step:" in err and "step-7 does not exist" in err and "10, 20" in err
    err = _refused(run_cli, pretrained, "not-hf", "init.format=hf")
    assert "is not in format 'hf' (it needs config.json and *.safetensors" in err
    err = _refused(run_cli, pretrained, "no-format", "init.format=gguf")
    assert "init.format: no weight format 'gguf'; installed formats: llmtrain (built in)" in err

    err = _refused(run_cli, pretrained, "wider", "model.d_model=64", "model.dropout=0.1")
    assert "holds another model than this run's `model:`" in err
    assert "model.d_model: 32 in init.from, 64 here" in err
    assert "tensor tok_emb.weight: (320, 32) in init.from, (320, 64) here" in err
    assert "dropout" not in err.split("`model:`:")[1].split("Set these")[0]  # may differ
    err = _refused(run_cli, pretrained, "eps", "model.norm_eps=1e-6", "model.rope_base=500000.0")
    assert "model.rope_base: 10000.0 in init.from, 500000.0 here" in err
    assert "model.norm_eps: 1e-05 in init.from, 1e-06 here" in err
    assert "tensor" not in err  # the same shapes, another function


def test_another_tokenizer_is_refused_unless_told(run_cli, pretrained):  # noqa: F811
    other = _pack(pretrained.root, MORE_SPECIALS, "more-specials")
    err = _refused(run_cli, pretrained, "tok", f"data.train.0.path={other}")
    assert "was trained on data tokenized by bytes" in err
    assert "init.check_tokenizer: false" in err

    config = fine_tune(pretrained, "tok-ok", steps=1)
    config["data"]["train"] = [{"path": other}]
    config["init"]["check_tokenizer"] = False
    code, _, err = run_cli("run", ts.write_config(pretrained.root / "tok-ok.yaml", config))
    assert code == 0, err
    assert "run.warm_start" in err
