"""One training pass: its items' token log-probs from one packed forward, and the losses read from them.

`LoRATrainer` runs each micro-batch through `pass_logprobs` and one of the two losses; everything
here lays the items out end to end, as the packed row holds them, so a pass costs the same few
operations however many sequences it holds. The GRPO maths are `trainer_service.grpo`'s.
"""

from __future__ import annotations

import torch

from trainer_service.batching import TrainItem
from trainer_service.grpo import PolicyLossOutput, kept_token_logprobs, policy_loss
from trainer_service.grpo_config import GRPOConfig
from trainer_service.packed_attention import pack_row

__all__ = ["grpo_pass_loss", "pass_logprobs", "sft_pass_loss"]


def pass_logprobs(model: torch.nn.Module, items: list[TrainItem], *, packs: bool,
                  shares_prefixes: bool) -> torch.Tensor:
    """The items' `[seq - 1]` log-probs of their tokens 1.., end to end, computed where their masks are on.

    The items run as one forward: packed end to end into a single row (`pack_row`), each
    with positions from 0, which `transformers` turns into attention within each sequence
    only (no padding; the same logits as one forward per sequence up to float rounding).
    With `shares_prefixes`, the samples of one prompt hold it once (`art_packed`). Without
    `packs` (a model whose attention would cross the packed sequences) each item runs alone.
    On a GPU, where each pass is launch-bound, packing is what makes a step fast: on an H200 a
    batch of 32 sequences took 12.5 s one sequence per pass and 0.44 s in one
    (bench/train_gpu.py). The LM head and the softmax run on the assistant positions alone
    (`logits_to_keep`); the losses never read the other positions (1.13x on this CPU with
    64-token answers to 40-token prompts).
    """
    if not packs and len(items) > 1:
        return torch.cat([pass_logprobs(model, [item], packs=packs, shares_prefixes=shares_prefixes)
                          for item in items])
    shareable = [_first_trained(item) if shares_prefixes else 0 for item in items]
    row = pack_row([item.token_ids for item in items], shareable)
    keep = torch.cat([item.mask[row.shared[i]:].nonzero().squeeze(-1) + row.starts[i]
                      for i, item in enumerate(items)])
    # squeeze, not [0]: a select's backward would fill a zero tensor the size of the logits
    logits = model(input_ids=row.token_ids.unsqueeze(0), logits_to_keep=keep, use_cache=False,
                   **row.inputs).logits.squeeze(0)
    values = kept_token_logprobs(logits, row.token_ids, keep)
    # each item's `[seq - 1]`: 0 over its shared prefix (never trained), then its own positions
    # but the last (that one predicts the next segment's first token; `values` has no entry
    # for the row's last position)
    own = [row.own(i) for i in range(len(items))]
    return torch.cat([torch.cat([values.new_zeros(row.shared[i]), values[part.start : part.stop - 1]])
                      for i, part in enumerate(own)])


def grpo_pass_loss(config: GRPOConfig, items: list[TrainItem], new: torch.Tensor,
                   ref: torch.Tensor | None = None) -> PolicyLossOutput:
    """The pass's policy loss (`config.loss`) from its new log-probs `new`, and `ref`'s KL term when given."""
    lengths = _row_lengths(items)
    return policy_loss(config.loss, new, torch.cat([item.old_logprobs for item in items]),
                       _per_token([item.advantage for item in items], lengths), _cat_masks(items),
                       _per_token([item.weight for item in items], lengths), epsilon=config.epsilon,
                       epsilon_high=config.upper_epsilon, delta=config.delta, level=config.importance_sampling,
                       ref_logprobs=ref, kl_coef=config.kl_coef, segments=_segments(lengths))


def sft_pass_loss(items: list[TrainItem], new: torch.Tensor) -> PolicyLossOutput:
    """The pass's negative log-likelihood of its assistant tokens, each item's weighed by its weight."""
    mask = _cat_masks(items)
    weight = _per_token([item.weight for item in items], _row_lengths(items))
    loss = -(new * mask * weight).sum()
    return PolicyLossOutput(loss=loss, policy=float(loss.detach()), tokens=float(mask.sum()), clipped_tokens=0.0,
                            ratio_sum=0.0)


def _first_trained(item: TrainItem) -> int:
    """How many leading tokens of `item` no loss reads: the position of its first trained prediction."""
    trained = item.mask.nonzero()
    return int(trained[0]) if trained.numel() else item.mask.numel()


def _row_lengths(items: list[TrainItem]) -> torch.Tensor:
    """Number of per-token entries (`seq - 1`) of each item."""
    return torch.tensor([item.mask.numel() for item in items], device=items[0].mask.device)


def _cat_masks(items: list[TrainItem]) -> torch.Tensor:
    """The items' assistant masks end to end."""
    return torch.cat([item.mask for item in items])


def _per_token(values: list[float], lengths: torch.Tensor) -> torch.Tensor:
    """One value per item, repeated over that item's entries."""
    return torch.tensor(values, dtype=torch.float32, device=lengths.device).repeat_interleave(lengths)


def _segments(lengths: torch.Tensor) -> torch.Tensor:
    """The index of the item each entry of a packed row belongs to."""
    return torch.arange(lengths.numel(), device=lengths.device).repeat_interleave(lengths)
