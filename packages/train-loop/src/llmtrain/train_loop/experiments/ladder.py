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
then counted whole. The shapes and their counts are `ladder_shapes.py`'s; this module turns
budgets and ratios into rungs, checks the flags and prints the table.

Steps = ceil(D / tokens per step), where a step is the run's global batch (`data.batch_sizes`
for the data-parallel size of the sweep's processes) x seq_len; the run's tokens are then within
one step of D. The table reports the actual N, D, D / N and C = F D of each rung.

A rung that has no shape is an error, and the error lists every such rung (its budget, ratio,
target N and why: below the smallest shape, or the nearest shape too far) with the smallest
budget at which every given ratio has a shape (`smallest_budget`), so one try finds a ladder.

`--preset NAME` fills the budgets, ratios and aspect band that flags leave unset (`PRESETS`):
`laptop` sizes six runs that train on one CPU in about two minutes from a base like
`examples/ladder-laptop.yaml` (head_dim 8).

The keys a rung sets (`RUNG_KEYS`: the model's shape and the run length) are never given by
hand on the sweep's command line, in any spelling: an override `model.n_heads=8`, one inside a
mapping `model={kind: tiny, n_heads: 8}`, or an axis. Axes also may not vary what the rungs are
sized from (`LADDER_OWNS`: the model, the batch, seq_len, the mesh). `refuse_keys` is that rule,
checked before anything is sized. The base config file gives the shape the ladder scales.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import attrs

from llmtrain.core_mesh.config import ConfigError, ConfigValueError, Problem, parse_override
from llmtrain.core_mesh.errors import UserError
from llmtrain.core_mesh.interfaces import ModelDescription
from llmtrain.core_mesh.mesh import MeshError
from llmtrain.core_mesh.plugins import PluginManager
from llmtrain.train_loop.experiments.ladder_branches import Branch, trained_steps
from llmtrain.train_loop.experiments.ladder_shapes import (
    TOLERANCE,
    ShapeRule,
    ShapeSpace,
    compact,
    meta_describer,
    shape_rule,
    smallest_budget,
)
from llmtrain.train_loop.run_config import RunConfig, checked_model_options

DEFAULT_ASPECT = (32.0, 128.0)
# the keys every rung sets: given by hand (an override or an axis, in any spelling) they are
# refused, whether or not this base sets them
RUNG_KEYS = (
    "model.d_model",
    "model.n_layers",
    "model.n_heads",
    "model.n_kv_heads",
    "model.mlp_hidden",
    "training.steps",
    "training.tokens",
)
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
class Preset:
    """Budgets, ratios and an aspect band that fit together, for `--preset NAME`."""

    budgets: tuple[float, ...]
    ratios: tuple[float, ...]
    aspect: tuple[float, float]
    about: str


PRESETS = {
    # 2 budgets x 3 ratios: two IsoFLOP profiles of three sizes (about 25k to 200k non-embedding
    # parameters with head_dim 8), 6 runs of 100 to 1,000 steps of 1,024 tokens: about two
    # minutes on one CPU for examples/ladder-laptop.yaml
    "laptop": Preset(
        budgets=(1.2e11, 4.8e11),
        ratios=(2.0, 8.0, 32.0),
        aspect=(16.0, 64.0),
        about="six runs on one CPU in minutes, from a base with head_dim 8 "
        "(examples/ladder-laptop.yaml)",
    ),
}


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
    by_size: bool = False  # sized from a parameter count (--params), not a budget

    @property
    def label(self) -> dict[str, object]:
        """What the run id shows: `C=1e15,r=20`, or `N=50k,r=20` for a ladder by size."""
        if self.by_size:
            return {"N": compact(self.target_params), "r": _number(self.tokens_per_param)}
        return {"C": compact(self.budget), "r": _number(self.tokens_per_param)}

    @property
    def actual_budget(self) -> float:
        return self.flops_per_token * self.tokens

    @property
    def actual_ratio(self) -> float:
        return self.tokens / self.params

    def with_asked(
        self, *, budget: float, ratio: float, target: float, by_size: bool = False
    ) -> Rung:
        """This rung as the budget (or size) and ratio it was sized for."""
        return attrs.evolve(
            self, budget=budget, tokens_per_param=ratio, target_params=target, by_size=by_size
        )

    def overrides(self) -> dict[str, object]:
        """The config keys this rung sets in the base config."""
        out: dict[str, object] = {f"model.{key}": value for key, value in self.shape.items()}
        out["training.steps"] = self.steps
        if self.clears_tokens:
            out["training.tokens"] = None
        return out

    def record(self) -> dict[str, object]:
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


def refuse_keys(overrides: Sequence[str], axes: Sequence[tuple[str, str]]) -> None:
    """The one rule for the keys a ladder meets on the command line, whatever their spelling:
    `overrides` (`KEY=VALUE`, a mapping value setting each key inside it) may not set what a
    rung sets (`RUNG_KEYS`); `axes` ((key, flag) of --grid, --zip) may not vary that or what the
    rungs are sized from (`LADDER_OWNS`). Every refused key in one message, before sizing."""
    refused: list[str] = []
    for text in overrides:
        try:
            path, value = parse_override(text)
        except ConfigError:
            continue  # the sweep reports a malformed override as it does without --ladder
        for key in _keys_set(path, value):
            if any(_overlaps(key, owned) for owned in RUNG_KEYS):
                refused.append(f"{key} (override {text!r})")
    for key, flag in axes:
        if any(_overlaps(key, owned) for owned in (*RUNG_KEYS, *LADDER_OWNS)):
            refused.append(f"{key} ({flag})")
    if refused:
        raise UserError(
            f"--ladder sets each rung's {', '.join(RUNG_KEYS)} and sizes the rungs from the "
            "base config's model, batch, seq_len and mesh; refused: "
            f"{'; '.join(dict.fromkeys(refused))}. Give the base's shape in the base config "
            "file (the ladder keeps its head_dim = d_model / n_heads, n_heads / n_kv_heads and "
            "mlp_hidden / d_model), and sweep the model, batch or mesh in separate ladders"
        )


def _keys_set(path: tuple[str | int, ...], value: object) -> list[str]:
    """The dotted keys an override sets: `model.n_heads=8` one, `model={n_heads: 8, ...}` each
    key in the mapping (nested ones too)."""
    key = ".".join(str(p) for p in path)
    if isinstance(value, dict) and value:
        return [k for name, item in value.items() for k in _keys_set((*path, name), item)]
    return [key]


def _overlaps(key: str, owned: str) -> bool:
    """`model.d_model` is within `model.`, `data.seq_len` within `data.seq_len`, and `model`
    (the whole section) overlaps both `model.` and `model.n_heads`."""
    owned = owned.rstrip(".")
    return key == owned or key.startswith(f"{owned}.") or owned.startswith(f"{key}.")


# --- the run length ---


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


@attrs.frozen
class Sizer:
    """What sizing rungs from a base config needs: its shape rule within the aspect band, the
    model counted on the meta device, the tokens per step and the space of shapes."""

    config: RunConfig
    rule: ShapeRule
    describe: Callable[[dict[str, int]], ModelDescription]
    step_tokens: int
    space: ShapeSpace

    @classmethod
    def of(
        cls,
        config: RunConfig,
        plugins: PluginManager,
        aspect: tuple[float, float],
        world: int,
        source: str,
    ) -> Sizer:
        options = checked_model_options(plugins, config.model)
        rule = shape_rule(options, config.model.kind, aspect)
        describe = meta_describer(plugins, config.model)
        space = ShapeSpace(rule, lambda shape: describe(shape).n_non_embedding_params)
        return cls(config, rule, describe, tokens_per_step(config, world, source), space)

    def rung(self, target: float, *, budget: float = 0.0, ratio: float = 0.0) -> Rung:
        """The shape nearest `target` non-embedding parameters, trained in whole steps for at
        least the tokens of a compute `budget` (C / its FLOPs per token) or `ratio` tokens per
        parameter of its exact count (what was asked for is filled in by `Rung.with_asked`)."""
        _, d_model, n_layers = self.space.nearest(target)
        shape = self.rule.shape(d_model, n_layers)
        description = self.describe(shape)  # the whole model counted, not from its blocks
        params = description.n_non_embedding_params
        # the model's own FLOPs (attention included), as `fit` groups budgets
        per_token = float(description.flops_per_token(self.config.data.seq_len))
        wanted = budget / per_token if budget else ratio * params
        steps = math.ceil(wanted / self.step_tokens)
        return Rung(
            budget=0.0,
            tokens_per_param=0.0,
            target_params=0.0,
            target_tokens=wanted,
            shape=shape,
            params=params,
            steps=steps,
            tokens=steps * self.step_tokens,
            clears_tokens=self.config.training.tokens is not None,
            flops_per_token=per_token,
        )


def ladder(
    config: RunConfig,
    plugins: PluginManager,
    *,
    budgets: Sequence[float],
    ratios: Sequence[float],
    aspect: tuple[float, float] = DEFAULT_ASPECT,
    world: int = 1,
    source: str = "the base config",
) -> list[Rung]:
    """One rung per (budget, ratio), budgets outer, each with its shape and steps: D = C / F,
    F the shape's training FLOPs per token, so every rung of a budget costs C."""
    sizer = Sizer.of(config, plugins, aspect, world, source)
    failed = [
        (budget, ratio, target, why)
        for budget in budgets
        for ratio in ratios
        if (why := sizer.space.problem(target := math.sqrt(budget / (6.0 * ratio)))) is not None
    ]
    if failed:
        raise UserError(_no_shape_message(failed, budgets, ratios, sizer.rule, sizer.space))
    rungs = []
    for budget in budgets:
        for ratio in ratios:
            target = math.sqrt(budget / (6.0 * ratio))
            rungs.append(
                sizer.rung(target, budget=budget).with_asked(
                    budget=budget, ratio=ratio, target=target
                )
            )
    return rungs


def ladder_by_size(
    config: RunConfig,
    plugins: PluginManager,
    *,
    sizes: Sequence[float],
    ratios: Sequence[float],
    aspect: tuple[float, float] = DEFAULT_ASPECT,
    world: int = 1,
) -> list[Rung]:
    """One shape per size N (non-embedding parameters; the same shape rule as `ladder`), each
    trained at every ratio r: D = r x the shape's exact count. Sizes outer, ratios inner."""
    sizer = Sizer.of(config, plugins, aspect, world, "the base config")
    failed = [(n, why) for n in sizes if (why := sizer.space.problem(n)) is not None]
    if failed:
        listed = "; ".join(f"N={compact(n)}: {why}" for n, why in failed)
        low, high = (_number(a) for a in sizer.rule.aspect)
        raise UserError(
            f"--params: {len(failed)} of {len(sizes)} sizes have no model shape within "
            f"{TOLERANCE:.0%} (the base's head_dim {sizer.rule.head_dim}, d_model / n_layers "
            f"in --aspect-ratio {low},{high}): {listed}; give other sizes, widen "
            "--aspect-ratio, or give the base a smaller head_dim = d_model / n_heads"
        )
    rungs = []
    for size in sizes:
        for ratio in ratios:
            rung = sizer.rung(size, ratio=ratio)
            rungs.append(
                rung.with_asked(budget=rung.actual_budget, ratio=ratio, target=size, by_size=True)
            )
    return rungs


def _no_shape_message(
    failed: Sequence[tuple[float, float, float, str]],
    budgets: Sequence[float],
    ratios: Sequence[float],
    rule: ShapeRule,
    space: ShapeSpace,
) -> str:
    """Every rung without a shape, one line each, and the smallest budget that works."""
    given = ",".join(str(_number(r)) for r in ratios)
    low, high = (_number(a) for a in rule.aspect)
    lines = [
        f"--budgets {','.join(compact(c) for c in budgets)}: {len(failed)} of "
        f"{len(budgets) * len(ratios)} rungs have no model shape within {TOLERANCE:.0%} of "
        f"N = sqrt(C / 6r) (the base's head_dim {rule.head_dim}, {rule.kv_group} query "
        f"head(s) per kv head, d_model / n_layers in --aspect-ratio {low},{high}):"
    ]
    for budget, ratio, target, why in failed:
        lines.append(f"  C={compact(budget)}, r={_number(ratio)}: N = {target:,.0f}: {why}")
    smallest = smallest_budget(ratios, space)
    if smallest is not None:
        lines.append(
            f"the smallest budget with a shape for every ratio of --tokens-per-param {given} "
            f"is {compact(smallest)}"
        )
    bad = {budget for budget, *_ in failed}
    fixed = [c if c not in bad else smallest_budget(ratios, space, at_least=c) for c in budgets]
    found = [c for c in fixed if c is not None]
    if len(found) == len(fixed):
        lines.append(
            "the next budgets that work above the failing ones: --budgets "
            + ",".join(compact(c) for c in dict.fromkeys(found))
        )
    lines.append(
        "(or widen --aspect-ratio, or give the base a smaller head_dim = d_model / n_heads)"
    )
    return "\n".join(lines)


def table(rows: Sequence[tuple[str, Rung, Branch]]) -> str:
    """The dry-run table: one line per (run id, rung, its decay branch); for a branched ladder
    also where each rung starts and the tokens it trains, and the ladder's tokens against
    training every rung from scratch."""
    branched = any(branch.trunk is not None for _, _, branch in rows)
    header = ["run id", "C", "tokens/param", "N", "D", "D/N", "actual C", "n_layers"]
    header += ["d_model", "n_heads", "steps", *(["from", "trained"] if branched else [])]
    lines = [header]
    for run_id, rung, branch in rows:
        line = [
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
        ]
        if branched:
            line.append("-" if branch.trunk is None else f"{branch.trunk} @{branch.start}")
            line.append(f"{_trained_tokens(rung, branch):,}")
        lines.append(line)
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = []
    for line in lines:
        cells = [line[0].ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(line[1:], widths[1:], strict=True)
        ]
        out.append("  ".join(cells).rstrip())
    if branched:
        trained = sum(_trained_tokens(rung, branch) for _, rung, branch in rows)
        scratch = sum(rung.tokens for _, rung, _ in rows)
        out.append(
            f"tokens trained: {trained:,} of the {scratch:,} every rung from scratch would "
            f"train ({trained / scratch:.0%}): each branch goes on from its trunk's checkpoint"
        )
    return "\n".join(out)


def _trained_tokens(rung: Rung, branch: Branch) -> int:
    return rung.tokens // rung.steps * trained_steps(rung.steps, branch)
