"""The Trainer: one run config, any scale. `__init__` reads top to bottom as the recipe:

world and layout (checked before any process group) → data → process group, logs, seeds → model
on the meta device → parallelize → initialise weights → optimizers and lr schedule → checkpoint
resume → loggers. `train()` is the loop; `train_step()` is one optimizer step.
"""

from __future__ import annotations

import json
import math
import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import structlog
import torch

from llmtrain.checkpoint.manager import Checkpointer, KeepPolicy
from llmtrain.checkpoint.preemption import Preemption
from llmtrain.checkpoint.state import ModelState, Values
from llmtrain.core_mesh.config import ConfigValueError, dump_config, make_converter, unstructure
from llmtrain.core_mesh.errors import UserError
from llmtrain.core_mesh.interfaces import RunInfo
from llmtrain.core_mesh.logs import configure_logging
from llmtrain.core_mesh.mesh import build_device_mesh
from llmtrain.core_mesh.plugins import PluginManager
from llmtrain.core_mesh.world import (
    World,
    default_device_type,
    init_distributed,
    shutdown_distributed,
)
from llmtrain.data_pack.loader import open_windows
from llmtrain.data_pack.sampling import BatchPlan
from llmtrain.train_loop import observe, warm_start
from llmtrain.train_loop.loss import IGNORE, cross_entropy_sum
from llmtrain.train_loop.run_config import RunConfig, resolved
from llmtrain.train_loop.schedules import WarmupOptions, constant

log = structlog.get_logger("llmtrain.train")

# dense bf16 peak of the GPUs we know, for MFU (override with training.peak_tflops)
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "A100": 312.0, "L40S": 362.0}


class NonFiniteError(UserError):
    pass


def options_of(plugins: PluginManager, kind: str, choice: Any) -> Any:
    """The structured options of a `kind:` choice (defaults when the config gave none)."""
    if choice.options is not None:
        return choice.options
    entry = plugins.registry(kind).get(choice.kind)
    return entry.options(**entry.defaults) if entry.options is not None else None


def build(plugins: PluginManager, kind: str, choice: Any, *args: Any) -> Any:
    entry = plugins.registry(kind).get(choice.kind)
    return entry.target(options_of(plugins, kind, choice), *args)


def model_info(plugins: PluginManager, choice: Any) -> dict[str, Any]:
    """The model section as plain data (stored in checkpoints to rebuild the model)."""
    options = options_of(plugins, "model", choice)
    return {"kind": choice.kind, **(unstructure(options) if options is not None else {})}


class Prefetcher:
    """Reads the next step's batch in a background thread while this one computes."""

    def __init__(self, dataset: Any, plan: BatchPlan, start_step: int, depth: int = 2):
        self.dataset, self.plan = dataset, plan
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(start_step,), daemon=True)
        self.thread.start()

    def _run(self, step: int) -> None:
        while not self.stop.is_set():
            try:
                item = (step, self.dataset.read(np.concatenate(self.plan.step(step))))
            except Exception as exc:  # noqa: BLE001 - re-raised in the training thread
                item = (step, exc)
            while not self.stop.is_set():
                try:
                    self.queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            step += 1

    def next(self) -> tuple[int, dict[str, np.ndarray]]:
        step, batch = self.queue.get()
        if isinstance(batch, BaseException):
            raise batch
        return step, batch

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)


class Trainer:
    def __init__(
        self,
        config: RunConfig,
        plugins: PluginManager,
        *,
        resume: bool | None = None,
        console: Any = None,
    ):
        c = self.config = resolved(config, plugins)
        self.plugins = plugins
        self.run_dir = Path(c.run_dir) / c.name

        # world and layout, all checked before any process group exists
        self.world = World.from_env()
        self.device_type = default_device_type() if c.device == "auto" else c.device
        if self.device_type == "cuda" and not torch.cuda.is_available():
            raise UserError("device: cuda, but no CUDA GPU is available; use device: cpu")
        self.model_options = options_of(plugins, "model", c.model)
        with torch.device("meta"):
            meta_model = build(plugins, "model", c.model)
        self.description = meta_model.describe()
        max_len = getattr(self.model_options, "max_seq_len", None)
        if max_len is not None and c.data.seq_len > max_len:
            raise UserError(
                f"data.seq_len={c.data.seq_len} is longer than the model's max_seq_len "
                f"({max_len}); raise model.max_seq_len or shorten data.seq_len"
            )
        self.strategy = build(plugins, "parallel", c.parallel)
        dp = c.mesh.resolve(self.world.world_size).dp
        try:
            self.global_batch, self.accum = c.data.batch_sizes(dp)
        except ConfigValueError as exc:
            raise UserError(f"data.{exc.field}: {exc}") from None
        self.doc_masking = bool(getattr(self.model_options, "doc_masking", False))
        spec = self.strategy.check(
            c.mesh,
            self.world.world_size,
            self.description,
            seq_len=c.data.seq_len,
            device_type=self.device_type,
            microbatches=self.accum,
            document_masking=self.doc_masking,
        )

        # data: every dataset opens (and its tokenizer matches the model) before heavy work
        self.train_data = self._open(
            [d.path for d in c.data.train], [d.weight for d in c.data.train]
        )
        self.eval_data = None
        if c.data.eval:
            self.eval_data = self._open([c.data.eval.path], None, shuffle=False)
            packed = self.eval_data.sources[0].dataset.fingerprint
            trained = self.train_data.sources[0].dataset.fingerprint
            if packed != trained:
                raise UserError(
                    f"data.eval.path: {c.data.eval.path} was packed with another tokenizer "
                    f"({packed}) than the training data ({trained}); pack it with the same one"
                )
        # chat data: the loss counts only masked-in targets; generate --chat reads the template
        self.loss_masked = self.train_data.loss_mask
        self.chat = next(
            (s.dataset.chat for s in self.train_data.sources if s.dataset.chat is not None), None
        )
        tokens_per_step = self.global_batch * c.data.seq_len
        self.total_steps = c.training.steps or math.ceil(c.training.tokens / tokens_per_step)
        epochs = self.total_steps * self.global_batch / len(self.train_data)

        # process group, logs, seeds; from here on a failure also stops the process group
        if self.device_type == "cuda":
            observe.flight_recorder_env(c.debug, self.run_dir / "logs")
        self.device = init_distributed(self.world, self.device_type)
        try:
            self._build(spec, epochs, tokens_per_step, console, resume)
        except BaseException:
            shutdown_distributed(barrier=False)
            raise

    def _build(self, spec, epochs, tokens_per_step, console, resume: bool | None) -> None:
        """The recipe after the process group: logs, seeds, model, optimizers, resume, loggers."""
        c, plugins = self.config, self.plugins
        configure_logging(
            rank=self.world.rank,
            world_size=self.world.world_size,
            run_id=c.name,
            log_dir=self.run_dir / "logs",
            console=console,
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
        self._deterministic_before = observe.seed_everything(c.seed, c.debug)
        observe.start_memory_history(self.device, c.debug)

        # the model: parallelize on the meta device, then allocate and initialise
        mesh = build_device_mesh(spec, self.device_type)
        self.model = self.strategy.parallelize(
            self.description, mesh, self.device, microbatches=self.accum
        )
        self.model.materialize(_init_weights)
        if c.training.init == "full":
            self.model.load_full_state_dict(self._initial_weights())
        self.loss_fn = cross_entropy_sum(c.training.z_loss)

        # optimizers (one list per model part) and the lr schedule, a pure function of the step
        self.optimizers = [
            build(plugins, "optimizer", c.optimizer, part) for part in self.model.parts
        ]
        for opt in self._all_optimizers():
            for group in opt.param_groups:
                group.setdefault("base_lr", group["lr"])
        schedule = c.lr_scheduler or None
        self.lr_factor = (
            build(plugins, "lr_scheduler", schedule, self.total_steps)
            if schedule is not None
            else constant(WarmupOptions(), self.total_steps)
        )

        # this rank's data order; checkpoint resume
        self.plan = BatchPlan(self.global_batch, self.model.data_world, self.model.data_rank)
        self.counters = Values(step=0, tokens=0, skipped=0, consumed=0, elapsed_s=0.0)
        self.checkpoints = Checkpointer(
            c.checkpoint.dir or str(self.run_dir / "checkpoints"),
            keep=KeepPolicy(last=c.checkpoint.keep_last, every=c.checkpoint.keep_every),
            async_save=c.checkpoint.async_save,
            storage_options=c.checkpoint.storage_options,
        )
        self.state = {
            "train": ModelState(self.model.parts, self.optimizers),
            "counters": self.counters,
        }
        self.info = {
            "model": model_info(plugins, c.model),
            "data": {
                "fingerprint": self.train_data.sources[0].dataset.fingerprint,
                "tokenizer": self.train_data.sources[0].dataset.meta["tokenizer"],
                "global_batch": self.global_batch,
                "seq_len": c.data.seq_len,
                "chat": self.chat,
            },
        }
        self._resume(c.checkpoint.resume == "auto" if resume is None else resume)
        # init.from when there was nothing to resume (weights only); the provenance either way
        init = warm_start.start(c.init, self.model, self.checkpoints, self.info, plugins)
        if init is not None:
            self.info["init"] = init
        self.step = int(self.counters["step"])
        self.saved_step = self.step if self.step else None

        # loggers (rank 0) and the resolved config beside them
        self.sinks = []
        if self.world.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            text = dump_config(c, converter=make_converter(plugins))
            (self.run_dir / "config.yaml").write_text(provenance_header() + text)
            run = RunInfo(
                name=c.name,
                run_dir=str(self.run_dir),
                total_steps=self.total_steps,
                start_step=self.step,
                config=unstructure(c, converter=make_converter(plugins)),
            )
            self.sinks = [build(plugins, "logger", choice, run) for choice in c.loggers]
        self.flops_per_token = self.description.flops_per_token(c.data.seq_len)
        self.peak_flops = self._peak_flops()
        self.sync_wait = 0.0
        self.clock = None
        if self.world.world_size > 1:
            self.clock = observe.CollectiveClock()
            self.clock.install()
        self.profiler = observe.StepProfiler(c.profile, self.run_dir, self.world.rank, self.device)
        self.watchdog = observe.Watchdog(c.debug.watchdog, self.run_dir / "logs", self.world.rank)

    # --- setup helpers ---
    def _open(self, paths: list[str], weights: list[float] | None, *, shuffle: bool | None = None):
        c = self.config
        data = open_windows(
            paths,
            c.data.seq_len,
            weights=weights,
            seed=c.seed if c.data.seed is None else c.data.seed,
            doc_starts=self.doc_masking,
            shuffle=c.data.shuffle if shuffle is None else shuffle,
            cache_bytes=c.data.cache_mib << 20,
            storage_options=c.data.storage_options,
        )
        vocab = getattr(self.model_options, "vocab_size", None)
        packed = data.sources[0].dataset.vocab_size
        if vocab is not None and packed > vocab:
            raise UserError(
                f"{paths[0]} was packed with a tokenizer of {packed} ids, but model.vocab_size "
                f"is {vocab}; set model.vocab_size: {packed} (or more)"
            )
        return data

    def _resume(self, resume: bool) -> None:
        latest = self.checkpoints.latest_step()
        if latest is None:
            return
        if not resume:
            raise UserError(
                f"{self.checkpoints.url} already has checkpoints (newest: step {latest}); "
                "resume (--resume or checkpoint.resume: auto), or choose another run name"
            )
        data = self.checkpoints.info(latest).get("info", {}).get("data", {})
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
        step = self.checkpoints.load(self.state, step=latest)
        log.info("run.resumed", step=step, checkpoint=self.checkpoints.step_url(step))

    def _initial_weights(self) -> dict[str, torch.Tensor]:
        return initial_model(self.plugins, self.config.model, self.config.seed).state_dict()

    def _peak_flops(self) -> float | None:
        if self.config.training.peak_tflops is not None:
            return self.config.training.peak_tflops * 1e12
        if self.device.type != "cuda":
            return None
        name = torch.cuda.get_device_name(self.device)
        for key, tflops in PEAK_TFLOPS.items():
            if key in name:
                return tflops * 1e12
        return None

    def _all_optimizers(self) -> Iterator[Any]:
        for opts in self.optimizers:
            yield from opts

    # --- the loop ---
    def train(self) -> int:
        """Run to the target; returns the last step. Saves on preemption (SIGTERM/SIGUSR1).
        Rank 0 ends by writing `summary.json` (finished, stopped, failed or interrupted)."""
        summary = self.run_dir / "summary.json"
        if self.world.is_main:
            summary.unlink(missing_ok=True)  # absent while running (or after a hard kill)
            if self.chat is not None and not self.doc_masking:
                log.warning(
                    "data.chat_without_doc_masking",
                    message="the training data is chat conversations, packed several to a "
                    "window, and model.doc_masking is off: each conversation attends to the ones "
                    "before it in its window; set model.doc_masking: true to keep them apart",
                )
        try:
            step = self._train()
        except torch.OutOfMemoryError as exc:
            self._write_summary("failed", error=f"OutOfMemoryError: {exc}")
            raise self._out_of_memory(exc) from None
        except BaseException as exc:
            status = "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed"
            self._write_summary(status, error=f"{type(exc).__name__}: {exc}")
            raise
        self._write_summary("finished" if step >= self.total_steps else "stopped")
        return step

    def _train(self) -> int:
        c = self.config
        preemption = Preemption(device=self.device)
        data = Prefetcher(self.train_data, self.plan, self.step)
        window = {"time": time.perf_counter(), "wait": 0.0, "tokens": 0, "steps": 0}
        started, elapsed = time.perf_counter(), float(self.counters["elapsed_s"])
        try:
            while self.step < self.total_steps:
                self.watchdog.start("step", self.step + 1)
                self.profiler.before_step(self.step + 1, self.total_steps)
                waited = time.perf_counter()
                data_step, batch = data.next()
                window["wait"] += time.perf_counter() - waited
                assert data_step == self.step, (data_step, self.step)
                metrics = self.train_step(batch)
                self.profiler.after_step()
                self.watchdog.end()
                window["tokens"] += self.global_batch * c.data.seq_len
                window["steps"] += 1
                if c.data.eval and self.step % c.data.eval.every == 0:
                    self.watchdog.start("eval", self.step)
                    metrics.update(self.evaluate())
                    self.watchdog.end()
                self.counters["elapsed_s"] = elapsed + time.perf_counter() - started
                log_now = self.step % c.training.log_every == 0 or self.step == self.total_steps
                if log_now or "eval_loss" in metrics:
                    self._log(metrics, window)
                every = c.training.checkpoint_every
                if every and self.step % every == 0:
                    self.save()
                if preemption.should_stop():
                    if self.saved_step != self.step:
                        self.save(blocking=True)
                    self.checkpoints.wait()
                    log.warning(
                        "run.preempted",
                        message=f"stopped by a signal after step {self.step}; the checkpoint is "
                        f"saved and `llmtrain run` with the same config resumes it",
                    )
                    return self.step
            if self.saved_step != self.step:
                self.save(blocking=True)
            return self.step
        finally:
            self.watchdog.end()
            self.profiler.close()
            data.close()
            preemption.restore()
            self.checkpoints.close()

    def _out_of_memory(self, exc: BaseException) -> UserError:
        where = ""
        if self.device.type == "cuda":
            path = self.run_dir / "memory" / f"oom-step{self.step + 1}-rank{self.world.rank}.pickle"
            if observe.dump_memory_snapshot(path) is not None:
                where = (
                    f" A memory snapshot is in {path} (drag it into https://pytorch.org/memory_viz"
                )
                if not self.config.debug.memory_history:
                    where += (
                        "; set debug.memory_history: true to record where each block was allocated"
                    )
                where += ")."
        return UserError(
            f"rank {self.world.rank}: out of memory in step {self.step + 1} ({exc}).{where} "
            "Lower data.micro_batch, turn on parallel.activation_checkpointing, shard more "
            "(mesh.dp_shard, tp), and compare with `llmtrain estimate`"
        )

    def _write_summary(self, status: str, error: str | None = None) -> None:
        """`summary.json` beside the metrics: how the run ended (sweeps skip finished runs)."""
        if not self.world.is_main:
            return
        step = int(self.counters["step"])  # applied steps (a rejected non-finite one is not)
        summary = {
            "status": status,
            "step": step,
            "total_steps": self.total_steps,
            "tokens": step * self.global_batch * self.config.data.seq_len,
            "wall_time_s": round(float(self.counters["elapsed_s"]), 3),
            "world_size": self.world.world_size,
            "error": error,
        }
        self.run_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.run_dir / "summary.json.tmp"
        tmp.write_text(json.dumps(summary, indent=1) + "\n")
        tmp.replace(self.run_dir / "summary.json")

    def train_step(self, batch: dict[str, np.ndarray]) -> dict[str, float]:
        """One optimizer step over this rank's share of the global batch."""
        c = self.config
        inputs, targets, doc_starts = self._to_device(batch)
        # the first collective of the step: ranks that got here early wait for the slowest
        waited = time.perf_counter()
        count = self.model.sum_over_data((targets != IGNORE).sum().float()).item()
        self.sync_wait += time.perf_counter() - waited
        lr_factor = self.lr_factor(self.step)
        for opt in self._all_optimizers():
            for group in opt.param_groups:
                group["lr"] = group["base_lr"] * lr_factor
        if count == 0:
            return self._nothing_counted()
        local = self.model.forward_backward(
            inputs, targets, self.loss_fn, scale=1.0 / count, doc_starts=doc_starts
        )
        loss = (self.model.sum_over_data(local) / count).item()
        grad_norm = self.model.clip_grad_norm_(c.training.max_grad_norm)
        finite = math.isfinite(loss) and math.isfinite(grad_norm)
        if finite:
            for opt in self._all_optimizers():
                opt.step()
            self.model.after_optimizer_step()
        for opt in self._all_optimizers():
            opt.zero_grad(set_to_none=True)
        self.step += 1
        if not finite:
            self._non_finite(loss, grad_norm)
        self._advance()
        lr = self.optimizers[0][0].param_groups[0]["lr"]
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": lr}
        if self.loss_masked:
            metrics["loss_tokens"] = count
        return metrics

    def _advance(self) -> None:
        self.counters["step"] = self.step
        self.counters["tokens"] = self.step * self.global_batch * self.config.data.seq_len
        self.counters["consumed"] = self.step * self.global_batch

    def _to_device(self, batch: dict[str, np.ndarray]) -> tuple[torch.Tensor, ...]:
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

    def _nothing_counted(self) -> dict[str, float]:
        """A global batch whose loss mask counts no token: nothing to learn, no update (an
        optimizer step on zero gradients would still move the weights through its momentum)."""
        self.step += 1
        log.warning(
            "step.no_counted_tokens",
            step=self.step,
            message="the loss mask counts no token of this step's global batch; the step "
            "made no update",
        )
        self._advance()
        lr = self.optimizers[0][0].param_groups[0]["lr"]
        return {"grad_norm": 0.0, "lr": lr, "loss_tokens": 0}

    def _non_finite(self, loss: float, grad_norm: float) -> None:
        policy = self.config.training.non_finite
        what = f"loss {loss}, gradient norm {grad_norm}"
        skipped = int(self.counters["skipped"]) + 1
        self.counters["skipped"] = skipped
        if policy.action == "skip" and skipped <= policy.max_skips:
            log.warning("step.skipped", step=self.step, reason=what, skipped=skipped)
            return
        self.checkpoints.wait()
        last = self.checkpoints.latest_step()
        kept = f"the last good checkpoint is step {last}" if last else "no checkpoint was saved"
        limit = f" after {policy.max_skips} skipped steps" if policy.action == "skip" else ""
        raise NonFiniteError(
            f"step {self.step}: {what} is not finite{limit}; the step was not applied and "
            f"{kept}. Lower optimizer.lr, check the data, or set "
            "training.non_finite.action: skip"
        )

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Loss and perplexity over the first `data.eval.batches` global batches of the eval set."""
        c = self.config
        plan = BatchPlan(self.global_batch, self.model.data_world, self.model.data_rank)
        total = torch.zeros((), device=self.device)
        count = torch.zeros((), device=self.device)
        self.model.train(False)
        try:
            for step in range(c.data.eval.batches):
                batch = self.eval_data.read(np.concatenate(plan.step(step)))
                inputs, targets, doc_starts = self._to_device(batch)
                total += self.model.evaluate(inputs, targets, self.loss_fn, doc_starts=doc_starts)
                count += (targets != IGNORE).sum()
        finally:
            self.model.train(True)
        loss = (self.model.sum_over_data(total) / self.model.sum_over_data(count)).item()
        return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0))}

    def save(self, *, blocking: bool | None = None) -> None:
        """Save this step (in the background when checkpoint.async_save; `blocking` overrides)."""
        self.watchdog.start("save", self.step)
        self.checkpoints.save(self.step, self.state, info=self.info, blocking=blocking)
        self.watchdog.end()
        self.saved_step = self.step

    def _log(self, metrics: dict[str, float], window: dict[str, float]) -> None:
        now = time.perf_counter()
        elapsed = max(now - window["time"], 1e-9)
        tokens_per_s = window["tokens"] / elapsed
        metrics = {
            **metrics,
            "tokens": self.step * self.global_batch * self.config.data.seq_len,
            "tokens_per_s": tokens_per_s,
            "step_time_s": elapsed / max(window["steps"], 1),
            "data_wait": window["wait"] / elapsed,
            "sync_wait": self.sync_wait / elapsed,
            **observe.memory_mib(self.device),
        }
        self.sync_wait = 0.0
        if self.peak_flops:
            world = self.world.world_size
            metrics["mfu"] = tokens_per_s * self.flops_per_token / (self.peak_flops * world)
        # this rank's own numbers go to its JSON log; the metrics get the worst rank's
        mine = dict(metrics)
        if self.clock is not None:
            ranks = self.clock.gather(
                [metrics[k] for k in ("data_wait", "sync_wait", "peak_memory_mib")], self.device
            )
            lag = observe.arrival_lag(ranks)
            if lag is not None:
                # the share of the window the others spent waiting for this rank to arrive
                mine["arrival_lag"] = lag[self.world.rank] / elapsed
                slowest = max(range(len(ranks)), key=lambda r: lag[r])
            else:  # different collectives per rank (pipeline stages): the one that waits least
                slowest = min(range(len(ranks)), key=lambda r: ranks[r][1])
            metrics["slowest_rank"] = slowest
            metrics["data_wait_max"] = max(r[0] for r in ranks)
            metrics["peak_memory_mib"] = max(r[2] for r in ranks)
        log.debug("step", step=self.step, **{k: round(v, 6) for k, v in mine.items()})
        for sink in self.sinks:
            sink.log(self.step, metrics)
        window.update(time=now, wait=0.0, tokens=0, steps=0)

    def close(self) -> None:
        for sink in self.sinks:
            try:  # one logger failing to close must not keep the others or the group open
                sink.close()
            except Exception as exc:  # noqa: BLE001 - a plugin's failure, reported
                log.warning("logger.close_failed", logger=type(sink).__name__, error=repr(exc))
        self.watchdog.close()
        if getattr(self, "clock", None) is not None:
            self.clock.remove()
        observe.restore_determinism(self._deterministic_before)
        shutdown_distributed()


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


def initial_model(plugins: PluginManager, choice: Any, seed: int) -> torch.nn.Module:
    """The whole model initialised on CPU from the run seed: the same on every process (the
    weights a run with `training.init: full` starts from)."""
    with torch.device("meta"):
        full = build(plugins, "model", choice)
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
