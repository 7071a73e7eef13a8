"""Readers of the published file layouts of the built-in tasks, prompting each item the way
lm-evaluation-harness's task of the same name does (so scores are comparable with papers).

Each reader takes (path, options) and returns the task's items, zero-shot; `FileTask` adds
few-shot examples. Loading this module imports no torch.
"""

from __future__ import annotations

import re
from pathlib import PurePosixPath

import attrs
from fsspec.utils import infer_compression

from llmtrain.core_mesh.interfaces import TaskItem
from llmtrain.downstream.task_files import (
    TaskFileError,
    TaskOptions,
    answer_index,
    choices_of,
    csv_rows,
    field,
    json_lines,
    json_records,
    read_text,
)


def _hellaswag_text(text: str) -> str:
    # the bracketed tags are artifacts of HellaSwag's WikiHow part; the harness strips them
    text = text.strip().replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    return text.replace("  ", " ")


def hellaswag(path: str, options: TaskOptions) -> list[TaskItem]:
    """rowanz/hellaswag's `hellaswag_{train,val}.jsonl` (also the Hugging Face copy's rows):
    `activity_label`, `ctx_a`, `ctx_b`, four `endings`, `label`."""
    items = []
    for where, record in json_lines(path, options):
        ctx = (
            field(record, "ctx_a", str, where)
            + " "
            + field(record, "ctx_b", str, where).capitalize()
        )
        query = _hellaswag_text(field(record, "activity_label", str, where) + ": " + ctx)
        endings = choices_of(field(record, "endings", list, where), "endings", where)
        gold = answer_index(field(record, "label", (int, str), where), len(endings), "label", where)
        items.append(
            TaskItem((query,), tuple(_hellaswag_text(e) for e in endings), gold, where=where)
        )
    return items


def arc(path: str, options: TaskOptions) -> list[TaskItem]:
    """AI2's ARC-V1-Feb2018 `ARC-{Easy,Challenge}-{Train,Dev,Test}.jsonl` (`question.stem`,
    `question.choices[].text/label`, `answerKey`), or the Hugging Face copy's flat rows
    (`question`, `choices.text`, `choices.label`, `answerKey`)."""
    items = []
    for where, record in json_lines(path, options):
        question = field(record, "question", (str, dict), where)
        if isinstance(question, dict):
            stem = field(record, "question.stem", str, where)
            listed = field(record, "question.choices", list, where)
            if not listed:
                raise TaskFileError(f"{where}: field 'question.choices' must be a non-empty list")
            if not all(isinstance(c, dict) for c in listed):
                raise TaskFileError(f"{where}: field 'question.choices' must hold objects")
            texts = [
                field(record, f"question.choices.{i}.text", str, where) for i in range(len(listed))
            ]
            labels = [
                str(field(record, f"question.choices.{i}.label", (str, int), where))
                for i in range(len(listed))
            ]
        else:
            stem = question
            texts = list(
                choices_of(field(record, "choices.text", list, where), "choices.text", where)
            )
            labels = [str(x) for x in field(record, "choices.label", list, where)]
            if len(labels) != len(texts):
                raise TaskFileError(f"{where}: 'choices.label' and 'choices.text' differ in length")
        key = str(field(record, "answerKey", (str, int), where))
        if key not in labels:
            raise TaskFileError(f"{where}: field 'answerKey': {key!r} is not one of {labels}")
        items.append(
            TaskItem((f"Question: {stem}\nAnswer:",), tuple(texts), labels.index(key), where=where)
        )
    return items


@attrs.frozen(kw_only=True)
class PiqaOptions(TaskOptions):
    """PIQA keeps its labels in a file beside the questions: `labels_path` (default: the
    questions' path with `.jsonl` replaced by `-labels.lst`, as in `valid.jsonl` and
    `valid-labels.lst`); not needed when each record has a `label`. A `fewshot_path` file's
    labels are always the ones beside it."""

    labels_path: str | None = None


def piqa(path: str, options: TaskOptions) -> list[TaskItem]:
    """ybisk/piqa's `{train,valid}.jsonl` (`goal`, `sol1`, `sol2`) with `*-labels.lst` (one 0 or
    1 per line), or rows carrying their own `label` (the Hugging Face copy)."""
    records = list(json_lines(path, options))
    labels = None
    if records and "label" not in records[0][1]:
        labels_path, labels = _piqa_labels(path, options)
        if len(labels) != len(records):
            raise TaskFileError(
                f"{labels_path}: {len(labels)} labels for {len(records)} questions in {path}; "
                "give the labels file of the same split (labels_path)"
            )
    items = []
    for i, (where, record) in enumerate(records):
        goal = field(record, "goal", str, where)
        solutions = (field(record, "sol1", str, where), field(record, "sol2", str, where))
        label_where, label = (
            labels[i] if labels else (where, field(record, "label", (int, str), where))
        )
        gold = answer_index(label, 2, "label", label_where)
        items.append(TaskItem((f"Question: {goal}\nAnswer:",), solutions, gold, where=where))
    return items


def _piqa_labels(path: str, options: TaskOptions) -> tuple[str, list[tuple[str, str]]]:
    # labels_path belongs to `options.path`; a few-shot file's labels lie beside it
    labels_path = getattr(options, "labels_path", None) if path == options.path else None
    if labels_path is None:
        if not path.endswith(".jsonl"):
            raise TaskFileError(f"{path}: records have no 'label'; give labels_path")
        labels_path = path[: -len(".jsonl")] + "-labels.lst"
    text = read_text(labels_path, options)
    return labels_path, [
        (f"{labels_path}:{n}", line.strip())
        for n, line in enumerate(text.split("\n"), 1)
        if line.strip()
    ]


def winogrande(path: str, options: TaskOptions) -> list[TaskItem]:
    """allenai/winogrande's `{train_xl,dev}.jsonl` (`sentence` with one `_`, `option1`,
    `option2`, `answer` "1"/"2"). Scored as the harness does: the part after the blank is the
    one choice, after each option's context."""
    items = []
    for where, record in json_lines(path, options):
        sentence = field(record, "sentence", str, where)
        if "_" not in sentence:
            raise TaskFileError(f"{where}: field 'sentence' has no '_' blank")
        blank = sentence.index("_")
        options_ = (field(record, "option1", str, where), field(record, "option2", str, where))
        answer = field(record, "answer", (str, int), where)
        if str(answer).strip() not in ("1", "2"):
            raise TaskFileError(f"{where}: field 'answer': {answer!r} is not 1 or 2")
        gold = int(answer) - 1
        contexts = tuple(sentence[:blank] + option for option in options_)
        items.append(TaskItem(contexts, (sentence[blank + 1 :].strip(),), gold, where=where))
    return items


def lambada(path: str, options: TaskOptions) -> list[TaskItem]:
    """OpenAI's `lambada_test.jsonl` (`text`): predict the last word after the rest."""
    items = []
    for where, record in json_lines(path, options):
        words = field(record, "text", str, where).split(" ")
        if len(words) < 2:
            raise TaskFileError(f"{where}: field 'text' needs at least two words")
        items.append(TaskItem((" ".join(words[:-1]),), (words[-1],), where=where))
    return items


def sciq(path: str, options: TaskOptions) -> list[TaskItem]:
    """allenai/sciq's `{train,valid,test}.json` (one JSON array) or JSON lines: `support`,
    `question`, `distractor1..3`, `correct_answer` (the gold choice is the last)."""
    items = []
    for where, record in json_records(path, options):
        context = (
            f"{field(record, 'support', str, where).lstrip()}\n"
            f"Question: {field(record, 'question', str, where)}\nAnswer:"
        )
        names = ("distractor1", "distractor2", "distractor3", "correct_answer")
        choices = tuple(field(record, name, str, where) for name in names)
        items.append(TaskItem((context,), choices, 3, where=where))
    return items


@attrs.frozen(kw_only=True)
class MultipleChoiceOptions(TaskOptions):
    """`subject` fills MMLU's description line ("...questions (with answers) about {subject}.");
    default: taken from a `<subject>_test.csv` file name, else no description."""

    subject: str | None = None


LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


def _layout_name(path: str) -> PurePosixPath:
    """The file's name without a URL's query or a compression suffix (`x_test.csv.gz`)."""
    name = PurePosixPath(path.split("?")[0])
    return name.with_suffix("") if infer_compression(name.name) else name


def mmlu_prompt(question: str, choices: tuple[str, ...], gold: int, where: str) -> TaskItem:
    lines = [question.strip()] + [f"{LETTERS[i]}. {c}" for i, c in enumerate(choices)]
    context = "\n".join(lines) + "\nAnswer:"
    return TaskItem((context,), tuple(LETTERS[: len(choices)]), gold, where=where)


def mmlu(path: str, options: TaskOptions) -> list[TaskItem]:
    """hendrycks/test's `data/{dev,val,test}/<subject>_<split>.csv` (no header: question, the
    choices, the answer letter), or JSON lines of `question`, `choices` (a list) and `answer`
    (an index or a letter): the lettered prompt MMLU uses, scored on the answer letter."""
    items = []
    if _layout_name(path).suffix.lower() == ".csv":
        for where, row in csv_rows(path, options):
            if len(row) < 4:
                raise TaskFileError(
                    f"{where}: expected question, at least two choices and the answer; got "
                    f"{len(row)} columns"
                )
            choices = tuple(row[1:-1])
            if len(choices) > len(LETTERS):
                raise TaskFileError(f"{where}: more than {len(LETTERS)} choices")
            gold = answer_index(row[-1], len(choices), "answer (last column)", where)
            items.append(mmlu_prompt(row[0], choices, gold, where))
        return items
    for where, record in json_lines(path, options):
        choices = choices_of(field(record, "choices", list, where), "choices", where)
        gold = answer_index(
            field(record, "answer", (int, str), where), len(choices), "answer", where
        )
        items.append(mmlu_prompt(field(record, "question", str, where), choices, gold, where))
    return items


def mmlu_description(options: TaskOptions, path: str) -> str:
    subject = getattr(options, "subject", None)
    if subject is None:
        stem = _layout_name(path).stem
        match = re.fullmatch(r"(.+)_(dev|val|test)", stem)
        subject = match.group(1) if match else None
    if not subject:
        return ""
    return (
        "The following are multiple choice questions (with answers) about "
        f"{subject.replace('_', ' ')}.\n\n"
    )


@attrs.frozen(kw_only=True)
class DocumentOptions(TaskOptions):
    """`field`: the text field of a JSON-lines file (dotted for nested fields); a file with
    another suffix is read whole as one document."""

    field: str = "text"


def documents(path: str, options: TaskOptions) -> list[TaskItem]:
    """Documents for rolling perplexity: each line's `field` of a `.jsonl` file, or the whole
    file as one document."""
    name = getattr(options, "field", "text")
    suffix = "".join(PurePosixPath(path.split("?")[0]).suffixes).lower()
    if ".jsonl" in suffix or ".json" in suffix:
        return [
            TaskItem(("",), (field(record, name, str, where),), delimiter="", where=where)
            for where, record in json_lines(path, options)
        ]
    return [TaskItem(("",), (read_text(path, options),), delimiter="", where=f"{path}:1")]
