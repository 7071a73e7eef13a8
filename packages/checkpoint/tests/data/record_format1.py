"""Write `format1.expected.json`: what `format1/step-2` holds, read by torch's own DCP reader
(`dcp_to_torch_save`), independent of llmtrain's loader: each tensor's dtype, shape and the
SHA-256 of its bytes, and the non-tensor values.

The test compares what llmtrain loads with this record, never with a fresh training: training is
bitwise reproducible on one machine, not across CPUs, so a fresh run only matches the stored
tensors where they were made. Run from this folder: `python record_format1.py`.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

HERE = Path(__file__).parent


def tensor_digest(tensor: torch.Tensor) -> dict:
    data = tensor.detach().contiguous().cpu()
    return {
        "dtype": str(data.dtype),
        "shape": list(data.shape),
        "sha256": hashlib.sha256(data.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest(),
    }


def flatten(prefix: str, value, out: dict) -> dict:
    if isinstance(value, dict):
        for key, item in value.items():
            flatten(f"{prefix}.{key}" if prefix else str(key), item, out)
    else:
        out[prefix] = value
    return out


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(HERE / "format1" / "step-2", Path(tmp) / "state.pt")
        state = torch.load(Path(tmp) / "state.pt", weights_only=False)
    record = {
        key: tensor_digest(value) if isinstance(value, torch.Tensor) else value
        for key, value in flatten("", state, {}).items()
    }
    (HERE / "format1.expected.json").write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
