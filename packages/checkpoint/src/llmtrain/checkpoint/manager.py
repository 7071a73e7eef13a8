"""The Checkpointer: DCP saves under `<root>/step-<n>/`, counted only once committed.

A save: (rank 0) clear an unfinished leftover of the same step → every rank writes its RNG state
→ DCP writes every rank's shards and, on the coordinator, the DCP metadata → rank 0 writes
`llmtrain.json` (what the caller wants kept: the config, counters) and last the `COMMITTED`
marker. DCP's own metadata rename is not atomic on object storage, so only the marker counts: a
directory without it does not exist for `latest_step`/`load`, and is cleaned up by a later commit.

The marker is also the step's manifest (`integrity`): every file with its size, and the hash of
each file read whole; a load checks every file it reads against it before using it, and a damaged
one is a `CorruptCheckpointError` naming the file, never a crash or wrong state.

Async saves return once the state is staged in host memory; the write, the marker and the keep
policy run in the background. At most one save is in flight: the next save, `wait()` and
`close()` wait for it. Deletion runs only after a commit, when nothing else is in flight, and
never touches the newest committed step.
"""

from __future__ import annotations

import base64
import binascii
import functools
import json
import os
import random
import re
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar, overload

import attrs
import structlog
import torch
import torch.distributed as dist
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.checkpoint.stateful import Stateful

from llmtrain.checkpoint.integrity import (
    COMMIT_FILE,
    INFO_FILE,
    METADATA_FILE,
    RNG_DIR,
    CheckpointError,
    Commit,
    CorruptCheckpointError,
    Damage,
    FileEntry,
    NewerFormat,
    check_bytes,
    damaged,
    file_entry,
    ordered,
    parse_json,
    read_commit,
    read_info,
    reading,
    reason,
    seal,
    size_problem,
)
from llmtrain.checkpoint.safe_io import SafeLoadPlanner, UnsafeCheckpointError
from llmtrain.checkpoint.stream_storage import (
    DEFAULT_THREADS,
    FORMAT,
    StreamReader,
    StreamWriter,
)
from llmtrain.core_mesh.errors import UserError, naming_file, no_space, no_space_message
from llmtrain.core_mesh.json_types import JSONObject
from llmtrain.core_mesh.storage_errors import storage_errors

if TYPE_CHECKING:
    from torch.distributed.checkpoint.staging import DefaultStager

__all__ = ["COMMIT_FILE", "INFO_FILE", "RNG_DIR", "CheckpointError", "CorruptCheckpointError"]

log = structlog.get_logger("llmtrain.checkpoint")

P = ParamSpec("P")
R = TypeVar("R")
# what a rank tells the others of a failed check: (rank, message, a UserError, file, problem)
_Verdict = tuple[int, str, bool, str | None, str]

# a step's directory: `step-<n>` as `step_url` writes it (ASCII digits, no leading zero), so a
# name is one step's and the step it names is the one its files must record
STEP_DIR = re.compile(r"^step-(0|[1-9][0-9]*)$")
# what a checkpoint directory is, for a path given as one that is not
HOLDS = (
    "; give a checkpoint directory (runs/<name>/checkpoints), which holds one step-<n> "
    "directory per saved step, each with llmtrain.json, .metadata and COMMITTED"
)


@attrs.frozen
class KeepPolicy:
    """Keep the newest `last` committed steps, plus every step divisible by `every` (0: none)
    and the `steps` named (the points other runs branch from)."""

    last: int = 3
    every: int = 0
    steps: frozenset[int] = frozenset()

    def __attrs_post_init__(self) -> None:
        if self.last < 1:
            raise ValueError("keep.last must be at least 1 (the newest checkpoint is always kept)")

    def deletable(self, committed: Sequence[int]) -> list[int]:
        steps = sorted(committed)
        keep = set(steps[-self.last :])
        if self.every:
            keep |= {s for s in steps if s % self.every == 0}
        keep |= self.steps & set(steps)
        return [s for s in steps if s not in keep]


def _default_storage_options(url: str, given: Mapping[str, object]) -> dict[str, Any]:
    """Retries with exponential backoff for object stores, unless the caller set their own.
    (Values typed Any: they are passed as keyword arguments, beside typed ones, to
    `StreamWriter` and `StreamReader`.)"""
    options = dict(given)
    if url.startswith(("s3://", "s3a://")):
        options.setdefault(
            "config_kwargs",
            {
                "retries": {"max_attempts": 5, "mode": "standard"},
                "connect_timeout": 10,
                "read_timeout": 60,
            },
        )
    return options


def _stager() -> DefaultStager:
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    cuda = torch.cuda.is_available()
    return DefaultStager(
        StagingOptions(
            use_pinned_memory=cuda,
            use_shared_memory=False,
            use_async_staging=False,
            use_non_blocking_copy=cuda,
        )
    )


def rng_state(python: random.Random | None = None) -> dict[str, object]:
    """This process's random states as JSON-safe data (no pickle): torch's, and `python`'s if
    given. Never the global `random`: libraries draw from it at moments no run controls
    (botocore's retry jitter, aiohttp's connection shuffle), so its state would differ between
    two runs of the same steps as soon as one of them retried a request."""
    state: dict[str, object] = {"torch": _b64(torch.get_rng_state())}
    if python is not None:
        state["python"] = _jsonable(python.getstate())
    # torch.cuda.is_initialized has no annotations in torch's own source
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: Mapping[str, Any], python: random.Random | None = None) -> None:
    if python is not None and "python" in state:
        python.setstate(_tupled(state["python"]))
    torch.set_rng_state(_byte_tensor(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_byte_tensor(s) for s in state["cuda"]])


def _b64(state: torch.Tensor) -> str:
    return base64.b64encode(bytes(state.tolist())).decode()  # torch works without numpy


def _byte_tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(
        bytearray(base64.b64decode(text, validate=True)), dtype=torch.uint8
    ).clone()


def check_rng_state(state: object) -> JSONObject:
    """`state`, checked: raise `Damage` unless it is what `rng_state` writes. Each generator's
    state is tried on a scratch generator of its kind, so a resume never fails half-way through
    restoring."""
    if not isinstance(state, dict) or not isinstance(state.get("torch"), str):
        raise Damage('holds no random state (a JSON object with a "torch" state)')
    try:
        torch.Generator().set_state(_byte_tensor(state["torch"]))
    except (ValueError, RuntimeError, binascii.Error) as exc:
        raise Damage(f"holds no valid torch random state ({reason(exc)})") from None
    if "python" in state:
        try:
            random.Random().setstate(_tupled(state["python"]))  # noqa: S311 - a scratch one
        except (TypeError, ValueError, OverflowError) as exc:
            raise Damage(f"holds no valid Python random state ({reason(exc)})") from None
    cuda = state.get("cuda", [])
    try:
        if not isinstance(cuda, list) or not all(_byte_tensor(s).numel() for s in cuda):
            raise ValueError("not a list of states")
    except (ValueError, TypeError, binascii.Error) as exc:
        raise Damage(f"holds no valid CUDA random states ({reason(exc)})") from None
    return state


def _jsonable(value: object) -> object:
    return [_jsonable(v) for v in value] if isinstance(value, tuple | list) else value


def _tupled(value: Any) -> Any:
    return tuple(_tupled(v) for v in value) if isinstance(value, list) else value


def _on_storage(
    doing: str,
) -> Callable[
    [Callable[Concatenate[Checkpointer, P], R]], Callable[Concatenate[Checkpointer, P], R]
]:
    """A Checkpointer method whose storage cannot be used (an endpoint that does not answer, a
    bucket that does not exist, access denied, no credentials) raises one CheckpointError line
    naming the checkpoint's URL and what to do; `doing`: read or write."""

    def wrap(
        method: Callable[Concatenate[Checkpointer, P], R],
    ) -> Callable[Concatenate[Checkpointer, P], R]:
        @functools.wraps(method)
        def run(self: Checkpointer, /, *args: P.args, **kwargs: P.kwargs) -> R:
            with storage_errors(self.url, doing=doing, error=CheckpointError):
                return method(self, *args, **kwargs)

        return run

    return wrap


class Checkpointer:
    """Save and load named stateful parts at `url` (a path or any fsspec URL)."""

    def __init__(
        self,
        url: str,
        *,
        keep: KeepPolicy | None = None,
        async_save: bool = False,
        storage_options: Mapping[str, object] | None = None,
        retries: int = 3,
        backoff_s: float = 2.0,
        io_threads: int = DEFAULT_THREADS,
        python_rng: random.Random | None = None,
    ):
        self.url = url.rstrip("/")
        self.io_threads = io_threads
        self.python_rng = python_rng  # the Python-level generator whose state checkpoints carry
        self.storage_options = _default_storage_options(self.url, storage_options or {})
        self.fs, self.root = url_to_fs(self.url, **self.storage_options)
        self.keep = keep or KeepPolicy()
        self.async_save = async_save
        self.retries, self.backoff_s = retries, backoff_s
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        # async saves run DCP's collectives from a background thread: give them their own group
        self._group = dist.new_group(backend="gloo") if self.distributed and async_save else None
        # one stager for the run: its host buffers are allocated once and reused by every save
        # (a fresh copy per save would fault in a new page for every 4 KiB of state)
        self._stager = _stager() if async_save else None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="llmtrain-ckpt")
        self._inflight: Future[None] | None = None

    # -- what exists ------------------------------------------------------------------------

    def _path(self, step: int, *names: str) -> str:
        return "/".join([self.root.rstrip("/"), f"step-{step}", *names])

    def step_url(self, step: int) -> str:
        return f"{self.url}/step-{step}"

    @_on_storage("read")
    def _step_dirs(self, *, existing: bool = False) -> dict[int, bool]:
        """Every step directory, and whether it is committed. `existing`: the checkpoint
        directory must be one (`llmtrain checkpoints --verify`): a path that does not exist or
        is a file is a `CheckpointError` saying what a checkpoint directory holds; otherwise it
        has no steps yet (a run that has not saved)."""
        try:
            self.fs.invalidate_cache(self.root)
            if existing and self.fs.isfile(self.root):
                raise CheckpointError(f"{self.url} is a file, not a checkpoint directory{HOLDS}")
            names = [n.rstrip("/").rsplit("/", 1)[-1] for n in self.fs.ls(self.root, detail=False)]
        except FileNotFoundError:
            if existing:
                raise CheckpointError(f"{self.url} does not exist{HOLDS}") from None
            return {}
        steps = {int(m.group(1)) for n in names if (m := STEP_DIR.match(n))}
        return {s: self.fs.exists(self._path(s, COMMIT_FILE)) for s in sorted(steps)}

    def committed_steps(self) -> list[int]:
        return [s for s, done in self._step_dirs().items() if done]

    def latest_step(self) -> int | None:
        steps = self.committed_steps()
        return steps[-1] if steps else None

    @_on_storage("read")
    def info(self, step: int) -> dict[str, Any]:
        """The step's record in llmtrain.json, with what the caller stored (`info=` of `save`)
        under "info"; checked against the step's commit. (JSON, typed Any for the readers of
        `info` that take its shape as the trainer wrote it.)"""
        return self._info(step, self._commit(step))

    def _read(self, step: int, name: str) -> bytes:
        self.fs.invalidate_cache(self._path(step, name).rsplit("/", 1)[0])
        data: bytes = self.fs.cat_file(self._path(step, name))  # fsspec is untyped
        return data

    def _commit(self, step: int) -> Commit:
        try:
            with reading(self.step_url(step), COMMIT_FILE):
                return read_commit(self._read(step, COMMIT_FILE), step, FORMAT)
        except NewerFormat as newer:
            raise self._newer(step, newer.written) from None

    def _newer(self, step: int, written: object) -> CheckpointError:
        return CheckpointError(
            f"{self.step_url(step)} is in checkpoint format {written}, written by a newer "
            f"llmtrain; this one reads formats 1 to {FORMAT}: upgrade llmtrain-checkpoint"
        )

    def _info(self, step: int, commit: Commit) -> JSONObject:
        with reading(self.step_url(step), INFO_FILE):
            data = self._read(step, INFO_FILE)
            check_bytes(data, (commit.files or {}).get(INFO_FILE))
            return read_info(data, commit)

    def _listing(self, step: int) -> dict[str, int]:
        """The step directory's files (relative name -> bytes), sub-directories included."""
        base = self._path(step)
        self.fs.invalidate_cache(base)
        try:
            found = self.fs.find(base, detail=True)
        except FileNotFoundError:
            return {}
        prefix = base.rstrip("/") + "/"
        return {
            path.removeprefix(prefix): int(entry.get("size") or 0)
            for path, entry in found.items()
            if path.startswith(prefix) and entry.get("type", "file") == "file"
        }

    def _check_files(
        self, step: int, commit: Commit, listing: Mapping[str, int], *, rng: bool
    ) -> None:
        """Every file the manifest lists is there at its recorded size (the files of the random
        states only when `rng`: a weights-only load does not read them)."""
        files = commit.files or {}
        for name in ordered(files):
            if name.startswith(f"{RNG_DIR}/") and not rng:
                continue
            recorded, got = files[name]["size"], listing.get(name)
            problem = "is missing" if got is None else size_problem(got, recorded)
            if got != recorded:
                raise damaged(self.step_url(step), f"{self.step_url(step)}/{name}", problem)

    # -- saving ---------------------------------------------------------------------------------

    @_on_storage("write")
    def save(
        self,
        step: int,
        state: Mapping[str, object],
        *,
        info: Mapping[str, object] | None = None,
        blocking: bool | None = None,
    ) -> None:
        """Save `state` (name -> Stateful or state dict) as step `step`; every rank calls it."""
        self.wait()
        run_async = self.async_save if blocking is None else not blocking
        if self.rank == 0:
            self._with_retries(step, lambda: self._prepare(step))
        if self.distributed:
            dist.barrier()
        rng = json.dumps(rng_state(self.python_rng)).encode()
        name = f"{RNG_DIR}/rank{self.rank}.json"
        self._with_retries(step, lambda: self._write(self._path(step, name), rng))
        rng_files = self._gathered({name: file_entry(rng)})
        writer = self._writer(step)
        started = time.perf_counter()
        if run_async:
            upload = self._async(step, dict(state), writer)
            log.info(
                "checkpoint.staged", step=step, seconds=round(time.perf_counter() - started, 3)
            )
            self._inflight = self._pool.submit(
                self._finish, step, upload, dict(info or {}), started, writer, rng_files
            )
        else:
            self._with_retries(step, lambda: self._dcp_save(step, dict(state), writer))
            self._finish(step, None, dict(info or {}), started, writer, rng_files)

    def _gathered(self, entry: dict[str, FileEntry]) -> dict[str, FileEntry]:
        """Every rank's manifest entries (each rank writes its own random states)."""
        if not self.distributed:
            return entry
        everyone: list[dict[str, FileEntry]] = [{}] * self.world_size  # each replaced
        dist.all_gather_object(everyone, entry)
        return {name: e for part in everyone for name, e in part.items()}

    def _prepare(self, step: int) -> None:
        dirs = self._step_dirs()
        if dirs.get(step):
            raise CheckpointError(
                f"{self.step_url(step)} is already committed; refusing to overwrite it (delete it "
                "or save to another checkpoint directory)"
            )
        if step in dirs:  # an unfinished save of this step from a crashed run
            self.fs.rm(self._path(step), recursive=True)

    def _writer(self, step: int) -> StreamWriter:
        return StreamWriter(self.step_url(step), threads=self.io_threads, **self.storage_options)

    def reader(self, step: int) -> StreamReader:
        """The DCP reader of committed step `step` (format 2, and format 1 of earlier versions),
        which checks the metadata against the step's commit; a checkpoint of a newer format is
        refused, naming it."""
        commit = self._commit(step)
        return self._reader(step, commit, self._info(step, commit))

    def _reader(self, step: int, commit: Commit, info: JSONObject) -> StreamReader:
        written = info.get("format", 1)  # a count when there (`read_info`)
        if isinstance(written, int) and written > FORMAT:
            raise self._newer(step, written)
        return StreamReader(
            self.step_url(step),
            threads=self.io_threads,
            manifest=commit.files,
            **self.storage_options,
        )

    @_on_storage("read")
    def open_step(self, step: int, *, rng: bool = False) -> tuple[StreamReader, Metadata]:
        """(reader, metadata) of committed step `step`, once every file a load reads is checked:
        the commit, each listed file's size (the random states' only with `rng`), llmtrain.json
        and the metadata against their hashes, the data files against the items they hold. No
        tensor is read yet; a damaged file is a `CorruptCheckpointError` naming it."""
        commit = self._commit(step)
        listing = self._listing(step)
        self._check_files(step, commit, listing, rng=rng)
        reader = self._reader(step, commit, self._info(step, commit))
        try:
            metadata = reader.read_metadata()
        except UnsafeCheckpointError as exc:
            raise CheckpointError(f"{self.step_url(step)}: {exc}") from None
        reader.check_sizes(metadata, listing)
        return reader, metadata

    def _dcp_save(self, step: int, state: dict[str, object], writer: StreamWriter) -> None:
        dcp_save(state, storage_writer=writer)

    def _async(self, step: int, state: dict[str, object], writer: StreamWriter) -> Future[None]:
        response = dcp_async_save(
            state,
            storage_writer=writer,
            process_group=self._group,
            async_stager=self._stager,
        )
        if isinstance(response, AsyncSaveResponse):
            response.staging_completion.result()
            return response.upload_completion
        return response

    def _with_retries(self, step: int, action: Callable[[], object]) -> None:
        for attempt in range(self.retries + 1):
            try:
                action()
                return
            except UserError:
                raise
            except (Exception, CheckpointException) as exc:  # storage errors come in many types
                if (full := no_space(exc)) is not None:  # waiting will not free the disk
                    raise self._no_space_error(step, full) from exc
                if attempt == self.retries:
                    raise CheckpointError(
                        f"saving {self.step_url(step)} failed after {attempt + 1} attempts: "
                        f"{_reason(exc)}. Earlier committed checkpoints are untouched"
                    ) from exc
                delay = self.backoff_s * 2**attempt
                log.warning(
                    "checkpoint.retry",
                    step=step,
                    attempt=attempt + 1,
                    delay_s=delay,
                    error=_reason(exc),
                )
                time.sleep(delay)

    def _no_space_error(self, step: int, full: OSError) -> CheckpointError:
        """A save that ran out of space: its unfinished step is removed at once (nothing can
        load it), so the space it took is free again for the run's summary."""
        try:
            if self.fs.exists(self._path(step)):
                self.fs.rm(self._path(step), recursive=True)
        except OSError:
            pass  # another rank removed it first; the next save removes what is left
        return CheckpointError(
            f"saving {self.step_url(step)} failed: {no_space_message(full)}; the unfinished "
            "step was removed, earlier committed checkpoints are untouched and the run resumes "
            "from the newest"
        )

    def _finish(
        self,
        step: int,
        upload: Future[None] | None,
        info: dict[str, object],
        started: float,
        writer: StreamWriter,
        rng_files: dict[str, FileEntry],
    ) -> None:
        if upload is not None:
            try:
                upload.result()
            except (Exception, CheckpointException) as exc:
                if (full := no_space(exc)) is not None:
                    raise self._no_space_error(step, full) from exc
                raise CheckpointError(
                    f"the background save of {self.step_url(step)} failed: {_reason(exc)}; "
                    "it is not committed and earlier checkpoints are intact"
                ) from exc
        if self.rank == 0:
            record = {
                "step": step,
                "world_size": self.world_size,
                "time": time.time(),
                "format": FORMAT,
            }
            described = json.dumps({**record, "info": info}).encode()
            self._with_retries(step, lambda: self._write(self._path(step, INFO_FILE), described))
            written = writer.written or self._written_from_storage(step)
            files = {**written, **rng_files, INFO_FILE: file_entry(described)}
            self._with_retries(
                step, lambda: self._write(self._path(step, COMMIT_FILE), seal(record, files))
            )
            log.info(
                "checkpoint.committed",
                step=step,
                url=self.step_url(step),
                seconds=round(time.perf_counter() - started, 3),
            )
            self.prune()

    def _write(self, path: str, data: bytes) -> None:
        """The file appears whole or not at all. An object store puts whole objects; a local
        disk gets it under a temporary name, renamed into place, since a SIGKILL between
        creating and writing it would leave it empty (an empty COMMITTED is a damaged commit
        the next resume stops at)."""
        self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)  # a no-op on object storage
        local = isinstance(self.fs, LocalFileSystem)
        written = f"{path}.partial" if local else path
        with naming_file(path), self.fs.open(written, "wb") as f:
            f.write(data)
        if local:
            os.replace(written, path)

    def _written_from_storage(self, step: int) -> dict[str, FileEntry]:
        """The manifest entries of the metadata and data files as stored, for a save whose
        writer did not report them (DCP ran the coordinator's `finish` on another copy)."""
        files = {METADATA_FILE: file_entry(self._read(step, METADATA_FILE))}
        for name, size in self._listing(step).items():
            if "/" not in name and name.startswith("__"):
                files[name] = {"size": size}
        return files

    @_on_storage("write")
    def wait(self) -> None:
        """Block until the save in flight (if any) is committed; raise its error if it failed."""
        inflight, self._inflight = self._inflight, None
        if inflight is not None:
            inflight.result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)
            if self._stager is not None:
                self._stager.close()

    def prune(self) -> list[int]:
        """Apply the keep policy and remove unfinished leftovers older than the newest commit."""
        dirs = self._step_dirs()
        committed = [s for s, done in dirs.items() if done]
        if not committed:
            return []
        newest = committed[-1]
        doomed = set(self.keep.deletable(committed))
        doomed |= {s for s, done in dirs.items() if not done and s < newest}
        doomed.discard(newest)
        for step in sorted(doomed):
            # the marker goes first, so a half-deleted step is never taken for a checkpoint
            if dirs[step]:
                self.fs.rm(self._path(step, COMMIT_FILE))
            self.fs.rm(self._path(step), recursive=True)
        if doomed:
            log.info("checkpoint.pruned", steps=sorted(doomed))
        return sorted(doomed)

    # -- loading -------------------------------------------------------------------------------

    def resolve_step(self, step: int | None) -> int | None:
        dirs = self._step_dirs()
        committed = [s for s, done in dirs.items() if done]
        if step is None:
            return committed[-1] if committed else None
        if not dirs.get(step):
            state = "is not committed (an unfinished save)" if step in dirs else "does not exist"
            raise CheckpointError(
                f"{self.step_url(step)} {state}; committed steps in {self.url}: "
                f"{', '.join(map(str, committed)) or 'none'}"
            )
        return step

    @overload
    def load(self, /, state: Mapping[str, Any], *, step: int, restore_rng: bool = True) -> int: ...

    @overload
    def load(
        self, /, state: Mapping[str, Any], *, step: None = None, restore_rng: bool = True
    ) -> int | None: ...

    @_on_storage("read")
    def load(
        self,
        state: Mapping[str, Any],
        *,
        step: int | None = None,
        restore_rng: bool = True,
    ) -> int | None:
        """Load the newest committed step (or `step`) into `state`, in place; None if none.

        Works at another world size or parallel layout: DCP reshards. `restore_rng=False` keeps
        this process's random states (loading weights into another run, not resuming one).

        Every file the load reads is checked before the first tensor moves (`open_step`), and by
        every rank alike: when one rank finds damage (its own random states), all raise it."""
        step = self.resolve_step(step)
        if step is None:
            return None
        reader, metadata, rng = self._agreed(lambda: self._prepare_load(step, restore_rng))
        plain = {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state.items()}
        try:
            check_compatible(plain, metadata, self.step_url(step))
        except CheckpointError as exc:
            raise self._weights_only(step) or exc from None
        try:
            dcp_load(plain, storage_reader=reader, planner=SafeLoadPlanner())
        except CheckpointException as exc:
            raise load_failure(
                exc,
                self.step_url(step),
                " (values are loaded with weights_only: tensors, numbers, strings and plain "
                "containers only)",
            ) from exc
        for key, value in state.items():
            if isinstance(value, Stateful):
                value.load_state_dict(plain[key])
        if restore_rng:
            self._restore_rng(step, rng)
        log.info("checkpoint.loaded", step=step, url=self.step_url(step))
        return step

    def _weights_only(self, step: int) -> CheckpointError | None:
        """For a load asking for more than the model of a step `llmtrain average` wrote (a
        resume: optimizer state, counters), what it is and what to do instead."""
        averaged = self.info(step).get("info", {}).get("averaged")
        if not isinstance(averaged, dict):
            return None
        steps = ", ".join(map(str, averaged.get("steps") or []))
        source = averaged.get("source")
        return CheckpointError(
            f"{self.step_url(step)} is the mean of steps {steps} of {source} (`llmtrain "
            "average`): it holds model weights only, no optimizer state or counters, so a run "
            f"cannot resume from it; resume from {source}, or start a new run from these "
            f"weights with init: {{from: {self.url}}}"
        )

    def _prepare_load(
        self, step: int, restore_rng: bool
    ) -> tuple[StreamReader, Metadata, JSONObject | None]:
        reader, metadata = self.open_step(step, rng=restore_rng)
        rng = self._read_rng(step) if restore_rng else None
        return reader, metadata, rng

    def _agreed(self, check: Callable[[], R]) -> R:
        """`check()` on every rank; a failure on any rank is raised on all of them (a rank that
        went on alone would wait in DCP's collectives for the one that stopped)."""
        try:
            result = check()
        except Exception as exc:
            self._share_failure(exc)
            raise
        self._share_failure(None)
        return result

    def _share_failure(self, error: Exception | None) -> None:
        """Tell the other ranks whether `check()` failed here (`error`); raise when it did not
        but failed on another rank."""
        if self.distributed:
            verdict: _Verdict | None = None
            if error is not None:
                verdict = (
                    self.rank,
                    str(error) if isinstance(error, UserError) else _reason(error),
                    isinstance(error, UserError),
                    getattr(error, "file", None),
                    getattr(error, "problem", ""),
                )
            verdicts: list[_Verdict | None] = [None] * self.world_size
            dist.all_gather_object(verdicts, verdict)
            first = next((v for v in verdicts if v is not None), None)
            if error is None and first is not None:
                rank, message, by_user, file, problem = first
                if not by_user:  # a bug or a storage failure there, not a damaged file
                    raise RuntimeError(f"rank {rank} failed to open the checkpoint: {message}")
                if file is None:
                    raise CheckpointError(message)
                raise CorruptCheckpointError(message, file=file, problem=problem)

    def _read_rng(self, step: int) -> JSONObject | None:
        """This rank's saved random states, checked; None when the saving run had no such rank
        (it had fewer ranks than this one). A rank it had whose file is gone is damage."""
        commit = self._commit(step)
        saved = commit.world_size
        if saved is not None and self.rank >= saved:
            return None
        name = f"{RNG_DIR}/rank{self.rank}.json"
        with reading(self.step_url(step), name):
            try:
                data = self._read(step, name)
            except FileNotFoundError:
                if saved is None:  # a commit of an early version, which did not say
                    return None
                plural = "s" if saved != 1 else ""
                raise Damage(
                    f"is missing (the step was saved by {saved} rank{plural}, each with its file)"
                ) from None
            check_bytes(data, (commit.files or {}).get(name))
            return check_rng_state(parse_json(data, "a random state"))

    def _restore_rng(self, step: int, state: JSONObject | None) -> None:
        if state is None:
            log.warning(
                "checkpoint.no_rng_state",
                rank=self.rank,
                step=step,
                hint="the step was saved by fewer ranks; this rank keeps its own seeding",
            )
            return
        set_rng_state(state, self.python_rng)

    def damage(self, step: int, *, full: bool = False) -> CorruptCheckpointError | None:
        """What is damaged in committed step `step`, or None. Quick: the commit, every listed
        file's size, llmtrain.json. `full`: also the metadata, every rank's random states and
        every data item's bytes against its hash (reads the whole step)."""
        try:
            commit = self._commit(step)
            listing = self._listing(step)
            self._check_files(step, commit, listing, rng=True)
            info = self._info(step, commit)
            if full:
                reader = self._reader(step, commit, info)
                try:
                    metadata = reader.read_metadata()
                except UnsafeCheckpointError as exc:
                    where = f"{self.step_url(step)}/{METADATA_FILE}"
                    raise damaged(self.step_url(step), where, str(exc)) from None
                reader.check_sizes(metadata, listing)
                for name in sorted(n for n in listing if n.startswith(f"{RNG_DIR}/")):
                    with reading(self.step_url(step), name):
                        data = self._read(step, name)
                        check_bytes(data, (commit.files or {}).get(name))
                        check_rng_state(parse_json(data, "a random state"))
                reader.verify_items(metadata)
        except CorruptCheckpointError as exc:
            return exc
        return None


def check_compatible(state: Mapping[str, object], metadata: Metadata, where: str) -> None:
    """Every tensor of `state` exists in the checkpoint with the same global shape."""
    flat, _ = flatten_state_dict(dict(state))
    stored = metadata.state_dict_metadata
    missing = [k for k in flat if k not in stored]
    if missing:
        raise CheckpointError(
            f"{where} has no {missing[0]!r}"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
            + f"; it holds e.g. {', '.join(list(stored)[:5])}. Is it from another model or a run "
            "without this state?"
        )
    for key, value in flat.items():
        meta = stored[key]
        if isinstance(value, torch.Tensor):
            if not isinstance(meta, TensorStorageMetadata):
                raise CheckpointError(f"{where}: {key!r} is stored as a value, not a tensor")
            if tuple(value.shape) != tuple(meta.size):
                raise CheckpointError(
                    f"{where}: tensor {key!r} has shape {tuple(meta.size)} in the checkpoint but "
                    f"{tuple(value.shape)} in this model; the checkpoint is from a different model "
                    "shape"
                )


def load_failure(exc: BaseException, step_url: str, note: str = "") -> CheckpointError:
    """The error to raise for a failed DCP load of `step_url`: the damaged file's own line when
    a rank found one, else what went wrong (and `note`)."""
    corrupt = corruption(exc)
    if corrupt is not None:
        return CorruptCheckpointError(str(corrupt), file=corrupt.file, problem=corrupt.problem)
    return CheckpointError(f"cannot load {step_url}: {_reason(exc)}{note}")


def corruption(exc: BaseException) -> CorruptCheckpointError | None:
    """The damaged-file error inside DCP's wrapper of every rank's failure, if there is one."""
    for failure in (getattr(exc, "failures", None) or {}).values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, CorruptCheckpointError):
            return inner
    return exc if isinstance(exc, CorruptCheckpointError) else None


def _reason(exc: BaseException) -> str:
    """One line on what went wrong; for DCP's wrapper, the first rank's own error."""
    failures = getattr(exc, "failures", None)
    if isinstance(exc, CheckpointException) and failures:
        rank, inner = next(iter(failures.items()))
        inner = inner[0] if isinstance(inner, tuple) else inner
        return f"rank {rank}: {_reason(inner)}"
    text = str(exc).strip()
    unsafe = re.search(r"(?:global: GLOBAL|unsupported GLOBAL) ([\w.]+)", text)
    if "Weights only load failed" in text and unsafe:
        return f"refusing to unpickle {unsafe.group(1)} (not plain data)"
    lines = text.splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:500]
