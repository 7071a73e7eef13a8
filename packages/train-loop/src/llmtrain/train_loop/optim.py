"""Optimizer plugins: AdamW (fused where the device has it), Adam, SGD and Muon.

Weight decay applies to matrices only: parameters with fewer than two dimensions (norm scales,
biases) and embedding tables are excluded by rule. An optimizer plugin's target is called as
`target(options, module)` and returns a list of torch optimizers over the module's parameters
(Muon returns two: Muon for hidden matrices, AdamW for the rest).

µP: a module with `lr_multipliers()` (parameter name -> multiplier, entries != 1 only; a µP
model's hidden matrices get 1/width-multiplier) has its Adam-family groups split further by
multiplier. Such a group's `lr` is the configured lr times its multiplier; it also records the
configured lr as `base_lr` and the multiplier as `lr_multiplier`, which the trainer's schedule
multiplies back in at every step. A module without multipliers gets exactly the groups it always
got, with no extra keys.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar

import attrs

from llmtrain.core_mesh.config import ConfigValueError

if TYPE_CHECKING:
    from collections.abc import Iterable

    import torch
    from torch import nn

# an option's value, for the validators that check one
_Number = TypeVar("_Number", bound=float)


def _positive(instance: object, attribute: attrs.Attribute[_Number], value: _Number) -> None:
    if value <= 0:
        raise ValueError(f"must be positive, got {value}")


def _non_negative(instance: object, attribute: attrs.Attribute[_Number], value: _Number) -> None:
    if value < 0:
        raise ValueError(f"must be at least 0, got {value}")


def _beta(
    instance: object, attribute: attrs.Attribute[tuple[float, float]], value: tuple[float, float]
) -> None:
    if len(value) != 2 or not all(0.0 <= b < 1.0 for b in value):
        raise ValueError(f"must be two numbers in [0, 1), got {list(value)}")


@attrs.frozen(kw_only=True)
class AdamOptions:
    lr: float = attrs.field(default=3e-4, validator=_positive)
    betas: tuple[float, float] = attrs.field(default=(0.9, 0.95), validator=_beta)
    eps: float = attrs.field(default=1e-8, validator=_positive)
    weight_decay: float = attrs.field(default=0.1, validator=_non_negative)
    fused: bool | None = None  # None: fused on CUDA, foreach elsewhere


@attrs.frozen(kw_only=True)
class SGDOptions:
    lr: float = attrs.field(default=0.1, validator=_positive)
    momentum: float = attrs.field(default=0.9, validator=_non_negative)
    nesterov: bool = False
    weight_decay: float = attrs.field(default=0.0, validator=_non_negative)

    def __attrs_post_init__(self) -> None:
        if self.nesterov and self.momentum == 0:
            raise ConfigValueError("nesterov", "Nesterov momentum needs momentum > 0")


@attrs.frozen(kw_only=True)
class MuonOptions:
    """Muon (orthogonalised momentum) for the hidden weight matrices; AdamW (`adamw_lr`, the
    betas, eps) for embeddings, the output layer, norms and biases."""

    lr: float = attrs.field(default=0.02, validator=_positive)
    momentum: float = attrs.field(default=0.95, validator=_non_negative)
    weight_decay: float = attrs.field(default=0.1, validator=_non_negative)
    adamw_lr: float = attrs.field(default=3e-4, validator=_positive)
    betas: tuple[float, float] = attrs.field(default=(0.9, 0.95), validator=_beta)
    eps: float = attrs.field(default=1e-8, validator=_positive)


def _embedding_ids(module: nn.Module) -> set[int]:
    from torch import nn

    return {id(p) for m in module.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}


def decay_groups(
    module: nn.Module, weight_decay: float, params: Iterable[nn.Parameter] | None = None
) -> list[dict[str, Any]]:
    """Two parameter groups of `params` (default: all of the module's): matrices with weight
    decay; vectors (norm scales, biases) and embedding tables without."""
    embeddings = _embedding_ids(module)
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for p in module.parameters() if params is None else params:
        if not p.requires_grad:
            continue
        exempt = p.ndim < 2 or id(p) in embeddings
        (no_decay if exempt else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    groups.append({"params": no_decay, "weight_decay": 0.0})
    return [g for g in groups if g["params"]]


def lr_multipliers(module: nn.Module) -> dict[int, float]:
    """The module's µP learning-rate multipliers by parameter id: its `lr_multipliers()` names,
    matched against `named_parameters()`. The optimizer is built per model part (a pipeline
    stage, an FSDP- or TP-wrapped module): those keep the model's parameter names, and a stage
    simply lacks the names of the blocks it does not hold."""
    method = getattr(module, "lr_multipliers", None)
    by_name: dict[str, float] = method() if callable(method) else {}
    return {
        id(p): float(by_name[name])
        for name, p in module.named_parameters()
        if name in by_name and by_name[name] != 1.0
    }


def multiplier_groups(
    module: nn.Module, groups: list[dict[str, Any]], lr: float
) -> list[dict[str, Any]]:
    """`groups` split by the module's lr multipliers, each part with `lr` = `lr` x multiplier,
    `base_lr` = `lr` and `lr_multiplier`; `groups` themselves where the module has none."""
    multipliers = lr_multipliers(module)
    if not multipliers:
        return groups
    split: list[dict[str, Any]] = []
    for group in groups:
        by_multiplier: dict[float, list[nn.Parameter]] = {}
        for p in group["params"]:
            by_multiplier.setdefault(multipliers.get(id(p), 1.0), []).append(p)
        for multiplier, params in by_multiplier.items():
            split.append(
                {
                    **group,
                    "params": params,
                    "lr": lr * multiplier,
                    "base_lr": lr,
                    "lr_multiplier": multiplier,
                }
            )
    return split


def _implementation(fused: bool | None, module: nn.Module) -> dict[str, bool]:
    if fused is not None:
        return {"fused": fused}
    kinds = {type(p.data) for p in module.parameters()}
    if len(kinds) > 1:
        # DTensors beside plain tensors (TP without sequence parallelism leaves the norms
        # whole): the multi-tensor kernels refuse mixed lists, so step tensor by tensor
        return {"foreach": False}
    on_cuda = any(p.device.type == "cuda" for p in module.parameters())
    return {"fused": True} if on_cuda else {"foreach": True}


def _adam_family(name: str, options: AdamOptions, module: nn.Module) -> list[torch.optim.Optimizer]:
    import torch

    cls = getattr(torch.optim, name)
    return [
        cls(
            multiplier_groups(module, decay_groups(module, options.weight_decay), options.lr),
            lr=options.lr,
            betas=options.betas,
            eps=options.eps,
            **_implementation(options.fused, module),
        )
    ]


def adamw(options: AdamOptions, module: nn.Module) -> list[torch.optim.Optimizer]:
    """AdamW: weight decay applied to the weights, apart from the adaptive step."""
    return _adam_family("AdamW", options, module)


def adam(options: AdamOptions, module: nn.Module) -> list[torch.optim.Optimizer]:
    """Adam with L2-style weight decay folded into the gradient (torch.optim.Adam)."""
    return _adam_family("Adam", options, module)


def sgd(options: SGDOptions, module: nn.Module) -> list[torch.optim.Optimizer]:
    import torch

    if getattr(getattr(module, "cfg", None), "parametrization", "standard") == "mup":
        # the model's multipliers are Adam's (1/m for hidden matrices); µP under SGD scales
        # other parameters instead (Tensor Programs V, table 3), which no model states
        raise ConfigValueError(
            "kind",
            "sgd has no µP learning-rate rule here; use adamw, adam or muon with "
            "parametrization: mup, or parametrization: standard with sgd",
        )

    return [
        torch.optim.SGD(
            decay_groups(module, options.weight_decay),
            lr=options.lr,
            momentum=options.momentum,
            nesterov=options.nesterov,
        )
    ]


def muon(options: MuonOptions, module: nn.Module) -> list[torch.optim.Optimizer]:
    import torch
    from torch import nn

    if not hasattr(torch.optim, "Muon"):
        raise ConfigValueError("kind", f"torch {torch.__version__} has no torch.optim.Muon")
    # Muon orthogonalises hidden matrices; the embedding and output layers stay with AdamW.
    # Under µP the hidden matrices get no 1/m multiplier: Muon's update is orthogonalised (unit
    # spectral norm) and torch scales it by sqrt(max(1, fan_out / fan_in)), so its spectral norm
    # is lr x a shape factor that does not change when both dimensions grow with the width: the
    # spectral condition for feature learning, ||dW|| ~ sqrt(fan_out / fan_in) (Bernstein et
    # al., "A Spectral Condition for Feature Learning", arXiv 2310.17813), holds as it is. The
    # AdamW part takes the model's multipliers as adamw does.
    outer = _embedding_ids(module)
    head = getattr(module, "head", None)
    if isinstance(head, nn.Module):
        outer |= {id(p) for p in head.parameters()}
    hidden = [p for p in module.parameters() if p.ndim == 2 and id(p) not in outer]
    hidden_ids = {id(p) for p in hidden}
    rest = [p for p in module.parameters() if id(p) not in hidden_ids]
    optimizers: list[torch.optim.Optimizer] = []
    if hidden:
        optimizers.append(
            torch.optim.Muon(
                hidden, lr=options.lr, momentum=options.momentum, weight_decay=options.weight_decay
            )
        )
    if rest:
        optimizers.append(
            torch.optim.AdamW(
                multiplier_groups(
                    module, decay_groups(module, options.weight_decay, rest), options.adamw_lr
                ),
                lr=options.adamw_lr,
                betas=options.betas,
                eps=options.eps,
                **_implementation(None, nn.ParameterList(rest)),
            )
        )
    return optimizers
