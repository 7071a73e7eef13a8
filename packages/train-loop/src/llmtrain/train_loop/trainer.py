"""The Trainer: one run config, any scale. `__init__` reads top to bottom as the recipe:

world and layout (checked before any process group) → data → process group, logs, seeds → model
on the meta device → parallelize → initialise weights → optimizers and lr schedule → callbacks →
checkpoint resume → loggers. `train()` is the loop; `train_step()` is one optimizer step.
Everything around the step that a run may or may not want (watchdog, profiler, throughput,
stragglers, summary.json, plugins' callbacks) happens in callbacks (`callbacks.py`).
"""

from __future__ import annotations

import functools
import inspect
import json
import math
import os
import random
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import structlog
import torch
import yaml

from llmtrain.checkpoint.manager import Checkpointer, KeepPolicy
from llmtrain.checkpoint.preemption import Preemption
from llmtrain.checkpoint.state import ModelState, Values
from llmtrain.checkpoint.stream_storage import DEFAULT_THREADS
from llmtrain.core_mesh.config import (
    Choice,
    ConfigValueError,
    make_converter,
    structure,
    unstructure,
)
from llmtrain.core_mesh.errors import UserError, naming_file
from llmtrain.core_mesh.interfaces import (
    Better,
    MetricsSink,
    ModelDescription,
    Objective,
    ObjectiveContext,
    ParallelModel,
    ParallelStrategy,
    Reduce,
    RunInfo,
    Tokenizer,
)
from llmtrain.core_mesh.logs import configure_logging
from llmtrain.core_mesh.mesh import MeshSpec, build_device_mesh
from llmtrain.core_mesh.plugins import (
    LOGGER,
    LR_SCHEDULER,
    MODEL,
    OBJECTIVE,
    OPTIMIZER,
    PARALLEL,
    PluginManager,
)
from llmtrain.core_mesh.redact import redact, secret_values
from llmtrain.core_mesh.world import (
    World,
    default_device_type,
    init_distributed,
    shutdown_distributed,
)
from llmtrain.data_pack.loader import WindowDataset, open_windows
from llmtrain.data_pack.sampling import BatchPlan, Phase
from llmtrain.train_loop import callbacks, observe, warm_start
from llmtrain.train_loop.builtin_callbacks import builtin_callbacks
from llmtrain.train_loop.downstream_eval import METRIC_PREFIX as DOWNSTREAM_PREFIX
from llmtrain.train_loop.loss import IGNORE, bits_per_byte, cross_entropy_sum
from llmtrain.train_loop.metrics import MetricRecorder, StepMetrics, combine_over
from llmtrain.train_loop.mixture_schedule import on_resume, sampler_phases, schedule_of
from llmtrain.train_loop.prefetch import Prefetcher
from llmtrain.train_loop.run_config import (
    RunConfig,
    checked_model_options,
    option_compile,
    option_z_loss,
    resolved,
    warmup_outlasts,
    without_deprecated,
)
from llmtrain.train_loop.saved_model import model_info
from llmtrain.train_loop.schedules import (
    WarmupOptions,
    constant,
    decay_start,
    on_extend,
    on_lr_change,
    schedule_change,
)
from llmtrain.train_loop.step_gate import step_where
from llmtrain.train_loop.step_health import StepHealth
from llmtrain.train_loop.training_run import RunView

log = structlog.get_logger("llmtrain.train")


# the prefix the step-health counts are read under, beside the step's metrics
HEALTH = "step_health/"


class NonFiniteError(UserError):
    pass


class Trainer:
    def __init__(
        self,
        config: RunConfig,
        plugins: PluginManager,
        *,
        resume: bool | None = None,
        console: TextIO | None = None,
        preemption: Preemption | None = None,
    ):
        # listening already (`llmtrain run` starts it first thing), so a signal during the
        # setup below stops the run before its first step instead of killing it
        self.preemption = preemption
        current, self.deprecations = without_deprecated(config, plugins)
        c = self.config = resolved(current, plugins)
        self.plugins = plugins
        self.run_dir = Path(c.run_dir) / c.name
        # world, layout and data, all checked before any process group exists
        self.world = World.from_env()
        device_type = default_device_type() if c.device == "auto" else c.device
        if device_type == "cuda" and not torch.cuda.is_available():
            raise UserError("device: cuda, but no CUDA GPU is available; use device: cpu")
        spec = self._check_layout(device_type)
        self.total_steps = c.training.total_steps(self.global_batch * c.data.seq_len)
        self._open_data()
        # process group, logs, seeds; from here on a failure also stops the process group
        if device_type == "cuda":
            observe.flight_recorder_env(c.debug, self.run_dir / "logs")
            expandable_cuda_segments()
        self.device = init_distributed(self.world, device_type)
        try:
            self._build(spec, console, resume)
        except BaseException:
            shutdown_distributed(barrier=False)
            raise

    def _check_layout(self, device_type: str) -> MeshSpec:
        """The model (described on the meta device), the batch sizes and the mesh they run on."""
        c, plugins = self.config, self.plugins
        self.model_options = checked_model_options(plugins, c.model)
        with torch.device("meta"):
            meta_model = plugins.build(MODEL, c.model)
        self.description: ModelDescription = meta_model.describe()
        if self.model_options.doc_masking:
            refuse_doc_masking_without_doc_starts(plugins, c.model, meta_model)
        max_len = self.model_options.max_seq_len
        if c.data.seq_len > max_len:
            raise UserError(
                f"data.seq_len={c.data.seq_len} is longer than the model's max_seq_len "
                f"({max_len}); raise model.max_seq_len or shorten data.seq_len"
            )
        self.strategy: ParallelStrategy = plugins.build(PARALLEL, c.parallel)
        dp = c.mesh.resolve(self.world.world_size).dp
        try:
            self.global_batch, self.accum = c.data.batch_sizes(dp)
        except ConfigValueError as exc:
            raise UserError(f"data.{exc.field}: {exc}") from None
        self.doc_masking = self.model_options.doc_masking
        return self.strategy.check(
            c.mesh,
            self.world.world_size,
            self.description,
            seq_len=c.data.seq_len,
            device_type=device_type,
            microbatches=self.accum,
        )

    def _open_data(self) -> None:
        """Every dataset opens (and its tokenizer matches the model's) before heavy work."""
        c = self.config
        self.mixture = schedule_of(c.data, self.total_steps)
        self.train_data = self._open(
            [d.path for d in c.data.train],
            [d.weight for d in c.data.train],
            phases=sampler_phases(self.mixture, self.global_batch),
        )
        self.eval_data: list[WindowDataset] = []
        trained = self.train_data.sources[0].dataset.fingerprint
        for i, evaluation in enumerate(c.data.eval_sets):
            data = self._open([evaluation.path], None, shuffle=False)
            packed = data.sources[0].dataset.fingerprint
            if packed != trained:
                key = "data.eval" + (f"[{i}]" if isinstance(c.data.eval, list) else "")
                raise UserError(
                    f"{key}.path: {evaluation.path} was packed with another tokenizer "
                    f"({packed}) than the training data ({trained}); pack it with the same one"
                )
            self.eval_data.append(data)

    def _build(self, spec: MeshSpec, console: TextIO | None, resume: bool | None) -> None:
        """The recipe after the process group: logs, seeds, model, optimizers, callbacks, resume,
        loggers."""
        c = self.config
        self._start_logs(spec, console)
        self._deterministic_before = observe.seed_everything(c.seed, c.debug)
        # Python-level randomness for callbacks and plugins, carried by checkpoints; the global
        # `random` is left to libraries, which draw from it whenever they retry a request
        self.random = random.Random(c.seed)  # noqa: S311 - training randomness, not security
        observe.start_memory_history(self.device, c.debug)
        self._build_model(spec)
        self._build_optimizers()
        self._build_state()
        self._resume(self.config.checkpoint.resume == "auto" if resume is None else resume)
        # init.from when there was nothing to resume (weights only); the provenance either way
        if c.init is None or c.init.state == "weights":
            init = warm_start.start(c.init, self.model, self.checkpoints, self.info, self.plugins)
            if init is not None:
                self.info["init"] = init
        elif (latest := self.checkpoints.latest_step()) is not None:  # a resumed branch
            self.info["init"] = self.checkpoints.info(latest).get("info", {}).get("init")
        self.step = int(self.counters["step"])
        self.saved_step = self.step if self.step else None
        # the order the run reads from here on, for `llmtrain which`
        log.debug("data.mixture", schedule=self.mixture)
        self._start_loggers()

    def _start_logs(self, spec: MeshSpec, console: TextIO | None) -> None:
        """This rank's logs, and what the run is about to do (with its warnings)."""
        c = self.config
        tokens_per_step = self.global_batch * c.data.seq_len
        epochs = self.total_steps * self.global_batch / len(self.train_data)
        # the config's credentials: masked wherever the run writes text (logs, summary.json)
        self.secrets = secret_values(unstructure(c, converter=make_converter(self.plugins)))
        configure_logging(
            rank=self.world.rank,
            world_size=self.world.world_size,
            run_id=c.name,
            log_dir=self.run_dir / "logs",
            console=console,
            secrets=self.secrets,
        )
        log.info(
            "run.start",
            run_dir=str(self.run_dir),
            world=self.world.world_size,
            mesh=str(spec),
            steps=self.total_steps,
            global_batch=self.global_batch,
            grad_accum=self.accum,
            tokens=self.total_steps * tokens_per_step,
            epochs=round(epochs, 3),
        )
        if epochs > 1:
            log.warning(
                "data.repeats",
                message=f"{self.total_steps} steps read {epochs:.2f} epochs of the training data "
                f"({len(self.train_data)} windows); samples repeat in a new order each epoch",
            )
        # chat data: the loss counts only masked-in targets; generate --chat reads the template
        if self._chat() is not None and not self.doc_masking and self.world.is_main:
            log.warning(
                "data.chat_without_doc_masking",
                message="the training data is chat conversations, packed several to a "
                "window, and model.doc_masking is off: each conversation attends to the ones "
                "before it in its window; set model.doc_masking: true to keep them apart",
            )
        for message in self.deprecations if self.world.is_main else ():
            log.warning("config.deprecated", message=message)

    def _build_model(self, spec: MeshSpec) -> None:
        """The model: parallelized on the meta device, then allocated and initialised; the
        metrics recorder; the objective, and the loss of held-out evaluation."""
        c = self.config
        mesh = build_device_mesh(spec, self.device.type)
        self.model: ParallelModel = self.strategy.parallelize(
            self.description, mesh, self.device, microbatches=self.accum
        )
        self.model.materialize(_init_weights)
        if c.training.init == "full":
            self.model.load_full_state_dict(self._initial_weights())
        # the step's numbers stay on the device until a logged step reads them
        data_group = self.model.dim("dp").get_group() if self.model.data_world > 1 else None
        self.recorder = MetricRecorder(combine_over(data_group), self.model.data_world)
        self.health = StepHealth(self.device)
        # the chunked form of the loss compiles its softmax on CUDA when the run compiles
        compiles = option_compile(self.plugins.options_of("parallel", c.parallel))
        self.objective = self._objective(compiles)
        # held-out eval stays plain cross-entropy whatever the objective, so eval_loss compares
        z_loss = option_z_loss(self.plugins.options_of("objective", c.training.objective))
        self.loss_fn = cross_entropy_sum(
            c.training.z_loss if z_loss is None else z_loss, compile_chunks=compiles
        )

    def _build_optimizers(self) -> None:
        """Optimizers (one list per model part) and the lr schedule, a pure function of the
        step."""
        c, plugins = self.config, self.plugins
        self.optimizers = [plugins.build(OPTIMIZER, c.optimizer, part) for part in self.model.parts]
        for opt in self._all_optimizers():
            for group in opt.param_groups:
                group.setdefault("base_lr", group["lr"])
        schedule = c.lr_scheduler or None
        short = warmup_outlasts(schedule, self.total_steps)
        if short is not None and self.world.is_main:
            log.warning("lr.warmup_outlasts_run", message=short)
        # what checkpoints record of it (as their JSON reads back): a resume compares it with
        # the configured one
        recorded = (
            None if schedule is None else unstructure(schedule, converter=make_converter(plugins))
        )
        self.lr_schedule = json.loads(
            json.dumps({"lr_scheduler": recorded, "total_steps": self.total_steps})
        )
        self.lr_factor = (
            plugins.build(LR_SCHEDULER, schedule, self.total_steps)
            if schedule is not None
            else constant(WarmupOptions(), self.total_steps)
        )

    def _build_state(self) -> None:
        """This rank's data order, the counters, checkpoints and what they carry, callbacks
        (their state rides with checkpoints)."""
        c = self.config
        self.view = RunView(self)  # what callbacks see of the run
        self.plan = BatchPlan(self.global_batch, self.model.data_world, self.model.data_rank)
        self.counters = Values(step=0, tokens=0, skipped=0, consumed=0, elapsed_s=0.0)
        self.checkpoints = Checkpointer(
            c.checkpoint.dir or str(self.run_dir / "checkpoints"),
            keep=KeepPolicy(
                last=c.checkpoint.keep_last,
                every=c.checkpoint.keep_every or 0,
                steps=frozenset(c.checkpoint.steps),
            ),
            async_save=c.checkpoint.async_save,
            storage_options=c.checkpoint.storage_options,
            io_threads=c.checkpoint.io_threads or DEFAULT_THREADS,
            python_rng=self.random,
        )
        self.state = {
            "train": ModelState(self.model.parts, self.optimizers),
            "counters": self.counters,
        }
        self.info = {
            "model": model_info(self.plugins, c.model),
            "data": {
                "fingerprint": self.train_data.sources[0].dataset.fingerprint,
                "tokenizer": self.train_data.sources[0].dataset.meta["tokenizer"],
                "global_batch": self.global_batch,
                "seq_len": c.data.seq_len,
                "chat": self._chat(),
                "mixture": self.mixture,
            },
            "lr_schedule": self.lr_schedule,
        }
        self.data_wait_s = self.sync_wait_s = 0.0  # seconds waited, for the throughput callback
        self.last_local_loss: tuple[torch.Tensor, torch.Tensor] | None = None
        self.stop_reason: str | None = None
        self.callbacks = callbacks.Callbacks(
            [*builtin_callbacks(self.view), *callbacks.configured(c.callbacks, self.plugins)]
        )

    def _start_loggers(self) -> None:
        """Loggers (rank 0) and the resolved config beside them, both without credentials: run
        directories are shared and loggers upload what they are given."""
        c, plugins = self.config, self.plugins
        config = redact(unstructure(c, converter=make_converter(plugins)))
        self.run_info = RunInfo(
            name=c.name,
            run_dir=str(self.run_dir),
            total_steps=self.total_steps,
            start_step=self.step,
            config=config,
        )
        self.sinks: list[MetricsSink] = []
        if self.world.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            text = yaml.safe_dump(config, sort_keys=False)
            with naming_file(self.run_dir / "config.yaml"):
                (self.run_dir / "config.yaml").write_text(provenance_header() + text)
            self.sinks = [plugins.build(LOGGER, choice, self.run_info) for choice in c.loggers]

    # --- setup helpers ---
    def _chat(self) -> dict[str, Any] | None:
        """The chat template of the training data, if it is chat conversations."""
        sources = self.train_data.sources
        return next((s.dataset.chat for s in sources if s.dataset.chat is not None), None)

    def _open(
        self,
        paths: list[str],
        weights: list[float] | None,
        *,
        phases: list[Phase] | None = None,
        shuffle: bool | None = None,
    ) -> WindowDataset:
        c = self.config
        data = open_windows(
            paths,
            c.data.seq_len,
            weights=None if phases else weights,
            phases=phases,
            seed=c.seed if c.data.seed is None else c.data.seed,
            doc_starts=self.doc_masking,
            shuffle=c.data.shuffle if shuffle is None else shuffle,
            cache_bytes=c.data.cache_mib << 20,
            storage_options=c.data.storage_options,
        )
        vocab = self.model_options.vocab_size
        packed = data.sources[0].dataset.vocab_size
        if packed > vocab:
            raise UserError(
                f"{paths[0]} was packed with a tokenizer of {packed} ids, but model.vocab_size "
                f"is {vocab}; set model.vocab_size: {packed} (or more)"
            )
        return data

    def _resume(self, resume: bool) -> None:
        """Go on from the run's newest committed checkpoint; with none, and `init.state: all`,
        from the step of another run that `init` names (a branch)."""
        latest = self.checkpoints.latest_step()
        if latest is None:
            init = self.config.init
            if init is not None and init.state == "all":
                self._go_on(
                    Checkpointer(init.from_, storage_options=init.storage_options),
                    init.step,
                    branch=True,
                )
            return
        if not resume:
            raise UserError(
                f"{self.checkpoints.url} already has checkpoints (newest: step {latest}); "
                "resume (--resume or checkpoint.resume: auto), or choose another run name"
            )
        self._go_on(self.checkpoints, latest, branch=False)

    def _go_on(self, source: Checkpointer, latest: int | None, *, branch: bool) -> None:
        """Load the whole training state of `source`'s step `latest` and go on from it: this
        run's own checkpoint (a resume) or another run's (`branch`: `init.state: all`)."""
        if branch and latest not in source.committed_steps():
            committed = source.committed_steps()
            raise UserError(
                f"init.step: {source.url} has no committed step {latest} to branch from "
                f"(committed: {', '.join(map(str, committed[-8:])) or 'none'}); train the run "
                "it branches from first"
            )
        assert latest is not None
        data = source.info(latest).get("info", {}).get("data", {})
        if data.get("fingerprint") not in (None, self.info["data"]["fingerprint"]):
            raise UserError(
                f"checkpoint step {latest} was trained on data packed with another tokenizer "
                f"({data['fingerprint']}); this run's data has "
                f"{self.info['data']['fingerprint']}"
            )
        if data.get("global_batch") not in (None, self.global_batch):
            raise UserError(
                f"checkpoint step {latest} was trained with a global batch of "
                f"{data['global_batch']} sequences, this run uses {self.global_batch}: the data "
                "order would differ; keep the batch size to resume"
            )
        if data.get("seq_len") not in (None, self.config.data.seq_len):
            raise UserError(
                f"checkpoint step {latest} was trained with data.seq_len {data['seq_len']}, this "
                f"run uses {self.config.data.seq_len}: the windows and their order would differ; "
                "keep the sequence length to resume (start a new run, with init.from, to change it)"
            )
        self._check_resumable(source, latest)
        configured = [group["base_lr"] for group in self._param_groups()]
        # the callbacks' plain state first: it says which tensors of theirs the step holds
        saved = source.info(latest).get("info", {}).get("callbacks", {})
        self.callbacks.load_state(saved, source.step_url(latest))
        step = source.load(self._checkpointed(), step=latest)
        self._resume_lr(step, configured)
        if data.get("mixture") is not None:
            self._resume_mixture(step, data["mixture"])
        trained = source.info(step).get("info", {}).get("lr_schedule")
        if trained is not None and trained != self.lr_schedule:
            self._resume_schedule(step, trained)
        if branch:
            self.info["init"] = {
                "from": source.url,
                "step": step,
                "format": "llmtrain",
                "state": "all",
            }
        event = "run.branched" if branch else "run.resumed"
        log.info(event, step=step, checkpoint=source.step_url(step))
        self.callbacks.emit("on_load", self.view, step)

    def _check_resumable(self, source: Checkpointer, latest: int) -> None:
        """Refuse a resume that would train another model than the checkpoint's (another
        parametrization: the same weights, other multipliers) or train nothing (a checkpoint
        past the configured steps)."""
        c = self.config
        recorded = source.info(latest).get("info", {}).get("model", {})
        was = recorded.get("parametrization")
        now = self.info["model"].get("parametrization")
        if was is not None and now is not None and was != now:
            raise UserError(
                f"model.parametrization: checkpoint step {latest} was trained with "
                f"parametrization {was}, the config says {now}: the same weights would be "
                f"another model; set model.parametrization: {was} to resume, or start a new run "
                "(another name, or init.from) to change it"
            )
        if latest > self.total_steps:
            key = "training.steps" if c.training.steps is not None else "training.tokens"
            raise UserError(
                f"{key}: checkpoint step {latest} is past the {self.total_steps} steps the "
                f"config asks for: nothing would be trained; set {key} for more than "
                f"{latest} steps to train on, or choose another run name to start over"
            )

    def _param_groups(self) -> Iterator[dict[str, Any]]:
        for opt in self._all_optimizers():
            yield from opt.param_groups

    def _resume_lr(self, step: int, configured: list[float]) -> None:
        """A resume whose configured lr (`configured`: each group's `base_lr` before the
        checkpoint's optimizer state replaced it) is not the trained one: keep the trained one,
        take the configured one or refuse, as `training.on_extend` says; never silently."""
        groups = list(self._param_groups())
        changed = [
            (group["base_lr"], lr)
            for group, lr in zip(groups, configured, strict=True)
            if not math.isclose(group["base_lr"], lr, rel_tol=1e-9)
        ]
        if not changed:
            return
        decision = on_lr_change(self.config.training.on_extend, step, *changed[0])
        if not decision.keep_trained:
            for group, lr in zip(groups, configured, strict=True):
                group["base_lr"] = lr
        if self.world.is_main:
            log.warning(decision.event, message=decision.message)

    def _resume_mixture(self, step: int, trained: list[dict[str, Any]]) -> None:
        """A resume at `step` goes on with the configured mixture schedule where it gives the
        trained steps the same data; otherwise `training.on_extend` keeps the trained one or
        the resume is refused (`mixture_schedule.on_resume`)."""
        resumed = on_resume(trained, self.mixture, step, self.config.training.on_extend)
        if resumed.schedule != self.mixture:
            self.mixture = self.info["data"]["mixture"] = resumed.schedule
            phases = sampler_phases(resumed.schedule, self.global_batch)
            weights = resumed.schedule[0]["weights"] if phases is None else None
            self.train_data.sampler.remix(weights=weights, phases=phases)
        if resumed.event is not None and self.world.is_main:
            log.warning(resumed.event, message=resumed.message)

    def _resume_schedule(self, step: int, trained: dict[str, Any]) -> None:
        """A resume at `step` whose configured lr schedule is not the one the checkpoint was
        trained with (`trained`, as recorded): go on with the configured one where the lr stays
        where it is; otherwise refuse, keep the trained one or recompute, as
        `training.on_extend` says. Loud either way: never a silent jump."""
        c = self.config
        try:
            choice = trained["lr_scheduler"]
            trained_factor = (
                constant(WarmupOptions(), trained["total_steps"])
                if choice is None
                else self.plugins.build(
                    LR_SCHEDULER,
                    structure(choice, Choice.of("lr_scheduler"), plugins=self.plugins),
                    trained["total_steps"],
                )
            )
        except (UserError, KeyError, TypeError) as exc:
            raise UserError(
                f"checkpoint step {step} records an lr schedule this installation cannot "
                f"build ({trained!r}: {exc}); start a new run (init.from) instead"
            ) from None
        base_lr = next(self._all_optimizers()).param_groups[0]["base_lr"]
        change = schedule_change(trained_factor, self.lr_factor, step, base_lr)
        keys = []
        if trained["total_steps"] != self.total_steps:
            keys.append("training.steps" if c.training.steps is not None else "training.tokens")
        if trained["lr_scheduler"] != self.lr_schedule["lr_scheduler"]:
            keys.append("lr_scheduler")
        options_now = c.lr_scheduler and self.plugins.options_of("lr_scheduler", c.lr_scheduler)
        decision = on_extend(
            c.training.on_extend,
            change,
            trained,
            self.lr_schedule,
            keys,
            decay_start(options_now, self.total_steps),
        )
        if decision.keep_trained:
            self.lr_factor, self.lr_schedule = trained_factor, trained
            self.info["lr_schedule"] = trained
        if self.world.is_main:
            log.warning(decision.event, message=decision.message)

    def _objective(self, compiles: bool) -> Objective:
        """The run's `training.objective`, built for the model parts this rank holds."""
        c, plugins = self.config, self.plugins
        choice = c.training.objective
        context = ObjectiveContext(
            parts=list(self.model.parts),
            device=self.device,
            compile=compiles,
            storage_options=dict(c.checkpoint.storage_options),
            config=unstructure(c, converter=make_converter(plugins)),
            pipeline_stages=c.mesh.pp,
            plugins=plugins,
            averaged_ranks=self.model.size("dp_cp"),
            record_metric=self.recorder.record,
        )
        return plugins.build(OBJECTIVE, choice, context)

    def _initial_weights(self) -> dict[str, torch.Tensor]:
        return initial_model(self.plugins, self.config.model, self.config.seed).state_dict()

    def _all_optimizers(self) -> Iterator[torch.optim.Optimizer]:
        for opts in self.optimizers:
            yield from opts

    # --- the loop ---
    def train(self) -> int:
        """Run to the target; returns the last step. Saves on preemption (SIGTERM/SIGUSR1).
        Callbacks hear every event; the summary one writes `summary.json` on rank 0."""
        try:
            self.callbacks.emit("on_run_start", self.view)
            status = self._train()
        except torch.OutOfMemoryError as exc:
            self.callbacks.emit_failure(self.view, exc)
            raise observe.out_of_memory_error(
                exc, self.device, self.run_dir, self.step + 1, self.world.rank, self.config.debug
            ) from None
        except BaseException as exc:
            self.callbacks.emit_failure(self.view, exc)
            raise
        self.callbacks.emit("on_run_end", self.view, status)
        return self.step

    def _train(self) -> str:
        """Steps until the target (`finished`), a preemption signal or a callback's stop request
        (`stopped`). The last step is saved, unless a callback stopped the run."""
        preemption = self.preemption or Preemption()
        preemption.device = self.device
        data = Prefetcher(self.train_data, self.plan, self.step)
        started, elapsed = time.perf_counter(), float(self.counters["elapsed_s"])
        try:
            if preemption.should_stop():  # signalled during the setup
                log.warning(
                    "run.preempted",
                    message=f"stopped by a signal before step {self.step + 1}; nothing new to "
                    "save, and `llmtrain run` with the same config starts or resumes it",
                )
                return "stopped"
            while self.step < self.total_steps:
                metrics = self._next_step(data)
                self.counters["elapsed_s"] = elapsed + time.perf_counter() - started
                self._log_and_save(metrics)
                if self._votes_now(metrics) and preemption.should_stop():
                    self._save_last()
                    log.warning(
                        "run.preempted",
                        message=f"stopped by a signal after step {self.step}; the checkpoint is "
                        f"saved and `llmtrain run` with the same config resumes it",
                    )
                    return "stopped"
                if self.stop_reason is not None:
                    log.warning("run.stopped", step=self.step, message=self.stop_reason)
                    return "stopped"
            self._save_last()
            return "finished"
        finally:
            data.close()
            if self.preemption is None:  # one handed in is restored by whoever listened
                preemption.restore()
            self.checkpoints.close()

    def _votes_now(self, metrics: StepMetrics) -> bool:
        """Whether this step asks the ranks if any was signalled to stop: every step with one
        process (a flag, nothing to read); with several, a collective whose result the host
        reads, so only at steps that read the device anyway (logged and saved ones)."""
        return (
            self.world.world_size == 1
            or self.config.debug.host_syncs  # as before: a vote after every step
            or self._logs_now(metrics)
            or self._saves_now()
        )

    def _logs_now(self, metrics: StepMetrics) -> bool:
        """Every `log_every` steps, the last step, and steps that evaluated."""
        return (
            self.step % self.config.training.log_every == 0
            or self.step == self.total_steps
            or any(name == "eval_loss" or name.startswith("eval/") for name in metrics)
            or any(name.startswith(DOWNSTREAM_PREFIX) for name in metrics)
        )

    def _saves_now(self) -> bool:
        every = self.config.training.checkpoint_every
        periodic = every is not None and every > 0 and self.step % every == 0
        return periodic or self.step in self.config.checkpoint.steps

    def _next_step(self, data: Prefetcher) -> StepMetrics:
        """One step with its batch, its callbacks and, when due, the evaluation."""
        self.callbacks.emit("before_step", self.view, self.step + 1)
        waited = time.perf_counter()
        data_step, batch = data.next()
        self.data_wait_s += time.perf_counter() - waited
        assert data_step == self.step, (data_step, self.step)
        metrics = self.train_step(batch)
        self.callbacks.emit("after_step", self.view, self.step, metrics)
        last = self.step == self.total_steps
        due = [
            i
            for i, evaluation in enumerate(self.config.data.eval_sets)
            if self.step % evaluation.every == 0 or (last and evaluation.at_end)
        ]
        if due:
            self.callbacks.emit("before_eval", self.view, self.step)
            metrics.update(self.evaluate(due))
            self.callbacks.emit("after_eval", self.view, self.step, metrics)
        return metrics

    def _log_and_save(self, metrics: StepMetrics) -> None:
        """A logged step reads its metrics (and a saved one the skipped steps, which the
        checkpoint counts); other steps read nothing from the device."""
        logs, saves = self._logs_now(metrics), self._saves_now()
        if logs or saves:
            values = self._read(metrics)
            if logs:
                self._log(values)
        if saves:
            self.save()

    def _save_last(self) -> None:
        if self.saved_step != self.step:
            self._read({})  # the skipped steps the checkpoint counts
            self.save(blocking=True)
        self.checkpoints.wait()

    @functools.cached_property
    def tokenizer(self) -> Tokenizer:
        """The tokenizer the training data was packed with (built on first use)."""
        from llmtrain.data_pack.tokenizer import tokenizer_from_raw

        packed = self.train_data.sources[0].dataset.meta["tokenizer"]
        tokenizer: Tokenizer = tokenizer_from_raw(packed["spec"], self.plugins)
        return tokenizer

    def record_metric(
        self, name: str, value: Any, /, *, reduce: Reduce = "mean", better: Better = None
    ) -> None:
        """Add a number (a device tensor, read only if the step is logged) to this step's
        metrics: core-mesh's `MetricRecorder`."""
        self.recorder.record(name, value, reduce=reduce, better=better)

    @property
    def metric_directions(self) -> dict[str, str]:
        """Which way each logged metric improves ("higher" or "lower")."""
        return dict(self.recorder.directions)

    def request_stop(self, reason: str) -> None:
        """End the run after this step without saving it (a callback's call: the steps since
        the last checkpoint are not kept). `summary.json` says `stopped`."""
        self.stop_reason = reason

    def train_step(self, batch: dict[str, np.ndarray]) -> StepMetrics:
        """One optimizer step over this rank's share of the global batch. Nothing in it reads
        the device: the loss, the gradient norm and whether the step was applied stay there
        until a logged or saved step reads them (`_read`)."""
        c = self.config
        metrics = self.recorder.new_step()
        inputs, targets, doc_starts = self._to_device(batch)
        # the first collective of the step: ranks that got here early wait for the slowest
        # (where collectives block the host, as gloo's do; NCCL's are queued)
        waited = time.perf_counter()
        local_count = (targets != IGNORE).sum().float()
        count = self.model.sum_over_data(local_count.clone())
        if c.debug.host_syncs:  # as the step did before: the count read before the forward
            float(count)
        self.sync_wait_s += time.perf_counter() - waited
        lr = self._set_lr()
        # 1 / count in float64, as the Python number it was: the layout rounds it to float32
        # where it multiplies the loss, so the gradients have the same bits. A step whose loss
        # mask counted nothing divides by 1 (its loss is 0) and is not applied.
        scale = 1.0 / count.double().clamp(min=1.0)
        local = self.model.forward_backward(
            inputs,
            self.objective.prepare(inputs, targets, count),
            self.objective,
            scale=scale,
            doc_starts=doc_starts,
        )
        self.last_local_loss = (local.detach(), local_count)
        loss = self.model.sum_over_data(local) / count
        grad_norm = self.model.clip_grad_norm_(c.training.max_grad_norm)
        self.step += 1
        applied = self.health.check(self.step, loss, grad_norm, count)
        if c.debug.host_syncs:  # as before: the finite check the optimizer step waited for
            bool(applied)
        step_where(self._all_optimizers(), applied)
        self.model.after_optimizer_step(applied)
        for opt in self._all_optimizers():
            opt.zero_grad(set_to_none=True)
        self._advance()
        # float64, as the Python numbers callbacks got before: their arithmetic on them gives
        # the same bits (the values are the float32 ones, exactly)
        own: dict[str, Any] = {"loss": loss.double(), "grad_norm": grad_norm.double(), "lr": lr}
        if self.train_data.loss_mask:
            own["loss_tokens"] = count.double()
        # the trainer's own numbers first, then what the objective recorded (the logged order)
        recorded = dict(metrics)
        metrics.clear()
        metrics.update(own)
        metrics.update((k, v) for k, v in recorded.items() if k not in own)
        return metrics

    def _set_lr(self) -> float:
        """Set this step's scheduled lr on every group; returns the one logged: the configured
        lr times the schedule, whatever a group's µP multiplier."""
        lr_factor = self.lr_factor(self.step)
        for opt in self._all_optimizers():
            for group in opt.param_groups:
                scheduled = group["base_lr"] * lr_factor
                # a µP group (optim.multiplier_groups) keeps its multiplier on top
                multiplier = group.get("lr_multiplier")
                group["lr"] = scheduled if multiplier is None else scheduled * multiplier
        return float(self.optimizers[0][0].param_groups[0]["base_lr"] * lr_factor)

    def _advance(self) -> None:
        self.counters["step"] = self.step
        self.counters["tokens"] = self.step * self.global_batch * self.config.data.seq_len
        self.counters["consumed"] = self.step * self.global_batch

    def _to_device(
        self, batch: dict[str, np.ndarray]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Inputs, targets (masked ones set to IGNORE) and document starts (or None)."""
        tokens = torch.from_numpy(batch["tokens"]).to(self.device, non_blocking=True)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        mask = batch.get("loss_mask")
        if mask is not None:
            counted = torch.from_numpy(mask[:, 1:]).to(self.device, non_blocking=True)
            targets = targets.masked_fill(~counted, IGNORE)
        doc = batch.get("doc_starts") if self.doc_masking else None
        doc_starts = torch.from_numpy(doc).to(self.device) if doc is not None else None
        return inputs, targets, doc_starts

    def _read(self, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """The step's metrics as numbers, and the steps not applied since the last read (judged
        by `training.non_finite`): one host sync for both."""
        health = {HEALTH + k: v for k, v in self.health.tensors().items()}
        values = self.recorder.read(metrics, health)
        self.health.reset()
        counts = {k.removeprefix(HEALTH): values.pop(k) for k in health}
        if counts["empty"]:
            log.warning(
                "step.no_counted_tokens",
                step=int(counts["first_empty"]),
                steps=int(counts["empty"]),
                message="the loss mask counts no token of the global batch of "
                f"{int(counts['empty'])} step(s) since the last logged step, the first step "
                f"{int(counts['first_empty'])}; they made no update",
            )
        if values.get("loss_tokens") == 0:  # this step counted nothing: it has no loss
            values.pop("loss", None)
            values["grad_norm"] = 0.0
        if counts["non_finite"]:
            self._non_finite(counts)
        return values

    def _non_finite(self, counts: Mapping[str, float]) -> None:
        """`training.non_finite` on the steps since the last read that were not finite."""
        policy = self.config.training.non_finite
        first, n = int(counts["first_non_finite"]), int(counts["non_finite"])
        what = f"loss {counts['first_loss']}, gradient norm {counts['first_grad_norm']}"
        skipped = int(self.counters["skipped"]) + n
        self.counters["skipped"] = skipped
        if policy.action == "skip" and skipped <= policy.max_skips:
            log.warning("step.skipped", step=first, steps=n, reason=what, skipped=skipped)
            return
        self.checkpoints.wait()
        last = self.checkpoints.latest_step()
        kept = f"the last good checkpoint is step {last}" if last else "no checkpoint was saved"
        limit = f" after {policy.max_skips} skipped steps" if policy.action == "skip" else ""
        found = f" (found at step {self.step})" if first != self.step else ""
        raise NonFiniteError(
            f"step {first}: {what} is not finite{limit}{found}; the step was not applied and "
            f"{kept}. Lower optimizer.lr, check the data, or set "
            "training.non_finite.action: skip"
        )

    @torch.no_grad()
    def evaluate(self, due: Sequence[int] | None = None) -> dict[str, float]:
        """Loss, perplexity and, where the set records its bytes, bits per byte over the first
        `batches` global batches of each held-out set (`due`: which of `data.eval`'s sets;
        default all). One read of the device for all of them."""
        sets = self.config.data.eval_sets
        if not sets:
            raise UserError("data.eval is not set: this run has no held-out data to evaluate")
        chosen = range(len(sets)) if due is None else due
        self.model.train(False)
        try:
            sums = [self._eval_sums(sets[i].batches, self.eval_data[i]) for i in chosen]
        finally:
            self.model.train(True)
        totals = self.model.sum_over_data(torch.stack([x for pair in sums for x in pair]))
        values = totals.double().tolist()  # the one read
        metrics = {}
        for n, i in enumerate(chosen):
            loss = values[2 * n] / values[2 * n + 1]
            metrics[sets[i].metric("loss")] = loss
            metrics[sets[i].metric("ppl")] = math.exp(min(loss, 50.0))
            bpb = bits_per_byte(loss, self.eval_data[i].sources[0].dataset)
            if bpb is not None:  # datasets packed before bytes were counted have none
                metrics[sets[i].metric("bpb")] = bpb
        return metrics

    def _eval_sums(self, batches: int, data: WindowDataset) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed loss, counted targets) of this rank's share of a held-out set's first
        `batches` global batches, on the device."""
        plan = BatchPlan(self.global_batch, self.model.data_world, self.model.data_rank)
        total = torch.zeros((), device=self.device)
        count = torch.zeros((), device=self.device)
        for step in range(batches):
            batch = data.read(np.concatenate(plan.step(step)))
            inputs, targets, doc_starts = self._to_device(batch)
            total += self.model.evaluate(inputs, targets, self.loss_fn, doc_starts=doc_starts)
            count += (targets != IGNORE).sum()
        return total, count

    def save(self, *, blocking: bool | None = None) -> None:
        """Save this step (in the background when checkpoint.async_save; `blocking` overrides),
        with the callbacks' state."""
        self.callbacks.emit("before_save", self.view, self.step)
        info = {**self.info, "callbacks": self.callbacks.state()}
        self.checkpoints.save(self.step, self._checkpointed(), info=info, blocking=blocking)
        self.callbacks.emit("after_save", self.view, self.step)
        self.saved_step = self.step

    def _checkpointed(self) -> dict[str, Any]:
        """What a checkpoint's shards hold: the model parts with their optimizers, the
        counters, and the tensors callbacks keep laid out like the model (the `ema` callback's
        average), each under its callback's key."""
        kept = self.callbacks.tensor_states(self.view)
        if taken := kept.keys() & self.state.keys():
            raise UserError(
                f"callbacks {sorted(taken)}: a callback may not be named like the "
                f"checkpoint's own state ({', '.join(self.state)})"
            )
        return {**self.state, **kept}

    def _log(self, metrics: dict[str, Any]) -> None:
        """A logged step: callbacks add to the record, then this rank's JSON log line (its own
        values where they differ) and the loggers (rank 0) get it."""
        metrics["tokens"] = self.counters["tokens"]
        rank_metrics: dict[str, float] = {}
        self.callbacks.emit("on_log", self.view, self.step, metrics, rank_metrics)
        # what callbacks recorded in on_log (another read, only when they did)
        late = self.recorder.new_step()
        if late:
            metrics.update(self.recorder.read(late))
        self.recorder.seen(metrics)
        line = {**metrics, **rank_metrics}
        log.debug("step", step=self.step, **{k: round(v, 6) for k, v in line.items()})
        for sink in self.sinks:
            sink.log(self.step, metrics)

    def close(self) -> None:
        for sink in self.sinks:
            try:  # one logger failing to close must not keep the others or the group open
                sink.close()
            except Exception as exc:  # noqa: BLE001 - a plugin's failure, reported
                log.warning("logger.close_failed", logger=type(sink).__name__, error=repr(exc))
        observe.restore_determinism(self._deterministic_before)
        shutdown_distributed()


def expandable_cuda_segments() -> None:
    """Let CUDA's caching allocator grow segments in place unless the user chose a setting:
    without it, blocks freed between differently sized tensors (a step's activations, the loss's
    chunks) fragment memory and the reserved peak runs well above the allocated one. TorchTitan's
    launcher sets the same; read when the allocator starts, so before the first CUDA tensor."""
    if "PYTORCH_ALLOC_CONF" not in os.environ and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ:
        os.environ["PYTORCH_ALLOC_CONF"] = "expandable_segments:True"


def provenance_header() -> str:
    """YAML comment lines: the llmtrain package versions and the git commit, if any."""
    import subprocess

    import importlib_metadata

    lines = ["# written by llmtrain run"]
    for dist in importlib_metadata.distributions():
        name = dist.metadata["Name"] or ""
        if name.startswith("llmtrain") or name == "torch":
            lines.append(f"# {name} {dist.version}")
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain"], capture_output=True, text=True, timeout=5
        ).stdout.strip()
        lines.append(f"# git {sha}{' (uncommitted changes)' if dirty else ''}")
    except (OSError, subprocess.SubprocessError):
        pass
    return "\n".join([lines[0], *sorted(set(lines[1:]))]) + "\n"


def refuse_doc_masking_without_doc_starts(
    plugins: PluginManager, choice: Choice, model: torch.nn.Module
) -> None:
    """`model.doc_masking: true` hands each batch's document starts to the model's forward as
    `doc_starts`: a model whose forward takes no such argument (nor `**kwargs`) is refused
    here, before the run starts, rather than failing at its first step."""
    try:
        parameters = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):  # no signature to read: the first step will tell
        return
    if any(p.name == "doc_starts" or p.kind is p.VAR_KEYWORD for p in parameters):
        return
    origin = plugins.registry(MODEL).get(choice.kind).origin.describe()
    raise UserError(
        f"model.doc_masking: true, but model kind {choice.kind!r} of {origin} cannot mask "
        f"documents (its forward takes no doc_starts); set model.doc_masking: false"
    )


def initial_model(plugins: PluginManager, choice: Choice, seed: int) -> torch.nn.Module:
    """The whole model initialised on CPU from the run seed: the same on every process (the
    weights a run with `training.init: full` starts from)."""
    with torch.device("meta"):
        full: torch.nn.Module = plugins.build(MODEL, choice)
    full.to_empty(device="cpu")
    torch.manual_seed(seed)
    _init_weights(full)
    return full


def _init_weights(part: torch.nn.Module) -> None:
    init = getattr(part, "init_weights", None)
    if init is None:
        raise UserError(
            f"{type(part).__name__} has no init_weights(); a model plugin's module must "
            "initialise its parameters and buffers after allocation from the meta device"
        )
    init()
