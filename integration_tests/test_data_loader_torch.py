"""data-pack's windows under torch's DataLoader (spawned workers), without data-pack importing torch."""

from __future__ import annotations

import itertools
import json
import sys

import numpy as np
import pytest
import torch
from support import run
from torch.utils.data import DataLoader

from llmtrain.data_pack.loader import StepBatches, WindowLoader, open_windows
from llmtrain.data_pack.pack import pack
from llmtrain.data_pack.sampling import BatchPlan


@pytest.fixture(scope="module")
def rd_mixture(tmp_path_factory):
    directory = tmp_path_factory.mktemp("torch_loader")
    rng = np.random.default_rng(7)
    urls = []
    for name, alphabet in (("lower", "abcdefgh \n"), ("upper", "PQRSTUVW.")):
        jsonl = directory / f"{name}.jsonl"
        texts = [
            "".join(rng.choice(list(alphabet), size=int(rng.integers(1, 150)))) for _ in range(80)
        ]
        jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
        out = str(directory / name)
        pack([str(jsonl)], out, {"kind": "bytes"}, workers=1, chunk_tokens=96, compression="zstd:1")
        urls.append(out)
    return urls


def rd_open(urls):
    return open_windows(urls, 20, weights=[0.6, 0.4], seed=2, doc_starts=True)


@pytest.mark.parametrize("workers", [0, 2])
def test_torch_data_loader_yields_the_window_loaders_batches(rd_mixture, workers):
    plan = BatchPlan(16, world_size=2, rank=1, micro_batch=4)
    start, steps = 3, 5
    expected = list(
        itertools.islice(
            WindowLoader(rd_open(rd_mixture), plan, consumed=start * 16), steps * plan.accumulation
        )
    )
    options = {"num_workers": workers}
    if workers:
        options |= {"multiprocessing_context": "spawn", "persistent_workers": False}
    loader = DataLoader(
        dataset=rd_open(rd_mixture), batch_sampler=StepBatches(plan, start, steps), **options
    )
    got = list(loader)
    assert len(got) == len(expected) == len(loader) == steps * plan.accumulation
    sources_seen = set()
    for batch, (step, micro, numpy_batch) in zip(got, expected, strict=True):
        assert batch.keys() == numpy_batch.keys() == {"tokens", "doc_starts", "samples", "sources"}
        assert batch["tokens"].dtype == torch.int64 and batch["tokens"].shape == (4, 21)
        assert batch["doc_starts"].dtype == torch.bool and batch["doc_starts"].shape == (4, 20)
        for key, value in numpy_batch.items():
            assert torch.equal(batch[key], torch.from_numpy(value)), (step, micro, key)
        np.testing.assert_array_equal(batch["samples"].numpy(), plan.step(step)[micro])
        sources_seen |= set(batch["sources"].tolist())
    assert sources_seen == {0, 1}


def test_data_pack_does_not_import_torch():
    code = (
        "import sys, llmtrain.data_pack.loader, llmtrain.data_pack.pack; "
        "assert 'torch' not in sys.modules, 'data-pack imported torch'"
    )
    run([sys.executable, "-c", code], timeout=600)
