"""llmtrain-hf: Hugging Face interop for llmtrain.

`llmtrain hf export` writes a checkpoint as a transformers model directory (Llama, Mistral,
Qwen2, Qwen3, OLMo-2, Gemma 2, Gemma 3 or GPT-2; OLMoE, Qwen3-MoE or Mixtral for llmtrain-moe's models:
`llmtrain_hf.architectures`), `llmtrain hf import` reads one back as a checkpoint. The Python API lives in
`llmtrain_hf.convert` (configs, weights, `to_hf_model`, `from_hf_model`) and
`llmtrain_hf.transfer` (`export_checkpoint`, `import_hf`); the names below load them on first
use, so importing this package (as the CLI does on every start) imports neither torch nor
transformers.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "to_hf_model": "llmtrain_hf.convert",
    "from_hf_model": "llmtrain_hf.convert",
    "hf_config": "llmtrain_hf.convert",
    "options_from_hf": "llmtrain_hf.convert",
    "export_checkpoint": "llmtrain_hf.transfer",
    "import_hf": "llmtrain_hf.transfer",
}
__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'llmtrain_hf' has no attribute {name!r}")
