"""The `tensorboard` logger, installed as a plugin package: real `llmtrain run` processes write
event files that TensorBoard's own reader (the EventAccumulator its Python data loader uses) reads
back equal to metrics.jsonl, step by step, with the resolved config as text; a run SIGKILLed past
its checkpoint and resumed shows every step once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import train_support as ts
import yaml
from llmtrain_tensorboard.plugin import TensorBoardOptions, TensorBoardSink, tag_of

from llmtrain.core_mesh.interfaces import RunInfo


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return ts.pack_corpus(tmp_path_factory.mktemp("data"))


def config(data, tmp_path) -> dict:
    """The shared 30-step config (eval every 10) with a checkpoint every 10 steps, logging to
    metrics.jsonl and TensorBoard."""
    config = ts.run_config(data, tmp_path / "runs")
    config["training"].update(checkpoint_every=10)
    config["loggers"] = [{"kind": "jsonl"}, {"kind": "tensorboard"}]
    return config


def read_events(log_dir, *, purge: bool = True):
    """{tag: [(step, value), ...]} in file order, as TensorBoard's Python loader sees them
    (`purge=False`: everything in the files, also what a restart hid)."""
    from tensorboard.backend.event_processing import plugin_event_accumulator as pea
    from tensorboard.util import tensor_util

    acc = pea.EventAccumulator(
        str(log_dir), size_guidance={pea.TENSORS: 0}, purge_orphaned_data=purge
    )
    acc.Reload()
    out = {}
    for tag in acc.Tags()["tensors"]:
        values = [(e.step, tensor_util.make_ndarray(e.tensor_proto)) for e in acc.Tensors(tag)]
        out[tag] = [(step, array.item() if array.ndim == 0 else array) for step, array in values]
    return out


def config_texts(events) -> list[tuple[int, dict]]:
    """The config text summaries: (step, the YAML in the fenced block, parsed)."""
    out = []
    for step, array in events["config/text_summary"]:
        text = array[0].decode()
        assert text.startswith("```yaml\n") and text.endswith("```\n"), text[:80]
        out.append((step, yaml.safe_load(text.removeprefix("```yaml\n").removesuffix("```\n"))))
    return out


def assert_equal_to_jsonl(events, metrics: list[dict]) -> None:
    """Every metric of every metrics.jsonl line is in TensorBoard at its step, exactly (float64),
    and TensorBoard holds nothing else."""
    want = {}
    for line in metrics:
        for name, value in line.items():
            if name != "step":
                want.setdefault(tag_of(name), []).append((line["step"], value))
    got = {tag: values for tag, values in events.items() if tag != "config/text_summary"}
    assert sorted(got) == sorted(want)
    for tag in want:
        assert got[tag] == want[tag], tag


def test_entry_point_loads_without_torch_or_tensorboard():
    probe = (
        "import sys, importlib.metadata as md\n"
        "from llmtrain.core_mesh.plugins import PluginManager\n"
        "(ep,) = md.entry_points(group='llmtrain', name='tensorboard')\n"
        "pm = PluginManager(blocked=())\n"
        "pm.register(ep.load(), ep.name)\n"
        "entry = pm.registry('logger').get('tensorboard')\n"
        "print(ep.value, entry.options.__name__, pm.problems,\n"
        "      [m for m in ('torch', 'tensorboard') if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.split(maxsplit=1) == [
        "llmtrain_tensorboard.plugin",
        "TensorBoardOptions [] []\n",
    ]


def test_tags():
    assert tag_of("loss") == "train/loss"
    assert tag_of("tokens_per_s") == "train/tokens_per_s"
    assert tag_of("eval_loss") == "eval/loss"
    assert tag_of("eval_ppl") == "eval/ppl"
    assert tag_of("system/gpu_temp") == "system/gpu_temp"


def test_options_are_validated_with_the_config_path(data, tmp_path, run_cli):
    bad = config(data, tmp_path)
    bad["loggers"][1].update(dir=7, directory="tb")
    code, _, err = run_cli("config", "validate", ts.write_config(tmp_path / "bad.yaml", bad))
    assert code != 0
    assert "bad.yaml:37: loggers[1].directory: unknown key; allowed: dir" in err, err
    assert "bad.yaml:36: loggers[1].dir: expected str, got int" in err, err


def test_run_writes_every_logged_metric_and_the_config(data, tmp_path):
    path = ts.write_config(tmp_path / "run.yaml", config(data, tmp_path))
    ts.run(ts.llmtrain("run", path), timeout=600)
    run_dir = tmp_path / "runs" / "run"

    metrics = ts.read_metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(1, 31))
    events = read_events(run_dir / "tensorboard")
    assert_equal_to_jsonl(events, metrics)
    assert [step for step, _ in events["eval/loss"]] == [10, 20, 30]
    # float64 on disk: the token count and the loss are the numbers metrics.jsonl has
    assert events["train/tokens"][-1] == (30, 30 * 8 * 32)

    ((step, text),) = config_texts(events)
    assert step == 1
    assert text == yaml.safe_load((run_dir / "config.yaml").read_text())
    assert text["model"]["kind"] == "tiny" and text["model"]["d_model"] == 32
    assert text["loggers"][1] == {"kind": "tensorboard", "dir": "tensorboard"}


def test_sigkill_past_a_checkpoint_then_resume_shows_each_step_once(data, tmp_path):
    path = ts.write_config(tmp_path / "run.yaml", config(data, tmp_path))
    run_dir = tmp_path / "runs" / "run"
    proc = ts.start(ts.llmtrain("run", path))
    try:
        ts.wait_for_step(run_dir / "metrics.jsonl", 15, proc)
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)
    finally:
        ts.stop_group(proc)
    killed_at = ts.last_logged_step(run_dir / "metrics.jsonl")
    resumed_from = ts.committed_steps(run_dir / "checkpoints")[-1]
    assert resumed_from < killed_at < 30, "the kill did not land between a checkpoint and the end"

    resumed = ts.run(ts.llmtrain("run", path), timeout=600)
    assert "run.resumed" in resumed.stderr

    # the files hold the killed process's steps past the checkpoint and the resumed ones
    raw = [step for step, _ in read_events(run_dir / "tensorboard", purge=False)["train/loss"]]
    assert len(list((run_dir / "tensorboard").glob("events.out.tfevents.*"))) == 2
    first = raw[: raw.index(resumed_from + 1, resumed_from + 1)]
    assert first == list(range(1, len(first) + 1))
    assert raw == first + list(range(resumed_from + 1, 31))
    assert first[-1] in (killed_at - 1, killed_at)  # flushed per logged step (jsonl logs first)
    # ... and TensorBoard shows one uninterrupted run, equal to metrics.jsonl
    metrics = ts.read_metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(1, 31))
    events = read_events(run_dir / "tensorboard")
    assert_equal_to_jsonl(events, metrics)
    texts = config_texts(events)
    assert [step for step, _ in texts] == [1, resumed_from + 1]
    assert texts[0][1] == texts[1][1] == yaml.safe_load((run_dir / "config.yaml").read_text())


def run_info(tmp_path, start_step: int) -> RunInfo:
    return RunInfo(
        name="unit",
        run_dir=str(tmp_path),
        total_steps=100,
        start_step=start_step,
        config={"model": {"kind": "tiny"}},
    )


def test_a_fresh_start_hides_what_an_earlier_start_wrote(tmp_path):
    """A run killed before its first checkpoint starts again from step 0: its old points go."""
    old = TensorBoardSink(TensorBoardOptions(), run_info(tmp_path, 0))
    for step in range(1, 6):
        old.log(step, {"loss": 10.0 + step})
    # flushed per logged step: readable while the writer is open (and after a SIGKILL)
    assert [s for s, _ in read_events(tmp_path / "tensorboard")["train/loss"]] == [1, 2, 3, 4, 5]
    old.close()

    new = TensorBoardSink(TensorBoardOptions(), run_info(tmp_path, 0))
    new.log(1, {"loss": 1.0, "eval_loss": 2.0})
    new.log(2, {"loss": 0.5})
    new.close()
    events = read_events(tmp_path / "tensorboard")
    assert events["train/loss"] == [(1, 1.0), (2, 0.5)]
    assert events["eval/loss"] == [(1, 2.0)]
    assert [step for step, _ in config_texts(events)] == [1]
