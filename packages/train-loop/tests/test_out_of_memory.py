"""The message a rank gives when it runs out of memory (the CUDA snapshot is in the gpu tests)."""

from __future__ import annotations

import torch

from llmtrain.core_mesh.errors import UserError
from llmtrain.train_loop.observe import out_of_memory_error
from llmtrain.train_loop.run_config import DebugConfig


def test_the_message_names_the_rank_the_step_and_what_to_change(tmp_path):
    exc = torch.OutOfMemoryError("tried to allocate 2.00 GiB")
    error = out_of_memory_error(exc, torch.device("cpu"), tmp_path, 7, 3, DebugConfig())
    assert isinstance(error, UserError)
    assert str(error) == (
        "rank 3: out of memory in step 7 (tried to allocate 2.00 GiB). Lower data.micro_batch, "
        "turn on parallel.activation_checkpointing, shard more (mesh.dp_shard, tp), and compare "
        "with `llmtrain estimate`"
    )
    assert not (tmp_path / "memory").exists()  # no snapshot off CUDA
