"""Where a pack writes before it commits: the temporaries of killed packs (which pack owns each,
and removing those whose pack is gone), and the gate every write into the staging area passes.

A pack on a local disk writes under `<output>.tmp-<id>` and renames it into place; one killed
first leaves it behind. The staging directory holds a small owner record (pid, host, boot, process
start), and the next pack or merge of the same output removes the temporaries whose owner is no
longer running.

zarr writes in threads of its own (its event loop, and the threads that loop hands file writes
to): an interrupt (Ctrl-C) ends the wait of the pack's main thread, not a write under way. Such a
write, finishing after the pack removed its staging directory, would make it again (a chunk's
parent directories are created on write) and leave it behind once the process is gone. So every
write goes through a `WriteGate` (`GatedStore`), and an abandoned pack closes the gate (later
writes are refused; those under way are waited for) before it removes anything.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import socket
import threading
from collections.abc import Callable, Coroutine, Iterable, Iterator, Mapping
from typing import Any

import structlog
from zarr.abc.store import Store
from zarr.core.buffer import Buffer
from zarr.storage import WrapperStore

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


class StagingClosedError(RuntimeError):
    """A write into a staging area after its pack ended (committed or abandoned)."""


class WriteGate:
    """Counts the writes under way into one staging area. `close()` refuses every later write and
    waits for those under way, so that what is removed (or renamed) next stays as it is."""

    def __init__(self, where: str):
        self.where = where
        self._changed = threading.Condition()
        self._active = 0
        self._closed = False

    def enter(self) -> None:
        with self._changed:
            if self._closed:
                raise StagingClosedError(f"{self.where}: a write after the pack ended")
            self._active += 1

    def leave(self) -> None:
        with self._changed:
            self._active -= 1
            self._changed.notify_all()

    @property
    def active(self) -> int:
        with self._changed:
            return self._active

    def close(self, timeout: float | None = None) -> bool:
        """Refuse later writes and wait up to `timeout` seconds (None: as long as it takes) for
        those under way; False if some were still running then."""
        with self._changed:
            self._closed = True
            return self._changed.wait_for(lambda: self._active == 0, timeout)


class GatedStore(WrapperStore[Store]):
    """A zarr store whose every change (and a local store's opening, which makes its directory)
    passes through a `WriteGate`. The gate is left when the change is done, also if the coroutine
    that waits for it is cancelled (the file write in its thread goes on regardless)."""

    def __init__(self, store: Store, gate: WriteGate):
        super().__init__(store)
        self.gate = gate

    def _with_store(self, store: Store) -> GatedStore:
        return type(self)(store, self.gate)

    async def _through_gate(self, start: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
        self.gate.enter()
        try:
            task = asyncio.ensure_future(start())
        except BaseException:
            self.gate.leave()
            raise
        task.add_done_callback(self._done)
        return await asyncio.shield(task)

    def _done(self, task: asyncio.Future[Any]) -> None:
        self.gate.leave()
        if not task.cancelled():
            task.exception()  # retrieved: its waiter (if still there) raises it, else nobody

    async def _open(self) -> None:
        await self._through_gate(self._store._open)

    async def _ensure_open(self) -> None:
        await self._through_gate(self._store._ensure_open)

    async def set(self, key: str, value: Buffer) -> None:
        await self._through_gate(lambda: self._store.set(key, value))

    async def set_if_not_exists(self, key: str, value: Buffer) -> None:
        await self._through_gate(lambda: self._store.set_if_not_exists(key, value))

    async def _set_many(self, values: Iterable[tuple[str, Buffer]]) -> None:
        await self._through_gate(lambda: self._store._set_many(values))

    async def delete(self, key: str) -> None:
        await self._through_gate(lambda: self._store.delete(key))

    async def delete_dir(self, prefix: str) -> None:
        await self._through_gate(lambda: self._store.delete_dir(prefix))

    async def clear(self) -> None:
        await self._through_gate(self._store.clear)
