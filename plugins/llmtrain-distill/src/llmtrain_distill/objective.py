"""The distillation loss and its teacher.

Per counted target: `alpha · CE(student, target) + (1 - alpha) · T² · KL(softmax(teacher / T) ||
softmax(student / T))` (Hinton et al.'s T², so the soft term's gradient keeps its scale across
temperatures), summed like every llmtrain loss (the trainer divides by the global count).

`prepare` stacks the inputs with the targets, (B, T, 2), so each micro-batch parallel hands the
loss carries exactly its own inputs: the frozen teacher (eval mode, no gradient, on the loss's
device) scores them there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from llmtrain.core_mesh.errors import UserError
from llmtrain.core_mesh.interfaces import ObjectiveContext
from llmtrain.train_loop.loss import IGNORE
from llmtrain_distill.plugin import DistillOptions

WHERE = "training.objective"


class Distill:
    """The `distill` objective (`llmtrain.core_mesh.interfaces.Objective`)."""

    def __init__(self, teacher: Any, options: DistillOptions) -> None:
        self.teacher = teacher
        self.alpha, self.temperature, self.z_loss = (
            options.alpha,
            options.temperature,
            options.z_loss,
        )
        # ce, kl, counted targets of the step so far, kept on the loss's device: read once a
        # step (metrics), not synced per micro-batch
        self._sums: torch.Tensor | None = None

    def prepare(self, inputs: torch.Tensor, targets: torch.Tensor, count: float, /) -> Any:
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
        return loss

    def metrics(self) -> dict[str, float]:
        """The step's mean cross-entropy and KL per counted target (this rank's micro-batches)."""
        if self._sums is None:
            return {}
        ce, kl, count = self._sums.tolist()
        self._sums = None
        if not count:
            return {}
        return {"distill/ce": ce / count, "distill/kl": kl / count}


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
    teacher.to(context.device).eval().requires_grad_(False)
    return Distill(teacher, options)


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
