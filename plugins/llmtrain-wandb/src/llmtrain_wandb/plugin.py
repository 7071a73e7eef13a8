"""The `wandb` logger: one Weights & Biases run per llmtrain run, with the resolved config
(credentials redacted) as its config and every logged step's metrics in its history. A resumed llmtrain run resumes the same
W&B run: its id is kept in `<run dir>/wandb_run_id`.

`llmtrain` loads this module on every start: wandb is imported only when a run builds the logger.
"""

from __future__ import annotations

import logging
import secrets
import string
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

import attrs

from llmtrain.core_mesh.config import inside_run_dir, run_path
from llmtrain.core_mesh.errors import UserError
from llmtrain.core_mesh.interfaces import RunInfo
from llmtrain.core_mesh.metric_names import dashboard_metrics
from llmtrain.core_mesh.plugins import Register, hookimpl
from llmtrain.core_mesh.redact import redact

ID_FILE = "wandb_run_id"

log = logging.getLogger(__name__)


@attrs.frozen(kw_only=True)
class WandbOptions:
    project: str | None = None  # None: $WANDB_PROJECT, else wandb's default ("uncategorized")
    entity: str | None = None  # None: $WANDB_ENTITY, else your default entity
    name: str | None = None  # the W&B run's display name; None: the llmtrain run name
    group: str | None = None
    tags: list[str] = attrs.Factory(list)
    notes: str | None = None
    # None: wandb decides ($WANDB_MODE, then `wandb offline` / `wandb online`, then online)
    mode: Literal["online", "offline", "disabled"] | None = None
    # wandb writes <dir>/wandb/; relative to the run directory, which it may not leave (`../x` is
    # refused, as for the jsonl logger's file); an absolute path writes elsewhere on purpose;
    # None: the run directory
    dir: str | None = attrs.field(
        default=None, validator=inside_run_dir("directory"), metadata=run_path("directory")
    )


def run_id(run_dir: Path) -> str:
    """The W&B run id of this llmtrain run: read from the run directory, or made and written
    there before the W&B run starts (a process killed during `wandb.init` resumes the same id)."""
    path = run_dir / ID_FILE
    if path.exists():
        return path.read_text().strip()
    alphabet = string.ascii_lowercase + string.digits
    new = "".join(secrets.choice(alphabet) for _ in range(8))  # the shape of wandb's own ids
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(new + "\n")
    tmp.replace(path)
    return new


class WandbSink:
    """Resumes with `resume="allow"`. W&B keeps a run's steps increasing: after an online resume
    the server already holds the steps up to `run.starting_step - 1` (a killed process logged
    past its checkpoint), and those are skipped here instead of being refused one by one.

    W&B failing (its `wandb-core` process killed, say) never stops the training: the logger
    warns once and goes quiet.
    """

    def __init__(self, options: WandbOptions, run: RunInfo):
        import wandb

        run_dir = Path(run.run_dir)
        wandb_dir = run_dir / options.dir if options.dir else run_dir
        wandb_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.run = wandb.init(
                project=options.project,
                entity=options.entity,
                name=options.name or run.name,
                group=options.group,
                tags=list(options.tags) or None,
                notes=options.notes,
                mode=options.mode,
                dir=str(wandb_dir),
                id=run_id(run_dir),
                resume="allow",
                config=redact(run.config),  # W&B keeps it on a server: no credentials
            )
        except wandb.errors.Error as exc:
            raise UserError(
                f"the wandb logger could not start its W&B run: {exc} To log without a network "
                "or a W&B login, set `mode: offline` on the logger ({kind: wandb, mode: offline}) "
                "and upload the run later with `wandb sync`"
            ) from exc
        self.first_new_step = getattr(self.run, "starting_step", 0) or 0
        self.failed = False

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        if self.failed or step < self.first_new_step:
            return
        try:
            # keys that put the loss first (`loss/train`, `loss/eval`, then `memory/`, ...): the
            # same names as the tensorboard logger's
            self.run.log(dashboard_metrics(metrics), step=step)
        except Exception as exc:  # noqa: BLE001 - a logger must not stop the training
            self._give_up(f"step {step} and later are not logged to W&B", exc)

    def close(self) -> None:
        # the trainer closes its loggers in a `finally`: an exception on its way out is a failure
        exit_code = 1 if sys.exc_info()[0] is not None else 0
        try:
            self.run.finish(exit_code=exit_code)
        except Exception as exc:  # noqa: BLE001 - the run's own outcome matters more
            if not self.failed:
                self._give_up("the W&B run could not be finished", exc)
            self._release()

    def _give_up(self, what: str, exc: BaseException) -> None:
        self.failed = True
        log.warning(
            "wandb logger: %s (%s: %s); the training goes on (metrics.jsonl, if the jsonl logger "
            "is on, has every step), and a resumed run logs to the same W&B run again",
            what,
            type(exc).__name__,
            exc,
        )

    @staticmethod
    def _release() -> None:
        """Drop wandb's connection to a service that is gone, so that wandb's exit hook does not
        fail on it again."""
        import wandb

        try:
            wandb.teardown()
        except Exception:  # noqa: BLE001, S110 - already reported by _give_up
            pass


@hookimpl
def llmtrain_loggers(register: Register) -> None:
    register(
        "wandb",
        WandbSink,
        options=WandbOptions,
        help="Weights & Biases run (config, metrics), resumed with the llmtrain run",
    )
