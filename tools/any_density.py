"""How much of the source is typed `Any`: uses of `typing.Any` per 1,000 non-blank source lines,
over packages/*/src and plugins/*/src, per package and in total.

    python tools/any_density.py [--max N] [--top K]

A use is the name `Any` (or `typing.Any`) in code, string annotations included; imports,
comments and docstrings do not count. Exits 1 when the total is above `--max` (default 15, issue
47's target; TorchTitan stands at about 6.5, OLMo-core at 7.9).
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX = 15.0  # issue 47: Any at most 15 per 1,000 lines


def any_uses(source: str) -> int:
    """The uses of `Any` in one module's code (and in its string annotations)."""
    tree = ast.parse(source)
    uses = 0
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id == "Any":
            uses += 1
        elif isinstance(node, ast.Attribute) and node.attr == "Any":
            uses += 1
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            uses += _in_annotation(node.value)
    return uses


def _in_annotation(text: str) -> int:
    """`Any` in a string that parses as an expression (a quoted annotation); 0 for prose."""
    if "Any" not in text or len(text) > 200:
        return 0
    try:
        expression = ast.parse(text, mode="eval")
    except SyntaxError:
        return 0
    return sum(
        (isinstance(n, ast.Name) and n.id == "Any")
        or (isinstance(n, ast.Attribute) and n.attr == "Any")
        for n in ast.walk(expression)
    )


def lines_of(source: str) -> int:
    return sum(1 for line in source.splitlines() if line.strip())


def owner(path: Path) -> str:
    """`packages/train-loop`, `plugins/llmtrain-hf`, ..."""
    return "/".join(path.relative_to(ROOT).parts[:2])


def measure(paths: list[Path]) -> tuple[Counter[str], Counter[str], Counter[Path]]:
    """(uses by package, lines by package, uses by file)."""
    uses, lines, files = Counter[str](), Counter[str](), Counter[Path]()
    for path in paths:
        source = path.read_text(encoding="utf-8")
        n = any_uses(source)
        uses[owner(path)] += n
        lines[owner(path)] += lines_of(source)
        files[path] = n
    return uses, lines, files


def sources() -> list[Path]:
    found = [*ROOT.glob("packages/*/src/**/*.py"), *ROOT.glob("plugins/*/src/**/*.py")]
    return sorted(found)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--max", type=float, default=MAX, help=f"fail above this many per 1,000 lines ({MAX})"
    )
    parser.add_argument("--top", type=int, default=10, help="files with the most uses")
    args = parser.parse_args()
    uses, lines, files = measure(sources())
    print(f"{'package':32} {'Any':>6} {'lines':>8} {'per kLOC':>9}")
    for name in sorted(lines):
        print(f"{name:32} {uses[name]:6} {lines[name]:8} {1000 * uses[name] / lines[name]:9.1f}")
    total_uses, total_lines = sum(uses.values()), sum(lines.values())
    density = 1000 * total_uses / total_lines
    print(f"{'total':32} {total_uses:6} {total_lines:8} {density:9.1f}")
    print(f"\nmost uses ({args.top} files):")
    for path, n in files.most_common(args.top):
        print(f"  {n:4}  {path.relative_to(ROOT)}")
    if density > args.max:
        print(f"\n{density:.1f} Any per 1,000 lines is above --max {args.max}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
