"""Turn a leased batch of groups into training items: select, score, tokenize, weigh.

`prepare_grpo` builds the sequences of every trajectory with a finite reward (applying the
sequence length policy, re-tokenizing trajectories that are not token-exact), keeps the groups
whose trajectories with trainable tokens are two or more with different rewards, computes the
advantages and reward statistics on exactly those trajectories, and gives every trajectory the
same weight. Everything it leaves out is counted once under `data/skipped/<reason>`, in the unit
the reason names:

* groups: `too_few_trajectories` (fewer than two trajectories left to train), `no_reward_spread` (rewards
  equal up to float rounding, `collector.protocol.has_reward_spread`), `nonfinite_advantages` (rewards so
  large the advantages do not fit float32), and for SFT `no_rewarded_trajectory`;
* trajectories: `unrewarded_trajectories`, `nonfinite_rewards`, `malformed_trajectories` (a sequence whose
  `token_ids`, `logprobs` and `assistant_mask` differ in length, whose mask holds a value other than 0 and 1, or
  whose token ids fall outside the model's vocabulary),
  `not_token_exact_without_tokenizer`, `retokenize_failed`, `no_assistant_tokens` (no sequence has an assistant
  token, e.g. truncation cut them all);
* sequences: `too_long_sequences` (left out by `max_seq_len_policy="skip"`; a trajectory that loses
  all its trainable sequences this way is counted here only).
`prepare_sft` does the same for supervised warm-start steps on the best trajectory of each group.
`shard_items` splits the items between data-parallel ranks, whole trajectories at a time.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedTokenizerBase

from collector.protocol import Group, Sequence, Trajectory, has_reward_spread
from trainer_service.grpo import group_advantages, trajectory_token_weights
from trainer_service.grpo_config import GRPOConfig
from trainer_service.retokenize import RetokenizeError, render_with_assistant_mask

__all__ = [
    "VLLM_LOGPROB_FLOOR", "NothingTrainableError", "PreparedBatch", "TrainItem", "prepare_grpo", "prepare_sft",
    "shard_items",
]

logger = logging.getLogger(__name__)


VLLM_LOGPROB_FLOOR = -9999.0
"""vLLM's chat API writes a log-prob at or below this (`-inf` among them) as this value: a placeholder, not a
log-prob the trainer can compare with its own (its ratio would be e^20 after the clamp, `grpo.MAX_LOG_RATIO`)."""


class NothingTrainableError(ValueError):
    """No group of the batch carries a training signal."""


@dataclass
class TrainItem:
    """One sequence ready for the loss."""

    token_ids: torch.Tensor
    """`[seq]` token ids."""
    old_logprobs: torch.Tensor
    """`[seq - 1]` engine log-probs of tokens 1.. (NaN where unknown: trained on-policy)."""
    mask: torch.Tensor
    """`[seq - 1]` 1.0 on assistant tokens 1.., else 0.0."""
    advantage: float
    weight: float
    trajectory: int = 0
    """Index of the item's trajectory in the batch (the sequences of one trajectory share it)."""


@dataclass
class PreparedBatch:
    """Items of one step and the counters describing how they were chosen."""

    items: list[TrainItem]
    stats: dict[str, float] = field(default_factory=dict)


_Seq = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class _Counters:
    def __init__(self) -> None:
        self.skipped: Counter[str] = Counter()
        self.truncated = 0
        self.retokenized = 0
        self.split_edges = 0
        self.non_object_arguments = 0


def _malformed(seq: Sequence, vocab_size: int | None) -> str | None:
    """What breaks the protocol's shape of `seq` (its per-token lists of one length, a 0/1 mask) or the model (a
    token id outside its vocabulary of `vocab_size`, which fails the embedding lookup of the whole step), or None."""
    n = len(seq.token_ids)
    if not len(seq.logprobs) == len(seq.assistant_mask) == n:
        return (f"has token_ids ({n}), logprobs ({len(seq.logprobs)}) and assistant_mask ({len(seq.assistant_mask)}) "
                "of different lengths")
    if any(m not in (0, 1) for m in seq.assistant_mask):
        return f"has an assistant_mask value other than 0 and 1: {sorted(set(seq.assistant_mask) - {0, 1})[:5]}"
    if vocab_size is not None and n and not 0 <= min(seq.token_ids) <= max(seq.token_ids) < vocab_size:
        return (f"has token ids from {min(seq.token_ids)} to {max(seq.token_ids)}, outside the model's vocabulary "
                f"(0 to {vocab_size - 1}): sampled by another model?")
    return None


def _engine_logprob(value: float | None) -> float:
    """`value` where it is a log-prob the ratio can use, else NaN (unknown: the token trains on-policy): None, NaN,
    a value at or below vLLM's placeholder for `-inf`, and one above 0, which no probability has."""
    return value if value is not None and VLLM_LOGPROB_FLOOR < value <= 0.0 else float("nan")


def _sequences(trajectory: Trajectory, config: GRPOConfig, tokenizer: PreTrainedTokenizerBase | None,
               counters: _Counters, vocab_size: int | None) -> list[_Seq]:
    """Tensors `(ids, old_logprobs, mask)` of each trainable sequence of `trajectory`.

    Returns [] when it has none; the trajectory is then counted under exactly one reason.
    """
    raw: list[tuple[list[int], list[float | None], list[int]]] = []
    if trajectory.token_exact:
        for index, seq in enumerate(trajectory.sequences):
            if problem := _malformed(seq, vocab_size):
                logger.warning("trajectory %s of group %s is skipped (malformed_trajectories): sequence %d %s",
                               trajectory.id, trajectory.group_id, index, problem)
                counters.skipped["malformed_trajectories"] += 1
                return []
            raw.append((seq.token_ids, seq.logprobs, seq.assistant_mask))
    else:
        if tokenizer is None:
            counters.skipped["not_token_exact_without_tokenizer"] += 1
            return []
        try:
            ids, mask, split_edges, non_object = render_with_assistant_mask(
                tokenizer, trajectory.messages, trajectory.tools, trajectory.length_cut)
        except RetokenizeError as exc:
            logger.warning("trajectory %s of group %s is skipped (retokenize_failed): %s", trajectory.id,
                           trajectory.group_id, exc)
            counters.skipped["retokenize_failed"] += 1
            return []
        counters.retokenized += 1
        counters.split_edges += split_edges
        counters.non_object_arguments += non_object
        raw.append((ids, [None] * len(ids), mask))
    out: list[_Seq] = []
    too_long = 0
    for token_ids, logprobs, assistant_mask in raw:
        n = len(token_ids)
        if n > config.max_seq_len:
            if config.max_seq_len_policy == "skip":
                too_long += 1
                continue
            counters.truncated += 1
            n = config.max_seq_len
        mask = torch.tensor(assistant_mask[1:n], dtype=torch.float32)
        old = torch.tensor([_engine_logprob(lp) for lp in logprobs[1:n]], dtype=torch.float32)
        if int(mask.sum()) > 0:
            out.append((torch.tensor(token_ids[:n], dtype=torch.long), old, mask))
    if too_long:
        counters.skipped["too_long_sequences"] += too_long
    elif not out:
        counters.skipped["no_assistant_tokens"] += 1
    return out


def _finite_rewarded(group: Group, counters: _Counters) -> list[Trajectory]:
    kept = []
    for t in group.trajectories:
        if t.reward is None:
            counters.skipped["unrewarded_trajectories"] += 1
        elif not math.isfinite(t.reward):
            counters.skipped["nonfinite_rewards"] += 1
        else:
            kept.append(t)
    return kept


def _items(per_traj: list[tuple[float, list[_Seq]]], device: torch.device) -> list[TrainItem]:
    counts = [sum(int(m.sum()) for _, _, m in seqs) for _, seqs in per_traj]
    weights = trajectory_token_weights(counts)
    return [
        TrainItem(ids.to(device), old.to(device), mask.to(device), advantage, weight, index)
        for index, ((advantage, seqs), weight) in enumerate(zip(per_traj, weights, strict=True))
        for ids, old, mask in seqs
    ]


def _nothing(groups: list[Group], counters: _Counters, need: str) -> NothingTrainableError:
    reasons = ", ".join(f"{k}={v}" for k, v in sorted(counters.skipped.items())) or "no groups given"
    return NothingTrainableError(f"nothing to train in {len(groups)} group(s): {reasons}. {need}")


def _common_stats(groups: list[Group], counters: _Counters, trained_groups: int,
                  per_traj: list[tuple[float, list[_Seq]]]) -> dict[str, float]:
    # assistant tokens without an engine log-prob among those that train (not those of groups left out)
    missing = sum(int((mask.bool() & old.isnan()).sum()) for _, seqs in per_traj for _, old, mask in seqs)
    return {
        "data/groups": float(len(groups)),
        "data/groups_trained": float(trained_groups),
        "data/trajectories": float(len(per_traj)),
        "data/truncated_sequences": float(counters.truncated),
        "data/missing_logprobs": float(missing),
        "data/retokenized_trajectories": float(counters.retokenized),
        "data/retokenize_split_edges": float(counters.split_edges),
        "data/retokenize_non_object_arguments": float(counters.non_object_arguments),
        **{f"data/skipped/{k}": float(v) for k, v in sorted(counters.skipped.items())},
    }


def _mean_std(rewards: list[float]) -> tuple[float, float]:
    """Mean and std (population) of finite `rewards`, finite however large they are.

    The rewards are first multiplied by a power of two (exactly) that brings them below 1 in magnitude, so that
    neither their sum nor their squares overflow near float64's limit (1.8e308), and the results scaled back.
    Rounding is held to what the true values obey: the mean within the rewards' range, the std within their
    largest magnitude (it could otherwise round past float64's limit).
    """
    values = torch.tensor(rewards, dtype=torch.float64)
    exponent = max(0, math.frexp(float(values.abs().max()))[1])
    scaled = values * math.ldexp(1.0, -exponent)
    mean = float(scaled.mean().clamp(scaled.min(), scaled.max()))
    std = float(scaled.std(correction=0).clamp(max=scaled.abs().max()))
    return math.ldexp(mean, exponent), math.ldexp(std, exponent)


def _reward_stats(rewards: list[float]) -> dict[str, float]:
    """`reward/mean` and `reward/std` of finite `rewards` (`_mean_std`)."""
    mean, std = _mean_std(rewards)
    return {"reward/mean": mean, "reward/std": std}


def prepare_grpo(groups: list[Group], config: GRPOConfig, device: torch.device,
                 tokenizer: PreTrainedTokenizerBase | None = None, *, vocab_size: int | None = None) -> PreparedBatch:
    """Select trainable groups and turn their sequences into items with advantages and weights. With `vocab_size`
    (the model's), a sequence with a token id outside it skips its trajectory as malformed.

    Raises:
        NothingTrainableError: no group has two trajectories with finite, different rewards and
            assistant tokens (and advantages that fit float32); the message counts why each was left out.
    """
    counters = _Counters()
    rewards_seen: list[float] = []
    advantages_seen: list[float] = []
    per_traj: list[tuple[float, list[_Seq]]] = []
    trained_groups = 0
    for group in groups:
        rewarded = _finite_rewarded(group, counters)
        if len(rewarded) < 2:
            counters.skipped["too_few_trajectories"] += 1
            continue
        kept = [(float(t.reward), seqs) for t in rewarded  # type: ignore[arg-type]
                if (seqs := _sequences(t, config, tokenizer, counters, vocab_size))]
        if len(kept) < 2:
            counters.skipped["too_few_trajectories"] += 1
            continue
        # float64: a finite reward beyond float32's range must not turn into inf
        rewards = torch.tensor([reward for reward, _ in kept], dtype=torch.float64)
        if not has_reward_spread([reward for reward, _ in kept]):
            counters.skipped["no_reward_spread"] += 1
            continue
        advantages = group_advantages(rewards, scale=config.scale_rewards)
        if not bool(torch.isfinite(advantages).all()):
            counters.skipped["nonfinite_advantages"] += 1
            continue
        rewards_seen.extend(rewards.tolist())
        advantages_seen.extend(advantages.tolist())
        per_traj.extend(zip(advantages.tolist(), (seqs for _, seqs in kept), strict=True))
        trained_groups += 1
    if not per_traj:
        raise _nothing(groups, counters, "A group needs at least two trajectories with finite, different rewards "
                       "and assistant tokens.")
    adv_t = torch.tensor(advantages_seen)
    stats = {
        **_common_stats(groups, counters, trained_groups, per_traj),
        **_reward_stats(rewards_seen),
        "advantage/mean": float(adv_t.mean()),
        "advantage/std": float(adv_t.std(correction=0)),
        "advantage/min": float(adv_t.min()),
        "advantage/max": float(adv_t.max()),
    }
    return PreparedBatch(_items(per_traj, device), stats)


def prepare_sft(groups: list[Group], config: GRPOConfig, device: torch.device,
                tokenizer: PreTrainedTokenizerBase | None = None, *, vocab_size: int | None = None) -> PreparedBatch:
    """Pick the best-rewarded trajectory of each group (ties, up to float rounding: the first) as supervised targets.

    A group whose best trajectory cannot train (counted under its reason, e.g. `no_assistant_tokens`) is left
    out, not replaced by a worse-rewarded one (`vocab_size` as in `prepare_grpo`). Items carry advantage 1.0 and
    equal per-trajectory weights, so the SFT loss is the mean over trajectories of each one's mean assistant-token
    negative log-likelihood. `reward/mean` and `reward/std` are those of the rewards the step chose among (every
    finite reward of the groups that train, members that could not train too), not only the chosen ones', so they
    stay near a GRPO step's on the same groups; `reward/chosen_mean` is the mean reward of the chosen trajectories.

    Raises:
        NothingTrainableError: no group's best-rewarded trajectory has assistant tokens.
    """
    counters = _Counters()
    per_traj: list[tuple[float, list[_Seq]]] = []
    rewards_seen: list[float] = []
    rewards_chosen: list[float] = []
    for group in groups:
        rewarded = _finite_rewarded(group, counters)
        if not rewarded:
            counters.skipped["no_rewarded_trajectory"] += 1
            continue
        top = max(float(t.reward) for t in rewarded)  # type: ignore[arg-type]
        # a tie is rewards equal up to float rounding, as for `no_reward_spread`: the first recorded of them wins
        best = next(t for t in rewarded if not has_reward_spread([float(t.reward), top]))  # type: ignore[arg-type]
        seqs = _sequences(best, config, tokenizer, counters, vocab_size)
        if not seqs:
            continue
        per_traj.append((1.0, seqs))
        rewards_seen.extend(float(t.reward) for t in rewarded)  # type: ignore[arg-type]
        rewards_chosen.append(float(best.reward))  # type: ignore[arg-type]
    if not per_traj:
        raise _nothing(groups, counters, "SFT needs a group whose best-rewarded trajectory has assistant tokens.")
    stats = {**_common_stats(groups, counters, len(per_traj), per_traj), **_reward_stats(rewards_seen),
             "reward/chosen_mean": _mean_std(rewards_chosen)[0]}
    return PreparedBatch(_items(per_traj, device), stats)


def micro_batches(items: list[TrainItem], max_items: int, max_tokens: int) -> list[list[TrainItem]]:
    """Split `items`, in order, into passes of at most `max_items` items and `max_tokens` tokens.

    A pass takes the next item while both limits hold; an item longer than `max_tokens` gets a
    pass of its own.
    """
    passes: list[list[TrainItem]] = []
    tokens = 0
    for item in items:
        length = int(item.token_ids.numel())
        if not passes or len(passes[-1]) == max_items or tokens + length > max_tokens:
            passes.append([])
            tokens = 0
        passes[-1].append(item)
        tokens += length
    return passes


def shard_items(items: list[TrainItem], rank: int, world_size: int) -> list[TrainItem]:
    """Return rank `rank`'s share of `items`: whole trajectories, balanced by token count.

    Trajectories go, longest first, to the rank with the fewest tokens so far (ties: the lower
    rank), so every rank computes the same split. Items keep their weights, which were set over
    the whole batch: the ranks' summed gradients equal the one-process gradient.

    Args:
        items: the step's items (`prepare_grpo` / `prepare_sft`), in batch order.
        rank: this process's rank, `0 <= rank < world_size`.
        world_size: number of ranks.

    Returns:
        The items of `rank`'s trajectories, in batch order (empty when there are fewer
        trajectories than ranks).
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must lie in [0, world_size={world_size})")
    tokens: Counter[int] = Counter()
    for item in items:
        tokens[item.trajectory] += int(item.token_ids.numel())
    load = [0] * world_size
    owner: dict[int, int] = {}
    for trajectory in sorted(tokens, key=lambda t: (-tokens[t], t)):
        target = min(range(world_size), key=lambda r: (load[r], r))
        owner[trajectory] = target
        load[target] += tokens[trajectory]
    return [item for item in items if owner[item.trajectory] == rank]
