"""Every bad task file is one clear line naming the file (and file:line for a record), never a
traceback: a table of cases generated from valid files in each published layout
(downstream_layouts.py), each damaged one way (missing, a directory, empty, binary, compressed
without its suffix, Parquet, other JSON, truncated at random points, bytes flipped at random, a
field deleted or of another type, labels out of range, empty choice lists, a sentence without
its blank, a lone surrogate, a compressed file cut short), and variants that are no damage
(extra fields, CRLF, a byte order mark, blank lines, other key orders, compression, unusual but
valid labels), which must load. A sample of the damaged cases goes through `llmtrain eval-tasks`
(exit 2, the same one line on stderr); S3 cases run on a moto server."""

from __future__ import annotations

import bz2
import copy
import csv
import gzip
import io
import json
import lzma
import random
import re
import socket
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import pytest
from downstream_layouts import (
    HELLASWAG_ROWS,
    LAMBADA_TEXT,
    MMLU_ROWS,
    PIQA_ROWS,
    SCIQ_ROWS,
    WINOGRANDE_ROWS,
    arc_flat,
    arc_nested,
)
from shared_fixtures import moto_endpoint  # noqa: F401 - the session's S3 server (moto)

from llmtrain.core_mesh.config import Choice, structure
from llmtrain.core_mesh.errors import UserError
from llmtrain.core_mesh.interfaces import TaskItem
from llmtrain.core_mesh.plugins import PluginManager

# --- the valid files -------------------------------------------------------------------------


@attrs.frozen
class Layout:
    """A valid task file in one published layout. `form`: how `records` are written (`jsonl`,
    `array`: one JSON array, `csv`, `text`: one document); `fields`: what each record needs, as
    (dotted name, the types `field` names in its message); `side`: files beside it."""

    name: str
    kind: str
    filename: str
    form: str
    records: tuple[Any, ...]
    fields: tuple[tuple[str, str], ...] = ()
    side: tuple[tuple[str, bytes], ...] = ()

    def encode(self, records: Sequence[Any] | None = None) -> bytes:
        records = self.records if records is None else records
        if self.form == "jsonl":
            return "".join(json.dumps(r) + "\n" for r in records).encode()
        if self.form == "array":
            return json.dumps(list(records), indent=1).encode()
        if self.form == "csv":
            out = io.StringIO()
            csv.writer(out).writerows(records)
            return out.getvalue().encode()
        return "".join(records).encode()

    def line_of(self, index: int) -> int:
        """The line record `index` starts on (what its errors name)."""
        if self.form == "array":
            lines = self.encode().decode().split("\n")
            return [n for n, line in enumerate(lines, 1) if line == " {"][index]
        return self.encode(self.records[:index]).count(b"\n") + 1


STR, LABEL, LIST = "str", "int/str", "list"
LAYOUTS = [
    Layout(
        "hellaswag",
        "hellaswag",
        "hellaswag_val.jsonl",
        "jsonl",
        tuple(HELLASWAG_ROWS),
        (
            ("activity_label", STR),
            ("ctx_a", STR),
            ("ctx_b", STR),
            ("endings", LIST),
            ("label", LABEL),
        ),
    ),
    Layout(
        "arc-nested",
        "arc_easy",
        "ARC-Easy-Test.jsonl",
        "jsonl",
        (arc_nested(), arc_nested("3", "1234")),
        (
            ("question", "str/dict"),
            ("question.stem", STR),
            ("question.choices", LIST),
            ("answerKey", "str/int"),
        ),
    ),
    Layout(
        "arc-flat",
        "arc_challenge",
        "ARC-Challenge-Test.jsonl",
        "jsonl",
        (arc_flat("B"), arc_flat("4", "1234")),
        (
            ("question", "str/dict"),
            ("choices.text", LIST),
            ("choices.label", LIST),
            ("answerKey", "str/int"),
        ),
    ),
    Layout(
        "piqa",
        "piqa",
        "valid.jsonl",
        "jsonl",
        tuple(PIQA_ROWS),
        (("goal", STR), ("sol1", STR), ("sol2", STR)),
        side=(("valid-labels.lst", b"0\n1\n"),),
    ),
    Layout(
        "piqa-hf",
        "piqa",
        "train.jsonl",
        "jsonl",
        ({**PIQA_ROWS[0], "label": 0}, {**PIQA_ROWS[1], "label": 1}),
        (("goal", STR), ("sol1", STR), ("sol2", STR), ("label", LABEL)),
    ),
    Layout(
        "winogrande",
        "winogrande",
        "dev.jsonl",
        "jsonl",
        tuple(WINOGRANDE_ROWS),
        (("sentence", STR), ("option1", STR), ("option2", STR), ("answer", "str/int")),
    ),
    Layout(
        "lambada",
        "lambada",
        "lambada_test.jsonl",
        "jsonl",
        ({"text": LAMBADA_TEXT}, {"text": "two words"}),
        (("text", STR),),
    ),
    Layout(
        "sciq-array",
        "sciq",
        "test.json",
        "array",
        tuple(SCIQ_ROWS),
        tuple((name, STR) for name in SCIQ_ROWS[0]),
    ),
    Layout(
        "sciq-jsonl",
        "sciq",
        "valid.jsonl",
        "jsonl",
        tuple(SCIQ_ROWS),
        tuple((name, STR) for name in SCIQ_ROWS[0]),
    ),
    Layout(
        "mmlu-csv", "mmlu", "abstract_algebra_test.csv", "csv", tuple(tuple(r) for r in MMLU_ROWS)
    ),
    Layout(
        "mmlu-jsonl",
        "mmlu",
        "questions.jsonl",
        "jsonl",
        (
            {"question": "What is 2 + 2?", "choices": ["3", "4", "5"], "answer": 1},
            {"question": "Pick E.", "choices": list("abcde"), "answer": "E"},
        ),
        (("question", STR), ("choices", LIST), ("answer", LABEL)),
    ),
    Layout(
        "perplexity-jsonl",
        "perplexity",
        "docs.jsonl",
        "jsonl",
        ({"text": "one doc"}, {"text": LAMBADA_TEXT}),
        (("text", STR),),
    ),
    Layout("perplexity-text", "perplexity", "book.txt", "text", (LAMBADA_TEXT,)),
]

# --- what a case expects ---------------------------------------------------------------------

ANY_LINE = -1  # the message names the file, with a line or without
NO_LINE = 0  # the message names the file alone


@attrs.frozen
class Expect:
    """`loads`: the file must load (`same`: to the valid file's items; `gold`: an item's gold).
    Else refused: one line naming `file` (relative to the case's folder) at `line` (one of
    `lines`, `NO_LINE` or `ANY_LINE`), saying `says` (the whole rest of the line when `exact`).
    `either`: random damage, which may leave a valid file: loads, or is refused as described
    (naming `file` or one of its `siblings`)."""

    loads: bool = False
    same: bool = False
    gold: tuple[int, int] | None = None  # (item, its gold)
    file: str = ""
    siblings: tuple[str, ...] = ()  # other files the message may name instead
    lines: tuple[int, ...] = (ANY_LINE,)
    says: str = ""
    exact: bool = False
    either: bool = False


@attrs.frozen
class Case:
    id: str
    kind: str
    path: str  # the task file, relative to the case's folder
    files: tuple[tuple[str, bytes | None], ...]  # None: a directory
    expect: Expect
    valid: Layout


def refused(file: str, line: int, says: str, *, exact: bool = True) -> Expect:
    return Expect(file=file, lines=(line,), says=says, exact=exact)


def loads(*, same: bool = True, gold: tuple[int, int] | None = None) -> Expect:
    return Expect(loads=True, same=same, gold=gold)


# --- damage ------------------------------------------------------------------------------------


def with_value(record: dict, dotted: str, value: Any = None, *, delete: bool = False) -> dict:
    record = copy.deepcopy(record)
    *parents, last = dotted.split(".")
    inner = record
    for part in parents:
        inner = inner[part]
    if delete:
        del inner[last]
    else:
        inner[last] = value
    return record


WRONG_VALUES = [None, 7, 1.5, "text", [], {}, True]
TYPES = {"str": str, "int": int, "list": list, "dict": dict}


def wrong_values(names: str) -> list[Any]:
    """Values `field` refuses for a field of these types (a bool is no int for it)."""
    kinds = tuple(TYPES[n] for n in names.split("/"))
    return [v for v in WRONG_VALUES if isinstance(v, bool) or not isinstance(v, kinds)]


# record 1 (the second) set to a value the task cannot use: (field, value, what the line says)
BAD_VALUES: dict[str, list[tuple[str, Any, str]]] = {
    "hellaswag": [
        ("label", v, f"field 'label': {v!r:.60} is not the index of one of 4 choices")
        for v in [
            4,
            -1,
            "9",
            "",
            " ",
            "x1",
            "E",
            "\u00b2",
            "\u00df",
            10**30,
            "-1",
            "\u0663",
            "9" * 5000,
        ]
    ]
    + [
        ("endings", [], "field 'endings' must be a non-empty list of choices"),
        ("endings", ["a", 2, "c", "d"], "field 'endings': every choice must be text, got 2"),
        ("endings", [None], "field 'endings': every choice must be text, got None"),
        (
            "ctx_a",
            "\ud800 x",
            "'\\ud800' is half a surrogate pair, not a character; fix the record's \\u escapes",
        ),
    ],
    "arc-nested": [
        ("answerKey", v, f"field 'answerKey': {str(v)!r} is not one of ['1', '2', '3', '4']")
        for v in ["5", "A", 0, "", "C"]
    ]
    + [
        ("question.choices", [], "field 'question.choices' must be a non-empty list"),
        ("question.choices", ["A"], "field 'question.choices' must hold objects"),
        ("question.choices", [{"text": "t"}], "field 'question.choices.0.label' is missing"),
        ("question.choices", [{"label": "1"}], "field 'question.choices.0.text' is missing"),
        (
            "question.choices",
            [{"text": 3, "label": "1"}],
            "field 'question.choices.0.text' must be str, got 3",
        ),
    ],
    "arc-flat": [
        ("answerKey", v, f"field 'answerKey': {str(v)!r} is not one of ['1', '2', '3', '4']")
        for v in ["5", "D", 9]
    ]
    + [
        ("choices.text", [], "field 'choices.text' must be a non-empty list of choices"),
        ("choices.label", ["1"], "'choices.label' and 'choices.text' differ in length"),
    ],
    "piqa-hf": [
        ("label", v, f"field 'label': {v!r} is not the index of one of 2 choices")
        for v in [2, "2", -1, "x"]
    ],
    "winogrande": [
        ("answer", v, f"field 'answer': {v!r} is not 1 or 2")
        for v in ["0", "3", "B", "", 3, "1.0", 0]
    ]
    + [("sentence", "no blank in this one.", "field 'sentence' has no '_' blank")],
    "lambada": [
        ("text", "one", "field 'text' needs at least two words"),
        ("text", "", "field 'text' needs at least two words"),
        (
            "text",
            "a \udc00",
            "'\\udc00' is half a surrogate pair, not a character; fix the record's \\u escapes",
        ),
    ],
    "mmlu-jsonl": [
        ("answer", v, f"field 'answer': {v!r} is not the index of one of 5 choices")
        for v in [5, "F", "\u00b2", -1, "\u1e9e"]
    ]
    + [
        ("choices", [], "field 'choices' must be a non-empty list of choices"),
        ("choices", ["a", None], "field 'choices': every choice must be text, got None"),
    ],
}
# unusual but valid values of record 1: (field, value, the gold they give)
ODD_BUT_VALID: dict[str, list[tuple[str, Any, int | None]]] = {
    "hellaswag": [("label", "3", 3), ("label", " 2 ", 2), ("label", "d", 3), ("ctx_b", "", 0)],
    "arc-nested": [("answerKey", 2, 1), ("answerKey", "4", 3)],
    "piqa-hf": [("label", "0", 0), ("label", "B", 1)],
    "winogrande": [("answer", 2, 1), ("answer", " 1 ", 0)],
    "mmlu-jsonl": [("answer", "e", 4), ("answer", 4, 4), ("answer", "4", 4)],
    "lambada": [("text", "line\u2028separator and\u0085more words", None)],
}


def file_cases(layout: Layout, data: bytes) -> Iterator[tuple[str, Any, Expect]]:
    """(id, the task file's content or None for a directory or "missing", expectation)."""
    f = layout.filename
    yield "missing", "missing", refused(f, NO_LINE, "no such task file; check the path")
    yield "directory", None, refused(f, NO_LINE, "is a directory; give the task file in it")
    empty = "the file is empty; check the path or download it again"
    yield "empty", b"", refused(f, NO_LINE, empty)
    yield "blank", b"\n \n\t\r\n", refused(f, NO_LINE, empty)
    rng = random.Random(f"garbage {layout.name}")
    binary = bytes(rng.randrange(256) for _ in range(300))
    yield "binary", b"\xff" + binary, refused(f, 1, "not UTF-8 text (byte 0); task files are UTF-8")
    high = bytes(rng.randrange(0x80, 0x100) for _ in range(200))
    yield "not-utf8", b"ab\ncd\n" + high, refused(f, 3, "not UTF-8 text", exact=False)
    nul = "a NUL byte: binary data, not task text; check the path"
    yield "nul", data[:20] + b"\n\n\0" + data, refused(f, data.count(b"\n", 0, 20) + 3, nul)
    gz_name = "gzip-compressed data without a .gz suffix: name the file *.gz"
    yield "gzip-no-suffix", gzip.compress(data), refused(f, NO_LINE, gz_name)
    parquet = "a Parquet file, which tasks do not read: export its rows as JSON lines"
    yield "parquet", b"PAR1" + binary + b"PAR1", refused(f, NO_LINE, parquet)
    # other JSON than the layout's
    for name, doc in [
        ("json-object", json.dumps({"data": list(layout.records)}, indent=2)),
        ("json-array", json.dumps(list(layout.records))),
        ("json-string", json.dumps("text")),
        ("json-null", "null"),
        ("json-number", "42"),
        ("json-empty-array", "[]"),
    ]:
        yield name, doc.encode(), other_json(layout, name, doc)


def other_json(layout: Layout, name: str, doc: str) -> Expect:
    f = layout.filename
    if layout.form == "text":
        return loads(same=False)
    if layout.form == "csv":
        return refused(f, 1, "", exact=False)
    if layout.kind == "sciq" and name == "json-array":
        return loads()  # the array layout of the same rows
    if layout.kind == "sciq" and name == "json-empty-array":
        return refused(f, NO_LINE, "no items in the file (sciq)")
    if name == "json-object":
        return refused(
            f, 1, "; the file is one JSON object, not JSON lines (one object a line)", exact=False
        )
    got = {"json-string": "string", "json-null": "null", "json-number": "number"}
    return refused(f, 1, f"expected a JSON object, got {got.get(name, 'array')}")


def record_cases(layout: Layout) -> Iterator[tuple[str, bytes, Expect]]:
    """Record 1 damaged: a field deleted, of another type, or of a value the task cannot use."""
    f, records, line = layout.filename, list(layout.records), layout.line_of(1)

    def damaged(record: dict) -> bytes:
        return layout.encode([records[0], record, *records[2:]])

    seen: set[str] = set()
    for k, (name, types) in enumerate(layout.fields):
        gone = with_value(records[1], name, delete=True)
        yield f"no-{name}", damaged(gone), refused(f, line, f"field {name!r} is missing")
        # every wrong type for the first field of each type, two (in turn) for the others
        values = wrong_values(types)
        if types in seen:
            values = [values[k % len(values)], values[(k + 1) % len(values)]]
        seen.add(types)
        for value in values:
            says = f"field {name!r} must be {types}, got {value!r:.60}"
            yield (
                f"{name}={value!r}",
                damaged(with_value(records[1], name, value)),
                refused(f, line, says),
            )
    for name, value, says in BAD_VALUES.get(layout.name, []):
        yield (
            f"{name}={value!r:.20}",
            damaged(with_value(records[1], name, value)),
            refused(f, line, says),
        )
    for name, value, gold in ODD_BUT_VALID.get(layout.name, []):
        yield (
            f"valid-{name}={value!r}",
            damaged(with_value(records[1], name, value)),
            loads(same=False, gold=None if gold is None else (1, gold)),
        )
    if layout.form == "jsonl":
        for name, text, says in [
            ("line-array", "[1, 2]", "expected a JSON object, got array"),
            ("line-string", '"text"', "expected a JSON object, got string"),
            ("line-null", "null", "expected a JSON object, got null"),
            (
                "line-comma",
                '{"a": 1,}',
                "not a JSON line: Expecting property name enclosed in double quotes (column 9)",
            ),
            ("line-garbage", "garbage", "not a JSON line: Expecting value (column 1)"),
            ("line-deep", "[" * 100_000, "not a JSON line: nested too deeply"),
            (
                "line-long-number",
                '{"n": ' + "9" * 5000 + "}",
                "not a JSON line: a number too long to read",
            ),
        ]:
            data = layout.encode(records[:1]) + text.encode() + b"\n"
            yield name, data, refused(f, 2, says)


def csv_cases(layout: Layout) -> Iterator[tuple[str, bytes, Expect]]:
    """MMLU's CSV: its last row (line 4) damaged."""
    f, rows = layout.filename, [list(r) for r in layout.records]
    last = rows[-1]

    def damaged(row: list[str]) -> bytes:
        return layout.encode([*rows[:-1], row])

    for answer in ["F", "Z", "", "4", "\u00b2", "-1", "9" * 5000]:
        says = f"field 'answer (last column)': {answer!r:.60} is not the index of one of 4 choices"
        yield f"answer={answer!r}", damaged([*last[:-1], answer]), refused(f, 4, says)
    shape = "expected question, at least two choices and the answer; got {} columns"
    yield "columns-3", damaged(last[:3]), refused(f, 4, shape.format(3))
    yield "columns-1", damaged(last[:1]), refused(f, 4, shape.format(1))
    says = "field 'answer (last column)': 'False, True' is not the index of one of 3 choices"
    yield "no-answer-column", damaged(last[:-1]), refused(f, 4, says)
    yield "27-choices", damaged([last[0], *"x" * 27, "A"]), refused(f, 4, "more than 26 choices")
    yield (
        "nul-in-field",
        damaged([last[0] + "\0", *last[1:]]),
        refused(f, 4, "a NUL byte", exact=False),
    )
    huge = damaged(["q" * 200_000, *last[1:]])
    yield "huge-field", huge, refused(f, 4, "not CSV: field larger than field limit (131072)")
    yield "valid-lowercase", damaged([*last[:-1], "b"]), loads(same=False, gold=(2, 1))
    yield "valid-more-choices", damaged([*last[:-1], "e", "E"]), loads(same=False, gold=(2, 4))


def array_cases(layout: Layout) -> Iterator[tuple[str, bytes, Expect]]:
    f, text = layout.filename, layout.encode().decode()
    cut = "the JSON array is not closed: truncated? download it again"
    yield "array-open", b"[", refused(f, 1, cut)
    yield "array-no-close", text.removesuffix("]").encode(), refused(f, ANY_LINE, cut)
    after = "more text after the JSON array"
    yield "array-trailing", (text + "\nmore").encode(), refused(f, ANY_LINE, after)
    yield "array-numbers", b"[1, 2]", refused(f, 1, "expected a JSON object, got number")
    yield "valid-compact", json.dumps(list(layout.records)).encode(), loads()
    yield "valid-trailing-space", (text + "\n\n  ").encode(), loads()


def random_cases(layout: Layout, data: bytes) -> Iterator[tuple[str, bytes, Expect]]:
    """Cut at random points inside a record, bytes flipped at random (seeded by the layout)."""
    f, rng = layout.filename, random.Random(f"damage {layout.name}")
    # PIQA rows without their own label (a flip in the key) need the labels file beside them
    siblings = (f.replace(".jsonl", "-labels.lst"),) if layout.kind == "piqa" else ()
    inside = [
        p
        for p in range(1, len(data))
        if data[p - 1 : p] not in (b"\n", b"\r") and data[p : p + 1] not in (b"\n", b"\r")
    ]
    for p in sorted(rng.sample(inside, 6)):
        line = data.count(b"\n", 0, p) + 1
        if layout.form == "jsonl":
            says = "; the file ends inside this record: truncated? download it again"
            expect = refused(f, line, says, exact=False)
        elif layout.form == "array":
            expect = refused(f, ANY_LINE, "truncated?", exact=False)
        elif layout.form == "csv":  # a cut row may still be a row ("120" -> "1")
            expect = Expect(file=f, either=True)
        else:  # any prefix of a document is a document
            expect = loads(same=False)
        yield f"cut-{p}", data[:p], expect
    for p in sorted(rng.sample(range(len(data)), 8)):
        flipped = bytearray(data)
        flipped[p] = (flipped[p] + rng.randrange(1, 256)) % 256
        line = data.count(b"\n", 0, p) + 1
        # a record that fails is the one the byte was in, or the next when it became a newline
        lines = (line, line + 1) if layout.form == "jsonl" else (ANY_LINE,)
        expect = Expect(file=f, siblings=siblings, lines=lines, either=True)
        yield f"flip-{p}", bytes(flipped), expect


def compressed_cases(layout: Layout, data: bytes) -> Iterator[tuple[str, str, bytes, Expect]]:
    """(id, suffix, content, expectation): compressed copies load; cut short or flipped, not."""
    for suffix, compress in [
        (".gz", gzip.compress),
        (".bz2", bz2.compress),
        (".xz", lzma.compress),
        (".zst", _zstd),
    ]:
        if compress is None:
            continue
        packed = compress(data)
        name = suffix.lstrip(".")
        yield f"valid-{name}", suffix, packed, loads()
        short = "not complete {} data"
        kind = {"gz": "gzip", "zst": "zstd"}.get(name, name)
        cut = refused(layout.filename + suffix, NO_LINE, short.format(kind), exact=False)
        yield f"{name}-cut", suffix, packed[: len(packed) * 2 // 3], cut
        if suffix == ".gz":
            rng = random.Random(f"gz {layout.name}")
            for p in sorted(rng.sample(range(10, len(packed)), 3)):
                flipped = bytearray(packed)
                flipped[p] ^= 0x55
                either = Expect(file=layout.filename + suffix, either=True)
                yield f"gz-flip-{p}", suffix, bytes(flipped), either


try:
    import zstandard

    def _zstd(data: bytes) -> bytes:
        return zstandard.ZstdCompressor().compress(data)

except ImportError:  # fsspec reads .zst only with a zstd module
    _zstd = None  # type: ignore[assignment]


def variant_cases(layout: Layout, data: bytes) -> Iterator[tuple[str, bytes, Expect]]:
    """No damage: the same items."""
    text = data.decode()
    # CRLF inside a quoted CSV field or a document is text, kept as it is
    crlf = text.replace("\n", "\r\n").encode()
    yield "valid-crlf", crlf, loads(same=layout.form not in ("text", "csv"))
    yield "valid-bom", b"\xef\xbb\xbf" + data, loads()
    if layout.form == "text":  # text that begins as a binary format does is still text
        for magic in ("PAR1", "BZh91AY&SY", "PK"):
            yield f"valid-begins-{magic}", (magic + " " + text).encode(), loads(same=False)
    if layout.form == "jsonl":
        yield "valid-blank-lines", ("\n \n" + text.replace("\n", "\n\n  \n")).encode(), loads()
        yield "valid-no-final-newline", text.rstrip("\n").encode(), loads()
    if layout.form in ("jsonl", "array"):
        extra = [
            {
                **dict(reversed(r.items())),
                "extra": {"nested": [1, None, "x"]},
                "score": float("nan"),
            }
            for r in layout.records
        ]
        yield "valid-extra-fields-reordered", layout.encode(extra), loads()


def side_cases(layout: Layout) -> Iterator[tuple[str, str, bytes | None, Expect]]:
    """PIQA's labels file beside the questions, damaged: (id, its name, content, expectation)."""
    for name, content in layout.side:
        count = (
            "{} labels for 2 questions in {}; give the labels file of the same split (labels_path)"
        )
        yield (
            "labels-missing",
            name,
            "missing",
            refused(name, NO_LINE, "no such task file; check the path"),
        )
        yield (
            "labels-empty",
            name,
            b"",
            refused(name, NO_LINE, "the file is empty; check the path or download it again"),
        )
        yield "labels-short", name, content[:2], refused(name, NO_LINE, count.format(1, "{path}"))
        yield (
            "labels-long",
            name,
            content + b"1\n",
            refused(name, NO_LINE, count.format(3, "{path}")),
        )
        for bad in ["2", "-1", "x", "\u00b2"]:
            says = f"field 'label': {bad!r} is not the index of one of 2 choices"
            yield f"labels-{bad}", name, f"0\n{bad}\n".encode(), refused(name, 2, says)
        yield (
            "labels-binary",
            name,
            b"0\n\xff\xfe\n",
            refused(name, 2, "not UTF-8 text", exact=False),
        )
        yield "valid-labels-crlf", name, b"0\r\n1\r\n", loads()


def layout_case(
    layout: Layout, id_: str, content: Any, expect: Expect, path: str | None = None
) -> Case:
    """A case of the task file `path` (default: the layout's name) holding `content` (None: a
    directory; "missing": no file), with the layout's side files as they are."""
    path = path or layout.filename
    files = layout.side if content == "missing" else ((path, content), *layout.side)
    return Case(f"{layout.name}:{id_}", layout.kind, path, files, expect, layout)


def build_cases() -> list[Case]:
    cases = []
    for layout in LAYOUTS:
        data = layout.encode()
        generated = [
            *file_cases(layout, data),
            *random_cases(layout, data),
            *variant_cases(layout, data),
            *(record_cases(layout) if layout.fields else ()),
            *(csv_cases(layout) if layout.form == "csv" else ()),
            *(array_cases(layout) if layout.form == "array" else ()),
        ]
        cases.append(layout_case(layout, "valid", data, loads()))
        cases += [layout_case(layout, *case) for case in generated]
        if not layout.side:  # PIQA's labels lie beside `valid.jsonl`, not `valid.jsonl.gz`
            for id_, suffix, content, expect in compressed_cases(layout, data):
                cases.append(layout_case(layout, id_, content, expect, layout.filename + suffix))
        for id_, name, content, expect in side_cases(layout):
            files = ((layout.filename, data), *((n, c) for n, c in layout.side if n != name))
            if content != "missing":
                files = (*files, (name, content))
            case_id = f"{layout.name}:{id_}"
            cases.append(Case(case_id, layout.kind, layout.filename, files, expect, layout))
    return cases


CASES = build_cases()

# --- checking a case ---------------------------------------------------------------------------


def task_items(plugins: PluginManager, kind: str, path: str) -> list[TaskItem]:
    choice = structure({"kind": kind, "path": path}, Choice.of("task"), plugins=plugins)
    return list(plugins.build("task", choice).items())


def lay_out(case: Case, folder: Path) -> Path:
    folder.mkdir()
    for name, content in case.files:
        if content is None:
            (folder / name).mkdir()
        else:
            (folder / name).write_bytes(content)
    return folder


def outcome(plugins: PluginManager, case: Case, folder: Path) -> list[TaskItem] | UserError:
    """The items, or the UserError; anything else raised fails the test with its traceback."""
    try:
        return task_items(plugins, case.kind, str(folder / case.path))
    except UserError as exc:
        return exc


def check_refusal(message: str, expect: Expect, folder: Path) -> None:
    assert "\n" not in message and "\r" not in message, message
    assert "Traceback" not in message and "this is a bug" not in message, message
    named = [str(folder / f) for f in (expect.file, *expect.siblings)]
    pattern = "|".join(re.escape(n) for n in named)
    line = re.match(rf"(?:{pattern})(?::(\d+))?: ", message)
    assert line, f"does not start with {named}: {message}"
    number = int(line.group(1)) if line.group(1) else NO_LINE
    if ANY_LINE not in expect.lines and line.group(0).startswith(named[0] + ":"):
        assert number in expect.lines, (number, expect.lines, message)
    says = expect.says.replace("{path}", str(folder / "valid.jsonl"))
    rest = message[line.end() :]
    if expect.exact:
        assert rest == says, message
    else:
        assert says in message, message


def valid_items(plugins: PluginManager, layout: Layout, root: Path) -> list[TaskItem]:
    folder = root / f"valid-{layout.name}"
    if not folder.exists():
        folder.mkdir()
        (folder / layout.filename).write_bytes(layout.encode())
        for name, content in layout.side:
            (folder / name).write_bytes(content)
    return task_items(plugins, layout.kind, str(folder / layout.filename))


def prompts(items: Sequence[TaskItem]) -> list[tuple[Any, ...]]:
    return [(i.contexts, i.choices, i.gold, i.delimiter) for i in items]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("task-files")


def test_the_table_is_large_and_covers_every_layout():
    assert len(CASES) > 300
    assert {c.valid.name for c in CASES} == {layout.name for layout in LAYOUTS}
    assert len({c.id for c in CASES}) == len(CASES)
    refusals = [c for c in CASES if not c.expect.loads and not c.expect.either]
    assert len(refusals) > 200


def check_case(plugins: PluginManager, case: Case, root: Path) -> None:
    folder = lay_out(case, root / str(CASES.index(case)))
    result = outcome(plugins, case, folder)
    expect = case.expect
    if isinstance(result, UserError):
        assert not expect.loads, f"a valid file was refused: {result}"
        check_refusal(str(result), expect, folder)
        return
    assert expect.loads or expect.either, f"loaded {len(result)} items; expected a refusal"
    assert result, "no items and no error"
    if expect.same:
        assert prompts(result) == prompts(valid_items(plugins, case.valid, root))
    if expect.gold is not None:
        index, gold = expect.gold
        assert result[index].gold == gold


# one test per layout, each running all of its cases (one pytest item per case costs more than
# the case) and reporting every case that fails, by id; `-k` picks layouts
@pytest.mark.parametrize("layout", LAYOUTS, ids=[layout.name for layout in LAYOUTS])
def test_bad_task_files(plugins, root, layout):
    failures = []
    cases = [c for c in CASES if c.valid is layout]
    for case in cases:
        try:
            check_case(plugins, case, root)
        except AssertionError as exc:
            failures.append(f"{case.id}: {exc}")
        except Exception:  # not a UserError: what this test is for
            failures.append(f"{case.id}: raised\n{traceback.format_exc()}")
    assert not failures, f"{len(failures)} of {len(cases)} cases failed:\n" + "\n".join(failures)


# --- through the command line ------------------------------------------------------------------

CLI_SAMPLE = [c for c in CASES if not c.expect.loads and not c.expect.either][::20]


@pytest.fixture(scope="module")
def eval_tasks(plugins: PluginManager) -> Callable[..., tuple[int, str, str]]:
    if "eval-tasks" not in plugins.registry("command"):
        pytest.skip("llmtrain-train-loop (the eval-tasks command) is not installed")
    from llmtrain.core_mesh.cli import main

    def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = main(["eval-tasks", *argv], plugins=plugins)
        out, err = capsys.readouterr()
        return code, out, err

    return run


@pytest.mark.parametrize("case", CLI_SAMPLE, ids=[c.id for c in CLI_SAMPLE])
def test_eval_tasks_prints_one_line_and_exits_2(plugins, eval_tasks, capsys, root, tmp_path, case):
    folder = lay_out(case, tmp_path / "case")
    message = str(outcome(plugins, case, folder))
    path = folder / case.path
    code, out, err = eval_tasks(
        capsys, str(tmp_path / "no-checkpoint"), "--tasks", f"{case.kind}={path}"
    )
    # the files are read before the checkpoint: the task file's error, not the checkpoint's
    assert (code, out, err) == (2, "", f"error: {message}\n")


@pytest.mark.parametrize(
    ("name", "suggested"),
    [
        ("helaswag", "hellaswag"),
        ("arc-easy", "arc_easy"),
        ("winogrand", "winogrande"),
        ("mmlu_csv", "mmlu"),
    ],
)
def test_eval_tasks_unknown_task_suggests(eval_tasks, capsys, tmp_path, name, suggested):
    path = tmp_path / "x.jsonl"
    code, out, err = eval_tasks(capsys, str(tmp_path / "no"), "--tasks", f"{name}={path}")
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and err.startswith("error: --tasks[0]: kind: "), err
    assert f"unknown task {name!r} (did you mean {suggested!r}?); known: " in err


# --- on an object store ------------------------------------------------------------------------


@pytest.fixture
def bucket(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """s3://<a fresh bucket> on a moto server (skipped where moto or s3fs is not installed)."""
    pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    from shared_fixtures import s3_bucket

    endpoint = request.getfixturevalue("moto_endpoint")
    for name in s3_bucket(endpoint, monkeypatch, "tasks"):
        yield f"s3://{name}"


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_task_files_on_s3(plugins, bucket):
    import fsspec

    fs = fsspec.filesystem("s3")
    valid = LAYOUTS[0].encode()
    fs.pipe(f"{bucket}/hellaswag_val.jsonl", valid)
    fs.pipe(f"{bucket}/cut.jsonl", valid[:-40])
    fs.pipe(f"{bucket}/cut.jsonl.gz", gzip.compress(valid)[:-9])
    fs.pipe(f"{bucket}/dir/hellaswag_val.jsonl", valid)
    good = task_items(plugins, "hellaswag", f"{bucket}/hellaswag_val.jsonl")
    assert [i.where for i in good] == [f"{bucket}/hellaswag_val.jsonl:{n}" for n in (1, 2)]

    def error(path: str, **options: Any) -> str:
        choice = structure(
            {"kind": "hellaswag", "path": path, **options}, Choice.of("task"), plugins=plugins
        )
        with pytest.raises(UserError) as caught:
            plugins.build("task", choice).items()
        message = str(caught.value)
        assert "\n" not in message
        return message

    missing = "no such task file; check the path"
    assert error(f"{bucket}/nope.jsonl") == f"{bucket}/nope.jsonl: {missing}"
    assert error("s3://no-such-bucket-x1/a.jsonl") == f"s3://no-such-bucket-x1/a.jsonl: {missing}"
    assert error(bucket) == f"{bucket}: is a directory; give the task file in it"
    assert error(f"{bucket}/dir") == f"{bucket}/dir: is a directory; give the task file in it"
    assert error(f"{bucket}/cut.jsonl").startswith(f"{bucket}/cut.jsonl:2: not a JSON line: ")
    assert error(f"{bucket}/cut.jsonl").endswith(
        "; the file ends inside this record: truncated? download it again"
    )
    assert error(f"{bucket}/cut.jsonl.gz").startswith(
        f"{bucket}/cut.jsonl.gz: not complete gzip data ("
    )
    unreachable = {
        "endpoint_url": f"http://127.0.0.1:{closed_port()}",
        "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 1},
    }
    message = error(f"{bucket}/hellaswag_val.jsonl", storage_options=unreachable)
    assert message.startswith(
        f"{bucket}/hellaswag_val.jsonl: cannot read the task file from its store: Could not connect"
    )
    assert message.endswith(
        "; check the endpoint, the network and the credentials (storage_options)"
    )
    message = error(f"{bucket}/hellaswag_val.jsonl", storage_options={"bogus": 1})
    assert message.startswith(f"{bucket}/hellaswag_val.jsonl: storage_options: ")
    assert "bogus" in message


def test_unknown_protocol_and_empty_path(plugins, tmp_path):
    with pytest.raises(UserError) as caught:
        task_items(plugins, "lambada", "foo://bucket/lambada_test.jsonl")
    assert str(caught.value) == (
        "foo://bucket/lambada_test.jsonl: Protocol not known: foo: give a local path or an "
        "fsspec URL (s3://, gs://, ...)"
    )
    with pytest.raises(UserError, match="path: must name the task file, got an empty path"):
        task_items(plugins, "lambada", " ")
