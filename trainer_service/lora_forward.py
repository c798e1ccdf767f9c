"""One fused op per LoRA projection in the trainer: `base(x) + (x @ A.T) @ (scaling * B).T` as an `addmm`.

PEFT's `lora.Linear.forward` computes the adapter's delta in the LoRA weights' dtype. With bf16
base weights and float32 LoRA (the trainer's default with CUDA and on a CPU with bf16 units) it
casts the layer's input to float32, multiplies, scales the float32 delta, adds it to the bf16
result (which promotes the sum to float32) and casts the sum back to bf16: four elementwise passes
over the layer's input or output in the forward, and their mirrors in the backward. Profiled on
the training bench's batch (1 thread), those casts, scalings and adds took about a quarter of a
step.

`fuse_lora_forward` gives each LoRA linear layer a forward that multiplies in the input's dtype
instead: the LoRA matrices (rank x width, small) are cast to it, the scaling goes into B, and the
matmul adds the delta to the base output itself. The weights and their gradients stay float32
(the optimizer keeps float32 masters); the products round to bf16 like every other product of the
step, as under TRL's `bf16=True` autocast. Anything else (adapters disabled for the KL reference,
several active adapters, a merged or variant adapter such as DoRA, per-call adapter names, an input
in another dtype than the base weights) runs
PEFT's own forward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from peft.tuners.lora import Linear as LoraLinear

__all__ = ["fuse_lora_forward"]


def fuse_lora_forward(model: torch.nn.Module) -> int:
    """Give every PEFT LoRA linear layer of `model` the fused forward; returns how many layers got it."""
    layers = [module for module in model.modules() if isinstance(module, LoraLinear)]
    for layer in layers:
        layer.forward = functools.partial(_fused_forward, layer, layer.forward)
    return len(layers)


def _fused_forward(layer: LoraLinear, peft_forward: Callable[..., torch.Tensor], x: torch.Tensor, *args: Any,
                   **kwargs: Any) -> torch.Tensor:
    adapters = layer.active_adapters
    if (layer.disable_adapters or layer.merged or kwargs or args or len(adapters) != 1
            or adapters[0] not in layer.lora_A or adapters[0] in layer.lora_variant
            or layer.get_base_layer().weight.dtype != x.dtype):
        return peft_forward(x, *args, **kwargs)
    name = adapters[0]
    result = layer.base_layer(x)
    a = layer.lora_A[name].weight.to(x.dtype)
    b = (layer.lora_B[name].weight * layer.scaling[name]).to(x.dtype)
    shrunk = torch.nn.functional.linear(layer.lora_dropout[name](x), a)
    width = result.shape[-1]
    fused = torch.addmm(result.reshape(-1, width), shrunk.reshape(-1, shrunk.shape[-1]), b.T)
    return fused.view(result.shape)
