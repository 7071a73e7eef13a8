"""The vocabulary packages share: small frozen attrs classes and Protocols, nothing else.

No package imports a sibling; they meet here. Nothing in this module needs torch or numpy at
run time: tensors, modules, devices and meshes are named as torch's types for the type checker
only (`TYPE_CHECKING`), so core-mesh installs and imports without torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol, runtime_checkable

import attrs

if TYPE_CHECKING:
    import random
    from pathlib import Path

    import torch
    from torch.distributed.device_mesh import DeviceMesh

    from llmtrain.core_mesh.mesh import MeshSpec
    from llmtrain.core_mesh.plugins import PluginManager
    from llmtrain.core_mesh.world import World


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

    def encode_batch(self, texts: Sequence[str], /) -> list[list[int]]: ...

    def decode(self, ids: Sequence[int], /) -> str: ...


TASK_SCORINGS = ("multiple_choice", "cloze", "perplexity")


@attrs.frozen
class TaskItem:
    """One question of a downstream task, as prompts: each choice's text is scored by its
    log-likelihood after its context (`delimiter + choice`, the delimiter lm-evaluation-harness
    calls the target delimiter).

    `contexts` holds one context shared by every choice or one per choice (Winogrande's
    partial scoring: one shared choice after different contexts). A cloze item has one context
    and one choice (the answer); a perplexity item has the empty context and the document as
    its one choice. `where` names the source (`file:line`) in errors and per-item results.
    """

    contexts: tuple[str, ...]
    choices: tuple[str, ...]
    gold: int = 0
    delimiter: str = " "
    where: str = ""

    @property
    def n_options(self) -> int:
        return max(len(self.contexts), len(self.choices))

    def context(self, option: int) -> str:
        return self.contexts[option if len(self.contexts) > 1 else 0]

    def choice(self, option: int) -> str:
        return self.choices[option if len(self.choices) > 1 else 0]


class Task(Protocol):
    """A downstream evaluation task: what a `task` plugin entry's `target(options)` returns.

    `scoring` is one of `TASK_SCORINGS`: `multiple_choice` (acc, acc_norm), `cloze` (greedy
    accuracy of the answer, perplexity) or `perplexity` (rolling log-likelihood of documents).
    `items()` gives the prompts ready to score (few-shot examples included), reading and
    checking the task's files on the first call; bad input raises `UserError` naming file:line.
    """

    @property
    def name(self) -> str: ...

    @property
    def scoring(self) -> str: ...

    def items(self) -> Sequence[TaskItem]: ...


@attrs.frozen
class AttentionDescription:
    """What a model's attention computes, as the layout check sees it (parallel never looks at
    the model's code).

    - `layers`: per block, the names of the mask functions its attention composes, e.g.
      `("causal", "document", "window=1024")`; every key is visible to a query only where every
      function allows it. Empty: plain causal attention in every block.
    - `score_mod`: what is done to the scores before the softmax, e.g. `"softcap=50.0"`; None
      when they are left as they are.
    """

    layers: tuple[tuple[str, ...], ...] = ()
    score_mod: str | None = None

    @property
    def masks(self) -> frozenset[str]:
        """Every mask function some block uses (`window=N` kept with its N)."""
        return frozenset(name for layer in self.layers for name in layer)

    @property
    def document_masking(self) -> bool:
        return "document" in self.masks

    @property
    def plain_causal(self) -> bool:
        return self.masks <= {"causal"} and self.score_mod is None


@attrs.frozen
class ModelDescription:
    """What a model tells the parallel and training code about itself.

    - `blocks`: the repeated transformer blocks, the units of FSDP sharding, activation
      checkpointing and per-block compile.
    - `tp_plan`: module path (relative to `module`, globs allowed) -> a tensor-parallel style
      name ("colwise", "rowwise", "sequence_parallel", ...); the parallel package maps names to
      torch styles.
    - `flops_per_token(seq_len)`: training FLOPs per token, for MFU and scaling fits: 6 x the
      parameters a token multiplies by (the LM head whether tied or not; no embedding lookup,
      no idle expert) + 12·L·H·Q·T for attention. The one count every MFU figure uses.
    - `tied_embeddings`: the output projection reuses the input embedding's weight (pipeline
      parallelism refuses such a model with a message saying so).
    - `trim_to_stage(module, block_ids, first, last)`: cut `module` (or a deep copy of it) down to
      one pipeline stage in place: keep the blocks at those indices into `blocks`, the input
      layers only when `first`, the output layers only when `last`. A stage without input layers
      takes hidden states; one without output layers returns them. None: cannot be pipelined.

    - `n_heads`, `n_kv_heads`: the attention's query and key/value heads, which tensor
      parallelism must divide; None (the default) for a model without attention heads, whose
      `tp_plan` alone says what tensor parallelism splits.
    - `takes_head_fn`: `module(tokens, ..., head_fn=f)` returns `f(final hidden states,
      output matrix)` in place of the logits, so a loss can run the output projection itself
      (chunked, without the batch's logits).

    - `attention`: its attention masks and score changes (`AttentionDescription`); the default
      is plain causal attention.

    Context parallelism calls `module(tokens, positions=...)` with each token's position in its
    sequence, and replaces causal attention; a model that supports it accepts `positions`. A
    model whose attention is not plain causal also gets `sequence_length=T` (and `doc_starts` of
    the whole sequence): it builds each block's boolean mask over (its queries, every key in
    position order) and passes it as `attn_mask` to scaled_dot_product_attention, which context
    parallelism answers with the keys and values of every rank.
    """

    module: torch.nn.Module
    blocks: Sequence[torch.nn.Module]
    tp_plan: Mapping[str, str]
    n_params: int
    n_non_embedding_params: int
    flops_per_token: Callable[[int], float]
    n_heads: int | None = None
    n_kv_heads: int | None = None
    tied_embeddings: bool = False
    # (its own model class, the stage's layers, has the embedding, has the head)
    trim_to_stage: Callable[[Any, Sequence[int], bool, bool], None] | None = None
    takes_head_fn: bool = False
    attention: AttentionDescription = AttentionDescription()


@runtime_checkable
class MetricsSink(Protocol):
    """Receives one dict of numbers per logged step (console, jsonl, tensorboard, wandb ...)."""

    def log(self, step: int, metrics: Mapping[str, float], /) -> None: ...

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
    config: Mapping[str, object]


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
    - `model(path, storage_options)`: that model info alone, read without the weights (a run's
      `model: {from: PATH}` takes its shape from it).
    """

    def recognizes(self, path: str, storage_options: Mapping[str, object], /) -> bool: ...

    def describe(self) -> str: ...

    def model(self, path: str, storage_options: Mapping[str, object], /) -> dict[str, object]: ...

    def load(
        self, path: str, storage_options: Mapping[str, object], /
    ) -> tuple[dict[str, torch.Tensor], dict[str, object]]: ...


@runtime_checkable
class ModelOptions(Protocol):
    """What the training code reads of a model plugin's options class (the `model:` section):

    - `vocab_size`: token ids the model embeds (packed data with more ids is refused);
    - `max_seq_len`: the longest sequence it takes (a longer `data.seq_len` is refused);
    - `doc_masking`: attention stays within each packed document (the data then carries
      document starts, which the model takes as `doc_starts=`);
    - `training_only` (a class attribute): the options that shape training but not the function
      the weights compute (dropout, ...); a warm start may change them.
    """

    training_only: ClassVar[frozenset[str]]

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_seq_len(self) -> int: ...

    @property
    def doc_masking(self) -> bool: ...


# --- the model contract: what the commands that use a trained model need of it ---


@runtime_checkable
class LanguageModel(Protocol):
    """What generation (`llmtrain generate`), held-out eval (`llmtrain eval`), downstream scoring
    (`eval-tasks`, the `downstream` callback) and lm-eval need of the module a `model` plugin
    builds (a torch Module; training needs `describe()` and `init_weights()` besides):

    - `model(tokens, /, **inputs)` (torch runs `forward`): logits (B, T, V >= vocab_size) for
      tokens (B, T); ids at or past `options.vocab_size` are padding and never sampled. Keyword
      inputs are passed only where declared: `doc_starts=` when `options.doc_masking`;
      `positions=`, `attention_mask=`, `logits_at=` together when `packed_rows`; `cache=` and
      `start_pos=` with a cache `new_cache` returned.
    - `options`: the `ModelOptions` it was built with (`vocab_size`, `max_seq_len`).
    - `packed_rows`: forward takes `positions` (B, T), `attention_mask` (B, T, T) and
      `logits_at` (B, T) and returns the logits of the `logits_at` tokens only, so downstream
      scoring packs a question's options after one copy of their context; False: one row a
      request.
    - `new_cache(batch, max_len, /)`: a cache for incremental decoding, or None. With one,
      `model(new_tokens, cache=c, start_pos=p)` continues after the p tokens already run;
      without, `generate` reruns the whole prefix for each new token.
    - the state dict is the weights: buffers computed from the options (RoPE tables, masks) are
      registered with `persistent=False`, so a checkpoint loads strictly.
    """

    packed_rows: ClassVar[bool]

    @property
    def options(self) -> ModelOptions: ...

    def __call__(self, tokens: torch.Tensor, /, **inputs: object) -> torch.Tensor: ...

    def forward(self, tokens: torch.Tensor, /) -> torch.Tensor: ...

    def new_cache(self, batch: int, max_len: int, /) -> object | None: ...


@runtime_checkable
class ParallelModel(Protocol):
    """A model laid out over the device mesh (what a `ParallelStrategy` returns): the parts this
    rank holds and how to run a step on them, whatever the layout.

    Losses are sums over target tokens. `forward_backward` backpropagates `loss_sum * scale`
    (the trainer passes 1 / the global count of counted targets) and returns this rank's summed
    loss; `evaluate` returns it without gradients. `sum_over_data` sums a number over the ranks
    that read different data (`data_world` of them; this one reads slice `data_rank`).
    """

    @property
    def parts(self) -> Sequence[torch.nn.Module]:
        """The modules this rank holds (one per pipeline stage here; the whole model without
        pipelining): what optimizers and checkpoints take."""
        ...

    @property
    def device(self) -> torch.device: ...

    @property
    def spec(self) -> MeshSpec: ...

    @property
    def data_rank(self) -> int: ...

    @property
    def data_world(self) -> int: ...

    def size(self, dim: str, /) -> int:
        """The degree of one mesh dimension (pp, dp_replicate, dp_shard, cp, tp, dp, ...)."""
        ...

    def dim(self, name: str, /) -> DeviceMesh:
        """The 1-D device mesh of one dimension (`.size()`, `.get_group()` for collectives over
        it, as a callback summing over `cp` or `pp` needs)."""
        ...

    def parameters(self) -> Iterator[torch.nn.Parameter]: ...

    def train(self, mode: bool = ..., /) -> None: ...

    def forward_backward(
        self,
        tokens: torch.Tensor,
        targets: torch.Tensor,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        /,
        *,
        scale: float | torch.Tensor = ...,
        doc_starts: torch.Tensor | None = ...,
    ) -> torch.Tensor:
        """`scale`: a number, or a float64 tensor on the device (1 / the step's count, which
        the trainer does not read on the host)."""
        ...

    def evaluate(
        self,
        tokens: torch.Tensor,
        targets: torch.Tensor,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        /,
        *,
        doc_starts: torch.Tensor | None = ...,
        inputs: Mapping[str, torch.Tensor] | None = ...,
    ) -> torch.Tensor:
        """`inputs`: further keyword inputs of the model's forward (a mapping; e.g. the packed
        rows of downstream scoring: positions, attention_mask, logits_at), for layouts that
        split neither the model nor the sequence (no pp, cp or tp)."""
        ...

    def sum_over_data(self, value: torch.Tensor, /) -> torch.Tensor: ...

    def clip_grad_norm_(self, max_norm: float | None, /) -> torch.Tensor:
        """Clip the gradients to a global L2 norm (None: only measure it); returns the norm, a
        float32 tensor on the device (not read, so the step waits for nothing)."""
        ...

    def after_optimizer_step(self, applied: torch.Tensor | None = None, /) -> None:
        """The modules' state updates after an optimizer step (`AfterOptimizerStep`);
        `applied`: a boolean device tensor, False where the step was skipped: their state then
        stays as it was, without the host reading the flag."""
        ...

    def materialize(self, init: Callable[[torch.nn.Module], None], /) -> None:
        """Allocate parts built on the meta device on this rank's device; `init(part)` fills them."""
        ...

    def load_full_state_dict(self, state: Mapping[str, torch.Tensor], /) -> None:
        """Load unsharded weights (every rank passes the same); each part takes its own keys."""
        ...

    def full_state_dict(self) -> dict[str, object]:
        """The unsharded weights of the parts this rank holds."""
        ...


@runtime_checkable
class ParallelStrategy(Protocol):
    """What a `parallel` plugin builds from its options: it checks a layout before any process
    group exists, then lays a model out over the device mesh.

    - `check(mesh, world_size, description, *, seq_len, device_type, microbatches)`: the
      resolved mesh spec, or a UserError naming every reason the model does not fit the layout
      (`microbatches`: gradient accumulation steps per optimizer step). What the model's
      attention masks and how it scores (document masking, windows, soft-capping) it reads from
      `description.attention`.
    - `parallelize(description, device_mesh, device, *, microbatches)`: the model of
      `description` (built on the meta device) as a `ParallelModel` on `device_mesh`.
    """

    def check(
        self,
        mesh: MeshSpec,
        world_size: int,
        description: ModelDescription,
        /,
        *,
        seq_len: int,
        device_type: str,
        microbatches: int,
    ) -> MeshSpec: ...

    def parallelize(
        self,
        description: ModelDescription,
        device_mesh: DeviceMesh,
        device: torch.device,
        /,
        *,
        microbatches: int,
    ) -> ParallelModel: ...


@runtime_checkable
class TrainingRun(Protocol):
    """What a callback sees of the run it is in (train-loop's Trainer): read these, change
    nothing but through `request_stop`.

    - `config`: the resolved run config (train-loop's `RunConfig`); `run_info`: what loggers are
      told of the run (name, run dir, steps, the config as plain data);
    - `run_dir`, `world` (rank, world size), `device`;
    - `model`: the parallelized model; `description`: what the model said about itself;
    - `step`: optimizer steps applied so far; `total_steps`; `global_batch` (sequences per step);
    - `plan`: this rank's data order (`plan.step(i)`: its sample indices of 0-based step `i`, one
      array per micro-batch); `train_data`: the training windows (data-pack's `WindowDataset`:
      `sampler.lookup(samples)` gives each sample's dataset and window);
    - `counters`: the values checkpoints carry (`step`, `tokens`, `elapsed_s`, ...);
    - `data_wait_s`, `sync_wait_s`: seconds this rank has waited for data and at each step's
      first collective, since the process started;
    - `last_local_loss`: (this rank's summed loss, its counted targets) of the last step, tensors;
    - `plugins`: the run's `PluginManager` (to build plugin entries: tasks, tokenizers, ...);
      `tokenizer`: the `Tokenizer` the training data was packed with;
    - `random`: a `random.Random` seeded with the run's seed whose state checkpoints carry: draw
      Python-level randomness from it, not from the global `random` (libraries draw from that
      one at moments no run controls, e.g. botocore when it retries a request, so a resumed run
      could not continue it exactly);
    - `record_metric(name, value, reduce="mean", better=None)`: add a number to this step's
      logged metrics (`MetricRecorder`): a device tensor stays on the device until a logged step
      reads every recorded value at once; `metric_directions`: which way each logged metric
      improves (`"higher"` or `"lower"`);
    - `request_stop(reason)`: end the run after this step, without saving it; call it on every
      rank alike (decide from numbers all ranks share);
    - `evaluate(due)`: the held-out loss, perplexity and bits per byte of the model's current
      weights on `data.eval`'s sets (`due`: their indices; default all), by metric name, read
      from the device once; call it on every rank alike.
    """

    @property
    def config(self) -> Any: ...

    @property
    def run_info(self) -> RunInfo: ...

    @property
    def run_dir(self) -> Path: ...

    @property
    def world(self) -> World: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def model(self) -> ParallelModel: ...

    @property
    def description(self) -> ModelDescription: ...

    @property
    def step(self) -> int: ...

    @property
    def total_steps(self) -> int: ...

    @property
    def global_batch(self) -> int: ...

    @property
    def plan(self) -> Any: ...

    @property
    def train_data(self) -> Any: ...

    @property
    def counters(self) -> Any: ...

    @property
    def data_wait_s(self) -> float: ...

    @property
    def sync_wait_s(self) -> float: ...

    @property
    def last_local_loss(self) -> tuple[torch.Tensor, torch.Tensor] | None: ...

    @property
    def plugins(self) -> PluginManager: ...

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def random(self) -> random.Random: ...

    def record_metric(
        self,
        name: str,
        value: float | torch.Tensor,
        /,
        *,
        reduce: Reduce = "mean",
        better: Better = None,
    ) -> None: ...

    @property
    def metric_directions(self) -> Mapping[str, str]: ...

    def request_stop(self, reason: str, /) -> None: ...

    def evaluate(self, due: Sequence[int] | None = None, /) -> dict[str, float]: ...


# how a recorded metric combines the values of the ranks that read different data (the data
# ranks) when it is logged: their mean, sum or largest; None: every rank holds the run's value
Reduce = Literal["mean", "sum", "max"] | None
REDUCTIONS: tuple[Reduce, ...] = ("mean", "sum", "max", None)
# which way a metric improves, for the analysis commands (None: by its name's rule,
# `metric_names.better_of`)
Better = Literal["higher", "lower"] | None


class MetricRecorder(Protocol):
    """`record_metric(name, value, reduce=..., better=...)`: one call, from the step, an
    objective or a callback, records a number for the step's logged metrics.

    `value` is a device tensor (one element) or a number. Tensors are not read when recorded:
    reading one waits for every kernel queued before it (a host sync), so a logged step reads
    all of them at once, after one collective per reduction over the data ranks; a step that is
    not logged reads nothing and its values are dropped. The latest value of a name in a step
    is the one logged. `better`: which way the metric improves, written to `summary.json` for
    the analysis commands (`compare`, `report`) to rank runs by."""

    def __call__(
        self,
        name: str,
        value: float | torch.Tensor,
        /,
        *,
        reduce: Reduce = "mean",
        better: Better = None,
    ) -> None: ...


class Callback:
    """Code that runs inside a training run at its events (plugin kind `callback`): subclass it
    and override the events you need; the others cost nothing (the trainer calls only what a
    class overrides). `run` is the run as `TrainingRun` describes it (train-loop hands over a
    view of its trainer, nothing more). Every rank calls every event, in the same order, so an
    event may run collectives when all ranks reach it.

    Events, in the order a run meets them:
    - `on_load(run, step)`: a checkpoint was resumed (this callback's state is already back).
    - `on_run_start(run)`: the loop is about to start, at `run.step` (0, or the resumed step).
    - `before_step(run, step)` / `after_step(run, step, metrics)`: around optimizer step `step`
      (1-based). `metrics` is the step's record: keys added here are logged with it when the step
      is logged (every `training.log_every` steps, eval steps and the last one). Its values are
      numbers or one-element device tensors (`loss`, `grad_norm`, what was recorded with
      `run.record_metric`); reading a tensor as a number (`float(x)`) waits for the device, a
      stall of the step's kernel queue: leave them to the logged step, which reads them all at
      once, or record new values with `run.record_metric` instead.
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

    def on_load(self, run: TrainingRun, step: int) -> None: ...

    def on_run_start(self, run: TrainingRun) -> None: ...

    def before_step(self, run: TrainingRun, step: int) -> None: ...

    def after_step(self, run: TrainingRun, step: int, metrics: dict[str, Any]) -> None: ...

    def before_eval(self, run: TrainingRun, step: int) -> None: ...

    def after_eval(self, run: TrainingRun, step: int, metrics: dict[str, float]) -> None: ...

    def on_log(
        self, run: TrainingRun, step: int, metrics: dict[str, float], rank_metrics: dict[str, float]
    ) -> None: ...

    def before_save(self, run: TrainingRun, step: int) -> None: ...

    def after_save(self, run: TrainingRun, step: int) -> None: ...

    def on_run_end(self, run: TrainingRun, status: str) -> None: ...

    def on_failure(self, run: TrainingRun, error: BaseException) -> None: ...


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


# --- the training objective (`training.objective`, plugin kind `objective`) ---


@attrs.frozen(kw_only=True)
class ObjectiveContext:
    """What an objective's factory gets from the run: `target(options, context)`.

    `parts`: the model parts (torch modules) this rank holds; `device`: the torch device;
    `compile`: whether the run compiles; `storage_options`: the checkpoint storage options (to
    read a teacher checkpoint from the same store); `config`: the run config as a mapping;
    `pipeline_stages`: the pipeline-parallel degree (the loss runs on the last stage only);
    `plugins`: the run's plugin manager (to build a teacher model from its checkpoint);
    `averaged_ranks`: how many ranks' gradients the layout averages (those reading different
    tokens: data and context shards), which the layout makes up for by scaling the loss by it: a
    term whose gradient must not grow with them divides by it; `record_metric`: the run's
    `MetricRecorder`, for the objective's own numbers (e.g. its loss terms)."""

    parts: Sequence[torch.nn.Module]
    device: torch.device
    plugins: PluginManager | None = None
    compile: bool = False
    storage_options: Mapping[str, str] = attrs.Factory(dict)
    config: Mapping[str, Any] = attrs.Factory(dict)
    pipeline_stages: int = 1
    averaged_ranks: int = 1
    record_metric: MetricRecorder | None = None


class Objective(Protocol):
    """The loss of a training step, summed over the counted targets (the trainer scales by one
    over the global count). It may also have `from_hidden(hidden, weight, targets, /)`, the same
    sum from the final hidden states and the output matrix (parallel's `HiddenStateLoss`)."""

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor, /) -> torch.Tensor: ...

    def prepare(
        self, inputs: torch.Tensor, targets: torch.Tensor, count: torch.Tensor, /
    ) -> torch.Tensor:
        """The targets parallel splits along dim 0 and hands back to the loss (the targets
        themselves for cross-entropy); `count`: the step's global number of counted targets, a
        float32 tensor on the device (use it in tensor arithmetic: reading it as a number would
        stall the device every step). An objective's own numbers go to
        `ObjectiveContext.record_metric`."""
        ...


@runtime_checkable
class AuxiliaryLosses(Protocol):
    """A model part with auxiliary losses (MoE load balancing) an objective may add itself:
    `inject_aux_loss(False)` stops the part adding them through its own backward, `aux_loss()`
    is the weighted sum of the last forward's."""

    def inject_aux_loss(self, enabled: bool, /) -> None: ...

    def aux_loss(self) -> torch.Tensor: ...


@runtime_checkable
class ExpertParallel(Protocol):
    """A module holding a Mixture-of-Experts layer's `n_experts` experts as stacked weights
    (expert dimension first). Under expert parallelism (`mesh.ep > 1`) the parallel strategy
    calls `shard_experts(ep_mesh)` on the meta device, before FSDP: the module then keeps
    experts `[rank * n / ep, (rank + 1) * n / ep)` as DTensors sharded on dimension 0 over the
    1-D `ep_mesh`, and sends each token to the rank holding its expert (and back) itself."""

    n_experts: int

    def shard_experts(self, ep_mesh: DeviceMesh, /) -> None: ...


@runtime_checkable
class AfterOptimizerStep(Protocol):
    """A module whose state moves after each optimizer step outside the gradients (MoE's
    per-expert routing bias). `sum_over_ranks(tensor)` returns the tensor summed over every rank
    that saw different tokens of the step, so every rank updates its state alike."""

    def after_optimizer_step(
        self, sum_over_ranks: Callable[[torch.Tensor], torch.Tensor], /
    ) -> None: ...
