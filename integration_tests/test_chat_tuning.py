"""Instruction tuning end to end on CPU: `llmtrain data pack-chat` → `llmtrain run` → `eval`
through real `python -m llmtrain` processes (and 2 gloo ranks under torchrun), and `generate
--chat` run in this process (`run_cli`: the same command without a process start per reply).

The toy task: translate one of twelve English words to German. A tiny byte-level model learns it
in a few seconds; the loss counts only the assistant's answer and its end of turn."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
import torch
import train_support as ts
from shared_fixtures import run_cli  # noqa: F401

WORDS = {
    "red": "rot",
    "blue": "blau",
    "green": "gruen",
    "black": "schwarz",
    "white": "weiss",
    "house": "Haus",
    "dog": "Hund",
    "cat": "Katze",
    "tree": "Baum",
    "water": "Wasser",
    "bread": "Brot",
    "night": "Nacht",
}
SYSTEM = "You translate words to German."
SPECIALS = ["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
TOKENIZER = {"kind": "bytes", "special_tokens": SPECIALS}
SEQ_LEN = 128


def write_conversations(path, n: int, seed: int) -> None:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            messages = [{"role": "system", "content": SYSTEM}] if rng.random() < 0.3 else []
            for _ in range(2 if rng.random() < 0.3 else 1):  # some ask twice
                word = rng.choice(sorted(WORDS))
                messages += [
                    {"role": "user", "content": f"Translate {word}"},
                    {"role": "assistant", "content": WORDS[word]},
                ]
            f.write(json.dumps({"messages": messages}) + "\n")


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    """train.zarr and valid.zarr packed by the CLI with the built-in ChatML template."""
    d = tmp_path_factory.mktemp("chat")
    paths = {}
    for split, n, seed in (("train", 600, 0), ("valid", 60, 1)):
        write_conversations(d / f"{split}.jsonl", n, seed)
        paths[split] = d / f"{split}.zarr"
        proc = ts.run(
            ts.llmtrain(
                "data",
                "pack-chat",
                d / f"{split}.jsonl",
                "-o",
                paths[split],
                "--tokenizer",
                "bytes",
                "--tokenizer-option",
                f"special_tokens={json.dumps(SPECIALS)}",
                "--seq-len",
                SEQ_LEN,
                "--log-dir",
                d / "logs",
            ),
            timeout=600,
        )
        assert f"{n} conversations" in proc.stdout, proc.stdout
    return d, paths


def config(chat, run_dir, name: str, **training) -> dict:
    _, paths = chat
    return {
        "name": name,
        "seed": 5,
        "run_dir": str(run_dir),
        "device": "cpu",
        "model": {
            "kind": "tiny",
            "vocab_size": 260,
            "max_seq_len": SEQ_LEN,
            "doc_masking": True,
            "dropout": 0.0,
        },
        "data": {
            "train": [{"path": str(paths["train"])}],
            "eval": {"path": str(paths["valid"]), "every": 50, "batches": 1},
            "seq_len": SEQ_LEN,
            "micro_batch": 4,
            "global_batch": 8,
        },
        "optimizer": {"kind": "adamw", "lr": 3e-3, "weight_decay": 0.0},
        "lr_scheduler": {"kind": "cosine", "warmup_steps": 10, "min_ratio": 0.1},
        "training": {"steps": 250, "log_every": 10, **training},
    }


@pytest.fixture(scope="module")
def trained(chat, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trained")
    cfg = config(chat, tmp / "runs", "chat")
    path = ts.write_config(tmp / "run.yaml", cfg)
    ts.run(ts.llmtrain("run", path), timeout=600)
    return {"cfg": cfg, "run_dir": tmp / "runs" / "chat"}


@pytest.mark.parametrize(
    ("layout", "overrides"),
    [
        ("fsdp", []),  # 2 data ranks x 2 micro-batches of 2
        ("tp", ["mesh.tp=2"]),  # 1 data rank x 4 micro-batches, sequence parallel
        ("pp", ["mesh.pp=2"]),  # 4 micro-batches through a 2-stage pipeline
    ],
)
def test_loss_is_the_masked_cross_entropy_over_the_global_batch(chat, tmp_path, layout, overrides):
    """Two gloo ranks: the logged loss of step 1 (taken on the initial weights) equals the
    cross-entropy over the counted targets of the whole global batch divided by their number,
    computed here by hand from the stored tokens and masks, whatever splits the batch."""
    from llmtrain.core_mesh.plugins import PluginManager
    from llmtrain.data_pack.loader import open_windows
    from llmtrain.data_pack.sampling import BatchPlan
    from llmtrain.train_loop.run_config import RunConfig
    from llmtrain.train_loop.trainer import initial_model

    cfg = config(chat, tmp_path / "runs", "masked", steps=1, log_every=1)
    cfg["data"]["micro_batch"] = 2
    cfg["model"]["tied_embeddings"] = False  # so a pipeline can cut the model
    del cfg["data"]["eval"]
    path = ts.write_config(tmp_path / "run.yaml", cfg)
    ts.run(ts.torchrun(2, "run", path, *overrides), timeout=600)
    logged = ts.read_metrics(tmp_path / "runs" / "masked")[0]

    from llmtrain.core_mesh.config import load_config

    plugins = PluginManager().load_entry_points()
    run = load_config(str(path), RunConfig, plugins=plugins)
    model = initial_model(plugins, run.model, run.seed).eval()
    data = open_windows([cfg["data"]["train"][0]["path"]], SEQ_LEN, seed=run.seed, doc_starts=True)
    samples = np.concatenate(BatchPlan(8).step(0))
    batch = data.read(samples)
    tokens = torch.from_numpy(batch["tokens"])
    counted = torch.from_numpy(batch["loss_mask"][:, 1:])
    with torch.no_grad():
        logits = model(tokens[:, :-1], doc_starts=torch.from_numpy(batch["doc_starts"])).float()
    ce = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), tokens[:, 1:].flatten(), reduction="none"
    ).view(8, SEQ_LEN)
    expected = (ce * counted).sum() / counted.sum()
    assert logged["loss_tokens"] == int(counted.sum())
    assert logged["loss"] == pytest.approx(float(expected), rel=1e-5)
    # what it is not: the mean over all targets, or the mean of per-micro-batch means
    assert float(ce.mean()) != pytest.approx(float(expected), rel=1e-4)
    per_micro = [
        (ce[i : i + 2] * counted[i : i + 2]).sum() / counted[i : i + 2].sum() for i in (0, 2, 4, 6)
    ]
    assert float(sum(per_micro) / 4) != pytest.approx(float(expected), rel=1e-4)
    # an untrained model is near uniform over the 260 ids
    assert abs(logged["loss"] - math.log(260)) < 1.0


def test_a_tiny_model_learns_the_chat_task(chat, trained, tmp_path, run_cli):  # noqa: F811
    """The assistant-token loss falls far below the untrained value, in training and on held-out
    conversations, and greedy `generate --chat` answers each word."""
    _, paths = chat
    metrics = ts.read_metrics(trained["run_dir"])
    evals = [m["eval_loss"] for m in metrics if "eval_loss" in m]
    assert len(evals) == 5
    untrained = math.log(260)
    assert evals[-1] < 0.1 * untrained, evals
    assert metrics[-1]["loss"] < 0.1 * untrained
    checkpoints = trained["run_dir"] / "checkpoints"
    command = ts.llmtrain("eval", checkpoints, "--data", paths["valid"])
    out = ts.run(command, timeout=600).stdout
    result = json.loads(out.strip().splitlines()[-1])
    from llmtrain.data_pack.loader import open_windows

    valid = open_windows([str(paths["valid"])], SEQ_LEN, shuffle=False)
    everything = valid.read(np.arange(len(valid)))
    assert result["tokens"] == int(everything["loss_mask"][:, 1:].sum())
    assert result["loss"] < 0.1 * untrained

    def reply(*options: object) -> str:  # greedy
        command = ("generate", checkpoints, "--chat", "--temperature", "0")
        code, out, err = run_cli(*command, *options)
        assert code == 0, err
        return out

    for word in ("dog", "water", "night", "green"):
        assert reply("--prompt", f"Translate {word}") == WORDS[word] + "\n", word
    assert reply("--system", SYSTEM, "--prompt", "Translate cat") == "Katze\n"
    # a later turn of a conversation: the earlier turns from a file
    earlier = tmp_path / "earlier.json"
    turns = [
        {"role": "user", "content": "Translate tree"},
        {"role": "assistant", "content": "Baum"},
    ]
    earlier.write_text(json.dumps(turns))
    assert reply("--messages", earlier, "--prompt", "Translate bread") == "Brot\n"
    earlier.write_text('{"messages": [{"role": "user"}]}')
    code, _, err = run_cli("generate", checkpoints, "--chat", "--messages", earlier)
    assert code == 2
    assert f"{earlier}: expected a list of {{role, content}} messages" in err


def test_document_masking_keeps_conversations_apart(chat, trained):
    """In a window of several conversations, each one's logits equal those of the conversation
    alone; without document masking the later ones see the earlier ones."""
    from llmtrain.data_pack.loader import open_windows
    from llmtrain.train_loop.saved_model import load_model

    _, paths = chat
    model, _, _ = load_model(str(trained["run_dir"] / "checkpoints"), None, _plugins())
    data = open_windows([str(paths["train"])], SEQ_LEN, shuffle=False, doc_starts=True)
    batch = data.read([0])
    tokens = torch.from_numpy(batch["tokens"][:, :-1])
    starts = np.flatnonzero(batch["doc_starts"][0])
    assert len(starts) >= 2 and starts[0] == 0
    with torch.no_grad():
        packed = model(tokens, doc_starts=torch.from_numpy(batch["doc_starts"]))
        plain = model(tokens)
        begin, end = int(starts[1]), int(starts[2]) if len(starts) > 2 else SEQ_LEN
        alone = model(tokens[:, begin:end])
    torch.testing.assert_close(packed[:, begin:end], alone, rtol=1e-5, atol=1e-5)
    assert (plain[:, begin:end] - alone).abs().max() > 1e-3


def test_chat_errors_name_what_to_do(chat, tmp_path, run_cli):  # noqa: F811
    # a window length that would cut conversations
    cfg = config(chat, tmp_path / "runs", "cut", steps=2)
    cfg["data"]["seq_len"] = 96
    # and a model trained on plain text, for --chat: it records no template
    corpus = ts.pack_corpus(tmp_path / "plain", TOKENIZER)
    plain = ts.run_config(corpus, tmp_path / "runs", name="plain")
    plain["model"]["vocab_size"] = 260
    plain["training"] = {"steps": 2, "log_every": 1}
    proc, pretrained = ts.side_by_side(
        ts.llmtrain("run", ts.write_config(tmp_path / "cut.yaml", cfg)),
        ts.llmtrain("run", ts.write_config(tmp_path / "plain.yaml", plain)),
    )
    assert pretrained.returncode == 0, pretrained.stderr[-6000:]
    assert proc.returncode != 0
    assert "use a seq_len that is a multiple of 128" in proc.stderr
    checkpoints = tmp_path / "runs" / "plain" / "checkpoints"

    def chat_with(*options: str) -> tuple[int, str, str]:
        command = ("generate", checkpoints, "--chat", "--prompt", "hi", *options)
        return run_cli(*command, "--max-new-tokens", "5")

    code, _, err = chat_with()
    assert code != 0
    assert "records no chat template; pass --template" in err
    # ... which --template chatml supplies
    code, _, err = chat_with("--template", "chatml")
    assert code == 0, err
    # the template's tokens must exist in the tokenizer
    code, _, err = chat_with("--template", "chatml", "--tokenizer", "bytes")
    assert code != 0
    assert "needs <|im_end|>, <|im_start|> as special tokens" in err


def _plugins():
    from llmtrain.core_mesh.plugins import PluginManager

    return PluginManager().load_entry_points()


def test_a_step_that_counts_no_target_makes_no_update(chat, tmp_path):
    """A chat dataset whose mask counts nothing (written by hand): each step logs loss_tokens 0,
    no loss, and leaves the weights exactly as initialised (an AdamW step on zero gradients
    would still apply its weight decay)."""
    from llmtrain.checkpoint.export import load_model_weights
    from llmtrain.core_mesh.config import load_config
    from llmtrain.core_mesh.plugins import PluginManager
    from llmtrain.data_pack.store import DatasetWriter, Output, PackedDataset
    from llmtrain.train_loop.run_config import RunConfig
    from llmtrain.train_loop.trainer import initial_model

    _, paths = chat
    packed = PackedDataset(str(paths["train"]))
    n_blocks = 40
    tokens = np.asarray(packed.read(0, n_blocks * SEQ_LEN + 1))
    out = Output(str(tmp_path / "silent.zarr"), overwrite=False)
    writer = DatasetWriter(out, tokens.dtype, loss_mask=True)
    writer.add(tokens, np.asarray([len(tokens)]), np.zeros(len(tokens), bool))
    writer.close()
    counts = {**packed.meta["counts"], "documents": 1, "tokens": len(tokens), "counted_tokens": 0}
    out.commit({**packed.meta, "counts": counts})

    cfg = config(chat, tmp_path / "runs", "silent", steps=2, log_every=1)
    cfg["data"]["train"] = [{"path": str(tmp_path / "silent.zarr")}]
    cfg["optimizer"]["weight_decay"] = 0.1  # a step on zero gradients would still decay
    del cfg["data"]["eval"]
    path = ts.write_config(tmp_path / "run.yaml", cfg)
    ts.run(ts.llmtrain("run", path), timeout=600)
    metrics = ts.read_metrics(tmp_path / "runs" / "silent")
    assert [m["loss_tokens"] for m in metrics] == [0, 0]
    assert all("loss" not in m for m in metrics)
    plugins = PluginManager().load_entry_points()
    run = load_config(str(path), RunConfig, plugins=plugins)
    initial = initial_model(plugins, run.model, run.seed).state_dict()
    weights, _, step = load_model_weights(str(tmp_path / "runs" / "silent" / "checkpoints"))
    assert step == 2
    for name, value in weights.items():
        assert torch.equal(value, initial[name]), name


def test_fine_tune_a_pretrained_run_after_adding_the_chat_tokens(chat, tmp_path):
    """The usual path: pretrain on plain text with the bytes tokenizer (258 ids), add
    <|im_start|>/<|im_end|> for chat (260 ids: the model's padded table already has the rows),
    and fine-tune from the pretrained checkpoint. The tokenizer check refuses it until told; the
    fine-tune then starts well below the loss of the same run from scratch."""
    corpus = ts.pack_corpus(tmp_path / "plain")  # bytes: 256 + <|endoftext|>, <|pad|>
    pretrain = config(chat, tmp_path / "runs", "pretrain", steps=40, log_every=40)
    pretrain["model"]["vocab_size"] = 258
    pretrain["data"]["train"] = [{"path": corpus.train}]
    del pretrain["data"]["eval"]
    tune = config(chat, tmp_path / "runs", "sft", steps=3, log_every=1)
    del tune["data"]["eval"]
    tune["init"] = {"from": str(tmp_path / "runs" / "pretrain" / "checkpoints")}
    # the same first batch from scratch: the pretrained model already knows bytes of English
    scratch = {**tune, "name": "scratch", "init": None}
    for done in ts.side_by_side(
        ts.llmtrain("run", ts.write_config(tmp_path / "pretrain.yaml", pretrain)),
        ts.llmtrain("run", ts.write_config(tmp_path / "scratch.yaml", scratch)),
    ):
        assert done.returncode == 0, done.stderr[-6000:]

    path = ts.write_config(tmp_path / "sft.yaml", tune)
    proc = ts.run(ts.llmtrain("run", path), check=False, timeout=600)
    assert proc.returncode != 0
    assert "init.check_tokenizer: false" in proc.stderr
    ts.run(ts.llmtrain("run", path, "init.check_tokenizer=false"), timeout=600)
    first = ts.read_metrics(tmp_path / "runs" / "sft")[0]
    untrained = ts.read_metrics(tmp_path / "runs" / "scratch")[0]
    assert first["step"] == untrained["step"] == 1
    assert first["loss_tokens"] == untrained["loss_tokens"]  # the same counted targets
    assert first["loss"] < untrained["loss"] - 0.5, (first["loss"], untrained["loss"])
    from llmtrain.checkpoint.manager import Checkpointer

    info = Checkpointer(str(tmp_path / "runs" / "sft" / "checkpoints")).info(3)["info"]
    assert info["init"]["from"] == tune["init"]["from"] and info["init"]["step"] == 40
    assert info["data"]["chat"]["template"]["name"] == "chatml"
