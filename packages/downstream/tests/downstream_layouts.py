"""Rows of the built-in tasks as their datasets publish them (the tests' valid task files), and
writers of the layouts that are not JSON lines. Imported by the tests (conftest.py puts this
folder on sys.path: pytest's importlib mode does not)."""

from __future__ import annotations

import csv

# rows as the datasets publish them (hellaswag_val.jsonl lines 1 and 2 in layout; the second is
# a WikiHow row with the bracketed tags the harness strips)
HELLASWAG_ROWS = [
    {
        "ind": 24,
        "activity_label": "Roof shingle removal",
        "ctx_a": "A man is sitting on a roof.",
        "ctx_b": "he",
        "ctx": "A man is sitting on a roof. he",
        "split": "val",
        "split_type": "indomain",
        "label": 3,
        "endings": [
            "is using wrap to wrap a pair of skis.",
            "is ripping level tiles off.",
            "is holding a rubik's cube.",
            "starts pulling up roofing on a roof.",
        ],
        "source_id": "activitynet~v_-JhWjGDPHMY",
    },
    {
        "ind": 4,
        "activity_label": "Home and Garden",
        "ctx_a": "[header] How to clean a grill [title] Turn the grill on high.",
        "ctx_b": "[step] LET it heat for 15 minutes.",
        "ctx": "[header] How to clean a grill [title] Turn the grill on high. [step] LET it heat.",
        "split": "val",
        "split_type": "zeroshot",
        "label": "0",
        "endings": [
            "[substeps] Scrub the grates with a brush.",
            "Pour water [title] on the coals.",
            "Walk away.",
            "Eat the grill.",
        ],
        "source_id": "wikihow~1234",
    },
]


ARC_STEM = "Which is the most likely effect of a faster rotation of a planet?"
ARC_TEXTS = [
    "Planetary density will decrease.",
    "Planetary years will become longer.",
    "Planetary days will become shorter.",
    "Planetary gravity will become stronger.",
]


def arc_nested(key: str = "C", labels: str = "ABCD", **changes) -> dict:
    return {
        "id": "Mercury_7175875",
        "question": {
            "stem": ARC_STEM,
            "choices": [{"text": t, "label": x} for t, x in zip(ARC_TEXTS, labels, strict=True)],
        },
        "answerKey": key,
        **changes,
    }


def arc_flat(key: str = "C", labels: str = "ABCD") -> dict:
    return {
        "id": "Mercury_7175875",
        "question": ARC_STEM,
        "choices": {"text": ARC_TEXTS, "label": list(labels)},
        "answerKey": key,
    }


PIQA_ROWS = [
    {
        "goal": "How do I ready a guinea pig cage for it's new occupants?",
        "sol1": "Provide the guinea pig with a cage full of bedding made of ripped paper strips.",
        "sol2": "Provide the guinea pig with a cage full of bedding made of ripped jeans material.",
    },
    {"goal": "dresser", "sol1": "replace drawer with bobby pin ", "sol2": "finish, woodgrain with"},
]


WINOGRANDE_ROWS = [
    {
        "qID": "3QHITW7OYO7Q6B6ISU2UMJB84ZLAQE-2",
        "sentence": "Sarah was a much better surgeon than Maria so _ always got the harder cases.",
        "option1": "Sarah",
        "option2": "Maria",
        "answer": "1",
    },
    {
        "qID": "3QHITW7OYO7Q6B6ISU2UMJB84ZLAQE-1",
        "sentence": "Sarah was a much better surgeon than Maria so _ always got the easier cases.",
        "option1": "Sarah",
        "option2": "Maria",
        "answer": "2",
    },
]


LAMBADA_TEXT = (
    "In my palm is a clear stone, and inside it is a small ivory statuette. A guardian angel.\n\n"
    "\"Figured if you're going to be out at night getting hit by cars, you might as well have "
    'some backup."\n\nI look at him, feeling stunned. But as I stare at Harlin, his mouth '
    "curved in a confident grin, I don't care about signs"
)


SCIQ_ROWS = [
    {
        "question": "What type of organism is commonly used in preparation of foods such as "
        "cheese and yogurt?",
        "distractor3": "viruses",
        "distractor1": "protozoa",
        "distractor2": "gymnosperms",
        "correct_answer": "mesophilic organisms",
        "support": "  Mesophiles grow best in moderate temperature.",
    },
    {
        "question": "What is the least dangerous radioactive decay?",
        "distractor3": "zeta decay",
        "distractor1": "beta decay",
        "distractor2": "gamma decay",
        "correct_answer": "alpha decay",
        "support": "",
    },
]


MMLU_ROWS = [
    ["Find the degree for the given field extension Q(sqrt(2), sqrt(3)) over Q.", "0", "4", "2", "6", "B"],
    ["Let p = (1, 2, 5, 4)(2, 3) in S_5.\nFind the index of <p> in S_5.", "8", "2", "24", "120", "C"],
    ["Statement 1 | A factor group of a non-Abelian group is non-Abelian.", "True, True", "False, False", "True, False", "False, True", "d"],
]  # fmt: skip


def write_mmlu_csv(path) -> str:
    with open(path, "w", newline="", encoding="utf-8") as f:
        csv.writer(f).writerows(MMLU_ROWS)
    return str(path)
