"""Logger plugins (metrics sinks): `console` (a live progress line on rank 0) and `jsonl`
(`<run dir>/metrics.jsonl`, one JSON object per logged step). A logger's target is called as
`target(options, run_info)` and returns a `MetricsSink`."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping
from pathlib import Path

import attrs

from llmtrain.core_mesh.config import inside_run_dir, run_path
from llmtrain.core_mesh.errors import naming_file
from llmtrain.core_mesh.interfaces import RunInfo


@attrs.frozen(kw_only=True)
class ConsoleOptions:
    progress_bar: bool = True  # a tqdm bar; false: one plain line per logged step


@attrs.frozen(kw_only=True)
class JsonlOptions:
    # relative to the run directory, which it may not leave; an absolute path writes elsewhere
    # on purpose (the tensorboard and wandb loggers' `dir` is checked the same way)
    file: str = attrs.field(
        default="metrics.jsonl", validator=inside_run_dir("file"), metadata=run_path("file")
    )


def _fmt(key: str, value: float) -> str:
    if key == "lr":
        return f"{value:.2e}"
    if key in ("tokens_per_s",):
        return f"{value:,.0f}"
    if key == "mfu":
        return f"{100 * value:.1f}%"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return f"{value:.4g}" if isinstance(value, float) else str(value)


SHOWN = ("loss", "eval_loss", "lr", "grad_norm", "tokens_per_s", "mfu")


def _short(key: str) -> str:
    """How the console names a metric: `eval/web/loss` as `web_loss`, others as they are."""
    if key.startswith("eval/") and key.count("/") == 2:
        _, name, what = key.split("/")
        return f"{name}_{what}"
    return key


class ConsoleSink:
    def __init__(self, options: ConsoleOptions, run: RunInfo):
        self.bar = None
        if options.progress_bar and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(
                total=run.total_steps, initial=run.start_step, desc=run.name, unit="step"
            )
        self.last = run.start_step

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        # the named held-out sets' losses go beside eval_loss (`eval/web/loss` as `web_loss`)
        named = sorted(k for k in metrics if k.startswith("eval/") and k.endswith("/loss"))
        keys = [*SHOWN[:2], *named, *SHOWN[2:]]
        shown = {_short(k): _fmt(k, metrics[k]) for k in keys if k in metrics}
        if self.bar is not None:
            self.bar.update(step - self.last)
            self.bar.set_postfix(shown, refresh=True)
        else:
            line = f"step {step} " + " ".join(f"{k}={v}" for k, v in shown.items())
            print(line, file=sys.stderr, flush=True)
        self.last = step

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class JsonlSink:
    """Appends; on a resumed run first drops lines past the step it resumes from, so the file
    reads as one uninterrupted run."""

    def __init__(self, options: JsonlOptions, run: RunInfo):
        self.path = Path(run.run_dir) / options.file
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            kept = []
            for line in self.path.read_text().splitlines():
                step = _step_of(line)
                if step is not None and step <= run.start_step:
                    kept.append(line)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text("".join(line + "\n" for line in kept))
            tmp.replace(self.path)
        self.file = self.path.open("a")
        self.failed = False

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        with naming_file(self.path):
            try:
                self.file.write(json.dumps({"step": step, **metrics}) + "\n")
                self.file.flush()
            except OSError:
                self.failed = True  # the run ends with this error
                raise

    def close(self) -> None:
        try:
            with naming_file(self.path):
                self.file.close()
        except OSError:
            # closing retries the write that failed (a full disk): that error was the run's
            if not self.failed:
                raise


def _step_of(line: str) -> int | None:
    """The step of a metrics line; None for a blank or half-written one (a killed run)."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None
