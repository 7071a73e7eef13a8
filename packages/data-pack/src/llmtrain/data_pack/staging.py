"""The temporaries of killed packs: which pack owns each, and removing those whose pack is gone.

A pack on a local disk writes under `<output>.tmp-<id>` and renames it into place; one killed
first leaves it behind. The staging directory holds a small owner record (pid, host, boot, process
start), and the next pack or merge of the same output removes the temporaries whose owner is no
longer running.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
from collections.abc import Iterator, Mapping
from typing import Any

import structlog

OWNER_FILE = ".llmtrain-owner.json"  # in a local staging directory: which process writes it
_TEMPORARY_SUFFIX = re.compile(r"\.tmp-[0-9a-f]{8}")

log = structlog.get_logger("llmtrain.data_pack")


def _boot_id() -> str | None:
    """This boot of the machine (Linux): a process of an earlier boot is gone whatever its pid."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return None


def _process_stat(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks since boot) from /proc, or None without /proc. The
    start time tells the process that wrote an owner record from a later one given its pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # the name, in parentheses, may hold spaces
    return fields[0], int(fields[19])  # fields 3 and 22 of proc(5)


def write_owner(staged: str) -> None:
    """Record this process as the owner of the new staging directory `staged`. The record
    appears whole or not at all (a temporary file renamed into place); if it cannot be written
    (a full disk), `staged` is removed before the error is raised: kept without a record, it
    would stay as "no owner record" forever."""
    stat = _process_stat(os.getpid())
    owner = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "boot": _boot_id(),
        "started": None if stat is None else stat[1],
    }
    path = os.path.join(staged, OWNER_FILE)
    try:
        with open(f"{path}.tmp", "w") as f:
            json.dump(owner, f)
        os.replace(f"{path}.tmp", path)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise


def _read_owner(staged: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(staged, OWNER_FILE)) as f:
            owner = json.load(f)
    except (OSError, ValueError):
        return None
    valid = (
        isinstance(owner, dict)
        and isinstance(owner.get("pid"), int)
        and owner["pid"] > 0
        and isinstance(owner.get("host"), str)
    )
    return owner if valid else None


def _owner_running(owner: Mapping[str, Any]) -> bool:
    """Whether the process named by an owner record (on this machine) still runs."""
    boot = _boot_id()
    if owner.get("boot") and boot and owner["boot"] != boot:
        return False
    try:
        os.kill(owner["pid"], 0)  # signal 0: only asks whether the pid exists
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, as another user's process
    stat = _process_stat(owner["pid"])
    if stat is None:
        return True  # no /proc to tell a reused pid apart: keep what may be running
    state, started = stat
    if state in ("Z", "X"):  # exited, not yet reaped by its parent
        return False
    return owner.get("started") in (None, started)


def _why_kept(staged: str) -> str | None:
    """None when the temporary's pack is gone; else why it must stay."""
    owner = _read_owner(staged)
    if owner is None:
        return (
            "it has no owner record (made by an older llmtrain, or by a pack killed as it "
            "started); remove it by hand if no pack is writing it"
        )
    if owner["host"] != socket.gethostname():
        return f"its pack (pid {owner['pid']}) runs on {owner['host']}, not on this machine"
    if _owner_running(owner):
        return f"its pack (pid {owner['pid']}) is still running"
    return None


def _temporaries(final: str) -> Iterator[str]:
    parent, name = os.path.split(os.path.abspath(final))
    try:
        entries = sorted(os.listdir(parent))
    except OSError:
        return
    for entry in entries:
        if entry.startswith(name) and _TEMPORARY_SUFFIX.fullmatch(entry[len(name) :]):
            yield os.path.join(parent, entry)


def remove_stale_temporaries(final: str) -> list[str]:
    """Remove the `<final>.tmp-<id>` directories of packs of `final` that no longer run (killed
    before they could clean up); keep those of running packs. Returns what was removed."""
    removed = []
    for staged in _temporaries(final):
        reason = _why_kept(staged)
        if reason is not None:
            log.info("output.temporary_kept", path=staged, reason=reason)
            continue
        try:
            shutil.rmtree(staged)
        except FileNotFoundError:
            continue  # its pack committed or cleaned it up meanwhile
        except OSError as exc:
            log.warning("output.stale_temporary_not_removed", path=staged, error=str(exc))
            continue
        log.info("output.stale_temporary_removed", path=staged)
        removed.append(staged)
    return removed
