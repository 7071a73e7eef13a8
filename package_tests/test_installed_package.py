"""Run by every package's nox session (LLMTRAIN_PACKAGE names it): the package installed alone
with its declared dependencies imports into the shared `llmtrain` namespace at the repo version."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import re

import pytest

PACKAGE = os.environ.get("LLMTRAIN_PACKAGE", "")
IMPORT_NAMES = {"pyyaml": "yaml", "importlib-metadata": "importlib_metadata"}

pytestmark = pytest.mark.skipif(not PACKAGE, reason="run by a package's nox session")


def test_importable_in_the_shared_namespace():
    package = importlib.import_module("llmtrain." + PACKAGE.replace("-", "_"))
    core = importlib.import_module("llmtrain.core_mesh")
    assert package.__doc__ and core.__doc__
    # a PEP 420 namespace: both packages hang below one `llmtrain` without an __init__.py
    assert importlib.import_module("llmtrain").__file__ is None


def test_same_version_as_core_mesh():
    version = importlib.metadata.version(f"llmtrain-{PACKAGE}")
    assert version == importlib.metadata.version("llmtrain-core-mesh")


def test_declared_dependencies_are_importable():
    for requirement in importlib.metadata.requires(f"llmtrain-{PACKAGE}") or []:
        if "extra ==" in requirement:
            continue
        dist = re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].lower()
        if dist.startswith("llmtrain-"):
            importlib.import_module("llmtrain." + dist.removeprefix("llmtrain-").replace("-", "_"))
        else:
            importlib.import_module(IMPORT_NAMES.get(dist, dist.replace("-", "_")))


def test_torch_absent_where_promised():
    if PACKAGE in ("core-mesh", "data-pack", "ablate"):
        assert importlib.util.find_spec("torch") is None, f"{PACKAGE} must work without torch"
    else:
        assert importlib.util.find_spec("torch") is not None
