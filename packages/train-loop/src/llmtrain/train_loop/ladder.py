"""Model ladders for `llmtrain sweep BASE.yaml --ladder`: model sizes and run lengths from
compute budgets, for scaling-law studies.

A ladder is configured on the command line like every other sweep axis (there is no `ladder:`
block in the run config: a run config describes one run, a sweep's axes are its flags):

    llmtrain sweep base.yaml --ladder --budgets 1e15,3e15,1e16 --tokens-per-param 10,20,40
        [--aspect-ratio 32,128] [--dry-run]

Each rung is one compute budget C (FLOPs) and one tokens-per-parameter ratio r (budgets and
ratios are crossed). Its target model size is N = sqrt(C / 6r) non-embedding parameters (C = 6 N
D with D = r N). Its data is then D = C / F tokens, F the chosen shape's training FLOPs per token
as the model reports them (6 x the parameters a token multiplies by, the LM head's V x d
included whether tied or not, plus attention: what `llmtrain fit` and MFU count): every rung of a
budget costs C, so a budget's rungs are one IsoFLOP profile. The tokens per parameter a rung gets,
D / N, shown beside r, differs from r where the head and attention are a large share of a small
model's FLOPs (fewer tokens) or the nearest shape misses N (more tokens for a smaller model).

The shape rule, from the base config's `model:` section:
- head_dim = d_model / n_heads of the base stays fixed, and so does the base's n_heads /
  n_kv_heads ratio g; so d_model is a multiple of head_dim x g, n_heads = d_model / head_dim
  and n_kv_heads = n_heads / g (left unset when the base leaves it unset);
- n_layers keeps the aspect ratio d_model / n_layers inside the band (32 to 128 by default,
  the range of Kaplan et al.'s and OLMo's ladders);
- an `mlp_hidden` set in the base scales with d_model (the base's mlp_hidden / d_model, rounded
  to `mlp_multiple_of`); left unset, the model derives it from d_model itself;
- of all the shapes in the band, the one whose non-embedding parameter count is nearest N
  (ties: the aspect ratio nearest the band's geometric middle). A budget below the smallest
  shape, or one whose nearest shape is more than 10% from N, is refused.

Parameter counts are exact: every count comes from the model built on the meta device through
the model plugin (the path training and `llmtrain estimate` take), as its `describe()` reports
`n_non_embedding_params` (a Mixture-of-Experts model counts all its experts). The search assumes
blocks of one size (a count at 1 and 2 layers gives the cost of a block); the chosen shape is
then counted whole.

Steps = ceil(D / tokens per step), where a step is the run's global batch (`data.batch_sizes`
for the data-parallel size of the sweep's processes) x seq_len; the run's tokens are then within
one step of D. The table reports the actual N, D, D / N and C = F D of each rung.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from llmtrain.core_mesh.config import ConfigError, ConfigValueError, Problem
from llmtrain.core_mesh.errors import UserError
from llmtrain.core_mesh.mesh import MeshError
from llmtrain.train_loop.run_config import RunConfig, checked_model_options

DEFAULT_ASPECT = (32.0, 128.0)
# a rung whose nearest shape misses N by more is refused: its budget sits where shapes are too
# coarse (the smallest models of a wide head_dim) and its point would mislead a fit
TOLERANCE = 0.10
SHAPE_KEYS = ("d_model", "n_layers", "n_heads")
# sweep axes that would change the model's size or the tokens per step the ladder computed
LADDER_OWNS = (
    "model.",
    "data.seq_len",
    "data.micro_batch",
    "data.grad_accum",
    "data.global_batch",
    "mesh.",
    "training.steps",
    "training.tokens",
)


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


@attrs.frozen
class Rung:
    """One run of the ladder: the budget and ratio asked for, the shape and steps chosen."""

    budget: float
    tokens_per_param: float
    target_params: float
    target_tokens: float
    shape: dict[str, int]
    params: int  # non-embedding, exact
    steps: int
    tokens: int  # steps x tokens per step
    clears_tokens: bool  # the base sets training.tokens, which steps replaces
    flops_per_token: float  # the shape's training FLOPs per token at the run's seq_len

    @property
    def label(self) -> dict[str, Any]:
        """What the run id shows: `C=1e15,r=20`."""
        return {"C": compact(self.budget), "r": _number(self.tokens_per_param)}

    @property
    def actual_budget(self) -> float:
        return self.flops_per_token * self.tokens

    @property
    def actual_ratio(self) -> float:
        return self.tokens / self.params

    def overrides(self) -> dict[str, Any]:
        """The config keys this rung sets in the base config."""
        out: dict[str, Any] = {f"model.{key}": value for key, value in self.shape.items()}
        out["training.steps"] = self.steps
        if self.clears_tokens:
            out["training.tokens"] = None
        return out

    def record(self) -> dict[str, Any]:
        """The rung as the sweep's manifest keeps it (for scaling-law fits)."""
        return {
            "budget": self.budget,
            "tokens_per_param": self.tokens_per_param,
            "target_params": self.target_params,
            "target_tokens": self.target_tokens,
            "params": self.params,
            "tokens": self.tokens,
            "actual_budget": self.actual_budget,
            "actual_tokens_per_param": self.actual_ratio,
            "flops_per_token": self.flops_per_token,
            "steps": self.steps,
            **self.shape,
        }


def compact(value: float) -> str:
    """1e15 -> '1e15', 3e15 -> '3e15', 1.5e16 -> '1.5e16' (a budget as people write it)."""
    return re.sub(r"e\+?0*(\d)", r"e\1", f"{value:.3g}")


def _number(value: float) -> float | int:
    return int(value) if float(value).is_integer() else value


# --- the flags ---


def parse_positive_list(text: str | None, flag: str, example: str) -> list[float]:
    """`1e15,3e15` -> [1e15, 3e15]: positive, finite, each once."""
    parts = [p.strip() for p in (text or "").split(",") if p.strip()]
    if not parts:
        raise UserError(
            f"--ladder needs {flag} with one or more comma-separated values, e.g. {flag} {example}"
        )
    values = []
    for part in parts:
        try:
            value = float(part)
        except ValueError:
            raise UserError(f"{flag}: {part!r} is not a number (e.g. {flag} {example})") from None
        if not (math.isfinite(value) and value > 0):
            raise UserError(
                f"{flag}: {part} is not positive; give values above 0 (e.g. {flag} {example})"
            )
        if value in values:
            raise UserError(f"{flag}: {part} is given twice")
        values.append(value)
    return values


def parse_aspect(text: str | None) -> tuple[float, float]:
    if text is None:
        return DEFAULT_ASPECT
    values = parse_positive_list(text, "--aspect-ratio", "32,128")
    if len(values) != 2 or values[0] > values[1]:
        raise UserError(
            f"--aspect-ratio {text!r}: give the band of d_model / n_layers as MIN,MAX (e.g. 32,128)"
        )
    return values[0], values[1]


def check_other_axes(keys: Sequence[str]) -> None:
    """Sweep axes may vary what the ladder leaves alone (optimizer.lr, seeds), not the model or
    the tokens per step it sized the rungs with."""
    owned = [k for k in keys if any(_within(k, owned) for owned in LADDER_OWNS)]
    if owned:
        raise UserError(
            f"--ladder sizes the model and the steps from the base config; {', '.join(owned)} "
            "cannot be swept with it: set them in the base config (or sweep them in separate ladders)"
        )


def _within(key: str, owned: str) -> bool:
    """`model.d_model` is within `model.`; `data.seq_len` within `data.seq_len`."""
    return key.startswith(owned) or key == owned.rstrip(".")


# --- shapes and counts ---


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


def meta_describer(plugins: Any, choice: Any) -> Callable[[dict[str, int]], Any]:
    """shape -> the `ModelDescription` of the base model with that shape, built on the meta
    device (no memory) by its plugin: its exact parameter counts and FLOPs per token."""
    import torch

    options = plugins.options_of("model", choice)
    described: dict[tuple, Any] = {}

    def describe(shape: dict[str, int]) -> Any:
        key = tuple(sorted(shape.items()))
        if key not in described:
            sized = attrs.evolve(choice, options=attrs.evolve(options, **shape))
            with torch.device("meta"):
                model = plugins.build("model", sized)
            described[key] = model.describe()
        return described[key]

    return describe


def nearest_shape(
    target: float, rule: ShapeRule, count: Callable[[dict[str, int]], int]
) -> tuple[dict[str, int], int, dict[str, int], int]:
    """(the shape nearest `target` parameters, its exact count, the smallest shape in the band,
    its count). Widths grow by head_dim x kv_group until even the fewest layers overshoot."""
    middle = math.sqrt(rule.aspect[0] * rule.aspect[1])
    best: tuple[float, float, int, int] | None = None  # (distance, aspect distance, d, layers)
    smallest: tuple[int, int] | None = None
    d_model = rule.width_step
    while True:
        layers = rule.layer_counts(d_model)
        if layers:
            one = count(rule.shape(d_model, 1))
            per_block = count(rule.shape(d_model, 2)) - one
            for n_layers in layers:
                params = one + (n_layers - 1) * per_block
                key = (abs(params - target), abs(math.log(d_model / n_layers / middle)))
                if best is None or key < best[:2]:
                    best = (*key, d_model, n_layers)
            if smallest is None:
                smallest = (d_model, layers[0])
            if one + (layers[0] - 1) * per_block > 2 * target:
                break  # wider shapes only grow
        d_model += rule.width_step
    assert best is not None and smallest is not None
    chosen = rule.shape(best[2], best[3])
    least = rule.shape(*smallest)
    return chosen, count(chosen), least, count(least)


def tokens_per_step(config: RunConfig, world: int, source: str) -> int:
    """Global batch x seq_len, as the trainer reads it for `world` processes."""
    try:
        dp = config.mesh.resolve(world).dp
    except MeshError as exc:
        raise ConfigError([Problem(("mesh",), str(exc), source)], source) from None
    try:
        global_batch, _ = config.data.batch_sizes(dp)
    except ConfigValueError as exc:
        raise ConfigError([Problem(("data", exc.field), str(exc), source)], source) from None
    return global_batch * config.data.seq_len


# --- the ladder ---


def ladder(
    config: RunConfig,
    plugins: Any,
    *,
    budgets: Sequence[float],
    ratios: Sequence[float],
    aspect: tuple[float, float] = DEFAULT_ASPECT,
    world: int = 1,
    source: str = "the base config",
) -> list[Rung]:
    """One rung per (budget, ratio), budgets outer, each with its shape and steps."""
    options = checked_model_options(plugins, config.model)
    rule = shape_rule(options, config.model.kind, aspect)
    describe = meta_describer(plugins, config.model)

    def count(shape: dict[str, int]) -> int:
        return describe(shape).n_non_embedding_params

    step_tokens = tokens_per_step(config, world, source)
    rungs = []
    for budget in budgets:
        for ratio in ratios:
            target = math.sqrt(budget / (6.0 * ratio))
            shape, params, least, least_params = nearest_shape(target, rule, count)
            where = f"--budgets {compact(budget)} with --tokens-per-param {_number(ratio)}"
            if target < least_params:
                raise UserError(
                    f"{where}: too small: N = sqrt(C / 6r) = {target:,.0f} parameters, below the "
                    f"smallest shape in the aspect band (d_model {least['d_model']}, "
                    f"{least['n_layers']} layer(s): {least_params:,}), which needs C >= "
                    f"{compact(6 * ratio * least_params**2)}; give larger budgets, or a base "
                    f"model with a smaller head_dim (now {rule.head_dim})"
                )
            if abs(params - target) > TOLERANCE * target:
                raise UserError(
                    f"{where}: no shape within {TOLERANCE:.0%} of N = {target:,.0f} (nearest: "
                    f"d_model {shape['d_model']}, {shape['n_layers']} layers, {params:,}); "
                    "shapes are too coarse here: give larger budgets or widen --aspect-ratio"
                )
            # the budget in the model's own count (attention included), as `fit` groups budgets
            per_token = float(describe(shape).flops_per_token(config.data.seq_len))
            tokens_wanted = budget / per_token
            steps = math.ceil(tokens_wanted / step_tokens)
            rungs.append(
                Rung(
                    budget=budget,
                    tokens_per_param=ratio,
                    target_params=target,
                    target_tokens=tokens_wanted,
                    shape=shape,
                    params=params,
                    steps=steps,
                    tokens=steps * step_tokens,
                    clears_tokens=config.training.tokens is not None,
                    flops_per_token=per_token,
                )
            )
    return rungs


def table(rows: Sequence[tuple[str, Rung]]) -> str:
    """The dry-run table: one line per (run id, rung)."""
    header = (
        "run id",
        "C",
        "tokens/param",
        "N",
        "D",
        "D/N",
        "actual C",
        "n_layers",
        "d_model",
        "n_heads",
        "steps",
    )
    lines = [header]
    for run_id, rung in rows:
        lines.append(
            (
                run_id,
                compact(rung.budget),
                f"{_number(rung.tokens_per_param)}",
                f"{rung.params:,}",
                f"{rung.tokens:,}",
                f"{rung.actual_ratio:.1f}",
                compact(rung.actual_budget),
                str(rung.shape["n_layers"]),
                str(rung.shape["d_model"]),
                str(rung.shape["n_heads"]),
                str(rung.steps),
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = []
    for line in lines:
        cells = [line[0].ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(line[1:], widths[1:], strict=True)
        ]
        out.append("  ".join(cells).rstrip())
    return "\n".join(out)
