"""GRPO maths against hand-computed values on small tensors."""

from __future__ import annotations

import math

import pytest
import torch

from trainer_service.grpo import (
    MAX_LOG_RATIO,
    POLICY_LOSSES,
    cispo_loss,
    group_advantages,
    importance_ratio,
    kept_token_logprobs,
    kl_k3,
    policy_loss,
    ppo_loss,
    trajectory_token_weights,
)
from trainer_service.grpo_config import GRPOConfig


def test_group_advantages_scaled_and_unscaled() -> None:
    rewards = torch.tensor([0.0, 1.0])
    # mean 0.5, population std 0.5 → ±1 (minus the eps effect)
    assert torch.allclose(group_advantages(rewards, eps=0.0), torch.tensor([-1.0, 1.0]))
    assert torch.allclose(group_advantages(rewards, scale=False), torch.tensor([-0.5, 0.5]))
    r = torch.tensor([1.0, 2.0, 3.0, 6.0])  # mean 3, std sqrt((4+1+0+9)/4)=sqrt(3.5)
    expected = (r - 3.0) / (math.sqrt(3.5) + 1e-6)
    assert torch.allclose(group_advantages(r), expected)


def test_group_advantages_zero_spread_is_zero() -> None:
    assert torch.equal(group_advantages(torch.tensor([0.7, 0.7, 0.7])), torch.zeros(3))
    with pytest.raises(ValueError, match="non-empty 1-D"):
        group_advantages(torch.tensor([]))


def test_kept_token_logprobs_match_log_softmax_at_every_position() -> None:
    torch.manual_seed(0)
    logits = torch.randn(5, 7)
    ids = torch.tensor([3, 1, 4, 1, 5])
    got = kept_token_logprobs(logits[:4], ids, torch.arange(4))
    expected = torch.stack([torch.log_softmax(logits[t], -1)[ids[t + 1]] for t in range(4)])
    assert got.shape == (4,)
    assert torch.allclose(got, expected, atol=1e-6)
    # Uniform logits: every token has log(1/7).
    uniform = kept_token_logprobs(torch.zeros(2, 7), torch.tensor([0, 1, 2]), torch.arange(2))
    assert torch.allclose(uniform, torch.full((2,), -math.log(7)))


def test_ppo_ratio_is_exactly_one_on_policy() -> None:
    new = torch.tensor([-0.3, -1.2, -2.0], requires_grad=True)
    out = ppo_loss(new, new.detach().clone(), torch.tensor(1.5), 0.2, 0.2)
    assert torch.equal(out.ratio, torch.ones(3))
    assert not out.clipped.any()
    assert torch.allclose(out.loss, torch.full((3,), -1.5))
    out.loss.sum().backward()
    # d/dnew of -ratio*A at ratio 1 = -A
    assert torch.allclose(new.grad, torch.full((3,), -1.5))


def test_ppo_clipping_engages() -> None:
    old = torch.zeros(4)
    new = torch.log(torch.tensor([1.5, 0.5, 1.5, 0.5])).requires_grad_()
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    out = ppo_loss(new, old, adv, 0.2, 0.28)  # clip range [0.8, 1.28]: each bound from its own epsilon
    # ratio 1.5, A>0 → clipped at 1.28; ratio 0.5, A>0 → unclipped 0.5 (min picks it);
    # ratio 1.5, A<0 → unclipped -1.5; ratio 0.5, A<0 → clipped at 0.8 → -0.8.
    assert torch.allclose(out.loss, torch.tensor([-1.28, -0.5, 1.5, 0.8]), atol=1e-6)
    assert out.clipped.tolist() == [True, False, False, True]
    out.loss.sum().backward()
    assert new.grad[0] == 0 and new.grad[3] == 0  # clipped tokens carry no gradient
    assert new.grad[1] != 0 and new.grad[2] != 0


def test_ppo_delta_caps_the_ratio_of_negative_advantages() -> None:
    old = torch.zeros(4)
    new = torch.log(torch.tensor([5.0, 2.0, 5.0, 0.5])).requires_grad_()
    adv = torch.tensor([-1.0, -1.0, 1.0, -1.0])
    plain = ppo_loss(new, old, adv, 0.2, 0.2)
    out = ppo_loss(new, old, adv, 0.2, 0.2, delta=3.0)
    # ratio 5, A<0: PPO's loss 5 (unbounded), with delta 3 → 3 and no gradient; ratio 2 < delta, A<0: 2 as PPO;
    # ratio 5, A>0: clipped at 1.2 either way; ratio 0.5, A<0: clipped at 0.8 either way.
    assert torch.allclose(plain.loss, torch.tensor([5.0, 2.0, -1.2, 0.8]), atol=1e-6)
    assert torch.allclose(out.loss, torch.tensor([3.0, 2.0, -1.2, 0.8]), atol=1e-6)
    assert out.clipped.tolist() == [True, False, True, True]
    assert plain.clipped.tolist() == [False, False, True, True]
    (grad,) = torch.autograd.grad(out.loss.sum(), new)
    assert grad.tolist() == [0.0, pytest.approx(2.0), 0.0, 0.0]  # d(ratio)/d(logp) = ratio, times |A| = 1
    (plain_grad,) = torch.autograd.grad(plain.loss.sum(), new)
    assert plain_grad[0] == pytest.approx(5.0)


def test_delta_is_ppo_only_and_above_the_clip() -> None:
    assert GRPOConfig(delta=3.0).delta == 3.0
    assert GRPOConfig.from_env({"ART_TRAINER_DELTA": "4"}).delta == 4.0
    assert GRPOConfig.from_env({"ART_TRAINER_DELTA": "none"}).delta is None
    with pytest.raises(ValueError, match=r"delta=3.0 is PPO's two-sided clip; loss='cispo'"):
        GRPOConfig(loss="cispo", delta=3.0)
    with pytest.raises(ValueError, match=r"delta=1.1 must exceed 1 \+ epsilon_high \(1.2\)"):
        GRPOConfig(delta=1.1)
    with pytest.raises(ValueError, match="delta=2.0 is PPO's two-sided clip"):
        policy_loss("cispo", torch.zeros(2), torch.zeros(2), 1.0, torch.ones(2), 1.0, delta=2.0)


def test_cispo_keeps_gradient_of_clipped_tokens() -> None:
    old = torch.zeros(3)
    new = torch.log(torch.tensor([2.0, 0.5, 2.0])).requires_grad_()
    out = cispo_loss(new, old, torch.tensor([1.0, -2.0, -1.0]), 0.2, 0.3)
    # weight = min(ratio, 1.3), detached: [1.3, 0.5, 1.3]; loss = -w * A * logp
    assert torch.allclose(out.loss, torch.tensor([-1.3 * math.log(2.0), 0.5 * 2.0 * math.log(0.5),
                                                  1.3 * math.log(2.0)]), atol=1e-6)
    assert out.clipped.tolist() == [True, False, True]
    out.loss.sum().backward()
    assert torch.allclose(new.grad, torch.tensor([-1.3, 1.0, 1.3]))  # -w * A: a negative advantage pushes down


def test_policy_loss_masks_weights_and_metrics() -> None:
    new = torch.tensor([-1.0, -2.0, -3.0, -4.0], requires_grad=True)
    old = torch.tensor([999.0, -2.0, -3.0, float("nan")])  # prompt placeholder and a missing logprob
    mask = torch.tensor([0.0, 1.0, 1.0, 1.0])
    out = policy_loss("ppo", new, old, 2.0, mask, 0.25)
    # on-policy everywhere that counts: loss per token = -2, 3 tokens, weight 0.25
    assert math.isclose(float(out.loss.detach()), -1.5, rel_tol=1e-6)
    assert out.tokens == 3 and out.clipped_tokens == 0
    # the ratio and the gap cover the two tokens with an engine logprob, not the missing one
    assert out.known_tokens == 2 and out.ratio_sum == 2 and out.gap_sum == 0
    with pytest.raises(ValueError, match="unknown policy loss"):
        policy_loss("nope", new, old, 1.0, mask, 1.0)


def test_trajectories_weigh_equally() -> None:
    # 2 tokens and 4 tokens: each trajectory's tokens sum to 1/2.
    assert trajectory_token_weights([2, 4]) == [0.25, 0.125]
    assert trajectory_token_weights([0, 5]) == [0.0, 0.2]
    with pytest.raises(ValueError):
        trajectory_token_weights([0])


def test_registry_and_config_validation() -> None:
    assert set(POLICY_LOSSES) == {"ppo", "cispo"}
    assert GRPOConfig(loss="cispo", epsilon_high=0.28).upper_epsilon == 0.28
    with pytest.raises(ValueError, match=r"loss='dpo'.*\['cispo', 'ppo'\]"):
        GRPOConfig(loss="dpo")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="learning_rate=0"):
        GRPOConfig(learning_rate=0)
    with pytest.raises(ValueError, match="epsilon=1.5"):
        GRPOConfig(epsilon=1.5)


def test_sequence_level_ratio_is_shared_and_hand_computed() -> None:
    new = torch.tensor([-1.0, -2.0, -0.5, -3.0], requires_grad=True)
    old = torch.tensor([-1.2, -1.8, 9.0, -3.3])
    mask = torch.tensor([1.0, 1.0, 0.0, 1.0])  # position 2 is a prompt token with a junk logprob
    out = policy_loss("ppo", new, old, 1.0, mask, 1.0, epsilon=0.2, level="sequence")
    mean_log_ratio = (0.2 - 0.2 + 0.3) / 3  # masked mean of new - old
    ratio = math.exp(mean_log_ratio)
    assert out.ratio_sum == pytest.approx(3 * ratio, rel=1e-6)  # every assistant token has the same ratio
    assert out.loss.item() == pytest.approx(-3 * ratio, rel=1e-6)
    out.loss.backward()
    # d/dnew_t of -3 * exp(mean) = -3 * ratio / 3 on each assistant token, 0 on the prompt token
    assert new.grad is not None
    assert torch.allclose(new.grad, torch.tensor([-ratio, -ratio, 0.0, -ratio]), atol=1e-6)
    token = policy_loss("ppo", new.detach(), old, 1.0, mask, 1.0, epsilon=0.2, level="token")
    assert token.ratio_sum != pytest.approx(out.ratio_sum)
    # the engine/trainer gap is per token at either level: |0.2| + |-0.2| + |0.3|
    assert out.gap_sum == pytest.approx(0.7, rel=1e-6) and token.gap_sum == pytest.approx(0.7, rel=1e-6)
    with pytest.raises(ValueError, match="importance sampling level"):
        policy_loss("ppo", new, old, 1.0, mask, 1.0, level="word")


def test_sequence_level_clips_the_whole_sequence() -> None:
    new = torch.tensor([0.0, 0.0])
    old = torch.tensor([-0.5, -0.5])  # ratio e^0.5 = 1.65 > 1.2 on both
    out = policy_loss("ppo", new, old, 1.0, torch.ones(2), 1.0, epsilon=0.2, level="sequence")
    assert out.clipped_tokens == 2.0


def test_kl_k3_values_and_penalty() -> None:
    new = torch.tensor([-1.0, -2.0, -3.0], requires_grad=True)
    ref = torch.tensor([-1.0, -1.0, -1.0])
    kl = kl_k3(new, ref)
    # delta = ref - new = [0, 1, 2]: k3 = e^delta - delta - 1 = [0, e - 2, e^2 - 3]
    assert torch.allclose(kl.detach(), torch.tensor([0.0, math.e - 2.0, math.exp(2.0) - 3.0]))
    mask = torch.tensor([1.0, 1.0, 0.0])  # the last is a prompt token: its KL is neither penalised nor reported
    plain = policy_loss("ppo", new, new.detach(), 0.0, mask, 0.5)  # advantage 0: only the KL remains
    with_kl = policy_loss("ppo", new, new.detach(), 0.0, mask, 0.5, ref_logprobs=ref, kl_coef=0.1)
    assert plain.loss.item() == 0.0
    assert with_kl.loss.item() == pytest.approx(0.1 * 0.5 * (math.e - 2.0), rel=1e-6)
    assert with_kl.policy == plain.policy == 0.0  # the policy term alone: the KL penalty is not in it
    assert with_kl.kl_sum == pytest.approx(math.e - 2.0, rel=1e-6)


def test_kept_token_logprobs_equal_the_full_rows_where_kept() -> None:
    torch.manual_seed(0)
    logits, ids = torch.randn(6, 11), torch.randint(0, 11, (6,))
    keep = torch.tensor([1, 2, 4])
    got = kept_token_logprobs(logits[keep], ids, keep)
    full = torch.log_softmax(logits[:-1], -1).gather(-1, ids[1:, None])[:, 0]
    assert got.shape == full.shape == (5,)
    assert torch.allclose(got[keep], full[keep], atol=1e-6) and got[[0, 3]].tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="2 rows of logits for 3 kept positions"):
        kept_token_logprobs(logits[:2], ids, keep)


def test_sequence_level_on_a_packed_row_equals_one_call_per_sequence() -> None:
    torch.manual_seed(0)
    lengths = (3, 5, 2)
    new = [torch.randn(n, requires_grad=True) for n in lengths]
    old = [torch.randn(n) for n in lengths]
    masks = [torch.tensor([0.0, 1.0, 1.0]), torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0]), torch.tensor([1.0, 1.0])]
    advantages, weights = (1.0, -0.5, 2.0), (0.1, 0.2, 0.3)
    alone = [policy_loss("ppo", n, o, a, m, w, level="sequence") for n, o, a, m, w in
             zip(new, old, advantages, masks, weights, strict=True)]
    segments = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    per_token = [torch.full((n,), v) for v, n in zip(advantages, lengths, strict=True)]
    row = policy_loss("ppo", torch.cat(new), torch.cat(old), torch.cat(per_token), torch.cat(masks),
                      torch.cat([torch.full((n,), w) for w, n in zip(weights, lengths, strict=True)]),
                      level="sequence", segments=segments)
    assert float(row.loss.detach()) == pytest.approx(sum(float(out.loss.detach()) for out in alone), rel=1e-6)
    assert row.ratio_sum == pytest.approx(sum(out.ratio_sum for out in alone), rel=1e-6)
    assert row.clipped_tokens == sum(out.clipped_tokens for out in alone)
    grads = torch.autograd.grad(row.loss, new)
    expected = torch.autograd.grad(sum(out.loss for out in alone), new)
    assert all(torch.allclose(g, e, atol=1e-7) for g, e in zip(grads, expected, strict=True))


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
@pytest.mark.parametrize("advantage", [1.0, -1.0])
def test_far_or_infinite_engine_logprobs_keep_loss_and_gradient_finite(name: str, advantage: float) -> None:
    new = torch.tensor([-1.0, -2.0, -0.5, -3.0], requires_grad=True)
    # vLLM writes a -inf log-prob as -9999.0; a -inf or +inf that reaches the trainer is unknown
    old = torch.tensor([-1.0, -9999.0, -math.inf, math.inf])
    out = policy_loss(name, new, old, advantage, torch.ones(4), 0.25)
    out.loss.backward()
    assert math.isfinite(float(out.loss.detach())) and math.isfinite(out.ratio_sum)
    assert new.grad is not None and bool(torch.isfinite(new.grad).all())
    # token 1's log-ratio is clamped: its ratio is e^MAX_LOG_RATIO; the infinite ones are unknown (on-policy)
    assert out.known_tokens == 2 and out.ratio_sum == pytest.approx(1.0 + math.exp(MAX_LOG_RATIO), rel=1e-6)
    assert out.gap_sum == pytest.approx(9997.0)


def test_importance_ratio_is_clamped_and_differentiable_inside_the_bound() -> None:
    new = torch.tensor([0.5, 30.0, -30.0], requires_grad=True)
    ratio = importance_ratio(new, torch.zeros(3))
    assert torch.allclose(ratio.detach(),
                          torch.tensor([math.exp(0.5), math.exp(MAX_LOG_RATIO), math.exp(-MAX_LOG_RATIO)]))
    ratio.sum().backward()
    assert new.grad is not None and new.grad.tolist() == [pytest.approx(math.exp(0.5)), 0.0, 0.0]


def test_group_advantages_of_rewards_beyond_float32() -> None:
    assert group_advantages(torch.tensor([1e39, 0.0], dtype=torch.float64)).tolist() == [1.0, -1.0]
    assert group_advantages(torch.tensor([1e39, 0.0], dtype=torch.float64)).dtype == torch.float32


@pytest.mark.parametrize("rewards", [[1e300, 0.0], [1.7e308, -1.7e308], [-1e200, 1.0]])
def test_group_advantages_of_rewards_whose_squares_overflow(rewards: list[float]) -> None:
    # the std's squares overflowed float64 to inf, which scaled every advantage of the group to 0
    got = group_advantages(torch.tensor(rewards, dtype=torch.float64)).tolist()
    assert got == ([1.0, -1.0] if rewards[0] > rewards[1] else [-1.0, 1.0])


def test_cispo_bounds_its_weight_from_above_only_as_documented() -> None:
    new, old = torch.log(torch.tensor([2.0, 0.1])), torch.zeros(2)  # ratios 2 and 0.1

    def loss(**eps: float | None) -> float:
        return float(policy_loss("cispo", new, old, 1.0, torch.ones(2), 1.0, **eps).loss)  # type: ignore[arg-type]

    # weight = [min(2, 1 + cap), 0.1]: the lower epsilon never lifts 0.1 and never matters beside epsilon_high
    assert loss(epsilon=0.1, epsilon_high=0.3) == loss(epsilon=0.9, epsilon_high=0.3) == pytest.approx(
        -(1.3 * math.log(2.0) + 0.1 * math.log(0.1)), rel=1e-6)
    assert loss(epsilon=0.5) == pytest.approx(-(1.5 * math.log(2.0) + 0.1 * math.log(0.1)), rel=1e-6)  # cap 1 + epsilon
