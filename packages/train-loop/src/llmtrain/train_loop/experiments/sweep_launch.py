"""Launching a sweep's runs: one after another here (each dies with the sweep, `lifetime.py`),
as printed torchrun commands, or as a SLURM job-array script."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import NoReturn

from llmtrain.ablate.files import write_atomically
from llmtrain.ablate.runs import read_metrics, read_summary
from llmtrain.train_loop import lifetime
from llmtrain.train_loop.experiments.sweep_plan import PlannedRun

# the CPU cores a SLURM task asks for per process: its own thread, data prefetch, checkpoint writes
CPUS_PER_PROCESS = 4
# the #SBATCH options that ask for GPUs or CPUs another way: given with --slurm, they replace
# what the script would ask for
GPU_OPTIONS = frozenset({"gpus-per-node", "gpus", "gpus-per-task", "gpus-per-socket", "gres"})
CPU_OPTIONS = frozenset({"cpus-per-task", "cpus-per-gpu", "mincpus"})


def run_command(config: Path, nproc: int, *, executable: bool) -> list[str]:
    """`llmtrain run CONFIG --resume`, under torchrun for several processes. `executable`: with
    this Python (`-m`), for running here; else the console scripts, for printing."""
    if nproc == 1:
        head = [sys.executable, "-m", "llmtrain"] if executable else ["llmtrain"]
    else:
        torchrun = [sys.executable, "-m", "torch.distributed.run"] if executable else ["torchrun"]
        head = [*torchrun, "--standalone", f"--nproc-per-node={nproc}", "-m", "llmtrain"]
    return [*head, "run", str(config), "--resume"]


def slurm_script(
    name: str,
    configs: Sequence[Path],
    *,
    nodes: int,
    nproc: int,
    gpus_per_node: int,
    options: Sequence[str],
    max_parallel: int | None,
    sweep_dir: Path,
) -> str:
    """A job array: task i runs configs[i] with torchrun on `nodes` nodes, one task per node
    with `gpus_per_node` GPUs (0: none) and CPUS_PER_PROCESS cores per process; `--slurm`
    options that ask for GPUs or CPUs themselves replace those. Preempted or requeued tasks
    resume from their checkpoints."""
    throttle = f"%{max_parallel}" if max_parallel else ""
    given = {option.partition("=")[0].lstrip("-") for option in options}
    resources = []
    if gpus_per_node and not given & GPU_OPTIONS:
        resources.append(f"#SBATCH --gpus-per-node={gpus_per_node}")
    if not given & CPU_OPTIONS:
        resources.append(f"#SBATCH --cpus-per-task={nproc * CPUS_PER_PROCESS}")
    lines = [
        "#!/bin/bash",
        f"# llmtrain sweep {name}: {len(configs)} runs, one array task each",
        f"#SBATCH --job-name={name}",
        f"#SBATCH --array=0-{len(configs) - 1}{throttle}",
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=1",
        *resources,
        f"#SBATCH --output={sweep_dir}/slurm-%A_%a.out",
        # a requeued task would truncate the output of its earlier attempts
        "#SBATCH --open-mode=append",
        "#SBATCH --signal=B:USR1@300",
        "#SBATCH --requeue",
    ]
    for option in options:
        key, sep, value = option.partition("=")
        lines.append(f"#SBATCH --{key.lstrip('-')}{'=' + value if sep else ''}")
    lines += [
        "set -euo pipefail",
        f"cd {shlex.quote(str(Path.cwd()))}",
        "CONFIGS=(",
        *(f"  {shlex.quote(str(c))}" for c in configs),
        ")",
        'CONFIG="${CONFIGS[$SLURM_ARRAY_TASK_ID]}"',
        'TASK="${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}"',
        "# the run's console output, every attempt appended (as --launch here writes it): where",
        "# `llmtrain sweep` reads why a run failed",
        'LOG="$(dirname "$CONFIG")/output.log"',
        'note() { echo "# $(date \'+%Y-%m-%d %H:%M:%S\') slurm $TASK: $*" >> "$LOG"; }',
        "# a killed attempt may have left half a line: the note starts a line of its own",
        'if [[ -s "$LOG" && -n "$(tail -c 1 "$LOG")" ]]; then echo >> "$LOG"; fi',
        'nodes=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))',
        'head="${nodes[0]}"',
        "# the rendezvous port is the task's own: array tasks share nodes",
        "port=$((20000 + SLURM_JOB_ID % 10000))",
        "# before the time limit (--signal) this script gets SIGUSR1; SIGTERM goes to the run's",
        "# processes on every node through scancel (srun would turn a SIGTERM into SIGKILL), each",
        "# finishes its step, saves and exits; the task is requeued and resumes from there",
        "on_usr1() {",
        "    requeued=1",
        '    note "SIGUSR1 before the time limit: the run saves, then the task is requeued"',
        '    scancel --signal=TERM "$TASK"',
        '    wait "$pid" || true',
        '    scontrol requeue "$TASK"',
        "}",
        'note "attempt $((${SLURM_RESTART_COUNT:-0} + 1)) on ${SLURM_JOB_NODELIST}: $CONFIG"',
        "# srun (Slurm 22.05 and later) does not pass the job's cpus-per-task on to its task",
        "srun --kill-on-bad-exit=1 "
        '${SLURM_CPUS_PER_TASK:+--cpus-per-task="$SLURM_CPUS_PER_TASK"} \\',
        "    torchrun \\",
        f'    --nnodes="$SLURM_NNODES" --nproc-per-node={nproc} \\',
        '    --rdzv-backend=c10d --rdzv-endpoint="$head:$port" --rdzv-id="$TASK" \\',
        '    -m llmtrain run "$CONFIG" --resume >> "$LOG" 2>&1 &',
        "pid=$!",
        "trap on_usr1 USR1",
        "code=0",
        'wait "$pid" || code=$?',
        'if [[ -n "${requeued:-}" ]]; then exit 0; fi',
        "# the line `llmtrain sweep` reads as this attempt's failure",
        'if ((code != 0)); then note "exit code $code"; fi',
        'exit "$code"',
    ]
    return "\n".join(lines) + "\n"


def _last_error(log_file: Path) -> str:
    """The run's last `error:` line, else its last line that is not a launcher's note."""
    try:
        lines = [ln.strip() for ln in log_file.read_text(errors="replace").splitlines()]
    except OSError:
        return "no output"
    lines = [ln for ln in lines if ln and not ln.startswith("# ")]
    for line in reversed(lines):
        if line.startswith("error:"):
            return line[len("error:") :].strip()
    return lines[-1] if lines else "no output"


# the job script's note of a failed attempt, the last line of the run's output.log
_EXIT_NOTE = re.compile(r"# \S+ \S+ slurm \S+: exit code (\d+)")


def failure(path: Path) -> str | None:
    """Why the run in `path` failed ("exit code N: reason"), or None: its summary.json says
    failed, or (a run of the SLURM job script that failed before it wrote one) the script's
    last note in its output.log is a nonzero exit code."""
    log_file = path / "output.log"
    summary = read_summary(path)
    if summary is not None and summary.get("status") == "failed":
        why = summary.get("error") or _last_error(log_file)
        code = summary.get("exit_code")
        return f"exit code {code}: {why}" if code is not None else str(why)
    try:
        lines = log_file.read_text(errors="replace").splitlines()
    except OSError:
        return None
    last = next((line for line in reversed(lines) if line.strip()), "")
    match = _EXIT_NOTE.fullmatch(last.strip())
    return f"exit code {match[1]}: {_last_error(log_file)}" if match else None


def _ends_mid_line(path: Path) -> bool:
    """Whether a file ends without a newline (a process killed mid-write)."""
    try:
        with path.open("rb") as f:
            f.seek(-1, os.SEEK_END)
            return f.read(1) != b"\n"
    except (FileNotFoundError, OSError):  # none yet, or empty (seek before the start)
        return False


def run_here(planned: Sequence[PlannedRun], sweep_dir: Path, nproc: int) -> list[tuple[str, str]]:
    """Run the unfinished runs one after another; returns (run id, why) of the failed ones."""
    failed = []
    clock = TimeLeft([run for run in planned if not finished(run.path(sweep_dir))])

    def say(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    for i, run in enumerate(planned, 1):
        path = run.path(sweep_dir)
        prefix = f"[{i}/{len(planned)}] {run.id}"
        summary = read_summary(path)
        if summary is not None and summary.get("status") == "finished":
            say(f"{prefix}: finished before, skipped")
            continue
        resuming = _has_checkpoints(run)
        log_file = path / "output.log"
        say(f"{prefix}: {'resuming' if resuming else 'running'} (output: {log_file})")
        started = time.perf_counter()
        command = run_command(path / "config.yaml", nproc, executable=True)
        cut = _ends_mid_line(log_file)
        with log_file.open("a", encoding="utf-8") as out:
            # a killed run may have left half a line: the header starts a line of its own
            out.write(("\n" if cut else "") + f"# {time.strftime('%Y-%m-%d %H:%M:%S')} ")
            out.write(f"{shlex.join(command)}\n")
            out.flush()
            # the run stays in the sweep's process group and, on Linux, gets SIGTERM when the
            # sweep ends: it never trains on alone (lifetime.py)
            proc = subprocess.Popen(
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=lifetime.child_environment(),
                # calls only prctl and signal, both looked up before the fork
                preexec_fn=lifetime.child_preexec(),
            )
            try:
                with _signals_interrupt():
                    code = proc.wait()
            except KeyboardInterrupt:
                # the run saves a checkpoint on SIGTERM; the next `llmtrain sweep` resumes it
                say(f"{prefix}: interrupted; stopping the run (it saves, then exits)")
                proc.send_signal(signal.SIGTERM)  # torchrun passes it on to its ranks
                proc.wait()
                raise
        seconds = time.perf_counter() - started
        left = clock.done(run, seconds)
        summary = read_summary(path)
        if code == 0 and summary is not None and summary.get("status") == "finished":
            say(f"{prefix}: finished in {seconds:.0f} s{_result(path)}{left}")
        else:
            why = (summary or {}).get("error") or _last_error(log_file)
            if summary is None or summary.get("status") != "failed":
                # failed before training started (or killed): say so where compare looks
                record = {"status": "failed", "step": 0, "error": why, "exit_code": code}
                write_atomically(path / "summary.json", json.dumps(record, indent=1) + "\n")
            failed.append((run.id, f"exit code {code}: {why}"))
            say(f"{prefix}: FAILED (exit code {code}) after {seconds:.0f} s: {why}{left}")
    return failed


def finished(path: Path) -> bool:
    """Whether the run in `path` has finished (its summary says so)."""
    summary = read_summary(path)
    return summary is not None and summary.get("status") == "finished"


class TimeLeft:
    """The sweep's time left, from the runs done so far: their seconds per step trained (their
    start-up included), times the steps the runs still to go will train (a decay branch only
    its own). A rough figure: runs of other sizes run at other speeds."""

    def __init__(self, pending: Sequence[PlannedRun]):
        self.left = {run.id: _steps_to_train(run) for run in pending}
        self.seconds = 0.0
        self.steps = 0

    def done(self, run: PlannedRun, seconds: float) -> str:
        """Count `run` as done in `seconds`; the tail of its line: the runs and time left."""
        self.seconds += seconds
        self.steps += self.left.pop(run.id, 0)
        if not self.left:
            return ""
        runs = f"{len(self.left)} run{'s' * (len(self.left) != 1)} to go"
        if not self.steps:
            return f"; {runs}"
        remaining = sum(self.left.values()) * self.seconds / self.steps
        return f"; {runs}, about {_duration(remaining)} left"


def _steps_to_train(run: PlannedRun) -> int:
    """The steps a run trains itself (its config's steps; a branch's after its start)."""
    training, init = run.config.training, run.config.init
    steps = training.steps or 0
    start = init.step if init is not None and init.state == "all" and init.step else 0
    return max(steps - start, 0)


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


@contextlib.contextmanager
def _signals_interrupt() -> Iterator[None]:
    """SIGTERM and SIGHUP stop the sweep like Ctrl-C, so the running run is stopped with it
    (with SIGTERM: it saves, then exits; it ignores the terminal's SIGINT)."""

    def interrupt(signum: int, frame: FrameType | None) -> NoReturn:
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _has_checkpoints(run: PlannedRun) -> bool:
    from fsspec.core import url_to_fs

    checkpoint = run.config.checkpoint
    url = checkpoint.dir or str(Path(run.config.run_dir) / run.id / "checkpoints")
    try:
        fs, root = url_to_fs(url, **checkpoint.storage_options)
        return any(fs.exists(f"{d}/COMMITTED") for d in fs.ls(root, detail=False))
    except (OSError, ValueError):
        return False


def _result(path: Path) -> str:
    evals = [m["eval_loss"] for m in read_metrics(path / "metrics.jsonl") if "eval_loss" in m]
    return f", eval loss {evals[-1]:.4f}" if evals else ""
