"""The run config: one YAML file that describes a whole training run.

Components (model, parallel strategy, optimizer, lr schedule, loggers) are chosen by `kind:`
among the installed plugins; each plugin's own options class validates the rest of its section.
Checks that need several sections at once (batch arithmetic, steps or tokens) live in
`RunConfig.__attrs_post_init__` and name the keys involved.
"""

from __future__ import annotations

import functools
import math
import os
import re
from collections.abc import Callable
from fnmatch import fnmatch
from pathlib import Path, PurePath
from typing import TYPE_CHECKING, Literal, Protocol, TypeVar, cast, runtime_checkable

import attrs

from llmtrain.core_mesh.config import (
    YAML_KEY,
    Choice,
    ConfigValueError,
    PathParts,
    Problem,
    run_paths,
)
from llmtrain.core_mesh.conformance import protocol_mismatches
from llmtrain.core_mesh.errors import UserError
from llmtrain.core_mesh.interfaces import ModelOptions
from llmtrain.core_mesh.mesh import MeshError, MeshSpec
from llmtrain.data_pack.sampling import MIN_WEIGHT

if TYPE_CHECKING:
    from llmtrain.core_mesh.plugins import PluginManager

# an option's value, for the validators that check one
_Number = TypeVar("_Number", bound=float)
_Amount = TypeVar("_Amount", bound=float | None)
_Count = TypeVar("_Count", bound=int | None)


def _positive(instance: object, attribute: attrs.Attribute[_Count], value: _Count) -> None:
    if value is not None and value < 1:
        raise ValueError(f"must be at least 1, got {value}")


def _non_negative(instance: object, attribute: attrs.Attribute[_Amount], value: _Amount) -> None:
    if value is not None and value < 0:
        raise ValueError(f"must be at least 0, got {value}")


def _positive_number(instance: object, attribute: attrs.Attribute[_Amount], value: _Amount) -> None:
    if value is not None and value <= 0:
        raise ValueError(f"must be more than 0, got {value}")


# what a seed may be: Python, NumPy's SeedSequence and torch.manual_seed all take it
SEED_LIMIT = 2**64


def _seed(instance: object, attribute: attrs.Attribute[_Count], value: _Count) -> None:
    if value is not None and not 0 <= value < SEED_LIMIT:
        raise ValueError(f"must be a whole number from 0 to 2**64 - 1, got {value}")


def _not_blank(instance: object, attribute: attrs.Attribute[str], value: str) -> None:
    if not value.strip():
        raise ValueError("must be a path or URL, got an empty string")


def _path_or_null(
    instance: object, attribute: attrs.Attribute[str | None], value: str | None
) -> None:
    if value is not None and not value.strip():
        raise ValueError("must be a path or URL (null for the default), got an empty string")


def _name(instance: object, attribute: attrs.Attribute[str], value: str) -> None:
    """A run name is one safe path component: the run's directory is `run_dir/name`."""
    if value in (".", "..") or any(c in value for c in "/\\\0"):
        raise ValueError(f"must be one directory name (no '/', '\\', '.' or '..'), got {value!r}")
    if not value or value.strip() != value:
        raise ValueError(
            f"must be a non-empty name without '/' or surrounding spaces, got {value!r}"
        )


def _metric_part(
    instance: object, attribute: attrs.Attribute[str | None], value: str | None
) -> None:
    """A name that metric names carry (`eval/<name>/loss`): letters, digits, `_`, `-`, `.`."""
    if value is not None and not re.fullmatch(r"[A-Za-z0-9_.-]+", value):
        raise ValueError(
            f"must be letters, digits, '_', '-' or '.' (it names metrics), got {value!r}"
        )


@attrs.frozen(kw_only=True)
class DatasetRef:
    """A packed dataset (`llmtrain data pack`) and its share of a mixture; `name` is what
    reports call it (default: the path's last part without its extension)."""

    path: str = attrs.field(validator=_not_blank)
    # 0 leaves the dataset out of the mixture (a sweep can switch datasets off)
    weight: float = attrs.field(default=1.0, validator=_non_negative)
    name: str | None = attrs.field(default=None, validator=_metric_part)


@attrs.frozen(kw_only=True)
class EvalData:
    """A held-out packed dataset, read in order: `batches` global batches every `every` steps
    and, with `at_end`, after the last step (the loss a run ends at: what scaling-law fits and
    compare's final_eval_loss read). A named set logs `eval/<name>/loss`, `/ppl` and `/bpb`;
    the one unnamed set `eval_loss`, `eval_ppl` and `eval_bpb`."""

    path: str = attrs.field(validator=_not_blank)
    name: str | None = attrs.field(default=None, validator=_metric_part)
    every: int = attrs.field(default=100, validator=_positive)
    batches: int = attrs.field(default=10, validator=_positive)
    at_end: bool = True

    def metric(self, what: str) -> str:
        """This set's metric `what` (loss, ppl, bpb): `eval/<name>/loss`, or `eval_loss`."""
        return f"eval_{what}" if self.name is None else f"eval/{self.name}/{what}"


@attrs.frozen(kw_only=True)
class MixturePhase:
    """One phase of a mixture schedule (`data.phases`): the weight of each `data.train`
    dataset, in order, until the phase ends at `until_step` or at `until_fraction` of the
    run's steps; the last phase has no end (it goes on to the end of the run)."""

    weights: list[float]
    until_step: int | None = attrs.field(default=None, validator=_positive)
    until_fraction: float | None = attrs.field(default=None)

    @until_fraction.validator
    def _check_fraction(
        self, attribute: attrs.Attribute[float | None], value: float | None
    ) -> None:
        if value is not None and not 0 < value < 1:
            raise ValueError(f"must be between 0 and 1 (a fraction of the run), got {value}")

    def end_of(self, total_steps: int) -> int | None:
        """The step this phase ends at in a run of `total_steps`; None for the last phase."""
        if self.until_fraction is not None:
            return round(self.until_fraction * total_steps)
        return self.until_step


@attrs.frozen(kw_only=True)
class DataConfig:
    """Windows of `seq_len + 1` tokens. Per step the run reads `global_batch` sequences, each
    data-parallel rank `global_batch / dp` of them in micro-batches of `micro_batch`.
    Give `global_batch` (or `global_batch_tokens`), or `grad_accum`, not both."""

    train: list[DatasetRef]
    seq_len: int = attrs.field(validator=_positive)
    micro_batch: int = attrs.field(default=8, validator=_positive)
    grad_accum: int | None = attrs.field(default=None, validator=_positive)
    global_batch: int | None = attrs.field(default=None, validator=_positive)
    global_batch_tokens: int | None = attrs.field(default=None, validator=_positive)
    eval: EvalData | list[EvalData] | None = None
    phases: list[MixturePhase] = attrs.Factory(list)
    seed: int | None = attrs.field(default=None, validator=_seed)
    shuffle: bool = True
    cache_mib: int = attrs.field(default=512, validator=_positive)
    storage_options: dict[str, str] = attrs.Factory(dict)

    def __attrs_post_init__(self) -> None:
        if not self.train:
            raise ConfigValueError("train", "needs at least one dataset")
        weights = [d.weight for d in self.train]
        if all(w == 0 for w in weights):
            raise ConfigValueError(
                ("train", 0, "weight"),
                "at least one dataset needs a positive weight (a weight of 0 leaves a dataset "
                "out of the mixture)",
            )
        _check_weights(weights, lambda i: ("train", i, "weight"))
        self._check_phases()
        self._check_eval_names()
        given = [
            name
            for name in ("grad_accum", "global_batch", "global_batch_tokens")
            if getattr(self, name) is not None
        ]
        if len(given) > 1:
            raise ConfigValueError(given[1], f"give only one of {', '.join(given)}")
        if (
            self.global_batch_tokens is not None
            and self.seq_len >= 1
            and self.global_batch_tokens % self.seq_len
        ):
            raise ConfigValueError(
                "global_batch_tokens",
                f"{self.global_batch_tokens} tokens is not a whole number of sequences of "
                f"seq_len={self.seq_len}",
            )

    def _check_phases(self) -> None:
        """A mixture schedule weights every dataset in each phase; every phase but the last
        ends, in increasing order; the datasets' own weights are left at their default."""
        if not self.phases:
            return
        if len(self.train) < 2:
            raise ConfigValueError(
                "phases", "a mixture schedule needs at least two data.train datasets"
            )
        given = [i for i, d in enumerate(self.train) if d.weight != 1.0]
        if given:
            raise ConfigValueError(
                ("train", given[0], "weight"),
                "with data.phases the weights are given per phase; leave data.train's weights out",
            )
        last = len(self.phases) - 1
        for i, phase in enumerate(self.phases):
            if len(phase.weights) != len(self.train):
                raise ConfigValueError(
                    ("phases", i, "weights"),
                    f"lists {len(phase.weights)} weights for {len(self.train)} data.train datasets",
                )
            for j, w in enumerate(phase.weights):  # a float option is finite already
                if w < 0:
                    raise ConfigValueError(
                        ("phases", i, "weights", j), f"must be at least 0, got {w}"
                    )
            if all(w == 0 for w in phase.weights):
                raise ConfigValueError(
                    ("phases", i, "weights"), "at least one weight must be positive"
                )
            _check_weights(phase.weights, functools.partial(_phase_weight_key, i))
            ends = [k for k in ("until_step", "until_fraction") if getattr(phase, k) is not None]
            if i < last and len(ends) != 1:
                raise ConfigValueError(
                    ("phases", i),
                    "give where the phase ends: until_step (a step) or until_fraction (of the "
                    "run's steps), one of them" + (", not both" if ends else ""),
                )
            if i == last and ends:
                raise ConfigValueError(
                    ("phases", i, ends[0]),
                    "the last phase goes on to the end of the run: leave its end out",
                )

    def _check_eval_names(self) -> None:
        if not isinstance(self.eval, list):
            return
        if not self.eval:
            raise ConfigValueError("eval", "an empty list: give held-out sets, or leave eval out")
        seen: set[str] = set()
        for i, entry in enumerate(self.eval):
            if entry.name is None:
                raise ConfigValueError(
                    ("eval", i, "name"),
                    "each eval set of a list needs a name (its metrics are eval/<name>/loss)",
                )
            if entry.name in seen:
                raise ConfigValueError(("eval", i, "name"), f"{entry.name!r} names two eval sets")
            seen.add(entry.name)

    @property
    def eval_sets(self) -> list[EvalData]:
        """The held-out sets, the single form as a list of one."""
        if self.eval is None:
            return []
        return self.eval if isinstance(self.eval, list) else [self.eval]

    def phase_ends(self, total_steps: int) -> list[int | None]:
        """The step each phase of `data.phases` ends at in a run of `total_steps` (None for the
        last); every end inside the run and after the one before."""
        ends = [phase.end_of(total_steps) for phase in self.phases]
        before = 0
        for i, (phase, end) in enumerate(zip(self.phases, ends[:-1], strict=False)):
            key = "until_step" if phase.until_step is not None else "until_fraction"
            if end is None or not before < end < total_steps:
                raise ConfigValueError(
                    ("phases", i, key),
                    f"ends at step {end}, outside steps {before + 1}..{total_steps - 1} of a "
                    f"{total_steps}-step run after the phase before: every phase needs at least "
                    "one step",
                )
            before = end
        return ends

    def batch_sizes(self, dp: int) -> tuple[int, int]:
        """(global batch in sequences, gradient accumulation steps) for `dp` data ranks."""
        key = "global_batch"
        if self.global_batch_tokens is not None:
            global_batch, key = self.global_batch_tokens // self.seq_len, "global_batch_tokens"
        elif self.global_batch is not None:
            global_batch = self.global_batch
        else:
            global_batch = self.micro_batch * (self.grad_accum or 1) * dp
        per_step = self.micro_batch * dp
        if global_batch % per_step:
            raise ConfigValueError(
                key,
                f"{global_batch} sequences per step do not divide into {dp} data-parallel "
                f"ranks x micro_batch {self.micro_batch}; use a multiple of {per_step}",
            )
        return global_batch, global_batch // per_step


def _phase_weight_key(phase: int, i: int) -> PathParts:
    return ("phases", phase, "weights", i)


def _check_weights(weights: list[float], path: Callable[[int], PathParts]) -> None:
    """No positive weight below MIN_WEIGHT of the total (`path(i)`: the config key of the i-th)."""
    total = sum(w for w in weights if w > 0)
    for i, w in enumerate(weights):
        if 0 < w < MIN_WEIGHT * total:
            raise ConfigValueError(
                path(i),
                f"{w:g} is below {MIN_WEIGHT:g} of the total weight {total:g}: the dataset "
                "would be sampled less than once per million samples; raise it, or 0 to "
                "leave the dataset out",
            )


@attrs.frozen(kw_only=True)
class NonFinite:
    """What a NaN or infinite loss or gradient does: `stop` (after keeping the last good
    checkpoint) or `skip` the step, at most `max_skips` times in a run."""

    action: Literal["stop", "skip"] = attrs.field(
        default="stop", validator=attrs.validators.in_(("stop", "skip"))
    )
    max_skips: int = attrs.field(default=10, validator=_non_negative)


def _default_objective() -> Choice:
    return Choice.of("objective")(kind="cross_entropy")


@attrs.frozen(kw_only=True)
class TrainingConfig:
    """How long and how often. The target is `steps` or `tokens` (one of them)."""

    steps: int | None = attrs.field(default=None, validator=_positive)
    tokens: int | None = attrs.field(default=None, validator=_positive)
    log_every: int = attrs.field(default=10, validator=_positive)
    checkpoint_every: int | None = attrs.field(default=None, validator=_positive)
    # null: measure the norm only (0 clips every gradient to nothing: a zero update, on purpose)
    max_grad_norm: float | None = attrs.field(default=1.0, validator=_non_negative)
    # the loss of a step, a plugin of kind `objective` (README: "The training objective")
    objective: Choice.of("objective") = attrs.Factory(_default_objective)  # type: ignore[valid-type]
    # deprecated spelling of `objective: {kind: cross_entropy, z_loss: ...}`
    z_loss: float = attrs.field(default=0.0, validator=_non_negative)
    non_finite: NonFinite = attrs.Factory(NonFinite)
    # the MFU reference; null: known GPUs by name, else no MFU
    peak_tflops: float | None = attrs.field(default=None, validator=_positive_number)
    # full: every process initialises the whole model on CPU from the seed and keeps its shards,
    # so the initial weights are the same at any layout (host memory: one model per process);
    # sharded: each process initialises only its shards on the device (light, layout-dependent)
    init: Literal["full", "sharded"] = attrs.field(
        default="full", validator=attrs.validators.in_(("full", "sharded"))
    )
    # a resume whose lr schedule differs from the one its checkpoint was trained with (other
    # steps/tokens, other lr_scheduler options) in a way that moves the lr: `refuse` (one line
    # naming the jump), `keep` (go on with the trained schedule; past its end, its final lr) or
    # `recompute` (the configured schedule, jump and all). A change that keeps the lr where it
    # is (a wsd run extended in its stable phase) goes on with the configured one, logged.
    on_extend: Literal["refuse", "keep", "recompute"] = attrs.field(
        default="refuse", validator=attrs.validators.in_(("refuse", "keep", "recompute"))
    )

    def total_steps(self, tokens_per_step: int) -> int:
        """`steps`, or the steps that train on `tokens` (rounded up)."""
        if self.steps is not None:
            return self.steps
        if self.tokens is None:  # refused when the config was built
            raise ValueError("give exactly one of training.steps and training.tokens")
        return math.ceil(self.tokens / tokens_per_step)

    def __attrs_post_init__(self) -> None:
        if (self.steps is None) == (self.tokens is None):
            raise ConfigValueError(
                "steps", "give exactly one of training.steps and training.tokens"
            )
        if self.z_loss and self.objective != _default_objective():
            # which one weighs the z-loss would be a guess: the deprecated key is moved into
            # the default objective only (`without_deprecated`)
            raise ConfigValueError(
                "z_loss",
                "the deprecated training.z_loss and training.objective are both given; write "
                f"the weight in the objective (training.objective: {{kind: "
                f"{self.objective.kind}, z_loss: {self.z_loss}}}, where it takes one) and "
                "remove training.z_loss",
            )


@attrs.frozen(kw_only=True)
class CheckpointConfig:
    """Where and how checkpoints go; `dir` defaults to `<run dir>/checkpoints` (any fsspec URL)."""

    dir: str | None = attrs.field(default=None, validator=_path_or_null)
    keep_last: int = attrs.field(default=3, validator=_positive)  # the newest is always kept
    keep_every: int | None = attrs.field(default=None, validator=_positive)
    # steps saved besides training.checkpoint_every's and never pruned: where the decay
    # branches of a ladder (`llmtrain sweep --branch-decays`) start from
    steps: list[int] = attrs.Factory(list)
    async_save: bool = False
    # threads per rank that write and read the checkpoint's files (the concurrency of its
    # uploads and ranged reads on object storage); null: up to 4, no more than the cores
    io_threads: int | None = attrs.field(default=None, validator=_positive)
    resume: Literal["auto", "never"] = attrs.field(
        default="auto", validator=attrs.validators.in_(("auto", "never"))
    )
    storage_options: dict[str, str] = attrs.Factory(dict)

    def __attrs_post_init__(self) -> None:
        for i, step in enumerate(self.steps):
            if step < 1:
                raise ConfigValueError(("steps", i), f"a step to save is 1 or more, got {step}")


@attrs.frozen(kw_only=True)
class ProfileConfig:
    """torch.profiler windows: every `every` steps, `warmup` steps run under the profiler
    unrecorded, then `active` steps are recorded into one Chrome/Perfetto trace per rank
    (`<run dir>/profiles/step-N/rank<k>.json`). Steps outside a window run without it."""

    every: int = attrs.field(default=100, validator=_positive)
    active: int = attrs.field(default=2, validator=_positive)
    warmup: int = attrs.field(default=1, validator=_non_negative)
    ranks: list[int] | None = None  # default: every rank
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False

    def __attrs_post_init__(self) -> None:
        for i, rank in enumerate(self.ranks or []):
            if rank < 0:
                raise ConfigValueError(("ranks", i), f"a rank is 0 or more, got {rank}")
        if self.warmup + self.active > self.every:
            raise ConfigValueError(
                "every",
                f"a window of warmup {self.warmup} + active {self.active} steps does not fit "
                f"in every {self.every} steps",
            )


def _more_than_one(instance: object, attribute: attrs.Attribute[_Number], value: _Number) -> None:
    if value <= 1:
        raise ValueError(f"must be more than 1, got {value}")


@attrs.frozen(kw_only=True)
class WatchdogConfig:
    """A step slower than `multiple` x the median of the recent steps (and at least
    `min_seconds`) makes every rank write its Python stacks to its log. Until `warmup_steps`
    steps have run, and during eval and saves, the limit is `startup_seconds`."""

    enabled: bool = True
    # at most 1 would call every other ordinary step a hang
    multiple: float = attrs.field(default=10.0, validator=_more_than_one)
    min_seconds: float = attrs.field(default=60.0, validator=_non_negative)
    warmup_steps: int = attrs.field(default=3, validator=_positive)
    startup_seconds: float = attrs.field(default=900.0, validator=_positive_number)


@attrs.frozen(kw_only=True)
class DebugConfig:
    # torch.use_deterministic_algorithms and every seed: bitwise repeatable on one machine;
    # slower kernels on GPU, and ops without a deterministic kernel raise
    deterministic: bool = False
    watchdog: WatchdogConfig = attrs.Factory(WatchdogConfig)
    # CUDA: record every allocation's stack for the out-of-memory snapshot (slows allocation)
    memory_history: bool = False
    # NCCL: keep a ring of recent collectives and dump it on a timeout (off: no trace on hangs)
    flight_recorder: bool = True
    # read the step's numbers on the host every step, where the step read them before it kept
    # them on the device (the count before the forward, the finite check before the optimizer
    # step, the ranks' stop vote after it): what those syncs cost, measured (the GPU kit's
    # *-syncs steps); the numbers are the same either way
    host_syncs: bool = False


@attrs.frozen(kw_only=True)
class InitConfig:
    """A warm start: the run's model starts from the weights at `from` (an llmtrain checkpoint
    directory or, through a `weights` plugin, e.g. a Hugging Face directory), with a fresh
    optimizer, the lr schedule and data from step 0. A run that has checkpoints of its own
    resumes them instead. `format: auto` takes an llmtrain checkpoint directory as such and asks
    the installed weight formats about anything else."""

    from_: str = attrs.field(metadata={YAML_KEY: "from"}, validator=_not_blank)
    step: int | None = attrs.field(default=None, validator=_non_negative)  # default: the newest
    format: str = attrs.field(default="auto", validator=_not_blank)  # auto, llmtrain, hf, ...
    check_tokenizer: bool = True
    storage_options: dict[str, str] = attrs.Factory(dict)
    # weights: a warm start; all: a branch, the run goes on from that step of another run as
    # from its own checkpoint (optimizer, step, data position, random states, callbacks)
    state: Literal["weights", "all"] = attrs.field(
        default="weights", validator=attrs.validators.in_(("weights", "all"))
    )

    def __attrs_post_init__(self) -> None:
        if self.state == "all" and self.step is None:
            raise ConfigValueError(
                "step", "init.state: all (a branch) names the step it goes on from"
            )
        if self.state == "all" and self.format not in ("auto", "llmtrain"):
            raise ConfigValueError(
                "format", "init.state: all goes on from an llmtrain checkpoint directory"
            )


def _default_parallel() -> Choice:
    return Choice.of("parallel")(kind="default")


def _default_loggers() -> list[Choice]:
    logger = Choice.of("logger")
    return [logger(kind="console"), logger(kind="jsonl")]


# optimizers without a µP rule: a model with `parametrization: mup` cannot be trained by them
MUP_WITHOUT_RULE = frozenset({"sgd"})


@attrs.frozen(kw_only=True)
class RunConfig:
    name: str = attrs.field(validator=_name)
    seed: int = attrs.field(default=0, validator=_seed)
    run_dir: str = attrs.field(default="runs", validator=_not_blank)
    device: Literal["auto", "cpu", "cuda"] = attrs.field(
        default="auto", validator=attrs.validators.in_(("auto", "cpu", "cuda"))
    )
    model: Choice.of("model")  # type: ignore[valid-type]
    data: DataConfig
    optimizer: Choice.of("optimizer")  # type: ignore[valid-type]
    lr_scheduler: Choice.of("lr_scheduler") | None = None  # type: ignore[valid-type]
    loggers: list[Choice.of("logger")] = attrs.Factory(_default_loggers)  # type: ignore[valid-type]
    mesh: MeshSpec = attrs.Factory(MeshSpec)
    parallel: Choice.of("parallel") = attrs.Factory(_default_parallel)  # type: ignore[valid-type]
    training: TrainingConfig
    checkpoint: CheckpointConfig = attrs.Factory(CheckpointConfig)
    profile: ProfileConfig | None = None
    debug: DebugConfig = attrs.Factory(DebugConfig)
    init: InitConfig | None = None
    # plugin callbacks, called after the built-in ones in this order (train-loop README)
    callbacks: list[Choice.of("callback")] = attrs.Factory(list)  # type: ignore[valid-type]

    def __attrs_post_init__(self) -> None:
        # the optimizer's µP rule (optim.multiplier_groups) is Adam's; sgd refuses a µP model
        # when it is built, which is when the run starts: said here, at validation, instead
        parametrization = getattr(self.model.options, "parametrization", None)
        if parametrization == "mup" and self.optimizer.kind in MUP_WITHOUT_RULE:
            raise ConfigValueError(
                ("optimizer", "kind"),
                f"{self.optimizer.kind} has no µP learning-rate rule, and model.parametrization "
                "is mup; use adamw, adam or muon with parametrization: mup, or "
                f"parametrization: standard with {self.optimizer.kind}",
            )


def warmup_outlasts(schedule: object, total_steps: int) -> str | None:
    """What to tell a run whose lr warmup is as long as the run (it never reaches the peak lr it
    was given), or None. Not an error: short smoke runs of a long run's config do this on
    purpose."""
    warmup = getattr(getattr(schedule, "options", None), "warmup_steps", None)
    if isinstance(warmup, int) and warmup >= total_steps:
        return (
            f"lr_scheduler.warmup_steps {warmup} is not shorter than the run ({total_steps} "
            "steps): the lr never reaches its peak"
        )
    return None


def without_deprecated(config: RunConfig, plugins: PluginManager) -> tuple[RunConfig, list[str]]:
    """The config in today's spelling, and a message for each deprecated setting it had.

    `training.z_loss: W` is `training.objective: {kind: cross_entropy, z_loss: W}`: moved into
    the cross_entropy objective where that one has no z-loss of its own (another objective
    keeps it for the held-out evaluation's loss)."""
    training = config.training
    if not training.z_loss:
        return config, []
    message = (
        "training.z_loss is deprecated; write training.objective: "
        f"{{kind: cross_entropy, z_loss: {training.z_loss}}}"
    )
    choice = training.objective
    options = plugins.options_of("objective", choice)
    if choice.kind != "cross_entropy" or options.z_loss:
        return config, [message]
    moved = attrs.evolve(choice, options=attrs.evolve(options, z_loss=training.z_loss))
    # moved, not copied: the written config.yaml reads back without the deprecated key
    training = attrs.evolve(training, objective=moved, z_loss=0.0)
    return attrs.evolve(config, training=training), [message]


@runtime_checkable
class CompileOption(Protocol):
    """Parallel options that can compile the model (the `default` strategy's `compile`)."""

    compile: bool


@runtime_checkable
class ZLossOption(Protocol):
    """Objective options with a z-loss weight (`cross_entropy`'s, `distill`'s)."""

    z_loss: float


def option_compile(options: object) -> bool:
    """Whether a `parallel:` entry's options compile the model (False where they cannot)."""
    return isinstance(options, CompileOption) and bool(options.compile)


def option_z_loss(options: object) -> float | None:
    """The z-loss weight of an objective's options; None where the objective has none."""
    return float(options.z_loss) if isinstance(options, ZLossOption) else None


def resolved(config: RunConfig, plugins: PluginManager) -> RunConfig:
    """The config with every chosen component's options filled in (defaults included), so the
    written config reads back to the same run even if a default changes later."""

    def fill(kind: str, choice: Choice | None) -> Choice | None:
        if choice is None:
            return None
        return attrs.evolve(choice, options=plugins.options_of(kind, choice))

    return attrs.evolve(
        config,
        model=fill("model", config.model),
        optimizer=fill("optimizer", config.optimizer),
        lr_scheduler=fill("lr_scheduler", config.lr_scheduler),
        parallel=fill("parallel", config.parallel),
        loggers=[fill("logger", choice) for choice in config.loggers],
        callbacks=[fill("callback", choice) for choice in config.callbacks],
        training=attrs.evolve(
            config.training, objective=fill("objective", config.training.objective)
        ),
    )


def checked_model_options(plugins: PluginManager, choice: Choice) -> ModelOptions:
    """The `model:` section's options, checked to offer what training reads of them
    (`ModelOptions`), so a model plugin that lacks one hears which, not an AttributeError."""
    options = plugins.options_of("model", choice)
    missing = [m.split(":")[0] for m in protocol_mismatches(type(options), ModelOptions)]
    if missing:
        entry = plugins.registry("model").get(choice.kind)
        raise UserError(
            f"model: kind {choice.kind!r} of {entry.origin.describe()} has options "
            f"({type(options).__name__}) without {', '.join(missing)}; a model plugin's options "
            "class must provide them (llmtrain.core_mesh.interfaces.ModelOptions)"
        )
    # options_of returns Any; the protocol check above found nothing missing
    return cast(ModelOptions, options)


def layout_problems(
    config: RunConfig, plugins: PluginManager, *, world_size: int | None
) -> list[Problem]:
    """What the model and the launch make of the data section: `data.seq_len` against the
    model's `max_seq_len`, and with `world_size` the mesh and the batch arithmetic (what the
    Trainer checks again, found here with the file and line)."""
    problems = []
    try:
        max_len = plugins.options_of("model", config.model).max_seq_len
    except (AttributeError, UserError):  # a model plugin without it: the Trainer names it
        max_len = None
    if isinstance(max_len, int) and config.data.seq_len > max_len:
        problems.append(
            Problem(
                ("data", "seq_len"),
                f"{config.data.seq_len} is longer than the model's max_seq_len ({max_len}); "
                "raise model.max_seq_len or shorten data.seq_len",
            )
        )
    if world_size is not None:
        try:
            dp = config.mesh.resolve(world_size).dp
        except MeshError as exc:
            return [*problems, Problem(("mesh",), str(exc))]
        try:
            config.data.batch_sizes(dp)
        except ConfigValueError as exc:
            problems.append(Problem(("data", *exc.path), str(exc)))
    return problems


# what a run writes in its directory itself (ARCHITECTURE.md's layout): a logger may not write
# over these. Its own directories are refused whole but for `logs/`, whose names the patterns say
RUN_FILES = frozenset({"config.yaml", "summary.json", "summary.json.tmp", "output.log"})
RUN_DIRS = frozenset({"checkpoints", "profiles"})
RUN_LOGS = ("logs/rank*.jsonl", "logs/stacks-rank*.txt", "logs/nccl_trace_rank_*")


def run_path_problems(
    config: RunConfig, plugins: PluginManager, *, writable: bool
) -> list[Problem]:
    """What is wrong with the places the run will write, found before it starts: the run
    directory (`run_dir`, `name`), a local `checkpoint.dir` and each logger's file or directory
    (fields marked `RUN_PATH`). A path that exists as the wrong kind (a file where a directory
    goes, or the reverse) is refused, and so is a logger path onto the run's own files; with
    `writable`, so is a place this process cannot create or write (`llmtrain run`: `config
    validate` may check a config on another machine than the one that runs it)."""
    problems: list[Problem] = []

    def check(path: PathParts, where: Path, kind: str) -> None:
        message = place_problem(where, kind, writable=writable)
        if message is not None:
            problems.append(Problem(path, message))

    run_dir = Path(config.run_dir)
    check(("run_dir",), run_dir, "directory")
    if not problems:
        check(("name",), run_dir / config.name, "directory")
    checkpoint_dir = config.checkpoint.dir
    if checkpoint_dir is not None and _local(checkpoint_dir):
        check(("checkpoint", "dir"), Path(checkpoint_dir.removeprefix("file://")), "directory")
    run, run_ok = run_dir / config.name, not problems
    for i, choice in enumerate(config.loggers):
        options = choice.options or plugins.options_of("logger", choice)
        for key, kind, value in run_paths(options):
            own = _onto_the_runs_own(value, kind)
            if own is not None:
                problems.append(Problem(("loggers", i, key), own))
            elif run_ok:  # a logger's path inside a run directory that cannot be: said once
                check(("loggers", i, key), run / value, kind)
    return problems


def _local(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


def _onto_the_runs_own(value: str, kind: str) -> str | None:
    """Why a logger's path (relative to the run directory) would write over the run's own
    files, or None."""
    path = PurePath(value)
    if path.is_absolute():
        return None
    parts = [p for p in path.parts if p != "."]
    within = "/".join(parts)
    if kind == "file" and (
        within in RUN_FILES | RUN_DIRS | {"logs"} or any(fnmatch(within, p) for p in RUN_LOGS)
    ):
        return f"{value!r} is a file or directory the run writes itself; name another"
    if parts and parts[0] in RUN_DIRS and (kind == "file" or parts[0] == "checkpoints"):
        return f"{value!r} is inside the run's own {parts[0]}/ directory; name another place"
    return None


def place_problem(path: Path, kind: str, *, writable: bool) -> str | None:
    """Why a run cannot write `path` (a "file" or a "directory"), or None: it exists as the
    other kind, or it cannot be created under its nearest existing parent, or (`writable`)
    that parent is read-only or not this process's to write."""
    if path.exists():
        if kind == "directory" and not path.is_dir():
            return f"{path} exists and is not a directory"
        if kind == "file" and path.is_dir():
            return f"{path} is a directory, not a file"
        target = path if path.is_dir() else path.parent
    else:
        target = path.parent
        while not target.exists() and target != target.parent:
            target = target.parent
        if not target.is_dir():
            return f"{target} is not a directory, so {path} cannot be created"
    if writable and not _writable(target):
        return f"{target} is not writable, so the run cannot write {path}"
    if writable and kind == "file" and path.is_file() and not os.access(path, os.W_OK):
        return f"{path} is not writable"
    return None


def _writable(directory: Path) -> bool:
    try:
        if os.statvfs(directory).f_flag & os.ST_RDONLY:
            return False
    except OSError:
        return False
    return os.access(directory, os.W_OK | os.X_OK)
