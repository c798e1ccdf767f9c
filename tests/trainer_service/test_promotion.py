"""The promotion gate on the tiny Llama trainer.

The engine here answers vLLM's `/v1/chat/completions` in process (httpx MockTransport, the
published response shape: `choices[].message.content`), saying which model answered, so the
test controls each checkpoint's eval reward through the reward function.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import math
import re
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import numpy
import pytest

from collector.protocol import Batch
from tests.trainer_service.builders import group, make_service
from trainer_service.checkpoint_checks import CheckpointMismatchError
from trainer_service.checkpoints import CheckpointStore
from trainer_service.config import TrainerSettings
from trainer_service.evaluation import EvalError, Evaluator, build_evaluator, load_eval_file, load_reward_fn
from trainer_service.promotion import PromotionGate
from trainer_service.protocol import ServiceError

SCORES: dict[str, float] = {}
"""Eval reward per answering model, set by the test."""


def reward(row: dict[str, Any], completion: str) -> float:
    """The eval reward function under test (`tests.trainer_service.test_promotion:reward`)."""
    assert row["messages"][0]["role"] == "user"
    return SCORES[completion.removeprefix("answer from ")]


def engine(request: httpx.Request) -> httpx.Response:
    body = json.loads(request.content)
    choices = [{"index": i, "message": {"role": "assistant", "content": f"answer from {body['model']}"},
                "finish_reason": "stop"} for i in range(body["n"])]
    return httpx.Response(200, json={"id": "x", "object": "chat.completion", "model": body["model"],
                                     "choices": choices})


def scored_evaluator(source: Callable[[], Awaitable[list[dict[str, Any]]]], scores: dict[str, float],
                     samples: int = 1) -> Evaluator:
    """An evaluator of `source`'s rows whose reward for each model is `scores`' (through `reward`), answered by
    `engine`."""
    SCORES.clear()
    SCORES.update(scores)
    return Evaluator(source, load_reward_fn("tests.trainer_service.test_promotion:reward"), "http://engine",
                     samples=samples, transport=httpx.MockTransport(engine))


async def test_gate_promotes_within_margin_and_says_why_not(tmp_path: Path) -> None:
    eval_file = tmp_path / "eval.jsonl"
    eval_file.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"{a}+1?"}]})
                                   for a in range(3)))
    rows = load_eval_file(eval_file)

    async def source() -> list[dict[str, Any]]:
        return rows

    def evaluator() -> Evaluator:
        return Evaluator(source, load_reward_fn("tests.trainer_service.test_promotion:reward"), "http://engine",
                         samples=2, transport=httpx.MockTransport(engine))

    SCORES.clear()
    SCORES.update({"base-model": 0.5, "agent@1": 0.6, "agent@2": 0.3, "agent@3": 0.55})
    batches: list[Batch] = []
    service = make_service(tmp_path / "run", batches, [], evaluator=evaluator(), promotion_margin=0.1)
    assert service.trainer is not None
    results = []
    for index in range(3):
        batches.append(Batch(id=f"b{index}", groups=[group(service.trainer, (1.0, 0.0))], lease_expires_at=0))
        results.append(await service.train_once())
    first, second, third = results
    assert first.promotion.promoted and first.latest_model == "agent@1"
    assert first.promotion.baseline_reward == 0.5 and first.metrics["eval/reward"] == 0.6
    assert not second.promotion.promoted and second.latest_model == "agent@1"
    assert "below agent@1's 0.6000 by more than the margin 0.1" in second.promotion.reason
    assert service.resolve("agent@2") == "agent@2"  # kept and served by name, just not as latest
    status = await service.status()
    assert status.promotion is not None and status.promotion.step == 3
    assert third.promotion.promoted and third.latest_model == "agent@3"  # 0.55 >= 0.6 - 0.1
    assert status.eval_rewards == pytest.approx({0: 0.5, 1: 0.6, 2: 0.3, 3: 0.55})
    await service.aclose()

    SCORES["agent@4"] = math.nan  # a broken reward: the step is kept, not promoted
    restarted = make_service(tmp_path / "run", batches, [], evaluator=evaluator(), promotion_margin=0.1)
    assert restarted.trainer is not None and restarted.resolve("agent@latest") == "agent@3"
    batches.append(Batch(id="b4", groups=[group(restarted.trainer, (1.0, 0.0))], lease_expires_at=0))
    fourth = await restarted.train_once()
    assert not fourth.promotion.promoted and fourth.latest_model == "agent@3"
    assert "eval failed" in fourth.promotion.reason and "finite" in fourth.promotion.reason
    assert (await restarted.status()).counters["eval_failures"] == 1  # was counted nowhere
    await restarted.aclose()


@pytest.mark.parametrize(("margin", "base", "new"), [(0.1, [1.0] * 8 + [0.0] * 2, [1.0] * 7 + [0.0] * 3),
                                                     (0.0, [0.1, 0.2, 0.3], [0.3, 0.2, 0.1])])
async def test_a_reward_exactly_the_margin_below_is_promoted_whatever_the_float_rounding(
        tmp_path: Path, margin: float, base: list[float], new: list[float]) -> None:
    rewards = {"base-model": base, "agent@1": new}  # per prompt; means 0.8 and 0.7, or the same three in another order
    rows = [{"messages": [{"role": "user", "content": str(index)}]} for index in range(len(base))]

    async def source() -> list[dict[str, Any]]:
        return rows

    def score(row: dict[str, Any], completion: str) -> float:
        return rewards[completion.removeprefix("answer from ")][int(row["messages"][0]["content"])]

    evaluator = Evaluator(source, score, "http://engine", samples=1, transport=httpx.MockTransport(engine))
    settings = TrainerSettings(output_dir=tmp_path, wandb="off", eval_split="val", promotion_margin=margin,
                               eval_reward="tests.trainer_service.test_promotion:reward")
    gate = PromotionGate(settings, CheckpointStore(tmp_path / "checkpoints"), evaluator, lambda step: f"agent@{step}",
                         lambda: "base-model")
    gate.restore([])
    decision = await gate.judge(1)  # 0.8 - 0.1 is 0.7000000000000001; 0.1 + 0.2 + 0.3 is not 0.3 + 0.2 + 0.1
    assert decision.promoted and gate.latest == 1, decision.reason  # was "0.7000 is below 0.8000 by more than 0.1"
    await gate.aclose()


async def test_a_grown_eval_split_measures_the_baseline_again_on_the_same_prompts(tmp_path: Path) -> None:
    rows = [{"messages": [{"role": "user", "content": "0+1?"}]}]
    asked: list[tuple[str, str]] = []  # (model, prompt) of each eval request

    async def source() -> list[dict[str, Any]]:  # a collector split: it grows between steps
        return list(rows)

    def recording(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        asked.append((body["model"], body["messages"][0]["content"]))
        return engine(request)

    SCORES.clear()
    SCORES.update({"base-model": 0.5, "agent@1": 0.6, "agent@2": 0.6})
    evaluator = Evaluator(source, load_reward_fn("tests.trainer_service.test_promotion:reward"), "http://engine",
                          samples=1, transport=httpx.MockTransport(recording))
    batches: list[Batch] = []
    service = make_service(tmp_path, batches, [], evaluator=evaluator)
    assert service.trainer is not None
    batches.append(Batch(id="b1", groups=[group(service.trainer, (1.0, 0.0))], lease_expires_at=0))
    await service.train_once()
    assert sorted(asked) == [("agent@1", "0+1?"), ("base-model", "0+1?")]
    rows.append({"messages": [{"role": "user", "content": "1+1?"}]})
    asked.clear()
    batches.append(Batch(id="b2", groups=[group(service.trainer, (1.0, 0.0))], lease_expires_at=0))
    await service.train_once()
    # agent@1's cached reward was for one prompt: it is measured again, on both, beside agent@2
    assert sorted(asked) == [("agent@1", "0+1?"), ("agent@1", "1+1?"), ("agent@2", "0+1?"), ("agent@2", "1+1?")]
    assert set((await service.status()).eval_rewards) == {1, 2}  # the base's one-prompt reward is dropped
    await service.aclose()


async def test_a_step_dropped_by_retention_leaves_the_eval_rewards(tmp_path: Path) -> None:
    async def source() -> list[dict[str, Any]]:
        return [{"messages": [{"role": "user", "content": "1+1?"}]}]

    evaluator = scored_evaluator(source, {"base-model": 0.5, "agent@1": 0.6, "agent@2": 0.7})
    batches: list[Batch] = []
    service = make_service(tmp_path, batches, [], evaluator=evaluator, keep_last=1)
    assert service.trainer is not None
    for index in (1, 2):
        batches.append(Batch(id=f"b{index}", groups=[group(service.trainer, (1.0, 0.0))], lease_expires_at=0))
        await service.train_once()
    assert service.steps == [2] and service.resolve("agent@latest") == "agent@2"
    status = await service.status()
    # step 1's reward was shown until the next step, its checkpoint deleted
    assert status.eval_rewards == pytest.approx({0: 0.5, 2: 0.7}) and status.eval_reward_count == 2
    saved = json.loads((tmp_path / "checkpoints" / "promotion.json").read_text())
    assert saved["evals"] == pytest.approx({"0": 0.5, "2": 0.7}) and saved["latest"] == 2  # held step 1's till the next
    await service.aclose()


async def test_a_promotion_state_not_saved_without_a_dropped_step_is_counted_and_fails_no_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    async def source() -> list[dict[str, Any]]:
        return [{"messages": [{"role": "user", "content": "1+1?"}]}]

    scores = {"base-model": 0.5, "agent@1": 0.6, "agent@2": 0.7}
    batches: list[Batch] = []
    service = make_service(tmp_path, batches, [], evaluator=scored_evaluator(source, scores), keep_last=1)
    assert service.trainer is not None
    batches.append(Batch(id="b1", groups=[group(service.trainer, (1.0, 0.0))], lease_expires_at=0))
    await service.train_once()
    write = service.store.write_promotion

    def full_after_the_gate(state: dict[str, Any]) -> None:  # step 2's gate saves; retention's save is refused
        if 1 not in state["evals"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        write(state)

    monkeypatch.setattr(service.store, "write_promotion", full_after_the_gate)
    batches.append(Batch(id="b2", groups=[group(service.trainer, (1.0, 0.0))], lease_expires_at=0))
    result = await service.train_once()
    monkeypatch.undo()
    assert result.latest_model == "agent@2" and service.steps == [2]
    assert service.counters["promotion_write_errors"] == 1 and "names them until it is saved again" in caplog.text
    assert (await service.status()).eval_rewards == pytest.approx({0: 0.5, 2: 0.7})
    await service.aclose()
    restarted = make_service(tmp_path, [], [], evaluator=scored_evaluator(source, scores), keep_last=1)
    assert set(json.loads((tmp_path / "checkpoints" / "promotion.json").read_text())["evals"]) == {"0", "2"}
    await restarted.aclose()


async def test_status_while_the_gate_runs_shows_the_metrics_of_the_step_it_gates(tmp_path: Path) -> None:
    evaluating, decide = asyncio.Event(), asyncio.Event()
    asked: list[int] = []

    async def source() -> list[dict[str, Any]]:  # step 2's gate waits until the test has asked for the status
        asked.append(len(asked) + 1)
        if len(asked) == 2:
            evaluating.set()
            await decide.wait()
        return [{"messages": [{"role": "user", "content": "1+1?"}]}]

    evaluator = scored_evaluator(source, {"base-model": 0.5, "agent@1": 0.6, "agent@2": 0.7})
    batches: list[Batch] = []
    service = make_service(tmp_path, batches, [], evaluator=evaluator)
    assert service.trainer is not None
    for index in (1, 2):
        batches.append(Batch(id=f"b{index}", groups=[group(service.trainer, (1.0, 0.0))], lease_expires_at=0))
    await service.train_once()
    running = asyncio.create_task(service.train_once())
    await evaluating.wait()
    status = await service.status()
    decide.set()
    result = await running
    assert status.training and status.step == 2 and status.latest_model == "agent@1"
    # was step 1's metrics beside step 2
    assert status.last_metrics["step"] == 2 and status.last_metrics["loss/policy"] == result.metrics["loss/policy"]
    assert "eval/reward" not in status.last_metrics  # the gate has not measured it yet
    assert (await service.status()).last_metrics["eval/reward"] == pytest.approx(0.7)
    await service.aclose()


async def test_an_evaluator_that_fails_unexpectedly_promotes_nothing_and_the_step_is_recorded(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    async def source() -> list[dict[str, Any]]:
        raise RuntimeError("a bug in the eval source")

    evaluator = Evaluator(source, lambda row, text: 1.0, "http://engine", transport=httpx.MockTransport(engine))
    batches: list[Batch] = []
    service = make_service(tmp_path, batches, [], evaluator=evaluator, keep_last=1)
    assert service.trainer is not None
    for index in (1, 2):
        batches.append(Batch(id=f"b{index}", groups=[group(service.trainer, (1.0, 0.0))], lease_expires_at=0))
        # was a 500 `training_failed` for a served step: no retention, no metrics line
        result = await service.train_once()
        assert not result.promotion.promoted and result.latest_model == "base-model"
        assert result.promotion.reason == "eval failed, not promoted: RuntimeError: a bug in the eval source"
    assert service.steps == [2] and service.resolve("agent@2") == "agent@2"
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert "RuntimeError: a bug in the eval source" in caplog.text and "Traceback" in caplog.text
    status = await service.status()
    assert status.promotion is not None and status.promotion.step == 2 and status.last_error is None
    assert status.counters["eval_failures"] == 2  # was counted nowhere, as an `EvalError`
    await service.aclose()


def test_eval_file_errors_name_the_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bad = tmp_path / "eval.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n{"prompt": "no messages"}\n')
    with pytest.raises(EvalError, match=r"eval.jsonl:2 needs a non-empty `messages`"):
        load_eval_file(bad)
    with pytest.raises(EvalError, match="cannot be imported"):
        load_reward_fn("tests.trainer_service.test_promotion:missing")
    for spec in (":reward", ".test_promotion:reward"):  # import_module raised ValueError and TypeError here
        with pytest.raises(EvalError, match=f"eval reward '{re.escape(spec)}' cannot be imported"):
            load_reward_fn(spec)
    (tmp_path / "reward_with_a_typo.py").write_text("def reward(row, completion) return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(EvalError, match="eval reward 'reward_with_a_typo:reward' cannot be imported: expected ':'"):
        load_reward_fn("reward_with_a_typo:reward")  # was a SyntaxError's traceback at start


async def async_reward(row: dict[str, Any], completion: str) -> float:
    """An `async def` reward (`tests.trainer_service.test_promotion:async_reward`): its coroutine is no number."""
    return 1.0


def test_an_eval_file_not_utf8_or_not_chat_messages_and_an_async_reward_are_refused_at_start(tmp_path: Path) -> None:
    bad = tmp_path / "eval.jsonl"
    bad.write_bytes('{"messages": [{"role": "user", "content": "café"}]}\n'.encode("latin-1"))
    with pytest.raises(EvalError, match=r"eval.jsonl cannot be read: 'utf-8' codec"):  # was a UnicodeDecodeError
        load_eval_file(bad)
    for messages in (["hi"], [{"content": "hi"}]):  # were accepted: every eval then failed at the engine
        bad.write_text(json.dumps({"messages": messages}))
        with pytest.raises(EvalError, match=r"eval.jsonl:1 needs a non-empty `messages` list of chat messages"):
            load_eval_file(bad)
    # was accepted: every eval then failed with "the eval reward function raised TypeError: float() argument ..."
    with pytest.raises(EvalError, match="is an async function; give a plain `def function"):
        load_reward_fn("tests.trainer_service.test_promotion:async_reward")


def test_an_eval_file_line_ends_at_newline_only_and_may_start_with_a_byte_order_mark(tmp_path: Path) -> None:
    eval_file = tmp_path / "eval.jsonl"
    row = {"messages": [{"role": "user", "content": "a\u2028b\x85c\u2029d"}]}
    line = json.dumps(row, ensure_ascii=False).encode() + b"\r\n\r\n"
    eval_file.write_bytes(line)
    # `splitlines` cut the line at U+2028, U+0085 and U+2029, which JSON strings hold unescaped: "is not JSON"
    assert load_eval_file(eval_file) == [row]
    eval_file.write_bytes(b"\xef\xbb\xbf" + line)
    assert load_eval_file(eval_file) == [row]  # was "eval.jsonl:1 is not JSON: Unexpected UTF-8 BOM"


@pytest.mark.parametrize(("line", "problem"), [('{"messages": [{"role": "user", "content": NaN}]}', "Out of range"),
                                               ('{"messages": [{"role": "user", "content": "\\ud800"}]}',
                                                "surrogates not allowed")])
def test_an_eval_row_json_cannot_carry_is_refused_at_start(tmp_path: Path, line: str, problem: str) -> None:
    eval_file = tmp_path / "eval.jsonl"
    eval_file.write_text(line + "\n")
    # was loaded; each eval then raised httpx's ValueError, a 500 `training_failed` for a step already served
    with pytest.raises(EvalError, match=f"eval.jsonl:1 cannot be sent to the engine as JSON: .*{problem}"):
        load_eval_file(eval_file)


@pytest.mark.parametrize("line", ["[" * 100_000, '{"messages": [{"role": "user", "content": ' + "9" * 5000 + "}]}"],
                         ids=["deep", "long-int"])
def test_an_eval_line_python_cannot_read_is_refused_naming_the_line(tmp_path: Path, line: str) -> None:
    eval_file = tmp_path / "eval.jsonl"
    eval_file.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n' + line + "\n")
    with pytest.raises(EvalError, match="eval.jsonl:2 is not JSON: "):  # was a RecursionError or ValueError traceback
        load_eval_file(eval_file)


def _nested(depth: int) -> list[Any]:
    """A list nested `depth` deep (built without recursion)."""
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


# nested deeper than JSON can be encoded from the event loop (a RecursionError; an eval file line as deep is read at
# start with a shallower stack): was raised out of the gate, not an eval failure
@pytest.mark.parametrize("content", [math.nan, "\ud800", _nested(5000)], ids=["nan", "surrogate", "nested"])
async def test_an_eval_row_json_cannot_carry_fails_the_eval_not_the_step(tmp_path: Path, content: object) -> None:
    async def source() -> list[dict[str, Any]]:  # e.g. a collector split: not read through `load_eval_file`
        return [{"messages": [{"role": "user", "content": content}]}]

    evaluator = Evaluator(source, lambda row, text: 1.0, "http://engine", transport=httpx.MockTransport(engine))
    settings = TrainerSettings(output_dir=tmp_path, wandb="off")
    gate = PromotionGate(settings, CheckpointStore(tmp_path / "checkpoints"), evaluator, lambda step: f"agent@{step}",
                         lambda: "base-model")
    decision = await gate.judge(1)  # raised ValueError, UnicodeEncodeError or RecursionError
    assert not decision.promoted and gate.latest is None
    assert re.match(r"eval failed, not promoted: (prompt 0|a prompt) of the eval set cannot be (sent to the engine|"
                    r"encoded) as JSON: ", decision.reason)
    await gate.aclose()


async def test_a_prompt_nested_too_deep_to_send_fails_the_eval() -> None:
    async def source() -> list[dict[str, Any]]:
        return [{"messages": [{"role": "user", "content": _nested(5000)}]}]

    evaluator = Evaluator(source, lambda row, text: 1.0, "http://engine", transport=httpx.MockTransport(engine))
    with pytest.raises(EvalError, match=r"^prompt 0 of the eval set cannot be sent to the engine as JSON: maximum "
                                        "recursion depth exceeded"):  # was a RecursionError
        await evaluator.evaluate("agent@1")
    await evaluator.aclose()


@pytest.mark.parametrize("field", ["eval_split", "eval_file"])
def test_an_empty_eval_source_is_refused_at_start(tmp_path: Path, field: str) -> None:
    # `ART_TRAINER_EVAL_SPLIT=` turned the gate on for a split no trajectory has: nothing was ever promoted
    flag = field.replace("_", "-")
    with pytest.raises(ValueError, match=f"{field}\n.*is empty; give one, or leave --{flag} "
                                         f"\\(ART_TRAINER_{field.upper()}\\) out"):
        TrainerSettings(output_dir=tmp_path, wandb="off", eval_reward="tests.trainer_service.test_promotion:reward",
                        **{field: ""})


async def test_full_disk_for_the_promotion_state_keeps_latest_where_it_is_saved(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    batches: list[Batch] = []
    service = make_service(tmp_path, batches, [])  # no eval set: every step is promoted
    assert service.trainer is not None
    batches.append(Batch(id="b1", groups=[group(service.trainer, (1.0, 0.0))], lease_expires_at=0))
    await service.train_once()

    def disk_full(state: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(service.store, "write_promotion", disk_full)
    batches.append(Batch(id="b2", groups=[group(service.trainer, (1.0, 0.0))], lease_expires_at=0))
    with pytest.raises(ServiceError) as info:
        await service.train_once()
    assert info.value.status == 507 and info.value.body.error.code == "promotion_write_failed"
    assert "No space left on device" in info.value.body.error.message and "agent@1" in info.value.body.error.message
    # latest stays what promotion.json says; step 2 is served by name and its metrics are recorded
    assert service.resolve("agent@latest") == "agent@1" and service.resolve("agent@2") == "agent@2"
    assert json.loads((tmp_path / "checkpoints" / "promotion.json").read_text())["latest"] == 1
    last = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == 2 and last["promotion/promoted"] == 0.0
    status = await service.status()
    assert status.last_error == info.value.body.error.message and status.counters["promotion_write_errors"] == 1
    await service.aclose()


async def test_a_malformed_engine_answer_fails_the_eval_and_promotes_nothing(tmp_path: Path) -> None:
    async def source() -> list[dict[str, Any]]:
        return [{"messages": [{"role": "user", "content": "1+1?"}]}]

    no_choices = httpx.MockTransport(lambda request: httpx.Response(200, json={"object": "error", "message": "x"}))
    evaluator = Evaluator(source, lambda row, text: 1.0, "http://engine", transport=no_choices)
    batches: list[Batch] = []
    service = make_service(tmp_path, batches, [], evaluator=evaluator)
    assert service.trainer is not None
    batches.append(Batch(id="b1", groups=[group(service.trainer, (1.0, 0.0))], lease_expires_at=0))
    result = await service.train_once()
    assert not result.promotion.promoted and result.latest_model == "base-model"
    assert "eval failed" in result.promotion.reason and "not a chat completion" in result.promotion.reason
    assert "KeyError" in result.promotion.reason
    await service.aclose()


async def test_an_engine_answer_without_choices_fails_the_eval_not_the_step(tmp_path: Path) -> None:
    async def source() -> list[dict[str, Any]]:
        return [{"messages": [{"role": "user", "content": "1+1?"}]}]

    no_choices = httpx.MockTransport(lambda request: httpx.Response(200, json={"object": "chat.completion",
                                                                               "choices": []}))
    evaluator = Evaluator(source, lambda row, text: 1.0, "http://engine", transport=no_choices)
    with pytest.raises(EvalError, match="without choices"):  # was a ZeroDivisionError
        await evaluator.evaluate("agent@1")
    batches: list[Batch] = []
    service = make_service(tmp_path, batches, [], evaluator=evaluator)
    assert service.trainer is not None
    batches.append(Batch(id="b1", groups=[group(service.trainer, (1.0, 0.0))], lease_expires_at=0))
    result = await service.train_once()  # the step is served; the gate promotes nothing (was a 500)
    assert not result.promotion.promoted and "without choices" in result.promotion.reason
    await service.aclose()


@pytest.mark.parametrize(("body", "problem"), [(b'[{"not": "a trajectory"}]', "ValidationError"),
                                               (b"[" * 100_000, "RecursionError")])  # the latter escaped: a 500
async def test_malformed_collector_trajectories_are_an_eval_error(tmp_path: Path, body: bytes, problem: str) -> None:
    trajectories = httpx.MockTransport(lambda request: httpx.Response(200, content=body))
    settings = TrainerSettings(output_dir=tmp_path, wandb="off", eval_split="val",
                               eval_reward="tests.trainer_service.test_promotion:reward")
    async with httpx.AsyncClient(base_url="http://collector", transport=trajectories) as collector:
        evaluator = build_evaluator(settings, collector, "http://engine")
        assert evaluator is not None
        with pytest.raises(EvalError, match=f"trajectories of the eval split 'val' are malformed.*{problem}"):
            await evaluator.evaluate("agent@1")
        await evaluator.aclose()


def test_restore_promotes_no_unevaluated_step_and_without_eval_serves_the_newest(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "checkpoints")
    async def no_rows() -> list[dict[str, Any]]:
        raise AssertionError("restore evaluated a step")

    never = Evaluator(no_rows, reward, "http://engine")
    settings = TrainerSettings(output_dir=tmp_path, wandb="off")

    def restored(evaluator: Evaluator | None, steps: list[int]) -> int | None:
        gate = PromotionGate(settings, store, evaluator, lambda step: f"agent@{step}", lambda: "base-model")
        gate.restore(steps)
        return gate.latest

    # A crash after step 1 was saved, before its gate ran: with an eval set, latest stays the base model.
    assert restored(never, [1]) is None
    # Without an eval set every step is promoted: the newest kept one wins over a saved older latest.
    store.write_promotion({"latest": 1, "evals": {}, "decision": None})
    assert restored(None, [1, 2]) == 2
    assert restored(never, [1, 2]) == 1  # with an eval set the saved decision holds


def _restored_with_an_eval_set(tmp_path: Path, store: CheckpointStore, steps: list[int]) -> PromotionGate:
    """A gate with an eval set, restored for the kept `steps` from what `store` saved; restoring evaluates nothing."""

    async def no_rows() -> list[dict[str, Any]]:
        raise AssertionError("restore evaluated a step")

    evaluator = Evaluator(no_rows, reward, "http://engine")
    gate = PromotionGate(TrainerSettings(output_dir=tmp_path, wandb="off"), store, evaluator,
                         lambda step: f"agent@{step}", lambda: "base-model")
    gate.restore(steps)
    return gate


def test_a_promoted_step_no_longer_kept_serves_the_base_model_with_a_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """E.g. moved out of the run folder as a damaged checkpoint's error says: latest went back to the base model
    silently."""
    store = CheckpointStore(tmp_path / "checkpoints")
    store.write_promotion({"latest": 3, "evals": {}, "decision": None})
    gate = _restored_with_an_eval_set(tmp_path, store, [1, 2])
    assert gate.latest is None
    assert f"the promoted step 3 ({store.root / 'promotion.json'}) is no longer kept: `latest` serves base-model " \
           "until a step is promoted" in caplog.text


@pytest.mark.parametrize("saved", ['{"latest": 1, "ev', "[]", '{"evals": {"1": "high"}}',
                                   '{"latest": 1, "evals": {}, "decision": {"step": 1}}',
                                   '{"latest": 1, "evals": {}, "decision": 5}',
                                   # were `agent@True` and the base model (silently) as latest; a folder was ignored
                                   '{"latest": true, "evals": {}}', '{"latest": "1", "evals": {}}', "folder",
                                   # were read: a NaN or infinite baseline promoted nothing, silently
                                   '{"latest": null, "evals": {"0": NaN}}', '{"latest": null, "evals": {"0": 1e999}}',
                                   # were a traceback at start (OverflowError, RecursionError)
                                   '{"latest": null, "evals": {"0": 1' + "0" * 400 + '}}', "[" * 100_000])
def test_a_damaged_promotion_state_stops_the_start_naming_the_file(tmp_path: Path, saved: str) -> None:
    store = CheckpointStore(tmp_path / "checkpoints")
    store.root.mkdir()
    if saved == "folder":
        (store.root / "promotion.json").mkdir()  # cannot be read, as a file without read permission (not as root)
    else:
        (store.root / "promotion.json").write_text(saved)
    settings = TrainerSettings(output_dir=tmp_path, wandb="off")
    # raised when the gate is built, in the service's constructor: before vLLM starts, and the CLI reports it
    with pytest.raises(CheckpointMismatchError, match=r"promotion.json .*Move .* afresh"):
        PromotionGate(settings, store, None, lambda step: f"agent@{step}", lambda: "base-model")


@pytest.mark.parametrize(("saved", "evals"), [("{}", {}), ('{"evals": {"0": 0.5}}', {0: 0.5})])
def test_a_promotion_state_without_latest_serves_the_base_model(tmp_path: Path, saved: str,
                                                               evals: dict[int, float]) -> None:
    """`latest` left out, as `evals` may be (e.g. `{}` written to start the gate afresh): was a KeyError at start,
    with an eval set, once vLLM ran."""
    store = CheckpointStore(tmp_path / "checkpoints")
    store.root.mkdir()
    (store.root / "promotion.json").write_text(saved)
    gate = _restored_with_an_eval_set(tmp_path, store, [1, 2])
    assert gate.latest is None and gate.evals == evals


@pytest.mark.parametrize(("evals", "problem"), [
    # were read as rewards 1.0 and 0.5: only a JSON number is a reward
    ('{"0": true}', "its `evals` reward of step 0 is True, not a number"),
    ('{"0": "0.5"}', "its `evals` reward of step 0 is '0.5', not a number"),
    ('{"2": null}', "its `evals` reward of step 2 is None, not a number"),
    ('{"0": 1, "3": NaN}', "its `evals` reward of step 3 is nan, not a finite number"),
    ('{" 1": 0.5}', "its `evals` key ' 1' is not a step number"),  # was read as step 1
])
def test_an_eval_reward_that_is_no_json_number_stops_the_start_naming_the_field(
    tmp_path: Path, evals: str, problem: str
) -> None:
    store = CheckpointStore(tmp_path / "checkpoints")
    store.root.mkdir()
    (store.root / "promotion.json").write_text(f'{{"latest": null, "evals": {evals}}}')
    with pytest.raises(CheckpointMismatchError) as info:
        store.read_promotion()
    assert f"{store.root / 'promotion.json'} cannot be read (ValueError: {problem})" in str(info.value)


@pytest.mark.parametrize(("returned", "mean"), [(numpy.True_, 1.0), (numpy.False_, 0.0), (True, 1.0),
                                                (numpy.float32(0.5), 0.5), (numpy.int64(2), 2.0), (3, 3.0)])
async def test_a_reward_of_any_real_number_counts_numpys_too(returned: object, mean: float) -> None:
    async def source() -> list[dict[str, Any]]:
        return [{"messages": [{"role": "user", "content": "1+1?"}]}]

    # `numpy.bool_`, e.g. `(answer == expected).all()`, is no `numbers.Real`: it was refused ("return a float")
    evaluator = Evaluator(source, lambda row, text: returned, "http://engine", transport=httpx.MockTransport(engine))
    score = await evaluator.evaluate("agent@1")
    assert score == mean and type(score) is float
    await evaluator.aclose()


@pytest.mark.parametrize("returned", ["0.9", "abc", None, [1.0], numpy.str_("0.9"), numpy.complex64(1)])
async def test_a_reward_that_is_no_number_fails_the_eval_naming_the_prompt_and_model(returned: object) -> None:
    async def source() -> list[dict[str, Any]]:
        return [{"messages": [{"role": "user", "content": "1+1?"}]}]

    # "0.9" was taken as a reward; "abc" and None were "the eval reward function raised ValueError/TypeError"
    evaluator = Evaluator(source, lambda row, text: returned, "http://engine", transport=httpx.MockTransport(engine))
    with pytest.raises(EvalError, match=rf"returned {re.escape(repr(returned))} \(\w+\) on prompt 0 of the eval set, "
                                        r"answered by agent@1; return a float"):
        await evaluator.evaluate("agent@1")
    await evaluator.aclose()


@pytest.mark.parametrize("returned", [10**400, 10**5000], ids=["1e400", "1e5000"])  # 1e5000 cannot be printed
async def test_a_reward_too_large_for_a_float_fails_the_eval_naming_the_prompt_and_model(returned: int) -> None:
    async def source() -> list[dict[str, Any]]:
        return [{"messages": [{"role": "user", "content": "1+1?"}]}]

    # was a bare OverflowError from `math.isfinite`, naming neither
    evaluator = Evaluator(source, lambda row, text: returned, "http://engine", transport=httpx.MockTransport(engine))
    with pytest.raises(EvalError, match=r"returned a number too large for a float \(int\) on prompt 0 of the eval "
                                        r"set, answered by agent@1; rewards must be finite"):
        await evaluator.evaluate("agent@1")
    await evaluator.aclose()


@pytest.mark.parametrize(("returned", "samples"), [(10**308, 4), (-1.5e308, 4),
                                                  # each divided by 3 first, the sum still rounded past the largest
                                                  # float: the mean was `inf`
                                                  (sys.float_info.max, 3), (-sys.float_info.max, 3)])
async def test_rewards_whose_sum_is_too_large_for_a_float_have_their_finite_mean(returned: float, samples: int) -> None:
    async def source() -> list[dict[str, Any]]:
        return [{"messages": [{"role": "user", "content": "1+1?"}]}]

    # the mean was `inf`, promoted and saved as `Infinity`, which `promotion.json` then refused at start
    evaluator = Evaluator(source, lambda row, text: returned, "http://engine", samples=samples,
                          transport=httpx.MockTransport(engine))
    assert await evaluator.evaluate("agent@1") == float(returned)
    await evaluator.aclose()


async def test_a_reward_that_raises_names_the_prompt_and_logs_the_row(caplog: pytest.LogCaptureFixture) -> None:
    async def source() -> list[dict[str, Any]]:
        return [{"messages": [{"role": "user", "content": "1+1?"}], "answer": "2"},
                {"messages": [{"role": "user", "content": "2+2?"}]}]

    def exact(row: dict[str, Any], completion: str) -> float:
        return float(completion == row["answer"])

    evaluator = Evaluator(source, exact, "http://engine", transport=httpx.MockTransport(engine))
    with pytest.raises(EvalError, match="raised KeyError on prompt 1 of the eval set, answered by agent@1: 'answer'"):
        await evaluator.evaluate("agent@1")
    assert '"content": "2+2?"' in caplog.text and "Traceback" in caplog.text  # which row, and where in the function
    await evaluator.aclose()


def exiting_reward(row: dict[str, Any], completion: str) -> float:
    """A reward that exits, as argparse does on arguments it cannot parse."""
    raise SystemExit(2)


async def test_a_reward_that_exits_fails_the_eval_not_the_service(tmp_path: Path) -> None:
    async def source() -> list[dict[str, Any]]:
        return [{"messages": [{"role": "user", "content": "1+1?"}]}]

    evaluator = Evaluator(source, exiting_reward, "http://engine", transport=httpx.MockTransport(engine))
    settings = TrainerSettings(output_dir=tmp_path, wandb="off")
    gate = PromotionGate(settings, CheckpointStore(tmp_path / "checkpoints"), evaluator, lambda step: f"agent@{step}",
                         lambda: "base-model")
    decision = await gate.judge(1)  # the SystemExit was raised again in the event loop: the service stopped
    assert not decision.promoted and gate.latest is None
    assert decision.reason == ("eval failed, not promoted: the eval reward function raised SystemExit on prompt 0 of "
                               "the eval set, answered by agent@1: 2")
    await gate.aclose()


@pytest.mark.parametrize("raised", [asyncio.CancelledError, GeneratorExit])
async def test_a_reward_that_raises_a_cancellation_fails_the_eval_not_the_step(
        tmp_path: Path, raised: type[BaseException]) -> None:
    """The function's own CancelledError (a cancellation, as if the step were stopped) or GeneratorExit (a
    RuntimeError "coroutine ignored GeneratorExit") escaped the gate; nothing cancelled the step."""
    async def source() -> list[dict[str, Any]]:
        return [{"messages": [{"role": "user", "content": "1+1?"}]}]

    def cancelling_reward(row: dict[str, Any], completion: str) -> float:
        raise raised("from the reward")

    evaluator = Evaluator(source, cancelling_reward, "http://engine", transport=httpx.MockTransport(engine))
    settings = TrainerSettings(output_dir=tmp_path, wandb="off")
    gate = PromotionGate(settings, CheckpointStore(tmp_path / "checkpoints"), evaluator, lambda step: f"agent@{step}",
                         lambda: "base-model")
    decision = await gate.judge(1)
    assert not decision.promoted and gate.latest is None
    assert decision.reason == (f"eval failed, not promoted: the eval reward function raised {raised.__name__} on "
                               "prompt 0 of the eval set, answered by agent@1: from the reward")
    await gate.aclose()


async def test_cancelling_an_eval_while_the_reward_runs_cancels_it() -> None:
    """A real cancellation (the service stops the step) still propagates, while the reward function runs."""
    async def source() -> list[dict[str, Any]]:
        return [{"messages": [{"role": "user", "content": "1+1?"}]}]

    running, done = threading.Event(), threading.Event()

    def slow_reward(row: dict[str, Any], completion: str) -> float:
        running.set()
        done.wait(60)
        return 1.0

    evaluator = Evaluator(source, slow_reward, "http://engine", transport=httpx.MockTransport(engine))
    task = asyncio.ensure_future(evaluator.evaluate("agent@1"))
    await asyncio.to_thread(running.wait, 60)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    done.set()
    await evaluator.aclose()


def one_argument_reward(completion: str) -> float:
    """A reward that forgot the row (`tests.trainer_service.test_promotion:one_argument_reward`)."""
    return float(bool(completion))


def test_a_reward_function_that_cannot_take_row_and_completion_is_refused_at_start() -> None:
    # was accepted: every eval then failed with "the eval reward function raised TypeError"
    with pytest.raises(EvalError, match=r"'tests.trainer_service.test_promotion:one_argument_reward' cannot be "
                                        r"called as function\(row, completion\): too many positional arguments"):
        load_reward_fn("tests.trainer_service.test_promotion:one_argument_reward")


async def test_a_failed_eval_prompt_stops_the_other_requests() -> None:
    cancelled: list[int] = []

    class Engine(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            index = int(json.loads(request.content)["messages"][0]["content"])
            if index == 0:
                return httpx.Response(500, text="engine died")
            try:
                await asyncio.sleep(60)  # a slow answer
            except asyncio.CancelledError:
                cancelled.append(index)
                raise
            return engine(request)

    async def source() -> list[dict[str, Any]]:
        return [{"messages": [{"role": "user", "content": str(index)}]} for index in range(4)]

    evaluator = Evaluator(source, lambda row, text: 1.0, "http://engine", transport=Engine())
    with pytest.raises(EvalError, match="HTTP 500: engine died"):
        await evaluator.evaluate("agent@1")
    assert sorted(cancelled) == [1, 2, 3]  # were left running (into the next step) after the gate's decision
    await evaluator.aclose()


@pytest.mark.parametrize("change", ["reward", "samples"])
async def test_a_restart_with_other_scoring_measures_the_promoted_step_again(tmp_path: Path, change: str) -> None:
    async def source() -> list[dict[str, Any]]:
        return [{"messages": [{"role": "user", "content": "1+1?"}]}]

    scale = {"base-model": 0.5, "agent@1": 0.6}  # rewards on a 0..1 scale

    def reward_v1(row: dict[str, Any], completion: str) -> float:
        return scale[completion.removeprefix("answer from ")]

    def reward_v2(row: dict[str, Any], completion: str) -> float:
        return scale[completion.removeprefix("answer from ")]

    def gate(reward_fn: Any, samples: int, steps: list[int]) -> PromotionGate:
        evaluator = Evaluator(source, reward_fn, "http://engine", samples=samples,
                              transport=httpx.MockTransport(engine))
        settings = TrainerSettings(output_dir=tmp_path, wandb="off", eval_split="val",
                                   eval_reward="tests.trainer_service.test_promotion:reward")
        restored = PromotionGate(settings, CheckpointStore(tmp_path / "checkpoints"), evaluator,
                                 lambda step: f"agent@{step}", lambda: "base-model")
        restored.restore(steps)
        return restored

    first = gate(reward_v1, 1, [])
    assert (await first.judge(1)).promoted
    await first.aclose()
    scale.update({"agent@1": 0.06, "agent@2": 0.07})  # measured otherwise, the same checkpoints score otherwise
    second = gate(reward_v2, 1, [1]) if change == "reward" else gate(reward_v1, 2, [1])
    decision = await second.judge(2)
    # was compared with agent@1's 0.6 measured the other way: "0.0700 is below agent@1's 0.6000"
    assert decision.promoted and decision.baseline_reward == pytest.approx(0.06), decision.reason
    await second.aclose()


def test_a_reward_module_that_raises_on_import_is_one_error_naming_its_line(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "reward_needing_env.py").write_text('import os\nTOKEN = os.environ["JUDGE_TOKEN_NOT_SET"]\n\n\n'
                                                   "def reward(row, completion):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("JUDGE_TOKEN_NOT_SET", raising=False)
    # was the KeyError's traceback at start: the CLI reports only an EvalError as one line
    with pytest.raises(EvalError, match=r"eval reward 'reward_needing_env:reward': importing its module raised "
                                        r"KeyError: 'JUDGE_TOKEN_NOT_SET' \(.*reward_needing_env.py:2\)"):
        load_reward_fn("reward_needing_env:reward")


async def test_the_reward_function_runs_off_the_event_loop_one_call_at_a_time() -> None:
    async def source() -> list[dict[str, Any]]:
        return [{"messages": [{"role": "user", "content": str(index)}]} for index in range(6)]

    on_loop: list[bool] = []
    running: list[int] = [0, 0]  # now, most at once
    guard = threading.Lock()

    def slow(row: dict[str, Any], completion: str) -> float:
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:  # a worker thread: the service's proxy and status go on meanwhile
            on_loop.append(False)
        with guard:
            running[0] += 1
            running[1] = max(running)
        time.sleep(0.01)  # e.g. runs the answer's code
        with guard:
            running[0] -= 1
        return 1.0

    evaluator = Evaluator(source, slow, "http://engine", samples=2, transport=httpx.MockTransport(engine))
    assert await evaluator.evaluate("agent@1") == 1.0
    # was called on the event loop: a slow reward held up every proxied request and GET /v1/status
    assert on_loop == [False] * 12 and running[1] == 1  # a user function need not be thread-safe
    await evaluator.aclose()


async def test_an_eval_logs_its_progress(caplog: pytest.LogCaptureFixture) -> None:
    async def source() -> list[dict[str, Any]]:
        return [{"messages": [{"role": "user", "content": str(index)}]} for index in range(8)]

    evaluator = Evaluator(source, lambda row, text: 0.5, "http://engine", samples=2,
                          transport=httpx.MockTransport(engine))
    with caplog.at_level(logging.INFO, logger="trainer_service.evaluation"):
        await evaluator.evaluate("agent@1")
    lines = [record.getMessage() for record in caplog.records if record.name == "trainer_service.evaluation"]
    # was one line once the whole eval had ended: a long one showed nothing for minutes
    assert [line.split(" in ")[0] for line in lines] == [
        "eval of agent@1: 8 prompts x 2 samples", "eval of agent@1: 2 of 8 prompts scored",
        "eval of agent@1: 4 of 8 prompts scored", "eval of agent@1: 6 of 8 prompts scored",
        "eval of agent@1: mean reward 0.5000 on 8 prompts x 2 samples"]
    await evaluator.aclose()


async def test_a_stopped_eval_gives_up_an_engine_that_never_answers_and_asks_it_nothing_after() -> None:
    # a shutdown waited for the eval client's 600 s timeout on a vLLM that took the request and never answered
    asked: list[str] = []
    never = asyncio.Event()

    async def hung(request: httpx.Request) -> httpx.Response:
        asked.append(json.loads(request.content)["model"])
        await never.wait()
        raise AssertionError("the engine never answers")

    async def source() -> list[dict[str, Any]]:
        return [{"messages": [{"role": "user", "content": "3 + 4?"}]}]

    evaluator = Evaluator(source, lambda row, text: 1.0, "http://engine", transport=httpx.MockTransport(hung))
    evaluation = asyncio.ensure_future(evaluator.evaluate("agent@1"))
    while not asked:
        await asyncio.sleep(0.01)
    started = time.monotonic()
    evaluator.stop(0.2)
    with pytest.raises(EvalError, match="given up: the service is shutting down"):
        await evaluation
    assert 0.2 <= time.monotonic() - started < 2
    with pytest.raises(EvalError, match="given up: the service is shutting down"):
        await evaluator.evaluate("base-model")
    assert asked == ["agent@1"]  # the later eval asked the engine nothing
    await evaluator.aclose()


async def test_an_eval_request_that_timed_out_says_so() -> None:
    # httpx's timeouts carry no message: the decision's reason ended in "for agent@1: " and said nothing more
    def timed_out(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("", request=request)

    async def source() -> list[dict[str, Any]]:
        return [{"messages": [{"role": "user", "content": "3 + 4?"}]}]

    evaluator = Evaluator(source, lambda row, text: 1.0, "http://engine", transport=httpx.MockTransport(timed_out))
    with pytest.raises(EvalError) as info:
        await evaluator.evaluate("agent@1")
    said = "the engine did not answer an eval prompt for agent@1: ReadTimeout: no answer within 600 s"
    assert str(info.value) == said
    await evaluator.aclose()
