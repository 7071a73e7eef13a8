"""`--where` filters: the language's results on hand-picked records, agreement with the same
filters written in pyarrow.compute on random tables (Kleene nulls), and the errors: bad text is a
FilterSyntaxError that runs nothing, a record the filter cannot judge is a RecordMismatch."""

from __future__ import annotations

import ast
import builtins
import pickle
import random

import pytest

from llmtrain.core_mesh.errors import UserError
from llmtrain.data_pack.filters import FilterSyntaxError, RecordMismatch, Where

RECORD = {
    "i": 5,
    "f": 0.5,
    "s": "en",
    "b": True,
    "n": None,
    "nb": None,
    "neg": -2,
    "empty": "",
    "big": 12345678901234567890,
    "u": "日本語",
    "nan": float("nan"),
    "tags": ["a", "b"],
    "meta": {"lang": "de", "score": 0.9, "q": {"x": 3}, "none": None},
    "nullmeta": None,
}

CASES = [
    # comparisons, both ways round, int against float
    ("i == 5", True),
    ("i != 5", False),
    ("i > 4", True),
    ("i >= 5", True),
    ("i < 5", False),
    ("i <= 5", True),
    ("5 == i", True),
    ("4 < i", True),
    ("6 <= i", False),
    ("i == 5.0", True),
    ("f > 0.25", True),
    ("f >= 1e-1", True),
    ("big == 12345678901234567890", True),
    ("neg == -2", True),
    ("neg < -1.5", True),
    ("neg > +0", False),
    # strings, both quotes, escapes, non-ASCII
    ("s == 'en'", True),
    ('s == "en"', True),
    ("s < 'fr'", True),
    ("s > 'fr'", False),
    ("empty == ''", True),
    ("meta.lang == 'd\\x65'", True),
    ("u == '日本語'", True),
    # bools, bare fields as predicates
    ("b", True),
    ("not b", False),
    ("b == true", True),
    ("b != false", True),
    ("b == True", True),
    ("true", True),
    ("false", False),
    # chains
    ("0 < i < 10", True),
    ("0 < i < 5", False),
    ("0 < i <= 5 < 6", True),
    ("0.5 <= f < 0.9", True),
    # in / not in
    ("i in [1, 5]", True),
    ("i in (1, 2)", False),
    ("i not in [1, 2]", True),
    ("i in [-5, 5.0]", True),
    ("s in ['en', 'de']", True),
    ("s not in ['en']", False),
    ("i in []", False),
    ("i not in []", True),
    ("3 in [1, 3]", True),
    # dotted paths
    ("meta.lang == 'de'", True),
    ("meta.q.x == 3", True),
    ("meta.score > 0.8 and meta.lang in ['de']", True),
    # nullness tests
    ("n == null", True),
    ("n != null", False),
    ("n == None", True),
    ("null == n", True),
    ("i == null", False),
    ("i != null", True),
    ("meta == null", False),
    ("meta != null", True),
    ("nullmeta == null", True),
    ("tags != null", True),
    # a comparison with null is unknown, and unknown drops the record, negated or not
    ("n > 1", False),
    ("not (n > 1)", False),
    ("n == 1", False),
    ("n != 1", False),
    ("not (n == 1)", False),
    ("n == i", False),
    ("not (n == i)", False),
    ("nb", False),
    ("not nb", False),
    # Kleene and / or
    ("n > 1 or i == 5", True),
    ("n > 1 or true", True),
    ("n > 1 and i == 4", False),
    ("not (n > 1 and i == 4)", True),  # False and null is False
    ("n > 1 and i == 5", False),
    ("not (n > 1 and i == 5)", False),  # True and null is null
    ("not (n > 1 or i == 4)", False),  # False or null is null
    ("nb or b", True),
    ("not (nb and not b)", True),
    ("i == 1 or i == 2 or i == 5", True),
    ("i > 0 and f > 0 and s == 'en' and b", True),
    ("i > 0 and f > 0 and n > 0", False),
    ("not (i > 0 and f > 0 and n > 0)", False),
    ("not (i < 0 and f > 0 and n > 0)", True),
    ("not (i < 0 or f < 0 or n > 0)", False),
    ("i >= 5 and (s == 'fr' or meta.lang == 'de')", True),
    ("not not b", True),
    # in with nulls: `x in [a, b]` is `x == a or x == b`
    ("n in [1, 2]", False),
    ("n not in [1, 2]", False),
    ("not (n in [1, 2])", False),
    ("n in [1, null]", True),
    ("n not in [1, null]", False),
    ("i in [1, null]", False),
    ("i not in [1, null]", True),
    ("n in [null]", True),
    ("meta in [null]", False),
    ("nullmeta in [null]", True),
    ("null in [1]", False),
    ("not (null in [1])", False),
    # a null struct on the way gives null, as pyarrow's struct_field does
    ("nullmeta.lang == 'x'", False),
    ("not (nullmeta.lang == 'x')", False),
    ("nullmeta.lang == null", True),
    ("meta.none.deeper == null", True),
    # literals on both sides, fields on both sides
    ("1 < 2", True),
    ("null == null", True),
    ("null != 1", True),
    ("'a' == 'a'", True),
    ("i > f", True),
    ("s == meta.lang", False),
    ("i == meta.q.x", False),
    ("b == b", True),
    # NaN compares like IEEE (and pyarrow): never equal, never ordered
    ("nan == nan", False),
    ("nan != 1", True),
    ("nan > 0", False),
    ("nan < 0", False),
]


@pytest.mark.parametrize(("expression", "expected"), CASES)
def test_expressions_on_a_record(expression, expected):
    assert Where.parse([expression]).keep(RECORD) is expected


def test_every_expression_must_hold():
    assert Where.parse(["i > 0", "s == 'en'"]).keep(RECORD) is True
    assert Where.parse(["i > 0", "s == 'de'"]).keep(RECORD) is False
    assert Where.parse(["i > 0", "n > 0"]).keep(RECORD) is False
    assert Where.parse(["i > 0", "not (n > 0)"]).keep(RECORD) is False


def test_no_expression_keeps_everything():
    where = Where.parse([])
    assert where.fields == () and where.columns == ()
    assert where.keep({}) is True
    assert where.keep(RECORD) is True
    where.check_columns([], "empty.parquet")


def test_and_or_stop_once_the_answer_is_known():
    """A guard spares records that lack the guarded field; a null guard does not."""
    guarded = Where.parse(["kind == 'code' and code.lang == 'py'"])
    assert guarded.keep({"kind": "text"}) is False
    assert guarded.keep({"kind": "code", "code": {"lang": "py"}}) is True
    with pytest.raises(RecordMismatch, match="field 'code' is missing"):
        guarded.keep({"kind": "code"})
    with pytest.raises(RecordMismatch, match="field 'code' is missing"):
        guarded.keep({"kind": None})  # null and X: X decides between False and null
    either = Where.parse(["kind == 'text' or code.lang == 'py'"])
    assert either.keep({"kind": "text"}) is True
    with pytest.raises(RecordMismatch, match="field 'code' is missing"):
        either.keep({"kind": "code"})
    # a later expression is not judged once an earlier one is false
    assert Where.parse(["kind == 'code'", "code.lang == 'py'"]).keep({"kind": "text"}) is False


def test_fields_and_columns_in_first_seen_order():
    where = Where.parse(["b > 1 and a.x == 2", "a.y == 3 or b < 0", "c", "x == true and y != null"])
    assert where.fields == ("b", "a.x", "a.y", "c", "x", "y")
    assert where.columns == ("b", "a", "c", "x", "y")


def test_pickles_as_its_text():
    """Spawned workers receive the filter by pickle; the closures are rebuilt there."""
    where = Where.parse(["i >= 3 and s == 'en'", "not b"])
    again = pickle.loads(pickle.dumps(where))
    assert again == where and again.expressions == where.expressions
    assert again.keep({"i": 3, "s": "en", "b": False}) is True
    assert again.keep({"i": 3, "s": "en", "b": True}) is False


def test_a_single_string_is_refused():
    with pytest.raises(TypeError, match="sequence of expressions"):
        Where.parse("i > 3")


# -- syntax errors ---------------------------------------------------------------------------


SYNTAX_ERRORS = [
    ("score >== 3", "--where 'score >== 3': invalid syntax at column 9"),
    (
        "f(x)",
        "--where 'f(x)': function calls are not allowed at column 1; use comparisons, in, and, or, not",
    ),
    ("a > 1 and f(x)", "function calls are not allowed at column 11"),
    ("  a > 1 and f(x)", "function calls are not allowed at column 13"),
    ("é == 1 and f(x)", "function calls are not allowed at column 12"),
    ("(a > 1\n and f(x))", "function calls are not allowed at line 2, column 6"),
    ("a > 1)", "unmatched ')' at column 6"),
    ("", "the expression is empty"),
    ("   ", "the expression is empty"),
    ("x = 1", "invalid syntax"),
    ("import os", "invalid syntax"),
    ("'a'.upper()", "function calls are not allowed"),
    ("'a'.upper == 'x'", "attribute access on a literal is not allowed"),
    ("3 .real > 1", "attribute access on a literal is not allowed"),
    ("true.x", "attribute access on a literal is not allowed"),
    ("f(x).y == 1", "function calls are not allowed"),
    ("x[0] > 1", "indexing and slicing are not allowed"),
    ("meta['lang'] == 'en'", "indexing and slicing are not allowed"),
    ("lambda: 1", "lambda is not allowed"),
    ("[x for x in y]", "comprehensions are not allowed"),
    ("any(x > 1 for x in y)", "function calls are not allowed"),
    ("x in [y for y in z]", "comprehensions are not allowed"),
    ("2 ** 3 > 1", "arithmetic (**) is not allowed"),
    ("a + 1 > 2", "arithmetic (+) is not allowed"),
    ("a % 2 == 0", "arithmetic (%) is not allowed"),
    ("~x", "arithmetic (~) is not allowed"),
    ("-x > 1", "- applies only to a number literal"),
    ("(x := 1)", "assignment (:=) is not allowed at column 2"),
    ("f'{x}' == 'a'", "f-strings are not allowed"),
    ("a if b else c", "conditional expressions (a if b else c) are not allowed"),
    ("x == {'a': 1}", "dict literals are not allowed"),
    ("x == {1, 2}", "set literals are not allowed"),
    ("__import__", "names like '__import__' (double underscores) are not allowed"),
    ("a.__class__ == 1", "names like '__class__' (double underscores) are not allowed"),
    ("__builtins__.open == 1", "names like '__builtins__'"),
    ("b'x' == x", "bytes literals are not allowed"),
    ("1j == x", "complex numbers are not allowed"),
    ("... == x", "Ellipsis is not allowed"),
    ("x is None", "`is` is not supported (write x == null)"),
    ("x is not null", "`is` is not supported (write x != null)"),
    ("x > null", "null cannot be ordered (> null)"),
    ("null <= x", "null cannot be ordered"),
    ("flag < true", "true/false cannot be ordered (<)"),
    ("3", "a number alone is not a condition"),
    ("'en'", "a string alone is not a condition"),
    ("null", "null alone is not a condition"),
    ("'a' < 3", "compares a string with a number"),
    ("true == 1", "compares a bool with a number"),
    ("x in y", "`in` takes a list of literals"),
    ("x in 'abc'", "`in` takes a list of literals"),
    ("x in [1, 'a']", "the list mixes numbers and strings"),
    ("x in [true, 1]", "the list mixes bools and numbers"),
    ("x in [y]", "a list holds only literals"),
    ("x in [[1]]", "a list holds only literals"),
    ("'a' in [1]", "compares a string with numbers"),
    ("x == [1]", "a list can only follow `in` or `not in`"),
    ("x > 1, y", "a list can only follow `in` or `not in`"),
    ("(a > 1) == true", "a condition cannot be compared"),
    ("not " * 60 + "x", "nested more than 50 levels deep"),
    ("x\0 > 1", "the expression holds a NUL character"),
    ("(" * 300 + "x" + ")" * 300, "--where"),
]


@pytest.mark.parametrize(("expression", "message"), SYNTAX_ERRORS)
def test_syntax_errors_name_the_expression_and_the_problem(expression, message):
    with pytest.raises(FilterSyntaxError) as caught:
        Where.parse(["i > 0", expression])
    text = str(caught.value)
    assert message in text
    assert text.startswith("--where ") and "\n" not in text
    assert isinstance(caught.value, UserError)


def test_messages_quote_the_expression_as_a_shell_would_take_it():
    with pytest.raises(FilterSyntaxError, match=r"""^--where "lang == 'en' and f\(\)": """):
        Where.parse(["lang == 'en' and f()"])
    with pytest.raises(FilterSyntaxError, match=r"""^--where 'a > 1\\n and f\(x\)': """):
        Where.parse(["a > 1\n and f(x)"])


def test_nothing_in_the_text_is_ever_run(tmp_path, monkeypatch):
    """Filters that would write a file under eval are refused, and parsing and judging only
    ever compile to an AST (never to code), with eval and exec unavailable."""
    target = tmp_path / "pwned"
    attacks = [
        f"__import__('os').system('touch {target}')",
        f"open('{target}', 'w').write('x') > 0",
        f"[open('{target}', 'w') for _ in [1]]",
        f"(lambda: open('{target}', 'w'))()",
        f"exec(\"open('{target}', 'w')\")",
        f"eval(\"open('{target}', 'w')\") == 1",
        f"x == open('{target}', 'w')",
        f"x in [open('{target}', 'w')]",
        "().__class__.__bases__[0].__subclasses__()",
        f"(w := open('{target}', 'w'))",
        f"f'{{open(\"{target}\", \"w\")}}' == 'x'",
    ]
    real_compile = builtins.compile

    def ast_only(source, filename, mode, flags=0, *args, **kwargs):
        assert flags & ast.PyCF_ONLY_AST, "compiled to code"
        return real_compile(source, filename, mode, flags, *args, **kwargs)

    def forbidden(*args, **kwargs):
        raise AssertionError("eval or exec was called")

    monkeypatch.setattr(builtins, "compile", ast_only)
    monkeypatch.setattr(builtins, "eval", forbidden)
    monkeypatch.setattr(builtins, "exec", forbidden)
    for attack in attacks:
        with pytest.raises(FilterSyntaxError):
            Where.parse([attack])
    # the language itself still works under the same watch
    where = Where.parse([text for text, _ in CASES])
    for text, expected in CASES:
        assert Where.parse([text]).keep(RECORD) is expected
    assert where.keep(RECORD) is False
    assert not target.exists()


# -- records the filter cannot judge ---------------------------------------------------------

MISMATCHES = [
    ("int_score >= 3", {}, "--where 'int_score >= 3': field 'int_score' is missing"),
    ("language == 3", {"language": "en"}, "--where 'language == 3': field 'language' is a string ('en'), compared with a number"),
    ("3 == language", {"language": "en"}, "field 'language' is a string ('en'), compared with a number"),
    ("score > 1", {"score": True}, "field 'score' is a bool (True), compared with a number"),
    ("score > 1.5", {"score": "2"}, "field 'score' is a string ('2'), compared with a number"),
    ("flag == true", {"flag": 1}, "field 'flag' is a number (1), compared with a bool"),
    ("lang in ['en', 'de']", {"lang": 3}, "field 'lang' is a number (3), compared with a string"),
    ("score in [1, 2]", {"score": "1"}, "field 'score' is a string ('1'), compared with a number"),
    ("score not in [1, null]", {"score": False}, "field 'score' is a bool (False), compared with a number"),
    ("meta.lang == 'en'", {"meta": {}}, "field 'meta.lang' is missing"),
    ("meta.lang == 'en'", {}, "field 'meta' is missing (needed for 'meta.lang')"),
    ("meta.q.x == 1", {"meta": {}}, "field 'meta.q' is missing (needed for 'meta.q.x')"),
    ("meta.lang == 'en'", {"meta": "en"}, "field 'meta' is a string ('en'), not an object, so 'meta.lang' cannot be read"),
    ("is_clean", {"is_clean": 1}, "field 'is_clean' is a number (1), not true/false"),
    ("not is_clean", {"is_clean": "yes"}, "field 'is_clean' is a string ('yes'), not true/false"),
    ("a < b", {"a": 1, "b": "x"}, "field 'a' is a number (1) and field 'b' is a string ('x'): they cannot be compared with <"),
    ("a < b", {"a": True, "b": False}, "they cannot be compared with <"),
    ("a == b", {"a": {"k": 1}, "b": {"k": 1}}, "field 'a' is an object ({'k': 1})"),
    ("tags == 'x'", {"tags": ["x"]}, "field 'tags' is a list (['x']), compared with a string"),
    ("meta > 1", {"meta": {"a": 1}}, "field 'meta' is an object ({'a': 1}), compared with a number"),
    ("x == 1", ["x"], "the record is a list (['x']), not an object, so field 'x' cannot be read"),
    ("x.y == 1", "text", "the record is a string ('text'), not an object"),
    ("text == 1", {"text": "y" * 100}, "field 'text' is a string ('yyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyy...)"),
]  # fmt: skip


@pytest.mark.parametrize(("expression", "record", "message"), MISMATCHES)
def test_records_the_filter_cannot_judge_name_the_field(expression, record, message):
    where = Where.parse([expression])
    with pytest.raises(RecordMismatch) as caught:
        where.keep(record)
    reason = caught.value.args[0]
    assert message in reason
    assert reason.startswith("--where ") and expression in reason and "\n" not in reason
    assert not isinstance(caught.value, UserError)


def test_a_null_is_never_a_type_mismatch():
    where = Where.parse(["language == 3"])
    assert where.keep({"language": None}) is False
    assert Where.parse(["not (language == 3)"]).keep({"language": None}) is False
    assert Where.parse(["language in ['en']"]).keep({"language": None}) is False


# -- check_columns -----------------------------------------------------------------------------


def test_check_columns():
    where = Where.parse(["a >= 3", "b.c == 'x' or x >= 3"])
    where.check_columns(["a", "b", "x"], "data.parquet")
    where.check_columns({"a": 1, "b": 2, "x": 3, "extra": 4}, "data.parquet")
    with pytest.raises(UserError) as caught:
        Where.parse(["x >= 3"]).check_columns(["a", "b", "c"], "data.parquet")
    assert str(caught.value) == (
        "data.parquet: --where 'x >= 3' names column 'x', which it lacks (columns: a, b, c)"
    )
    with pytest.raises(UserError, match=r"names column 'b', which it lacks \(columns: a, x\)"):
        where.check_columns(["x", "a"], "t.arrow")
    with pytest.raises(UserError, match=r"--where 'int_scor > 2' .*did you mean 'int_score'"):
        Where.parse(["int_scor > 2"]).check_columns(["int_score", "text"], "f.parquet")
    many = [f"c{k:03d}" for k in range(40)]
    with pytest.raises(UserError, match=r"c029, \.\.\. \(10 more\)"):
        Where.parse(["zz > 1"]).check_columns(many, "wide.parquet")


# -- agreement with pyarrow.compute on random tables -----------------------------------------


def random_table(seed: int, n: int = 600):
    """Ints, floats, strings and bools with nulls, and a struct (itself sometimes null) holding
    a string, a float and a nested struct, for dotted paths."""
    import numpy as np
    import pyarrow as pa

    rng = np.random.default_rng(seed)

    def column(values, null_share, type=None):
        return pa.array(values, type=type, mask=rng.random(n) < null_share)

    q = pa.StructArray.from_arrays(
        [column(rng.integers(0, 6, n), 0.2)], names=["x"], mask=pa.array(rng.random(n) < 0.1)
    )
    meta = pa.StructArray.from_arrays(
        [
            column(rng.choice(["en", "de", "fr"], n), 0.15),
            column(np.round(rng.random(n), 2), 0.15),
            q,
        ],
        names=["lang", "score", "q"],
        mask=pa.array(rng.random(n) < 0.1),
    )
    return pa.table(
        {
            "i": column(rng.integers(-5, 11, n), 0.15),
            "f": column(np.round(rng.random(n), 2), 0.1),
            "s": column(rng.choice(["en", "de", "fr", "", "EN"], n), 0.15),
            "b": column(rng.random(n) < 0.5, 0.2),
            "meta": meta,
        }
    )


def reference_filters():
    """(the filter's text, the same filter written by hand in pyarrow.compute)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    unknown = pa.scalar(None, pa.bool_())

    def is_in(values, value_set):
        """`in` is `x == a or x == b`: unlike pc.is_in, a null x is null unless the set holds
        null (pc.is_in says false)."""
        found = pc.is_in(values, value_set=pa.array(value_set))
        return found if None in value_set else pc.if_else(pc.is_valid(values), found, unknown)

    def lang(t):
        return pc.struct_field(t["meta"], "lang")

    def score(t):
        return pc.struct_field(t["meta"], "score")

    def qx(t):
        return pc.struct_field(pc.struct_field(t["meta"], "q"), "x")

    and_, or_, not_ = pc.and_kleene, pc.or_kleene, pc.invert
    return [
        ("i >= 3", lambda t: pc.greater_equal(t["i"], 3)),
        ("3 <= i", lambda t: pc.greater_equal(t["i"], 3)),
        ("i >= 3 and s == 'en'", lambda t: and_(pc.greater_equal(t["i"], 3), pc.equal(t["s"], "en"))),
        ("i < 0 or b", lambda t: or_(pc.less(t["i"], 0), t["b"])),
        ("b", lambda t: t["b"]),
        ("not b", lambda t: not_(t["b"])),
        ("b == false", lambda t: pc.equal(t["b"], False)),
        ("b != true and f >= 0.5", lambda t: and_(pc.not_equal(t["b"], True), pc.greater_equal(t["f"], 0.5))),
        ("not (i > 2 and f < 0.5)", lambda t: not_(and_(pc.greater(t["i"], 2), pc.less(t["f"], 0.5)))),
        ("not (b or i > 100)", lambda t: not_(or_(t["b"], pc.greater(t["i"], 100)))),
        ("0.2 <= f < 0.7", lambda t: and_(pc.greater_equal(t["f"], 0.2), pc.less(t["f"], 0.7))),
        ("-2 < i <= 4 and not (s == 'fr')", lambda t: and_(and_(pc.greater(t["i"], -2), pc.less_equal(t["i"], 4)), not_(pc.equal(t["s"], "fr")))),
        ("s in ['en', 'de']", lambda t: is_in(t["s"], ["en", "de"])),
        ("s not in ['en', 'de']", lambda t: not_(is_in(t["s"], ["en", "de"]))),
        ("not (s in ['en', ''])", lambda t: not_(is_in(t["s"], ["en", ""]))),
        ("s in ['en', null]", lambda t: is_in(t["s"], ["en", None])),
        ("i not in [1, 2, 3, null]", lambda t: not_(is_in(t["i"], [1, 2, 3, None]))),
        ("i in [-1, 0.0, 1]", lambda t: is_in(t["i"], [-1, 0, 1])),
        ("s == null", lambda t: pc.is_null(t["s"])),
        ("s != null or i == null", lambda t: or_(pc.is_valid(t["s"]), pc.is_null(t["i"]))),
        ("i < f", lambda t: pc.less(t["i"], t["f"])),
        ("s > meta.lang", lambda t: pc.greater(t["s"], lang(t))),
        ("meta.lang == 'en' and meta.score > 0.5", lambda t: and_(pc.equal(lang(t), "en"), pc.greater(score(t), 0.5))),
        ("meta.q.x != 3 or not b", lambda t: or_(pc.not_equal(qx(t), 3), not_(t["b"]))),
        ("meta == null", lambda t: pc.is_null(t["meta"])),
        ("meta.q.x in [1, 2, 3] and meta.lang != null", lambda t: and_(is_in(qx(t), [1, 2, 3]), pc.is_valid(lang(t)))),
        ("meta.score == null", lambda t: pc.is_null(score(t))),
        ("(i > 5 or i < -3) and (b or s == null)", lambda t: and_(or_(pc.greater(t["i"], 5), pc.less(t["i"], -3)), or_(t["b"], pc.is_null(t["s"])))),
        ("i > 0 or f > 0.5 or b", lambda t: or_(or_(pc.greater(t["i"], 0), pc.greater(t["f"], 0.5)), t["b"])),
        ("i > 0 and f > 0.5 and not b", lambda t: and_(and_(pc.greater(t["i"], 0), pc.greater(t["f"], 0.5)), not_(t["b"]))),
    ]  # fmt: skip


def kept_by_pyarrow(table, mask) -> list[int]:
    import pyarrow as pa

    numbered = table.append_column("row", pa.array(range(table.num_rows)))
    return numbered.filter(mask).column("row").to_pylist()


def kept_by_where(where: Where, rows) -> list[int]:
    return [k for k, row in enumerate(rows) if where.keep(row)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_keeps_the_rows_pyarrow_keeps(seed):
    table = random_table(seed)
    rows = table.to_pylist()
    for text, build in reference_filters():
        expected = kept_by_pyarrow(table, build(table))
        kept = kept_by_where(Where.parse([text]), rows)
        assert 0 < len(expected) < table.num_rows, text  # each filter decides something
        assert len(kept) == len(expected), text
        assert kept == expected, text


def test_several_expressions_keep_what_pyarrow_keeps_with_all_masks():
    import pyarrow.compute as pc

    table = random_table(3)
    mask = pc.and_kleene(
        pc.and_kleene(pc.greater(table["i"], 0), pc.is_valid(table["s"])),
        pc.less(pc.struct_field(table["meta"], "score"), 0.8),
    )
    expected = kept_by_pyarrow(table, mask)
    where = Where.parse(["i > 0", "s != null", "meta.score < 0.8"])
    assert 0 < len(expected) < table.num_rows
    assert kept_by_where(where, table.to_pylist()) == expected


@pytest.mark.parametrize("seed", [0, 1])
def test_random_combinations_keep_the_rows_pyarrow_keeps(seed):
    """Random trees of and / or / not over the reference filters: the Kleene logic has to
    agree with pyarrow's at every level, nulls included."""
    import pyarrow.compute as pc

    table = random_table(10 + seed, n=300)
    rows = table.to_pylist()
    atoms = [(text, build(table)) for text, build in reference_filters()]
    rng = random.Random(seed)

    def tree(depth: int):
        if depth == 0 or rng.random() < 0.25:
            return rng.choice(atoms)
        kind = rng.choice(["and", "or", "not"])
        if kind == "not":
            text, mask = tree(depth - 1)
            return f"not ({text})", pc.invert(mask)
        (left, left_mask), (right, right_mask) = tree(depth - 1), tree(depth - 1)
        combine = pc.and_kleene if kind == "and" else pc.or_kleene
        return f"({left}) {kind} ({right})", combine(left_mask, right_mask)

    decided = 0
    for _ in range(150):
        text, mask = tree(4)
        expected = kept_by_pyarrow(table, mask)
        assert kept_by_where(Where.parse([text]), rows) == expected, text
        decided += 0 < len(expected) < table.num_rows
    assert decided > 100
