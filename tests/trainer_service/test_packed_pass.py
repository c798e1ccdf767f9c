"""One training pass: packed log-probs equal each sequence's own, and the losses lay out each item's values."""

from __future__ import annotations

import pytest
import torch

from tests.trainer_service.builders import PROMPT, make_trainer
from trainer_service.batching import TrainItem, micro_batches
from trainer_service.grpo import policy_loss
from trainer_service.grpo_config import GRPOConfig
from trainer_service.packed_pass import grpo_pass_loss, pass_logprobs, sft_pass_loss


def item(ids: list[int], trained_from: int, advantage: float = 0.0, weight: float = 1.0,
         old: float = float("nan")) -> TrainItem:
    """An item whose predictions of tokens `trained_from`.. carry loss."""
    n = len(ids) - 1
    mask = torch.tensor([0.0] * (trained_from - 1) + [1.0] * (n - trained_from + 1))
    return TrainItem(token_ids=torch.tensor(ids), old_logprobs=torch.full((n,), old), mask=mask,
                     advantage=advantage, weight=weight)


def turns(ids: list[int], assistant: list[int], advantage: float = 0.0, weight: float = 1.0,
          old: float = float("nan")) -> TrainItem:
    """An item whose tokens with `assistant` 1 carry loss (as `prepare_grpo` builds it: the mask of tokens 1..)."""
    mask = torch.tensor(assistant[1:], dtype=torch.float32)
    return TrainItem(token_ids=torch.tensor(ids), old_logprobs=torch.full((len(ids) - 1,), old), mask=mask,
                     advantage=advantage, weight=weight)


# a tool-calling trajectory: the prompt, the assistant's call, the tool's result (not sampled), the assistant's answer
TOOL_CALL, TOOL_RESULT, ANSWER = [900, 901, 2], [1200, 1201, 1202], [902, 2]
TOOL_TURNS = turns(PROMPT + TOOL_CALL + TOOL_RESULT + ANSWER,
                   [0] * len(PROMPT) + [1] * len(TOOL_CALL) + [0] * len(TOOL_RESULT) + [1] * len(ANSWER))


def alone(model: torch.nn.Module, one: TrainItem) -> torch.Tensor:
    """`one`'s log-probs of its tokens 1.. from a forward of its own."""
    with torch.no_grad():
        logits = model(input_ids=one.token_ids.unsqueeze(0)).logits[0, :-1]
    return torch.log_softmax(logits.float(), -1).gather(-1, one.token_ids[1:, None])[:, 0]


@pytest.mark.parametrize("packs,shares_prefixes", [(True, True), (True, False), (False, False)])
def test_each_item_gets_its_own_log_probs_where_its_mask_is_on(packs: bool, shares_prefixes: bool) -> None:
    trainer = make_trainer()
    trainer.model.eval()
    items = [item(PROMPT + [900, 901, 2], len(PROMPT)), item(PROMPT + [1500, 2], len(PROMPT)),
             item([1, 77, 78, 79, 80], 2), TOOL_TURNS]  # the last: assistant, tool, assistant
    assert TOOL_TURNS.mask.tolist() == [0.0] * (len(PROMPT) - 1) + [1.0] * 3 + [0.0] * 3 + [1.0] * 2
    with torch.no_grad():
        got = pass_logprobs(trainer.model, items, packs=packs, shares_prefixes=shares_prefixes)
    assert got.shape == (sum(len(i.token_ids) - 1 for i in items),)
    for part, one in zip(got.split([len(i.token_ids) - 1 for i in items]), items, strict=True):
        on = one.mask.bool()
        assert torch.allclose(part[on], alone(trainer.model, one)[on], atol=1e-5)
        assert not part[~on].any()  # not computed where no loss reads it


def test_the_grpo_loss_repeats_each_items_advantage_and_weight_over_its_own_tokens() -> None:
    config = GRPOConfig(loss="ppo", epsilon=0.1, epsilon_high=0.3)  # clip range [0.9, 1.3]
    # item 0: 4 entries, trained at 1 and 3 (2 is a tool's result); item 1: 2 entries, both trained
    items = [turns([1, 2, 3, 4, 5], [0, 0, 1, 0, 1], advantage=1.5, weight=0.25, old=-1.0),
             item([1, 2, 3], 1, advantage=-0.5, weight=2.0, old=-2.0)]
    # ratios where trained: e^0.2 = 1.22 (A > 0, inside the range), e^-0.1 = 0.90; e^-0.15 = 0.86 (A < 0: clipped), 1.05
    new = torch.tensor([-9.0, -0.8, -7.0, -1.1, -2.15, -1.95])
    got = grpo_pass_loss(config, items, new)
    want = policy_loss("ppo", new, torch.tensor([-1.0, -1.0, -1.0, -1.0, -2.0, -2.0]),
                       torch.tensor([1.5, 1.5, 1.5, 1.5, -0.5, -0.5]), torch.tensor([0.0, 1.0, 0.0, 1.0, 1.0, 1.0]),
                       torch.tensor([0.25, 0.25, 0.25, 0.25, 2.0, 2.0]), epsilon=0.1, epsilon_high=0.3,
                       segments=torch.tensor([0, 0, 0, 0, 1, 1]))
    assert want.tokens == 4 and want.clipped_tokens == 1
    assert float(got.loss) == pytest.approx(float(want.loss))
    assert (got.tokens, got.clipped_tokens, got.ratio_sum) == (want.tokens, want.clipped_tokens, want.ratio_sum)


def test_the_sft_loss_is_the_weighted_negative_log_likelihood_of_the_trained_tokens() -> None:
    items = [turns([1, 2, 3, 4, 5], [0, 0, 1, 0, 1], weight=0.5), item([1, 2, 3], 1, weight=2.0)]
    new = torch.tensor([-9.0, -1.0, -7.0, -2.0, -0.5, -0.25])  # -9 and -7: a prompt and a tool result token
    got = sft_pass_loss(items, new)
    assert float(got.loss) == pytest.approx(0.5 * (1.0 + 2.0) + 2.0 * (0.5 + 0.25))
    assert got.tokens == 4.0


def edge_items() -> list[TrainItem]:
    """Edge shapes: one token, two, only the last token trained, trained from token 1, around the batched
    attention's `_SHORT_KEYS` (192), a prompt of 150 shared by the next two, and nothing trained."""
    generator = torch.Generator().manual_seed(3)

    def ids(n: int) -> list[int]:
        return torch.randint(0, 49152, (n,), generator=generator).tolist()

    prompt = ids(150)
    return [item(ids(1), 1), item(ids(2), 1), turns(ids(193), [0] * 192 + [1]), item(ids(192), 1),
            item(prompt + ids(42), 150), item(prompt + ids(43), 151), item(ids(2), 2)]


@pytest.mark.parametrize("shares_prefixes,pass_tokens", [(True, 4096), (False, 4096), (True, 2)],
                         ids=["one-pass-shared", "one-pass", "one-item-per-pass"])
def test_edge_shapes_get_the_log_probs_and_lora_gradients_of_each_item_alone(shares_prefixes: bool,
                                                                             pass_tokens: int) -> None:
    trainer = make_trainer()
    trainer.model.eval()
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():  # a trained adapter: every LoRA weight gets a gradient
        for name, param in trainer.model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05, generator=generator)
    items, lora = edge_items(), [p for p in trainer.model.parameters() if p.requires_grad]
    got, base = [], []
    for chunk in micro_batches(items, 8, pass_tokens):  # 2 tokens: each item in a pass of its own
        new = pass_logprobs(trainer.model, chunk, packs=True, shares_prefixes=shares_prefixes)
        sft_pass_loss(chunk, new).loss.backward()
        got.append(new.detach())
        with torch.no_grad(), trainer.model.disable_adapter():  # the KL reference's pass
            base.append(pass_logprobs(trainer.model, chunk, packs=True, shares_prefixes=shares_prefixes))
    packed_grads = [p.grad.clone() for p in lora]
    trainer.model.zero_grad()
    sizes = [len(i.token_ids) - 1 for i in items]
    for part, base_part, one in zip(torch.cat(got).split(sizes), torch.cat(base).split(sizes), items, strict=True):
        torch.testing.assert_close(part, alone(trainer.model, one) * one.mask, atol=1e-5, rtol=1e-5)  # 0 off-mask
        with trainer.model.disable_adapter():
            torch.testing.assert_close(base_part, alone(trainer.model, one) * one.mask, atol=1e-5, rtol=1e-5)
        if one.mask.any():
            logits = trainer.model(input_ids=one.token_ids.unsqueeze(0)).logits[0, :-1]
            nll = torch.log_softmax(logits.float(), -1).gather(-1, one.token_ids[1:, None])[:, 0]
            sft_pass_loss([one], nll).loss.backward()
    for param, packed in zip(lora, packed_grads, strict=True):
        torch.testing.assert_close(packed, param.grad, atol=1e-5, rtol=1e-4)
