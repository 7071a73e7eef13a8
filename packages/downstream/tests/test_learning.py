"""End to end on a learnable toy task written in ARC's and LAMBADA's published layouts: a tiny
model trained for 150 steps (about twice what it needs) answers every question (acc, acc_norm and the greedy cloze
accuracy reach 1), while an untrained one sits at chance."""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F

from llmtrain.core_mesh.config import Choice, structure
from llmtrain.downstream.evaluate import evaluate_task
from llmtrain.downstream.scoring import Batching, module_runner

COLOURS = ["red", "green", "blue", "yellow"]
MAX_LEN = 64


def question(k: int) -> str:
    return f"What colour is item {k}?"


def arc_rows(golds: list[int]) -> list[dict]:
    return [
        {
            "id": f"toy_{k}",
            "question": question(k),
            "choices": {"text": COLOURS, "label": list("ABCD")},
            "answerKey": "ABCD"[gold],
        }
        for k, gold in enumerate(golds)
    ]


def evaluate(plugins, tokenizer, model, kind: str, path: str):
    choice = structure({"kind": kind, "path": path}, Choice.of("task"), plugins=plugins)
    return evaluate_task(
        plugins.build("task", choice),
        tokenizer,
        module_runner(model),
        max_len=MAX_LEN,
        batching=Batching(rows=32),
        device="cpu",
    )


def train(model: torch.nn.Module, tokenizer, texts: list[str], steps: int) -> float:
    """Full-batch Adam on the texts (each after the end-of-document token). Adam is written out:
    building any torch.optim optimizer imports torch._dynamo, seconds of imports per process."""
    rows = [[tokenizer.eod_id, *ids] for ids in tokenizer.encode_batch(texts)]
    length = max(len(r) for r in rows)
    batch = torch.full((len(rows), length), -100, dtype=torch.long)
    for b, row in enumerate(rows):
        batch[b, : len(row)] = torch.tensor(row)
    inputs = batch[:, :-1].clamp(min=0)
    targets = batch[:, 1:]
    params = [p for p in model.parameters() if p.requires_grad]
    means = [torch.zeros_like(p) for p in params]
    squares = [torch.zeros_like(p) for p in params]
    lr, beta1, beta2 = 3e-3, 0.9, 0.999
    model.train()
    for step in range(1, steps + 1):
        logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100)
        grads = torch.autograd.grad(loss, params)
        with torch.no_grad():
            for p, g, m, v in zip(params, grads, means, squares, strict=True):
                m.mul_(beta1).add_(g, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                denominator = (v / (1 - beta2**step)).sqrt_().add_(1e-8)
                p.addcdiv_(m, denominator, value=-lr / (1 - beta1**step))
    model.eval()
    return float(loss.detach())


def test_a_trained_model_answers_every_question(plugins, tiny_model, byte_tokenizer, write_jsonl):
    golds = [0, 1, 2, 3, 2, 0, 3, 1]
    arc = write_jsonl("ARC-Easy-Train.jsonl", arc_rows(golds))
    solved = [f"Question: {question(k)}\nAnswer: {COLOURS[g]}" for k, g in enumerate(golds)]
    lambada = write_jsonl("lambada_test.jsonl", [{"text": t} for t in solved])
    model = tiny_model(seed=0)

    before = evaluate(plugins, byte_tokenizer, model, "arc_easy", arc)
    assert before.metrics["acc"] < 1.0
    assert evaluate(plugins, byte_tokenizer, model, "lambada", lambada).metrics["acc"] == 0.0

    loss = train(model, byte_tokenizer, solved, steps=150)
    assert loss < 0.5, loss

    after = evaluate(plugins, byte_tokenizer, model, "arc_easy", arc)
    assert after.metrics["acc"] == 1.0
    assert after.metrics["acc_norm"] == 1.0
    assert after.metrics["acc_norm_tokens"] == 1.0
    for item in after.items:
        lls = item["loglikelihoods"]
        assert lls[item["gold"]] > -1.0  # the answer is likely, not just the likeliest
        assert max(ll for i, ll in enumerate(lls) if i != item["gold"]) < -2.0
    cloze = evaluate(plugins, byte_tokenizer, model, "lambada", lambada)
    assert cloze.metrics["acc"] == 1.0  # every answer token is the greedy choice
    assert cloze.metrics["perplexity"] < 2.0


def test_an_untrained_model_sits_at_chance(plugins, tiny_model, byte_tokenizer, write_jsonl):
    """200 questions, 4 choices, golds drawn independently of anything the model sees: the
    count right is Binomial(200, 1/4) (mean 50, sd 6.1); allow four sd either side."""
    n = 200
    rng = random.Random(0)
    arc = write_jsonl("ARC-Easy-Test.jsonl", arc_rows([rng.randrange(4) for _ in range(n)]))
    result = evaluate(plugins, byte_tokenizer, tiny_model(seed=1), "arc_easy", arc)
    assert len(result.items) == n
    sd = math.sqrt(0.25 * 0.75 / n)
    for name in ("acc", "acc_norm", "acc_norm_tokens"):
        assert 0.25 - 4 * sd < result.metrics[name] < 0.25 + 4 * sd, (name, result.metrics)
        assert result.metrics[f"{name}_stderr"] == pytest.approx(
            math.sqrt(result.metrics[name] * (1 - result.metrics[name]) / (n - 1)), rel=1e-9
        )
