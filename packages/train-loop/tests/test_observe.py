"""Profiler windows, the hang watchdog and the memory estimate's exact parts, in one process (the
multi-rank runs are in integration_tests/test_observe.py; reading traces and rank logs back is
llmtrain-ablate's, tested in packages/ablate/tests/test_reports.py)."""

from __future__ import annotations

import json
import time

import pytest
import torch

from llmtrain.core_mesh.config import ConfigError, structure
from llmtrain.core_mesh.plugins import PluginManager, hookimpl
from llmtrain.train_loop import observe
from llmtrain.train_loop.experiments import estimate
from llmtrain.train_loop.run_config import ProfileConfig, RunConfig, WatchdogConfig


# --- the profiler ---
def test_profile_windows_and_traces(tmp_path):
    config = ProfileConfig(every=4, active=2, warmup=1)
    prof = observe.StepProfiler(config, tmp_path, rank=3, device=torch.device("cpu"))
    layer = torch.nn.Linear(8, 8)
    for step in range(1, 15):  # steps 1..14; windows open at 4, 8 and 12 (12+1+2-1 = 14 fits)
        prof.before_step(step, last_step=14)
        layer(torch.randn(4, 8)).sum().backward()
        prof.after_step()
    prof.close()
    windows = sorted(p.name for p in (tmp_path / "profiles").iterdir())
    assert windows == ["step-13", "step-5", "step-9"]
    trace = json.loads((tmp_path / "profiles" / "step-5" / "rank3.json").read_text())
    steps = [
        e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")
    ]
    assert len(steps) == 2  # the active steps only
    assert any(e.get("name") == "aten::addmm" for e in trace["traceEvents"])


def test_profile_window_that_does_not_fit_is_not_opened(tmp_path):
    prof = observe.StepProfiler(ProfileConfig(every=4, active=2), tmp_path, 0, torch.device("cpu"))
    for step in range(1, 6):  # a window at 4 would record 5 and 6, past the last step 5
        prof.before_step(step, last_step=5)
        prof.after_step()
    prof.close()
    assert not (tmp_path / "profiles").exists()


def test_profile_only_on_chosen_ranks(tmp_path):
    config = ProfileConfig(every=2, active=1, ranks=[1])
    prof = observe.StepProfiler(config, tmp_path, rank=0, device=torch.device("cpu"))
    prof.before_step(2, last_step=10)
    assert prof.prof is None


def test_profile_config_window_must_fit():
    with pytest.raises(ConfigError, match="does not fit in every 2 steps"):
        structure({"every": 2, "active": 2, "warmup": 1}, ProfileConfig)


# --- the watchdog ---
def test_watchdog_dumps_every_stack_once_per_stalled_step(tmp_path, monkeypatch):
    config = WatchdogConfig(multiple=3.0, min_seconds=0.2, warmup_steps=2, startup_seconds=30)
    dog = observe.Watchdog(config, tmp_path, rank=5)
    try:
        assert dog.limit("step") == 30  # no median yet
        for step in (1, 2, 3):
            dog.start("step", step)
            time.sleep(0.01)
            dog.end()
        assert dog.limit("step") == pytest.approx(0.2)  # max(min_seconds, 3 x ~0.01)
        assert dog.limit("eval") == 30
        dog.start("step", 4)
        deadline = time.monotonic() + 5
        while dog.stalls == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.6)  # still stuck: no second report for the same step
        dog.end()
    finally:
        dog.close()
    assert dog.stalls == 1
    text = (tmp_path / "stacks-rank5.txt").read_text()
    assert text.startswith("=== rank 5: step 4 (step) running for")
    assert "test_watchdog_dumps_every_stack_once_per_stalled_step" in text  # this thread's frame
    assert "llmtrain-watchdog" in text or "Thread" in text


def test_watchdog_can_be_off(tmp_path):
    dog = observe.Watchdog(WatchdogConfig(enabled=False), tmp_path, 0)
    assert dog.thread is None
    dog.start("step", 1)
    dog.end()
    dog.close()


# --- memory ---
def test_arrival_lag_from_the_gathered_windows():
    # rows: [values..., calls, summed arrival seconds]
    assert observe.arrival_lag([[0.1, 4.0, 2.0], [0.2, 4.0, 2.5]]) == [0.0, 0.5]
    assert observe.arrival_lag([[0.1, 4.0, 2.0], [0.2, 3.0, 2.5]]) is None  # other calls
    assert observe.arrival_lag([[0.1, 0.0, 0.0], [0.2, 0.0, 0.0]]) is None  # none


def test_collective_clock_wraps_and_restores_the_collectives():
    import torch.distributed as dist

    original = dist.all_reduce
    clock = observe.CollectiveClock()
    clock.install()
    try:
        assert dist.all_reduce is not original and dist.all_reduce.__wrapped__ is original
        with pytest.raises(ValueError):  # no process group here: the call still goes through
            dist.all_reduce(torch.zeros(1))
        assert clock.calls == 1 and clock.total > 0
    finally:
        clock.remove()
    assert dist.all_reduce is original


def test_memory_on_cpu_is_resident_set_size():
    mem = observe.memory_mib(torch.device("cpu"))
    assert mem["peak_memory_mib"] >= mem["active_memory_mib"] > 10
    block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    grown = observe.memory_mib(torch.device("cpu"))
    assert grown["active_memory_mib"] - mem["active_memory_mib"] > 50
    del block


# --- the estimate's exact parts ---
@pytest.fixture(scope="module")
def plugins():
    return PluginManager().load_entry_points()


def small_config(plugins, **extra):
    model = {"kind": "tiny", "vocab_size": 320, "max_seq_len": 64, "tied_embeddings": False}
    raw = {
        "name": "e",
        "model": {**model, "n_layers": 8},
        "data": {"train": [{"path": "unused.zarr"}], "seq_len": 64, "micro_batch": 4},
        "optimizer": {"kind": "adamw", "lr": 1e-3},
        "training": {"steps": 1},
        **extra,
    }
    return structure(raw, RunConfig, plugins=plugins)


def test_estimate_parameters_gradients_and_adam_state_are_exact(plugins):
    config = small_config(plugins)
    est = estimate.estimate(config, plugins, world=1)
    with torch.device("meta"):
        model = plugins.build("model", config.model)
    n = sum(p.numel() for p in model.parameters())
    assert est.n_params == n
    assert est.params == est.grads == 4 * n
    steps = len(list(model.parameters())) * 4  # AdamW's per-parameter step counter (fp32 scalar)
    assert est.optimizer == 2 * 4 * n + steps  # exp_avg and exp_avg_sq
    assert est.activations > 0 and est.total == sum(size for _, size in est.rows()[:-1])


def test_estimate_scales_with_the_layout(plugins):
    base = estimate.estimate(small_config(plugins), plugins, world=1)
    fsdp = estimate.estimate(small_config(plugins), plugins, world=4)  # dp_shard 4
    assert fsdp.params == pytest.approx(base.params / 4, abs=4)
    assert fsdp.optimizer == pytest.approx(base.optimizer / 4, rel=0.01)
    assert fsdp.activations == base.activations  # same micro-batch per rank
    ac = small_config(
        plugins, parallel={"kind": "default", "activation_checkpointing": {"mode": "full"}}
    )
    assert estimate.estimate(ac, plugins, world=1).activations < base.activations / 2
    bf16 = small_config(plugins, parallel={"kind": "default", "param_dtype": "bfloat16"})
    assert estimate.estimate(bf16, plugins, world=1).activations == pytest.approx(
        base.activations / 2, rel=0.01
    )


def test_estimate_of_another_strategy_takes_the_default_options():
    class Other:
        @hookimpl
        def llmtrain_parallel_strategies(self, register):
            register("other", object())

    plugins = PluginManager(blocked=()).load_entry_points()
    plugins.register(Other(), "other")
    base = estimate.estimate(small_config(plugins), plugins, world=2)
    other = estimate.estimate(small_config(plugins, parallel={"kind": "other"}), plugins, world=2)
    assert other.rows() == base.rows() and other.layout == base.layout
    assert other.notes == (
        "parallel.kind 'other' is estimated as the default strategy with its default options",
        *base.notes,
    )
