"""YAML a config may not be (issue 52): nested aliases (a "billion laughs"), deep nesting and
numbers beyond any option are one ConfigError at their line, found while the YAML is composed,
before anything expands them."""

from __future__ import annotations

import pytest

from llmtrain.core_mesh import config as config_module
from llmtrain.core_mesh.config import MAX_DEPTH, MAX_VALUES, ConfigError, parse_yaml


def alias_bomb(levels: int = 9) -> str:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]")
    return "\n".join(lines) + "\n"


def one_problem(text: str) -> str:
    with pytest.raises(ConfigError) as caught:
        parse_yaml(text, "run.yaml")
    assert len(caught.value.problems) == 1
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_an_alias_bomb_is_refused_after_a_bounded_number_of_nodes(monkeypatch):
    composed = []
    compose = config_module._Loader.compose_node

    def counting(self, parent, index):
        composed.append(1)
        return compose(self, parent, index)

    monkeypatch.setattr(config_module._Loader, "compose_node", counting)
    message = one_problem(alias_bomb())
    # refused at a5, the first level past the budget: 9**6 values once expanded
    assert message.startswith(f"run.yaml:6: this value holds more than {MAX_VALUES} values")
    assert "alias" in message
    assert len(composed) < 200  # each node composed once; nothing expanded


def test_aliases_within_the_budget_still_work():
    raw = parse_yaml("base: &b {lr: 0.1}\nrun: {opt: *b}\nlist: &l [1, 2]\nmore: [*l, *l]\n")
    assert raw["run"]["opt"] == {"lr": 0.1}
    assert raw["more"] == [[1, 2], [1, 2]]


def test_deep_nesting_is_one_line_not_a_recursion_error():
    deep = "x: " + "[" * 10_000 + "]" * 10_000 + "\n"
    assert one_problem(deep) == (
        f"run.yaml:1: nested more than {MAX_DEPTH} levels deep; no config needs that many"
    )
    ok = "x: " + "[" * 50 + "]" * 50 + "\n"
    assert parse_yaml(ok) is not None


def test_huge_numbers_are_one_line():
    assert one_problem("training:\n  steps: 1e400\n") == (
        "run.yaml:2: 1e400 is beyond the largest number a float holds (about 1.8e308)"
    )
    assert one_problem("steps: " + "9" * 10_000 + "\n") == (
        "run.yaml:1: a number of 10000 digits; no option takes more than 100"
    )
    # what YAML means by infinity stays what the converter refuses with its own message
    assert parse_yaml("x: .inf\ny: 18446744073709551615\nz: 1.5e308\n") == {
        "x": float("inf"),
        "y": 2**64 - 1,
        "z": 1.5e308,
    }


def test_an_override_is_bounded_too():
    with pytest.raises(ConfigError, match="beyond the largest number"):
        config_module.parse_override("training.steps=1e400")


def test_safe_loading_is_kept():
    with pytest.raises(ConfigError, match="invalid YAML"):
        parse_yaml("x: !!python/object/apply:os.system ['true']\n")
