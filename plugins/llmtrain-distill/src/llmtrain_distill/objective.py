"""The distillation loss and its teacher.

Per counted target: `alpha · CE(student, target) + (1 - alpha) · T² · KL(softmax(teacher / T) ||
softmax(student / T))` (Hinton et al.'s T², so the soft term's gradient keeps its scale across
temperatures), summed like every llmtrain loss (the trainer divides by the global count).

`prepare` stacks the inputs with the targets, (B, T, 2), so each micro-batch parallel hands the
loss carries exactly its own inputs: the frozen teacher (eval mode, no gradient, on the loss's
device) scores them there.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from llmtrain.core_mesh.errors import UserError
from llmtrain.core_mesh.interfaces import LanguageModel, MetricRecorder, ObjectiveContext
from llmtrain.train_loop.loss import IGNORE
from llmtrain_distill.plugin import DistillOptions

WHERE = "training.objective"


class Distill:
    """The `distill` objective (`llmtrain.core_mesh.interfaces.Objective`)."""

    def __init__(
        self,
        teacher: LanguageModel,
        options: DistillOptions,
        record_metric: MetricRecorder | None = None,
    ) -> None:
        self.teacher = teacher
        self.record_metric = record_metric
        self.alpha, self.temperature, self.z_loss = (
            options.alpha,
            options.temperature,
            options.z_loss,
        )
        # ce, kl, counted targets of the step so far, kept on the loss's device and recorded
        # as the step's metrics: read only when the step is logged
        self._sums: torch.Tensor | None = None

    def prepare(
        self, inputs: torch.Tensor, targets: torch.Tensor, count: torch.Tensor, /
    ) -> torch.Tensor:
        self._sums = None  # a new step
        return torch.stack([inputs, targets], dim=-1)

    def __call__(self, logits: torch.Tensor, packed: torch.Tensor, /) -> torch.Tensor:
        inputs, targets = packed[..., 0], packed[..., 1]
        with torch.no_grad():
            teacher = self.teacher(inputs)
        return self.loss(logits, teacher, targets)

    def loss(
        self, logits: torch.Tensor, teacher: torch.Tensor, targets: torch.Tensor
    ) -> torch.Tensor:
        """The summed loss of student `logits` against `teacher` logits (both (B, T, V))."""
        flat = logits.flatten(0, 1).float()
        target = targets.flatten()
        counted = target != IGNORE
        ce = F.cross_entropy(flat, target, reduction="sum", ignore_index=IGNORE)
        t = self.temperature
        soft_teacher = F.log_softmax(teacher.flatten(0, 1).float() / t, dim=-1)
        soft_student = F.log_softmax(flat / t, dim=-1)
        per_token = F.kl_div(soft_student, soft_teacher, reduction="none", log_target=True)
        kl = (per_token.sum(-1) * counted).sum()
        loss = self.alpha * ce + (1.0 - self.alpha) * t * t * kl
        if self.z_loss:
            log_z = torch.logsumexp(flat, dim=-1)
            loss = loss + self.z_loss * (log_z.square() * counted).sum()
        sums = torch.stack([ce.detach(), kl.detach(), counted.sum().to(ce.dtype)]).double()
        self._sums = sums if self._sums is None else self._sums + sums
        self._record(self._sums)
        return loss

    def _record(self, sums: torch.Tensor) -> None:
        """The step so far: mean cross-entropy and KL per counted target of this rank's
        micro-batches, averaged over the data ranks when logged (a rank that counted nothing
        records NaN)."""
        if self.record_metric is None:
            return
        ce, kl, count = sums.unbind()
        self.record_metric("distill/ce", ce / count, better="lower")
        self.record_metric("distill/kl", kl / count, better="lower")


def build(options: DistillOptions, context: ObjectiveContext) -> Distill:
    from llmtrain.train_loop.saved_model import load_model

    mesh = dict(context.config.get("mesh") or {})
    for key, what in (("pp", "pipeline"), ("tp", "tensor"), ("cp", "context")):
        if int(mesh.get(key) or 1) > 1:
            raise UserError(
                f"{WHERE}: distill does not run under {what} parallelism (mesh.{key}="
                f"{mesh[key]}); train the student with data parallelism only"
            )
    if context.plugins is None:
        raise UserError(f"{WHERE}: distill needs the run's plugins to load its teacher")
    url, step = teacher_location(options.teacher)
    try:
        teacher, info, _ = load_model(url, step, context.plugins)
    except UserError as error:
        raise UserError(f"{WHERE}.teacher: {error}") from None
    except (OSError, ValueError, RuntimeError) as error:
        raise UserError(
            f"{WHERE}.teacher: cannot load a checkpoint from {options.teacher} ({error})"
        ) from None
    student = (context.config.get("model") or {}).get("vocab_size")
    vocab = info.get("model", {}).get("vocab_size")
    if student != vocab:
        raise UserError(
            f"{WHERE}.teacher: the teacher's vocabulary ({vocab}) differs from the student's "
            f"model.vocab_size ({student}); distill needs the same tokenizer"
        )
    check_positions(options.teacher, teacher.options.max_seq_len, context.config)
    teacher.to(context.device).eval().requires_grad_(False)
    return Distill(teacher, options, context.record_metric)


def check_positions(teacher: str, longest: int, config: Mapping[str, Any]) -> None:
    """The teacher sees the student's windows, so it must take `data.seq_len` tokens (its
    learned positions or rope tables end at its `max_seq_len`): refused here, when the
    objective is built, not as a crash at the first step."""
    seq_len = (config.get("data") or {}).get("seq_len")
    if isinstance(seq_len, int) and seq_len > longest:
        raise UserError(
            f"{WHERE}.teacher: the teacher {teacher} takes at most {longest} tokens (its "
            f"model.max_seq_len), fewer than the student's data.seq_len ({seq_len}); distill "
            f"from a teacher trained with max_seq_len of at least {seq_len}, or lower "
            "data.seq_len"
        )


def teacher_location(path: str) -> tuple[str, int | None]:
    """(checkpoints directory, step or None for the newest) of a run directory, a checkpoints
    directory or one `step-N` directory."""
    local = Path(path)
    name = local.name
    if name.startswith("step-") and name[5:].isdigit():
        return str(local.parent), int(name[5:])
    if (local / "checkpoints").is_dir():
        return str(local / "checkpoints"), None
    return path, None
