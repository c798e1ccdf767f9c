"""How a LoRATrainer step lays its sequences into forward passes (packed micro-batches, a group's shared prompt
once, one sequence at a time for a model that attends across them) and in which dtypes it trains."""

from __future__ import annotations

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM

from tests.trainer_service.builders import (
    BAD,
    GOOD,
    PROMPT,
    adapter_gap,
    group,
    lora_params,
    make_trainer,
    seq_logprobs,
    tiny_model,
    uneven_groups,
)
from trainer_service.batching import TrainItem
from trainer_service.grpo_config import GRPOConfig
from trainer_service.packed_pass import pass_logprobs
from trainer_service.training import (
    LoRATrainer,
)


@pytest.mark.parametrize(("kind", "overrides"), [
    ("grpo", {"kl_coef": 0.1}), ("grpo", {"importance_sampling": "sequence", "loss": "cispo"}), ("sft", {})])
def test_packed_micro_batches_take_the_one_sequence_step(kind: str, overrides: dict[str, object]) -> None:
    packed, alone = make_trainer(micro_batch_size=4, **overrides), make_trainer(micro_batch_size=1, **overrides)
    assert packed.packs
    groups = uneven_groups(alone)
    alone.step(groups)  # then the logprobs are off policy: ratios differ per token and per sequence
    packed.restore(alone.snapshot())
    before = lora_params(alone)
    want, got = alone.train(groups, kind), packed.train(groups, kind)
    off, moved = adapter_gap(lora_params(packed), lora_params(alone), before)
    # float order only (measured up to 2.9e-4 of the move, with KL; a 1% learning-rate change: 1e-2)
    assert moved > 1e-3 and off < 1e-3 * moved, (off, moved)
    assert want.keys() == got.keys()
    for key, value in want.items():
        if not key.startswith("time/"):
            assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-7), key


def test_a_model_that_attends_across_packed_sequences_trains_one_sequence_at_a_time(
        caplog: pytest.LogCaptureFixture) -> None:
    model = tiny_model()
    forward = model.forward
    def forward_without_bounds(*args: object, position_ids: object = None, cu_seq_lens_q: object = None,
                               cu_seq_lens_k: object = None, art_prefix: object = None, art_batch: object = None,
                               **kwargs: object) -> object:
        return forward(*args, **kwargs)  # sees no sequence starts

    model.forward = forward_without_bounds
    with caplog.at_level("WARNING", logger="trainer_service.training"):
        trainer = LoRATrainer(model, GRPOConfig(learning_rate=5e-3, micro_batch_size=4, train_dtype="float32"))
    assert not trainer.packs and "attends across sequences packed into one row" in caplog.text
    reference = make_trainer(micro_batch_size=4)
    groups = uneven_groups(reference)
    before = lora_params(reference)
    want, got = reference.step(groups), trainer.step(groups)
    assert got["loss/policy"] == pytest.approx(want["loss/policy"], abs=1e-6)
    assert got["loss/ratio_mean"] == pytest.approx(1.0, abs=1e-5)  # packed, its logprobs would be off
    off, moved = adapter_gap(lora_params(trainer), lora_params(reference), before)
    assert moved > 1e-3 and off < 1e-3 * moved, (off, moved)


@pytest.mark.parametrize(("overrides", "passes"), [({}, 1), ({"micro_batch_size": 1}, 6), ({"micro_batch_size": 4}, 2),
                                                   ({"micro_batch_size": 4, "micro_batch_tokens": 12}, 6)])
def test_a_step_runs_one_forward_per_micro_batch(overrides: dict[str, object], passes: int) -> None:
    trainer = make_trainer(**overrides)
    groups = uneven_groups(trainer)  # six sequences of 9 to 13 tokens
    forwards = []
    trainer.model.base_model.model.register_forward_pre_hook(lambda *_: forwards.append(1))
    trainer.step(groups)
    assert len(forwards) == passes


def test_bf16_base_weights_train_an_fp32_adapter() -> None:
    trainer = make_trainer(train_dtype="bfloat16", learning_rate=2e-3)
    base = [p for n, p in trainer.model.named_parameters() if "lora_" not in n]
    adapter = [p for n, p in trainer.model.named_parameters() if "lora_" in n]
    assert {p.dtype for p in base} == {torch.bfloat16} and {p.dtype for p in adapter} == {torch.float32}

    def total(ids: list[int]) -> float:
        return sum(seq_logprobs(trainer, PROMPT + ids)[len(PROMPT) - 1 :])

    good0 = total(GOOD)
    metrics = trainer.step([group(trainer, (1.0, 0.0))])
    # on-policy up to bf16 rounding: the engine's logprobs here come from an unpacked forward
    assert metrics["loss/ratio_mean"] == pytest.approx(1.0, abs=2e-2)
    for _ in range(3):
        trainer.step([group(trainer, (1.0, 0.0))])
    assert total(GOOD) > good0 + 0.5
    assert all(state["exp_avg"].dtype == torch.float32 for state in trainer.optimizer.state.values())


def test_train_dtype_auto_follows_the_hardware() -> None:
    assert GRPOConfig(train_dtype="float32").torch_dtype() == torch.float32
    assert GRPOConfig(train_dtype="bfloat16").torch_dtype() == torch.bfloat16
    native = torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()
    want = torch.bfloat16 if torch.cuda.is_available() or native else torch.float32
    assert GRPOConfig(train_dtype="auto").torch_dtype() == want


def test_a_group_trains_its_shared_prompt_once() -> None:
    trainer = make_trainer(micro_batch_size=4)
    assert trainer.shares_prefixes
    groups = [group(trainer, (1.0, 0.0))]
    rows: list[int] = []
    trainer.model.base_model.model.register_forward_pre_hook(
        lambda _module, args, kwargs: rows.append(kwargs["input_ids"].shape[1]), with_kwargs=True)
    trainer.step(groups)
    # PROMPT + GOOD and PROMPT + BAD: the prompt once, then each completion from the prompt's last token on
    assert rows == [len(PROMPT) - 1 + 1 + len(GOOD) + 1 + len(BAD)]


def test_a_model_without_the_attention_interface_keeps_its_own(caplog: pytest.LogCaptureFixture) -> None:
    model = tiny_model()

    def refuse(name: str) -> None:
        raise ValueError(f"{name} is not supported")

    model.set_attn_implementation = refuse  # type: ignore[method-assign]
    with caplog.at_level("WARNING", logger="trainer_service.training"):
        trainer = LoRATrainer(model, GRPOConfig(learning_rate=5e-3, train_dtype="float32"))
    assert "keeps its own attention" in caplog.text
    assert trainer.packs and not trainer.shares_prefixes  # sdpa with position_ids still packs
    reference = make_trainer()
    groups = uneven_groups(reference)
    assert trainer.step(groups)["loss/policy"] == pytest.approx(reference.step(groups)["loss/policy"], abs=1e-6)


def test_a_sliding_window_model_keeps_its_own_attention(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(vocab_size=1000, hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             sliding_window=4))
    with caplog.at_level("WARNING", logger="trainer_service.training"):
        trainer = LoRATrainer(model, GRPOConfig(train_dtype="float32"))
    assert "does not compute sliding_window" in caplog.text
    assert trainer.packs and not trainer.shares_prefixes  # its own attention packs by position_ids
    trainer.model.eval()
    first, second = torch.arange(1, 10), torch.arange(20, 32)  # both longer than the window
    items = [TrainItem(ids, torch.zeros(ids.numel() - 1), torch.ones(ids.numel() - 1), 1.0, 1.0)
             for ids in (first, second)]
    with torch.no_grad():
        got = pass_logprobs(trainer.model, items, packs=trainer.packs, shares_prefixes=trainer.shares_prefixes)
        model.set_attn_implementation("eager")
        logits = trainer.model(input_ids=second.unsqueeze(0)).logits[0, :-1]
    want = torch.log_softmax(logits, -1).gather(-1, second[1:, None])[:, 0]
    torch.testing.assert_close(got[first.numel() - 1 :], want, atol=1e-5, rtol=1e-5)
