"""`llmtrain sweep --launch slurm` under a real Slurm (the one-node cluster of conftest.py): the
job array it writes is submitted with sbatch and watched with squeue and scontrol, and the runs
are read back from their directories.

- A 4-run array throttled to 2 tasks at once finishes every run with the losses of the same
  sweep launched `here`.
- A run whose time limit comes mid-training gets SIGUSR1 from Slurm (`--signal`), saves, is
  requeued by the script and finishes with the losses of an uninterrupted run.
- `scancel` of an array leaves each run `stopped` with a checkpoint; the script written again
  resumes them.
- A run that fails is reported by `llmtrain sweep` afterwards, with its reason.

Slurm signals on a clock of its own (it looks at time limits every 30 s): a run that must be
mid-training when a signal comes waits for it under SIGSTOP, sent by `scancel --signal`, rather
than training for a minute. The tests wait on what the jobs do, with generous timeouts."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import train_support as ts

RTOL = 1e-6
KEYS = ("loss", "lr", "grad_norm", "eval_loss", "tokens")
IDS = ["n_layers=1,seed=0", "n_layers=1,seed=1", "n_layers=2,seed=0", "n_layers=2,seed=1"]
# CPU jobs; a task asks for a CPU a process (on_slurm), so that two share the node
ON_SLURM = ("--launch", "slurm", "--gpus-per-node", "0")
# Slurm's time limits are whole minutes and slurmctld looks at them every 30 s: with a limit of
# 1 minute and SIGUSR1 50 s before it, the signal comes 10 to 40 s into each attempt
TIME_LIMIT = ("--slurm", "time=1", "--slurm", "signal=B:USR1@50")
# steps of the time-limit run
LIMITED_STEPS = 1500
# steps of the cancelled runs
CANCELLED_STEPS = 1000
JOB_TIMEOUT = 600


# --- the runs ---


def small_config(data: SimpleNamespace, name: str) -> dict:
    """12 steps, eval and a checkpoint every 6 (as integration_tests/test_sweep.py's)."""
    config = ts.run_config(data, data.dir / "unused", name)  # the sweep sets run_dir
    config["data"]["eval"]["every"] = 6
    config["training"].update(steps=12, log_every=1, checkpoint_every=6)
    return config


def long_config(data: SimpleNamespace, name: str, steps: int) -> dict:
    """`steps` steps of the smallest model, a log line and an eval every 100, checkpoints only
    when stopped (and at the end)."""
    config = ts.run_config(data, data.dir / "unused", name)
    config["model"]["n_layers"] = 1
    config["data"]["eval"]["every"] = 100
    config["training"].update(steps=steps, log_every=100, checkpoint_every=10 * steps)
    return config


def sweep_cmd(base: Path, sweeps: Path, *args: object) -> list[str]:
    return ts.llmtrain("sweep", base, *args, "--dir", sweeps)


def on_slurm(nproc: int = 1) -> tuple[object, ...]:
    """The flags of a SLURM launch of `nproc` processes a run, a CPU each."""
    return (*ON_SLURM, "--nproc-per-node", nproc, "--slurm", f"cpus-per-task={nproc}")


def write_script(base: Path, sweeps: Path, *args: object, nproc: int = 1) -> Path:
    """`llmtrain sweep ... --launch slurm` with `nproc` processes a run: the job script it
    writes (and says to submit)."""
    proc = ts.run(sweep_cmd(base, sweeps, *args, *on_slurm(nproc)), timeout=600)
    script = Path(proc.stdout.split(maxsplit=1)[1].strip())
    assert proc.stdout == f"sbatch {script}\n" and script.name == "sweep.sbatch", proc.stdout
    return script


def metrics_of(run_dir: Path) -> dict[int, dict]:
    return ts.by_step(ts.read_metrics(run_dir))


def summary_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def assert_same_runs(expected: Path, got: Path) -> None:
    want, have = metrics_of(expected), metrics_of(got)
    assert sorted(have) == sorted(want), f"{got}: steps {sorted(have)} != {sorted(want)}"
    ts.assert_close_runs(want, have, RTOL, KEYS)


# --- Slurm, through its commands ---


def sbatch(script: Path) -> str:
    proc = subprocess.run(
        ["sbatch", "--parsable", str(script)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, f"sbatch exited {proc.returncode}: {proc.stderr}"
    return proc.stdout.strip().split(";")[0]


def queue(job: str) -> list[tuple[str, ...]]:
    """(task, state, reason) of the job's tasks that squeue still lists (pending, running,
    completing)."""
    proc = subprocess.run(
        ["squeue", "--noheader", f"--jobs={job}", "--format=%i %T %r"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    # a job that has left the queue is "Invalid job id" to squeue --jobs, or not listed
    assert proc.returncode == 0 or "Invalid job id" in proc.stderr, proc.stderr
    return [tuple(line.split()) for line in proc.stdout.splitlines() if line.strip()]


def wait_for_job(job: str, sweep_dir: Path, timeout: float = JOB_TIMEOUT) -> tuple[int, set[str]]:
    """Until squeue lists none of the job's tasks; returns the most it saw running at once and
    the reasons it gave for pending ones. Past `timeout` the job is cancelled and the test
    fails with the runs' output."""
    deadline = time.monotonic() + timeout
    most, reasons = 0, set()
    while time.monotonic() < deadline:
        tasks = queue(job)
        if not tasks:
            return most, reasons
        most = max(most, sum(state == "RUNNING" for _, state, _ in tasks))
        reasons |= {reason for _, state, reason in tasks if state == "PENDING"}
        time.sleep(0.5)
    subprocess.run(["scancel", job], timeout=60)
    outputs = "\n".join(
        f"--- {log}\n{log.read_text(errors='replace')[-3000:]}"
        for log in sorted(sweep_dir.rglob("output.log"))
    )
    raise AssertionError(f"job {job} still queued after {timeout} s: {queue(job)}\n{outputs}")


def job_field(job: str, field: str) -> str:
    """A field of `scontrol show job` (the job's first task for an array)."""
    proc = subprocess.run(
        ["scontrol", "show", "job", job], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    match = re.search(rf"\b{field}=(\S*)", proc.stdout)
    assert match, f"no {field} in scontrol show job {job}:\n{proc.stdout}"
    return match[1]


def completions(cluster: SimpleNamespace, job: str) -> dict[int, tuple[str, str]]:
    """{array task: (state, exit code)} of the job's tasks as the job completion log last
    recorded them."""
    found = {}
    for line in cluster.jobcomp.read_text().splitlines():
        fields = dict(re.findall(r"(\w+)=(\S*)", line))
        if fields.get("ArrayJobId") == job:
            found[int(fields["ArrayTaskId"])] = (fields["JobState"], fields["ExitCode"])
    return found


# --- fixtures ---


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return ts.pack_corpus(tmp_path_factory.mktemp("data"))


# --- the tests ---


def test_an_array_of_four_runs_two_at_a_time_equals_the_sweep_here(cluster, data, tmp_path):
    base = ts.write_config(tmp_path / "abl.yaml", small_config(data, "abl"))
    axes = ("--grid", "model.n_layers=1,2", "--seeds", "2")
    script = write_script(base, tmp_path / "slurm", *axes, "--max-parallel", "2")
    assert "#SBATCH --array=0-3%2" in script.read_text().splitlines()
    job = sbatch(script)
    # the same sweep launched here, beside the array
    here = ts.start(sweep_cmd(base, tmp_path / "here", *axes))
    try:
        most, reasons = wait_for_job(job, script.parent)
    finally:
        done = ts.finish(here, timeout=JOB_TIMEOUT)
    assert done.returncode == 0, done.stderr[-3000:]
    # the throttle held the other tasks back (the node has room for as many as it has CPUs)
    assert 1 <= most <= 2, f"{most} tasks ran at once under --max-parallel 2"
    assert "JobArrayTaskLimit" in reasons, reasons
    assert completions(cluster, job) == {task: ("COMPLETED", "0:0") for task in range(4)}
    for run_id in IDS:
        run_dir = script.parent / run_id
        assert summary_of(run_dir)["status"] == "finished", run_id
        assert_same_runs(tmp_path / "here" / "abl" / run_id, run_dir)
    # every run finished: no script again
    again = ts.run(sweep_cmd(base, tmp_path / "slurm", *axes, *on_slurm()), timeout=600)
    assert again.stdout == "" and "every run has finished; no script written" in again.stderr


def test_a_run_at_its_time_limit_is_requeued_and_resumes(cluster, data, tmp_path):
    steps = LIMITED_STEPS
    base = ts.write_config(tmp_path / "limit.yaml", long_config(data, "limit", steps))
    script = write_script(base, tmp_path / "slurm", *TIME_LIMIT)
    run_dir = script.parent / "base"
    log_file, metrics = run_dir / "output.log", run_dir / "metrics.jsonl"
    job = sbatch(script)
    here = ts.start(sweep_cmd(base, tmp_path / "here"))  # the uninterrupted run
    try:
        # A run of 1500 steps trains for seconds, and Slurm signals 10 to 40 s into a task (it
        # looks at time limits every 30 s): at step 200 the run waits under SIGSTOP (scancel
        # --signal) for the signal, and continues (SIGCONT) once the script has taken it and
        # sent its SIGTERM. Once the run has saved mid-training, the time limit is raised
        # (scontrol update): the rest of the run is not cut again every 30 s.
        deadline = time.monotonic() + JOB_TIMEOUT
        paused = False
        while queue(job) and time.monotonic() < deadline:
            text = log_file.read_text() if log_file.exists() else ""
            if re.search(r"stopped by a signal after step \d+", text):
                update = ["scontrol", "update", f"JobId={job}_0", "TimeLimit=10"]
                subprocess.run(update, check=True, timeout=60)
                break
            attempt = text[text.rfind(": attempt ") :] if ": attempt " in text else ""
            signalled = "SIGUSR1 before the time limit" in attempt
            if paused and signalled:
                subprocess.run(["scancel", "--signal=CONT", f"{job}_0"], check=True, timeout=60)
                paused = False
            elif attempt and not paused and not signalled and ts.last_logged_step(metrics) >= 200:
                subprocess.run(["scancel", "--signal=STOP", f"{job}_0"], check=True, timeout=60)
                paused = True
            time.sleep(0.2)
        wait_for_job(job, script.parent, timeout=max(1.0, deadline - time.monotonic()))
    finally:
        done = ts.finish(here, timeout=JOB_TIMEOUT)
    assert done.returncode == 0, done.stderr[-3000:]

    log = log_file.read_text()
    signalled = log.count("SIGUSR1 before the time limit")
    # every signal stopped the run (mid-training at least once: it saved a checkpoint there),
    # and the next attempt resumed from what it saved
    assert log.count("run.preempted") == signalled, log[-3000:]
    saved = [int(s) for s in re.findall(r"stopped by a signal after step (\d+)", log)]
    resumed = [int(s) for s in re.findall(r"run\.resumed .*step=(\d+)", log)]
    assert saved and resumed == saved, f"saved {saved}, resumed {resumed}:\n{log[-3000:]}"
    assert all(0 < step < steps for step in saved), saved
    assert set(saved) <= set(ts.committed_steps(run_dir / "checkpoints"))
    # requeued by the script, as many times as it was signalled
    assert int(job_field(f"{job}_0", "Restarts")) == signalled
    assert completions(cluster, job) == {0: ("COMPLETED", "0:0")}
    summary = summary_of(run_dir)
    assert (summary["status"], summary["step"]) == ("finished", steps)
    assert_same_runs(tmp_path / "here" / "limit" / "base", run_dir)


def test_scancel_stops_the_runs_and_the_script_again_resumes_them(cluster, data, tmp_path):
    steps = CANCELLED_STEPS
    base = ts.write_config(tmp_path / "stop.yaml", long_config(data, "stop", steps))
    sweeps = tmp_path / "slurm"
    script = write_script(base, sweeps, "--seeds", "2", "--max-parallel", "2")
    job = sbatch(script)
    runs = [script.parent / f"seed={seed}" for seed in (0, 1)]  # array tasks 0 and 1
    # the task that has trained 100 steps first is paused (SIGSTOP to its step) until the other
    # has: however far apart they start, both are mid-run when the array is cancelled. Not
    # `scontrol suspend`: Slurm SIGKILLs a job that was ever suspended when it is cancelled.
    deadline = time.monotonic() + JOB_TIMEOUT

    def step_of(task: int) -> int:
        assert queue(job), f"job {job} ended before both runs trained"
        assert time.monotonic() < deadline, f"job {job}: the runs did not train"
        return ts.last_logged_step(runs[task] / "metrics.jsonl")

    first = None  # the task that trained 100 steps first, and its step when paused
    while first is None or step_of(1 - first[0]) < 100:
        for task in (0, 1):
            if first is None and step_of(task) >= 100:
                subprocess.run(
                    ["scancel", "--signal=STOP", f"{job}_{task}"], check=True, timeout=60
                )
                first = (task, step_of(task))
        time.sleep(0.2)
    subprocess.run(["scancel", "--signal=CONT", f"{job}_{first[0]}"], check=True, timeout=60)
    while step_of(first[0]) <= first[1]:
        time.sleep(0.1)
    subprocess.run(["scancel", job], check=True, timeout=60)
    wait_for_job(job, script.parent)

    assert [state for state, _ in completions(cluster, job).values()] == ["CANCELLED"] * 2
    stopped = {}
    for run in runs:
        summary = summary_of(run)
        assert summary["status"] == "stopped", (run.name, summary)
        assert 100 <= summary["step"] < steps
        assert summary["step"] in ts.committed_steps(run / "checkpoints")
        stopped[run.name] = summary["step"]

    # written again, the script covers both runs; submitted, they resume and finish
    proc = ts.run(sweep_cmd(base, sweeps, "--seeds", "2", *on_slurm()), timeout=600)
    assert "2 runs to go (0 finished)" in proc.stderr and "failed" not in proc.stderr
    job = sbatch(script)
    wait_for_job(job, script.parent)
    assert completions(cluster, job) == {0: ("COMPLETED", "0:0"), 1: ("COMPLETED", "0:0")}
    for run in runs:
        summary = summary_of(run)
        assert (summary["status"], summary["step"]) == ("finished", steps)
        log = (run / "output.log").read_text()
        assert f"step={stopped[run.name]}" in re.findall(r"run\.resumed .*", log)[-1], log[-2000:]


def test_a_failed_run_is_reported_by_the_sweep_with_its_reason(cluster, data, tmp_path):
    """Two processes a run (torchrun's rendezvous on the task's port, two CPUs a task)."""
    base = ts.write_config(tmp_path / "abl.yaml", small_config(data, "abl"))
    missing = tmp_path / "missing.zarr"
    axes = ("--grid", f"data.train.0.path={data.train},{missing}", "--nproc-per-node", "2")
    sweeps = tmp_path / "slurm"
    script = write_script(base, sweeps, *axes[:2], nproc=2)
    manifest = json.loads((script.parent / "manifest.json").read_text())
    good, bad = [run["id"] for run in manifest["runs"]]
    job = sbatch(script)
    wait_for_job(job, script.parent)

    states = completions(cluster, job)
    assert states[0] == ("COMPLETED", "0:0") and states[1][0] == "FAILED", states
    summary = summary_of(script.parent / good)
    assert (summary["status"], summary["world_size"]) == ("finished", 2)
    # the sweep, run again, names the failed run and why; it still lists it to run
    proc = ts.run(sweep_cmd(base, sweeps, *axes, "--launch", "print"), timeout=600)
    assert "1 finished, 1 to run" in proc.stderr
    assert "1 run failed on the last attempt" in proc.stderr, proc.stderr
    line = next(ln for ln in proc.stderr.splitlines() if ln.startswith(f"  {bad}: "))
    assert re.fullmatch(rf"  {re.escape(bad)}: exit code [1-9]\d*: .*", line), line
    assert f"{missing}: not a packed dataset" in line, line
    commands = [shlex.split(line) for line in proc.stdout.splitlines()]
    assert [command[-4:] for command in commands] == [
        ["llmtrain", "run", str(script.parent / bad / "config.yaml"), "--resume"]
    ]


def test_decay_branches_wait_for_their_trunk(cluster, data, tmp_path):
    """A branched ladder (`--branch-decays`): the printed command submits the trunks' array,
    then the branches' with `--dependency=afterok` on it; the branch starts from the
    checkpoint its trunk saved."""
    config = small_config(data, "lad")
    config["model"] |= {"d_model": 8, "n_heads": 2, "n_kv_heads": 1}
    config["lr_scheduler"] = {"kind": "wsd", "warmup_steps": 3}
    config["training"].pop("checkpoint_every")
    base = ts.write_config(tmp_path / "lad.yaml", config)
    ladder = (
        "--ladder",
        "--params",
        "3.6e3",
        "--tokens-per-param",
        "1,4",
        "--aspect-ratio",
        "2,64",
    )
    sweeps = tmp_path / "slurm"
    proc = ts.run(
        sweep_cmd(base, sweeps, *ladder, "--branch-decays", "0.2", *on_slurm()), timeout=600
    )
    command = proc.stdout.strip()
    assert command.startswith("job=$(sbatch --parsable ") and "--dependency=afterok:" in command
    # the command as printed, the second sbatch told to print its job id alone
    parsable = command.replace("&& sbatch ", "&& sbatch --parsable ")
    submitted = subprocess.run(["bash", "-c", parsable], capture_output=True, text=True, timeout=60)
    assert submitted.returncode == 0, submitted.stderr
    branches = submitted.stdout.strip().split(";")[0]
    assert job_field(branches, "Dependency").startswith("afterok:")
    wait_for_job(branches, sweeps / "lad")
    manifest = json.loads((sweeps / "lad" / "manifest.json").read_text())
    ((branch_id, branch),) = manifest["branches"].items()
    for run_id in (branch["trunk"], branch_id):
        assert summary_of(sweeps / "lad" / run_id)["status"] == "finished", run_id
    assert min(metrics_of(sweeps / "lad" / branch_id)) == branch["start"] + 1
