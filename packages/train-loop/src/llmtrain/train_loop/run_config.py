"""The run config: one YAML file that describes a whole training run.

Components (model, parallel strategy, optimizer, lr schedule, loggers) are chosen by `kind:`
among the installed plugins; each plugin's own options class validates the rest of its section.
Checks that need several sections at once (batch arithmetic, steps or tokens) live in
`RunConfig.__attrs_post_init__` and name the keys involved.
"""

from __future__ import annotations

from typing import Any, Literal

import attrs

from llmtrain.core_mesh.config import YAML_KEY, Choice, ConfigValueError
from llmtrain.core_mesh.conformance import protocol_mismatches
from llmtrain.core_mesh.errors import UserError
from llmtrain.core_mesh.interfaces import ModelOptions
from llmtrain.core_mesh.mesh import MeshSpec


def _positive(instance: object, attribute: attrs.Attribute, value: int | None) -> None:
    if value is not None and value < 1:
        raise ValueError(f"must be at least 1, got {value}")


def _non_negative(instance: object, attribute: attrs.Attribute, value: float | None) -> None:
    if value is not None and value < 0:
        raise ValueError(f"must be at least 0, got {value}")


def _name(instance: object, attribute: attrs.Attribute, value: str) -> None:
    """A run name is one safe path component: the run's directory is `run_dir/name`."""
    if value in (".", "..") or any(c in value for c in "/\\\0"):
        raise ValueError(f"must be one directory name (no '/', '\\', '.' or '..'), got {value!r}")
    if not value or value.strip() != value:
        raise ValueError(
            f"must be a non-empty name without '/' or surrounding spaces, got {value!r}"
        )


@attrs.frozen(kw_only=True)
class DatasetRef:
    """A packed dataset (`llmtrain data pack`) and its share of a mixture."""

    path: str
    # 0 leaves the dataset out of the mixture (a sweep can switch datasets off)
    weight: float = attrs.field(default=1.0, validator=_non_negative)


@attrs.frozen(kw_only=True)
class EvalData:
    """A held-out packed dataset, read in order: `batches` global batches every `every` steps
    and, with `at_end`, after the last step (the loss a run ends at: what scaling-law fits and
    compare's final_eval_loss read)."""

    path: str
    every: int = attrs.field(default=100, validator=_positive)
    batches: int = attrs.field(default=10, validator=_positive)
    at_end: bool = True


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
    eval: EvalData | None = None
    seed: int | None = None
    shuffle: bool = True
    cache_mib: int = attrs.field(default=512, validator=_positive)
    storage_options: dict[str, str] = attrs.Factory(dict)

    def __attrs_post_init__(self) -> None:
        if not self.train:
            raise ConfigValueError("train", "needs at least one dataset")
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


@attrs.frozen(kw_only=True)
class NonFinite:
    """What a NaN or infinite loss or gradient does: `stop` (after keeping the last good
    checkpoint) or `skip` the step, at most `max_skips` times in a run."""

    action: Literal["stop", "skip"] = attrs.field(
        default="stop", validator=attrs.validators.in_(("stop", "skip"))
    )
    max_skips: int = attrs.field(default=10, validator=_non_negative)


@attrs.frozen(kw_only=True)
class TrainingConfig:
    """How long and how often. The target is `steps` or `tokens` (one of them)."""

    steps: int | None = attrs.field(default=None, validator=_positive)
    tokens: int | None = attrs.field(default=None, validator=_positive)
    log_every: int = attrs.field(default=10, validator=_positive)
    checkpoint_every: int | None = attrs.field(default=None, validator=_positive)
    max_grad_norm: float | None = attrs.field(default=1.0, validator=_non_negative)
    z_loss: float = attrs.field(default=0.0, validator=_non_negative)
    non_finite: NonFinite = attrs.Factory(NonFinite)
    peak_tflops: float | None = attrs.field(default=None, validator=_non_negative)  # MFU reference
    # full: every process initialises the whole model on CPU from the seed and keeps its shards,
    # so the initial weights are the same at any layout (host memory: one model per process);
    # sharded: each process initialises only its shards on the device (light, layout-dependent)
    init: Literal["full", "sharded"] = attrs.field(
        default="full", validator=attrs.validators.in_(("full", "sharded"))
    )

    def __attrs_post_init__(self) -> None:
        if (self.steps is None) == (self.tokens is None):
            raise ConfigValueError(
                "steps", "give exactly one of training.steps and training.tokens"
            )


@attrs.frozen(kw_only=True)
class CheckpointConfig:
    """Where and how checkpoints go; `dir` defaults to `<run dir>/checkpoints` (any fsspec URL)."""

    dir: str | None = None
    keep_last: int | None = attrs.field(default=3, validator=_positive)
    keep_every: int | None = attrs.field(default=None, validator=_positive)
    async_save: bool = False
    # threads per rank that write and read the checkpoint's files (the concurrency of its
    # uploads and ranged reads on object storage); null: up to 4, no more than the cores
    io_threads: int | None = attrs.field(default=None, validator=_positive)
    resume: Literal["auto", "never"] = attrs.field(
        default="auto", validator=attrs.validators.in_(("auto", "never"))
    )
    storage_options: dict[str, str] = attrs.Factory(dict)


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
        if self.warmup + self.active > self.every:
            raise ConfigValueError(
                "every",
                f"a window of warmup {self.warmup} + active {self.active} steps does not fit "
                f"in every {self.every} steps",
            )


@attrs.frozen(kw_only=True)
class WatchdogConfig:
    """A step slower than `multiple` x the median of the recent steps (and at least
    `min_seconds`) makes every rank write its Python stacks to its log. Until `warmup_steps`
    steps have run, and during eval and saves, the limit is `startup_seconds`."""

    enabled: bool = True
    multiple: float = attrs.field(default=10.0, validator=_non_negative)
    min_seconds: float = attrs.field(default=60.0, validator=_non_negative)
    warmup_steps: int = attrs.field(default=3, validator=_positive)
    startup_seconds: float = attrs.field(default=900.0, validator=_non_negative)


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


def _not_blank(instance: object, attribute: attrs.Attribute, value: str) -> None:
    if not value.strip():
        raise ValueError("must be a path or URL, got an empty string")


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


def _default_parallel():
    return Choice.of("parallel")(kind="default")


def _default_loggers():
    logger = Choice.of("logger")
    return [logger(kind="console"), logger(kind="jsonl")]


@attrs.frozen(kw_only=True)
class RunConfig:
    name: str = attrs.field(validator=_name)
    seed: int = 0
    run_dir: str = "runs"
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


def warmup_outlasts(schedule: Any, total_steps: int) -> str | None:
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


def resolved(config: RunConfig, plugins: Any) -> RunConfig:
    """The config with every chosen component's options filled in (defaults included), so the
    written config reads back to the same run even if a default changes later."""

    def fill(kind: str, choice: Any) -> Any:
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
    )


def checked_model_options(plugins: Any, choice: Any) -> ModelOptions:
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
    return options
