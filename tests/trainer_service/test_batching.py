"""Batch preparation: skipped inputs are counted, lengths follow the policy, masks are exact."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from collector.protocol import Group, Sequence, Trajectory
from tests.trainer_service.builders import BAD, GOOD, PROMPT, group, make_trainer, trajectory
from trainer_service.base_model import resolve_base_model
from trainer_service.batching import (
    VLLM_LOGPROB_FLOOR,
    NothingTrainableError,
    TrainItem,
    micro_batches,
    prepare_grpo,
    prepare_sft,
    shard_items,
)
from trainer_service.config import BUNDLED_TOOL_TEMPLATE
from trainer_service.grpo_config import GRPOConfig
from trainer_service.retokenize import RetokenizeError, render_with_assistant_mask

CPU = torch.device("cpu")

TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers",
                                           "parameters": {"type": "object", "properties": {"a": {"type": "number"},
                                                                                          "b": {"type": "number"}}}}}]
CONVERSATION = [
    {"role": "system", "content": "You add numbers."},
    {"role": "user", "content": "What is 2+3?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "5"},
    {"role": "assistant", "content": "The sum is 5."},
    {"role": "user", "content": "And 1+1?"},
    {"role": "assistant", "content": "2"},
]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    tok = AutoTokenizer.from_pretrained(resolve_base_model("SmolLM2-135M-Instruct"))
    tok.chat_template = BUNDLED_TOOL_TEMPLATE.read_text()  # the template vLLM serves the bundled model with
    return tok


def test_nonfinite_rewards_are_skipped_and_counted() -> None:
    trainer = make_trainer()
    g = group(trainer, (1.0, 0.0))
    poisoned = g.model_copy(deep=True)
    extra = poisoned.trajectories[0].model_copy(update={"id": "nan", "reward": math.nan})
    inf = poisoned.trajectories[1].model_copy(update={"id": "inf", "reward": math.inf})
    poisoned.trajectories += [extra, inf]
    batch = prepare_grpo([poisoned], trainer.config, CPU)
    assert batch.stats["data/skipped/nonfinite_rewards"] == 2
    assert batch.stats["data/trajectories"] == 2 and batch.stats["reward/mean"] == 0.5
    only_nan = g.model_copy(deep=True)
    only_nan.trajectories[1].reward = math.nan
    with pytest.raises(NothingTrainableError, match="nonfinite_rewards=1"):
        prepare_grpo([only_nan], trainer.config, CPU)


def test_malformed_sequences_skip_their_trajectory_not_the_batch(caplog: pytest.LogCaptureFixture) -> None:
    trainer = make_trainer()
    short, flipped = group(trainer, (1.0, 0.0), "short"), group(trainer, (1.0, 0.0), "flipped")
    short.trajectories[0].sequences[0].logprobs.pop()  # one log-prob fewer than tokens
    flipped.trajectories[1].sequences[0].assistant_mask[-1] = -1  # would flip the sign of that token's loss
    batch = prepare_grpo([group(trainer, (1.0, 0.0), "ok"), short, flipped], trainer.config, CPU)
    assert batch.stats["data/skipped/malformed_trajectories"] == 2 and batch.stats["data/groups_trained"] == 1
    assert batch.stats["data/skipped/too_few_trajectories"] == 2 and len(batch.items) == 2
    assert "trajectory short-a of group g is skipped (malformed_trajectories): sequence 0 has token_ids (10), " \
        "logprobs (9)" in caplog.text and "assistant_mask value other than 0 and 1: [-1]" in caplog.text
    with pytest.raises(NothingTrainableError, match="malformed_trajectories=1"):  # SFT's best one is malformed
        prepare_sft([short], trainer.config, CPU)


def test_token_ids_outside_the_models_vocabulary_skip_their_trajectory(caplog: pytest.LogCaptureFixture) -> None:
    """An app pointed at another model's engine: its ids failed the embedding lookup of the whole step, which
    charged every group of the batch a failed attempt."""
    trainer = make_trainer()
    vocab = trainer.model.get_input_embeddings().num_embeddings
    foreign = group(trainer, (1.0, 0.0), "foreign")
    foreign.trajectories[0].sequences[0].token_ids[-1] = vocab  # one past the last embedding
    metrics = trainer.step([group(trainer, (1.0, 0.0), "ok"), foreign])
    assert metrics["data/skipped/malformed_trajectories"] == 1 and metrics["data/groups_trained"] == 1
    assert f"outside the model's vocabulary (0 to {vocab - 1})" in caplog.text

def test_rewards_equal_up_to_float_rounding_have_no_spread() -> None:
    trainer = make_trainer()
    for scale in (1.0, 1e10):  # 1e10: the rounding noise alone gave advantages of ±0.57
        noisy = group(trainer, (scale * (0.1 + 0.2 + 0.3), scale * (0.3 + 0.2 + 0.1)))
        assert noisy.trajectories[0].reward != noisy.trajectories[1].reward
        with pytest.raises(NothingTrainableError, match=r"in 1 group\(s\): no_reward_spread=1\. "):
            prepare_grpo([noisy], trainer.config, CPU)  # and no other reason named, not even at 0
    small = prepare_grpo([group(trainer, (1.0, 1.0 + 1e-9))], GRPOConfig(scale_rewards=False), CPU)
    assert small.stats["data/groups_trained"] == 1  # a difference beyond rounding still trains


def test_long_sequences_truncate_or_skip() -> None:
    trainer = make_trainer()
    g = group(trainer, (1.0, 0.0))
    limit = len(PROMPT) + len(BAD)  # the GOOD trajectory is one token longer
    cut = prepare_grpo([g], GRPOConfig(max_seq_len=limit), CPU)
    assert cut.stats["data/truncated_sequences"] == 1
    assert sorted(int(i.token_ids.numel()) for i in cut.items) == [limit, limit]
    with pytest.raises(NothingTrainableError, match="too_long_sequences=1") as info:
        prepare_grpo([g], GRPOConfig(max_seq_len=limit, max_seq_len_policy="skip"), CPU)
    assert "no_assistant_tokens" not in str(info.value)  # one dropped trajectory, one reason


def test_advantages_and_reward_stats_cover_only_the_trajectories_trained() -> None:
    trainer = make_trainer()
    g = group(trainer, (1.0, 0.0))
    g.trajectories.append(trajectory(trainer, BAD, 0.5, "g-c"))
    skip = GRPOConfig(max_seq_len=len(PROMPT) + len(BAD), max_seq_len_policy="skip")  # GOOD (reward 1) is too long
    batch = prepare_grpo([g], skip, CPU)
    # rewards 0 and 0.5 are trained: advantages ±1 and the stats of those two, not of [1, 0, 0.5]
    assert [round(i.advantage, 4) for i in batch.items] == [-1.0, 1.0]
    assert batch.stats["reward/mean"] == 0.25 and batch.stats["reward/std"] == 0.25
    assert batch.stats["data/trajectories"] == 2 and batch.stats["data/skipped/too_long_sequences"] == 1
    assert "data/skipped/no_assistant_tokens" not in batch.stats
    # rewards [1, 0, 0] with the 1 dropped: the two left share a reward, so nothing trains
    g.trajectories[2].reward = 0.0
    with pytest.raises(NothingTrainableError, match="no_reward_spread=1, too_long_sequences=1. ") as info:
        prepare_grpo([g], skip, CPU)
    assert "no_assistant_tokens" not in str(info.value)


def test_a_trajectory_truncated_to_its_prompt_is_left_out_before_the_advantages() -> None:
    trainer = make_trainer()
    g = group(trainer, (1.0, 0.0))
    long_prompt = trajectory(trainer, BAD, 0.9, "g-c")
    seq, pad = long_prompt.sequences[0], 10
    seq.token_ids = PROMPT + [5] * pad + BAD
    seq.logprobs = [None] * (len(PROMPT) + pad) + seq.logprobs[len(PROMPT):]
    seq.assistant_mask = [0] * (len(PROMPT) + pad) + [1] * len(BAD)
    g.trajectories.append(long_prompt)
    batch = prepare_grpo([g], GRPOConfig(max_seq_len=len(PROMPT) + len(GOOD)), CPU)  # cut inside its prompt
    assert batch.stats["data/truncated_sequences"] == 1 and batch.stats["data/skipped/no_assistant_tokens"] == 1
    assert [round(i.advantage, 4) for i in batch.items] == [1.0, -1.0]  # rewards 1 and 0, not [1, 0, 0.9]
    assert batch.stats["reward/mean"] == 0.5 and batch.stats["data/trajectories"] == 2


def test_rewards_beyond_float32_scale_to_finite_advantages_or_are_counted() -> None:
    trainer = make_trainer()
    huge = group(trainer, (1e39, 0.0))
    batch = prepare_grpo([huge], trainer.config, CPU)
    assert [round(i.advantage, 4) for i in batch.items] == [1.0, -1.0]
    assert batch.stats["reward/mean"] == pytest.approx(5e38) and math.isfinite(batch.stats["advantage/std"])
    # unscaled, an advantage of 5e38 does not fit float32: the group is left out and counted
    with pytest.raises(NothingTrainableError, match="nonfinite_advantages=1"):
        prepare_grpo([huge], GRPOConfig(scale_rewards=False), CPU)


@pytest.mark.parametrize(("rewards", "mean", "std"), [((1e308, 1.7e308), 1.35e308, 3.5e307),
                                                     ((-1.7e308, 1.7e308), 0.0, 1.7e308),
                                                     ((1.5e308, 0.0), 7.5e307, 7.5e307)])
def test_reward_stats_of_rewards_near_float64s_limit_are_their_true_values(
        rewards: tuple[float, float], mean: float, std: float) -> None:
    """Summing or squaring them overflows; the stats themselves fit in float64, and training takes the group."""
    trainer = make_trainer()
    stats = prepare_grpo([group(trainer, rewards)], trainer.config, CPU).stats
    assert stats["reward/mean"] == pytest.approx(mean) and stats["reward/std"] == pytest.approx(std)
    best = [group(trainer, (reward, reward), f"g{i}") for i, reward in enumerate(rewards)]  # SFT: one per group
    stats = prepare_sft(best, trainer.config, CPU).stats
    assert stats["reward/mean"] == pytest.approx(mean) and stats["reward/std"] == pytest.approx(std)


@pytest.mark.parametrize("placeholder", [-math.inf, VLLM_LOGPROB_FLOOR])
def test_infinite_engine_logprobs_are_missing(placeholder: float) -> None:
    trainer = make_trainer()
    g = group(trainer, (1.0, 0.0))
    seq = g.trajectories[0].sequences[0]
    seq.logprobs = [*seq.logprobs[:-3], -50.0, placeholder, seq.logprobs[-1]]
    item = prepare_grpo([g], trainer.config, CPU).items[0]
    assert math.isnan(float(item.old_logprobs[-2])) and not item.old_logprobs[-1].isnan()
    assert float(item.old_logprobs[-3]) == -50.0  # a very unlikely token is still a log-prob
    assert prepare_grpo([g], trainer.config, CPU).stats["data/missing_logprobs"] == 1


def test_positive_engine_logprobs_are_missing() -> None:
    """A log-prob above 0 is no probability: kept, its ratio exp(new - old) shrank the token's gradient to nothing,
    unreported."""
    trainer = make_trainer()
    g = group(trainer, (1.0, 0.0))
    seq = g.trajectories[0].sequences[0]
    seq.logprobs = [*seq.logprobs[:-3], 0.0, 3.5, seq.logprobs[-1]]
    batch = prepare_grpo([g], trainer.config, CPU)
    old = batch.items[0].old_logprobs
    assert math.isnan(float(old[-2])) and float(old[-3]) == 0.0  # certainty (log 1) is still a log-prob
    assert batch.stats["data/missing_logprobs"] == 1


def test_missing_logprobs_count_only_the_tokens_that_train() -> None:
    trainer = make_trainer()
    flat = group(trainer, (0.5, 0.5), "flat")  # no reward spread: left out
    for t in flat.trajectories:
        t.sequences[0].logprobs = [None] * len(t.sequences[0].logprobs)  # an engine that returned no log-probs
    batch = prepare_grpo([group(trainer, (1.0, 0.0), "ok"), flat], trainer.config, CPU)
    assert batch.stats["data/skipped/no_reward_spread"] == 1 and batch.stats["data/missing_logprobs"] == 0
    flat.trajectories[0].reward = 1.0  # now it trains, on-policy: all 7 of its assistant tokens
    assert prepare_grpo([flat], trainer.config, CPU).stats["data/missing_logprobs"] == len(GOOD) + len(BAD)


def test_advantage_stats_are_reported() -> None:
    trainer = make_trainer()
    stats = prepare_grpo([group(trainer, (1.0, 0.0))], trainer.config, CPU).stats
    assert (stats["advantage/max"] == pytest.approx(1.0, abs=1e-5)
            and stats["advantage/min"] == pytest.approx(-1.0, abs=1e-5))
    assert stats["advantage/mean"] == pytest.approx(0.0, abs=1e-6)


def test_sft_takes_the_best_of_each_group() -> None:
    trainer = make_trainer()
    batch = prepare_sft([group(trainer, (0.2, 0.9), "a"), group(trainer, (0.5, 0.5), "b")], trainer.config, CPU)
    # group a: BAD (0.9) wins; group b: a tie keeps the first (GOOD)
    assert [i.token_ids.tolist()[len(PROMPT):] for i in batch.items] == [BAD, GOOD]
    assert batch.stats["reward/chosen_mean"] == pytest.approx(0.7)
    assert batch.stats["reward/mean"] == pytest.approx(0.525)  # every reward of the groups: 0.2, 0.9, 0.5, 0.5


def test_sft_reward_stats_are_those_of_a_grpo_step_on_the_same_groups() -> None:
    """They were the chosen trajectories' (0.95 here, against GRPO's 0.525): the reward curve stepped up after a
    warm start, and `--keep-best-metric reward/mean` favoured SFT steps."""
    trainer = make_trainer()
    groups = [group(trainer, (0.2, 0.9), "a"), group(trainer, (0.0, 1.0), "b")]
    grpo, sft = (prepare(groups, trainer.config, CPU).stats for prepare in (prepare_grpo, prepare_sft))
    assert sft["reward/mean"] == grpo["reward/mean"] and sft["reward/std"] == grpo["reward/std"]
    assert sft["reward/chosen_mean"] == pytest.approx(0.95) and "reward/chosen_mean" not in grpo


def test_sft_ties_up_to_float_rounding_keep_the_first() -> None:
    """0.3 + 0.2 + 0.1 and 0.1 + 0.2 + 0.3 are one reward by `has_reward_spread`'s rule: the first recorded trains,
    not the later one rounding made larger by 1e-16."""
    trainer = make_trainer()
    first, later = 0.3 + 0.2 + 0.1, 0.1 + 0.2 + 0.3
    assert later > first
    batch = prepare_sft([group(trainer, (first, later))], trainer.config, CPU)
    assert [i.token_ids.tolist()[len(PROMPT):] for i in batch.items] == [GOOD]
    assert batch.stats["reward/chosen_mean"] == first


def test_sft_leaves_out_a_group_whose_best_cannot_train() -> None:
    trainer = make_trainer()
    g = group(trainer, (1.0, 0.0))
    g.trajectories[0].sequences[0].assistant_mask = [0] * len(PROMPT + GOOD)  # the best; the other could train
    # the message said a rewarded trajectory with assistant tokens was needed, which this group has
    with pytest.raises(NothingTrainableError, match=r"no_assistant_tokens=1\. SFT needs a group whose "
                       "best-rewarded trajectory has assistant tokens"):
        prepare_sft([g], trainer.config, CPU)


def test_retokenized_mask_covers_exactly_the_assistant_turns(tokenizer: PreTrainedTokenizerBase) -> None:
    ids, mask, *_ = render_with_assistant_mask(tokenizer, CONVERSATION, TOOLS)
    assert len(ids) == len(mask)
    # the masked tokens, run by run, are exactly the three assistant turns as the template renders them
    runs, current = [], []
    for token, m in zip(ids, mask, strict=True):
        if m:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    if current:
        runs.append(tokenizer.decode(current))
    assert runs == [
        '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>',
        "The sum is 5.<|im_end|>",
        "2<|im_end|>",
    ]
    unmasked = tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if not m])
    for text in ("You add numbers.", "What is 2+3?", "<tool_response>\n5\n</tool_response>", "And 1+1?",
                 '"name": "add"'):
        assert text in unmasked  # prompts, tool definitions and tool results carry no loss


def test_an_assistant_message_that_opens_the_conversation_is_not_trained(tokenizer: PreTrainedTokenizerBase) -> None:
    # it was masked from the text's start: the template's default system prompt and role header trained with it
    greeting = [{"role": "assistant", "content": "Hi, how can I help?"}, {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4"}]
    ids, mask, *_ = render_with_assistant_mask(tokenizer, greeting)
    assert tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m]) == "4<|im_end|>"
    with pytest.raises(RetokenizeError, match="no assistant message after its first message"):
        render_with_assistant_mask(tokenizer, greeting[:2])


def test_retokenized_tool_calls_render_their_arguments_as_vllm_does(tokenizer: PreTrainedTokenizerBase) -> None:
    # vLLM parses an `arguments` string into an object before the template renders it with `tojson`
    def conversation(arguments: str | dict) -> list[dict]:
        return [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": arguments}}]}]

    compact, served = conversation('{"a":2,"b":3}'), conversation({"a": 2, "b": 3})
    ids, mask, *_ = render_with_assistant_mask(tokenizer, compact, TOOLS)
    assert (ids, mask) == render_with_assistant_mask(tokenizer, served, TOOLS)[:2]
    assert tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m]) == (
        '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>')
    assert compact[1]["tool_calls"][0]["function"]["arguments"] == '{"a":2,"b":3}'  # the caller's messages are kept


@pytest.mark.parametrize("arguments", ["not json", '{"a": 2, "b', "1" * 5000, "[" * 100_000])  # past 4300 digits
# and nesting past the recursion limit: `json.loads` raises ValueError / RecursionError, which escaped the skip
def test_retokenize_refuses_tool_call_arguments_that_are_not_json(
        tokenizer: PreTrainedTokenizerBase, arguments: str, caplog: pytest.LogCaptureFixture) -> None:
    # they trained as rendered raw (`"arguments": not json}`), which vLLM's parser never returns as a call and vLLM
    # renders as `{}` in later prompts: the tokens sampled for that turn are unknown
    odd = [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": arguments}}]}]
    with pytest.raises(RetokenizeError, match="message 1 has a tool call 'add' whose arguments are not JSON"):
        render_with_assistant_mask(tokenizer, odd, TOOLS)
    hello = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    groups = [Group(id="g", trajectories=[
        Trajectory(id=tid, trace_id="1" * 32, group_id="g", token_exact=False, messages=messages, tools=TOOLS,
                   reward=reward)
        for tid, messages, reward in (("a", hello, 1.0), ("b", hello, 0.0), ("c", odd, 0.5))])]
    batch = prepare_grpo(groups, GRPOConfig(), CPU, tokenizer)
    assert batch.stats["data/skipped/retokenize_failed"] == 1 and batch.stats["data/trajectories"] == 2
    assert "trajectory c of group g is skipped (retokenize_failed)" in caplog.text


@pytest.mark.parametrize("verbatim", [True, False], ids=["bundled", "tojson"])
@pytest.mark.parametrize("arguments", ["[1, 2]", "3", "null", '"{\\"a\\": 2}"'])
def test_retokenized_tool_call_arguments_that_are_json_but_no_object_train_as_sampled(
        tokenizer: PreTrainedTokenizerBase, arguments: str, verbatim: bool) -> None:
    # vLLM's hermes parser returns `[1, 2]` for a sampled `"arguments": [1,2]` (any JSON value, dumped): a template
    # writing every value with `tojson` (Qwen2.5's way) trained it as the string `"[1, 2]"`, never sampled
    template = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    template.chat_template = tokenizer.chat_template
    if not verbatim:  # the bundled template writes an `arguments` string as it is, other values with `tojson`
        written = "fn['arguments'] if fn['arguments'] is string else (fn['arguments'] | tojson)"
        assert written in template.chat_template
        template.chat_template = template.chat_template.replace(written, "fn['arguments'] | tojson")
    call = [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": arguments}}]}]
    ids, mask, *_ = render_with_assistant_mask(template, call, TOOLS)
    assert template.decode([t for t, m in zip(ids, mask, strict=True) if m]) == (
        '<tool_call>\n{"name": "add", "arguments": ' + arguments + '}\n</tool_call><|im_end|>')


@pytest.mark.parametrize("arguments", [[1, 2], 3, [], False])
def test_retokenize_refuses_tool_call_arguments_that_are_neither_json_text_nor_an_object(
        tokenizer: PreTrainedTokenizerBase, arguments: object) -> None:
    # they trained as rendered (`[1, 2]`, or `{}` where empty), yet vLLM's parser returns arguments as JSON text
    # only (its API refuses other values) and vLLM renders them as `{}` in later prompts: the sampled tokens are unknown
    odd = [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": arguments}}]}]
    with pytest.raises(RetokenizeError, match=f"message 1 has a tool call 'add' whose arguments are of type "
                       f"{type(arguments).__name__}, neither JSON text nor an object"):
        render_with_assistant_mask(tokenizer, odd, TOOLS)


@pytest.mark.parametrize("reply", ["\n\nSure.", "  Sure.", "\n Sure.", "\t\nSure.", " Sure.", "\nSure."])
def test_a_reply_opening_with_whitespace_trains_the_tokens_sampled_after_the_header(
        tokenizer: PreTrainedTokenizerBase, reply: str, caplog: pytest.LogCaptureFixture) -> None:
    # SmolLM2's tokenizer merged the reply's first whitespace with the header's newline (`assistant\n` + `\nSure`
    # gave one `\n\n` token): that token was left out of the mask, so the reply trained without it
    caplog.set_level("INFO", logger="trainer_service.retokenize")
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": reply},
                {"role": "user", "content": "again"}, {"role": "assistant", "content": reply}]
    ids, mask, *_ = render_with_assistant_mask(tokenizer, messages)
    sampled = tokenizer(reply + "<|im_end|>", add_special_tokens=False)["input_ids"]  # the engine's, after the header
    assert [t for t, m in zip(ids, mask, strict=True) if m] == sampled * 2
    prompt = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]  # as the engine tokenized the first prompt
    assert ids[:len(prompt_ids) + len(sampled)] == prompt_ids + sampled
    header = tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    second = len(ids) - mask[::-1].index(1) - len(sampled)  # where the second reply's tokens start
    assert ids[second - len(header):second] == header and mask[second - 1] == 0
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(messages, tokenize=False)  # no text lost
    together = tokenizer("<|im_start|>assistant\n" + reply, add_special_tokens=False)["input_ids"]
    merged = together != header + sampled[:-1]  # the header's newline and the reply's whitespace shared a token
    assert ("re-tokenized apart at 2 assistant message edge(s)" in caplog.text) == merged  # counted where it merged


def test_the_edges_a_reply_is_tokenized_apart_at_are_counted_per_step(tokenizer: PreTrainedTokenizerBase) -> None:
    # each cut was only logged: a step's metrics did not say how many replies trained apart from the later prompts
    hello = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    merging = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "\n\nSure"}]
    assert render_with_assistant_mask(tokenizer, merging).split_edges == 1
    assert render_with_assistant_mask(tokenizer, hello).split_edges == 0
    groups = [Group(id="g", trajectories=[
        Trajectory(id=tid, trace_id="1" * 32, group_id="g", token_exact=False, messages=messages, reward=reward)
        for tid, messages, reward in (("a", hello, 1.0), ("b", merging, 0.0))])]
    assert prepare_grpo(groups, GRPOConfig(), CPU, tokenizer).stats["data/retokenize_split_edges"] == 1
    assert prepare_sft(groups, GRPOConfig(), CPU, tokenizer).stats["data/retokenize_split_edges"] == 0  # `hello` only


def test_tool_call_arguments_that_are_json_but_no_object_are_counted_per_step(
        tokenizer: PreTrainedTokenizerBase) -> None:
    # they train as vLLM's parser returns them, where vLLM writes `{}` in later prompts: no step's metrics said so
    def calls(*arguments: str) -> dict:
        return {"role": "assistant", "content": None, "tool_calls": [
            {"id": f"c{i}", "type": "function", "function": {"name": "add", "arguments": value}}
            for i, value in enumerate(arguments)]}

    question = {"role": "user", "content": "2+3?"}
    plain = [question, calls('{"a": 2}', "")]
    odd = [calls("[0]"), question, calls("[1, 2]", '{"b": 3}', "null"), {"role": "tool", "tool_call_id": "c0",
                                                                          "content": "5"}, calls('"3"')]
    assert render_with_assistant_mask(tokenizer, plain, TOOLS).non_object_arguments == 0
    assert render_with_assistant_mask(tokenizer, odd, TOOLS).non_object_arguments == 3  # not message 0's: untrained
    groups = [Group(id="g", trajectories=[
        Trajectory(id=tid, trace_id="1" * 32, group_id="g", token_exact=False, messages=messages, tools=TOOLS,
                   reward=reward)
        for tid, messages, reward in (("a", plain, 1.0), ("b", odd, 0.0))])]
    assert prepare_grpo(groups, GRPOConfig(), CPU, tokenizer).stats["data/retokenize_non_object_arguments"] == 3
    assert prepare_sft(groups, GRPOConfig(), CPU, tokenizer).stats["data/retokenize_non_object_arguments"] == 0


@pytest.mark.parametrize("arguments", ["", None])
def test_retokenized_tool_calls_without_arguments_render_an_empty_object_as_vllm_does(
        tokenizer: PreTrainedTokenizerBase, arguments: str | None) -> None:
    # vLLM renders a call with no arguments as `{}`; the text itself trained `"arguments": }` or `"arguments": null`
    def conversation(value: str | dict | None) -> list[dict]:
        return [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": value}}]}]

    ids, mask, *_ = render_with_assistant_mask(tokenizer, conversation(arguments), TOOLS)
    assert (ids, mask) == render_with_assistant_mask(tokenizer, conversation({}), TOOLS)[:2]
    assert tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m]) == (
        '<tool_call>\n{"name": "add", "arguments": {}}\n</tool_call><|im_end|>')


def test_retokenized_content_parts_render_as_vllm_hands_them_to_the_template(
        tokenizer: PreTrainedTokenizerBase) -> None:
    # a template that does not loop over content parts gets their texts joined by newlines from vLLM; a Llama-3-like
    # `| trim` rendered (and trained) the parts' Python text, SmolLM2's own template failed on them
    trim = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    trim.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n"
                          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    own = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    parts = [{"role": "user", "content": [{"type": "text", "text": "2+3?"}, "Reply briefly."]},
             {"role": "assistant", "content": [{"type": "text", "text": "5"}, {"type": "refusal", "refusal": "no"}]}]
    joined = [{"role": "user", "content": "2+3?\nReply briefly."}, {"role": "assistant", "content": "5\nno"}]
    for template in (trim, own):
        ids, mask, *_ = render_with_assistant_mask(template, parts)
        assert (ids, mask) == render_with_assistant_mask(template, joined)[:2]
        assert template.decode([t for t, m in zip(ids, mask, strict=True) if m]) == "5\nno<|im_end|>"
    # the bundled template renders parts itself (vLLM passes them on, each a text part): it joins them without newlines
    ids, mask, *_ = render_with_assistant_mask(tokenizer, parts)
    assert tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m]) == "5no<|im_end|>"
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/cat.png"}}]},
             {"role": "assistant", "content": "a cat"}]
    for template in (trim, tokenizer):  # the image was silently left out of the bundled template's rendering
        with pytest.raises(RetokenizeError, match="message 0 has a content part of type 'image_url'"):
            render_with_assistant_mask(template, image)
    odd = [{"role": "user", "content": [{"type": ["text"], "text": "hi"}]}, {"role": "assistant", "content": "a"}]
    with pytest.raises(RetokenizeError, match=r"content part of type \['text'\] without text"):  # foreign data
        render_with_assistant_mask(tokenizer, odd)


def test_retokenized_mask_ends_at_an_end_of_turn_token_that_is_not_eos(tokenizer: PreTrainedTokenizerBase) -> None:
    # a Gemma-like template: turns end with a special token other than eos (here <|endoftext|>; eos is <|im_end|>),
    # then a newline the model never samples
    gemma_like = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    gemma_like.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|endoftext|>\n"
                                "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    messages = [{"role": "user", "content": "What is 2+3?"}, {"role": "assistant", "content": "5"}]
    ids, mask, *_ = render_with_assistant_mask(gemma_like, messages)
    masked = [token for token, m in zip(ids, mask, strict=True) if m]
    assert gemma_like.decode(masked) == "5<|endoftext|>"
    assert gemma_like.decode(ids[len(ids) - 1:]) == "\n" and mask[-1] == 0


def test_foreign_trajectories_are_retokenized_and_counted(tokenizer: PreTrainedTokenizerBase) -> None:
    def foreign(tid: str, answer: str, reward: float) -> Trajectory:
        return Trajectory(id=tid, trace_id="1" * 32, group_id="f", token_exact=False, tools=TOOLS, reward=reward,
                          messages=[*CONVERSATION[:-1], {"role": "assistant", "content": answer}],
                          sequences=[Sequence(token_ids=[1, 2], logprobs=[None, None], assistant_mask=[0, 0])])

    group_ = Group(id="f", trajectories=[foreign("x", "2", 1.0), foreign("y", "3", 0.0)])
    batch = prepare_grpo([group_], GRPOConfig(), CPU, tokenizer)
    assert batch.stats["data/retokenized_trajectories"] == 2
    assert all(bool(torch.isnan(item.old_logprobs).all()) for item in batch.items)  # trained on-policy
    expected_ids, expected_mask, *_ = render_with_assistant_mask(tokenizer, group_.trajectories[0].messages, TOOLS)
    assert batch.items[0].token_ids.tolist() == expected_ids and batch.items[0].mask.tolist() == expected_mask[1:]
    with pytest.raises(NothingTrainableError, match="not_token_exact_without_tokenizer=2"):
        prepare_grpo([group_], GRPOConfig(), CPU, None)


def test_a_reply_cut_by_length_trains_no_end_of_turn_token(tokenizer: PreTrainedTokenizerBase) -> None:
    # the model hit max_tokens in "The sum" and did not end its turn; the next turn was sampled after <|im_end|>
    cut = [*CONVERSATION[:4], {"role": "assistant", "content": "The sum"}, *CONVERSATION[5:]]
    ids, mask, *_ = render_with_assistant_mask(tokenizer, cut, TOOLS, length_cut=[4])
    assert ids == render_with_assistant_mask(tokenizer, cut, TOOLS)[0]  # the token stays in the sequence
    assert tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m]) == (
        '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>The sum2<|im_end|>')

    def foreign(tid: str, reward: float, **fields: object) -> dict:
        return {"id": tid, "trace_id": "1" * 32, "group_id": "c", "token_exact": False, "tools": TOOLS,
                "reward": reward, "messages": cut, **fields}

    groups = [Group(id="c", trajectories=[Trajectory.model_validate(foreign("x", 1.0, length_cut=[4])),
                                          Trajectory.model_validate(foreign("y", 0.0))])]  # an older collector's
    x, y = prepare_grpo(groups, GRPOConfig(), CPU, tokenizer).items
    assert x.token_ids.tolist() == ids and x.mask.tolist() == mask[1:]
    assert int(y.mask.sum()) == int(x.mask.sum()) + 1  # without the field: trained as before


def test_retokenize_refuses_what_it_cannot_mask(tokenizer: PreTrainedTokenizerBase) -> None:
    with pytest.raises(RetokenizeError, match="no assistant message"):
        render_with_assistant_mask(tokenizer, CONVERSATION[:2])


def test_a_conversation_the_template_cannot_render_is_skipped_and_counted(
        tokenizer: PreTrainedTokenizerBase, caplog: pytest.LogCaptureFixture) -> None:
    def foreign(tid: str, gid: str, messages: list[dict], reward: float) -> Trajectory:
        return Trajectory(id=tid, trace_id="1" * 32, group_id=gid, token_exact=False, messages=messages, reward=reward)

    hello = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    nameless = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"arguments": "{}"}}]}]  # a foreign tool call without a name
    groups = [Group(id="ok", trajectories=[foreign("a", "ok", hello, 1.0), foreign("b", "ok", CONVERSATION, 0.0)]),
              Group(id="odd", trajectories=[foreign("c", "odd", nameless, 1.0), foreign("d", "odd", hello, 0.0)])]
    batch = prepare_grpo(groups, GRPOConfig(), CPU, tokenizer)  # the rest of the batch trains
    assert batch.stats["data/skipped/retokenize_failed"] == 1 and batch.stats["data/groups_trained"] == 1
    assert "trajectory c of group odd is skipped (retokenize_failed)" in caplog.text and "UndefinedError" in caplog.text
    with pytest.raises(RetokenizeError, match="cannot render the conversation: UndefinedError") as info:
        render_with_assistant_mask(tokenizer, nameless)
    assert type(info.value.__cause__).__name__ == "UndefinedError"
    strict = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    strict.chat_template = "{{ raise_exception('only user turns') }}"  # a template refusing what it does not support
    with pytest.raises(RetokenizeError, match="TemplateError: only user turns"):
        render_with_assistant_mask(strict, hello)


def test_tool_calls_a_template_leaves_out_are_not_trained_as_an_empty_turn(
        tokenizer: PreTrainedTokenizerBase, caplog: pytest.LogCaptureFixture) -> None:
    # SmolLM2's own template (`--chat-template model`) has no tool section: it drops an assistant message's calls,
    # and the tool-calling turn would train as a bare <|im_end|>
    toolless = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    assert "tool_calls" not in toolless.chat_template
    with pytest.raises(RetokenizeError, match="does not render the tool calls of message 2"):
        render_with_assistant_mask(toolless, CONVERSATION, TOOLS)
    hello = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    render_with_assistant_mask(toolless, hello)  # conversations without tool calls still re-tokenize
    groups = [Group(id="g", trajectories=[
        Trajectory(id=tid, trace_id="1" * 32, group_id="g", token_exact=False, messages=messages, tools=TOOLS,
                   reward=reward)
        for tid, messages, reward in (("a", hello, 1.0), ("b", hello, 0.0), ("c", CONVERSATION, 0.5))])]
    batch = prepare_grpo(groups, GRPOConfig(), CPU, toolless)
    assert batch.stats["data/skipped/retokenize_failed"] == 1 and batch.stats["data/trajectories"] == 2
    assert "trajectory c of group g is skipped (retokenize_failed)" in caplog.text


def item(trajectory: int, tokens: int) -> TrainItem:
    return TrainItem(torch.zeros(tokens, dtype=torch.long), torch.zeros(tokens - 1), torch.ones(tokens - 1),
                     advantage=0.0, weight=0.1, trajectory=trajectory)


def test_shard_items_keeps_trajectories_whole_and_balances_tokens() -> None:
    # trajectory 1 has two sequences (10 + 10 tokens); longest first to the lighter rank:
    # 50 -> r0, 30 -> r1, 25 -> r1 (55), 20 -> r0 (70), 5 -> r1 (60)
    items = [item(0, 50), item(1, 10), item(2, 30), item(1, 10), item(3, 25), item(4, 5)]
    rank0, rank1 = shard_items(items, 0, 2), shard_items(items, 1, 2)
    assert [i.trajectory for i in rank0] == [0, 1, 1] and [i.trajectory for i in rank1] == [2, 3, 4]
    assert shard_items(items, 0, 1) == items
    assert shard_items(items[:1], 1, 2) == []  # fewer trajectories than ranks: an empty share
    with pytest.raises(ValueError, match="rank=2"):
        shard_items(items, 2, 2)


def test_items_carry_their_trajectory_index() -> None:
    trainer = make_trainer()
    items = prepare_grpo([group(trainer, (1.0, 0.0), "a"), group(trainer, (0.0, 1.0), "b")], trainer.config, CPU).items
    assert [i.trajectory for i in items] == [0, 1, 2, 3]


def test_micro_batches_keep_order_and_both_limits() -> None:
    items = [item(i, n) for i, n in enumerate((30, 30, 30, 50, 200, 10, 10, 10, 10))]

    def shape(passes: list[list[TrainItem]]) -> list[list[int]]:
        return [[i.trajectory for i in p] for p in passes]

    # 100 tokens at most: 30+30+30, then 50 (+200 would pass it), 200 alone (over the limit), 10s by three
    assert shape(micro_batches(items, 3, 100)) == [[0, 1, 2], [3], [4], [5, 6, 7], [8]]
    assert shape(micro_batches(items, 1, 10_000)) == [[i] for i in range(9)]
    assert shape(micro_batches(items, 64, 10_000)) == [list(range(9))]
    assert micro_batches([], 4, 100) == []
