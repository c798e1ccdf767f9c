"""`token_logprobs`: the log-probability of one target token per row of logits, forward and backward.

The trainer needs `log_softmax(logits)[target]` at every trained position, and its gradient, for
rows of the whole vocabulary (49,152 for the bundled model). Computed as one autograd op over
blocks of rows, the float32 work stays in a block of a few MiB: forward reads the (bf16) logits
once per block for the log-sum-exp and the target's logit; backward writes
`g * (onehot(target) - softmax)` straight into the gradient, in the logits' dtype. Only the
logits and one float per row are kept for the backward.

The composed alternative (upcast the logits to float32, TRL's `selective_log_softmax`, autograd
through the gather and the cast) writes and reads several float32 copies of the whole block and
a zero-filled gradient the size of the logits. `bench/token_logprobs.py` times both on the
training bench's shapes.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["token_logprobs"]

_BLOCK_ELEMENTS = 1 << 20
"""Float32 elements per block of rows (4 MiB): about the size of a core's L2 cache here."""


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        rows = logits.shape[0]
        step = max(1, _BLOCK_ELEMENTS // max(1, logits.shape[1]))
        values = torch.empty(rows, dtype=torch.float32, device=logits.device)
        lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
        for start in range(0, rows, step):
            block = slice(start, start + step)
            x = logits[block].float()
            lse[block] = torch.logsumexp(x, dim=-1)
            values[block] = x.gather(1, targets[block, None]).squeeze(1) - lse[block]
        ctx.save_for_backward(logits, targets, lse)
        ctx.step = step
        return values

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        logits, targets, lse = ctx.saved_tensors
        out = torch.empty_like(logits)
        for start in range(0, logits.shape[0], ctx.step):
            block = slice(start, start + ctx.step)
            g = grad[block, None].float()
            # d log p[target] / d logit[v] = onehot(target)[v] - softmax[v]
            x = (logits[block].float() - lse[block, None]).exp_().mul_(-g)
            x.scatter_add_(1, targets[block, None], g)
            out[block] = x
        return out, None


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """`log_softmax(logits, -1)` at each row's target, in float32, differentiable in `logits`.

    Args:
        logits: `[rows, vocab]`, any float dtype (the gradient comes back in it).
        targets: `[rows]` token ids.

    Returns:
        `[rows]` float32 log-probabilities.
    """
    if logits.ndim != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(f"need logits [rows, vocab] and targets [rows], got {tuple(logits.shape)} and "
                         f"{tuple(targets.shape)}")
    return _TokenLogprobs.apply(logits, targets)
