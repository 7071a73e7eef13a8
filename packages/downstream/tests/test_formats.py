"""The readers of the published task layouts: the prompts lm-evaluation-harness builds from the
same rows, the gold index, `where` (file:line), and one-line errors for bad input."""

from __future__ import annotations

import json
import re

import attrs
import pytest
from downstream_layouts import (
    ARC_STEM,
    ARC_TEXTS,
    HELLASWAG_ROWS,
    LAMBADA_TEXT,
    PIQA_ROWS,
    SCIQ_ROWS,
    WINOGRANDE_ROWS,
    arc_flat,
    arc_nested,
    write_mmlu_csv,
)

from llmtrain.core_mesh.config import Choice, ConfigError, structure
from llmtrain.core_mesh.errors import UserError
from llmtrain.core_mesh.interfaces import TaskItem
from llmtrain.downstream.plugin import BUILTIN_TASKS
from llmtrain.downstream.task_files import TaskFileError


def task_items(plugins, kind: str, path: str, **options) -> list[TaskItem]:
    choice = structure({"kind": kind, "path": path, **options}, Choice.of("task"), plugins=plugins)
    task = plugins.build("task", choice)
    assert task.name == kind
    assert task.scoring == BUILTIN_TASKS[kind][1]
    return list(task.items())


def test_hellaswag_prompts_as_the_harness(plugins, write_jsonl):
    path = write_jsonl("hellaswag_val.jsonl", HELLASWAG_ROWS)
    first, second = task_items(plugins, "hellaswag", path)
    assert first.contexts == ("Roof shingle removal: A man is sitting on a roof. He",)
    assert first.choices == tuple(HELLASWAG_ROWS[0]["endings"])
    assert (first.gold, first.delimiter, first.where) == (3, " ", f"{path}:1")
    # "[title]" -> ". ", other tags removed, double spaces closed, ctx_b capitalized (which
    # lowercases the rest, as Python's str.capitalize does in the harness)
    assert second.contexts == (
        "Home and Garden: How to clean a grill. Turn the grill on high. let it heat for 15 minutes.",
    )
    assert second.choices == (
        " Scrub the grates with a brush.",
        "Pour water. on the coals.",
        "Walk away.",
        "Eat the grill.",
    )
    assert (second.gold, second.where) == (0, f"{path}:2")


@pytest.mark.parametrize("kind", ["arc_easy", "arc_challenge"])
def test_arc_both_layouts(plugins, write_jsonl, kind):
    nested = write_jsonl("ARC-Easy-Test.jsonl", [arc_nested(), arc_nested("3", "1234")])
    flat = write_jsonl("hf/test.jsonl", [arc_flat("B"), arc_flat("4", "1234")])
    a, b = task_items(plugins, kind, nested)
    c, d = task_items(plugins, kind, flat)
    for item in (a, b, c, d):
        assert item.contexts == (f"Question: {ARC_STEM}\nAnswer:",)
        assert item.choices == tuple(ARC_TEXTS)
    assert [a.gold, b.gold, c.gold, d.gold] == [2, 2, 1, 3]
    assert [a.where, b.where, c.where, d.where] == [
        f"{nested}:1",
        f"{nested}:2",
        f"{flat}:1",
        f"{flat}:2",
    ]


def test_piqa_with_its_labels_file(plugins, write_jsonl, tmp_path):
    path = write_jsonl("valid.jsonl", PIQA_ROWS)
    (tmp_path / "valid-labels.lst").write_text("0\n1\n")
    first, second = task_items(plugins, "piqa", path)
    assert first.contexts == (f"Question: {PIQA_ROWS[0]['goal']}\nAnswer:",)
    assert first.choices == (PIQA_ROWS[0]["sol1"], PIQA_ROWS[0]["sol2"])
    assert second.choices == ("replace drawer with bobby pin ", "finish, woodgrain with")
    assert [first.gold, second.gold] == [0, 1]
    assert [first.where, second.where] == [f"{path}:1", f"{path}:2"]
    # labels_path names the file when it is elsewhere; rows with their own label need none
    (tmp_path / "elsewhere.lst").write_text("1\n0\n")
    items = task_items(plugins, "piqa", path, labels_path=str(tmp_path / "elsewhere.lst"))
    assert [i.gold for i in items] == [1, 0]
    hf = write_jsonl("hf.jsonl", [{**PIQA_ROWS[0], "label": 1}])
    assert [i.gold for i in task_items(plugins, "piqa", hf)] == [1]


def test_winogrande_partial_scoring(plugins, write_jsonl):
    path = write_jsonl("dev.jsonl", WINOGRANDE_ROWS)
    first, second = task_items(plugins, "winogrande", path)
    head = "Sarah was a much better surgeon than Maria so "
    assert first.contexts == (head + "Sarah", head + "Maria")
    assert first.choices == ("always got the harder cases.",)
    assert first.n_options == 2 and first.choice(1) == "always got the harder cases."
    assert [first.gold, second.gold] == [0, 1]
    assert second.where == f"{path}:2"


def test_lambada_last_word(plugins, write_jsonl):
    path = write_jsonl("lambada_test.jsonl", [{"text": LAMBADA_TEXT}, {"text": "two words"}])
    first, second = task_items(plugins, "lambada", path)
    assert first.contexts == (LAMBADA_TEXT[: -len(" signs")],)
    assert first.choices == ("signs",)
    assert first.delimiter == " "  # the harness's continuation is " signs"
    assert (second.contexts, second.choices, second.where) == (("two",), ("words",), f"{path}:2")


@pytest.mark.parametrize("indent", [None, 2])
def test_sciq_json_array(plugins, tmp_path, indent):
    path = tmp_path / "test.json"
    path.write_text(json.dumps(SCIQ_ROWS, indent=indent))
    first, second = task_items(plugins, "sciq", str(path))
    assert first.contexts == (
        "Mesophiles grow best in moderate temperature.\n"
        f"Question: {SCIQ_ROWS[0]['question']}\nAnswer:",
    )
    assert first.choices == ("protozoa", "gymnosperms", "viruses", "mesophilic organisms")
    assert second.contexts == (f"\nQuestion: {SCIQ_ROWS[1]['question']}\nAnswer:",)
    assert [first.gold, second.gold] == [3, 3]
    # an array's records are named by the line each object starts on
    starts = [1, 1] if indent is None else [2, 10]
    assert [first.where, second.where] == [f"{path}:{n}" for n in starts]


MMLU_DESCRIPTION = (
    "The following are multiple choice questions (with answers) about abstract algebra.\n\n"
)


def test_mmlu_hendrycks_csv(plugins, tmp_path):
    path = write_mmlu_csv(tmp_path / "abstract_algebra_test.csv")
    first, second, third = task_items(plugins, "mmlu", path)
    assert first.contexts == (
        MMLU_DESCRIPTION + "Find the degree for the given field extension Q(sqrt(2), sqrt(3)) "
        "over Q.\nA. 0\nB. 4\nC. 2\nD. 6\nAnswer:",
    )
    assert first.choices == ("A", "B", "C", "D")
    assert [first.gold, second.gold, third.gold] == [1, 2, 3]
    # a quoted question spanning two lines: the next row starts on line 4
    assert [first.where, second.where, third.where] == [f"{path}:1", f"{path}:2", f"{path}:4"]
    assert second.contexts[0].startswith(MMLU_DESCRIPTION + "Let p = (1, 2, 5, 4)(2, 3) in S_5.\n")
    # `subject` replaces the one the file name gives
    (item, *_) = task_items(plugins, "mmlu", path, subject="college_mathematics")
    assert item.contexts[0].startswith(
        "The following are multiple choice questions (with answers) about college mathematics."
        "\n\nFind the degree"
    )


def test_mmlu_style_json_lines(plugins, write_jsonl):
    rows = [
        {"question": "  What is 2 + 2? ", "subject": "x", "choices": ["3", "4", "5"], "answer": 1},
        {"question": "Pick E.", "choices": list("abcde"), "answer": "E"},
    ]
    path = write_jsonl("questions.jsonl", rows)
    first, second = task_items(plugins, "mmlu", path)
    # no <subject>_<split> file name: no description
    assert first.contexts == ("What is 2 + 2?\nA. 3\nB. 4\nC. 5\nAnswer:",)
    assert first.choices == ("A", "B", "C")
    assert second.choices == tuple("ABCDE")
    assert [first.gold, second.gold] == [1, 4]


def test_perplexity_documents(plugins, write_jsonl, tmp_path):
    path = write_jsonl("docs.jsonl", [{"text": "one doc"}, {"meta": {"body": "x"}, "text": "two"}])
    items = task_items(plugins, "perplexity", path)
    assert [(i.contexts, i.choices, i.delimiter) for i in items] == [
        (("",), ("one doc",), ""),
        (("",), ("two",), ""),
    ]
    with pytest.raises(TaskFileError, match=re.escape(f"{path}:1: field 'meta.body' is missing")):
        task_items(plugins, "perplexity", path, field="meta.body")
    text = tmp_path / "book.txt"
    text.write_text("line one\nline two\n")
    (whole,) = task_items(plugins, "perplexity", str(text))
    assert whole.choices == ("line one\nline two\n",)


# --- bad input: one line naming file:line and the field ---------------------------------------


def one_line_error(plugins, kind: str, path: str, **options) -> str:
    with pytest.raises(UserError) as caught:
        task_items(plugins, kind, path, **options)
    message = str(caught.value)
    assert "\n" not in message, message
    return message


def test_missing_field(plugins, write_jsonl):
    row = {k: v for k, v in HELLASWAG_ROWS[0].items() if k != "ctx_b"}
    path = write_jsonl("hellaswag_val.jsonl", [HELLASWAG_ROWS[0], row])
    assert one_line_error(plugins, "hellaswag", path) == f"{path}:2: field 'ctx_b' is missing"
    nested = write_jsonl("ARC-Easy-Test.jsonl", [{"id": "x", "question": {"choices": []}}])
    assert one_line_error(plugins, "arc_easy", nested) == (
        f"{nested}:1: field 'question.stem' is missing"
    )


def test_wrong_field_type(plugins, write_jsonl):
    path = write_jsonl("hellaswag_val.jsonl", [{**HELLASWAG_ROWS[0], "label": True}])
    message = one_line_error(plugins, "hellaswag", path)
    assert message.startswith(f"{path}:1: field 'label' must be int/str")


@pytest.mark.parametrize("label", [4, -1, "9", "", "x1"])
def test_label_out_of_range(plugins, write_jsonl, label):
    path = write_jsonl(
        "hellaswag_val.jsonl", [HELLASWAG_ROWS[0], {**HELLASWAG_ROWS[0], "label": label}]
    )
    message = one_line_error(plugins, "hellaswag", path)
    assert message == f"{path}:2: field 'label': {label!r} is not the index of one of 4 choices"


def test_winogrande_answer_must_be_1_or_2(plugins, write_jsonl):
    row = {"qID": "q", "sentence": "A _ b.", "option1": "x", "option2": "y"}
    # a letter is no Winogrande answer: "B" read as an index would pick option1
    for answer in ("0", "3", "B", "A", ""):
        path = write_jsonl("dev.jsonl", [{**row, "answer": answer}])
        message = one_line_error(plugins, "winogrande", path)
        assert message == f"{path}:1: field 'answer': {answer!r} is not 1 or 2"
    path = write_jsonl("dev.jsonl", [{**row, "sentence": "no blank", "answer": "1"}])
    assert (
        one_line_error(plugins, "winogrande", path)
        == f"{path}:1: field 'sentence' has no '_' blank"
    )


def test_empty_choice_list(plugins, write_jsonl):
    path = write_jsonl("hellaswag_val.jsonl", [{**HELLASWAG_ROWS[0], "endings": []}])
    assert one_line_error(plugins, "hellaswag", path) == (
        f"{path}:1: field 'endings' must be a non-empty list of choices"
    )
    mmlu = write_jsonl("q.jsonl", [{"question": "q", "choices": [], "answer": 0}])
    assert "q.jsonl:1: field 'choices' must be a non-empty list" in one_line_error(
        plugins, "mmlu", mmlu
    )
    arc = write_jsonl(
        "ARC-Easy-Test.jsonl",
        [arc_nested(), {**arc_nested(), "question": {"stem": "s", "choices": []}}],
    )
    assert one_line_error(plugins, "arc_easy", arc) == (
        f"{arc}:2: field 'question.choices' must be a non-empty list"
    )
    bad = write_jsonl("hellaswag_val.jsonl", [{**HELLASWAG_ROWS[0], "endings": ["a", 2, "c", "d"]}])
    assert one_line_error(plugins, "hellaswag", bad) == (
        f"{bad}:1: field 'endings': every choice must be text, got 2"
    )


def test_non_utf8_byte_names_its_line(plugins, tmp_path):
    path = tmp_path / "hellaswag_val.jsonl"
    good = json.dumps(HELLASWAG_ROWS[0]).encode()
    path.write_bytes(good + b"\n" + good + b"\n" + good.replace(b"roof.", b"r\xe9of.", 1) + b"\n")
    message = one_line_error(plugins, "hellaswag", str(path))
    assert message.startswith(f"{path}:3: not UTF-8 text")


def test_bad_json_line(plugins, write_jsonl):
    path = write_jsonl("lambada_test.jsonl", [{"text": "a b"}, "", '{"text": "a b",}'])
    message = one_line_error(plugins, "lambada", path)
    assert message.startswith(f"{path}:3: not a JSON line")
    array = write_jsonl("lambada_test.jsonl", ['["a b"]'])
    assert (
        one_line_error(plugins, "lambada", array) == f"{array}:1: expected a JSON object, got array"
    )


def test_line_separators_inside_json_strings_are_text(plugins, tmp_path):
    """JSON allows U+2028, U+2029 and U+0085 raw inside strings (json.dumps(ensure_ascii=False)
    writes them so); only newlines end a JSON line."""
    path = tmp_path / "lambada_test.jsonl"
    texts = ["left\u2028right word", "next\x85line of\u2029text", "last line"]
    lines = [json.dumps({"text": t}, ensure_ascii=False) for t in texts]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    items = task_items(plugins, "lambada", str(path))
    assert [i.choices[0] for i in items] == ["word", "of\u2029text", "line"]
    assert [i.where for i in items] == [f"{path}:{n}" for n in (1, 2, 3)]


def test_sciq_bad_record_in_the_array(plugins, tmp_path):
    path = tmp_path / "test.json"
    broken = [SCIQ_ROWS[0], {k: v for k, v in SCIQ_ROWS[1].items() if k != "distractor2"}]
    path.write_text(json.dumps(broken, indent=1))
    message = one_line_error(plugins, "sciq", str(path))
    assert message == f"{path}:10: field 'distractor2' is missing"


def test_arc_answer_key_not_among_labels(plugins, write_jsonl):
    path = write_jsonl("ARC-Easy-Test.jsonl", [arc_nested(), arc_nested("E")])
    assert one_line_error(plugins, "arc_easy", path) == (
        f"{path}:2: field 'answerKey': 'E' is not one of ['A', 'B', 'C', 'D']"
    )
    flat = write_jsonl("test.jsonl", [arc_flat("1")])
    assert "test.jsonl:1: field 'answerKey': '1' is not one of" in one_line_error(
        plugins, "arc_easy", flat
    )


def test_piqa_label_count_mismatch(plugins, write_jsonl, tmp_path):
    path = write_jsonl("valid.jsonl", PIQA_ROWS)
    labels = tmp_path / "valid-labels.lst"
    labels.write_text("0\n")
    message = one_line_error(plugins, "piqa", path)
    assert message == (
        f"{labels}: 1 labels for 2 questions in {path}; give the labels file of the same split "
        "(labels_path)"
    )
    labels.write_text("0\n2\n")
    assert one_line_error(plugins, "piqa", path) == (
        f"{labels}:2: field 'label': '2' is not the index of one of 2 choices"
    )
    labels.unlink()
    assert one_line_error(plugins, "piqa", path) == f"{labels}: no such task file; check the path"


def test_mmlu_csv_bad_rows(plugins, tmp_path):
    path = tmp_path / "anatomy_test.csv"
    path.write_text("q,a,b,c,d,A\nq,a,b,c,d,F\n")
    assert one_line_error(plugins, "mmlu", str(path)) == (
        f"{path}:2: field 'answer (last column)': 'F' is not the index of one of 4 choices"
    )
    path.write_text("q,a,b,c,d,A\n\nq,A\n")
    assert one_line_error(plugins, "mmlu", str(path)).startswith(
        f"{path}:3: expected question, at least two choices and the answer; got 2 columns"
    )


def test_missing_and_empty_files(plugins, tmp_path):
    missing = tmp_path / "nope.jsonl"
    assert one_line_error(plugins, "hellaswag", str(missing)) == (
        f"{missing}: no such task file; check the path"
    )
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    assert one_line_error(plugins, "lambada", str(empty)) == (
        f"{empty}: the file is empty; check the path or download it again"
    )
    # a file with no items for the task: an empty array of SciQ's layout
    array = tmp_path / "test.json"
    array.write_text("[\n]\n")
    assert one_line_error(plugins, "sciq", str(array)) == f"{array}: no items in the file (sciq)"


# --- choosing a task in config ------------------------------------------------------------------


def test_unknown_task_lists_and_suggests(plugins, tmp_path):
    with pytest.raises(ConfigError) as caught:
        structure({"kind": "helaswag", "path": str(tmp_path)}, Choice.of("task"), plugins=plugins)
    message = str(caught.value)
    assert "unknown task 'helaswag' (did you mean 'hellaswag'?)" in message
    known = message.split("known: ")[1].split(", ")
    assert sorted(known) == sorted(BUILTIN_TASKS)


@attrs.frozen
class EvalSection:
    task: Choice.of("task")  # type: ignore[valid-type]


@pytest.mark.parametrize(
    ("given", "problem"),
    [
        ({"shots": "two"}, "task.shots: expected int, got str 'two'"),
        ({"limit": 0}, "task.limit: must be at least 1, got 0"),
        ({"shots": -1}, "task.shots: must be at least 0, got -1"),
        ({"labels_path": 3}, "task.labels_path: expected str, got int 3"),
        ({"subject": "algebra"}, "task.subject"),  # piqa has no such option
    ],
)
def test_bad_options_name_the_config_path(plugins, given, problem):
    raw = {"task": {"kind": "piqa", "path": "valid.jsonl", **given}}
    with pytest.raises(ConfigError) as caught:
        structure(raw, EvalSection, plugins=plugins)
    assert problem in str(caught.value)
