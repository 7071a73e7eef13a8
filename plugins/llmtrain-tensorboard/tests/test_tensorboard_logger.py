"""The `tensorboard` logger, installed as a plugin package: real `llmtrain run` processes write
event files that TensorBoard's own readers show equal to metrics.jsonl, step by step, with the
resolved config as text: the Python loader (`--load_fast=false`), the classic `EventAccumulator`
and a real `tensorboard --logdir` serving the web view from its data server. A run SIGKILLed
past its checkpoint and resumed shows every step once in each of them."""

from __future__ import annotations

import contextlib
import functools
import html
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from types import SimpleNamespace

import numpy as np
import pytest
import train_support as ts
import yaml
from llmtrain_tensorboard.plugin import TensorBoardOptions, TensorBoardSink

from llmtrain.core_mesh.interfaces import RunInfo
from llmtrain.core_mesh.metric_names import dashboard_name

TEXT_TAG = "config/text_summary"  # TensorBoard's tag for the text logged as `config`
RUN = "run/tensorboard"  # the TensorBoard run of the llmtrain run `run`, under `--logdir runs`


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


@pytest.fixture(scope="module")
def finished_run(data, tmp_path_factory):
    """A 30-step run's directory."""
    tmp_path = tmp_path_factory.mktemp("finished")
    path = ts.write_config(tmp_path / "run.yaml", config(data, tmp_path))
    ts.run(ts.llmtrain("run", path), timeout=600)
    return tmp_path / "runs" / "run"


@pytest.fixture(scope="module")
def resumed_run(data, tmp_path_factory):
    """A run SIGKILLed between its checkpoint at step 10 and step 20, then resumed to step 30."""
    tmp_path = tmp_path_factory.mktemp("resumed")
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
    return SimpleNamespace(dir=run_dir, killed_at=killed_at, resumed_from=resumed_from)


def as_stored(metrics: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} of metrics.jsonl as TensorBoard holds it: each value is the
    logged number rounded to float32 (what a `simple_value` holds)."""
    want = {}
    for line in metrics:
        for name, value in line.items():
            if name != "step":
                want.setdefault(dashboard_name(name), []).append(
                    (line["step"], float(np.float32(value)))
                )
    return want


def config_texts(texts: list[tuple[int, str]]) -> list[tuple[int, dict]]:
    """(step, markdown) of the config text -> (step, the YAML in its fenced block, parsed)."""
    out = []
    for step, text in texts:
        assert text.startswith("```yaml\n") and text.endswith("```\n"), text[:80]
        out.append((step, yaml.safe_load(text.removeprefix("```yaml\n").removesuffix("```\n"))))
    return out


# --- TensorBoard's readers


def read_events(log_dir, *, purge: bool = True):
    """{tag: [(step, value), ...]} in file order, as TensorBoard's Python loader (the
    `plugin_event_accumulator` behind `--load_fast=false`) sees them (`purge=False`: everything
    in the files, also what a restart hid)."""
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


def python_loader_texts(events) -> list[tuple[int, str]]:
    return [(step, array[0].decode()) for step, array in events[TEXT_TAG]]


def read_classic(log_dir) -> tuple[dict, list[tuple[int, str]]]:
    """({tag: [(step, value), ...]}, [(step, config text), ...]) as the classic
    `event_accumulator.EventAccumulator` sees them: its `Scalars(tag)` and `Tensors(tag)`."""
    from tensorboard.backend.event_processing import event_accumulator as ea
    from tensorboard.util import tensor_util

    acc = ea.EventAccumulator(str(log_dir), size_guidance={ea.SCALARS: 0, ea.TENSORS: 0})
    acc.Reload()
    tags = acc.Tags()
    assert tags["tensors"] == [TEXT_TAG], tags
    scalars = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in tags["scalars"]}
    texts = [
        (e.step, tensor_util.make_ndarray(e.tensor_proto)[0].decode())
        for e in acc.Tensors(TEXT_TAG)
    ]
    return scalars, texts


LOCAL_FREE_PORT = ["--host", "127.0.0.1", "--port", "0"]


@contextlib.contextmanager
def tensorboard(logdir, timeout: float = 120):
    """`tensorboard --logdir LOGDIR` as a user starts it (its default loader), on a free port of
    127.0.0.1: yields its URL once it serves. Killed, with its data server, on the way out."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), *LOCAL_FREE_PORT],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines = queue.Queue()

    def read():
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        printed = []
        deadline = time.monotonic() + timeout
        while (address := re.search(r" at (http://127\.0\.0\.1:\d+)/", "".join(printed))) is None:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(
                    f"tensorboard printed no address in {timeout} s:\n{''.join(printed)}"
                ) from None
            if line is None:
                raise AssertionError(
                    f"tensorboard exited ({proc.wait()}) before serving:\n{''.join(printed)}"
                )
            printed.append(line)
        # the web view's default: the Rust data server, announced with this note
        assert "fast data loading" in "".join(printed), (
            "tensorboard did not start its data server (it fell back to the Python loader):\n"
            + "".join(printed)
        )
        yield address.group(1)
    finally:
        ts.stop_group(proc)
        proc.wait()
        reader.join(timeout=30)
        proc.stdout.close()


OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def get(url: str, path: str, form: dict | None = None):
    """The JSON answer to GET `path` (or POST, with `form`)."""
    body = None if form is None else urllib.parse.urlencode(form).encode()
    with OPENER.open(url + path, data=body, timeout=60) as response:
        return json.load(response)


def served_scalars(url: str, run: str) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} of `run`, asked for the way the web view's Time Series
    dashboard asks: the tags, then every scalar series."""
    tags = get(url, "/data/plugin/timeseries/tags", {})["scalars"]["runTagInfo"].get(run, [])
    if not tags:
        return {}
    requests = json.dumps([{"plugin": "scalars", "tag": tag} for tag in tags])
    series = get(url, "/data/plugin/timeseries/timeSeries", {"requests": requests})
    return {
        one["tag"]: [(point["step"], point["value"]) for point in one["runToSeries"][run]]
        for one in series
    }


def served_texts(url: str, run: str) -> list[tuple[int, str]]:
    """(step, the config text) of `run` from the text dashboard's answer: the markdown rendered
    as HTML, the YAML block read back out of its <code> element."""
    query = urllib.parse.urlencode({"run": run, "tag": TEXT_TAG})
    out = []
    for point in get(url, "/data/plugin/text/text?" + query):
        (code,) = re.findall(r"<pre><code[^>]*>(.*?)</code></pre>", point["text"], re.S)
        out.append((point["step"], f"```yaml\n{html.unescape(code)}```\n"))
    return out


NUMBER = re.compile(r"\d+(\.\d*)?([eE][+-]?\d+)?")


def compare_tag_names(a: str, b: str) -> int:
    """TensorBoard's tag order (`compareTagNames` of tensorboard/webapp/metrics/utils.ts, which
    its dashboards sort cards with), ported: runs of digits compare as numbers, and `/` sorts
    before every other character, so `a/b` comes before `a+/b` and `a_b/c`."""
    i = j = 0
    while True:
        if i == len(a):
            return 0 if j == len(b) else -1
        if j == len(b):
            return 1
        if a[i].isdigit() and b[j].isdigit():
            ma, mb = NUMBER.match(a, i), NUMBER.match(b, j)
            x, y = float(ma.group()), float(mb.group())
            if x != y:
                return -1 if x < y else 1
            i, j = ma.end(), mb.end()
            continue
        a_break, b_break = a[i] == "/" or a[i].isdigit(), b[j] == "/" or b[j].isdigit()
        if a_break and not b_break:
            return -1
        if b_break and not a_break:
            return 1
        if not a_break and a[i] != b[j]:
            return -1 if a[i] < b[j] else 1
        i, j = i + 1, j + 1


def tensorboard_order(tags) -> list[tuple[str, list[str]]]:
    """[(group, [tag, ...]), ...] in the order TensorBoard's Time Series dashboard shows them: the
    cards sorted by `compare_tag_names`, then grouped by the part of the tag before its first
    `/`, the groups in the order their first card comes (`groupCardsByTag` in the same file)."""
    groups: dict[str, list[str]] = {}
    for tag in sorted(tags, key=functools.cmp_to_key(compare_tag_names)):
        groups.setdefault(tag.split("/", 1)[0], []).append(tag)
    return list(groups.items())


def poll(fetch, want, timeout: float = 120):
    """`fetch()` until it answers `want`, or its last answer after `timeout` s: the data server
    reads the event files in the background after TensorBoard starts serving."""
    deadline = time.monotonic() + timeout
    while (got := fetch()) != want and time.monotonic() < deadline:
        time.sleep(0.5)
    return got


# --- tests


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


def test_tags_put_the_loss_first():
    # the shared mapping of llmtrain.core_mesh.metric_names, the same as the wandb logger's
    assert [dashboard_name(k) for k in ("loss", "eval_loss", "eval_ppl", "active_memory_mib")] == [
        "loss/train",
        "loss/eval",
        "loss/eval_ppl",
        "memory/active_mib",
    ]
    assert dashboard_name("system/gpu_temp") == "system/gpu_temp"


def test_options_are_validated_with_the_config_path(data, tmp_path, run_cli):
    bad = config(data, tmp_path)
    bad["loggers"][1].update(dir=7, directory="tb")
    code, _, err = run_cli("config", "validate", ts.write_config(tmp_path / "bad.yaml", bad))
    assert code != 0
    assert "bad.yaml:37: loggers[1].directory: unknown key; allowed: dir" in err, err
    assert "bad.yaml:36: loggers[1].dir: expected str, got int" in err, err


ELSEWHERE = "; give a path inside it, or an absolute path to write elsewhere on purpose"


@pytest.mark.parametrize(
    ("directory", "says"),
    [
        ("../../x", "'../../x' leaves the run directory" + ELSEWHERE),
        ("tb/../../x", "'tb/../../x' leaves the run directory" + ELSEWHERE),
        ("", "must name a directory, got ''"),
        (
            "checkpoints/tb",
            "'checkpoints/tb' is inside the run's own checkpoints/ directory; name another place",
        ),
    ],
)
def test_the_directory_stays_in_the_run_as_jsonls_file_does(
    data, tmp_path, run_cli, directory, says
):
    """Refused before the run starts (as the jsonl logger's `../x.jsonl` is): nothing is
    written, inside the run or out of it."""
    bad = config(data, tmp_path)
    bad["loggers"][1].update(dir=directory)
    path = ts.write_config(tmp_path / "bad.yaml", bad)
    for command in (("config", "validate"), ("run",)):
        code, _, err = run_cli(*command, path)
        assert (code, err) == (2, f"error: {path}:36: loggers[1].dir: {says}\n"), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml"]
    assert not (tmp_path.parent / "x").exists()


def test_a_directory_taken_by_a_file_is_refused_before_the_run(data, tmp_path, run_cli):
    (tmp_path / "taken").write_text("a file\n")
    bad = config(data, tmp_path)
    bad["loggers"][1].update(dir=str(tmp_path / "taken"))  # absolute: elsewhere on purpose
    path = ts.write_config(tmp_path / "bad.yaml", bad)
    code, _, err = run_cli("run", path)
    assert (code, err) == (
        2,
        f"error: {path}:36: loggers[1].dir: {tmp_path}/taken exists and is not a directory\n",
    )
    assert not (tmp_path / "runs").exists()


def test_python_loader_reads_every_logged_metric_and_the_config(finished_run):
    metrics = ts.read_metrics(finished_run)
    assert [m["step"] for m in metrics] == list(range(1, 31))
    events = read_events(finished_run / "tensorboard")
    texts = config_texts(python_loader_texts(events))
    del events[TEXT_TAG]
    assert events == as_stored(metrics)
    assert [step for step, _ in events["loss/eval"]] == [10, 20, 30]
    assert events["progress/tokens"][-1] == (30, 30 * 8 * 32)

    ((step, text),) = texts
    assert step == 1
    assert text == yaml.safe_load((finished_run / "config.yaml").read_text())
    assert text["model"]["kind"] == "tiny" and text["model"]["d_model"] == 32
    assert text["loggers"][1] == {"kind": "tensorboard", "dir": "tensorboard"}


def test_classic_accumulator_reads_every_logged_metric_and_the_config(finished_run):
    scalars, texts = read_classic(finished_run / "tensorboard")
    assert scalars == as_stored(ts.read_metrics(finished_run))
    assert scalars["progress/tokens"][-1] == (30, 30 * 8 * 32)
    assert config_texts(texts) == [(1, yaml.safe_load((finished_run / "config.yaml").read_text()))]


def test_the_web_view_serves_every_logged_metric_and_the_config(finished_run):
    want = as_stored(ts.read_metrics(finished_run))
    with tensorboard(finished_run.parent) as url:
        scalars = poll(lambda: served_scalars(url, RUN), want)
        assert scalars == want
        assert sorted(get(url, "/data/plugin/scalars/tags")[RUN]) == sorted(want)
        # the first screen is the loss: the dashboard's first group is `loss`, and its cards
        # are every loss curve; memory, optimizer and throughput follow
        tags = get(url, "/data/plugin/timeseries/tags", {})["scalars"]["runTagInfo"][RUN]
        order = tensorboard_order(tags)
        assert order[0] == ("loss", ["loss/eval", "loss/eval_bpb", "loss/eval_ppl", "loss/train"])
        assert [group for group, _ in order] == ["loss", "memory", "optim", "perf", "progress"]
        texts = config_texts(served_texts(url, RUN))
    assert texts == [(1, yaml.safe_load((finished_run / "config.yaml").read_text()))]


def test_sigkill_past_a_checkpoint_then_resume_shows_each_step_once(resumed_run):
    run_dir, resumed_from = resumed_run.dir, resumed_run.resumed_from
    # the files hold the killed process's steps past the checkpoint and the resumed ones
    raw = [step for step, _ in read_events(run_dir / "tensorboard", purge=False)["loss/train"]]
    assert len(list((run_dir / "tensorboard").glob("events.out.tfevents.*"))) == 2
    first = raw[: raw.index(resumed_from + 1, resumed_from + 1)]
    assert first == list(range(1, len(first) + 1))
    assert raw == first + list(range(resumed_from + 1, 31))
    killed_at = resumed_run.killed_at
    assert first[-1] in (killed_at - 1, killed_at)  # flushed per logged step (jsonl logs first)
    # ... and TensorBoard shows one uninterrupted run, equal to metrics.jsonl
    metrics = ts.read_metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(1, 31))
    events = read_events(run_dir / "tensorboard")
    texts = config_texts(python_loader_texts(events))
    del events[TEXT_TAG]
    assert events == as_stored(metrics)
    assert [step for step, _ in texts] == [1, resumed_from + 1]
    assert texts[0][1] == texts[1][1] == yaml.safe_load((run_dir / "config.yaml").read_text())


def test_a_resumed_run_reads_once_in_the_classic_accumulator(resumed_run):
    scalars, texts = read_classic(resumed_run.dir / "tensorboard")
    assert scalars == as_stored(ts.read_metrics(resumed_run.dir))
    config = yaml.safe_load((resumed_run.dir / "config.yaml").read_text())
    assert config_texts(texts) == [(1, config), (resumed_run.resumed_from + 1, config)]


def test_a_resumed_run_is_served_once_by_the_web_view(resumed_run):
    want = as_stored(ts.read_metrics(resumed_run.dir))
    assert [step for step, _ in want["loss/train"]] == list(range(1, 31))
    with tensorboard(resumed_run.dir.parent) as url:
        assert poll(lambda: served_scalars(url, RUN), want) == want
        texts = config_texts(served_texts(url, RUN))
    config = yaml.safe_load((resumed_run.dir / "config.yaml").read_text())
    assert texts == [(1, config), (resumed_run.resumed_from + 1, config)]


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
    assert [s for s, _ in read_events(tmp_path / "tensorboard")["loss/train"]] == [1, 2, 3, 4, 5]
    old.close()

    new = TensorBoardSink(TensorBoardOptions(), run_info(tmp_path, 0))
    new.log(1, {"loss": 1.0, "eval_loss": 2.0})
    new.log(2, {"loss": 0.5})
    new.close()
    events = read_events(tmp_path / "tensorboard")
    assert events["loss/train"] == [(1, 1.0), (2, 0.5)]
    assert events["loss/eval"] == [(1, 2.0)]
    assert [step for step, _ in config_texts(python_loader_texts(events))] == [1]
    want = {"loss/train": [(1, 1.0), (2, 0.5)], "loss/eval": [(1, 2.0)]}
    scalars, texts = read_classic(tmp_path / "tensorboard")
    assert scalars == want
    # the classic accumulator purges only its own kinds (scalars, histograms, images, audio),
    # not tensors such as text: it keeps the earlier start's config text as well
    assert [step for step, _ in texts] == [1, 1]
    with tensorboard(tmp_path) as url:
        assert poll(lambda: served_scalars(url, "tensorboard"), want) == want
        assert [step for step, _ in served_texts(url, "tensorboard")] == [1]


def test_values_are_the_logged_numbers_rounded_to_float32(tmp_path):
    """`simple_value` is a float32: a token count past 2**24 and a loss lose their low bits in
    TensorBoard (metrics.jsonl keeps the exact numbers)."""
    sink = TensorBoardSink(TensorBoardOptions(), run_info(tmp_path, 0))
    sink.log(1, {"tokens": 2**24 + 1, "loss": 0.1, "lr": 3e-3})
    sink.close()
    want = {
        "progress/tokens": [(1, 2.0**24)],
        "loss/train": [(1, 0.10000000149011612)],
        "optim/lr": [(1, 0.003000000026077032)],
    }
    scalars, _ = read_classic(tmp_path / "tensorboard")
    assert scalars == want
    events = read_events(tmp_path / "tensorboard")
    del events[TEXT_TAG]
    assert events == want
    with tensorboard(tmp_path) as url:
        assert poll(lambda: served_scalars(url, "tensorboard"), want) == want
