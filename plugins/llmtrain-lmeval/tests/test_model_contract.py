"""lm-eval on a model plugin that is not a Transformer: integration_tests/plugins/llmtrain-toy-lm
(causal convolutions, no KV cache, no packed rows), trained a few steps with `llmtrain run`.
The harness scores it through this plugin item for item as llmtrain's own `evaluate_task`
does, and `generate_until` decodes greedily by rerunning the prefix."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml
from support import run

MAX_LEN = 64


@pytest.fixture(scope="module")
def toy(tmp_path_factory, packed) -> str:
    """The committed checkpoints of a 4-step `toy-lm` run on the shared packed corpus."""
    root = tmp_path_factory.mktemp("toy")
    config = {
        "data": {"train": [{"path": str(packed)}], "seq_len": 32, "micro_batch": 4},
        "name": "toy",
        "seed": 0,
        "run_dir": str(root / "runs"),
        "device": "cpu",
        "model": {"kind": "toy-lm", "max_seq_len": MAX_LEN, "d_model": 32},
        "optimizer": {"kind": "adamw", "lr": 3e-3},
        "training": {"steps": 4, "log_every": 2},
        "loggers": [{"kind": "jsonl"}],
    }
    (root / "run.yaml").write_text(yaml.safe_dump(config))
    run([str(Path(sys.executable).parent / "llmtrain"), "run", str(root / "run.yaml")])
    return str(root / "runs" / "toy" / "checkpoints")


def test_the_harness_scores_the_toy_model_as_llmtrain(toy, arc, plugins, task_manager):
    import torch

    from llmtrain.core_mesh.config import Choice, structure
    from llmtrain.downstream.evaluate import evaluate_task
    from llmtrain.downstream.scoring import Batching, module_runner
    from llmtrain.train_loop.saved_model import load_model, tokenizer_of

    model, info, _ = load_model(toy, None, plugins)
    assert type(model).__name__ == "ToyLM" and not model.packed_rows
    choice = structure({"kind": "arc_easy", "path": arc.file}, Choice.of("task"), plugins=plugins)
    ours = evaluate_task(
        plugins.build("task", choice),
        tokenizer_of(info, None, plugins),
        module_runner(model),
        max_len=MAX_LEN,
        batching=Batching(rows=8),
        device=torch.device("cpu"),
    )
    import llmtrain_lmeval  # noqa: F401 - registers `llmtrain` for the Python API
    import lm_eval

    results = lm_eval.simple_evaluate(
        model="llmtrain",
        model_args={"checkpoint": toy},
        tasks=[arc.name],
        task_manager=task_manager,
        batch_size=8,
        device="cpu",
        log_samples=True,
    )
    theirs = sorted(results["samples"][arc.name], key=lambda s: s["doc_id"])
    assert len(theirs) == len(ours.items) == 20
    for mine, sample in zip(ours.items, theirs, strict=True):
        assert (mine["acc"], mine["acc_norm"]) == (sample["acc"], sample["acc_norm"])
        got = [float(r[0][0]) for r in sample["resps"]]  # one (ll, is_greedy) per option
        assert got == mine["loglikelihoods"]  # the same rows in the same batches: the same bits
    assert results["results"][arc.name]["acc,none"] == pytest.approx(ours.metrics["acc"])


def test_generate_until_reruns_the_prefix(toy):
    import torch
    from llmtrain_lmeval.model import LLMTrainLM
    from lm_eval.api.instance import Instance

    lm = LLMTrainLM(toy, device="cpu")
    context = "The cat sat on the"
    request = Instance("generate_until", {}, (context, {"until": ["\n"], "max_gen_toks": 10}), 0)
    (text,) = lm.generate_until([request])
    # greedy decoding: the argmax of a forward pass over the whole prefix, token by token
    ids = torch.tensor([lm.tokenizer.encode_batch([context])[0]])
    new: list[int] = []
    with torch.no_grad():
        for _ in range(10):
            nxt = int(lm.model(ids)[0, -1, : lm.tokenizer.vocab_size].argmax())
            new.append(nxt)
            if nxt == lm.tokenizer.eod_id:
                break
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    expected = lm.tokenizer.decode([t for t in new if t != lm.tokenizer.eod_id])
    assert text == expected.split("\n")[0]
    assert text.strip()  # some words were generated, not an immediate stop
