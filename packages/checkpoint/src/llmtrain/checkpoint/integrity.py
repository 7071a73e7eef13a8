"""What a committed step is made of, and the checks every file passes before it is used.

`COMMITTED`, written last by rank 0, is the step's manifest: the save's record (step, world size,
time, format) and every file the step holds with its size, and for the files read whole (the DCP
`.metadata`, `llmtrain.json`, each `rng/rank<k>.json`) the XXH3 hash of their bytes. The data
files need no hash of their own: `.metadata` holds one per item, checked on every load. The
manifest carries the hash of its own canonical JSON, so a changed byte in it is found too.

A file that is missing, cut short, longer, empty, not what its kind must be (JSON of another
shape, bytes that do not unpickle as metadata) or whose bytes do not match what the commit
recorded is a `CorruptCheckpointError`: one line naming the file and what to do. Nothing is
deleted or rewritten on the way: a damaged step stays as it is for its owner to inspect.

Commits written before the manifest (and format-1 checkpoints) have none: their files get the
same checks of shape (and the data items their hashes), without the file hashes.
"""

from __future__ import annotations

import contextlib
import errno
import json
import re
from collections.abc import Iterator, Mapping
from typing import NotRequired, TypedDict, cast

import attrs
import xxhash

from llmtrain.core_mesh.errors import UserError
from llmtrain.core_mesh.json_types import JSON, JSONObject

COMMIT_FILE = "COMMITTED"
INFO_FILE = "llmtrain.json"
METADATA_FILE = ".metadata"
RNG_DIR = "rng"
# the longest reason quoted from a parser's message
_REASON = 160
_HEX16 = re.compile(r"^[0-9a-f]{16}$")


class CheckpointError(UserError):
    """A checkpoint that cannot be saved or loaded, with what exists and what to do."""


class CorruptCheckpointError(CheckpointError):
    """A file of a committed step that is missing, cut short, or holds other bytes than were
    written. `file` is its path or URL, `problem` what is wrong with it."""

    def __init__(self, message: str, *, file: str = "", problem: str = ""):
        super().__init__(message)
        self.file, self.problem = file, problem


class Damage(ValueError):
    """What is wrong with a file's bytes (the reader adds which file and what to do)."""


class NewerFormat(Exception):
    """A commit of a checkpoint format newer than this code reads (its manifest may differ)."""

    def __init__(self, written: int):
        super().__init__(written)
        self.written = written


def damaged(step_url: str, file: str, problem: str) -> CorruptCheckpointError:
    """The one line a damaged file of step `step_url` gets."""
    problem = " ".join(problem.split())
    root, _, name = step_url.rstrip("/").rpartition("/")
    return CorruptCheckpointError(
        f"{file} {problem}: checkpoint {name} is damaged (it was left as it is); use an earlier "
        f"step (`llmtrain checkpoints {root}` lists them; a resume takes the newest, so rename "
        f"{name}, e.g. to {name}.damaged) or restore the file from a copy",
        file=file,
        problem=problem,
    )


def reason(exc: BaseException) -> str:
    """A parser's complaint on one short line."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}"[:_REASON]


@contextlib.contextmanager
def reading(step_url: str, name: str) -> Iterator[str]:
    """Reading file `name` of step `step_url` (yields its URL): a `Damage` or a file that is
    not there (or not a file) becomes the damaged-file line."""
    file = f"{step_url.rstrip('/')}/{name}"
    try:
        yield file
    except Damage as exc:
        raise damaged(step_url, file, str(exc)) from None
    except FileNotFoundError:
        raise damaged(step_url, file, "is missing") from None
    except (IsADirectoryError, NotADirectoryError):
        raise damaged(step_url, file, "is not a file") from None
    except PermissionError as exc:
        raise CheckpointError(
            f"{file} cannot be read ({reason(exc)}): give this user read access to it"
        ) from None
    except OSError as exc:
        if exc.errno != errno.EIO:  # a storage failure, not this file
            raise
        raise damaged(step_url, file, f"cannot be read ({reason(exc)})") from None


def xxh3(data: bytes) -> str:
    return xxhash.xxh3_64_hexdigest(data)


class FileEntry(TypedDict):
    """A manifest entry: the file's size, and the hash of a file read whole."""

    size: int
    xxh3: NotRequired[str]


def file_entry(data: bytes) -> FileEntry:
    """A manifest entry of a file read whole: its size and hash."""
    return {"size": len(data), "xxh3": xxh3(data)}


def size_problem(got: int, recorded: int) -> str:
    if got == 0:
        return f"is empty (its commit recorded {recorded} bytes)"
    if got < recorded:
        return f"is truncated: {got} bytes, its commit recorded {recorded}"
    return f"has {got} bytes, its commit recorded {recorded}"


def check_bytes(data: bytes, entry: FileEntry | None) -> None:
    """`data` has the size and hash the manifest recorded (nothing to check without one)."""
    if entry is None:
        return
    if len(data) != entry["size"]:
        raise Damage(size_problem(len(data), entry["size"]))
    recorded = entry.get("xxh3")
    if recorded is not None and xxh3(data) != recorded:
        raise Damage(
            f"does not match the checksum its commit recorded (XXH3 {xxh3(data)}, recorded "
            f"{recorded})"
        )


def parse_json(data: bytes, what: str) -> JSON:
    if not data:
        raise Damage("is empty")
    try:
        parsed: JSON = json.loads(data)
        return parsed
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise Damage(f"is not {what} (not JSON: {reason(exc)})") from None


def _kind(value: object) -> str:
    names = {dict: "object", list: "list", str: "string", bool: "boolean", type(None): "null"}
    return names.get(type(value), "number")


# --- the commit record ----------------------------------------------------------------------------


def _canonical(value: object) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def seal(record: Mapping[str, object], files: Mapping[str, FileEntry]) -> bytes:
    """The bytes of COMMITTED: the record, the manifest and the hash of both."""
    body = {**record, "files": dict(files)}
    return _canonical({**body, "xxh3": xxh3(_canonical(body))})


@attrs.frozen
class Commit:
    """A step's COMMITTED as read: the save's record, and its manifest (file name -> size and
    hash; None for a commit written before manifests)."""

    step: int
    record: JSONObject
    files: dict[str, FileEntry] | None

    @property
    def world_size(self) -> int | None:
        size = self.record.get("world_size")  # a count when there (`check_record`)
        return size if isinstance(size, int) else None


def read_commit(data: bytes, step: int, newest: int) -> Commit:
    """COMMITTED of step `step`, checked; `NewerFormat` for a format above `newest`."""
    value = parse_json(data, "a commit record")
    if not isinstance(value, dict):
        raise Damage(f"is not a commit record (a JSON {_kind(value)}, not an object)")
    written = value.get("format")
    if type(written) is int and written > newest:
        raise NewerFormat(written)
    sealed = "xxh3" in value or "files" in value
    if sealed:
        claimed = value.pop("xxh3", None)
        if claimed != xxh3(_canonical(value)):
            raise Damage("does not match its own checksum")
    files = value.pop("files", None)  # there only when sealed
    check_record(value, step, required=("step", "world_size") if sealed else ("step",))
    return Commit(step, value, _manifest(files) if sealed else None)


def check_record(value: JSONObject, step: int, *, required: tuple[str, ...]) -> None:
    """The save's record in COMMITTED or llmtrain.json: the right step, counts that are counts."""
    for key, least in (("step", 0), ("world_size", 1), ("format", 1)):
        if key not in value:
            if key in required:
                raise Damage(f"records no {key}")
            continue
        got = value[key]
        if type(got) is not int or got < least:
            raise Damage(f"records {key} {got!r}, which is no count")
    if value["step"] != step:
        raise Damage(f"records step {value['step']}, not {step}: it belongs to another step")
    if "time" in value and type(value["time"]) not in (int, float):
        raise Damage(f"records time {value['time']!r}, which is no time")


def plain_path(name: object) -> bool:
    """A path inside the step directory: relative, no `..`, no empty parts."""
    if not isinstance(name, str) or not name or name.startswith("/") or "\\" in name:
        return False
    return all(part not in ("", ".", "..") for part in name.split("/"))


def _manifest(files: JSON) -> dict[str, FileEntry]:
    """The manifest of a sealed commit, checked entry by entry."""
    if not isinstance(files, dict):
        raise Damage("holds no list of the step's files")
    for name in (METADATA_FILE, INFO_FILE):
        if name not in files:
            raise Damage(f"does not list {name}")
    for name, entry in files.items():
        if not plain_path(name):
            raise Damage(f"lists {name!r}, which is not a file of the step")
        size = entry.get("size") if isinstance(entry, dict) else None
        if not isinstance(entry, dict) or type(size) is not int or size < 0:
            raise Damage(f"records no size for {name}")
        digest = entry.get("xxh3")
        if digest is not None and not (isinstance(digest, str) and _HEX16.match(digest)):
            raise Damage(f"records no valid checksum for {name}")
    return cast(dict[str, FileEntry], files)  # each entry checked above


def read_info(data: bytes, commit: Commit) -> JSONObject:
    """llmtrain.json: the save's record (the same as COMMITTED's) and the caller's `info`."""
    value = parse_json(data, "a step record")
    if not isinstance(value, dict):
        raise Damage(f"is not a step record (a JSON {_kind(value)}, not an object)")
    check_record(value, commit.step, required=("step",))
    for key, theirs in commit.record.items():
        if key in value and value[key] != theirs:
            raise Damage(f"records {key} {value[key]!r}, its COMMITTED {theirs!r}")
    if not isinstance(value.get("info", {}), dict):
        raise Damage("holds an `info` that is not a JSON object")
    return value


def ordered(files: Mapping[str, object]) -> list[str]:
    """The manifest's names in the order a load reads them (the first damaged one is named)."""
    first = {INFO_FILE: 0, METADATA_FILE: 1}
    return sorted(files, key=lambda n: (first.get(n, 3 if n.startswith(f"{RNG_DIR}/") else 2), n))
