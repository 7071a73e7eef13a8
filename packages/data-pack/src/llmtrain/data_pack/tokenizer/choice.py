"""A tokenizer from a config or the command line: `--tokenizer` spellings to a `Choice`, a choice
to plain data (dataset metadata, worker processes) and plain data to the tokenizer a plugin builds.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from llmtrain.core_mesh.errors import UserError
from llmtrain.core_mesh.plugins import TOKENIZER
from llmtrain.data_pack.tokenizer.common import TokenizerError

if TYPE_CHECKING:
    from llmtrain.core_mesh.config import Choice
    from llmtrain.core_mesh.plugins import PluginManager


# The config and plugin machinery is imported when first used, not with this module: pack's
# worker processes import this package to unpickle their tokenizer, and its start is pack's cost.


@functools.cache
def _tokenizer_choice_type() -> type[Choice]:
    from llmtrain.core_mesh.config import Choice

    return Choice.of("tokenizer")


def tokenizer_choice(text: str, plugins: PluginManager, extra: Sequence[str] = ()) -> Choice:
    """A CLI spelling of a tokenizer: `bytes`, `hf:PATH`, `tiktoken:PATH`, or a bare file path
    (`*.json` is hf, `*.tiktoken` is tiktoken); `extra` holds `key=value` options."""
    kind, sep, path = text.partition(":")
    if not (sep and kind in plugins.registry("tokenizer")):
        if text.endswith(".json"):
            kind, path = "hf", text
        elif text.endswith(".tiktoken"):
            kind, path = "tiktoken", text
        elif text.endswith(".model"):
            raise TokenizerError(
                f"{text}: a SentencePiece .model file, which llmtrain does not read; give the "
                "model's tokenizer.json (transformers' AutoTokenizer.from_pretrained(...)"
                ".save_pretrained(DIR) writes one)"
            )
        else:
            kind, path = text, ""
    raw: dict[str, Any] = {"kind": kind}
    if path:
        raw["path"] = path
    for item in extra:
        key, sep, value = item.partition("=")
        if not sep:
            raise UserError(f"tokenizer option {item!r}: expected key=value")
        raw[key] = json.loads(value) if value[:1] in "[{" or value in ("true", "false") else value
    from llmtrain.core_mesh.config import structure

    return structure(raw, _tokenizer_choice_type(), plugins=plugins, source="--tokenizer")


def choice_to_raw(choice: Choice, plugins: PluginManager) -> dict[str, Any]:
    """Plain data for a tokenizer choice (stored in dataset metadata, sent to worker processes)."""
    from llmtrain.core_mesh.config import make_converter, unstructure

    raw: dict[str, Any] = unstructure(choice, converter=make_converter(plugins))  # attrs: a dict
    return raw


def tokenizer_from_raw(raw: dict[str, Any], plugins: PluginManager | None = None) -> Any:
    """The tokenizer a plugin builds (Any: plugins' tokenizers have more than the core
    `Tokenizer` protocol, e.g. `token_id`, `with_fast`)."""
    from llmtrain.core_mesh.config import structure
    from llmtrain.core_mesh.plugins import PluginManager

    if plugins is None:
        plugins = PluginManager().load_entry_points()
    choice = structure(raw, _tokenizer_choice_type(), plugins=plugins)
    return plugins.build(TOKENIZER, choice)
