"""`--where` filters: a small, safe expression language over a record's fields.

`llmtrain data pack --where "int_score >= 3 and meta.language == 'en'"` keeps the records for
which every expression is true. The text is parsed by `ast.parse(..., mode="eval")` and only a
whitelist of node types is accepted (fields, literals, comparisons, `in`, `and`, `or`, `not`);
nothing is ever evaluated by Python. The tree is compiled once into nested closures, so judging a
record costs a few function calls.

Nulls follow pyarrow.compute and SQL (Kleene logic), so a filter keeps the same rows whether a
table is filtered here row by row or by `Table.filter` with the same expression written in
pyarrow: a comparison with a null is unknown, `and`/`or` are `and_kleene`/`or_kleene`, and only a
true result keeps a record. `x == null` and `x != null` test nullness. Types are strict (a string
is never compared with a number, a bool is not a number): a mismatch or a missing field is an
error for that record (`RecordMismatch`), because silently dropping it would hide a typo or a
schema change.
"""

from __future__ import annotations

import ast
import numbers
import operator
import shlex
from collections.abc import Callable, Collection, Mapping, Sequence
from decimal import Decimal
from typing import Any

import attrs

from llmtrain.core_mesh.errors import UserError, did_you_mean

HINT = "use comparisons, in, and, or, not"
MAX_DEPTH = 50  # deeper trees would make the closures recurse too far; no real filter needs it
LITERAL_NAMES = {"true": True, "false": False, "null": None}
ORDERING = (ast.Lt, ast.LtE, ast.Gt, ast.GtE)
OPERATORS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
}
# `3 < x` is judged as `x > 3`, so a field is always on the left
MIRRORED = {
    ast.Eq: ast.Eq,
    ast.NotEq: ast.NotEq,
    ast.Lt: ast.Gt,
    ast.LtE: ast.GtE,
    ast.Gt: ast.Lt,
    ast.GtE: ast.LtE,
}
SYMBOLS = {ast.Eq: "==", ast.NotEq: "!=", ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">="}
# the exact types records from JSON or `Table.to_pylist()` hold: checked first, because cheaply
EXACT_TYPES = {"number": (int, float), "string": (str,), "bool": (bool,)}
ARTICLES = {
    "number": "a number",
    "string": "a string",
    "bool": "a bool",
    "object": "an object",
    "list": "a list",
    "null": "null",
}

UNSUPPORTED: dict[type, str] = {
    ast.Call: "function calls are not allowed",
    ast.Subscript: "indexing and slicing are not allowed (name nested fields with dots: a.b)",
    ast.Lambda: "lambda is not allowed",
    ast.ListComp: "comprehensions are not allowed",
    ast.SetComp: "comprehensions are not allowed",
    ast.DictComp: "comprehensions are not allowed",
    ast.GeneratorExp: "comprehensions are not allowed",
    ast.NamedExpr: "assignment (:=) is not allowed",
    ast.JoinedStr: "f-strings are not allowed",
    ast.FormattedValue: "f-strings are not allowed",
    ast.IfExp: "conditional expressions (a if b else c) are not allowed",
    ast.Dict: "dict literals are not allowed (`in` takes a list: x in [1, 2])",
    ast.Set: "set literals are not allowed (`in` takes a list: x in [1, 2])",
    ast.Starred: "* unpacking is not allowed",
    ast.Await: "await is not allowed",
    ast.Yield: "yield is not allowed",
    ast.YieldFrom: "yield is not allowed",
    ast.Slice: "indexing and slicing are not allowed",
}
ARITHMETIC = {
    ast.Add: "+",
    ast.Sub: "-",
    ast.Mult: "*",
    ast.MatMult: "@",
    ast.Div: "/",
    ast.FloorDiv: "//",
    ast.Mod: "%",
    ast.Pow: "**",
    ast.LShift: "<<",
    ast.RShift: ">>",
    ast.BitOr: "|",
    ast.BitXor: "^",
    ast.BitAnd: "&",
}

Record = Mapping[str, Any]
Test = Callable[[Record], "bool | None"]  # True, False, or None for unknown (null)


class FilterSyntaxError(UserError):
    """A `--where` expression that is not valid in the filter language."""


class RecordMismatch(Exception):
    """A record the filter cannot judge (a missing field, a type that does not compare);
    args[0] is a one-line reason naming the field."""


@attrs.frozen
class Where:
    """Every `--where` expression, compiled: `keep(record)` is true when all of them are.

    Build it with `Where.parse`. It pickles as its expression texts and is compiled again on
    load, so it can be handed to spawned worker processes."""

    expressions: tuple[str, ...]
    _tests: tuple[Test, ...] = attrs.field(eq=False, repr=False)
    _fields: tuple[tuple[str, ...], ...] = attrs.field(eq=False, repr=False)

    @classmethod
    def parse(cls, expressions: Sequence[str]) -> Where:
        if isinstance(expressions, str):
            raise TypeError("Where.parse takes a sequence of expressions, not one string")
        compiled = [_Compiler(text).compile() for text in expressions]
        return cls(
            tuple(expressions),
            tuple(test for test, _ in compiled),
            tuple(fields for _, fields in compiled),
        )

    def __reduce__(self) -> tuple[Callable[[Sequence[str]], Where], tuple[tuple[str, ...]]]:
        return (Where.parse, (self.expressions,))

    @property
    def fields(self) -> tuple[str, ...]:
        """Every dotted path the expressions name, in first-seen order."""
        return tuple(dict.fromkeys(f for fields in self._fields for f in fields))

    @property
    def columns(self) -> tuple[str, ...]:
        """The top-level names of `fields`: the columns a Parquet reader must read."""
        return tuple(dict.fromkeys(f.split(".", 1)[0] for f in self.fields))

    def keep(self, record: Record) -> bool:
        """True only if every expression is true (unknown, i.e. null, drops the record).

        Expressions, and the operands of `and`/`or`, are judged left to right and stop once the
        answer is known, so `kind == 'code' and code.lang == 'py'` reads `code` only where needed.
        Raises RecordMismatch for a record the filter cannot judge."""
        for test in self._tests:
            if test(record) is not True:
                return False
        return True

    def check_columns(self, available: Collection[str], where: str) -> None:
        """Fail before reading any row when a table lacks a column the filter names."""
        for text, fields in zip(self.expressions, self._fields, strict=True):
            for field in fields:
                column = field.split(".", 1)[0]
                if column not in available:
                    names = sorted(available)
                    shown = ", ".join(names[:30]) or "none"
                    if len(names) > 30:
                        shown += f", ... ({len(names) - 30} more)"
                    if hint := did_you_mean(column, names):
                        shown += "; " + hint.strip()[1:-1]
                    raise UserError(
                        f"{where}: --where {quoted(text)} names column {column!r}, which it lacks"
                        f" (columns: {shown})"
                    )


def quoted(text: str) -> str:
    """The expression as a person would type it in a shell, on one line."""
    if not text.isprintable():
        return repr(text)
    if "'" not in text:
        return f"'{text}'"
    if not any(c in text for c in '"\\$`'):
        return f'"{text}"'
    return shlex.quote(text)


def kind_of(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (numbers.Real, Decimal)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, Mapping):
        return "object"
    if isinstance(value, (list, tuple)):
        return "list"
    return type(value).__name__


def described(value: Any) -> str:
    """'a string ('en')': a value's kind and a short repr, for messages."""
    kind = kind_of(value)
    text = repr(value)
    if len(text) > 40:
        text = text[:37] + "..."
    return f"{ARTICLES.get(kind, 'a ' + kind)} ({text})"


@attrs.frozen
class _Field:
    path: str
    get: Callable[[Record], Any]


@attrs.frozen
class _Literal:
    value: Any

    @property
    def kind(self) -> str:
        return kind_of(self.value)


class _Compiler:
    """Turns one expression's text into a test closure, checking every node on the way."""

    def __init__(self, text: str):
        self.text = text
        self.label = f"--where {quoted(text)}"
        self.fields: list[str] = []

    def compile(self) -> tuple[Test, tuple[str, ...]]:
        stripped = self.text.strip()
        if not stripped:
            raise FilterSyntaxError(f"{self.label}: the expression is empty")
        if "\0" in stripped:
            raise FilterSyntaxError(f"{self.label}: the expression holds a NUL character")
        self.lead = len(self.text) - len(self.text.lstrip())
        self.lines = stripped.split("\n")
        try:
            tree = ast.parse(stripped, mode="eval")
        except SyntaxError as exc:
            where = self.position(exc.lineno or 1, (exc.offset or 1) - 1, in_bytes=False)
            raise FilterSyntaxError(f"{self.label}: {exc.msg}{where}") from None
        except (ValueError, RecursionError, MemoryError) as exc:  # absurd nesting
            raise FilterSyntaxError(f"{self.label}: cannot be parsed ({exc})") from None
        test = self.condition(tree.body, 0)
        return test, tuple(dict.fromkeys(self.fields))

    # -- errors --------------------------------------------------------------------------------

    def position(self, line: int, offset: int, *, in_bytes: bool = True) -> str:
        """' at column C' (or ' at line L, column C'), counting characters from 1."""
        if in_bytes and 0 < line <= len(self.lines):
            offset = len(self.lines[line - 1].encode()[:offset].decode(errors="ignore"))
        if line > 1:
            return f" at line {line}, column {offset + 1}"
        return f" at column {self.lead + offset + 1}"

    def refuse(self, node: ast.AST, what: str, hint: str = HINT) -> FilterSyntaxError:
        where = self.position(getattr(node, "lineno", 1), getattr(node, "col_offset", 0))
        return FilterSyntaxError(f"{self.label}: {what}{where}" + (f"; {hint}" if hint else ""))

    def unsupported(self, node: ast.AST) -> FilterSyntaxError:
        if isinstance(node, ast.BinOp):
            symbol = ARITHMETIC.get(type(node.op), "?")
            return self.refuse(node, f"arithmetic ({symbol}) is not allowed")
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Invert):
            return self.refuse(node, "arithmetic (~) is not allowed")
        if isinstance(node, ast.UnaryOp):
            symbol = "-" if isinstance(node.op, ast.USub) else "+"
            return self.refuse(node, f"{symbol} applies only to a number literal (-3, +0.5)")
        if isinstance(node, ast.Attribute):
            return self.refuse(node, "attribute access is only for dotted field names (meta.lang)")
        what = UNSUPPORTED.get(type(node), f"{type(node).__name__} is not allowed")
        return self.refuse(node, what)

    def mismatch(self, path: str, value: Any, expected: str) -> RecordMismatch:
        return RecordMismatch(
            f"{self.label}: field {path!r} is {described(value)}, compared with {ARTICLES[expected]}"
        )

    # -- conditions ----------------------------------------------------------------------------

    def condition(self, node: ast.AST, depth: int) -> Test:
        if depth > MAX_DEPTH:
            raise self.refuse(
                node, f"the expression is nested more than {MAX_DEPTH} levels deep", ""
            )
        if isinstance(node, ast.BoolOp):
            tests = [self.condition(value, depth + 1) for value in node.values]
            return (kleene_and if isinstance(node.op, ast.And) else kleene_or)(tests)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            return kleene_not(self.condition(node.operand, depth + 1))
        if isinstance(node, ast.Compare):
            return self.comparison(node)
        operand = self.operand(node)
        if isinstance(operand, _Field):
            return self.predicate(operand)
        if operand.kind != "bool":
            what = f"{ARTICLES[operand.kind]} alone is not a condition"
            raise self.refuse(node, what, "compare it, e.g. x == 3")
        return constant(operand.value)

    def predicate(self, field: _Field) -> Test:
        """A bare field: its own value, which must be true, false or null."""
        get, label = field.get, self.label

        def test(record: Record) -> bool | None:
            value = get(record)
            if value is True or value is False or value is None:
                return value
            raise RecordMismatch(
                f"{label}: field {field.path!r} is {described(value)}, not true/false; "
                "a bare field must hold a bool (compare it otherwise, e.g. x > 0)"
            )

        return test

    def comparison(self, node: ast.Compare) -> Test:
        """`a < b < c` is `a < b and b < c`, in Kleene logic."""
        operands = [node.left, *node.comparators]
        tests = []
        for op, left, right in zip(node.ops, operands, operands[1:], strict=False):
            if isinstance(op, (ast.In, ast.NotIn)):
                tests.append(self.membership(op, left, right))
            elif isinstance(op, (ast.Is, ast.IsNot)):
                spelled = "==" if isinstance(op, ast.Is) else "!="
                raise self.refuse(node, f"`is` is not supported (write x {spelled} null)", "")
            else:
                tests.append(self.compare(op, self.operand(left), self.operand(right), node))
        return tests[0] if len(tests) == 1 else kleene_and(tests)

    def compare(
        self, op: ast.cmpop, left: _Field | _Literal, right: _Field | _Literal, node: ast.Compare
    ) -> Test:
        symbol = SYMBOLS[type(op)]
        for side in (left, right):
            if isinstance(side, _Literal) and side.kind == "null" and isinstance(op, ORDERING):
                what = f"null cannot be ordered ({symbol} null)"
                raise self.refuse(node, what, "test nullness with == null or != null")
            if isinstance(side, _Literal) and side.kind == "bool" and isinstance(op, ORDERING):
                what = f"true/false cannot be ordered ({symbol})"
                raise self.refuse(node, what, "compare bools with == or !=")
        if isinstance(left, _Literal) and isinstance(right, _Literal):
            if "null" in (left.kind, right.kind):
                same = left.value is None and right.value is None
                return constant(same if isinstance(op, ast.Eq) else not same)
            if left.kind != right.kind:
                raise self.refuse(
                    node, f"compares {ARTICLES[left.kind]} with {ARTICLES[right.kind]}", ""
                )
            return constant(OPERATORS[type(op)](left.value, right.value))
        if isinstance(left, _Literal):
            left, right, op = right, left, MIRRORED[type(op)]()
        assert isinstance(left, _Field)  # two literals were compared above
        if isinstance(right, _Literal):
            if right.value is None:  # the one comparison with null that is not unknown
                return is_null(left.get) if isinstance(op, ast.Eq) else is_valid(left.get)
            return self.field_with_literal(left, OPERATORS[type(op)], right.value, right.kind)
        return self.field_with_field(left, op, right)

    def field_with_literal(
        self, field: _Field, op: Callable[[Any, Any], bool], literal: Any, kind: str
    ) -> Test:
        get, exact = field.get, EXACT_TYPES[kind]

        def test(record: Record) -> bool | None:
            value = get(record)
            if type(value) in exact:
                return op(value, literal)
            if value is None:
                return None
            if kind_of(value) != kind:
                raise self.mismatch(field.path, value, kind)
            return bool(op(value, literal))

        return test

    def field_with_field(self, left: _Field, op: ast.cmpop, right: _Field) -> Test:
        compare, ordering, label = OPERATORS[type(op)], isinstance(op, ORDERING), self.label

        def test(record: Record) -> bool | None:
            a, b = left.get(record), right.get(record)
            if a is None or b is None:
                return None
            kind_a, kind_b = kind_of(a), kind_of(b)
            if kind_a != kind_b or kind_a not in EXACT_TYPES or (ordering and kind_a == "bool"):
                raise RecordMismatch(
                    f"{label}: field {left.path!r} is {described(a)} and field {right.path!r} is "
                    f"{described(b)}: they cannot be compared with {SYMBOLS[type(op)]}"
                )
            return bool(compare(a, b))

        return test

    def membership(self, op: ast.cmpop, left_node: ast.AST, right_node: ast.AST) -> Test:
        """`x in [a, b]` is `x == a or x == b`: a null x is unknown unless the list holds null."""
        if not isinstance(right_node, (ast.List, ast.Tuple, ast.Name, ast.Attribute, ast.Constant)):
            raise self.unsupported(right_node)
        if not isinstance(right_node, (ast.List, ast.Tuple)):
            raise self.refuse(right_node, "`in` takes a list of literals, such as ['en', 'de']", "")
        items = [self.literal(element) for element in right_node.elts]
        kinds = sorted({item.kind for item in items} - {"null"})
        if len(kinds) > 1:
            raise self.refuse(
                right_node, f"the list mixes {' and '.join(k + 's' for k in kinds)}", ""
            )
        kind = kinds[0] if kinds else None
        values = frozenset(item.value for item in items if item.value is not None)
        holds_null = len(values) < len(items)
        on_null = True if holds_null else (None if values else False)
        negate = isinstance(op, ast.NotIn)
        left = self.operand(left_node)
        if isinstance(left, _Literal):
            if left.value is not None and kind is not None and left.kind != kind:
                raise self.refuse(left_node, f"compares {ARTICLES[left.kind]} with {kind}s", "")
            found = on_null if left.value is None else left.value in values
            return constant(found if not negate or found is None else not found)
        get, path = left.get, left.path
        exact = EXACT_TYPES.get(kind, ()) if kind is not None else ()

        def test(record: Record) -> bool | None:
            value = get(record)
            if type(value) in exact:
                return (value in values) is not negate
            if value is None:
                return on_null if on_null is None else on_null is not negate
            if kind is None:  # only nulls (or nothing) in the list: any other value is out
                return negate
            if kind_of(value) == kind:
                return (value in values) is not negate
            raise self.mismatch(path, value, kind)

        return test

    # -- operands ------------------------------------------------------------------------------

    def operand(self, node: ast.AST) -> _Field | _Literal:
        if isinstance(node, ast.Name) and node.id not in LITERAL_NAMES:
            return self.field(node)
        if isinstance(node, ast.Attribute):
            return self.field(node)
        if isinstance(node, (ast.List, ast.Tuple)):
            raise self.refuse(node, "a list can only follow `in` or `not in`", "")
        if isinstance(node, (ast.BoolOp, ast.Compare)) or (
            isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not)
        ):
            raise self.refuse(node, "a condition cannot be compared (use and, or, not)", "")
        return self.literal(node)

    def literal(self, node: ast.AST) -> _Literal:
        if isinstance(node, ast.Name) and node.id in LITERAL_NAMES:
            return _Literal(LITERAL_NAMES[node.id])
        if isinstance(node, ast.Constant):
            value = node.value
            if value is None or isinstance(value, (bool, int, float, str)):
                return _Literal(value)
            what = {bytes: "bytes literals", complex: "complex numbers"}.get(type(value))
            raise self.refuse(node, f"{what or repr(value)} {'are' if what else 'is'} not allowed")
        if (
            isinstance(node, ast.UnaryOp)
            and isinstance(node.op, (ast.USub, ast.UAdd))
            and isinstance(node.operand, ast.Constant)
            and isinstance(node.operand.value, (int, float))
            and type(node.operand.value) in (int, float)  # not a bool
        ):
            value = node.operand.value
            return _Literal(-value if isinstance(node.op, ast.USub) else value)
        if isinstance(node, (ast.Name, ast.Attribute, ast.List, ast.Tuple)):
            raise self.refuse(
                node, "a list holds only literals (numbers, strings, true, false, null)", ""
            )
        raise self.unsupported(node)

    def field(self, node: ast.AST) -> _Field:
        parts: list[str] = []
        base = node
        while isinstance(base, ast.Attribute):
            parts.append(base.attr)
            base = base.value
        if not isinstance(base, ast.Name):
            if isinstance(base, (ast.Constant, ast.List, ast.Tuple, ast.UnaryOp)):
                raise self.refuse(node, "attribute access on a literal is not allowed")
            raise self.unsupported(base)
        if base.id in LITERAL_NAMES:
            raise self.refuse(node, "attribute access on a literal is not allowed")
        parts.append(base.id)
        parts.reverse()
        for part in parts:
            if part.startswith("__") and part.endswith("__"):
                raise self.refuse(node, f"names like {part!r} (double underscores) are not allowed")
        path = ".".join(parts)
        self.fields.append(path)
        return _Field(path, self.getter(parts))

    def getter(self, parts: list[str]) -> Callable[[Record], Any]:
        """Reads a dotted path; a null on the way gives null (pyarrow's struct_field does)."""
        path, label = ".".join(parts), self.label

        def refuse(record: Any, depth: int) -> RecordMismatch:
            """Why `parts[depth]` cannot be read from `record`."""
            if depth == 0 and not isinstance(record, Mapping):
                return RecordMismatch(
                    f"{label}: the record is {described(record)}, not an object, so field "
                    f"{path!r} cannot be read"
                )
            if isinstance(record, Mapping):
                missing = ".".join(parts[: depth + 1])
                needed = f" (needed for {path!r})" if missing != path else ""
                return RecordMismatch(f"{label}: field {missing!r} is missing{needed}")
            return RecordMismatch(
                f"{label}: field {'.'.join(parts[:depth])!r} is {described(record)}, not an "
                f"object, so {path!r} cannot be read"
            )

        if len(parts) == 1:
            name = parts[0]

            def get(record: Record) -> Any:
                try:
                    return record[name]
                except (KeyError, TypeError, IndexError):
                    raise refuse(record, 0) from None

            return get

        def get_path(record: Record) -> Any:
            value: Any = record
            for depth, part in enumerate(parts):
                if value is None and depth > 0:
                    return None
                if not isinstance(value, Mapping):
                    raise refuse(value, depth)
                try:
                    value = value[part]
                except KeyError:
                    raise refuse(value, depth) from None
            return value

        return get_path


def constant(value: bool | None) -> Test:
    return lambda record: value


def is_null(get: Callable[[Record], Any]) -> Test:
    return lambda record: get(record) is None


def is_valid(get: Callable[[Record], Any]) -> Test:
    return lambda record: get(record) is not None


def kleene_not(test: Test) -> Test:
    def negated(record: Record) -> bool | None:
        value = test(record)
        return None if value is None else not value

    return negated


def kleene_and(tests: list[Test]) -> Test:
    """False wins, then null; operands after a False are not judged."""
    return _kleene(tests, decisive=False)


def kleene_or(tests: list[Test]) -> Test:
    """True wins, then null; operands after a True are not judged."""
    return _kleene(tests, decisive=True)


def _kleene(tests: list[Test], *, decisive: bool) -> Test:
    """`and` (False decides) or `or` (True decides) in Kleene logic: the deciding value as soon
    as an operand has it, else null if any operand was null, else the other value."""

    def judge(record: Record) -> bool | None:
        result: bool | None = not decisive
        for test in tests:
            value = test(record)
            if value is decisive:
                return decisive
            if value is None:
                result = None
        return result

    return judge
