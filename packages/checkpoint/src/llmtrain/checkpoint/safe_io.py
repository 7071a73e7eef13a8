"""DCP reading without unpickling arbitrary objects.

torch.distributed.checkpoint pickles its `.metadata` file and loads non-tensor values with
`torch.load(weights_only=False)`. A checkpoint from someone else could run code when loaded. The
reader here unpickles the metadata through an allow-list: the checkpoint metadata classes, torch
sizes, dtypes and layouts, and paths. The planner loads values with `weights_only=True`, which
allows tensors, numbers, strings and plain containers only.
"""

from __future__ import annotations

import inspect
import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from llmtrain.checkpoint.integrity import METADATA_FILE  # noqa: F401 - also importable here
from llmtrain.core_mesh.errors import UserError

_ALLOWED_ELSEWHERE = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("llmtrain.checkpoint.stream_storage", "StoredItem"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class UnsafeCheckpointError(UserError, pickle.UnpicklingError):
    """Checkpoint metadata that names something other than checkpoint metadata."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == dcp_metadata.__name__:
            found = getattr(dcp_metadata, name, None)
            if found is not None and (
                (inspect.isclass(found) and found.__module__ == module)
                or name == "_MEM_FORMAT_ENCODING"
            ):
                return found
        elif (module, name) in _ALLOWED_ELSEWHERE:
            return super().find_class(module, name)
        elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"checkpoint metadata refers to {module}.{name}, which a checkpoint never needs; "
            "refusing to load it"
        )


def load_metadata(stream: Any) -> object:
    """The unpickled `.metadata` (only allow-listed classes; whether it is `Metadata` is the
    caller's check: see `stream_storage.metadata_problem`)."""
    loaded: object = _MetadataUnpickler(stream).load()
    return loaded


def _finish_metadata(metadata: object, load_id: str | None) -> Metadata:
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(
            f"checkpoint metadata is a {type(metadata).__name__}, not Metadata; refusing to load it"
        )
    storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
    storage_meta.load_id = load_id
    metadata.storage_meta = storage_meta
    return metadata


class SafeFsspecReader(FsspecReader):
    """An fsspec DCP reader whose metadata goes through the allow-list."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            return _finish_metadata(load_metadata(f), self.load_id)


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner, with non-tensor values loaded under `weights_only=True`."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded
