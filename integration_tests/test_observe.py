"""What a run tells about itself, end to end on CPU (gloo): profiler windows and `llmtrain
profile`, memory per rank in the metrics, `llmtrain estimate` against measured peaks, the hang
watchdog's stack dumps, stragglers in `llmtrain ranks`, and bitwise-repeatable runs under
`debug.deterministic`. Runs are real `python -m llmtrain run` processes (2 ranks under torchrun);
`observe_worker.py` adds model `slow-tiny`, which sleeps in the training forwards of one rank."""

from __future__ import annotations

import json
import math
import re
import statistics
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import train_support as ts
from shared_fixtures import run_cli  # noqa: F401

WORKER = Path(__file__).with_name("observe_worker.py")
MIB = 2**20
# a window opens before step s when s % every == 0 and s + warmup + active - 1 <= the last step
# (12): before steps 5 and 10, not 15; its trace is named after its first recorded step, s + warmup
PROFILE = {"every": 5, "active": 2, "warmup": 1}
PROFILED_STEPS = 12
WINDOWS = [6, 11]
# per training forward of the straggling rank (one forward per step): well above the step-time
# jitter of a loaded 2-core machine, where 0.05 s left rank 0 the slower one on 3 of 14 steps
SLEEP = 0.2


def worker_torchrun(nproc: int, *args: object) -> list[str]:
    """ts.torchrun's launcher running observe_worker.py (`llmtrain run ARGS`, plus slow-tiny)."""
    launcher = ts.torchrun(nproc)
    assert launcher[-2:] == ["-m", "llmtrain"], launcher
    return [*launcher[:-2], str(WORKER), *map(str, args)]


def small_config(data, run_dir: Path, name: str, steps: int) -> dict:
    """The shared config cut to `steps` steps: no eval, one save at the end, never resumed."""
    config = ts.run_config(data, run_dir, name)
    config["data"].pop("eval")
    config["training"].update(steps=steps, checkpoint_every=None)
    config["checkpoint"]["resume"] = "never"
    return config


def rank_log(run_dir: Path, rank: int, event: str | None = None) -> list[dict]:
    """The rank's JSON log lines (of one event); a line still being written is left out."""
    path = run_dir / "logs" / f"rank{rank}.jsonl"
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if event is None or row.get("event") == event:
            rows.append(row)
    return rows


def table_rows(out: str, header: str) -> list[list[str]]:
    """The whitespace-separated rows after the line starting with `header`, up to a blank line
    or a line that is not part of the table."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith(header)) + 1
    rows = []
    for line in lines[start:]:
        if not line.strip() or line.startswith(("slowest:", "error:")):
            break
        rows.append(line.split())
    return rows


def finish_all(procs: dict[str, subprocess.Popen], timeout: float) -> None:
    """Wait for runs started side by side; fail on any that failed, leaving none running."""
    try:
        done = {name: ts.finish(proc, timeout) for name, proc in procs.items()}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                ts.stop_group(proc)
                proc.communicate()
    for name, proc in done.items():
        assert proc.returncode == 0, f"run {name} exited {proc.returncode}:\n{proc.stderr[-6000:]}"


# --- shared runs ---
@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return ts.pack_corpus(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def profiled(data, tmp_path_factory) -> Path:
    """2 ranks, 12 steps, profiler windows of 1 warmup + 2 recorded steps every 5 steps."""
    work = tmp_path_factory.mktemp("profiled")
    config = small_config(data, work / "runs", "profiled", PROFILED_STEPS)
    config["profile"] = PROFILE
    ts.run(ts.torchrun(2, "run", ts.write_config(work / "run.yaml", config)), timeout=600)
    return work / "runs" / "profiled"


@pytest.fixture(scope="module")
def straggler(data, tmp_path_factory) -> Path:
    """2 ranks, 15 steps of slow-tiny whose rank 1 sleeps SLEEP s per training forward."""
    work = tmp_path_factory.mktemp("straggler")
    config = small_config(data, work / "runs", "straggler", 15)
    config["model"]["kind"] = "slow-tiny"
    path = ts.write_config(work / "run.yaml", config)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("SLOW_RANK", "1")
        env.setenv("SLOW_SECONDS", str(SLEEP))
        ts.run(worker_torchrun(2, path), timeout=600)
    return work / "runs" / "straggler"


@pytest.fixture(scope="module")
def repeats(data, tmp_path_factory) -> dict[str, Path]:
    """Three single-process deterministic runs with dropout, side by side: `a` and `b` with the
    same seed, `other` with another."""
    work = tmp_path_factory.mktemp("repeats")
    config = small_config(data, work / "runs", "a", 8)
    config["model"]["dropout"] = 0.1
    config["debug"] = {"deterministic": True}
    path = ts.write_config(work / "run.yaml", config)
    runs = {"a": [], "b": [], "other": ["seed=4"]}
    procs = {
        name: ts.start(ts.llmtrain("run", path, f"name={name}", *extra))
        for name, extra in runs.items()
    }
    finish_all(procs, timeout=600)
    return {name: work / "runs" / name for name in runs}


# --- 1. profiler windows and `llmtrain profile` ---
def test_profiler_writes_one_trace_per_rank_for_each_window(profiled):
    profiles = profiled / "profiles"
    assert sorted(p.name for p in profiles.iterdir()) == sorted(f"step-{s}" for s in WINDOWS)
    for step in WINDOWS:
        window = profiles / f"step-{step}"
        assert sorted(p.name for p in window.iterdir()) == ["rank0.json", "rank1.json"]
        for rank in (0, 1):
            trace = json.loads((window / f"rank{rank}.json").read_text())
            events = trace["traceEvents"]
            assert trace["distributedInfo"]["rank"] == rank
            assert trace["distributedInfo"]["world_size"] == 2
            ops = [e["name"] for e in events if e.get("cat") == "cpu_op"]
            assert "aten::mm" in ops and len(ops) > 100, f"step {step} rank {rank}"
            marks = [e["name"] for e in events if str(e.get("name")).startswith("ProfilerStep#")]
            assert len(marks) == PROFILE["active"], (step, rank, marks)
            # one optimizer step per recorded training step, none from the warmup step
            optimizer_steps = [e for e in events if e.get("name") == "Optimizer.step#AdamW.step"]
            assert len(optimizer_steps) == PROFILE["active"], (step, rank)
        written = [e["steps"] for e in rank_log(profiled, 0, "profile.written")]
        assert f"{step}-{step + PROFILE['active'] - 1}" in written


def test_profile_command_lists_the_top_operators_by_self_time(profiled, run_cli):  # noqa: F811
    code, out, err = run_cli("profile", profiled, "--rank", 1, "--top", 5)
    assert code == 0, err
    trace_file = profiled / "profiles" / f"step-{WINDOWS[-1]}" / "rank1.json"  # the newest
    assert out.splitlines()[0].startswith(f"{trace_file}: top 5 of ")
    rows = table_rows(out, "operator")
    assert len(rows) == 5, out
    self_ms = [float(row[-3]) for row in rows]
    assert all(ms > 0 for ms in self_ms) and self_ms == sorted(self_ms, reverse=True), out
    for row in rows:
        assert row[-5] == "cpu" and int(row[-4]) >= 1
        assert float(row[-3]) <= float(row[-1]) + 1e-3, row  # self time within the total

    # every operator: the shares add up, and aten::mm's calls are the trace's
    code, out, err = run_cli("profile", profiled, "--rank", 1, "--top", 100_000)
    assert code == 0, err
    rows = {" ".join(row[:-5]): row[-5:] for row in table_rows(out, "operator")}
    total_ms = sum(float(row[2]) for row in rows.values())
    for row in rows.values():  # each share is of the summed self time
        assert float(row[3].rstrip("%")) == pytest.approx(100 * float(row[2]) / total_ms, abs=0.1)
    aten = {name: row for name, row in rows.items() if name.startswith("aten::")}
    assert "aten::mm" in aten and float(aten["aten::mm"][2]) > 0
    events = json.loads(trace_file.read_text())["traceEvents"]
    mm_calls = sum(1 for e in events if e.get("cat") == "cpu_op" and e["name"] == "aten::mm")
    assert int(aten["aten::mm"][1]) == mm_calls

    code, out, err = run_cli("profile", profiled, "--step", WINDOWS[0], "--top", 3)
    assert code == 0, err
    assert out.startswith(str(profiled / "profiles" / f"step-{WINDOWS[0]}" / "rank0.json"))


def test_profile_command_names_the_windows_when_the_step_has_none(profiled, run_cli):  # noqa: F811
    code, out, err = run_cli("profile", profiled, "--step", 99)
    assert code == 2
    assert "no trace starting at step 99; traces start at 6, 11" in err
    assert "Traceback" not in err and not out


def test_a_run_without_profile_writes_no_profiles(straggler):
    assert (straggler / "metrics.jsonl").exists()
    assert not (straggler / "profiles").exists()


# --- 2. memory in the metrics ---
def test_metrics_carry_memory_and_the_largest_rank_peak(profiled, repeats):
    for run_dir in (profiled, repeats["a"]):
        for m in ts.read_metrics(run_dir):
            # CPU: resident set size, which torch alone makes well over 50 MiB
            assert 50 < m["peak_memory_mib"] < 8192, m
            assert 50 < m["active_memory_mib"] < 8192, m
            assert m["peak_memory_mib"] >= m["active_memory_mib"], m
    assert all("slowest_rank" not in m for m in ts.read_metrics(repeats["a"]))

    metrics = ts.read_metrics(profiled)
    assert [m["step"] for m in metrics] == list(range(1, PROFILED_STEPS + 1))
    assert all(m["slowest_rank"] in (0, 1) for m in metrics)
    last = [rank_log(profiled, rank, "step")[-1] for rank in (0, 1)]
    assert [line["step"] for line in last] == [PROFILED_STEPS] * 2
    # the rank lines are rounded to 6 decimals
    assert metrics[-1]["peak_memory_mib"] == pytest.approx(
        max(line["peak_memory_mib"] for line in last), abs=1e-5
    )
    assert metrics[-1]["data_wait_max"] == pytest.approx(
        max(line["data_wait"] for line in last), abs=1e-5
    )
    assert metrics[-1]["active_memory_mib"] == pytest.approx(last[0]["active_memory_mib"], abs=1e-5)


# --- 3. `llmtrain estimate` against measured peaks ---
def wide_config(data, run_dir: Path, name: str, checkpointing: str) -> dict:
    """The tiny model widened to ~4.9M parameters, micro-batches of 16 x 256 tokens, 2 steps:
    the peak is reached in step 2, the first whose forward and backward run with the optimizer
    state allocated (later steps add nothing to it: measured 941.2 MiB after step 2, 941.3 MiB
    after step 6)."""
    config = small_config(data, run_dir, name, 2)
    config["model"] = {
        "kind": "tiny",
        "vocab_size": 320,
        "max_seq_len": 256,
        "d_model": 256,
        "n_layers": 6,
        "n_heads": 4,
        "n_kv_heads": 4,
    }
    config["data"].update(seq_len=256, micro_batch=16, global_batch=16)
    config["parallel"] = {"kind": "default", "activation_checkpointing": {"mode": checkpointing}}
    return config


def estimate_rows(out: str) -> dict[str, float]:
    """`llmtrain estimate`'s table: row name -> MiB."""
    rows = re.findall(r"^\s+(\S.*?)\s+([\d,]+\.\d) MiB$", out, flags=re.M)
    return {name: float(size.replace(",", "")) for name, size in rows}


@pytest.fixture(scope="module")
def measured(data, tmp_path_factory) -> dict:
    """Peak memory of the wide model with activation checkpointing none and full, less that of
    a minimal model (the Python process and torch), each from its last metrics line."""
    work = tmp_path_factory.mktemp("measured")
    configs = {mode: wide_config(data, work / "runs", mode, mode) for mode in ("none", "full")}
    base = wide_config(data, work / "runs", "base", "none")
    base["model"].update(d_model=16, n_layers=1, n_heads=1, n_kv_heads=1)
    base["data"]["micro_batch"] = 1
    paths = {
        name: ts.write_config(work / f"{name}.yaml", c)
        for name, c in [*configs.items(), ("base", base)]
    }
    with pytest.MonkeyPatch.context() as env:
        # glibc raises its mmap threshold as tensors are freed and then keeps freed tensors
        # resident in its heap; a fixed threshold returns them, so RSS follows live tensors
        env.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
        procs = {name: ts.start(ts.llmtrain("run", path)) for name, path in paths.items()}
        finish_all(procs, timeout=600)
    peaks = {name: ts.read_metrics(work / "runs" / name)[-1]["peak_memory_mib"] for name in paths}
    return {
        "paths": paths,
        "peak": {mode: peaks[mode] - peaks["base"] for mode in configs},
    }


def estimated_total(run_cli, path: Path, *args: object) -> float:  # noqa: F811
    code, out, err = run_cli("estimate", path, *args)
    assert code == 0, err
    return estimate_rows(out)["total"]


@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_estimate_is_within_a_quarter_of_the_measured_peak(
    measured,
    run_cli,  # noqa: F811
    checkpointing,
):
    estimate = estimated_total(run_cli, measured["paths"][checkpointing])
    peak = measured["peak"][checkpointing]
    print(f"{checkpointing}: estimate {estimate:.1f} MiB, measured {peak:.1f} MiB")
    assert 1 / 1.25 <= estimate / peak <= 1.25, (
        f"activation checkpointing {checkpointing}: estimate {estimate:.1f} MiB, "
        f"measured {peak:.1f} MiB (ratio {estimate / peak:.2f})"
    )


def test_full_checkpointing_lowers_the_estimate_as_it_lowers_the_peak(measured, run_cli):  # noqa: F811
    none = estimated_total(run_cli, measured["paths"]["none"])
    full = estimated_total(run_cli, measured["paths"]["full"])
    peaks = measured["peak"]
    assert peaks["full"] < 0.6 * peaks["none"], peaks
    assert full < 0.6 * none, (none, full)


def test_estimate_divides_parameters_over_the_mesh(measured, run_cli):  # noqa: F811
    path = measured["paths"]["none"]
    code, out, err = run_cli("estimate", path)
    assert code == 0, err
    n_params = int(re.search(r"([\d,]+) parameters, ", out).group(1).replace(",", ""))
    one = estimate_rows(out)
    assert one["parameters"] == round(n_params * 4 / MIB, 1)  # fp32, whole on one rank

    # dp 2 needs a global batch of 2 ranks x micro-batch 16
    code, out, err = run_cli(
        "estimate", path, "--world-size", 4, "mesh.dp_shard=2", "mesh.tp=2", "data.global_batch=32"
    )
    assert code == 0, err
    assert "world 4: dp_replicate 1 x dp_shard 2 x cp 1 x tp 2 x pp 1" in out
    busiest = int(re.search(r"([\d,]+) on the busiest rank", out).group(1).replace(",", ""))
    assert busiest == math.ceil(n_params / 2)  # TP halves every block and the embeddings
    four = estimate_rows(out)
    assert four["parameters"] == round(math.ceil(busiest / 2) * 4 / MIB, 1)  # FSDP over 2
    assert four["parameters"] < one["parameters"] / 3.9
    assert four["gradients"] == four["parameters"]
    assert four["optimizer state"] == pytest.approx(one["optimizer state"] / 4, abs=0.1)


def test_estimate_refuses_a_mesh_that_does_not_fit_the_world(measured, run_cli):  # noqa: F811
    code, out, err = run_cli("estimate", measured["paths"]["none"], "--world-size", 4, "mesh.tp=3")
    assert code == 2
    assert "mesh: mesh " in err and "needs a multiple of 3 processes" in err
    assert "Traceback" not in err and not out


def test_attention_activations_grow_linearly_with_the_sequence(measured, run_cli):  # noqa: F811
    """The same tokens per micro-batch as 16 x 256 in 2 x 2048: flash attention keeps the memory."""
    path = measured["paths"]["none"]
    code, out, err = run_cli("estimate", path)
    assert code == 0, err
    short = estimate_rows(out)["activations"]
    overrides = ["model.max_seq_len=2048", "data.seq_len=2048", "data.micro_batch=2"]
    code, out, err = run_cli("estimate", path, *overrides, "data.global_batch=2")
    assert code == 0, err
    long = estimate_rows(out)["activations"]
    assert long == pytest.approx(short, rel=0.1), (short, long)


# --- 4. the hang watchdog ---
def main_thread(stacks: str) -> list[str]:
    """The frames of the thread that runs the worker's module, most recent first."""
    for thread in re.split(r"\n(?=(?:Current thread|Thread) 0x)", stacks):
        frames = [line.strip() for line in thread.splitlines() if line.startswith("  File ")]
        if frames and frames[-1].endswith("in <module>"):
            return frames
    raise AssertionError(f"no main thread in\n{stacks}")


def alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    running = []
    for p in processes:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                running.append(p)
        except psutil.NoSuchProcess:
            pass
    return running


def test_a_hung_rank_gets_every_rank_s_stacks_written(data, tmp_path, monkeypatch):
    config = small_config(data, tmp_path / "runs", "hang", 40)
    config["model"]["kind"] = "slow-tiny"
    config["debug"] = {"watchdog": {"multiple": 5, "min_seconds": 1, "warmup_steps": 2}}
    path = ts.write_config(tmp_path / "run.yaml", config)
    run_dir = tmp_path / "runs" / "hang"
    monkeypatch.setenv("SLOW_RANK", "1")
    monkeypatch.setenv("HANG_AT_FORWARD", "6")  # rank 1 sleeps 10 minutes in step 6
    proc = ts.start(worker_torchrun(2, path))
    family: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 300  # a loaded machine: torch imports, 5 steps, the stall
        while not all(rank_log(run_dir, rank, "watchdog.stall") for rank in (0, 1)):
            assert proc.poll() is None, (
                f"the run ended ({proc.returncode}):\n{proc.communicate()[1]}"
            )
            assert time.monotonic() < deadline, "no watchdog.stall on both ranks in 300 s"
            time.sleep(0.2)
    finally:
        try:
            family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
        ts.stop_group(proc)
        proc.communicate(timeout=30)
    psutil.wait_procs(family, timeout=10)
    assert not alive(family), f"left running: {alive(family)}"

    assert ts.last_logged_step(run_dir / "metrics.jsonl") == 5
    for rank in (0, 1):
        stacks_file = run_dir / "logs" / f"stacks-rank{rank}.txt"
        [stall] = rank_log(run_dir, rank, "watchdog.stall")
        assert stall["step"] == 6 and stall["activity"] == "step", stall
        assert stall["stacks"] == str(stacks_file) and str(stacks_file) in stall["message"]
        assert stall["level"] == "error"
        # the limit: 5 x the median of the steps so far, at least 1 s
        assert stall["limit_s"] == pytest.approx(max(1.0, 5 * stall["median_step_s"]), abs=2e-3)
        assert stall["seconds"] >= stall["limit_s"]
        text = stacks_file.read_text()
        assert re.match(rf"=== rank {rank}: step 6 \(step\) running for [\d.]+ s \(limit", text)
        frames = main_thread(text)
        assert any(f.endswith("in train_step") for f in frames), frames
        assert any(f.endswith("in forward_backward") for f in frames), frames
        if rank == 1:  # asleep in the model's forward
            assert frames[0].endswith("in hang_in_forward") and "observe_worker.py" in frames[0]
        else:  # waiting for rank 1 in a collective
            assert "torch/distributed" in frames[0], frames[:3]
            assert "hang_in_forward" not in text


# --- 5. stragglers ---
def test_a_straggler_sets_every_rank_s_pace(straggler):
    """Ranks step together, so both ranks' step lines show the sleeping rank's step time."""
    for rank in (0, 1):
        lines = rank_log(straggler, rank, "step")[1:]  # the first window holds start-up
        assert len(lines) == 14
        assert statistics.median(line["step_time_s"] for line in lines) > SLEEP
        assert all(0 <= line["sync_wait"] < 1 and 0 <= line["data_wait"] < 1 for line in lines)


def test_ranks_names_the_rank_that_is_slow_in_its_forward(straggler, run_cli):  # noqa: F811
    code, out, err = run_cli("ranks", straggler)
    assert code == 0, err
    rows = table_rows(out, "rank")
    marked = [int(row[0]) for row in rows if row[-1] == "slowest"]
    assert marked == [1], out
    assert "slowest: rank 1;" in out
    metrics = ts.read_metrics(straggler)[1:]
    ones = sum(m["slowest_rank"] == 1 for m in metrics)
    assert ones >= 0.8 * len(metrics), [m["slowest_rank"] for m in metrics]
    # rank 0 waits for rank 1's sleep, most of each step: rank 1 arrives late at the
    # collectives by about that share; rank 0 is never the late one
    lags = {
        rank: statistics.fmean(r["arrival_lag"] for r in rank_log(straggler, rank, "step")[1:])
        for rank in (0, 1)
    }
    assert lags[1] > 0.25 and lags[0] < 0.05, lags


# --- 6. determinism ---
def test_deterministic_runs_repeat_bitwise_and_the_seed_changes_them(repeats, profiled):
    a, b, other = (ts.read_metrics(repeats[name]) for name in ("a", "b", "other"))
    assert [m["step"] for m in a] == list(range(1, 9))
    assert [(m["loss"], m["grad_norm"]) for m in a] == [(m["loss"], m["grad_norm"]) for m in b]
    assert all(x["loss"] != y["loss"] for x, y in zip(a, other, strict=True))
    for name in ("a", "b", "other"):
        [event] = rank_log(repeats[name], 0, "debug.deterministic")
        assert "deterministic algorithms on" in event["message"]
    assert not rank_log(profiled, 0, "debug.deterministic")
