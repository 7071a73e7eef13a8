"""ARCHITECTURE.md's claims about interfaces, plugin kinds, commands and callbacks, checked
against the installed packages (test_repo_rules.py checks its claims about dependencies).

Each table of the document is read back and compared with what the code does: a row that names
a package as a user of a type must find that package referring to it, a Protocol's providers
must conform to it, a kind's row must name every entry the repo registers for it.
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import inspect
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import ROOT

from llmtrain.core_mesh import interfaces
from llmtrain.core_mesh.conformance import protocol_mismatches
from llmtrain.core_mesh.plugins import KINDS, PluginManager

DOC = ROOT / "ARCHITECTURE.md"
PACKAGE_DIRS = {
    p.name: p for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").is_file()
}
PLUGIN_DIRS = {p.name: p for p in (ROOT / "plugins").iterdir() if (p / "pyproject.toml").is_file()}

# Where the providers of each Protocol live: (distribution, class name). The test finds the class
# by walking the distribution's modules, so moving it within its package needs no edit here.
PROVIDERS: dict[str, list[tuple[str, str]]] = {
    "Tokenizer": [
        ("data-pack", "BytesTokenizer"),
        ("data-pack", "HFTokenizer"),
        ("data-pack", "TiktokenTokenizer"),
    ],
    "Task": [("downstream", "FileTask")],
    "MetricsSink": [
        ("train-loop", "ConsoleSink"),
        ("train-loop", "JsonlSink"),
        ("llmtrain-tensorboard", "TensorBoardSink"),
        ("llmtrain-wandb", "WandbSink"),
    ],
    "WeightFormat": [("llmtrain-hf", "HFWeights")],
    "ParallelStrategy": [("parallel", "DefaultStrategy")],
    "ParallelModel": [("parallel", "Parallelized")],
    "ModelOptions": [("models", "TransformerConfig"), ("llmtrain-moe", "MoEOptions")],
    "LanguageModel": [("models", "Transformer"), ("llmtrain-moe", "MoETransformer")],
    "Objective": [("train-loop", "CrossEntropySum"), ("llmtrain-distill", "Distill")],
    "AuxiliaryLosses": [("llmtrain-moe", "MoETransformer")],
    "ExpertParallel": [("llmtrain-moe", "Experts")],
    "AfterOptimizerStep": [("llmtrain-moe", "MoE")],
    "TrainingRun": [("train-loop", "RunView")],
}

# Protocols whose implementations are checked in their own package's tests instead
UNCHECKED_OK = {
    # a callable: train-loop's bound `MetricRecorder.record`; mypy --strict checks it where the
    # Trainer hands it to `ObjectiveContext(record_metric=...)`
    "MetricRecorder",
}


def section(title: str) -> str:
    """The text of one `## title` section of ARCHITECTURE.md."""
    text = DOC.read_text(encoding="utf-8")
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"ARCHITECTURE.md has no section '## {title}'"
    return match.group(1)


def table(text: str) -> list[list[str]]:
    """The rows (cells stripped, header and rule dropped) of the first Markdown table in text."""
    lines = [line for line in text.splitlines() if line.startswith("|")]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]
    return [row for row in rows[2:] if row]


def backticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def distributions_named(cell: str) -> set[str]:
    """The repo's packages and plugins a cell names (`models`, `llmtrain-moe`, `data-pack's`)."""
    names = set(PACKAGE_DIRS) | set(PLUGIN_DIRS)
    return {n for n in names if re.search(rf"(?<![\w-]){re.escape(n)}(?![\w-])", cell)}


def source_dirs(dist: str) -> list[Path]:
    base = PACKAGE_DIRS.get(dist) or PLUGIN_DIRS[dist]
    return [base / "src"]


def top_modules(dist: str) -> Iterator[str]:
    """Importable module names of one distribution, from its src/ tree."""
    for src in source_dirs(dist):
        for path in sorted(src.rglob("*.py")):
            parts = path.relative_to(src).with_suffix("").parts
            yield ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def find_class(dist: str, name: str) -> type:
    for module_name in top_modules(dist):
        module = importlib.import_module(module_name)
        found = vars(module).get(name)
        if inspect.isclass(found) and found.__module__ == module_name:
            return found
    raise AssertionError(f"no class {name} in {dist}'s sources")


def names_used(dist: str) -> set[str]:
    """Every identifier a distribution's sources use (names, attributes, imported names)."""
    used: set[str] = set()
    for src in source_dirs(dist):
        for path in src.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Name):
                    used.add(node.id)
                elif isinstance(node, ast.Attribute):
                    used.add(node.attr)
                elif isinstance(node, ast.alias):
                    used.add(node.name.rsplit(".", 1)[-1])
                elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                    used.update(re.findall(r"\b[A-Z]\w+\b", node.value))  # string annotations
    return used


def installed(dist: str) -> bool:
    name = dist if dist.startswith("llmtrain-") else f"llmtrain-{dist}"
    try:
        importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def public_types() -> dict[str, type]:
    return {
        name: obj
        for name, obj in vars(interfaces).items()
        if inspect.isclass(obj) and obj.__module__ == interfaces.__name__ and name[0] != "_"
    }


def is_protocol(cls: type) -> bool:
    return bool(getattr(cls, "_is_protocol", False))


@pytest.fixture(scope="module")
def interface_rows() -> dict[str, list[str]]:
    rows = table(section("Interfaces"))
    return {backticked(row[0])[0]: row for row in rows}


@pytest.fixture(scope="module")
def plugins() -> PluginManager:
    return PluginManager().load_entry_points()


# --- Interfaces -----------------------------------------------------------------------------


def test_the_interfaces_table_lists_exactly_the_types_of_interfaces_py(interface_rows):
    assert sorted(interface_rows) == sorted(public_types()), (
        "ARCHITECTURE.md's Interfaces table and interfaces.py's public classes differ"
    )


def test_every_package_said_to_use_a_type_refers_to_it(interface_rows):
    problems = []
    for name, row in interface_rows.items():
        users = distributions_named(row[3])
        assert users, f"the Interfaces row of {name} names no package using it"
        for dist in sorted(users):
            if installed(dist) and name not in names_used(dist):
                problems.append(f"{name}: '{dist}' is said to use it, but never refers to it")
    assert not problems, "\n".join(problems)


def test_every_provider_of_a_protocol_conforms_and_is_named(interface_rows):
    problems = []
    for name, providers in PROVIDERS.items():
        protocol = public_types()[name]
        named = distributions_named(interface_rows[name][2])
        for dist, class_name in providers:
            if dist not in named:
                problems.append(f"{name}: {dist} provides it ({class_name}) but is not named")
            if not installed(dist):
                continue
            mismatches = protocol_mismatches(find_class(dist, class_name), protocol)
            problems += [f"{name}: {class_name}: {m}" for m in mismatches]
    assert not problems, "\n".join(problems)


def test_every_protocol_with_a_provider_in_the_repo_is_checked_here():
    protocols = {name for name, cls in public_types().items() if is_protocol(cls)}
    unchecked = protocols - set(PROVIDERS)
    assert not unchecked - UNCHECKED_OK, f"add the providers of {sorted(unchecked)} to PROVIDERS"


def test_protocol_methods_take_positional_parameters_positional_only():
    problems = []
    for name, cls in public_types().items():
        if not is_protocol(cls):
            continue
        for member, fn in vars(cls).items():
            if not inspect.isfunction(fn) or (member.startswith("_") and member != "__call__"):
                continue
            named = [
                p.name
                for p in list(inspect.signature(fn).parameters.values())[1:]
                if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
            ]
            if named:
                problems.append(f"{name}.{member}: {', '.join(named)} (add `/`)")
    assert not problems, "ARCHITECTURE.md promises positional-only: " + "; ".join(problems)


def test_interfaces_needs_no_torch_or_numpy():
    """torch and numpy only under `TYPE_CHECKING` (the type checker's names), and the module
    imports in a Python where neither can be imported."""
    tree = ast.parse(Path(interfaces.__file__).read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            node.body = []  # for the type checker only
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    } | {
        (node.module or "").split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
    }
    assert not imported & {"torch", "numpy"}
    blocked = (
        "import sys; sys.modules['torch'] = sys.modules['numpy'] = None; "
        "import llmtrain.core_mesh.interfaces as i; print(i.TrainingRun.__name__)"
    )
    done = subprocess.run([sys.executable, "-c", blocked], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "TrainingRun", done.stderr


# --- Plugin kinds -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kind_rows() -> dict[str, list[str]]:
    rows = table(section("Where a plugin hooks in"))
    return {backticked(row[0])[0]: row for row in rows}


def test_the_kinds_table_matches_kinds(kind_rows):
    assert {kind: backticked(row[1])[0] for kind, row in kind_rows.items()} == KINDS


def test_each_kind_row_names_every_entry_the_repo_registers(kind_rows, plugins):
    problems = []
    for kind, row in kind_rows.items():
        in_repo = row[3]
        named = set(backticked(in_repo))
        for entry in plugins.registry(kind).values():
            dist = (entry.origin.distribution or "").removeprefix("llmtrain-")
            if dist not in PACKAGE_DIRS and f"llmtrain-{dist}" not in PLUGIN_DIRS:
                continue  # a third party's plugin installed here
            if f"llmtrain-{dist}" in PLUGIN_DIRS:
                dist = f"llmtrain-{dist}"
            if dist not in distributions_named(in_repo):
                problems.append(f"{kind} {entry.name!r}: its distribution {dist} is not named")
            # model presets are many entries of one builder: the row names the family
            if kind != "model" and entry.name not in named:
                problems.append(f"{kind} {entry.name!r} ({dist}) is not named")
        for name in named:
            if name not in plugins.registry(kind) and not _from_uninstalled_plugin(in_repo, name):
                problems.append(f"{kind} {name!r} is named but nothing registers it")
    assert not problems, "\n".join(problems)


def _from_uninstalled_plugin(cell: str, name: str) -> bool:
    """Whether `name` appears in the cell after an uninstalled plugin's name ("llmtrain-lmeval's
    `lm-eval`": that plugin runs in a session of its own)."""
    for plugin in PLUGIN_DIRS:
        if not installed(plugin):
            owned = re.search(rf"{re.escape(plugin)}'s ([^;]*)", cell)
            if owned and f"`{name}`" in owned.group(1):
                return True
    return False


def test_the_packages_table_names_each_package_commands(plugins):
    """Each package's row names (as `llmtrain NAME` and the backticked words after it) exactly the
    commands that package registers."""
    rows = {backticked(row[0])[0]: row for row in table(section("Packages and dependencies"))}
    problems = []
    for pkg, row in rows.items():
        job = row[2]
        start = job.find("`llmtrain")
        said = set()
        if start >= 0:
            words = backticked(job[start:])
            said = {w.split()[1] if w.startswith("llmtrain ") else w.split()[0] for w in words}
            said.discard("llmtrain")
        registered = {
            e.name
            for e in plugins.registry("command").values()
            if e.origin.distribution == f"llmtrain-{pkg}"
        }
        if pkg == "core-mesh":
            said = {"plugins"} if "`llmtrain` command" in job else set()
        if said != registered:
            problems.append(
                f"{pkg}: the table says {sorted(said)}, it registers {sorted(registered)}"
            )
    assert not problems, "\n".join(problems)


# --- The life of a run ------------------------------------------------------------------------


def test_the_callback_events_table_is_callback_events_in_order():
    rows = table(section("The life of a run"))
    # a row may name two events: `before_step(run, step)` / `after_step(run, step, metrics)`
    events = [call.split("(")[0] for row in rows for call in backticked(row[0])]
    assert events == list(interfaces.CALLBACK_EVENTS)


def test_the_built_in_callbacks_are_named_in_the_order_they_run():
    text = section("The life of a run")
    said = re.findall(r"`(\w+)` →", text)
    from llmtrain.train_loop import builtin_callbacks

    tree = ast.parse(Path(builtin_callbacks.__file__).read_text(encoding="utf-8"))
    pairs = [
        node.elts[0].value
        for node in ast.walk(tree)
        if isinstance(node, ast.Tuple)
        and len(node.elts) == 2
        and isinstance(node.elts[0], ast.Constant)
        and isinstance(node.elts[1], ast.Call)
    ]
    assert said == pairs, "ARCHITECTURE.md's list of built-in callbacks and their order"


def test_the_checks_can_fail():
    """The table reader and the name finder see what they should (so the tests above bite)."""
    text = "| a | b |\n|---|---|\n| `X` | models, llmtrain-moe's `y` |\n"
    assert table(text) == [["`X`", "models, llmtrain-moe's `y`"]]
    assert distributions_named(table(text)[0][1]) == {"models", "llmtrain-moe"}
    assert "Tokenizer" in names_used("data-pack")
    assert "NoSuchThing" not in names_used("data-pack")
    assert protocol_mismatches(object, interfaces.Tokenizer)
