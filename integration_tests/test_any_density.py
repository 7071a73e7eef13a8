"""tools/any_density.py, the measure of how much of the source is typed `Any`."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

from support import ROOT

SCRIPT = ROOT / "tools" / "any_density.py"


def load():
    spec = importlib.util.spec_from_file_location("any_density", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_uses_in_code_and_quoted_annotations_count_prose_does_not():
    any_density = load()
    source = '''
"""Any docstring that says Any counts for nothing."""
import typing
from typing import Any

# Any in a comment: nothing
def f(x: Any, y: "dict[str, Any]", z: typing.Any) -> list[Any]:
    """Returns Any thing."""
    note = "Any prose, not an annotation"
    quoted: "typing.Any" = None
    return [x, y, z, note, quoted]
'''
    # x, the quoted dict[str, Any], typing.Any, list[Any], the quoted typing.Any (the import
    # is not a use)
    assert any_density.any_uses(source) == 5
    assert any_density.lines_of("a = 1\n\n   \nb = 2\n") == 2


def test_the_repository_figures_and_the_limit():
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    total = next(line for line in done.stdout.splitlines() if line.startswith("total"))
    uses, lines, density = total.split()[1:]
    assert float(density) == round(1000 * int(uses) / int(lines), 1)
    assert "packages/core-mesh" in done.stdout and "plugins/llmtrain-hf" in done.stdout
    assert float(density) <= 15, "issue 47: Any at most 15 per 1,000 lines (the default --max)"
    over = subprocess.run(
        [sys.executable, str(SCRIPT), "--max", "0"], capture_output=True, text=True
    )
    assert over.returncode == 1 and "is above --max 0" in over.stdout
