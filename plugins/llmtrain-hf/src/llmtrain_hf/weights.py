"""The `hf` weight format (plugin kind `weights`): a transformers model directory (config.json +
safetensors, an architecture of `llmtrain_hf.architectures`) as the starting weights of a run,
`init: {from: DIR}`, and as the shape of its model, `model: {from: DIR}`.

Read through fsspec (a local path or any URL), safetensors only (no pickle), every file checked
(`llmtrain_hf.hf_dir`). Imported when the plugin registers, so torch, transformers and
safetensors are imported inside `load` and `model` only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

CONFIG = "config.json"


class HFWeights:
    """`WeightFormat` of transformers model directories."""

    def describe(self) -> str:
        return f"{CONFIG} and *.safetensors (a transformers model directory)"

    def recognizes(self, path: str, storage_options: Mapping[str, object]) -> bool:
        try:
            names = _names(path, storage_options)
        except (OSError, ValueError):
            return False
        return CONFIG in names and any(name.endswith(".safetensors") for name in names)

    def load(
        self, path: str, storage_options: Mapping[str, object]
    ) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
        """(llmtrain weights on CPU, `{"kind": "transformer", **options}`) of the directory
        (kind `moe`, llmtrain-moe's, for a Mixture-of-Experts architecture), every file checked
        (`hf_dir`): a damaged one is a UserError naming it."""
        from llmtrain.core_mesh.config import unstructure
        from llmtrain_hf.convert import model_kind
        from llmtrain_hf.hf_dir import read_model

        cfg, weights, _ = read_model(path, storage_options)
        return weights, {"kind": model_kind(cfg.options), **unstructure(cfg.options)}

    def model(self, path: str, storage_options: Mapping[str, object]) -> dict[str, object]:
        """`{"kind": "transformer", **options}` of the directory, from its config.json; the
        weight files' headers are checked against it too (`hf_dir.layout`), so that a damaged
        directory is refused when the run's config loads, before the run starts."""
        from llmtrain.core_mesh.config import unstructure
        from llmtrain_hf.convert import model_kind
        from llmtrain_hf.hf_dir import HFDir, layout, read_config

        hf = HFDir.open(path, storage_options)
        cfg = read_config(hf)
        layout(hf, cfg)
        return {"kind": model_kind(cfg.options), **unstructure(cfg.options)}


def _names(path: str, storage_options: Mapping[str, object]) -> set[str]:
    from fsspec.core import url_to_fs

    fs, root = url_to_fs(path, **storage_options)
    return {name.rstrip("/").rsplit("/", 1)[-1] for name in fs.ls(root, detail=False)}
