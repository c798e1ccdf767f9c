"""Group policy: capacity and readiness decisions, reward precedence."""

from __future__ import annotations

import math

from collector.groups import Member, TrainingReward, capacity, decide, merge_rewards


def _m(reward: float | None, complete: bool = True, split: str = "train") -> Member:
    return Member(complete, split, reward)


def test_capacity() -> None:
    assert capacity(explicit=True, size_hint=4, min_group_size=2) == 4
    assert capacity(explicit=False, size_hint=None, min_group_size=2) == 2
    assert capacity(explicit=True, size_hint=None, min_group_size=2) is None
    assert capacity(explicit=True, size_hint=None, min_group_size=2, followed=True) == 2  # what it needs to train


def test_decide() -> None:
    kw = {"reward_label": "'reward'", "keep_zero_spread": False}
    assert decide([_m(1.0), _m(0.0)], 2, **kw).state == "ready"
    assert decide([_m(1.0)], 2, **kw).reason == "waiting for 1 more of 2 trajectories"
    assert decide([_m(1.0), _m(0.0, complete=False)], 2, **kw).reason == "1 trajectories not complete"
    assert decide([_m(1.0), _m(None)], 2, **kw).reason == "1 trajectories without reward 'reward'"
    assert decide([_m(1.0), _m(0.0, split="val")], 2, **kw).state == "open"
    assert decide([_m(0.5), _m(0.5)], 2, **kw).state == "skipped"
    assert decide([_m(0.5), _m(0.5)], 2, reward_label="'reward'", keep_zero_spread=True).state == "ready"
    # partial credits summed in another order differ by rounding alone: no spread, as the trainer sees it
    assert 0.1 + 0.2 + 0.3 != 0.3 + 0.2 + 0.1
    assert decide([_m(0.1 + 0.2 + 0.3), _m(0.3 + 0.2 + 0.1)], 2, **kw).state == "skipped"
    assert decide([_m(1.0), _m(1.0 + 1e-9)], 2, **kw).state == "ready"


def test_merge_rewards_api_over_span_later_over_earlier() -> None:
    rows = [((3,), "api", "r", 0.3), ((1,), "span", "r", 0.1), ((5,), "span", "r", 0.5), ((2,), "api", "x", 2.0),
            ((4,), "api", "x", 4.0)]
    assert merge_rewards(rows) == {"r": 0.3, "x": 4.0}


def test_training_reward_one_name_or_weighted_sum() -> None:
    one = TrainingReward("correct")
    assert (one.of({"correct": 0.5}), one.of({}), one.label) == (0.5, None, "'correct'")
    mix = TrainingReward(weights={"correct": 1.0, "short": 0.5})
    assert mix.of({"correct": 1.0, "short": 0.4, "other": 9.0}) == 1.2
    assert mix.of({"correct": 1.0}) is None  # waits for every name
    assert mix.label == "1*'correct' + 0.5*'short'"


def test_a_training_reward_that_is_not_finite_skips_the_group() -> None:
    kw = {"reward_label": "'reward'", "keep_zero_spread": True}
    overflow = TrainingReward(weights={"a": 10.0, "b": -10.0}).of({"a": 1e308, "b": 1e308})  # inf - inf
    assert overflow is not None and math.isnan(overflow)
    for bad in (overflow, math.inf, -math.inf):
        decision = decide([_m(bad), _m(0.0)], 2, **kw)
        assert (decision.state, decision.reason) == ("skipped", "1 trajectories with reward 'reward' not finite")
