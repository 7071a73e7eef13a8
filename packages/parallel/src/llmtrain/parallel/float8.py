"""float8 training through torchao (the `float8` extra), on GPUs with float8 matmuls (compute
capability 8.9 or newer: Ada, Hopper, Blackwell). Linear layers become float8 linears before
tensor parallelism and sharding; FSDP then all-gathers their weights in float8."""

from __future__ import annotations

from torch import nn

MIN_CAPABILITY = (8, 9)


def float8_problem(device_type: str) -> str | None:
    """Why float8 cannot run here, or None when it can."""
    if device_type != "cuda":
        return f"float8 training needs a CUDA GPU; this run is on {device_type}"
    import torch

    if not torch.cuda.is_available():
        return "float8 training needs a CUDA GPU; none is available here"
    capability = torch.cuda.get_device_capability()
    if capability < MIN_CAPABILITY:
        return (
            f"float8 training needs compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} "
            f"or newer (Ada, Hopper); this GPU has {capability[0]}.{capability[1]}"
        )
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        return "float8 training needs torchao: pip install 'llmtrain-parallel[float8]'"
    return None


def convert_to_float8(module: nn.Module, *, fsdp_all_gather: bool) -> None:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig(enable_fsdp_float8_all_gather=fsdp_all_gather)

    def eligible(mod: nn.Module, name: str) -> bool:
        # the output projection stays in high precision; float8 needs dims divisible by 16
        if not isinstance(mod, nn.Linear) or name.split(".")[-1] == "head":
            return False
        return mod.in_features % 16 == 0 and mod.out_features % 16 == 0

    convert_to_float8_training(module, config=config, module_filter_fn=eligible)


def precompute_float8_scales(parts: list[nn.Module]) -> None:
    """After the optimizer step: one all-reduce for every float8 weight's scale (FSDP)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    for part in parts:
        precompute_float8_dynamic_scale_for_fsdp(part)
