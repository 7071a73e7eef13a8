"""downstream's plugin (entry point `downstream`): the built-in tasks, kind `task`. Loading it
imports no torch."""

from __future__ import annotations

import functools

from llmtrain.core_mesh.plugins import Register, hookimpl
from llmtrain.downstream import formats
from llmtrain.downstream.task_files import FileTask, Reader, TaskOptions

# name: (reader, scoring, options class, help)
BUILTIN_TASKS: dict[str, tuple[Reader, str, type, str]] = {
    "hellaswag": (
        formats.hellaswag,
        "multiple_choice",
        TaskOptions,
        "HellaSwag (hellaswag_val.jsonl)",
    ),
    "arc_easy": (formats.arc, "multiple_choice", TaskOptions, "ARC-Easy (ARC-Easy-Test.jsonl)"),
    "arc_challenge": (
        formats.arc,
        "multiple_choice",
        TaskOptions,
        "ARC-Challenge (ARC-Challenge-Test.jsonl)",
    ),
    "piqa": (
        formats.piqa,
        "multiple_choice",
        formats.PiqaOptions,
        "PIQA (valid.jsonl + valid-labels.lst)",
    ),
    "winogrande": (
        formats.winogrande,
        "multiple_choice",
        TaskOptions,
        "Winogrande (dev.jsonl), partial scoring",
    ),
    "sciq": (formats.sciq, "multiple_choice", TaskOptions, "SciQ (test.json)"),
    "mmlu": (
        formats.mmlu,
        "multiple_choice",
        formats.MultipleChoiceOptions,
        "MMLU-style lettered multiple choice (<subject>_test.csv or JSON lines)",
    ),
    "lambada": (
        formats.lambada,
        "cloze",
        TaskOptions,
        "LAMBADA last-word accuracy (lambada_test.jsonl)",
    ),
    "perplexity": (
        formats.documents,
        "perplexity",
        formats.DocumentOptions,
        "rolling perplexity and bits per byte of documents (JSON lines or a text file)",
    ),
}


def build_task(name: str, reader: Reader, scoring: str, options: TaskOptions) -> FileTask:
    if reader is formats.mmlu:
        description = formats.mmlu_description(options, options.path)
        return FileTask(name, scoring, options, reader, description, first_examples=True)
    return FileTask(name, scoring, options, reader)


@hookimpl
def llmtrain_tasks(register: Register) -> None:
    for name, (reader, scoring, options, help_) in BUILTIN_TASKS.items():
        register(
            name,
            functools.partial(build_task, name, reader, scoring),
            options=options,
            help=help_,
        )
