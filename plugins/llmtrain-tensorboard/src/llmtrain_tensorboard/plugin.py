"""The `tensorboard` logger: every logged step's metrics as TensorBoard scalars and the resolved
run config as text (credentials redacted), in `<run dir>/tensorboard/` (one event file per
process start).

`llmtrain` loads this module on every start: torch and tensorboard are imported only when a run
builds the logger.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import attrs
import yaml

from llmtrain.core_mesh.config import inside_run_dir, run_path
from llmtrain.core_mesh.interfaces import RunInfo
from llmtrain.core_mesh.metric_names import dashboard_metrics
from llmtrain.core_mesh.plugins import Register, hookimpl
from llmtrain.core_mesh.redact import redact


@attrs.frozen(kw_only=True)
class TensorBoardOptions:
    # relative to the run directory, which it may not leave (`../x` is refused, as for the jsonl
    # logger's file); an absolute path writes elsewhere on purpose
    dir: str = attrs.field(
        default="tensorboard", validator=inside_run_dir("directory"), metadata=run_path("directory")
    )


def config_markdown(config: Mapping[str, object]) -> str:
    """The config as a fenced YAML block (TensorBoard renders text summaries as markdown),
    credentials redacted: event files are copied and uploaded freely."""
    text = yaml.safe_dump(redact(config), sort_keys=False, default_flow_style=False)
    return f"```yaml\n{text}```\n"


class TensorBoardSink:
    """Scalars in TensorBoard's classic form (`simple_value`, a float32), on disk when `log`
    returns: a SIGKILLed run keeps every point its checkpoint covers. It is the one scalar form
    that all of TensorBoard's readers show: the data server behind the web view ignores float64
    tensors and the classic `EventAccumulator.Scalars` reads only this form. A float32 holds a
    token count exactly up to 2**24 and a loss to about 7 digits; metrics.jsonl keeps the exact
    numbers.

    A resumed run starts its event file with a purge at `start_step + 1`: TensorBoard then hides
    what an earlier, killed process wrote past the checkpoint this one resumes from, so the
    curves read as one uninterrupted run (the `jsonl` logger trims its file the same way). The
    config text goes to that first step too, so a second resume from the same checkpoint
    replaces it instead of adding another copy.
    """

    def __init__(self, options: TensorBoardOptions, run: RunInfo):
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(run.run_dir) / options.dir
        first = run.start_step + 1
        self.writer = SummaryWriter(str(self.log_dir), purge_step=first)
        self.writer.add_text("config", config_markdown(run.config), global_step=first)
        self.writer.flush()

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        # tags that put the loss first (`loss/train`, `loss/eval`, then `memory/`, `optim/`, ...):
        # the same names as the wandb logger's
        for tag, value in dashboard_metrics(metrics).items():
            self.writer.add_scalar(tag, value, global_step=step)
        self.writer.flush()  # waits for the writer thread: cheap next to a training step

    def close(self) -> None:
        self.writer.close()


@hookimpl
def llmtrain_loggers(register: Register) -> None:
    register(
        "tensorboard",
        TensorBoardSink,
        options=TensorBoardOptions,
        help="TensorBoard scalars and config text in <run dir>/tensorboard",
    )
