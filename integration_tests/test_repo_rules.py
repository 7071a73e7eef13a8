"""Repository rules from ARCHITECTURE.md ("Packages and dependencies"): PEP 420 namespace, the
dependency DAG, one VERSION file; and ARCHITECTURE.md itself names every package and plugin kind.

They only read pyproject.toml files and parse sources with `ast`: no torch or llmtrain needed."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path
from typing import NamedTuple

import pytest
from support import PACKAGES, ROOT  # PACKAGES: noxfile.py's list, checked against packages/

# Which llmtrain siblings each package may depend on and import (ARCHITECTURE.md "Packages and
# dependencies").
ALLOWED = {"core-mesh": set(), "train-loop": set(PACKAGES) - {"train-loop"}}
ALLOWED |= {
    p: {"core-mesh"}
    for p in ("data-pack", "models", "parallel", "checkpoint", "ablate", "downstream")
}
NO_TORCH_DEP = {"core-mesh", "data-pack", "ablate"}  # none may declare torch
NEVER_TORCH = {"data-pack", "ablate"}  # not even a lazy import inside a function
LAZY_TORCH_ONLY = {"core-mesh"}  # torch only inside functions, never at import time
# Lazy imports a package may leave undeclared: core-mesh's world/mesh functions use the torch that
# the packages calling them (models, parallel, ...) declare; core-mesh itself installs without it.
LAZY_UNDECLARED = {"core-mesh": {"torch"}}
TYPE_CHECKING = ("TYPE_CHECKING", "typing.TYPE_CHECKING")  # imports in these blocks never run
DIST_FOR_IMPORT = {
    "yaml": "pyyaml",
    "importlib_metadata": "importlib-metadata",
    "tiktoken_ext": "tiktoken",  # tiktoken ships its published encodings in this package
}


class Import(NamedTuple):
    module: str  # absolute dotted name; relative imports keep their leading dots
    lineno: int
    at_module_level: bool  # runs when the module is imported (not in a function/TYPE_CHECKING)


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name.strip().lower())


def req_name(requirement: str) -> str:
    """`torch[opt]>=2.6; python_version>'3'` -> `torch`."""
    return norm(re.split(r"[<>=!~;\[ ]", requirement.strip(), maxsplit=1)[0])


def load_toml(path: Path) -> dict:
    return tomllib.loads(path.read_text(encoding="utf-8"))


def deps_of(pyproject: dict) -> tuple[set[str], set[str]]:
    """(dependencies, optional-dependencies of any extra) as normalised distribution names."""
    project = pyproject.get("project", {})
    deps = {req_name(r) for r in project.get("dependencies", [])}
    optional = project.get("optional-dependencies", {}).values()
    extras = {req_name(r) for reqs in optional for r in reqs}
    return deps, extras


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def imports_in(path: Path) -> list[Import]:
    """Every import statement in a file, at any depth, with whether it runs at import time."""
    found: list[Import] = []

    def visit(node: ast.AST, eager: bool) -> None:
        if isinstance(node, ast.Import):
            found.extend(Import(a.name, node.lineno, eager) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            if module == "llmtrain":  # `from llmtrain import models` imports llmtrain.models
                found.extend(Import(f"llmtrain.{a.name}", node.lineno, eager) for a in node.names)
            else:
                found.append(Import(module, node.lineno, eager))
        elif isinstance(node, ast.If) and ast.unparse(node.test) in TYPE_CHECKING:
            for child in node.body:
                visit(child, False)
            for child in node.orelse:
                visit(child, eager)
            return
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            eager = False
        for child in ast.iter_child_nodes(node):
            visit(child, eager)

    visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)), True)
    return found


def dep_violations(pkg: str, deps: set[str]) -> list[str]:
    """Rule 2a: a package's declared dependencies follow the DAG."""
    out = []
    for dist in sorted(deps):
        if dist.startswith("llmtrain-") and dist.removeprefix("llmtrain-") not in ALLOWED[pkg]:
            out.append(f"{pkg} may not depend on {dist} (allowed: {sorted(ALLOWED[pkg])})")
    if pkg in NO_TORCH_DEP and "torch" in deps:
        out.append(f"{pkg} may not depend on torch")
    return out


def import_violations(pkg: str, path: Path, imports: list[Import]) -> list[str]:
    """Rule 2b: imports of siblings follow the DAG; torch only where and when allowed."""
    out = []
    for imp in imports:
        where, parts = f"{rel(path)}:{imp.lineno}", imp.module.split(".")
        if parts[0] == "llmtrain" and len(parts) > 1:
            sibling = norm(parts[1])
            if sibling != pkg and sibling not in ALLOWED[pkg]:
                out.append(f"{where}: {pkg} may not import {imp.module}")
        elif parts[0] == "torch" and pkg in NEVER_TORCH:
            out.append(f"{where}: {pkg} must never import torch ({imp.module})")
        elif parts[0] == "torch" and pkg in LAZY_TORCH_ONLY and imp.at_module_level:
            out.append(f"{where}: {pkg} may import torch only inside functions ({imp.module})")
    return out


def undeclared(pkg: str, path: Path, imports: list[Import], deps: set[str], extras: set[str]):
    """Rule 2c: every third-party or sibling module imported is a declared dependency."""
    out = []
    for imp in imports:
        top, *parts = imp.module.split(".")
        if not top or top in sys.stdlib_module_names:  # relative import or stdlib
            continue
        if top == "llmtrain":
            if not parts or norm(parts[0]) == pkg:
                continue
            dist = f"llmtrain-{norm(parts[0])}"
        else:
            dist = norm(DIST_FOR_IMPORT.get(top, top))
        eager = imp.at_module_level
        if dist not in (deps if eager else deps | extras | LAZY_UNDECLARED.get(pkg, set())):
            need = "[project].dependencies" if eager else "[project].dependencies or an extra"
            kind = "import-time" if eager else "lazy"
            out.append(
                f"{rel(path)}:{imp.lineno}: {kind} import of {imp.module!r} needs {dist!r} in {need} of {pkg}"
            )
    return out


def namespace_inits(root: Path) -> list[str]:
    pattern = "{}/*/src/llmtrain/__init__.py"
    return sorted(rel(p) for d in ("packages", "plugins") for p in root.glob(pattern.format(d)))


def version_problems(pyproject: dict, expected_path: str) -> list[str]:
    project = pyproject.get("project", {})
    out = []
    if "version" in project:
        out.append(f"[project] sets version = {project['version']!r}; it must be dynamic")
    if "version" not in project.get("dynamic", []):
        out.append('[project].dynamic does not contain "version"')
    got = pyproject.get("tool", {}).get("hatch", {}).get("version", {}).get("path")
    if got != expected_path:
        out.append(f"[tool.hatch.version].path is {got!r}, expected {expected_path!r}")
    return out


def package_sources(pkg: str) -> list[Path]:
    return sorted((ROOT / "packages" / pkg / "src").rglob("*.py"))


def fail_if(problems: list[str], rule: str) -> None:
    if problems:
        pytest.fail(f"{rule}:\n  " + "\n  ".join(problems), pytrace=False)


def plugin_kinds(path: Path) -> dict[str, str]:
    """`KINDS` (plugin kind -> hook) of core-mesh's plugins.py, read with `ast`."""
    for node in ast.parse(path.read_text(encoding="utf-8"), filename=str(path)).body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if any(isinstance(t, ast.Name) and t.id == "KINDS" for t in targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"{rel(path)} assigns no KINDS at module level")


def unnamed_in_architecture(text: str, packages: list[str], kinds: dict[str, str]) -> list[str]:
    """What the architecture text does not name in backticks: a package (`name` or
    `packages/name`), a plugin kind (`kind`) or its hook (`llmtrain_...`)."""
    out = []
    for pkg in packages:
        if not re.search(rf"`(packages/)?{re.escape(pkg)}/?`", text):
            out.append(f"package {pkg!r} (name it as `{pkg}`)")
    for kind, hook in kinds.items():
        for name, what in ((kind, "plugin kind"), (hook, "hook")):
            if f"`{name}`" not in text:
                out.append(f"{what} {name!r} (name it as `{name}`)")
    return out


# --- the rules, on the real tree ---------------------------------------------------------------


def test_packages_dir_matches_the_dag():
    on_disk = sorted(p.parent.name for p in (ROOT / "packages").glob("*/pyproject.toml"))
    assert on_disk == sorted(PACKAGES), "packages/ and noxfile.py's PACKAGES differ"
    assert sorted(ALLOWED) == on_disk, (
        "packages/ and the DAG in this test (and ARCHITECTURE.md) differ"
    )


def test_llmtrain_is_a_namespace_package():
    fail_if(namespace_inits(ROOT), "PEP 420: llmtrain must have no __init__.py (delete these)")


@pytest.mark.parametrize("pkg", PACKAGES)
def test_declared_dependencies_follow_the_dag(pkg):
    deps, _ = deps_of(load_toml(ROOT / "packages" / pkg / "pyproject.toml"))
    fail_if(dep_violations(pkg, deps), f"packages/{pkg}/pyproject.toml breaks the dependency DAG")


@pytest.mark.parametrize("pkg", PACKAGES)
def test_imports_follow_the_dag(pkg):
    problems = [v for p in package_sources(pkg) for v in import_violations(pkg, p, imports_in(p))]
    fail_if(problems, f"packages/{pkg}/src imports break the dependency DAG")


@pytest.mark.parametrize("pkg", PACKAGES)
def test_imported_modules_are_declared(pkg):
    deps, extras = deps_of(load_toml(ROOT / "packages" / pkg / "pyproject.toml"))
    srcs = package_sources(pkg)
    problems = [v for p in srcs for v in undeclared(pkg, p, imports_in(p), deps, extras)]
    fail_if(problems, f"packages/{pkg}/src imports modules its pyproject does not declare")


@pytest.mark.parametrize(
    "pyproject",
    sorted(ROOT.glob("packages/*/pyproject.toml")) + sorted(ROOT.glob("plugins/*/pyproject.toml")),
    ids=lambda p: rel(p.parent),
)
def test_package_version_comes_from_root_version_file(pyproject):
    fail_if(version_problems(load_toml(pyproject), "../../VERSION"), f"{rel(pyproject)}: version")


def test_root_version_and_dependencies():
    root = load_toml(ROOT / "pyproject.toml")
    assert (ROOT / "VERSION").is_file(), "the single VERSION file at the repo root is missing"
    fail_if(version_problems(root, "VERSION"), "pyproject.toml: version")
    deps = [req_name(r) for r in root["project"].get("dependencies", [])]
    want = [f"llmtrain-{p}" for p in PACKAGES]
    assert sorted(deps) == sorted(want), f"root [project].dependencies must be {want}, not {deps}"


def test_architecture_names_every_package_and_plugin_kind():
    doc = ROOT / "ARCHITECTURE.md"
    assert doc.is_file(), "ARCHITECTURE.md, the description of record, is missing at the repo root"
    packages = sorted(
        p.name for p in (ROOT / "packages").iterdir() if p.is_dir() and p.name[0] not in "._"
    )
    kinds = plugin_kinds(ROOT / "packages/core-mesh/src/llmtrain/core_mesh/plugins.py")
    assert "model" in kinds and "callback" in kinds, f"KINDS read from plugins.py: {kinds}"
    problems = unnamed_in_architecture(doc.read_text(encoding="utf-8"), packages, kinds)
    fail_if(problems, "ARCHITECTURE.md has fallen behind the tree; describe these there")


# --- the checkers can fail (so the rule tests above are not vacuous) --------------------------

BAD_SOURCE = """\
import torch
import torch.nn as nn
from typing import TYPE_CHECKING
from . import sibling_module
from llmtrain import parallel
from llmtrain.models.block import Block
import numpy
try:
    import torch.distributed
except ImportError:
    pass
if TYPE_CHECKING:
    import torch.fx
class C:
    import yaml
def f():
    import torch.cuda
    from zarr import open_group
"""


@pytest.fixture
def bad(tmp_path):
    path = tmp_path / "bad.py"
    path.write_text(BAD_SOURCE)
    return path, imports_in(path)


def test_imports_in_finds_every_form_and_level(bad):
    got = {(i.module, i.lineno, i.at_module_level) for i in bad[1]}
    assert got >= {("torch", 1, True), ("torch.nn", 2, True), (".", 4, True)}
    assert got >= {("llmtrain.parallel", 5, True), ("llmtrain.models.block", 6, True)}
    assert got >= {("torch.distributed", 9, True), ("torch.fx", 13, False), ("yaml", 15, True)}
    assert got >= {("torch.cuda", 17, False), ("zarr", 18, False)}


def test_import_checker_reports_dag_and_torch_violations(bad):
    core = "\n".join(import_violations("core-mesh", *bad))
    assert "bad.py:1:" in core and "bad.py:9:" in core  # module level, also inside a top-level try
    assert "bad.py:13:" not in core and "bad.py:17:" not in core  # TYPE_CHECKING, function: fine
    assert "may not import llmtrain.parallel" in core and "bad.py:4:" not in core
    data = "\n".join(import_violations("data-pack", *bad))
    assert "bad.py:17: data-pack must never import torch" in data and "bad.py:13:" in data
    ablate = "\n".join(import_violations("ablate", *bad))
    assert "bad.py:17: ablate must never import torch" in ablate
    assert "ablate may not import llmtrain.parallel" in ablate
    models = "\n".join(import_violations("models", *bad))
    assert "llmtrain.parallel" in models and "llmtrain.models.block" not in models
    assert import_violations("train-loop", *bad) == []


def test_undeclared_checker_reports_missing_dependencies(bad):
    got = "\n".join(undeclared("models", *bad, {"torch"}, {"zarr"}))
    assert "'numpy' needs 'numpy'" in got and "'yaml' needs 'pyyaml'" in got
    assert "'llmtrain.parallel' needs 'llmtrain-parallel'" in got
    assert "zarr" not in got and "typing" not in got and "llmtrain.models" not in got
    # an extra does not cover an import-time import; core-mesh may leave lazy torch undeclared
    assert "'numpy'" in "\n".join(undeclared("models", *bad, {"torch"}, {"numpy"}))
    core = "\n".join(undeclared("core-mesh", *bad, set(), set()))
    assert "bad.py:1:" in core and "bad.py:17:" not in core


def test_dependency_and_project_checkers_can_fail(tmp_path):
    assert req_name("Torch[opt] >=2.6; python_version>'3'") == "torch"
    assert req_name("importlib_metadata~=7") == "importlib-metadata"
    assert dep_violations("train-loop", {f"llmtrain-{p}" for p in ALLOWED["train-loop"]}) == []
    assert dep_violations("data-pack", {"torch", "llmtrain-core-mesh"}) == [
        "data-pack may not depend on torch"
    ]
    assert dep_violations("ablate", {"torch", "llmtrain-train-loop"}) == [
        "ablate may not depend on llmtrain-train-loop (allowed: ['core-mesh'])",
        "ablate may not depend on torch",
    ]
    (problem,) = dep_violations("models", {"llmtrain-parallel", "torch"})
    assert problem.startswith("models may not depend on llmtrain-parallel")
    (tmp_path / "plugins/x/src/llmtrain").mkdir(parents=True)
    (tmp_path / "plugins/x/src/llmtrain/__init__.py").write_text("")
    assert len(namespace_inits(tmp_path)) == 1
    assert len(version_problems({"project": {"version": "1.0"}}, "VERSION")) == 3


def test_architecture_checker_can_fail(tmp_path):
    source = tmp_path / "plugins.py"
    source.write_text(
        "GROUP = 'llmtrain'\n"
        "KINDS: dict[str, str] = {'model': 'llmtrain_models', 'callback': 'llmtrain_callbacks'}\n"
    )
    kinds = plugin_kinds(source)
    assert kinds == {"model": "llmtrain_models", "callback": "llmtrain_callbacks"}
    text = "`core-mesh` and `packages/models/`: kind `model` (`llmtrain_models`), callbacks"
    assert unnamed_in_architecture(text, ["core-mesh", "models", "data-pack"], kinds) == [
        "package 'data-pack' (name it as `data-pack`)",
        "plugin kind 'callback' (name it as `callback`)",
        "hook 'llmtrain_callbacks' (name it as `llmtrain_callbacks`)",
    ]
    assert unnamed_in_architecture("`mesh` `llmtrain.models`", ["core-mesh", "models"], {}) == [
        "package 'core-mesh' (name it as `core-mesh`)",
        "package 'models' (name it as `models`)",
    ]
    source.write_text("KIND = {}\n")
    with pytest.raises(AssertionError, match="assigns no KINDS"):
        plugin_kinds(source)
