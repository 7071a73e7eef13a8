"""A one-node Slurm cluster for the tests of this directory (`nox -s slurm`): Debian's munged,
slurmctld and slurmd, started in a temporary directory (configuration, keys, state, spool, pid
files and logs all there, on ports of their own) and stopped whatever happens. The tests talk
to it only through Slurm's own commands (sbatch, squeue, scontrol, scancel), which read its
configuration from SLURM_CONF; the jobs inherit the environment of the tests (this venv's
`torchrun` and `llmtrain`, one OpenMP thread a process).

A cluster that does not start is an error, never a skip: these tests are the only check that
the job script works under a real scheduler."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "squeue", "scontrol", "scancel")
# seconds: a requeued job waits this long (+1) before it may start again (Slurm's default, 120 s,
# would make the time-limit test wait two minutes for each requeue)
CRED_EXPIRE = 5
# seconds between the SIGTERM of a cancelled or timed-out job and its SIGKILL: the runs save
# their checkpoint in between
KILL_WAIT = 30


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def slurm_conf(root: Path, host: str, cpus: int) -> str:
    """One node (this machine: `host` at 127.0.0.1 with `cpus` CPUs), one partition, no
    cgroups (processes tracked by their parents), CPUs as the consumable resource (so that
    array tasks of one CPU share the node), and a job completion log in place of accounting."""
    return f"""\
ClusterName=llmtrain-test
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={root}/munge/munge.socket,cred_expire={CRED_EXPIRE}
CredType=cred/munge
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={root}/jobcomp.txt
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
OverTimeLimit=0
KillWait={KILL_WAIT}
MinJobAge=600
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=test Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


def log_tails(root: Path) -> str:
    parts = []
    for log in sorted((root / "log").glob("*.log")):
        lines = log.read_text(errors="replace").splitlines()
        parts.append(f"--- {log.name}\n" + "\n".join(lines[-30:]))
    return "\n".join(parts)


def wait_until(what: str, check, root: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise AssertionError(f"the test cluster: {what} after {timeout} s\n{log_tails(root)}")


def node_state(host: str) -> str:
    proc = subprocess.run(
        ["scontrol", "show", "node", host], capture_output=True, text=True, timeout=30
    )
    for word in proc.stdout.split():
        if word.startswith("State="):
            return word.removeprefix("State=")
    return ""


def cancel_everything() -> None:
    """Cancel every job of the test cluster (all of them the tests')."""
    proc = subprocess.run(
        ["squeue", "--noheader", "--format=%A"], capture_output=True, text=True, timeout=30
    )
    jobs = sorted(set(proc.stdout.split()))
    if jobs:
        subprocess.run(["scancel", *jobs], capture_output=True, timeout=30)


def stop(proc: subprocess.Popen, timeout: float = 30) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="session")
def cluster(tmp_path_factory) -> Iterator[SimpleNamespace]:
    """The running cluster: `root` (its directory), `host`, `cpus`, `jobcomp` (the completion
    log). SLURM_CONF and OMP_NUM_THREADS are set for the session."""
    missing = [p for p in (*DAEMONS, *CLIENTS) if not shutil.which(p)]
    assert not missing, f"{', '.join(missing)} not installed: run these tests with `nox -s slurm`"
    root = tmp_path_factory.mktemp("slurm")
    host = socket.gethostname().split(".")[0]
    cpus = os.cpu_count() or 1
    for sub in ("munge", "munge-key", "state", "spool", "log"):
        (root / sub).mkdir()
    (root / "munge").chmod(0o755)  # the socket's directory: open to every user
    (root / "munge-key").chmod(0o700)
    key = root / "munge-key" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    conf = root / "slurm.conf"
    conf.write_text(slurm_conf(root, host, cpus))

    daemons: list[subprocess.Popen] = []
    with pytest.MonkeyPatch.context() as env:
        env.setenv("SLURM_CONF", str(conf))
        env.setenv("OMP_NUM_THREADS", "1")
        # the jobs inherit this environment (sbatch's default --export=ALL): one without a
        # SLURM_* variable of an enclosing job
        for name in [n for n in os.environ if n.startswith(("SLURM_", "SBATCH_", "SRUN_"))]:
            if name != "SLURM_CONF":
                env.delenv(name)
        try:
            out = {name: (root / "log" / f"{name}.out").open("w") for name in DAEMONS}
            munged = [
                f"--key-file={key}",
                f"--socket={root}/munge/munge.socket",
                f"--pid-file={root}/munge/munged.pid",
                f"--seed-file={root}/munge/munged.seed",
                f"--log-file={root}/log/munged.log",
            ]
            daemons.append(
                subprocess.Popen(
                    ["munged", "--foreground", "--force", *munged],
                    stdout=out["munged"],
                    stderr=subprocess.STDOUT,
                )
            )
            wait_until("no munge socket", (root / "munge" / "munge.socket").exists, root)
            daemons.append(
                subprocess.Popen(
                    ["slurmctld", "-D", "-i", "-f", str(conf)],
                    stdout=out["slurmctld"],
                    stderr=subprocess.STDOUT,
                )
            )
            daemons.append(
                subprocess.Popen(
                    ["slurmd", "-D", "-N", host, "-f", str(conf)],
                    stdout=out["slurmd"],
                    stderr=subprocess.STDOUT,
                )
            )
            for file in out.values():
                file.close()  # the daemons hold their own

            def idle() -> bool:
                for proc in daemons:
                    assert proc.poll() is None, f"{proc.args[0]} exited\n{log_tails(root)}"
                return node_state(host) == "IDLE"

            wait_until("the node is not idle", idle, root)
            yield SimpleNamespace(root=root, host=host, cpus=cpus, jobcomp=root / "jobcomp.txt")
        finally:
            if len(daemons) == len(DAEMONS):
                cancel_everything()
                try:  # the jobs' processes end before slurmd does
                    wait_until("jobs are left", lambda: not queued_jobs(), root, KILL_WAIT + 30)
                except AssertionError as e:
                    print(e)
            for proc in reversed(daemons):
                stop(proc)


def queued_jobs() -> list[str]:
    proc = subprocess.run(
        ["squeue", "--noheader", "--format=%i %T"], capture_output=True, text=True, timeout=30
    )
    return proc.stdout.splitlines()
