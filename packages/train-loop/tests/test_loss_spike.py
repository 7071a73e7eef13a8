"""The loss-spike monitor (callback kind `loss_spike`) on a fake run: which steps fire and at
which ratio (checked by hand), the median window, a checkpointed state that resumes exactly, the
stop request, what each rank logs, and its options' validation errors."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import attrs
import pytest
import structlog
import torch

from llmtrain.core_mesh.config import Choice, ConfigError, structure
from llmtrain.core_mesh.interfaces import Callback
from llmtrain.core_mesh.plugins import PluginManager
from llmtrain.data_pack.sampling import BatchPlan, Sampler, SourceShape
from llmtrain.train_loop import observe
from llmtrain.train_loop.loss_spike import LossSpikeMonitor, LossSpikeOptions, register_callbacks

# window 4, judged from 3 losses on: spikes at step 4 (7.0 > 3 x 2.0), step 6 (6.5 > 3 x 2.0,
# the median of 2.0, 2.2, 1.8, 2.0) and step 8 (5.9 > 3 x 1.9: the oldest 2.0 has left the
# window, which holds 2.2, 1.8, 2.0, 1.0; with it the median would be 2.0 and 5.9 no spike)
LOSSES = [2.0, 2.2, 1.8, 7.0, 2.0, 6.5, 1.0, 5.9]
OPTIONS = LossSpikeOptions(window=4, min_steps=3)
SPIKES = {4: 7.0 / 2.0, 6: 6.5 / 2.0, 8: 5.9 / 1.9}


class FakeRun:
    """What the monitor reads of the Trainer: one process, global batch 8 in micro-batches of
    4, 20 training windows (so step 4's sequences 24..31 are in epoch 1)."""

    def __init__(self, *, is_main: bool = True, data_rank: int = 0, data_world: int = 1):
        self.world = SimpleNamespace(rank=0 if is_main else 1, world_size=1, is_main=is_main)
        self.device = torch.device("cpu")
        self.global_batch = 8
        self.model = SimpleNamespace(data_rank=data_rank, data_world=data_world)
        self.plan = BatchPlan(8, data_world, data_rank, micro_batch=4)
        self.train_data = SimpleNamespace(sampler=Sampler([SourceShape(20, 4)], shuffle=False))
        self.last_local_loss = (torch.tensor(0.0), torch.tensor(1.0))
        self.stops: list[str] = []

    def request_stop(self, reason: str) -> None:
        self.stops.append(reason)


def train(monitor: LossSpikeMonitor, run: FakeRun, losses, first_step: int = 1) -> dict:
    """Feed one loss per step (None: a step without a loss) as the trainer would; the records."""
    records = {}
    for step, loss in enumerate(losses, start=first_step):
        metrics = {"grad_norm": 1.0} if loss is None else {"loss": loss, "grad_norm": 1.0}
        run.last_local_loss = (torch.tensor(256.0 * (loss or 0.0)), torch.tensor(256.0))
        monitor.after_step(run, step, metrics)
        monitor.on_log(run, step, metrics, {})
        records[step] = metrics
    return records


def fired(records: dict) -> dict[int, float]:
    return {s: m["loss_spike_ratio"] for s, m in records.items() if "loss_spike" in m}


def test_spikes_fire_at_the_hand_checked_steps_and_ratios():
    monitor = LossSpikeMonitor(OPTIONS)
    records = train(monitor, FakeRun(), LOSSES)
    assert fired(records) == pytest.approx(SPIKES, rel=1e-12)
    assert all(records[s]["loss_spike"] == 1.0 for s in SPIKES)
    assert [records[s]["loss_spikes"] for s in records] == [0, 0, 0, 1, 1, 2, 2, 3]
    # spikes never enter the window: the last four non-spike losses
    assert monitor.state_dict() == {"recent": [2.2, 1.8, 2.0, 1.0], "spikes": 3}


def test_nothing_is_judged_before_min_steps_and_lossless_steps_are_ignored():
    monitor = LossSpikeMonitor(OPTIONS)
    records = train(monitor, FakeRun(), [1.0, 100.0, None, float("nan"), 1.0, 400.0])
    # 100 came before 3 losses were in: it joined the window (median of 1, 100, 1 = 1 at step 6)
    assert fired(records) == {6: 400.0}
    assert monitor.state_dict()["recent"] == [1.0, 100.0, 1.0]


def test_a_resumed_run_judges_exactly_as_an_uninterrupted_one():
    whole = train(LossSpikeMonitor(OPTIONS), FakeRun(), LOSSES)
    first = LossSpikeMonitor(OPTIONS)
    before = train(first, FakeRun(), LOSSES[:5])
    saved = json.loads(json.dumps(first.state_dict()))  # plain data, as a checkpoint holds it
    assert saved == {"recent": [2.0, 2.2, 1.8, 2.0], "spikes": 1}
    resumed = LossSpikeMonitor(OPTIONS)
    resumed.load_state_dict(saved)
    after = train(resumed, FakeRun(), LOSSES[5:], first_step=6)
    assert {**before, **after} == whole
    assert resumed.state_dict() == {"recent": [2.2, 1.8, 2.0, 1.0], "spikes": 3}


def test_a_state_saved_with_a_longer_window_keeps_the_newest_losses():
    monitor = LossSpikeMonitor(LossSpikeOptions(window=2, min_steps=2))
    monitor.load_state_dict({"recent": [5.0, 1.0, 2.0], "spikes": 4})
    assert monitor.state_dict() == {"recent": [1.0, 2.0], "spikes": 4}


def test_stop_requests_a_stop_naming_the_step():
    run = FakeRun()
    monitor = LossSpikeMonitor(attrs.evolve(OPTIONS, stop=True))
    train(monitor, run, LOSSES[:4])
    (reason,) = run.stops
    assert reason.startswith("loss spike at step 4: loss 7 is 3.50 x the median 2 of the last 3")
    assert "loss_spike" in reason
    assert LossSpikeMonitor(OPTIONS).options.stop is False
    quiet = FakeRun()
    train(LossSpikeMonitor(OPTIONS), quiet, LOSSES)
    assert quiet.stops == []


def test_rank_zero_logs_the_batch_and_each_data_rank_loss(monkeypatch):
    # 4 ranks: 2 data ranks x 2 tensor-parallel ranks; data rank 1's own loss is the high one
    gathered = [[0.0, 4.0], [0.0, 4.0], [1.0, 10.0], [1.0, 10.0]]
    monkeypatch.setattr(observe, "gather_floats", lambda values, device: gathered)
    run = FakeRun(data_world=2)
    with structlog.testing.capture_logs() as logs:
        train(LossSpikeMonitor(OPTIONS), run, LOSSES[:4])
    (event,) = [e for e in logs if e["event"] == "loss.spike"]
    assert event["log_level"] == "warning"
    assert {k: event[k] for k in ("step", "loss", "median", "sequences", "epoch")} == {
        "step": 4,
        "loss": 7.0,
        "median": 2.0,
        "sequences": [24, 32],  # [(4 - 1) x 8, 4 x 8)
        "epoch": 1,  # 24 sequences into 20 windows
    }
    assert event["ratio"] == pytest.approx(3.5)
    assert event["rank_losses"] == [4.0, 10.0] and event["highest_data_rank"] == 1
    assert event["data_rank"] == 0 and event["samples"] == [[24, 25, 26, 27]]  # its half
    assert event["windows"] == [4, 5, 6, 7] and event["sources"] == [0, 0, 0, 0]  # in order
    assert "step 4: loss 7 is 3.50 x the median 2" in event["message"]


def test_every_rank_logs_its_own_samples():
    run = FakeRun(is_main=False, data_rank=1, data_world=2)
    with structlog.testing.capture_logs() as logs:
        train(LossSpikeMonitor(OPTIONS), run, LOSSES[:4])
    (event,) = [e for e in logs if e["event"] == "loss.spike"]
    assert event["step"] == 4 and event["data_rank"] == 1
    assert event["samples"] == [[28, 29, 30, 31]]
    assert "median" not in event and "rank_losses" not in event  # rank 0's summary only


def test_one_process_gathers_its_own_loss():
    run = FakeRun()
    with structlog.testing.capture_logs() as logs:
        train(LossSpikeMonitor(OPTIONS), run, LOSSES[:4])
    (event,) = [e for e in logs if e["event"] == "loss.spike"]
    assert event["rank_losses"] == [7.0] and event["highest_data_rank"] == 0
    assert event["samples"] == [[24, 25, 26, 27], [28, 29, 30, 31]]  # two micro-batches


@attrs.frozen
class Schema:
    callbacks: list[Choice.of("callback")]


@pytest.fixture
def plugins() -> PluginManager:
    pm = PluginManager(blocked=())
    pm.register(SimpleNamespace(llmtrain_callbacks=register_callbacks), "spike")
    assert pm.problems == []
    return pm


def test_registered_as_callback_kind_loss_spike(plugins):
    config = structure(
        {"callbacks": [{"kind": "loss_spike", "window": 20}]}, Schema, plugins=plugins
    )
    (choice,) = config.callbacks
    assert choice.options == LossSpikeOptions(window=20)
    assert choice.options == LossSpikeOptions(factor=3.0, window=20, min_steps=10, stop=False)
    entry = plugins.registry("callback").get("loss_spike")
    assert isinstance(entry.target(choice.options), Callback)


def test_options_errors_name_the_config_path(plugins):
    bad = {"kind": "loss_spike", "factor": 1.0, "window": 0, "stop": "yes", "windw": 3}
    with pytest.raises(ConfigError) as info:
        structure({"callbacks": [bad]}, Schema, plugins=plugins)
    text = str(info.value)
    assert "callbacks[0].factor: must be more than 1, got 1.0" in text
    assert "callbacks[0].window: must be at least 1, got 0" in text
    assert "callbacks[0].stop: expected bool (true or false), got str 'yes'" in text
    assert "callbacks[0].windw: unknown key" in text
    with pytest.raises(ConfigError) as info:
        structure(
            {"callbacks": [{"kind": "loss_spike", "window": 5, "min_steps": 6}]},
            Schema,
            plugins=plugins,
        )
    assert "callbacks[0].min_steps: must be at most window=5" in str(info.value)


def test_the_module_imports_no_torch():
    code = (
        "import sys, llmtrain.train_loop.loss_spike; "
        "assert 'torch' not in sys.modules, 'loss_spike imported torch'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
