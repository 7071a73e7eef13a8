"""Shared setup for llmtrain-lmeval's tests: everything offline and cached under a temporary
HF_HOME, one torch thread, and one trained checkpoint for the session: a Llama-style `tiny`
model trained a few steps through the real `llmtrain run` (a BPE tokenizer trained here),
exported to a transformers directory with `llmtrain hf export`, and a local ARC-layout task
file with the lm-eval task that reads it the way the harness's `arc_easy` does."""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from support import run

# the harness and transformers must never reach for the network; datasets' json builder reads
# local files offline
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
TASK = "llmtrain_arc_parity"
# the harness's arc_easy.yaml, reading a local file instead of allenai/ai2_arc
TASK_YAML = {
    "task": TASK,
    "dataset_path": "json",
    "output_type": "multiple_choice",
    "test_split": "test",
    "doc_to_text": "Question: {{question}}\nAnswer:",
    "doc_to_target": "{{choices.label.index(answerKey)}}",
    "doc_to_choice": "{{choices.text}}",
    "metric_list": [
        {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
        {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True},
    ],
}
_home: str | None = None


def pytest_configure(config):
    global _home
    # DCP in one process without a process group: what loading a checkpoint means to do
    config.addinivalue_line("filterwarnings", "ignore:torch.distributed is disabled:UserWarning")
    _home = tempfile.mkdtemp(prefix="lmeval-hf-home-")
    os.environ.update(OFFLINE, HF_HOME=_home)


def pytest_unconfigure(config):
    if _home:
        shutil.rmtree(_home, ignore_errors=True)


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny model: threads buy nothing on a small, busy machine
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def plugins():
    from llmtrain.core_mesh.plugins import PluginManager

    pm = PluginManager(blocked=()).load_entry_points()
    assert pm.problems == [], pm.problems
    assert "lm-eval" in pm.registry("command") and "hf" in pm.registry("command")
    return pm


def llmtrain(*args: object) -> list[str]:
    """The installed `llmtrain` command (beside this interpreter)."""
    return [str(Path(sys.executable).parent / "llmtrain"), *map(str, args)]


@pytest.fixture(scope="session")
def packed(tmp_path_factory) -> Path:
    """A packed corpus of the quickstart's sentences under a 300-token BPE tokenizer: the
    training data of every model these tests train."""
    from llmtrain.data_pack.pack import pack
    from llmtrain.data_pack.tokenizer import train_bpe
    from llmtrain.train_loop.experiments.quickstart import sentence, write_corpus

    root = tmp_path_factory.mktemp("packed")
    rng = random.Random(0)
    texts = [" ".join(sentence(rng) for _ in range(3)) for _ in range(200)]
    tokenizer = root / "tokenizer.json"
    tokenizer.write_text(train_bpe(texts, 300, special_tokens=("<|endoftext|>",)))
    write_corpus(root / "train.jsonl", 80, seed=0)
    data = root / "train.zarr"
    pack([str(root / "train.jsonl")], str(data), {"kind": "hf", "path": str(tokenizer)}, workers=1)
    return data


@pytest.fixture(scope="session")
def trained(tmp_path_factory, packed) -> SimpleNamespace:
    """`checkpoint` (a Llama-style tiny model, 6 steps of `llmtrain run` on CPU), `export`
    (its transformers directory, written by llmtrain-hf) and `max_len` (the model's
    max_seq_len, the harness's max_length)."""
    from llmtrain_hf import export_checkpoint

    root = tmp_path_factory.mktemp("trained")
    data = packed
    config = {
        "name": "llama",
        "seed": 0,
        "run_dir": str(root / "runs"),
        "device": "cpu",
        "model": {
            "kind": "tiny",
            "max_seq_len": 128,
            "d_model": 32,
            "rope_base": 500000.0,
            "norm_eps": 1e-6,
            "tied_embeddings": False,
        },
        "data": {"train": [{"path": str(data)}], "seq_len": 64, "micro_batch": 4},
        "optimizer": {"kind": "adamw", "lr": 3e-3},
        "training": {"steps": 6, "log_every": 3},
        "loggers": [{"kind": "jsonl"}],
    }
    (root / "run.yaml").write_text(yaml.safe_dump(config))
    run(llmtrain("run", root / "run.yaml"))
    checkpoint = str(root / "runs" / "llama" / "checkpoints")
    # `llmtrain hf export` in this process: the tests load transformers here anyway
    export_checkpoint(checkpoint, str(root / "hf"))
    return SimpleNamespace(checkpoint=checkpoint, export=str(root / "hf"), max_len=128)


WORDS = ["river", "bridge", "café", "garden", "robot", "teacher", "storm", "naïve cat", "lamp"]
VERBS = ["builds", "follows", "paints", "finds", "carries", "watches"]


def arc_items(n: int, seed: int = 0) -> list[dict]:
    """ARC's Hugging Face rows: 3 to 5 choices, lettered or numbered labels, unicode."""
    rng = random.Random(seed)
    items = []
    for i in range(n):
        k = rng.randint(3, 5)
        labels = list("ABCDE"[:k]) if i % 4 else [str(j + 1) for j in range(k)]
        texts = [
            " ".join(rng.sample(WORDS, rng.randint(1, 2))) + rng.choice(["", ".", " today"])
            for _ in range(k)
        ]
        question = f"Which {rng.choice(WORDS)} {rng.choice(VERBS)} the {rng.choice(WORDS)}?"
        items.append(
            {
                "id": f"q{i}",
                "question": question,
                "choices": {"text": texts, "label": labels},
                "answerKey": rng.choice(labels),
            }
        )
    return items


@pytest.fixture(scope="session")
def arc(tmp_path_factory) -> SimpleNamespace:
    """`file` (20 ARC-layout items, JSON lines) and `tasks` (a folder holding the lm-eval task
    that reads it: `lm_eval --include_path tasks --tasks llmtrain_arc_parity`)."""
    root = tmp_path_factory.mktemp("arc")
    file = root / "ARC-Easy-Test.jsonl"
    file.write_text("".join(json.dumps(item) + "\n" for item in arc_items(20)))
    tasks = root / "tasks"
    tasks.mkdir()
    spec = {**TASK_YAML, "dataset_kwargs": {"data_files": {"test": str(file)}}}
    (tasks / f"{TASK}.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    return SimpleNamespace(file=str(file), tasks=str(tasks), name=TASK)


@pytest.fixture(scope="session")
def task_manager(arc):
    """The local task only: indexing lm-eval's thousands of built-in tasks takes seconds."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=arc.tasks, include_defaults=False)


@pytest.fixture(scope="session")
def ours(trained, arc, plugins):
    """llmtrain's own scores of the ARC file (the built-in `arc_easy` task): per item, the
    options' log-likelihoods, acc and acc_norm."""
    import torch

    from llmtrain.core_mesh.config import Choice, structure
    from llmtrain.downstream.evaluate import evaluate_task
    from llmtrain.downstream.scoring import Batching, module_runner
    from llmtrain.train_loop.saved_model import load_model, tokenizer_of

    model, info, _ = load_model(trained.checkpoint, None, plugins)
    choice = structure({"kind": "arc_easy", "path": arc.file}, Choice.of("task"), plugins=plugins)
    result = evaluate_task(
        plugins.build("task", choice),
        tokenizer_of(info, None, plugins),
        module_runner(model),
        max_len=trained.max_len,
        batching=Batching(rows=8),
        device=torch.device("cpu"),
    )
    assert result.truncated == 0 and len(result.items) == 20
    return result
