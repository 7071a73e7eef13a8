"""Few-shot prompts: solved examples drawn with a seed, never the question itself, the same for
an item whatever the limit, from `fewshot_path` when given, after the task's description."""

from __future__ import annotations

import csv

import pytest

from llmtrain.core_mesh.config import Choice, structure
from llmtrain.core_mesh.errors import UserError

N_ITEMS = 12


def arc_rows(prefix: str, n: int) -> list[dict]:
    return [
        {
            "id": f"{prefix}{k}",
            "question": f"{prefix} question {k}?",
            "choices": {"text": [f"wrong {k}", f"{prefix} right {k}"], "label": ["A", "B"]},
            "answerKey": "B",
        }
        for k in range(n)
    ]


def demo(prefix: str, k: int) -> str:
    """An ARC row solved, written out as the harness writes an example."""
    return f"Question: {prefix} question {k}?\nAnswer: {prefix} right {k}"


def contexts(plugins, kind: str, path: str, **options) -> list[str]:
    choice = structure({"kind": kind, "path": path, **options}, Choice.of("task"), plugins=plugins)
    return [item.contexts[0] for item in plugins.build("task", choice).items()]


def examples_of(context: str, own: str) -> list[str]:
    """The demonstrations before an item's own prompt (which must end the context)."""
    assert context.endswith(own)
    prefix = context[: -len(own)]
    assert prefix.endswith("\n\n")
    return prefix[: -len("\n\n")].split("\n\n")


@pytest.fixture
def arc_path(write_jsonl) -> str:
    return write_jsonl("ARC-Easy-Test.jsonl", arc_rows("test", N_ITEMS))


def test_examples_are_other_solved_items(plugins, arc_path):
    prompts = contexts(plugins, "arc_easy", arc_path, shots=3)
    drawn = set()
    for k, context in enumerate(prompts):
        shown = examples_of(context, f"Question: test question {k}?\nAnswer:")
        others = {demo("test", j) for j in range(N_ITEMS) if j != k}
        assert len(shown) == 3 and len(set(shown)) == 3
        assert set(shown) <= others, (k, shown)
        drawn.add(tuple(shown))
    assert len(drawn) > N_ITEMS // 2  # each item draws its own


def test_every_other_item_when_shots_is_the_pool_less_one(plugins, arc_path):
    prompts = contexts(plugins, "arc_easy", arc_path, shots=N_ITEMS - 1)
    for k, context in enumerate(prompts):
        shown = examples_of(context, f"Question: test question {k}?\nAnswer:")
        assert sorted(shown) == sorted(demo("test", j) for j in range(N_ITEMS) if j != k)


def test_seeded_and_independent_of_limit(plugins, arc_path):
    once = contexts(plugins, "arc_easy", arc_path, shots=2, seed=7)
    assert contexts(plugins, "arc_easy", arc_path, shots=2, seed=7) == once
    assert contexts(plugins, "arc_easy", arc_path, shots=2, seed=7, limit=4) == once[:4]
    other_seed = contexts(plugins, "arc_easy", arc_path, shots=2, seed=8)
    assert other_seed != once
    assert len(other_seed) == len(once)
    assert contexts(plugins, "arc_easy", arc_path, limit=5) == [
        f"Question: test question {k}?\nAnswer:" for k in range(5)
    ]


def test_fewshot_path(plugins, arc_path, write_jsonl):
    train = write_jsonl("ARC-Easy-Train.jsonl", arc_rows("train", 5))
    prompts = contexts(plugins, "arc_easy", arc_path, shots=5, fewshot_path=train)
    for k, context in enumerate(prompts):
        shown = examples_of(context, f"Question: test question {k}?\nAnswer:")
        assert sorted(shown) == sorted(demo("train", j) for j in range(5))
    # the whole pool is drawn from: the same index of another file is no longer excluded
    one = write_jsonl("one.jsonl", arc_rows("train", 1))
    first = contexts(plugins, "arc_easy", arc_path, shots=1, fewshot_path=one)[0]
    assert first == demo("train", 0) + "\n\nQuestion: test question 0?\nAnswer:"


def test_more_shots_than_the_pool(plugins, arc_path, write_jsonl):
    with pytest.raises(UserError, match=f"12 examples asked for, but {arc_path} has only 11"):
        contexts(plugins, "arc_easy", arc_path, shots=N_ITEMS)
    train = write_jsonl("ARC-Easy-Train.jsonl", arc_rows("train", 2))
    with pytest.raises(UserError, match=f"3 examples asked for, but {train} has only 2 to draw"):
        contexts(plugins, "arc_easy", arc_path, shots=3, fewshot_path=train)


def test_perplexity_takes_no_examples(plugins, write_jsonl):
    path = write_jsonl("docs.jsonl", [{"text": "a b"}, {"text": "c d"}])
    with pytest.raises(UserError, match="perplexity tasks take no examples"):
        contexts(plugins, "perplexity", path, shots=1)


def test_mmlu_description_then_examples(plugins, tmp_path):
    def write(name: str, rows: list[list[str]]) -> str:
        with open(tmp_path / name, "w", newline="", encoding="utf-8") as f:
            csv.writer(f).writerows(rows)
        return str(tmp_path / name)

    test = write("high_school_physics_test.csv", [["What is g?", "1", "9.8", "0", "3", "B"]])
    dev = write("high_school_physics_dev.csv", [["Unit of force?", "N", "J", "W", "Pa", "A"]])
    (prompt,) = contexts(plugins, "mmlu", test, shots=1, fewshot_path=dev)
    assert prompt == (
        "The following are multiple choice questions (with answers) about high school physics."
        "\n\n"
        "Unit of force?\nA. N\nB. J\nC. W\nD. Pa\nAnswer: A"
        "\n\n"
        "What is g?\nA. 1\nB. 9.8\nC. 0\nD. 3\nAnswer:"
    )


def test_mmlu_examples_are_the_first_dev_items_in_order_whatever_the_seed(plugins, tmp_path):
    def write(name: str, rows: list[list[str]]) -> str:
        with open(tmp_path / name, "w", newline="", encoding="utf-8") as f:
            csv.writer(f).writerows(rows)
        return str(tmp_path / name)

    test = write("anatomy_test.csv", [[f"Test {k}?", "a", "b", "A"] for k in range(3)])
    dev = write("anatomy_dev.csv", [[f"Dev {k}?", "a", "b", "AB"[k % 2]] for k in range(5)])
    shown = [f"Dev {k}?\nA. a\nB. b\nAnswer: {'AB'[k % 2]}" for k in range(2)]
    for seed in (1, 2):
        prompts = contexts(plugins, "mmlu", test, shots=2, fewshot_path=dev, seed=seed)
        for k, prompt in enumerate(prompts):
            own = f"Test {k}?\nA. a\nB. b\nAnswer:"
            assert examples_of(prompt, own)[1:] == shown  # after the subject line
    # from the test file itself: the first items, skipping the question's own
    prompts = contexts(plugins, "mmlu", test, shots=1)
    assert [
        examples_of(p, f"Test {k}?\nA. a\nB. b\nAnswer:")[1] for k, p in enumerate(prompts)
    ] == [
        "Test 1?\nA. a\nB. b\nAnswer: A",
        "Test 0?\nA. a\nB. b\nAnswer: A",
        "Test 0?\nA. a\nB. b\nAnswer: A",
    ]


def test_winogrande_example_uses_the_gold_option(plugins, write_jsonl):
    row = {"qID": "q", "option1": "Sarah", "option2": "Maria"}
    dev = write_jsonl("dev.jsonl", [{**row, "sentence": "Then _ won.", "answer": "1"}])
    train = write_jsonl("train_xl.jsonl", [{**row, "sentence": "So _ lost it.", "answer": "2"}])
    choice = structure(
        {"kind": "winogrande", "path": dev, "shots": 1, "fewshot_path": train},
        Choice.of("task"),
        plugins=plugins,
    )
    (item,) = plugins.build("task", choice).items()
    assert item.contexts == ("So Maria lost it.\n\nThen Sarah", "So Maria lost it.\n\nThen Maria")
    assert item.choices == ("won.",)


def test_piqa_examples_from_another_split_use_its_own_labels(plugins, write_jsonl, tmp_path):
    valid = write_jsonl(
        "valid.jsonl", [{"goal": f"g{k}", "sol1": "a", "sol2": "b"} for k in range(3)]
    )
    labels = tmp_path / "answers" / "valid-labels.lst"
    labels.parent.mkdir()
    labels.write_text("0\n0\n0\n")
    train = write_jsonl("train.jsonl", [{"goal": "t", "sol1": "wrong", "sol2": "right"}])
    (tmp_path / "train-labels.lst").write_text("1\n")
    prompts = contexts(plugins, "piqa", valid, labels_path=str(labels), shots=1, fewshot_path=train)
    assert prompts == [f"Question: t\nAnswer: right\n\nQuestion: g{k}\nAnswer:" for k in range(3)]
