"""Shared test setup for downstream: one torch thread, the installed plugins, task files written
in their published layouts (the rows: downstream_layouts.py), the bytes tokenizer, a tiny model
and a by-hand scorer."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from shared_fixtures import one_torch_thread  # noqa: F401

from llmtrain.core_mesh.config import Choice, structure
from llmtrain.core_mesh.interfaces import TaskItem
from llmtrain.core_mesh.plugins import PluginManager
from llmtrain.data_pack.tokenizer import ENDOFTEXT, BytesOptions, BytesTokenizer

# the tests import the published rows from downstream_layouts.py beside this file (pytest's
# importlib mode puts no test folder on sys.path)
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def plugins() -> PluginManager:
    """Every installed plugin (the built-in tasks, models and tokenizers among them)."""
    pm = PluginManager(blocked=()).load_entry_points()
    assert pm.problems == [], pm.problems
    return pm


@pytest.fixture
def write_jsonl(tmp_path: Path) -> Callable[[str, Sequence[Any]], str]:
    """write_jsonl(name, records) -> path: one `json.dumps` line per record (a str record is
    written as it is, so tests can plant bad lines)."""

    def write(name: str, records: Sequence[Any]) -> str:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
        path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        return str(path)

    return write


@pytest.fixture(scope="session")
def byte_tokenizer() -> BytesTokenizer:
    """UTF-8 bytes as ids 0-255 and the end-of-document token 256: vocabulary 257."""
    return BytesTokenizer(BytesOptions(special_tokens=[ENDOFTEXT]))


@pytest.fixture(scope="session")
def tiny_model(plugins: PluginManager) -> Callable[..., torch.nn.Module]:
    """tiny_model(seed=0) -> the `tiny` preset (vocabulary 257, 64 positions), initialised from
    the seed, in eval mode."""

    def build(seed: int = 0, max_seq_len: int = 64) -> torch.nn.Module:
        choice = structure(
            {"kind": "tiny", "vocab_size": 257, "max_seq_len": max_seq_len},
            Choice.of("model"),
            plugins=plugins,
        )
        torch.manual_seed(seed)
        model = plugins.build("model", choice)
        model.init_weights()
        return model.eval()

    return build


@pytest.fixture(scope="session")
def by_hand() -> Callable[[torch.nn.Module, Sequence[int], int], tuple[float, bool]]:
    """by_hand(model, tokens, scored) -> (log-likelihood of the last `scored` tokens, whether
    each was the arg-max): one plain forward of the row alone and a full log-softmax."""

    @torch.no_grad()
    def score(model: torch.nn.Module, tokens: Sequence[int], scored: int) -> tuple[float, bool]:
        ids = torch.tensor([list(tokens)])
        logp = torch.log_softmax(model(ids[:, :-1])[0].double(), dim=-1)
        targets = ids[0, 1:]
        positions = range(len(targets) - scored, len(targets))
        ll = sum(float(logp[p, targets[p]]) for p in positions)
        greedy = all(int(logp[p].argmax()) == int(targets[p]) for p in positions)
        return ll, greedy

    return score


@attrs.frozen
class ListTask:
    """A `Task` over items made in the test."""

    name: str
    scoring: str
    listed: tuple[TaskItem, ...]

    def items(self) -> list[TaskItem]:
        return list(self.listed)


@pytest.fixture(scope="session")
def list_task() -> Callable[..., ListTask]:
    """list_task(scoring, items, name="listed") -> a Task over those items."""

    def make(scoring: str, items: Sequence[TaskItem], name: str = "listed") -> ListTask:
        return ListTask(name, scoring, tuple(items))

    return make
