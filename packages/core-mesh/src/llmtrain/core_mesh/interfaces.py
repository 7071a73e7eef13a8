"""The vocabulary packages share: small frozen attrs classes and Protocols, nothing else.

No package imports a sibling; they meet here. Nothing in this module needs torch or numpy:
tensors, modules and arrays appear as `Any`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import attrs


@runtime_checkable
class Tokenizer(Protocol):
    """Text to token ids and back. `fingerprint` is a hash of everything that decides the ids."""

    @property
    def name(self) -> str: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def eod_id(self) -> int: ...

    @property
    def fingerprint(self) -> str: ...

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@runtime_checkable
class WindowSource(Protocol):
    """A random-access sequence of token windows of `seq_len + 1` tokens (numpy int arrays)."""

    @property
    def seq_len(self) -> int: ...

    def __len__(self) -> int: ...

    def window(self, index: int) -> Any: ...


@attrs.frozen
class ModelDescription:
    """What a model tells the parallel and training code about itself.

    - `blocks`: the repeated transformer blocks, the units of FSDP sharding, activation
      checkpointing and per-block compile.
    - `tp_plan`: module path (relative to `module`, globs allowed) -> a tensor-parallel style
      name ("colwise", "rowwise", "sequence_parallel", ...); the parallel package maps names to
      torch styles.
    - `flops_per_token(seq_len)`: training FLOPs per token (6N + 12·L·H·Q·T), for MFU.
    - `tied_embeddings`: the output projection reuses the input embedding's weight (pipeline
      parallelism refuses such a model with a message saying so).
    - `trim_to_stage(module, block_ids, first, last)`: cut `module` (or a deep copy of it) down to
      one pipeline stage in place: keep the blocks at those indices into `blocks`, the input
      layers only when `first`, the output layers only when `last`. A stage without input layers
      takes hidden states; one without output layers returns them. None: cannot be pipelined.

    Context parallelism calls `module(tokens, positions=...)` with each token's position in its
    sequence, and replaces causal attention; a model that supports it accepts `positions`.
    """

    module: Any
    blocks: Sequence[Any]
    tp_plan: Mapping[str, str]
    n_params: int
    n_non_embedding_params: int
    flops_per_token: Callable[[int], float]
    n_heads: int
    n_kv_heads: int
    tied_embeddings: bool = False
    trim_to_stage: Callable[[Any, Sequence[int], bool, bool], None] | None = None


@runtime_checkable
class MetricsSink(Protocol):
    """Receives one dict of numbers per logged step (console, jsonl, tensorboard, wandb ...)."""

    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


@attrs.frozen
class RunInfo:
    """What a logger plugin is told about the run it logs: built as `target(options, run)`.

    `start_step` is where this process starts (a resumed run starts after its checkpoint; a
    logger that appends to a file drops what it had written past that step).
    """

    name: str
    run_dir: str
    total_steps: int
    start_step: int
    config: Mapping[str, Any]


@runtime_checkable
class WeightFormat(Protocol):
    """Model weights stored another way than an llmtrain checkpoint (a Hugging Face directory,
    ...), that a run can start from: `init: {from: PATH, format: NAME}` (plugin kind `weights`).

    - `recognizes(path, storage_options)`: whether `path` (a local path or fsspec URL) holds
      weights of this format; cheap (reads no weights) and never raises for a foreign path.
    - `describe()`: what `recognizes` looks for, for the error when nothing recognises a path
      (`"config.json and *.safetensors"`).
    - `load(path, storage_options)`: (the whole model's state dict on CPU, under llmtrain's
      parameter names; the model info `{"kind": KIND, **options}` of the model the weights
      belong to, as a run's `model:` section would give it).
    """

    def recognizes(self, path: str, storage_options: Mapping[str, Any]) -> bool: ...

    def describe(self) -> str: ...

    def load(
        self, path: str, storage_options: Mapping[str, Any]
    ) -> tuple[dict[str, Any], dict[str, Any]]: ...


class Callback:
    """Code that runs inside a training run at its events (plugin kind `callback`): subclass it
    and override the events you need; the others cost nothing (the trainer calls only what a
    class overrides). `run` is the trainer, as `TrainingRun` describes it. Every rank calls every
    event, in the same order, so an event may run collectives when all ranks reach it.

    Events, in the order a run meets them:
    - `on_load(run, step)`: a checkpoint was resumed (this callback's state is already back).
    - `on_run_start(run)`: the loop is about to start, at `run.step` (0, or the resumed step).
    - `before_step(run, step)` / `after_step(run, step, metrics)`: around optimizer step `step`
      (1-based). `metrics` is the step's record: keys added here are logged with it when the step
      is logged (every `training.log_every` steps, eval steps and the last one).
    - `before_eval(run, step)` / `after_eval(run, step, metrics)`: around the held-out evaluation;
      `metrics` holds `eval_loss`, `eval_ppl` and may gain more.
    - `on_log(run, step, metrics, rank_metrics)`: a logged step, before the loggers get `metrics`
      (add to it; loggers run on rank 0). `rank_metrics` holds this rank's own values where they
      differ from the run's; the rank's JSON log line is `metrics` overlaid with them.
    - `before_save(run, step)` / `after_save(run, step)`: around a checkpoint save.
    - `on_run_end(run, status)`: the loop ended: `finished` (the target step) or `stopped`
      (preempted, or a callback called `run.request_stop`).
    - `on_failure(run, error)`: the run raised `error` (an exception raised here is logged and
      does not hide `error`).

    State: a callback with `state_dict()` (plain data: numbers, strings, lists, dicts) and
    `load_state_dict(state)` has it saved in every checkpoint and restored on resume, so a resumed
    run continues it exactly. The state saved is rank 0's; keep it the same on every rank.
    """

    def on_load(self, run: Any, step: int) -> None: ...

    def on_run_start(self, run: Any) -> None: ...

    def before_step(self, run: Any, step: int) -> None: ...

    def after_step(self, run: Any, step: int, metrics: dict[str, float]) -> None: ...

    def before_eval(self, run: Any, step: int) -> None: ...

    def after_eval(self, run: Any, step: int, metrics: dict[str, float]) -> None: ...

    def on_log(
        self, run: Any, step: int, metrics: dict[str, float], rank_metrics: dict[str, float]
    ) -> None: ...

    def before_save(self, run: Any, step: int) -> None: ...

    def after_save(self, run: Any, step: int) -> None: ...

    def on_run_end(self, run: Any, status: str) -> None: ...

    def on_failure(self, run: Any, error: BaseException) -> None: ...


CALLBACK_EVENTS = (
    "on_load",
    "on_run_start",
    "before_step",
    "after_step",
    "before_eval",
    "after_eval",
    "on_log",
    "before_save",
    "after_save",
    "on_run_end",
    "on_failure",
)
