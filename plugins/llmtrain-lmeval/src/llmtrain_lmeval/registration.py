"""Making `llmtrain` a model name lm-evaluation-harness knows, without importing lm-eval.

lm-eval finds its models in a registry of names and lazy `module:Class` paths, filled when
`lm_eval.models` is imported (its `MODEL_MAPPING`); it has no entry-point discovery. `watch()`
puts a finder on `sys.meta_path` that notices the import of `lm_eval.models` and, once the module
has run, adds `llmtrain` -> `llmtrain_lmeval.model:LLMTrainLM` beside the built-in names. Nothing
else is imported or changed: a process that never imports lm-eval pays one string comparison per
import. The wheel's `llmtrain_lmeval.pth` imports this package at interpreter start, so the
`lm_eval` command knows the model; `import llmtrain_lmeval` does the same in a Python program
(for `lm_eval.simple_evaluate(model="llmtrain", ...)`).

Imports nothing but `sys` at import time: this module runs at every interpreter start.
"""

from __future__ import annotations

import sys

# typing.TYPE_CHECKING without importing typing (mypy knows the name): the imports and classes
# below exist for the type checker only
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence
    from importlib.abc import Loader
    from importlib.machinery import ModuleSpec
    from types import ModuleType
    from typing import Protocol

    class _Registry(Protocol):
        """What `_add` uses of lm-eval's model registry (lm-eval ships no types)."""

        def __contains__(self, name: str, /) -> bool: ...

        def register(self, name: str, *, target: str) -> object: ...

    # _RegisterAfter is a loader (create_module, exec_module) without importlib.abc at run time
    _LoaderBase = Loader
else:
    _LoaderBase = object

MODEL_NAME = "llmtrain"
MODEL_PATH = "llmtrain_lmeval.model:LLMTrainLM"
WATCHED = "lm_eval.models"  # lm-eval registers its own lazy models when this module runs


def register() -> None:
    """Add `llmtrain` to lm-eval's model registry (a lazy path: the class loads on first use).

    Imports `lm_eval.models` first: lm-eval fills its registry from it only while the registry
    is empty, so registering into an empty one would hide the built-in models (`hf`, ...).
    """
    import lm_eval.models  # noqa: F401 - see the docstring
    from lm_eval.api.registry import model_registry

    _add(model_registry)


def _add(model_registry: _Registry) -> None:
    if MODEL_NAME not in model_registry:
        model_registry.register(MODEL_NAME, target=MODEL_PATH)


def _registered_after_import() -> None:
    try:
        from lm_eval.api.registry import model_registry

        _add(model_registry)
    except Exception as exc:  # noqa: BLE001 - lm-eval must keep working without our model
        import warnings

        warnings.warn(
            f"llmtrain-lmeval could not register the {MODEL_NAME!r} model with lm-eval: "
            f"{type(exc).__name__}: {exc}",
            stacklevel=2,
        )


# plain classes, not importlib.abc's: importing that module (and importlib.resources, typing)
# at every interpreter start would cost more than everything else here
class _RegisterAfter(_LoaderBase):
    """The loader of `lm_eval.models`, with `register()` run after the module's own code."""

    def __init__(self, loader: Loader) -> None:
        self._loader = loader

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        # the module keeps the real loader (resources, reloads); only this one run is wrapped
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        _registered_after_import()


class _Watcher:
    """Finds nothing itself: asks the finders after it for `lm_eval.models` and wraps the
    loader of what they found."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname != WATCHED:
            return None
        for finder in sys.meta_path:
            if isinstance(finder, _Watcher) or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _RegisterAfter(spec.loader)
                return spec
        return None


def watch() -> None:
    """Register `llmtrain` now if lm-eval's models are loaded, else when they are (once per
    process, however often called)."""
    if WATCHED in sys.modules:
        _registered_after_import()
    elif not any(isinstance(f, _Watcher) for f in sys.meta_path):
        sys.meta_path.insert(0, _Watcher())
