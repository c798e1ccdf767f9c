"""LoRATrainer on a tiny random Llama (vocab shared with the bundled tokenizer): the GRPO and SFT step, its guards,
checkpoints and learning (passes and dtypes: test_training_passes.py)."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from collector.protocol import Group, Sequence, Trajectory
from tests.trainer_service.builders import (
    BAD,
    GOOD,
    PROMPT,
    adapter_weights,
    group,
    lora_params,
    make_trainer,
    seq_logprobs,
)
from trainer_service.batching import prepare_grpo
from trainer_service.grpo import PolicyLossOutput
from trainer_service.training import (
    LoRATrainer,
    NonFiniteStepError,
    NothingTrainableError,
)

TOOL_RESULT = [1200, 1201, 1202]  # what a tool answered: in the context, never sampled by the model


def tool_trajectory(trainer: LoRATrainer, call: list[int], answer: list[int], reward: float, tid: str) -> Trajectory:
    """The prompt, an assistant turn calling a tool, the tool's result, the assistant's answer; the engine's
    log-probs on the two assistant turns only (as the collector records them)."""
    ids = PROMPT + call + TOOL_RESULT + answer
    mask = [0] * len(PROMPT) + [1] * len(call) + [0] * len(TOOL_RESULT) + [1] * len(answer)
    logprobs = [lp if m else None for lp, m in zip([None, *seq_logprobs(trainer, ids)], mask, strict=True)]
    return Trajectory(id=tid, trace_id="0" * 32, group_id="g", reward=reward,
                      sequences=[Sequence(token_ids=ids, logprobs=logprobs, assistant_mask=mask)])


def test_logprob_gap_measures_how_far_the_engine_disagrees() -> None:
    trainer = make_trainer()
    shifted = group(trainer, (1.0, 0.0))
    for t in shifted.trajectories:  # an engine that reports every sampled token 0.1 nats likelier
        seq = t.sequences[0]
        seq.logprobs = [None if lp is None else lp + 0.1 for lp in seq.logprobs]
        seq.logprobs[-1] = None  # an unknown one is neither a gap of 0 nor a ratio of 1
    metrics = trainer.step([shifted])
    assert metrics["data/missing_logprobs"] == 2
    assert metrics["loss/logprob_gap"] == pytest.approx(0.1, abs=1e-4)
    assert metrics["loss/ratio_mean"] == pytest.approx(math.exp(-0.1), rel=1e-4)


def test_step_changes_only_the_adapter() -> None:
    trainer = make_trainer()
    before = lora_params(trainer)
    base_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" not in n}
    metrics = trainer.step([group(trainer, (1.0, 0.0))])
    after = lora_params(trainer)
    assert any(not torch.equal(before[n], after[n]) for n in before)
    assert all(torch.equal(p, base_before[n]) for n, p in trainer.model.named_parameters() if "lora_" not in n)
    assert metrics["step"] == 1 and trainer.step_count == 1
    assert metrics["loss/ratio_mean"] == pytest.approx(1.0, abs=1e-5)  # on-policy data
    assert metrics["loss/logprob_gap"] == pytest.approx(0.0, abs=1e-5)
    assert metrics["loss/clip_fraction"] == 0.0
    assert metrics["reward/mean"] == 0.5
    assert metrics["grad/norm"] > 0


@pytest.mark.parametrize(("max_seq_len", "want"), [(300, [256]), (400, [256, 400])],
                         ids=["sequences-fit-a-pass", "a-sequence-longer-than-a-pass"])
def test_warm_up_runs_the_largest_passes_and_changes_nothing(max_seq_len: int, want: list[int]) -> None:
    """One pass of the largest whole number of 128-token sequences in micro_batch_tokens, and one of a
    max_seq_len sequence when that is longer than a pass (a step gives such a sequence a pass of its own)."""
    warmed, cold = (make_trainer(micro_batch_tokens=300, max_seq_len=max_seq_len) for _ in range(2))
    passes: list[int] = []
    warmed.model.register_forward_pre_hook(lambda module, args, kwargs: passes.append(kwargs["input_ids"].numel()),
                                           with_kwargs=True)
    before = adapter_weights(warmed)
    assert warmed.warm_up() > 0
    assert passes == want
    assert all(p.grad is None for p in warmed.model.parameters()), "the warm-up's gradients were kept"
    assert warmed.step_count == 0 and not warmed.optimizer.state
    assert all(torch.equal(before[n], w) for n, w in adapter_weights(warmed).items())
    batch = [group(cold, (1.0, 0.0))]
    got, want = warmed.step(batch), cold.step(batch)
    assert [got[k] for k in ("loss/policy", "grad/norm", "data/tokens")] == [
        want[k] for k in ("loss/policy", "grad/norm", "data/tokens")]
    assert all(torch.equal(w, adapter_weights(cold)[n]) for n, w in adapter_weights(warmed).items())


def test_only_assistant_tokens_count() -> None:
    trainer = make_trainer()
    calls, answers = ([900, 901, 2], [1500, 2]), (GOOD, BAD)
    g = Group(id="g", trajectories=[tool_trajectory(trainer, call, answer, reward, tid) for call, answer, reward, tid
                                    in zip(calls, answers, (1.0, 0.0), ("g-a", "g-b"), strict=True)])
    # Garbage engine logprobs on the prompt and the tool's result must not matter.
    g_noisy = g.model_copy(deep=True)
    for t in g_noisy.trajectories:
        seq = t.sequences[0]
        seq.logprobs = [-50.0 if m == 0 else lp for lp, m in zip(seq.logprobs, seq.assistant_mask, strict=True)]
    items_clean = prepare_grpo([g], trainer.config, trainer.device).items
    items_noisy = prepare_grpo([g_noisy], trainer.config, trainer.device).items
    want = make_trainer().step([g])  # the same initial adapter, the clean logprobs
    metrics = trainer.step([g_noisy])
    assert metrics["data/assistant_tokens"] == sum(map(len, calls + answers))
    assert metrics["data/tokens"] == 2 * (len(PROMPT) + len(TOOL_RESULT)) + sum(map(len, calls + answers))
    for clean, noisy, call, answer in zip(items_clean, items_noisy, calls, answers, strict=True):
        assert torch.equal(clean.mask, noisy.mask)
        assert clean.mask.tolist() == ([0.0] * (len(PROMPT) - 1) + [1.0] * len(call) + [0.0] * len(TOOL_RESULT)
                                       + [1.0] * len(answer))
    assert metrics["loss/ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["loss/policy"] == pytest.approx(want["loss/policy"], abs=1e-7)
    assert metrics["grad/norm"] == pytest.approx(want["grad/norm"], rel=1e-5)


@pytest.mark.parametrize("loss", ["ppo", "cispo"])
def test_an_engine_placeholder_logprob_trains_a_finite_step(loss: str) -> None:
    trainer = make_trainer(loss=loss)
    g = group(trainer, (1.0, 0.0))
    for t in g.trajectories:  # A > 0 and A < 0: vLLM writes a sampled token's -inf log-prob as -9999.0
        seq = t.sequences[0]
        seq.logprobs = [*seq.logprobs[:-2], -9999.0, seq.logprobs[-1]]
    before = lora_params(trainer)
    metrics = trainer.step([g])
    after = lora_params(trainer)
    assert math.isfinite(metrics["grad/norm"]) and math.isfinite(metrics["loss/policy"])
    assert all(bool(torch.isfinite(p).all()) for p in after.values())
    assert any(not torch.equal(before[n], after[n]) for n in before)


def test_delta_bounds_a_far_off_token_of_a_negative_advantage() -> None:
    """An engine log-prob 3 nats below the trainer's on the worse trajectory's first token (ratio e^3 ~ 20,
    A = -1): PPO's loss grows with that ratio; with delta 4 the token costs 4 |A| and is counted as clipped."""
    losses = {}
    for delta in (None, 4.0):
        trainer = make_trainer(delta=delta)
        g = group(trainer, (1.0, 0.0))
        seq = g.trajectories[1].sequences[0]  # reward 0: advantage -1
        first = len(PROMPT)
        seq.logprobs = [*seq.logprobs[:first], seq.logprobs[first] - 3.0, *seq.logprobs[first + 1:]]
        metrics = trainer.step([g])
        losses[delta] = metrics["loss/policy"]
        tokens = metrics["data/assistant_tokens"]
        assert metrics["loss/clip_fraction"] == pytest.approx((1 / tokens) if delta else 0.0)
    # the one token's share of the loss: weight 1 / (len(BAD) * 2 trajectories), times ratio e^3 or delta 4
    assert losses[None] - losses[4.0] == pytest.approx((math.exp(3.0) - 4.0) / (len(BAD) * 2), rel=1e-4)


def nan_loss(out: PolicyLossOutput, new: torch.Tensor) -> torch.Tensor:
    return out.loss * math.nan


def nan_gradient(out: PolicyLossOutput, new: torch.Tensor) -> torch.Tensor:
    return out.loss + torch.sqrt(new.sum() * 0.0)  # the same value; d sqrt(x)/dx at 0 is inf, times 0: NaN


@pytest.mark.parametrize("poison", [nan_loss, nan_gradient])
def test_a_non_finite_loss_or_gradient_never_reaches_the_adapter(
        poison: Callable[[PolicyLossOutput, torch.Tensor], torch.Tensor], monkeypatch: pytest.MonkeyPatch) -> None:
    trainer = make_trainer()
    g = group(trainer, (1.0, 0.0))
    real = trainer._grpo_loss
    monkeypatch.setattr(trainer, "_grpo_loss",
                        lambda items, new: dataclasses.replace(out := real(items, new), loss=poison(out, new)))
    before = lora_params(trainer)
    with pytest.raises(NonFiniteStepError, match="must be finite .*the optimizer did not step"):
        trainer.step([g])
    assert all(torch.equal(before[n], p) for n, p in lora_params(trainer).items())
    assert trainer.step_count == 0 and trainer.optimizer.state_dict()["state"] == {}
    assert all(p.grad is None for p in trainer.model.parameters())
    monkeypatch.undo()
    assert trainer.step([g])["step"] == 1  # the next good batch trains as usual


def test_a_step_that_makes_the_adapter_non_finite_raises_and_restore_undoes_it() -> None:
    trainer = make_trainer()
    g = group(trainer, (1.0, 0.0))
    before, snapshot = lora_params(trainer), trainer.snapshot()
    for param_group in trainer.optimizer.param_groups:  # an update that overflows; the loss and gradient are finite
        param_group["lr"] = math.inf
    with pytest.raises(NonFiniteStepError, match=r"step 1: the optimizer's step made adapter weights NaN or infinite"):
        trainer.step([g])
    assert trainer.step_count == 0 and all(p.grad is None for p in trainer.model.parameters())
    trainer.restore(snapshot)  # what the service does with every failed step
    assert all(torch.equal(before[n], p) for n, p in lora_params(trainer).items())
    assert trainer.step([g])["step"] == 1 and all(bool(p.isfinite().all()) for p in lora_params(trainer).values())


def test_zero_spread_groups_are_skipped() -> None:
    trainer = make_trainer()
    metrics = trainer.step([group(trainer, (1.0, 0.0), "a"), group(trainer, (0.5, 0.5), "b")])
    assert metrics["data/groups"] == 2
    assert metrics["data/groups_trained"] == 1
    assert metrics["data/skipped/no_reward_spread"] == 1
    assert metrics["data/trajectories"] == 2


def test_nothing_trainable_raises_readably() -> None:
    trainer = make_trainer()
    with pytest.raises(NothingTrainableError, match="no_reward_spread=1.*too_few_trajectories=1"):
        trainer.step([group(trainer, (0.5, 0.5), "a"), group(trainer, (1.0, None), "b")])
    with pytest.raises(NothingTrainableError, match="no groups given"):
        trainer.step([])
    assert trainer.step_count == 0


def test_rewarded_completion_gains_probability() -> None:
    trainer = make_trainer(learning_rate=2e-3)

    def total(ids: list[int]) -> float:
        return sum(seq_logprobs(trainer, PROMPT + ids)[len(PROMPT) - 1 :])

    good0, bad0 = total(GOOD), total(BAD)
    for _ in range(4):
        trainer.step([group(trainer, (1.0, 0.0))])  # fresh on-policy logprobs each step
    good1, bad1 = total(GOOD), total(BAD)
    assert good1 > good0 + 0.5, (good0, good1)
    assert bad1 < bad0 - 0.5, (bad0, bad1)


def test_cispo_learns_too() -> None:
    trainer = make_trainer(loss="cispo", learning_rate=2e-3)

    def total(ids: list[int]) -> float:
        return sum(seq_logprobs(trainer, PROMPT + ids)[len(PROMPT) - 1 :])

    good0, bad0 = total(GOOD), total(BAD)
    for _ in range(3):
        trainer.step([group(trainer, (1.0, 0.0))])
    good1, bad1 = total(GOOD), total(BAD)
    assert good1 > good0 + 0.25, (good0, good1)  # measured: +0.59
    assert bad1 < bad0 - 0.5, (bad0, bad1)  # measured: -1.57; the negative advantage pushes it down


def test_save_is_atomic_and_resumable(tmp_path: Path) -> None:
    trainer = make_trainer()
    metrics = trainer.step([group(trainer, (1.0, 0.0))])
    path = trainer.save(tmp_path / "checkpoints" / "step-1", batch_id="batch-7")
    names = {p.name for p in path.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "optimizer.pt", "manifest.json"} <= names
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["step"] == 1 and manifest["batch_id"] == "batch-7"
    assert manifest["base_model"] == "tiny-llama" and manifest["config"]["lora_r"] == 8
    assert manifest["metrics"]["loss/policy"] == metrics["loss/policy"]
    assert [p.name for p in path.parent.iterdir()] == ["step-1"]  # no temp folder left
    with pytest.raises(FileExistsError):
        trainer.save(path)

    fresh = make_trainer()
    fresh.resume(path)
    assert fresh.step_count == 1
    saved, restored = lora_params(trainer), lora_params(fresh)
    assert all(torch.equal(saved[n], restored[n]) for n in saved)


def test_resume_trains_with_this_runs_learning_rate_and_weight_decay(tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    first = make_trainer(learning_rate=5e-3, weight_decay=0.0)
    first.step([group(first, (1.0, 0.0))])
    path = first.save(tmp_path / "step-1")
    resumed = make_trainer(learning_rate=1e-4, weight_decay=0.1)  # restarted with new --learning-rate, --weight-decay
    with caplog.at_level(logging.INFO, logger="trainer_service.training"):
        resumed.resume(path)
    assert [(g["lr"], g["weight_decay"]) for g in resumed.optimizer.param_groups] == [(1e-4, 0.1)]
    assert "learning_rate 0.005 -> 0.0001, weight_decay 0 -> 0.1" in caplog.text
    saved, restored = first.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    # the moments are the saved ones
    assert all(torch.equal(saved[k]["exp_avg"], restored[k]["exp_avg"]) for k in saved)
    assert resumed.step([group(resumed, (1.0, 0.0))])["optim/lr"] == 1e-4
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="trainer_service.training"):
        make_trainer(learning_rate=5e-3).resume(path)
    assert "resumed the optimizer state" not in caplog.text  # nothing changed, nothing said


def test_resume_without_optimizer_state_says_so(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    first = make_trainer()
    first.step([group(first, (1.0, 0.0))])
    path = first.save(tmp_path / "step-1")
    (path / "optimizer.pt").unlink()  # an adapter copied in by hand
    resumed = make_trainer()
    with caplog.at_level(logging.WARNING, logger="trainer_service.training"):
        resumed.resume(path)
    assert resumed.step_count == 1 and resumed.optimizer.state_dict()["state"] == {}
    assert f"{path} has no optimizer state" in caplog.text


def test_kl_to_the_base_is_zero_before_training_and_grows_after() -> None:
    trainer = make_trainer(kl_coef=0.5)
    first = trainer.step([group(trainer, (1.0, 0.0))])
    assert first["loss/kl"] == pytest.approx(0.0, abs=1e-7)  # LoRA B starts at 0: policy == base
    for _ in range(2):
        metrics = trainer.step([group(trainer, (1.0, 0.0))])
    assert metrics["loss/kl"] > 1e-6
    # loss/policy is the policy term alone, the one a trainer without the penalty reports on the same step
    without_kl = make_trainer()
    without_kl.restore(trainer.snapshot())
    groups = [group(trainer, (1.0, 0.0))]
    got, want = trainer.step(groups), without_kl.step(groups)
    assert got["loss/policy"] == pytest.approx(want["loss/policy"], rel=1e-5, abs=1e-7)
    assert got["loss/total"] > got["loss/policy"] and "loss/total" not in want


def test_sequence_level_importance_sampling_learns() -> None:
    trainer = make_trainer(importance_sampling="sequence", learning_rate=2e-3)

    def total(ids: list[int]) -> float:
        return sum(seq_logprobs(trainer, PROMPT + ids)[len(PROMPT) - 1 :])

    good0, bad0 = total(GOOD), total(BAD)
    for _ in range(3):
        metrics = trainer.step([group(trainer, (1.0, 0.0))])
    assert metrics["loss/ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    good1, bad1 = total(GOOD), total(BAD)
    assert good1 > good0 + 0.25, (good0, good1)  # measured: +0.59
    assert bad1 < bad0 - 0.5, (bad0, bad1)  # measured: -1.57


def test_sft_step_raises_the_best_completion() -> None:
    trainer = make_trainer(learning_rate=2e-3)
    before = sum(seq_logprobs(trainer, PROMPT + GOOD)[len(PROMPT) - 1 :])
    metrics = trainer.sft_step([group(trainer, (1.0, 0.0))])
    # mean NLL of GOOD's tokens under the policy before the update
    assert metrics["loss/sft"] == pytest.approx(-before / len(GOOD), rel=1e-4)
    assert metrics["kind/sft"] == 1.0 and trainer.step_count == 1
    assert sum(seq_logprobs(trainer, PROMPT + GOOD)[len(PROMPT) - 1 :]) > before


def test_snapshot_and_restore_undo_a_step() -> None:
    trainer = make_trainer()
    snap = trainer.snapshot()
    before = lora_params(trainer)
    trainer.step([group(trainer, (1.0, 0.0))])
    trainer.restore(snap)
    assert trainer.step_count == 0
    assert all(torch.equal(before[n], p) for n, p in lora_params(trainer).items())
    assert trainer.optimizer.state_dict()["state"] == {}
