"""The `hf` weight format (plugin kind `weights`): a transformers model directory (config.json +
safetensors, an architecture of `llmtrain_hf.architectures`) as the starting weights of a run,
`init: {from: DIR}`, and as the shape of its model, `model: {from: DIR}`.

Read through fsspec (a local path or any URL), safetensors only (no pickle). Imported when the
plugin registers, so torch, transformers and safetensors are imported inside `load` only.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
# the model kind of the options derived from an HF config: every option explicit
KIND = "transformer"


class HFWeights:
    """`WeightFormat` of transformers model directories."""

    def describe(self) -> str:
        return f"{CONFIG} and *.safetensors (a transformers model directory)"

    def recognizes(self, path: str, storage_options: Mapping[str, Any]) -> bool:
        try:
            names = _names(path, storage_options)
        except (OSError, ValueError):
            return False
        return CONFIG in names and any(name.endswith(".safetensors") for name in names)

    def load(
        self, path: str, storage_options: Mapping[str, Any]
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """(llmtrain weights on CPU, `{"kind": "transformer", **options}`) of the directory."""
        from fsspec.core import url_to_fs

        from llmtrain.core_mesh.config import unstructure
        from llmtrain_hf.convert import from_hf_state_dict

        fs, root = url_to_fs(path, **storage_options)
        options = _options(fs, root, path)
        state = {}
        for name in _weight_files(fs, root):
            state.update(_read_safetensors(fs, f"{root}/{name}"))
        weights = from_hf_state_dict(state, options)
        return weights, {"kind": KIND, **unstructure(options)}

    def model(self, path: str, storage_options: Mapping[str, Any]) -> dict[str, Any]:
        """`{"kind": "transformer", **options}` of the directory, from its config.json alone."""
        from fsspec.core import url_to_fs

        from llmtrain.core_mesh.config import unstructure

        fs, root = url_to_fs(path, **storage_options)
        return {"kind": KIND, **unstructure(_options(fs, root, path))}


def _options(fs: Any, root: str, path: str) -> Any:
    """The llmtrain model options of the directory's config.json (refused by name when they
    have no llmtrain equivalent)."""
    from transformers import AutoConfig

    from llmtrain.core_mesh.errors import UserError
    from llmtrain_hf.convert import options_from_hf

    where = f"{path.rstrip('/')}/{CONFIG}"
    raw = json.loads(fs.cat_file(f"{root}/{CONFIG}"))
    if "model_type" not in raw:
        raise UserError(f"{where}: no model_type; is this a transformers model directory?")
    return options_from_hf(AutoConfig.for_model(**raw), where=where)


def _names(path: str, storage_options: Mapping[str, Any]) -> set[str]:
    from fsspec.core import url_to_fs

    fs, root = url_to_fs(path, **storage_options)
    return {name.rstrip("/").rsplit("/", 1)[-1] for name in fs.ls(root, detail=False)}


def _weight_files(fs: Any, root: str) -> list[str]:
    """The safetensors files of the model: those the shard index lists, else every one."""
    if fs.exists(f"{root}/{INDEX}"):
        return sorted(set(json.loads(fs.cat_file(f"{root}/{INDEX}"))["weight_map"].values()))
    names = [name.rstrip("/").rsplit("/", 1)[-1] for name in fs.ls(root, detail=False)]
    return sorted(name for name in names if name.endswith(".safetensors"))


def _read_safetensors(fs: Any, path: str) -> dict[str, Any]:
    from fsspec.implementations.local import LocalFileSystem
    from safetensors.torch import load, load_file

    if isinstance(fs, LocalFileSystem):
        return load_file(path)  # memory-mapped
    return load(fs.cat_file(path))
