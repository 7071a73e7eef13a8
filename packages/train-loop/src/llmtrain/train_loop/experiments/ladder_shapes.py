"""The shapes a model ladder chooses from (see `ladder.py`): the rule by which the base config's
model grows (fixed head_dim and query heads per kv head, layers inside an aspect-ratio band), every
shape's exact non-embedding parameter count from the model built on the meta device, the shape
nearest a target count, and the smallest budget at which every ratio has a shape."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from llmtrain.core_mesh.config import Choice
from llmtrain.core_mesh.errors import UserError
from llmtrain.core_mesh.interfaces import ModelDescription
from llmtrain.core_mesh.plugins import MODEL, PluginManager

# a rung whose nearest shape misses N by more is refused: its budget sits where shapes are too
# coarse (the smallest models of a wide head_dim) and its point would mislead a fit
TOLERANCE = 0.10
SHAPE_KEYS = ("d_model", "n_layers", "n_heads")


@attrs.frozen
class ShapeRule:
    """How the base config's model grows: what stays fixed while d_model and n_layers change."""

    head_dim: int
    kv_group: int  # query heads per key/value head
    sets_kv_heads: bool  # the base sets n_kv_heads (else it stays unset)
    mlp_ratio: float | None  # the base's mlp_hidden / d_model, when it sets mlp_hidden
    mlp_multiple: int
    aspect: tuple[float, float]

    @property
    def width_step(self) -> int:
        return self.head_dim * self.kv_group

    def shape(self, d_model: int, n_layers: int) -> dict[str, int]:
        """The model options of one shape, as the run config's `model:` keys."""
        n_heads = d_model // self.head_dim
        shape = {"d_model": d_model, "n_layers": n_layers, "n_heads": n_heads}
        if self.sets_kv_heads:
            shape["n_kv_heads"] = n_heads // self.kv_group
        if self.mlp_ratio is not None:
            multiple = self.mlp_multiple
            shape["mlp_hidden"] = max(
                multiple, round(self.mlp_ratio * d_model / multiple) * multiple
            )
        return shape

    def layer_counts(self, d_model: int) -> range:
        low, high = self.aspect
        return range(max(1, math.ceil(d_model / high)), math.floor(d_model / low) + 1)


def compact(value: float) -> str:
    """1e15 -> '1e15', 3e15 -> '3e15', 1.5e16 -> '1.5e16' (a budget as people write it)."""
    return re.sub(r"e\+?0*(\d)", r"e\1", f"{value:.3g}")


def shape_rule(options: Any, kind: str, aspect: tuple[float, float]) -> ShapeRule:
    """The rule for the base's model options; a model kind without transformer shape keys is
    refused (the ladder knows only d_model / n_layers / n_heads)."""
    fields = {a.name for a in attrs.fields(type(options))} if attrs.has(type(options)) else set()
    missing = [k for k in SHAPE_KEYS if k not in fields]
    if missing:
        raise UserError(
            f"--ladder: model kind {kind!r} ({type(options).__name__}) has no "
            f"{', '.join(missing)}; the ladder shapes transformers through d_model, n_layers and "
            "n_heads: use a model kind that has them, or sweep its own size keys with --zip"
        )
    n_heads = options.n_heads
    kv_heads = getattr(options, "n_kv_heads", None)
    mlp_hidden = getattr(options, "mlp_hidden", None)
    return ShapeRule(
        head_dim=getattr(options, "head_dim", options.d_model // n_heads),
        kv_group=n_heads // (kv_heads or n_heads),
        sets_kv_heads=kv_heads is not None,
        mlp_ratio=None if mlp_hidden is None else mlp_hidden / options.d_model,
        mlp_multiple=getattr(options, "mlp_multiple_of", 1),
        aspect=aspect,
    )


def meta_describer(
    plugins: PluginManager, choice: Choice
) -> Callable[[dict[str, int]], ModelDescription]:
    """shape -> the `ModelDescription` of the base model with that shape, built on the meta
    device (no memory) by its plugin: its exact parameter counts and FLOPs per token."""
    import torch

    options = plugins.options_of("model", choice)
    described: dict[tuple[tuple[str, int], ...], ModelDescription] = {}

    def describe(shape: dict[str, int]) -> ModelDescription:
        key = tuple(sorted(shape.items()))
        if key not in described:
            sized = attrs.evolve(choice, options=attrs.evolve(options, **shape))
            with torch.device("meta"):
                model = plugins.build(MODEL, sized)
            described[key] = model.describe()
        return described[key]

    return describe


class ShapeSpace:
    """Every shape of a rule, with its exact non-embedding count, enumerated lazily: widths grow
    by head_dim x kv_group, each with the layer counts of the aspect band. The count of a width
    comes from its model at 1 and 2 layers (blocks are of one size)."""

    def __init__(self, rule: ShapeRule, count: Callable[[dict[str, int]], int]):
        self.rule = rule
        self.count = count
        # (d_model, the layer counts in the band, params at the fewest, params per block)
        self._widths: list[tuple[int, range, int, int]] = []
        self._next = rule.width_step

    def _width(self, i: int) -> tuple[int, range, int, int]:
        while len(self._widths) <= i:
            d_model = self._next
            self._next += self.rule.width_step
            layers = self.rule.layer_counts(d_model)
            if not layers:
                continue
            one = self.count(self.rule.shape(d_model, 1))
            per_block = self.count(self.rule.shape(d_model, 2)) - one
            self._widths.append((d_model, layers, one + (layers[0] - 1) * per_block, per_block))
        return self._widths[i]

    def widths(self, limit: float) -> list[tuple[int, range, int, int]]:
        """The widths up to the first whose fewest layers count more than `limit` (included)."""
        out, i = [], 0
        while True:
            width = self._width(i)
            out.append(width)
            if width[2] > limit:
                return out
            i += 1

    def shapes(self, limit: float) -> list[tuple[int, int, int]]:
        """(params, d_model, n_layers) of every shape of `widths(limit)`, widths then layers
        ascending."""
        return [
            (fewest + (n - layers[0]) * per_block, d_model, n)
            for d_model, layers, fewest, per_block in self.widths(limit)
            for n in layers
        ]

    def smallest(self) -> tuple[int, int, int]:
        d_model, layers, fewest, _ = self._width(0)
        return fewest, d_model, layers[0]

    def nearest(self, target: float) -> tuple[int, int, int]:
        """The shape nearest `target` parameters (ties: the aspect nearest the band's middle,
        then the narrower)."""
        middle = math.sqrt(self.rule.aspect[0] * self.rule.aspect[1])
        return min(
            self.shapes(2 * target),
            key=lambda s: (abs(s[0] - target), abs(math.log(s[1] / s[2] / middle))),
        )

    def problem(self, target: float) -> str | None:
        """Why a rung of `target` parameters has no shape, or None when it has one."""
        least, d_model, n_layers = self.smallest()
        if target < least:
            return (
                f"below the smallest shape (d_model {d_model}, {_layers(n_layers)}: "
                f"{least:,} parameters)"
            )
        params, d_model, n_layers = self.nearest(target)
        if abs(params - target) > TOLERANCE * target:
            return (
                f"the nearest shape (d_model {d_model}, {_layers(n_layers)}: {params:,}) is "
                f"{params / target - 1:+.0%} off, more than {TOLERANCE:.0%}"
            )
        return None


def _layers(n: int) -> str:
    return f"{n} layer{'s' if n != 1 else ''}"


def smallest_budget(
    ratios: Sequence[float], space: ShapeSpace, at_least: float = 0.0
) -> float | None:
    """The smallest budget from `at_least` on (rounded up to 2 or 3 significant digits) at which
    every ratio's rung has a shape, or None if there is none below 1e30. The budgets where one
    ratio works start where its N reaches the smallest shape or comes within 10% of a shape
    (N = p / 1.1): the smallest budget where all work is `at_least` or one of those starts."""
    least = space.smallest()[0]
    low = min(ratios)
    limit = max(4.0 * least, math.sqrt(at_least / (6 * low)))
    while 6 * low * limit**2 < 1e30:
        starts = [least] + [p / (1 + TOLERANCE) for p, _, _ in space.shapes(limit)]
        trusted = 6 * low * (limit / (1 + TOLERANCE)) ** 2  # later shapes start above this
        candidates = {6 * r * t * t for r in ratios for t in starts if t >= least}
        for candidate in sorted({at_least, *(c for c in candidates if c > at_least)}):
            if candidate >= trusted:
                break
            if candidate <= 0:
                continue
            for budget in (_round_up(candidate, 2), _round_up(candidate, 3)):
                if all(space.problem(math.sqrt(budget / (6 * r))) is None for r in ratios):
                    return budget
        limit *= 4
    return None


def _round_up(value: float, digits: int) -> float:
    """`value` rounded up to `digits` significant digits, as the command line reads it back."""
    scale = 10 ** (math.floor(math.log10(value)) - digits + 1)
    return float(compact(math.ceil(value / scale * (1 - 1e-12)) * scale))
