"""Attention over sequences packed end to end into one row, each sequence attending to itself only.

Registered with `transformers` as the attention implementation `art_packed` (its attention and its
mask function). A packed forward passes the sequence boundaries as `cu_seq_lens_q`
(`pack_row`); each layer then runs one causal `scaled_dot_product_attention` per
sequence, so attention costs the sum of the squared sequence lengths, not the square of the row's
length as with a block-diagonal mask over the whole row. No mask is built: rows are packed, never
padded.

`pack_row` also shares prefixes: sequences that start with the same tokens (a GRPO group's
samples of one prompt) hold that prefix once in the row, and each continuation attends to it
(`art_prefix`), so the prompt's forward and backward run once per group instead of once per
sample. Its gradient is the sum the separate copies would give.

On a CPU in bf16, short segments (a prompt, an answer: up to `_SHORT_KEYS` keys with their
prefix) run together as one padded batch (`SegmentBatch`, laid out once per row by `pack_row`):
one attention per layer for all of them instead of one per segment, whose fixed cost (mask
checks, casts, the autograd nodes of each slice) made attention a quarter of a bf16 step on the
bench's batch. The padding costs little at those lengths; longer segments keep one call each.
That batch is two bf16 matrix products per layer (`_batched_attention`), not sdpa's math kernel,
which on a CPU widened bf16 to float32, repeated each key/value head for its query heads and
rebuilt the mask in every layer: forward+backward of the bench's layer 17 ms against 53 ms (2
threads), a step 1.2 s faster and its peak memory 3.1 GB against 3.9 GB; its log-probs and
gradient as far from a float32 step's as before (bf16 alone sets that distance).

The trainer uses it on a CPU, where packing turns many small matrix products into a few large
ones (forward and backward of 32 sequences of the bundled model in bf16, 1 thread: 21.7 s one per
pass, 16.7 s eight per pass; fp32 one per pass 30.5 s), and a row-sized mask made 32 packed
sequences 2x slower.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

__all__ = [
    "PACKED_ATTENTION", "PackedRow", "UnsupportedAttentionError", "pack_row", "packed_attention",
    "packing_keeps_sequences_apart", "prefix_sharing_works",
]

PACKED_ATTENTION = "art_packed"
"""The `attn_implementation` name under which `packed_attention` is registered."""

_UNSUPPORTED = ("sliding_window", "softcap", "s_aux")
"""Attention arguments `packed_attention` does not compute (a sliding window, a logit soft-cap, attention sinks):
a model that passes one of them (Mistral, Gemma 2, gpt-oss) is refused, not given plain causal attention."""


class UnsupportedAttentionError(ValueError):
    """A model's attention asks `art_packed` for something it does not compute (`_UNSUPPORTED`)."""


@dataclass(frozen=True)
class PackedRow:
    """Sequences laid out in one row by `pack_row`."""

    token_ids: torch.Tensor
    """`[row]` the row's tokens: each shared prefix once, then its sequences' remaining tokens."""
    inputs: dict[str, Any]
    """Model keyword arguments: positions, segment bounds, each segment's prefix (`art_prefix`) and the batch
    of short segments (`art_batch`)."""
    shared: list[int]
    """Per sequence: how many of its leading tokens sit in a shared prefix segment (0: none)."""
    starts: list[int]
    """Per sequence: the row index of its first token that is not in a shared prefix."""
    lengths: list[int]
    """Per sequence: its length in tokens (shared prefix included)."""

    def own(self, index: int) -> slice:
        """The row positions of sequence `index`'s tokens that are not in a shared prefix."""
        start = self.starts[index]
        return slice(start, start + self.lengths[index] - self.shared[index])


@dataclass(frozen=True)
class SegmentBatch:
    """A row's short segments laid out as one padded batch for a single attention call (`pack_row`)."""

    segments: list[int]
    """The segments in the batch, in batch order."""
    queries: torch.Tensor
    """`[len(segments) * width_q]` the row position of each query slot (padding repeats a valid one)."""
    keys: torch.Tensor
    """`[len(segments) * width_k]` the row position of each key slot: the segment's prefix, then itself."""
    bias: torch.Tensor
    """`[len(segments), 1, 1, width_q, width_k]` float32, added to the attention scores: 0 where a query slot
    sees a key, -inf elsewhere (a padding query sees one key, so no row is all -inf)."""
    gather: torch.Tensor
    """`[row]` where each row position's output is: in the batch's `[segments * width_q]` outputs, then in
    those of the other segments, one after another in row order."""


def _segment_batch(lengths: list[int], parents: list[int], device: torch.device) -> SegmentBatch | None:
    """The batch of the segments with at most `_SHORT_KEYS` keys (prefix included); None if there are none."""
    starts = [0, *itertools.accumulate(lengths)]
    keys_of = [lengths[i] + (lengths[p] if p >= 0 else 0) for i, p in enumerate(parents)]
    short = [i for i, n in enumerate(keys_of) if n <= _SHORT_KEYS]
    if not short:
        return None
    width_q, width_k = max(lengths[i] for i in short), max(keys_of[i] for i in short)
    queries = torch.zeros(len(short), width_q, dtype=torch.long)
    keys = torch.zeros(len(short), width_k, dtype=torch.long)
    mask = torch.zeros(len(short), 1, width_q, width_k, dtype=torch.bool)
    slot = torch.empty(starts[-1], dtype=torch.long)
    for b, i in enumerate(short):
        n, parent = lengths[i], parents[i]
        p = lengths[parent] if parent >= 0 else 0
        own = torch.arange(starts[i], starts[i] + n)
        queries[b, :n] = own
        queries[b, n:] = starts[i]
        keys[b, p : p + n] = own
        if parent >= 0:
            keys[b, :p] = torch.arange(starts[parent], starts[parent] + p)
        # all of the prefix, then causal within the segment: key j is seen by query i when j <= i + p
        mask[b, 0, :n, : p + n] = torch.ones(n, p + n, dtype=torch.bool).tril(diagonal=p)
        mask[b, 0, n:, 0] = True  # padding queries see one key: no row of -inf (their outputs are dropped)
        slot[own] = b * width_q + torch.arange(n)
    offset = len(short) * width_q
    for i in sorted(set(range(len(lengths))) - set(short)):
        slot[starts[i] : starts[i + 1]] = torch.arange(offset, offset + lengths[i])
        offset += lengths[i]
    bias = torch.zeros(mask.shape, dtype=torch.float32).masked_fill_(~mask, float("-inf"))
    return SegmentBatch(segments=short, queries=queries.flatten().to(device), keys=keys.flatten().to(device),
                        bias=bias.unsqueeze(1).to(device), gather=slot.to(device))


def _common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    n = min(a.numel(), b.numel())
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0]) if differ.numel() else n


def _families(sequences: list[torch.Tensor], shareable: list[int]) -> list[tuple[list[int], int]]:
    """Runs of consecutive sequences with a common prefix: `(indices, shared length)`, 0 for a lone one.

    A sequence joins the run before it when it shares at least the run's prefix with the run's
    first sequence (within `shareable` tokens of each); a GRPO group's samples of one prompt
    form one run.
    """
    runs: list[tuple[list[int], int]] = []
    for index, sequence in enumerate(sequences):
        if runs:
            members, shared = runs[-1]
            first = members[0]
            common = min(_common_prefix(sequences[first], sequence), shareable[first], shareable[index])
            if len(members) == 1 and common > 0:
                runs[-1] = ([first, index], common)
                continue
            if len(members) > 1 and common >= shared:
                members.append(index)
                continue
        runs.append(([index], 0))
    return runs


def pack_row(sequences: list[torch.Tensor], shareable: list[int] | None = None) -> PackedRow:
    """Lay `sequences` out in one row for an `art_packed` forward.

    `shareable[i]` is how many leading tokens of sequence `i` may be shared: those whose
    outputs no loss reads (its first trained position and later stay its own). None or 0:
    nothing shared, each sequence is one segment.

    `position_ids` (from 0 in each sequence) alone makes `transformers`' own attention
    implementations keep unshared sequences apart (without a KV cache); the bounds
    (`cu_seq_lens_q`/`_k`) serve `art_packed` and flash attention.
    """
    shareable = shareable or [0] * len(sequences)
    device = sequences[0].device
    pieces: list[torch.Tensor] = []
    positions: list[torch.Tensor] = []
    prefix_of: list[int] = []
    shared = [0] * len(sequences)
    starts = [0] * len(sequences)
    length = 0
    for members, common in _families(sequences, shareable):
        parent = -1
        if common:
            parent = len(pieces)
            pieces.append(sequences[members[0]][:common])
            positions.append(torch.arange(common, device=device))
            prefix_of.append(-1)
            length += common
        for index in members:
            own = sequences[index][common:]
            shared[index], starts[index] = common, length
            pieces.append(own)
            positions.append(torch.arange(common, common + own.numel(), device=device))
            prefix_of.append(parent)
            length += own.numel()
    lengths = [piece.numel() for piece in pieces]
    bounds = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
    inputs = {"position_ids": torch.cat(positions).unsqueeze(0), "cu_seq_lens_q": bounds, "cu_seq_lens_k": bounds,
              "max_length_q": max(lengths), "max_length_k": max(lengths), "art_prefix": prefix_of,
              # only a CPU's attention batches short segments (`_short_on_math`): no index tensors elsewhere
              "art_batch": _segment_batch(lengths, prefix_of, device) if device.type == "cpu" else None}
    return PackedRow(token_ids=torch.cat(pieces), inputs=inputs, shared=shared, starts=starts,
                     lengths=[sequence.numel() for sequence in sequences])


def packed_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     cu_seq_lens_q: torch.Tensor | None = None, art_prefix: list[int] | None = None,
                     art_batch: SegmentBatch | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Causal attention within each packed segment: `[1, heads, row, dim]` in, `[1, row, heads, dim]` out.

    Without bounds (`cu_seq_lens_q`, see `pack_row`) the row is one sequence. A segment
    whose `art_prefix` entry names an earlier segment (`pack_row`) continues it: it attends to
    all of that prefix, then causally to itself. Where short segments run on the plain-math kernel
    (bf16 on a CPU), those of `art_batch` run as one padded batch; the others one call each.

    Raises:
        ValueError: a batch of more than one row (padding would need a mask, which this never reads).
        UnsupportedAttentionError: the model's attention has a sliding window, a logit soft-cap or sinks.
    """
    asked = [name for name in _UNSUPPORTED if kwargs.get(name) is not None]
    if asked:
        raise UnsupportedAttentionError(f"attention {PACKED_ATTENTION!r} does not compute {', '.join(asked)} (asked "
                                        f"by {type(module).__name__}); use the model's own attention implementation")
    if query.shape[0] != 1:
        raise ValueError(f"attention {PACKED_ATTENTION!r} takes one unpadded row, got a batch of {query.shape[0]}; "
                         "pack the sequences into one row (`pack_row`)")
    bounds = [0, query.shape[2]] if cu_seq_lens_q is None else cu_seq_lens_q.tolist()
    lengths = [end - start for start, end in itertools.pairwise(bounds)]
    parents = art_prefix or [-1] * len(lengths)
    if art_batch is not None and not _short_on_math(query):
        art_batch = None  # flash, one segment at a time
    batched = set(art_batch.segments) if art_batch is not None else set()
    alone = [i for i in range(len(lengths)) if i not in batched]
    outputs = []  # [tokens, heads, dim] pieces in the order `art_batch.gather` reads them
    if art_batch is not None:
        outputs.append(_batched_attention(query, key, value, art_batch, dropout, scaling))
    if alone:
        # split, not sliced: a split's backward is one concatenation of the segments' gradients, where
        # each slice's backward would fill a row-sized tensor of zeros and add it to the others
        queries, keys, values = (tensor.split(lengths, dim=2) for tensor in (query, key, value))
        for index in alone:
            own_keys, own_values, mask, parent = keys[index], values[index], None, parents[index]
            if parent >= 0:
                own_keys = torch.cat([keys[parent], own_keys], dim=2)
                own_values = torch.cat([values[parent], own_values], dim=2)
                n, p = lengths[index], lengths[parent]
                # all of the prefix, then causal within the segment: key j is seen by query i when j <= i + p
                mask = torch.ones(n, p + n, dtype=torch.bool, device=query.device).tril(diagonal=p)
            with _kernel(query, own_keys.shape[2]):
                out = F.scaled_dot_product_attention(queries[index], own_keys, own_values, attn_mask=mask,
                                                     dropout_p=dropout, is_causal=mask is None, scale=scaling,
                                                     enable_gqa=key.shape[1] != query.shape[1])
            outputs.append(out[0].transpose(0, 1))
    pieces = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
    if art_batch is not None:
        pieces = pieces.index_select(0, art_batch.gather)
    return pieces.unsqueeze(0).contiguous(), None


def _batched_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, batch: SegmentBatch,
                       dropout: float, scaling: float | None) -> torch.Tensor:
    """`batch`'s segments in one attention: `[segments * width_q, heads, dim]` (padding slots included).

    Written out as two matrix products rather than sdpa's math kernel, which on a CPU converts bf16
    to float32 and back, repeats each key/value head for its query heads, and turns the boolean
    mask into a float one in every layer. Here the query heads that share a key/value head are
    stacked along the query axis (one product per key/value head, nothing repeated) and the mask
    is added as the batch's precomputed bias.
    """
    segments, heads, kv_heads, dim = len(batch.segments), query.shape[1], key.shape[1], query.shape[3]
    width_q, width_k = batch.bias.shape[-2:]
    group = heads // kv_heads
    scale = dim**-0.5 if scaling is None else scaling

    def gathered(tensor: torch.Tensor, index: torch.Tensor, width: int) -> torch.Tensor:
        rows = tensor[0].transpose(0, 1).index_select(0, index)  # [slots, heads, dim]
        return rows.view(segments, width, *rows.shape[1:])  # [segments, width, heads, dim]

    # query head h reads key/value head h // group (transformers' repeat_kv): [segments, kv_heads, group * width_q, dim]
    queries = (gathered(query, batch.queries, width_q) * scale).view(segments, width_q, kv_heads, group, dim)
    queries = queries.permute(0, 2, 3, 1, 4).reshape(segments, kv_heads, group * width_q, dim)
    keys = gathered(key, batch.keys, width_k).transpose(1, 2)  # [segments, kv_heads, width_k, dim]
    values = gathered(value, batch.keys, width_k).transpose(1, 2)
    scores = (queries @ keys.transpose(-1, -2)).view(segments, kv_heads, group, width_q, width_k)
    probs = torch.softmax(scores + batch.bias.to(scores.dtype), dim=-1)
    if dropout:
        probs = F.dropout(probs, p=dropout)
    # [segments, kv_heads, group * width_q, dim]
    out = probs.view(segments, kv_heads, group * width_q, width_k) @ values
    return out.view(segments, heads, width_q, dim).transpose(1, 2).reshape(segments * width_q, heads, dim)


_SHORT_KEYS = 192
"""Up to this many keys (prefix included) a segment is short: in bf16 on a CPU it runs in the row's batch
(`_batched_attention`), or on sdpa's plain-math kernel in a row given without one (see `_kernel`)."""

_MATH_DTYPES = (torch.bfloat16,)
"""Dtypes whose short segments run batched on a CPU (`_batched_attention`; see `_kernel` for a row without a
batch)."""


def _short_on_math(query: torch.Tensor) -> bool:
    """Whether `query`'s short segments run in the row's batch (`_batched_attention`), or on the plain-math
    kernel one by one where the row has no batch."""
    return query.device.type == "cpu" and query.dtype in _MATH_DTYPES


def _kernel(query: torch.Tensor, keys: int) -> contextlib.AbstractContextManager[None]:
    """The sdpa kernels to allow for one segment: the default, except short bf16 ones on a CPU (which run
    alone only in a row given without `art_batch`; `pack_row` batches them).

    There torch's flash kernel spends most of a short segment's backward outside the
    arithmetic: fwd+bwd of 9 query heads over 3 key/value heads at 105 keys took 4.4 ms with
    it and 2.6 ms with plain math; at 224 keys they were even, at 1024 flash was 4.8x faster.
    In fp32 flash was faster at every length measured (1.4 vs 2.1 ms at 105 keys), and batching
    fp32 segments on the math kernel gained nothing over flash per segment (the bench's step on 2
    threads, 4 alternations: median 8.96 s batched, 8.40 s alone).
    """
    if _short_on_math(query) and keys <= _SHORT_KEYS:
        return sdpa_kernel(SDPBackend.MATH)
    return contextlib.nullcontext()


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """The mask function of `art_packed`: none, each sequence's causal attention is built in."""
    return None


AttentionInterface.register(PACKED_ATTENTION, packed_attention)
AttentionMaskInterface.register(PACKED_ATTENTION, _no_mask)


def packing_keeps_sequences_apart(model: torch.nn.Module) -> bool:
    """Whether `model` attends only within each sequence of a packed row (positions restarting at 0).

    `transformers` builds that mask from `position_ids` when no KV cache is in use; a model
    that does not would let a sequence see the one packed before it. Checked on two short
    sequences: the second one's logits alone and packed after the first must agree (measured
    on the bundled model and the tests' tiny one: equal when kept apart, off by 0.7-1.3 times
    the largest logit when not).
    """
    return _packed_logits_match(model, torch.arange(1, 9), torch.arange(9, 15), shareable=0)


def prefix_sharing_works(model: torch.nn.Module) -> bool:
    """Whether `model` computes a `pack_row` row with a shared prefix right (`art_packed` attention does).

    Checked like `packing_keeps_sequences_apart`, on two sequences that share their first 4
    tokens. An attention that ignores `art_prefix` (transformers' own: a continuation's
    positions do not restart at 0, so it is taken for a sequence of its own) fails it.
    """
    return _packed_logits_match(model, torch.arange(1, 9), torch.cat([torch.arange(1, 5), torch.arange(9, 15)]),
                                shareable=4)


def _packed_logits_match(model: torch.nn.Module, first: torch.Tensor, second: torch.Tensor, shareable: int) -> bool:
    """`second`'s logits (beyond a shared prefix) alone and packed after `first` agree."""
    device = next(model.parameters()).device
    first, second = first.to(device), second.to(device)
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            alone = model(input_ids=second.unsqueeze(0), use_cache=False, **pack_row([second]).inputs).logits[0].float()
            row = pack_row([first, second], [shareable, shareable])
            packed = model(input_ids=row.token_ids.unsqueeze(0), use_cache=False, **row.inputs).logits[0].float()
    finally:
        model.train(training)
    want, got = alone[row.shared[1] :], packed[row.own(1)]
    return bool((got - want).abs().max() <= 5e-2 * want.abs().max())
