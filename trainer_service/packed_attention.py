"""Attention over sequences packed end to end into one row, each sequence attending to itself only.

Registered with `transformers` as the attention implementation `art_packed` (its attention and its
mask function). A packed forward passes the sequence boundaries as `cu_seq_lens_q`
(`packed_inputs`); each layer then runs one causal `scaled_dot_product_attention` per sequence,
so attention costs the sum of the squared sequence lengths, not the square of the row's length
as with a block-diagonal mask over the whole row. No mask is built: rows are packed, never padded.

The trainer uses it on a CPU, where packing turns many small matrix products into a few large
ones (a bf16 GRPO step of the bundled model 1.8x faster than one fp32 pass per sequence, 8
sequences a pass; bench/README.md), and a row-sized mask made 32 packed sequences 2x slower.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

__all__ = ["PACKED_ATTENTION", "packed_attention", "packed_inputs"]

PACKED_ATTENTION = "art_packed"
"""The `attn_implementation` name under which `packed_attention` is registered."""


def packed_inputs(lengths: list[int], device: torch.device) -> dict[str, Any]:
    """Model keyword arguments for a row of sequences of `lengths`: positions from 0 in each, and their bounds.

    `position_ids` makes `transformers`' own attention implementations mask each sequence off
    (without a KV cache); `cu_seq_lens_q`/`_k` give `packed_attention` (and flash attention) the
    boundaries directly.
    """
    bounds = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
    positions = torch.cat([torch.arange(n, device=device) for n in lengths]).unsqueeze(0)
    longest = max(lengths)
    return {"position_ids": positions, "cu_seq_lens_q": bounds, "cu_seq_lens_k": bounds,
            "max_length_q": longest, "max_length_k": longest}


def packed_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     cu_seq_lens_q: torch.Tensor | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Causal attention within each packed sequence: `[1, heads, row, dim]` in, `[1, row, heads, dim]` out.

    Without bounds (`cu_seq_lens_q`, see `packed_inputs`) the row is one sequence.

    Raises:
        ValueError: a batch of more than one row (padding would need a mask, which this never reads).
    """
    if query.shape[0] != 1:
        raise ValueError(f"attention {PACKED_ATTENTION!r} takes one unpadded row, got a batch of {query.shape[0]}; "
                         "pack the sequences into one row (`packed_inputs`)")
    bounds = [0, query.shape[2]] if cu_seq_lens_q is None else cu_seq_lens_q.tolist()
    grouped = key.shape[1] != query.shape[1]
    outputs = [
        F.scaled_dot_product_attention(query[:, :, start:end], key[:, :, start:end], value[:, :, start:end],
                                       dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=grouped)
        for start, end in itertools.pairwise(bounds)
    ]
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """The mask function of `art_packed`: none, each sequence's causal attention is built in."""
    return None


AttentionInterface.register(PACKED_ATTENTION, packed_attention)
AttentionMaskInterface.register(PACKED_ATTENTION, _no_mask)
