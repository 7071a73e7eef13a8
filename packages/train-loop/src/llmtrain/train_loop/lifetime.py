"""A sweep's runs die with the sweep.

`llmtrain sweep` starts each run as a child in its own process group, so a kill of the group
(a job scheduler's, `kill -9 -PGID`) reaches the run too. On Linux the run also gets a
parent-death signal (`prctl(PR_SET_PDEATHSIG)`): SIGTERM when the sweep process ends, however
it ends (a SIGKILL of the sweep alone included), so the run saves a checkpoint and stops instead
of training on unwatched. torchrun starts its ranks in sessions of their own: each rank sets the
same signal on itself when the environment names the sweep (`SWEEP_PID_ENV`), and stops at once
if the sweep is already gone.

The run ignores SIGINT: Ctrl-C in the sweep's terminal reaches the whole process group, and the
sweep answers it by sending the run SIGTERM (save, then exit), as it answers its own SIGTERM.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
from collections.abc import Callable

# the sweep's pid, for the ranks torchrun starts (they are not the sweep's children)
SWEEP_PID_ENV = "LLMTRAIN_SWEEP_PID"
# what torchrun listens to: not SIGINT, which the sweep answers with SIGTERM
TORCHRUN_SIGNALS_ENV = "TORCHELASTIC_SIGNALS_TO_HANDLE"
TORCHRUN_SIGNALS = "SIGTERM,SIGHUP,SIGQUIT"
PR_SET_PDEATHSIG = 1
PARENT_DEATH_SIGNAL = signal.SIGTERM


def _prctl() -> Callable[..., int] | None:
    """libc's prctl on Linux, else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    return getattr(libc, "prctl", None)


def child_environment(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a sweep's run: this process as its sweep, and torchrun (if the run
    uses it) leaving SIGINT to the sweep."""
    child = dict(os.environ if env is None else env)
    child[SWEEP_PID_ENV] = str(os.getpid())
    child.setdefault(TORCHRUN_SIGNALS_ENV, TORCHRUN_SIGNALS)
    return child


def child_preexec() -> Callable[[], None]:
    """What the sweep's child runs between fork and exec: ignore SIGINT, and on Linux get
    SIGTERM when the sweep ends (killed at once if it has ended already). Everything it needs is
    looked up here, before the fork."""
    prctl = _prctl()
    parent = os.getpid()

    def preexec() -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, int(PARENT_DEATH_SIGNAL), 0, 0, 0)
            if os.getppid() != parent:  # the sweep ended before the signal was set
                os.kill(os.getpid(), signal.SIGKILL)

    return preexec


def die_with_the_sweep() -> None:
    """In `llmtrain run`: when started by a sweep (directly or through torchrun), get SIGTERM
    when this process's parent ends, and end now if the sweep has already ended."""
    text = os.environ.get(SWEEP_PID_ENV)
    if not text:
        return
    try:
        sweep = int(text)
    except ValueError:
        return
    prctl = _prctl()
    if prctl is not None:
        parent = os.getppid()
        prctl(PR_SET_PDEATHSIG, int(PARENT_DEATH_SIGNAL), 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), PARENT_DEATH_SIGNAL)
            return
    if not _alive(sweep):
        os.kill(os.getpid(), PARENT_DEATH_SIGNAL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's (the pid was reused): not ours to judge
        return True
    return True
