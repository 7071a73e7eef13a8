"""The peak FLOP/s MFU divides by: the config's, else known from the GPU's name."""

from __future__ import annotations

import pytest
import torch

from llmtrain.train_loop import builtin_callbacks
from llmtrain.train_loop.builtin_callbacks import peak_flops


@pytest.mark.parametrize(
    ("name", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H100 NVL", 835.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_known_gpus_by_name(monkeypatch, name, tflops):
    monkeypatch.setattr(builtin_callbacks.torch.cuda, "get_device_name", lambda device=None: name)
    got = peak_flops(None, torch.device("cuda"))
    assert got == (None if tflops is None else tflops * 1e12)
    assert peak_flops(500.0, torch.device("cuda")) == 500e12  # training.peak_tflops wins


def test_no_peak_on_cpu():
    assert peak_flops(None, torch.device("cpu")) is None
