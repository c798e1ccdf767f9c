"""GRPO maths as pure tensor functions: advantages, token log-probs and the policy losses.

Nothing here knows about models, batches or HTTP; the trainer orchestrates. Conventions:

* Per-token tensors are 1-D and aligned: entry `t` is about token `t + 1` of a sequence
  (the first token has no prediction).
* `mask` is 1.0 on assistant (sampled) tokens and 0.0 elsewhere.
* `weight` is each token's share of the step's loss. `trajectory_token_weights` gives every
  trajectory the same total weight, split evenly over its assistant tokens, so the step's loss
  is the mean over trajectories of each trajectory's mean token loss.

Policy losses live in the `POLICY_LOSSES` registry (name → function); add a variant by
registering a function with the `PolicyLossFn` signature. Both losses take the ratio
`exp(clamp(new - old, -MAX_LOG_RATIO, MAX_LOG_RATIO))`, so an engine log-prob far from the
trainer's cannot overflow the loss or its gradient (batching drops vLLM's -9999.0 placeholder for `-inf`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from trainer_service.logprobs import token_logprobs

__all__ = [
    "IMPORTANCE_LEVELS",
    "MAX_LOG_RATIO",
    "ImportanceLevelFn",
    "POLICY_LOSSES",
    "PolicyLossFn",
    "PolicyLossOutput",
    "TokenLosses",
    "cispo_loss",
    "group_advantages",
    "importance_ratio",
    "kept_token_logprobs",
    "kl_k3",
    "policy_loss",
    "ppo_loss",
    "sequence_level",
    "token_level",
    "trajectory_token_weights",
]


def group_advantages(rewards: torch.Tensor, scale: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Return GRPO advantages of one group: `(r - mean(r)) / (std(r) + eps)`.

    Computed in float64 on the rewards divided by the largest `|r|` (the result is the same), so
    rewards beyond float32's range (about 3.4e38), or whose squares overflow float64 (beyond about
    1e154), still give finite advantages when scaled.

    Args:
        rewards: 1-D tensor, one reward per trajectory of the group.
        scale: divide by the standard deviation (population, not sample); False keeps `r - mean(r)`.
        eps: added to the standard deviation so a near-constant group does not explode.

    Returns:
        A float32 tensor shaped like `rewards`; all zeros when the rewards have no spread;
        infinite or NaN where the result does not fit float32 (the caller checks).
    """
    rewards = rewards.to(torch.float64)
    if rewards.ndim != 1 or rewards.numel() == 0:
        raise ValueError(f"rewards must be a non-empty 1-D tensor, got shape {tuple(rewards.shape)}")
    size = float(rewards.abs().max()) or 1.0
    unit = rewards / size  # |unit| <= 1: its mean and std cannot overflow
    centred = unit - unit.mean()
    if scale:  # (r - mean) / (std + eps) == (unit - mean(unit)) / (std(unit) + eps / size)
        return (centred / (unit.std(correction=0) + eps / size)).to(torch.float32)
    return (centred * size).to(torch.float32)


def kept_token_logprobs(kept_logits: torch.Tensor, token_ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Log-probability of each token under the logits of the position before it, computed at the
    `keep` positions only (the ones a loss reads), 0 at every other position.

    Args:
        kept_logits: `[len(keep), vocab]` logits of positions `keep` (a model's `logits_to_keep=keep`).
        token_ids: `[seq]` token ids of the sequence.
        keep: sorted positions `p` in `0..seq-2`; each predicts token `p + 1`.

    Returns:
        `[seq - 1]` float32 log-probs of tokens `1..seq-1`: filled at `keep`, 0 elsewhere.
    """
    if kept_logits.shape[0] != keep.numel():
        raise ValueError(f"{kept_logits.shape[0]} rows of logits for {keep.numel()} kept positions")
    values = token_logprobs(kept_logits, token_ids[keep + 1])
    return values.new_zeros(token_ids.numel() - 1).index_copy(0, keep, values)


def trajectory_token_weights(assistant_tokens: Sequence[int]) -> list[float]:
    """Return each trajectory's per-token weight so that every trajectory counts equally.

    Args:
        assistant_tokens: number of assistant tokens of each trajectory in the step.

    Returns:
        `1 / (tokens_i * n)` per trajectory; a trajectory without tokens gets 0.
    """
    counted = [n for n in assistant_tokens if n > 0]
    if not counted:
        raise ValueError("no trajectory has an assistant token: nothing to weight")
    return [1.0 / (n * len(counted)) if n > 0 else 0.0 for n in assistant_tokens]


@dataclass(frozen=True)
class TokenLosses:
    """What a policy loss computes for each token."""

    loss: torch.Tensor
    """Per-token loss (differentiable through the new log-probs)."""
    ratio: torch.Tensor
    """Importance ratio `exp(new - old)` per token (detached)."""
    clipped: torch.Tensor
    """True where the clip bound was active for the token."""


MAX_LOG_RATIO = 20.0
"""Bound on `|new - old|` log-prob before the importance ratio is exponentiated (ratio within
`e^-20..e^20`); beyond it the token's ratio is constant and passes no gradient through the ratio."""


def importance_ratio(new_logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    """`exp(new - old)` with the log-ratio clamped to `±MAX_LOG_RATIO` (differentiable inside the bound)."""
    return torch.exp(torch.clamp(new_logprobs - old_logprobs, -MAX_LOG_RATIO, MAX_LOG_RATIO))


PolicyLossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float, float, float | None], TokenLosses]
"""`(new_logprobs, old_logprobs, advantages, epsilon, epsilon_high, delta) -> TokenLosses`."""


def ppo_loss(
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    epsilon: float,
    epsilon_high: float,
    delta: float | None = None,
) -> TokenLosses:
    """PPO's clipped surrogate: `-min(ratio * A, clip(ratio, 1 - eps, 1 + eps_high) * A)`.

    The ratio is taken against the engine's sampled log-probs, so the first step on fresh data
    has ratio 1 and the clip only engages as the policy drifts inside a step (or when the engine
    and the trainer disagree). A negative advantage leaves the ratio unbounded above; with `delta`
    (two-sided clipping, as TRL's `delta` and INTELLECT-2) the unclipped term uses `min(ratio, delta)`,
    so such a token costs at most `delta * |A|` and passes no gradient beyond it.
    """
    ratio = importance_ratio(new_logprobs, old_logprobs)
    capped = ratio if delta is None else torch.clamp(ratio, max=delta)
    unclipped = capped * advantages
    clipped_ratio = torch.clamp(ratio, 1.0 - epsilon, 1.0 + epsilon_high)
    clipped = clipped_ratio * advantages
    loss = -torch.minimum(unclipped, clipped)
    active = clipped < unclipped
    if delta is not None:
        active = active | ((ratio > delta) & (advantages < 0))
    return TokenLosses(loss=loss, ratio=ratio.detach(), clipped=active.detach())


def cispo_loss(
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    epsilon: float,
    epsilon_high: float,
    delta: float | None = None,
) -> TokenLosses:
    """CISPO (MiniMax-M1): `-sg(min(ratio, 1 + eps_high)) * A * log pi`.

    The importance weight is clipped and detached, so every token keeps a gradient (PPO drops
    the gradient of clipped tokens). Only the upper bound is applied, as in the paper; `epsilon`
    is accepted for a uniform signature and unused by design. Its weight is already capped, so a
    `delta` (PPO's two-sided clip) is an error.
    """
    del epsilon  # CISPO bounds the weight from above only.
    if delta is not None:
        raise ValueError(f"delta={delta} is PPO's two-sided clip; cispo caps its weight at 1 + epsilon_high already")
    ratio = importance_ratio(new_logprobs, old_logprobs).detach()
    weight = torch.clamp(ratio, max=1.0 + epsilon_high)
    loss = -weight * advantages * new_logprobs
    return TokenLosses(loss=loss, ratio=ratio, clipped=ratio > 1.0 + epsilon_high)


POLICY_LOSSES: dict[str, PolicyLossFn] = {"ppo": ppo_loss, "cispo": cispo_loss}
"""Registry of policy losses by name (`GRPOConfig.loss`)."""


@dataclass(frozen=True)
class PolicyLossOutput:
    """A weighted loss over some tokens plus the sums its metrics are made of."""

    loss: torch.Tensor
    """Scalar: sum over tokens of `weight * mask * token loss`, KL penalty included (call backward on it)."""
    policy: float
    """The policy term of `loss` alone (without the KL penalty)."""
    tokens: float
    """Number of assistant tokens counted."""
    clipped_tokens: float
    """Assistant tokens where the clip was active."""
    ratio_sum: float
    """Sum of the importance ratio over the `known_tokens`."""
    kl_sum: float = 0.0
    """Sum of the per-token KL estimate to the reference over assistant tokens (0 without one)."""
    gap_sum: float = 0.0
    """Sum of `|new - old|` log-prob over the `known_tokens`."""
    known_tokens: float = 0.0
    """Assistant tokens with a finite engine log-prob (the ones `ratio_sum` and `gap_sum` cover)."""


def policy_loss(
    name: str,
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    weight: torch.Tensor | float,
    *,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    level: str = "token",
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    segments: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """Apply the registered loss `name` and reduce it to one weighted scalar.

    Args:
        name: key of `POLICY_LOSSES`.
        new_logprobs: per-token log-probs under the policy being trained (with gradient).
        old_logprobs: per-token log-probs the engine sampled with (any value where `mask` is 0;
            NaN or ±inf where unknown, which trains that token on-policy).
        advantages: per-token (or scalar) advantage.
        mask: 1.0 on assistant tokens, 0.0 elsewhere.
        weight: per-token (or scalar) weight, see `trajectory_token_weights`.
        epsilon: lower clip range (`ppo`: ratio >= 1 - epsilon; `cispo` has no lower bound).
        epsilon_high: upper clip range (`ppo`: ratio <= 1 + epsilon_high; `cispo`: weight capped
            at 1 + epsilon_high); None means `epsilon`.
        delta: `ppo` only: cap of the unclipped ratio (two-sided clipping); None: no cap.
        level: `token` (a ratio per token) or `sequence` (every assistant token shares
            `exp(mean(new - old))`, with the gradient of that mean).
        ref_logprobs: per-token log-probs of the reference (base) model; with `kl_coef > 0`
            adds `kl_coef * k3(new, ref)` per assistant token.
        kl_coef: weight of the KL penalty.
        segments: for several sequences end to end, the index (0..n-1) of the sequence each
            token belongs to (`sequence` level takes its mean per sequence); None: one sequence.

    Returns:
        The weighted loss and metric sums.
    """
    try:
        fn = POLICY_LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown policy loss {name!r}; choose one of {sorted(POLICY_LOSSES)}") from None
    mask = mask.to(new_logprobs.dtype)
    # Prompt positions may carry placeholders and a missing engine logprob is NaN (or ±inf): all
    # are replaced by the current log-prob (ratio 1), so they can neither overflow nor poison the sum.
    old_logprobs = old_logprobs.to(new_logprobs.dtype)
    known = (mask > 0) & torch.isfinite(old_logprobs)
    old = torch.where(known, old_logprobs, new_logprobs.detach())
    try:
        new = IMPORTANCE_LEVELS[level](new_logprobs, old, mask, segments)
    except KeyError:
        raise ValueError(
            f"unknown importance sampling level {level!r}; choose one of {sorted(IMPORTANCE_LEVELS)}") from None
    terms = fn(new, old, torch.as_tensor(advantages, dtype=new_logprobs.dtype), epsilon,
               epsilon if epsilon_high is None else epsilon_high, delta)
    policy = (terms.loss * mask * weight).sum()
    loss = policy
    kl_sum = 0.0
    if ref_logprobs is not None:
        kl = kl_k3(new_logprobs, ref_logprobs.to(new_logprobs.dtype))
        kl_sum = float((kl.detach() * mask).sum())
        if kl_coef:
            loss = policy + (kl_coef * kl * mask * weight).sum()
    counted = known.to(mask.dtype)  # tokens without an engine log-prob have no ratio or gap to report
    return PolicyLossOutput(
        loss=loss,
        policy=float(policy.detach()),
        tokens=float(mask.sum()),
        clipped_tokens=float((terms.clipped.to(mask.dtype) * mask).sum()),
        ratio_sum=float((terms.ratio * counted).sum()),
        kl_sum=kl_sum,
        gap_sum=float(((new_logprobs.detach() - old).abs() * counted).sum()),
        known_tokens=float(counted.sum()),
    )


def kl_k3(new_logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token KL(new || ref) estimate `exp(ref - new) - (ref - new) - 1` (Schulman's k3; >= 0).

    The gradient flows through `new_logprobs`; `ref_logprobs` is treated as a constant.
    """
    delta = ref_logprobs.detach() - new_logprobs
    return torch.exp(delta) - delta - 1.0


def token_level(new_logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor,
                segments: torch.Tensor | None = None) -> torch.Tensor:
    """Token-level importance sampling: each token keeps its own log-prob (the identity)."""
    del old_logprobs, mask, segments
    return new_logprobs


def sequence_level(new_logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor,
                   segments: torch.Tensor | None = None) -> torch.Tensor:
    """Sequence-level importance sampling (GSPO): every token gets `old + mean(new - old)` over the
    masked tokens of its sequence (`segments` numbers the sequences of a packed row; None: one).

    The ratio `exp(new' - old)` is then the same for all assistant tokens of a sequence, and its
    gradient is the gradient of the mean log-ratio.
    """
    if segments is None:
        segments = torch.zeros(mask.shape, dtype=torch.long, device=mask.device)
    sequences = int(segments[-1]) + 1 if segments.numel() else 0
    count = mask.new_zeros(sequences).index_add(0, segments, mask).clamp(min=1.0)
    total = new_logprobs.new_zeros(sequences).index_add(0, segments, (new_logprobs - old_logprobs) * mask)
    return old_logprobs + (total / count)[segments]


ImportanceLevelFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
"""`(new_logprobs, old_logprobs, mask, segments) -> new_logprobs'` (see `sequence_level`)."""

IMPORTANCE_LEVELS: dict[str, ImportanceLevelFn] = {
    "token": token_level,
    "sequence": sequence_level,
}
"""Registry of importance-sampling levels (`GRPOConfig.importance_sampling`)."""
