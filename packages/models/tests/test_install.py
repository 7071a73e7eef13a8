"""The package installs beside core-mesh into the shared `llmtrain` namespace with the same version."""

from __future__ import annotations

import importlib
import importlib.metadata


def test_importable_in_the_shared_namespace():
    package = importlib.import_module("llmtrain.models")
    core = importlib.import_module("llmtrain.core_mesh")
    assert package.__doc__ and core.__doc__
    # a PEP 420 namespace: both packages hang below one `llmtrain` without an __init__.py
    assert importlib.import_module("llmtrain").__file__ is None


def test_same_version_as_core_mesh():
    assert importlib.metadata.version("llmtrain-models") == importlib.metadata.version(
        "llmtrain-core-mesh"
    )


def test_declared_dependencies_are_importable():
    names = {"pyyaml": "yaml", "importlib-metadata": "importlib_metadata"}
    for requirement in importlib.metadata.requires("llmtrain-models") or []:
        if "extra ==" in requirement:
            continue
        dist = requirement.split(";")[0].split("[")[0]
        for sep in "<>=!~ ":
            dist = dist.split(sep)[0]
        if dist.startswith("llmtrain-"):
            importlib.import_module("llmtrain." + dist.removeprefix("llmtrain-").replace("-", "_"))
        else:
            importlib.import_module(names.get(dist, dist.replace("-", "_")))
