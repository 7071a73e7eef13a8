"""`llmtrain mup-check CONFIG --widths 128,256,512,1024`: µP's coordinate check.

The config's model is built at each width (`d_model` = width; the head size kept, so `n_heads`
and `n_kv_heads` grow with the width; a set `mlp_hidden` scaled alike; `mup_base_width` as the
config has it), initialised from the run seed, and trained a few steps on CPU in this process with
the config's optimizer, built by the same plugin builder the Trainer uses (so µP's per-layer
learning-rate multipliers apply) at the optimizer's lr (no schedule, no clipping). Every step
trains on the next micro-batch of the config's training data (read as the Trainer reads its
windows: real text, whose gradients agree from step to step as µP assumes), then runs one fixed probe batch (the
first micro-batch) through the model and records, by forward hooks (the model is not changed),
the coordinate size `mean(|x|)` of the embedding output, of each block's attention and MLP
outputs and of the block output, and of the logits; and of their change since step 0,
`mean(|x_t - x_0|)` on the same probe. That is the "coordinate check" of Tensor Programs V
(Yang et al. 2022, Fig. 5) and of the `mup` package.

Each kind's size at the last step against width is summarised by its slope in log-log (a least
squares fit of log size on log width): about 0 when the size does not move with width, 0.5 when
it grows as sqrt(width), 1 when linearly. Under µP the activations and their updates stay flat;
under the standard parametrization the logits (and the hidden updates) grow with width.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from llmtrain.core_mesh.cli import Context
from llmtrain.core_mesh.cli_conventions import main_object
from llmtrain.core_mesh.config import ConfigError, ConfigValueError, Problem
from llmtrain.core_mesh.errors import UserError
from llmtrain.core_mesh.plugins import MODEL, OPTIMIZER, PluginManager
from llmtrain.models.config import TransformerConfig
from llmtrain.train_loop.model_source import load_run_config
from llmtrain.train_loop.run_config import RunConfig

if TYPE_CHECKING:
    import torch

PARAMETRIZATIONS = ("standard", "mup")
# the layer kinds, in the order a token meets them; the block kinds are means over the blocks
KINDS = ("embedding", "attention", "mlp", "block", "logits")
FORMATS = (".png", ".svg", ".pdf")
# the verdict's bounds on the last step's log-log slope against width: µP is flat when every
# kind's size and update are within FLAT; standard grows when its logits' slope is above GROWS
FLAT = 0.25
GROWS = 0.35
# fewer heads than this at the smallest width: finite-width noise moves the slopes by 0.1-0.2
# and more (measured on the quickstart's config: 4 heads at width 64)
FEW_HEADS = 8
# what typically makes a kind grow under µP, said when one grows steadily
CAUSES = {
    "embedding": "the embedding's init or lr scaled with width (µP keeps both constant)",
    "attention": "attention scaled by 1/sqrt(head_dim) where the head size grows (µP: 1/d), or "
    "a hidden weight whose lr the optimizer does not scale by base/width",
    "mlp": "a hidden weight whose init or lr is not scaled by base/width (a parameter group "
    "without µP's multiplier)",
    "block": "a residual branch (attention or MLP) whose init or lr is not scaled by base/width",
    "logits": "the output layer's multiplier (µP divides the logits by the width multiplier) or "
    "its lr",
}


@attrs.frozen
class Check:
    """One parametrization's coordinate check: `sizes[kind][w][t]` is mean(|x|) of that kind at
    `widths[w]` after t steps (t = 0: at init); `updates[kind][w][t]` is mean(|x_t - x_0|)."""

    parametrization: str
    widths: tuple[int, ...]
    sizes: dict[str, list[list[float]]]
    updates: dict[str, list[list[float]]]
    losses: list[list[float]]  # [w][t]: the training loss of step t + 1
    head_dim: int | None = None  # the head size kept at every width (None: not known)

    def slope(self, series: dict[str, list[list[float]]], kind: str, step: int = -1) -> float:
        """The log-log slope of `kind` at `step` (default: the last) against width."""
        return loglog_slope(self.widths, [steps[step] for steps in series[kind]])

    def pair_slopes(self, series: dict[str, list[list[float]]], kind: str) -> list[float]:
        """The log-log slope between each two neighbouring widths, at the last step."""
        last = [steps[-1] for steps in series[kind]]
        return [
            loglog_slope(self.widths[i : i + 2], last[i : i + 2])
            for i in range(len(self.widths) - 1)
        ]

    def late_slopes(self, series: dict[str, list[list[float]]], kind: str) -> list[float]:
        """The slope at each step of the last half of training (at least the last step): how
        much the last step's slope moves from step to step, its own noise."""
        steps = len(series[kind][0]) - 1
        return [self.slope(series, kind, t) for t in range(max(1, steps - steps // 2), steps + 1)]

    def as_json(self) -> dict[str, object]:
        return {
            "parametrization": self.parametrization,
            "widths": list(self.widths),
            "sizes": self.sizes,
            "updates": self.updates,
            "losses": self.losses,
            "slopes": {  # null where a kind has no slope (0 at some width)
                what: {k: _finite(self.slope(series, k)) for k in KINDS}
                for what, series in (("sizes", self.sizes), ("updates", self.updates))
            },
        }


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def loglog_slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """The least-squares slope of log y on log x (nan when a y is not positive)."""
    if any(not y > 0 for y in ys):
        return math.nan
    lx = [math.log(x) for x in xs]
    ly = [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    var = sum((x - mx) ** 2 for x in lx)
    return sum((x - mx) * (y - my) for x, y in zip(lx, ly, strict=True)) / var


def parse_widths(text: str) -> tuple[int, ...]:
    """`--widths 128,256,512`: at least two different positive widths, in increasing order."""
    try:
        widths = sorted({int(w) for w in text.split(",") if w.strip()})
    except ValueError:
        raise UserError(
            f"--widths {text}: give comma-separated whole numbers, e.g. 128,256,512"
        ) from None
    if len(widths) < 2 or widths[0] < 1:
        raise UserError(
            f"--widths {text}: give at least two different positive widths, e.g. 128,256,512"
        )
    return tuple(widths)


def width_options(base: TransformerConfig, width: int, parametrization: str) -> TransformerConfig:
    """The config's model at `width`: the head size kept, the heads and a set `mlp_hidden`
    scaled with the width, the parametrization and `mup_base_width` as asked."""
    head_dim = base.head_dim
    if width % head_dim:
        raise UserError(
            f"--widths: {width} is not a multiple of the model's head size {head_dim} "
            "(the check keeps the head size and scales the number of heads); choose widths "
            f"that are multiples of {head_dim}"
        )
    n_heads = width // head_dim
    group = base.n_heads // base.kv_heads  # query heads per key/value head, kept
    if n_heads % group:
        raise UserError(
            f"--widths: {width} gives {n_heads} heads, not a multiple of the model's "
            f"{group} query heads per key/value head; choose widths that are multiples of "
            f"{head_dim * group}"
        )
    # Any: splatted into evolve's keyword arguments, each of its own type
    changes: dict[str, Any] = {
        "d_model": width,
        "n_heads": n_heads,
        "n_kv_heads": None if base.n_kv_heads is None else n_heads // group,
        "parametrization": parametrization,
    }
    if base.mlp_hidden is not None:
        changes["mlp_hidden"] = max(1, round(base.mlp_hidden * width / base.d_model))
    return attrs.evolve(base, **changes)


def _kind_of_module(name: str) -> str | None:
    """The layer kind a hooked module's output is (by its name in the Transformer)."""
    if name == "drop":  # dropout after the token (+ position) embedding: the embedding output
        return "embedding"
    parts = name.split(".")
    if len(parts) == 2 and parts[0] == "blocks":
        return "block"
    if len(parts) == 3 and parts[0] == "blocks" and parts[2] in ("attn", "mlp"):
        return "attention" if parts[2] == "attn" else "mlp"
    return None


def _probe(model: torch.nn.Module, tokens: torch.Tensor) -> dict[str, list[torch.Tensor]]:
    """Each hooked module's output on `tokens` (no grad, dropout off), by kind."""
    import torch

    got: dict[str, list[torch.Tensor]] = {kind: [] for kind in KINDS}
    hooks = []
    for name, module in model.named_modules():
        kind = _kind_of_module(name)
        if kind is None:
            continue

        def keep(m: torch.nn.Module, args: object, out: object, kind: str = kind) -> None:
            if torch.is_tensor(out):
                got[kind].append(out.detach().float().clone())

        hooks.append(module.register_forward_hook(keep))
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = model(tokens)
    finally:
        for hook in hooks:
            hook.remove()
        model.train(was_training)
    got["logits"].append(logits.detach().float())
    return got


def _mean_abs(xs: list[torch.Tensor]) -> float:
    """mean(|x|) of each tensor, averaged over the tensors (the blocks of one kind)."""
    return sum(float(x.abs().mean()) for x in xs) / len(xs)


def batches(config: RunConfig, steps: int, vocab_size: int) -> list[torch.Tensor]:
    """`steps` micro-batches of (micro_batch, seq_len + 1) tokens: the config's training windows
    in the order the Trainer's sampler gives them (its first `steps` micro-batches)."""
    import torch

    from llmtrain.data_pack.loader import open_windows

    data = config.data
    n = data.micro_batch
    windows = open_windows(
        [d.path for d in data.train],
        data.seq_len,
        weights=[d.weight for d in data.train],
        seed=config.seed if data.seed is None else data.seed,
        shuffle=data.shuffle,
        cache_bytes=data.cache_mib << 20,
        storage_options=data.storage_options,
    )
    packed = windows.sources[0].dataset.vocab_size
    if packed > vocab_size:
        raise UserError(
            f"{data.train[0].path} was packed with a tokenizer of {packed} ids, but "
            f"model.vocab_size is {vocab_size}; set model.vocab_size: {packed} (or more)"
        )
    total = len(windows)
    out = []
    for step in range(steps):
        samples = [(step * n + i) % total for i in range(n)]
        out.append(torch.from_numpy(windows.read(samples)["tokens"]))
    return out


def check_width(
    plugins: PluginManager,
    config: RunConfig,
    options: TransformerConfig,
    data: list[torch.Tensor],
    where: str = "config",
) -> tuple[dict[str, list[float]], dict[str, list[float]], list[float]]:
    """Train the model of `options` on `data` (one step a batch) from the run seed; (sizes by
    kind and step, updates by kind and step, losses) on the probe batch `data[0]`."""
    import torch
    import torch.nn.functional as F

    choice = attrs.evolve(config.model, options=options)
    torch.manual_seed(config.seed)
    model: torch.nn.Module = plugins.build(MODEL, choice)
    init = getattr(model, "init_weights", None)
    if init is not None:  # the Trainer's init, from the same seed at every width
        init()
    try:
        optimizers = plugins.build(OPTIMIZER, config.optimizer, model)
    except ConfigValueError as exc:  # an optimizer that refuses the parametrization
        raise UserError(
            f"{where}: optimizer.{exc.field}: {exc} (under parametrization "
            f"{options.parametrization})"
        ) from None
    probe = data[0][:, :-1]
    first = _probe(model, probe)
    sizes = {kind: [_mean_abs(first[kind])] for kind in KINDS}
    updates = {kind: [0.0] for kind in KINDS}
    losses = []
    model.train()
    for batch in data:
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()  # type: ignore[no-untyped-call]
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        now = _probe(model, probe)
        for kind in KINDS:
            sizes[kind].append(_mean_abs(now[kind]))
            moved = [a - b for a, b in zip(now[kind], first[kind], strict=True)]
            updates[kind].append(_mean_abs(moved))
    return sizes, updates, losses


def coordinate_check(
    plugins: PluginManager,
    config: RunConfig,
    widths: Sequence[int],
    parametrizations: Sequence[str],
    steps: int,
    *,
    source: str | None = None,
) -> list[Check]:
    """The coordinate check of each parametrization over `widths` (one process, CPU)."""
    where = source or "config"
    base = plugins.options_of(MODEL, config.model)
    if type(base) is not TransformerConfig:
        # a subclass (llmtrain-moe's MoEOptions) builds blocks whose outputs this check does not
        # know how to read, and µP is not defined for it
        raise UserError(
            f"{where}: model.kind {config.model.kind!r} has options {type(base).__name__}; "
            "mup-check checks llmtrain-models' transformer kinds (transformer, tiny, gpt2-*, "
            "llama-*), whose options are a TransformerConfig"
        )
    if config.data.seq_len > base.max_seq_len:
        raise UserError(
            f"{where}: data.seq_len={config.data.seq_len} is longer than the model's "
            f"max_seq_len ({base.max_seq_len}); shorten data.seq_len"
        )
    # every width's options first: a bad width or option stops the check before any training
    models: dict[str, list[TransformerConfig]] = {}
    for parametrization in parametrizations:
        models[parametrization] = []
        for width in widths:
            try:
                models[parametrization].append(width_options(base, width, parametrization))
            except ConfigValueError as exc:
                problem = Problem(("model", *exc.path), f"at width {width}: {exc}", source)
                raise ConfigError([problem], source) from None
    data = batches(config, steps, base.vocab_size)
    checks = []
    for parametrization, options in models.items():
        by_width = [check_width(plugins, config, o, data, where) for o in options]
        checks.append(
            Check(
                parametrization=parametrization,
                widths=tuple(widths),
                sizes={k: [w[0][k] for w in by_width] for k in KINDS},
                updates={k: [w[1][k] for w in by_width] for k in KINDS},
                losses=[w[2] for w in by_width],
                head_dim=base.head_dim,
            )
        )
    return checks


def verdict(checks: Sequence[Check]) -> list[str]:
    """One line per parametrization: flat (µP) or growing (standard), by the slopes."""
    lines = []
    for check in checks:
        # a kind that is 0 at some width (nothing moved it) has no slope and is left out
        slopes = {
            f"{kind} {what}": slope
            for what, series in (("size", check.sizes), ("update", check.updates))
            for kind in KINDS
            if math.isfinite(slope := check.slope(series, kind))
        }
        if not slopes:
            lines.append(f"{check.parametrization}: nothing to compare (every size was 0)")
            continue
        worst = max(slopes, key=lambda k: abs(slopes[k]))
        logits = slopes.get("logits size", math.nan)
        name = check.parametrization
        if name == "mup":
            lines.append(_mup_verdict(check, slopes, worst))
        else:
            grows = logits > GROWS
            lines.append(
                f"standard: logits {'grow' if grows else 'do not grow'} with width (slope "
                f"{logits:.2f}; growing means above {GROWS}; largest |slope| "
                f"{abs(slopes[worst]):.2f}, {worst})"
            )
    return lines


def _steady(check: Check, name: str) -> str | None:
    """Why the slope of `name` ("attention update") is not a steady trend with width, or None
    where it is: the same sign, and at least FLAT, between every two neighbouring widths and at
    every step of the last half of training."""
    kind, what = name.split()
    series = check.sizes if what == "size" else check.updates
    last = check.slope(series, kind)
    pairs = check.pair_slopes(series, kind)
    late = [s for s in check.late_slopes(series, kind) if math.isfinite(s)]
    if len(pairs) > 1 and any(p * last < 0 or abs(p) < FLAT for p in pairs):
        shown = ", ".join(
            f"{a}->{b}: {p:+.2f}"
            for a, b, p in zip(check.widths, check.widths[1:], pairs, strict=False)
        )
        return f"its slope between neighbouring widths is not steady ({shown})"
    if len(late) > 1 and any(s * last < 0 or abs(s) < FLAT for s in late):
        return (
            f"its slope over the last {len(late)} steps moves between {min(late):+.2f} and "
            f"{max(late):+.2f}"
        )
    return None


def _mup_verdict(check: Check, slopes: dict[str, float], worst: str) -> str:
    """µP's verdict: flat; or not flat, with what grows steadily and what typically causes it;
    or not flat but without a steady trend (finite-width noise), with what to run instead."""
    head = f"largest |slope| {abs(slopes[worst]):.2f}, {worst}; flat means below {FLAT}"
    if abs(slopes[worst]) < FLAT:
        return f"mup: flat with width ({head})"
    widths = check.widths
    advice = []
    if check.head_dim is not None and widths[0] // check.head_dim < FEW_HEADS:
        wider = ",".join(str(FEW_HEADS * check.head_dim << i) for i in range(4))
        advice.append(
            f"use widths of {FEW_HEADS} or more heads (the smallest here has "
            f"{widths[0] // check.head_dim}), e.g. --widths {wider}"
        )
    if len(widths) < 3:
        advice.append("give 3 or more widths")
    steady = {n: s for n, s in slopes.items() if abs(s) >= FLAT and _steady(check, n) is None}
    if steady:
        kinds = sorted({n.split()[0] for n in steady}, key=KINDS.index)
        grow = ", ".join(
            f"{n} {s:+.2f}" for n, s in sorted(steady.items(), key=lambda x: -abs(x[1]))
        )
        causes = "; ".join(f"{k}: {CAUSES[k]}" for k in kinds)
        if advice:  # a steady trend at widths too small or too few to trust it
            return (
                f"mup: NOT flat at these widths ({head}): {grow} change steadily with width, "
                f"but the widths are too small or too few to tell µP's failure from "
                f"finite-width effects: {'; '.join(advice)}. If they still change there, "
                f"typical causes: {causes}"
            )
        return (
            f"mup: NOT flat with width ({head}): {grow} change steadily with width, between "
            f"every two widths and over the last steps, so µP does not hold for this model or "
            f"optimizer; typical causes: {causes}"
        )
    reason = _steady(check, worst)
    advice.append("run more --steps; the figure (-o) shows the trend")
    return (
        f"mup: NOT flat, but no steady trend with width ({head}): {reason}. That is "
        f"finite-width noise rather than a µP problem; to judge, {'; '.join(advice)}"
    )


def table(check: Check) -> str:
    from llmtrain.ablate.compare import rich_table

    header = ["kind", *(f"d={w}" for w in check.widths), "slope"]
    body = []
    for what, series in (("size", check.sizes), ("update", check.updates)):
        for kind in KINDS:
            row = [f"{kind} {what}", *(f"{steps[-1]:.3g}" for steps in series[kind])]
            body.append([*row, f"{check.slope(series, kind):+.2f}"])
    return rich_table(header, body)


def figure(checks: Sequence[Check], output: Path, steps: int) -> None:
    """One panel per parametrization: each kind's size (solid) and update (dashed) at the last
    step against width, log-log."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise UserError(
            "llmtrain mup-check -o needs matplotlib: pip install 'llmtrain-train-loop[plot]'"
        ) from None
    fig = Figure(figsize=(5.5 * len(checks), 4.2), layout="constrained")
    axes = fig.subplots(1, len(checks), squeeze=False, sharey=True)[0]
    for ax, check in zip(axes, checks, strict=True):
        for i, kind in enumerate(KINDS):
            colour = f"C{i}"
            last = [s[-1] for s in check.sizes[kind]]
            ax.plot(check.widths, last, color=colour, marker="o", label=kind)
            moved = [s[-1] for s in check.updates[kind]]
            if all(m > 0 for m in moved):
                ax.plot(check.widths, moved, color=colour, marker="x", linestyle="--")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("width (d_model)")
        ax.set_title(f"{check.parametrization}: after {steps} steps")
        ax.grid(alpha=0.3, which="both")
    axes[0].set_ylabel("mean |x| (solid), mean |x_t - x_0| (dashed)")
    axes[0].legend(fontsize="small")
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(output.name + ".tmp")
    fig.savefig(tmp, format=output.suffix[1:].lower(), dpi=120)
    tmp.replace(output)


def check_output(output: Path) -> None:
    """`-o`: the figure file to write, refused before anything runs unless it can be one."""
    if output.is_dir():
        raise UserError(
            f"-o {output} is a directory; -o names the figure file to write, e.g. "
            f"{output / 'coord.png'}"
        )
    if output.suffix.lower() not in FORMATS:
        raise UserError(f"-o {output}: use a file ending in {', '.join(FORMATS)}")
    parent = next((p for p in output.parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise UserError(f"-o {output}: {parent} is a file, not a directory to write the figure in")


def configure(parser: argparse.ArgumentParser) -> None:
    main_object(parser, "config", metavar="CONFIG", help="the run config (YAML)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="e.g. optimizer.lr=1e-2")
    parser.add_argument(
        "--widths",
        required=True,
        help="comma-separated d_model values, e.g. 128,256,512,1024 (required)",
    )
    parser.add_argument(
        "--steps", type=int, default=10, help="training steps at each width (default: 10)"
    )
    parser.add_argument(
        "--parametrization",
        choices=("standard", "mup", "both"),
        default="both",
        help="which parametrization to check; both: side by side (default: both)",
    )
    parser.add_argument(
        "-o",
        "--output",
        default=None,
        metavar="FILE",
        help="also draw the figure: a .png, .svg or .pdf file",
    )
    parser.add_argument(
        "--json", action="store_true", help="print JSON instead of text (the tables)"
    )


def run(args: argparse.Namespace, ctx: Context) -> int:
    widths = parse_widths(args.widths)
    if args.steps < 1:
        raise UserError(f"--steps must be at least 1, got {args.steps}")
    output = Path(args.output) if args.output else None
    if output is not None:
        check_output(output)
    config = load_run_config(args.config, ctx.plugins, args.overrides)
    kinds = PARAMETRIZATIONS if args.parametrization == "both" else (args.parametrization,)
    checks = coordinate_check(
        ctx.plugins,
        config,
        widths,
        kinds,
        args.steps,
        source=args.config,
    )
    if output is not None:
        figure(checks, output, args.steps)
    lines = verdict(checks)
    if args.json:
        print(json.dumps({"steps": args.steps, "checks": [c.as_json() for c in checks]}))
    else:
        for check in checks:
            print(f"{check.parametrization}: size after {args.steps} steps, by width")
            print(table(check))
    for line in lines:
        print(f"verdict: {line}", file=sys.stderr if args.json else sys.stdout)
    if output is not None:
        print(f"figure: {output}", file=sys.stderr)
    return 0
