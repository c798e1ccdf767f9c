"""Group policy: how many trajectories a group takes, and when it is ready to train.

Pure functions; the store feeds them rows and acts on the answers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from collector.protocol import has_reward_spread

__all__ = ["Decision", "Member", "TrainingReward", "capacity", "decide", "merge_rewards"]


@dataclass(frozen=True)
class TrainingReward:
    """The reward GRPO trains on: one named reward, or a weighted sum of named rewards."""

    name: str = "reward"
    weights: Mapping[str, float] | None = None

    @property
    def label(self) -> str:
        """How the reward reads in messages: `'reward'` or `1*'correct' + 0.5*'short'`."""
        if not self.weights:
            return repr(self.name)
        return " + ".join(f"{weight:g}*{name!r}" for name, weight in sorted(self.weights.items()))

    def of(self, rewards: Mapping[str, float]) -> float | None:
        """The training reward from named rewards; None while any reward it needs is missing."""
        if not self.weights:
            return rewards.get(self.name)
        if any(name not in rewards for name in self.weights):
            return None
        return sum(weight * rewards[name] for name, weight in sorted(self.weights.items()))


@dataclass(frozen=True)
class Member:
    """One trajectory of a group, as readiness sees it."""

    complete: bool
    split: str
    reward: float | None
    """The training reward (configured name), or None when not given yet."""


@dataclass(frozen=True)
class Decision:
    """Whether an open group can be leased now."""

    state: Literal["open", "ready", "skipped"]
    reason: str | None = None


def capacity(explicit: bool, size_hint: int | None, min_group_size: int, *, followed: bool = False) -> int | None:
    """Most trajectories one group instance takes before a new instance opens.

    A known size (`art.group.size`) caps the group; an implicit group (by task or trace) is
    cut at `min_group_size`, so steady production traffic forms a stream of small groups; an
    explicit group without a size takes every trajectory that names it (None: no cap) until a
    newer instance of its key opens (`followed`: one opens when a trajectory names the key while
    the group is leased, skipped or expired). From then on it is cut at `min_group_size` too, even
    once back in the pool (given back, reopened): the key's later trajectories go to the newer
    instance, which would otherwise wait behind it alone, once it holds what it needs to train (a
    group reopened by hand after it expired waiting for members still gets them).
    """
    if size_hint is not None:
        return size_hint
    if not explicit or followed:
        return min_group_size
    return None


def decide(members: list[Member], expected: int, *, reward_label: str, keep_zero_spread: bool) -> Decision:
    """Readiness of an open group.

    Ready when every member is in the train split, complete and rewarded, there are at least
    `expected` members, every reward is finite (else skipped), and the rewards are not all equal up to float
    rounding (`has_reward_spread`; unless `keep_zero_spread`).
    """
    not_train = sorted({m.split for m in members if m.split != "train"})
    if not_train:
        return Decision("open", f"split {', '.join(not_train)}: only train groups are leased")
    if len(members) < expected:
        return Decision("open", f"waiting for {expected - len(members)} more of {expected} trajectories")
    incomplete = sum(not m.complete for m in members)
    if incomplete:
        return Decision("open", f"{incomplete} trajectories not complete")
    unrewarded = sum(m.reward is None for m in members)
    if unrewarded:
        return Decision("open", f"{unrewarded} trajectories without reward {reward_label}")
    not_finite = sum(m.reward is not None and not math.isfinite(m.reward) for m in members)
    if not_finite:  # a weighted sum of finite rewards can overflow; a new reward may repair it
        return Decision("skipped", f"{not_finite} trajectories with reward {reward_label} not finite")
    if not keep_zero_spread and not has_reward_spread([m.reward for m in members if m.reward is not None]):
        return Decision("skipped", "no reward spread")
    return Decision("ready")


def merge_rewards(rows: Iterable[tuple[tuple[int | str, ...], str, str, float]]) -> dict[str, float]:
    """Named rewards from (order key, source, name, value): API over span, later over earlier.

    The order key of a span reward is its time in the trace (so the result does not depend on
    arrival order); of an API reward, its arrival.
    """
    ordered = sorted(rows, key=lambda row: (row[1] == "api", row[0]))
    return {name: value for _, _, name, value in ordered}
