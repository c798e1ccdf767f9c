"""Spans → trajectory: merging turns, masks, logprob alignment, order and duplicates."""

from __future__ import annotations

import itertools
import json
import logging
import math
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from art_langgraph import semconv as sc
from collector import foreign
from collector import spans as span_readers
from collector.assembly import (
    FactsDigest,
    InvalidReward,
    SpanReward,
    assemble,
    facts,
    model_calls,
    span_problem,
    span_rewards,
    trajectory_key,
)
from collector.groups import TrainingReward
from collector.otlp import SpanRecord
from collector.sequences import build_sequences
from collector.spans import whole_number
from tests.collector.server_helpers import PB, collector_app
from tests.collector.span_builders import TRACE, llm, rollout, sid, to_request


def _assemble(spans, **kwargs):
    options = {"group_id": "g", "complete": True, "rewards": {}, "training": TrainingReward()} | kwargs
    return assemble("r1", spans, **options)


def _sequences(spans):
    built = build_sequences(spans)
    return built.sequences, built.token_exact


TURN1 = dict(start=10, prompt=[1, 2, 3], completion=[4, 5], logprobs=[-0.1, -0.2], step=3)
TURN2 = dict(start=20, prompt=[1, 2, 3, 4, 5, 6, 7], completion=[8], logprobs=[-0.3], step=4)


def test_extending_turn_merges_into_one_sequence() -> None:
    (seq,), exact = _sequences([llm(1, **TURN1), llm(2, **TURN2)])
    assert exact
    assert seq.token_ids == [1, 2, 3, 4, 5, 6, 7, 8]
    assert seq.assistant_mask == [0, 0, 0, 1, 1, 0, 0, 1]
    assert seq.logprobs == [None, None, None, -0.1, -0.2, None, None, -0.3]
    assert seq.policy_step == 4


def test_non_extending_turn_starts_a_new_sequence() -> None:
    # The prompt repeats the first prompt but not the first completion: not an extension.
    other = dict(start=20, prompt=[1, 2, 3, 9], completion=[6, 7], logprobs=[-1.0, -2.0], step=4)
    (first, second), exact = _sequences([llm(1, **TURN1), llm(2, **other)])
    assert exact
    assert (first.token_ids, first.assistant_mask, first.policy_step) == ([1, 2, 3, 4, 5], [0, 0, 0, 1, 1], 3)
    assert second.token_ids == [1, 2, 3, 9, 6, 7]
    assert second.assistant_mask == [0, 0, 0, 0, 1, 1]
    assert second.logprobs == [None, None, None, None, -1.0, -2.0]


def test_third_turn_compares_with_the_latest_sequence() -> None:
    other = dict(start=20, prompt=[9], completion=[10], logprobs=[-1.0])
    third = dict(start=30, prompt=[9, 10, 11], completion=[12], logprobs=[-2.0])
    sequences, _ = _sequences([llm(1, **TURN1), llm(2, **other), llm(3, **third)])
    assert [s.token_ids for s in sequences] == [[1, 2, 3, 4, 5], [9, 10, 11, 12]]
    assert sequences[1].assistant_mask == [0, 1, 0, 1]


def test_order_of_arrival_and_duplicates_do_not_matter() -> None:
    spans = [rollout(9, rewards={"reward": 1.0}), llm(1, **TURN1), llm(2, **TURN2)]
    expected = _assemble(spans)
    shuffled = _assemble([spans[2], spans[0], spans[1], spans[2], spans[1]])
    assert shuffled == expected
    assert len(expected.sequences) == 1


def test_lengths_align_along_every_sequence() -> None:
    traj = _assemble([llm(1, **TURN1), llm(2, **TURN2), llm(3, start=30, prompt=[5], completion=[1, 2, 3])])
    for seq in traj.sequences:
        assert len(seq.token_ids) == len(seq.logprobs) == len(seq.assistant_mask)
        assert all((lp is None) == (m == 0) for lp, m in zip(seq.logprobs, seq.assistant_mask, strict=True))


def test_span_without_token_ids_is_not_token_exact() -> None:
    traj = _assemble([llm(1, **TURN1), llm(2, start=20, prompt=None, completion=None)])
    assert not traj.token_exact
    assert [s.token_ids for s in traj.sequences] == [[1, 2, 3, 4, 5]]


def test_a_failed_attempt_is_no_turn() -> None:
    """A retried call leaves a span with `error.type` and no token ids; the retry alone is the turn."""
    failed = llm(2, start=15, prompt=None, completion=None, messages=[{"role": "user", "content": "q"}])
    failed.attributes[sc.ERROR_TYPE] = "APITimeoutError"
    traj = _assemble([llm(1, **TURN1), failed, llm(3, **TURN2, messages=[{"role": "user", "content": "q"}])])
    assert traj.token_exact
    assert [s.token_ids for s in traj.sequences] == [[1, 2, 3, 4, 5, 6, 7, 8]]
    assert model_calls([failed]) == []


def test_replies_cut_by_length_are_listed_by_their_index_in_the_messages() -> None:
    """The trainer re-tokenizes `messages`: it learns from `length_cut` which replies the model did not end."""
    def call(n: int, history: list[str], reply: str, finish: str | list[str]) -> SpanRecord:
        messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": text} for i, text in enumerate(history)]
        span = llm(n, start=10 * n, prompt=None, completion=None, messages=messages,
                   output=[{"role": "assistant", "content": reply}])
        span.attributes[sc.GEN_AI_RESPONSE_FINISH_REASONS] = finish
        return span

    cut, retried = call(1, ["count"], "1, 2", "length"), call(2, ["count"], "1, 2, 3", ["length"])  # not kept
    spans = [cut, retried, call(3, ["count", "1, 2", "go on"], "3, 4", ["stop"]),
             call(4, ["count", "1, 2", "go on", "3, 4", "more"], "5, 6", ["length"])]
    traj = _assemble(spans)
    assert [m["content"] for m in traj.messages] == ["count", "1, 2", "go on", "3, 4", "more", "5, 6"]
    assert traj.length_cut == [1, 5]
    assert _assemble(spans[2:]).length_cut == [5]  # the first reply came without a span: its reason is unknown


@pytest.mark.parametrize("more", [[{"role": "user", "content": "go on"}], []], ids=["new message", "no new message"])
def test_a_re_rendered_prompt_after_a_reply_is_drift(more: list[dict[str, str]]) -> None:
    """The second turn sends the first turn's messages and reply (and maybe more), but its prompt re-renders token 3."""
    question, reply = [{"role": "user", "content": "count"}], [{"role": "assistant", "content": "1, 2"}]
    spans = [
        llm(1, start=10, prompt=[1, 2, 3], completion=[4, 5], messages=question, output=reply),
        llm(2, start=20, prompt=[1, 2, 9, 4, 5, 6], completion=[7], messages=question + reply + more, output=reply),
    ]
    built = build_sequences(spans)
    assert [s.token_ids for s in built.sequences] == [[1, 2, 3, 4, 5], [1, 2, 9, 4, 5, 6, 7]]
    assert [(d.span_id, d.turn, d.position, d.expected, d.got) for d in built.drift] == [
        (spans[1].span_id, 1, 2, [3, 4, 5], [9, 4, 5, 6])
    ]


def test_a_retry_of_the_same_messages_is_no_drift() -> None:
    question, reply = [{"role": "user", "content": "count"}], [{"role": "assistant", "content": "1, 2"}]
    spans = [llm(n, start=10 * n, prompt=[1, 2, 3], completion=[3 + n], messages=question, output=reply)
             for n in (1, 2)]
    built = build_sequences(spans)
    assert len(built.sequences) == 2 and built.drift == []


def test_logprob_count_mismatch_drops_the_turn() -> None:
    traj = _assemble([llm(1, start=1, prompt=[1], completion=[2, 3], logprobs=[-0.1])])
    assert not traj.token_exact and traj.sequences == []


def test_a_logprob_that_is_no_number_is_unknown() -> None:
    """A mixed-type OTLP array may carry a bool or text; neither is a log-probability (True is no 1.0)."""
    sequences, exact = _sequences([llm(1, start=1, prompt=[1], completion=[2, 3, 4], logprobs=[True, "x", -0.5])])
    assert exact and sequences[0].logprobs == [None, None, None, -0.5]


@pytest.mark.parametrize("ids", [dict(prompt=[1, -7], completion=[2]), dict(prompt=[1], completion=[2, -1])])
def test_a_negative_token_id_drops_the_turn(ids: dict[str, list[int]], caplog: pytest.LogCaptureFixture) -> None:
    """No embedding has a negative row: such a turn would fail the trainer's whole step."""
    traj = _assemble([llm(1, **TURN1), llm(2, start=20, **ids)])
    assert not traj.token_exact
    assert [s.token_ids for s in traj.sequences] == [[1, 2, 3, 4, 5]]
    assert "span 0000000000000002: art." in caplog.text and "turn dropped" in caplog.text


def test_a_bad_span_is_logged_once_however_often_its_trajectory_is_read(caplog: pytest.LogCaptureFixture) -> None:
    """Each read assembles the trajectory again (the web page, `GET /v1/trajectories`, a lease): a bad span's warning
    is logged at the first only, while another span's still is."""
    for _ in range(3):
        _assemble([llm(1, **TURN1), llm(2, start=20, prompt=[1, -7], completion=[2])])
    _assemble([llm(1, **TURN1), llm(3, start=20, prompt=[1, -7], completion=[2])])
    dropped = [r.getMessage() for r in caplog.records if "turn dropped" in r.getMessage()]
    assert [message.split(":")[0] for message in dropped] == ["span 0000000000000002", "span 0000000000000003"]


def test_warnings_logged_once_are_forgotten_oldest_first(monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(span_readers, "WARNINGS_KEPT", 2)
    logger = logging.getLogger("tests.warn_once")
    for span_id in ["a", "b", "a", "c", "a", "b"]:  # "b" is forgotten once "c" comes; "a", logged since, is kept
        span_readers.warn_once(logger, "span %s: bad", span_id)
    assert [r.getMessage() for r in caplog.records if r.name == logger.name] == [
        "span a: bad", "span b: bad", "span c: bad", "span b: bad"
    ]


class _Id(int):
    """An int subclass other than bool: a whole number, so a token id."""


_ODD_IDS = [True, False, 3.0, -1, 2**70, None, "5", _Id(4), 0]
_ODD_LOGPROBS = [True, 1, _Id(2), None, "x", math.inf, -0.0, 2**70]


def _random_turn(rng: random.Random, n: int, tokens: list[Any], said: list[dict[str, Any]]) -> SpanRecord:
    """A random LLM span of a trajectory whose latest sequence holds `tokens` and whose latest turn said `said`:
    extending, drifting, unrelated, odd ids or logprobs, without ids, its messages in another convention."""
    kind = rng.choice(["extend", "extend", "extend", "drift", "fresh", "odd"])
    prompt = [rng.randrange(6) for _ in range(rng.randrange(3))]
    if kind in ("extend", "drift", "odd"):
        prompt = tokens + prompt
    if kind == "drift" and prompt:
        prompt[rng.randrange(len(prompt))] = rng.randrange(6)
    completion = [rng.randrange(6) for _ in range(rng.randrange(4))]
    if kind == "odd":
        ids = rng.choice([prompt, completion])
        ids.insert(rng.randrange(len(ids) + 1), rng.choice(_ODD_IDS))
    logprobs = [rng.choice([-0.5, -1.25, rng.choice(_ODD_LOGPROBS)]) for _ in completion]
    more = rng.choice([[], [{"role": "user", "content": "go on"}]])
    messages = rng.choice([said + more, said + more, said[:1], [{"role": "user", "content": str(n)}]])
    output = [{"role": "assistant", "content": rng.choice(["a", "b"])}]
    span = llm(n, start=10 * rng.randrange(6), prompt=prompt, completion=completion, logprobs=logprobs,
               step=rng.choice([n, 2.0, -1, None]), messages=messages, output=output)
    attributes = span.attributes
    if rng.random() < 0.2:  # a foreign call: its messages in OpenLLMetry's flattened convention, maybe no ids
        for key in (sc.GEN_AI_INPUT_MESSAGES, sc.GEN_AI_OUTPUT_MESSAGES):
            del attributes[key]
        for prefix, listed in (("gen_ai.prompt", messages), ("gen_ai.completion", output)):
            for i, message in enumerate(listed):
                attributes |= {f"{prefix}.{i}.role": message["role"], f"{prefix}.{i}.content": message["content"]}
        if rng.random() < 0.5:
            del attributes[sc.PROMPT_TOKEN_IDS], attributes[sc.COMPLETION_TOKEN_IDS]
    if rng.random() < 0.1:
        attributes[rng.choice([sc.PROMPT_TOKEN_IDS, sc.COMPLETION_TOKEN_IDS])] = "1,2"
    if rng.random() < 0.15:
        attributes[sc.COMPLETION_LOGPROBS] = rng.choice([None, "x", logprobs + [-0.5], logprobs[1:]])
        if attributes[sc.COMPLETION_LOGPROBS] is None:
            del attributes[sc.COMPLETION_LOGPROBS]
    return span


def _token_ids(value: Any) -> list[Any] | None:
    """A list of whole numbers from 0 (ints, not bools), else None."""
    if not isinstance(value, list):
        return None
    for v in value:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            return None
    return value


def _plain_extends(messages: list[dict[str, Any]], said: tuple[list[dict[str, Any]], list[dict[str, Any]]]) -> bool:
    """Whether `messages` say all the previous turn said (sent, returned), and more than it sent."""
    before = said[0] + said[1]
    return bool(before) and len(messages) > len(said[0]) and foreign.same_messages(messages[: len(before)], before) \
        and len(messages) >= len(before)


def _plain_build(spans: list[SpanRecord]) -> tuple[list[tuple[Any, ...]], bool, list[tuple[Any, ...]], set[Any]]:
    """`build_sequences` as its docstring tells it, token by token: (sequences, token_exact, drift, warned), each
    sequence (ids, logprobs, mask, step), each drift (span id, turn, position, expected, got), warned the (span id,
    attribute) of each turn dropped for a bad attribute."""
    first: dict[str, SpanRecord] = {}
    for span in spans:
        first.setdefault(span.span_id, span)
    sequences: list[tuple[list[Any], list[Any], list[int], Any]] = []
    exact, drift, warned = True, [], set()
    said: tuple[list[dict[str, Any]], list[dict[str, Any]]] = ([], [])
    for turn, span in enumerate(sorted(first.values(), key=lambda s: (s.start_ns, s.end_ns, s.span_id))):
        ids = {key: span.attributes.get(key) for key in (sc.PROMPT_TOKEN_IDS, sc.COMPLETION_TOKEN_IDS)}
        warned |= {(span.span_id, key) for key, value in ids.items() if value is not None and _token_ids(value) is None}
        prompt, completion = (_token_ids(value) for value in ids.values())
        raw = span.attributes.get(sc.COMPLETION_LOGPROBS)
        if prompt is None or completion is None:
            exact = False
            continue
        if raw is not None and not (isinstance(raw, list) and len(raw) == len(completion)):
            warned.add((span.span_id, sc.COMPLETION_LOGPROBS))
            exact = False
            continue
        logprobs = [None] * len(completion) if raw is None else [
            float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None for v in raw]
        step = whole_number(span.attributes.get(sc.POLICY_STEP), 0)
        talk = foreign.conversation(span.attributes, span_id=span.span_id)
        last = sequences[-1][0] if sequences else None
        if last and len(prompt) >= len(last) and all(a == b for a, b in zip(prompt, last)):
            ids_, lps, mask, _ = sequences.pop()
        else:
            if last is not None and _plain_extends(talk.input, said):
                at = next((i for i, (a, b) in enumerate(zip(prompt, last)) if a != b), min(len(prompt), len(last)))
                drift.append((span.span_id, turn, at, last[at : at + 8], prompt[at : at + 8]))
            ids_, lps, mask = [], [], []
        for token in prompt[len(ids_) :]:
            ids_, lps, mask = [*ids_, token], [*lps, None], [*mask, 0]
        for token, logprob in zip(completion, logprobs):
            ids_, lps, mask = [*ids_, token], [*lps, logprob], [*mask, 1]
        sequences.append((ids_, lps, mask, step))
        said = (talk.input, talk.output)
    return sequences, exact, drift, warned


def test_build_sequences_matches_a_plain_reading_of_its_rules(caplog: pytest.LogCaptureFixture) -> None:
    """Random trajectories (merges, drift, drops, odd ids and logprobs, foreign calls, duplicates, ties in time):
    `build_sequences` (which checks the usual lists in a faster way) gives what its rules say, warnings included."""
    rng = random.Random(7)
    for trajectory in range(400):
        spans: list[SpanRecord] = []
        tokens: list[Any] = []
        said: list[dict[str, Any]] = []
        for n in range(1, rng.randrange(2, 7)):
            span = _random_turn(rng, n, tokens, said)
            spans.append(span)
            prompt, completion = (span.attributes.get(key) for key in (sc.PROMPT_TOKEN_IDS, sc.COMPLETION_TOKEN_IDS))
            tokens = prompt + completion if isinstance(prompt, list) and isinstance(completion, list) else tokens
            talk = foreign.conversation(span.attributes)
            said = talk.input + talk.output
        if rng.random() < 0.2:
            spans.append(replace(rng.choice(spans), start_ns=0))  # a duplicate span id: the first one counts
        span_readers.forget_warnings()
        caplog.clear()
        built = build_sequences(spans)
        dropped = [r.getMessage().split(" ")[1:3] for r in caplog.records if "turn dropped" in r.getMessage()]
        got = (
            [(s.token_ids, s.logprobs, s.assistant_mask, s.policy_step) for s in built.sequences],
            built.token_exact,
            [(d.span_id, d.turn, d.position, d.expected, d.got) for d in built.drift],
            {(span_id.rstrip(":"), key) for span_id, key in dropped},
        )
        assert got == _plain_build(spans), f"trajectory {trajectory}"


def test_messages_tools_model_metadata_and_rewards() -> None:
    tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
    first = llm(1, **TURN1, messages=[{"role": "user", "content": "old"}],
                output=[{"role": "assistant", "content": "a"}])
    last = llm(
        2, **TURN2, model="agent@4", tools=tools,
        messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                  {"role": "user", "content": "more"}],
        output=[{"role": "assistant", "content": "b"}],
    )
    root = rollout(9, group="g1", task="add", split="val", rewards={"reward": 0.5, "len": 2.0}, metadata={"k": 1})
    traj = _assemble([last, root, first], rewards={"reward": 0.9, "len": 2.0, "judge": 0.1}, group_id="g1")
    assert traj.messages == [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
        {"role": "user", "content": "more"}, {"role": "assistant", "content": "b"},
    ]
    assert traj.tools == tools and traj.model == "agent@4"
    assert (traj.id, traj.trace_id, traj.group_id, traj.task, traj.split) == ("r1", TRACE, "g1", "add", "val")
    assert traj.metadata == {"k": 1}
    assert traj.rewards == {"reward": 0.9, "len": 2.0, "judge": 0.1}
    assert traj.reward == 0.9
    assert _assemble([root], rewards=traj.rewards, training=TrainingReward("len")).reward == 2.0
    assert _assemble([root], rewards=traj.rewards, training=TrainingReward("missing")).reward is None
    weighted = TrainingReward(weights={"reward": 1.0, "len": 0.5})
    assert _assemble([root], rewards=traj.rewards, training=weighted).reward == pytest.approx(1.9)
    assert _assemble([root], rewards={"reward": 1.0}, training=weighted).reward is None


def test_invalid_json_attribute_is_ignored() -> None:
    span = llm(1, **TURN1)
    span.attributes["gen_ai.input.messages"] = "{not json"
    assert _assemble([span]).messages == []


def test_facts_group_key_falls_back_to_task_then_id() -> None:
    assert facts("r1", [rollout(1, group="g", task="t", size=4)]).group_key == "g"
    with_task = facts("r1", [rollout(1, task="t")])
    assert (with_task.group_key, with_task.explicit_group, with_task.group_size) == ("t", False, None)
    bare = facts("r1", [llm(2, start=1, prompt=[1], completion=[2])])
    assert (bare.group_key, bare.has_rollout_span, bare.has_llm, bare.split) == ("r1", False, True, "train")


def test_facts_digest_in_any_order_and_pieces_equals_facts_of_all() -> None:
    child = llm(4, start=0, prompt=[1], completion=[2])
    child.attributes["art.group"] = "child"  # before the rollout span, which still wins
    spans = [
        llm(2, start=5, task="late", prompt=[1], completion=[2]),
        llm(3, start=1, task="early", prompt=[1], completion=[2]),
        child,
        rollout(1, group="g", size=3, split="val"),
    ]
    expected = facts("r1", spans)
    assert (expected.group_key, expected.task, expected.group_size, expected.split) == ("g", "early", 3, "val")
    for order in itertools.permutations(spans):
        for cut in range(len(order) + 1):
            digest = FactsDigest.of(order[:cut])
            digest = FactsDigest.from_json(digest.to_json())  # as the store keeps it between exports
            digest.add(order[cut:] + order[:1])  # a duplicate changes nothing
            assert digest.facts("r1") == expected
            merged = FactsDigest.of(order[:cut])
            merged.merge(FactsDigest.of(order[max(cut - 1, 0):]))
            assert json.loads(merged.to_json()) == json.loads(FactsDigest.of(spans).to_json())
    with pytest.raises(ValueError, match="no spans"):
        FactsDigest().facts("r1")


def test_facts_digest_orders_spans_of_one_id_in_two_traces_by_trace_id() -> None:
    """Spans of two traces in one trajectory (a resumed run) may share a span id, start and end, as stored since
    spans are keyed by (trace id, span id): the digest takes the first by trace id too, as `unique_sorted` orders
    them, whatever order they come in; a digest stored before it (parts without a trace id) still reads."""
    rollouts = [rollout(5, "r1", trace=trace * 32, group=f"g{trace}") for trace in "ab"]
    calls = [llm(6, rollout="r1", trace=trace * 32, start=1, task=f"t{trace}", prompt=[1], completion=[2])
             for trace in "ab"]
    for spans in (rollouts, calls):
        expected = facts("r1", spans)
        assert expected.trace_id == "a" * 32 and "a" in f"{expected.group_key}{expected.task}"
        for order in (spans, spans[::-1]):
            assert FactsDigest.of(order).facts("r1") == expected
            merged = FactsDigest.of(order[:1])
            merged.merge(FactsDigest.of(order[1:]))
            assert merged.facts("r1") == expected
    stored = FactsDigest.from_json(json.dumps({"rollout": None, "first": [1, 11, sid(6), "b" * 32],
                                               "attrs": {sc.TASK: [1, 11, sid(6), "tb"]}, "llm": True}))
    assert stored.facts("r1").task == "tb"


def test_facts_digest_tells_calls_of_other_instrumentations_only() -> None:
    """`foreign_only` survives storage and merges; a digest stored before it existed counts its calls as ours, so a
    trajectory stored then is kept as it was."""
    theirs = SpanRecord(TRACE, sid(3), None, "chat", 5, 15, {
        "gen_ai.operation.name": "chat", "gen_ai.input.messages": json.dumps([{"role": "user", "content": "hi"}])})
    ours = llm(2, rollout=None, start=10, prompt=[1], completion=[2])
    stored = FactsDigest.from_json(FactsDigest.of([theirs]).to_json())
    assert stored.foreign_only
    assert not FactsDigest().foreign_only and not FactsDigest.of([rollout(1)]).foreign_only
    stored.merge(FactsDigest.of([ours]))
    assert not stored.foreign_only
    older = json.loads(FactsDigest.of([theirs]).to_json())
    del older["ours"]
    assert not FactsDigest.from_json(json.dumps(older)).foreign_only


def test_trajectory_key() -> None:
    assert trajectory_key(llm(1, start=1, prompt=[1], completion=[2])) == ("r1", True)
    assert trajectory_key(llm(1, rollout=None, start=1, prompt=[1], completion=[2])) == (TRACE, False)


_UUID = "123e4567-e89b-12d3-a456-426614174000"


def test_a_rollout_id_that_is_a_uuid_keys_its_trajectory_by_its_hex_digits() -> None:
    """Every usual text form of one UUID names one trajectory, of the 32 lower-case hex digits the plugin writes and
    sends (before, a reward by them never reached a trajectory another tracer wrote with dashes). Text that
    `uuid.UUID` would read too but is no such form (misplaced dashes, an underscore, white space, a non-ASCII letter
    that folds to hex, `urn:uuid:` with braces) is an id of its own, kept as written, as any other id."""
    hex_digits = _UUID.replace("-", "")
    uuids = [_UUID, _UUID.upper(), "{" + _UUID + "}", "{" + _UUID.upper() + "}", "urn:uuid:" + _UUID,
             "URN:UUID:" + _UUID, hex_digits, hex_digits.upper(), "urn:uuid:" + hex_digits]
    others = ["r1", "{" + _UUID, _UUID + "}", " " + _UUID, _UUID + "\n", "urn:uuid:{" + _UUID + "}", "uuid:" + _UUID,
              _UUID.replace("-", "", 1), _UUID[:-1] + "g", _UUID[:-1] + "\u212a", "1_" + hex_digits[2:],
              hex_digits[:-1], hex_digits + "0"]
    keys = {written: trajectory_key(llm(1, rollout=written, start=1, prompt=[1], completion=[2])) for written in
            uuids + others}
    assert keys == {**{written: (hex_digits, True) for written in uuids}, **{other: (other, True) for other in others}}


@pytest.mark.parametrize("value", [math.nan, math.inf, "1.0", None])
def test_non_finite_reward_event_is_rejected(value: object) -> None:
    span = rollout(1, rewards={"reward": 0.0})
    span.events[0].attributes["art.reward.value"] = value
    with pytest.raises(InvalidReward, match="finite number"):
        span_rewards(span)


def test_reward_events_only_count_on_rollout_spans() -> None:
    span = llm(1, **TURN1)
    span.events.append(rollout(2, rewards={"reward": 1.0}).events[0])
    assert span_rewards(span) == []
    assert (span_rewards(rollout(2, rewards={"reward": 1, "x": -2.5}))
            == [SpanReward("reward", 1.0, 50), SpanReward("x", -2.5, 50)])


def test_reward_time_beyond_the_store_range_rejects_the_span() -> None:
    """An OTLP time is 64 bits unsigned, the store's reward time signed: such a reward made the whole export a 500."""
    span = rollout(1, rewards={"reward": 1.0})
    assert span_problem(span) is None
    span.events[0] = replace(span.events[0], time_ns=2**64 - 1)
    assert span_problem(span) == "reward 'reward' has a time beyond year 2262"


def test_a_rollout_id_equal_to_a_trace_id_is_one_trajectory_in_any_export(tmp_path: Path) -> None:
    """A rollout id that is also the id of a trace of foreign model calls (LangSmith's OTel export uses the root run's
    id, which the plugin takes as a graph run's rollout id) names one trajectory row: in one export the two made the
    row twice, the whole export a 500, retried for ever. The rollout's trajectory it is, from the spans of both."""
    shared = "ab" * 16
    ours = [rollout(1, shared, trace="cd" * 16, task="t"),
            llm(2, rollout=shared, trace="cd" * 16, start=10, prompt=[1], completion=[2])]
    foreign = SpanRecord(shared, sid(3), None, "chat", 5, 15, {
        "gen_ai.operation.name": "chat", "gen_ai.input.messages": json.dumps([{"role": "user", "content": "hi"}])})
    for n, exports in enumerate(([ours + [foreign]], [ours, [foreign]])):
        client = TestClient(collector_app(tmp_path / str(n)))
        for spans in exports:
            response = client.post("/v1/traces", content=to_request(spans).SerializeToString(), headers=PB)
            assert response.status_code == 200
        found = client.get(f"/v1/trajectories/{shared}").json()
        assert (found["trace_id"], found["group_id"], found["complete"]) == ("cd" * 16, "t", True)
        assert found["token_exact"]
        assert len(found["sequences"]) == 1


@pytest.mark.parametrize("key", [sc.ROLLOUT_ID, sc.GROUP, sc.TASK, sc.SPLIT])
@pytest.mark.parametrize("value", [5, 0, True, ["a", "b"], {"a": "b"}])
def test_an_identity_attribute_that_is_no_string_rejects_the_span(key: str, value: object) -> None:
    """The plugin writes these as strings; another value was read anyway: a rollout id of 5 left its rollout span
    and every reward to rollout "5" out of the rollout (keyed by trace instead), a group of ["a", "b"] made a group
    named "['a', 'b']", a group of 0 none at all."""
    span = rollout(1)
    span.attributes[key] = value
    assert span_problem(span) == f"attribute {key} is a {type(value).__name__}; it must be a string"


@pytest.mark.parametrize(("attributes", "problem"), [
    ({"rollout_id": "."}, "attribute art.rollout.id '.' has a path segment"),
    ({"rollout_id": "runs/../r2"}, "attribute art.rollout.id 'runs/../r2' has a path segment"),
    ({"group": ".."}, "attribute art.group '..' has a path segment"),
    ({"group": "a/./b", "task": "t"}, "attribute art.group 'a/./b' has a path segment"),
    ({"task": "./tasks/a.json"}, "attribute art.task './tasks/a.json' (the group id, as the span has no art.group)"),
])
def test_an_id_with_a_dot_segment_rejects_the_span(attributes: dict[str, str], problem: str) -> None:
    """HTTP clients drop a path segment `.` or `..`: a trajectory or group with one in its id could never be reached
    by `GET /v1/trajectories/{id}` or `/v1/groups/{id}/judge`, and `a/../b` reached `b` instead."""
    found = span_problem(rollout(1, **attributes))
    assert found is not None and found.startswith(problem) and found.endswith("which HTTP clients drop from a URL")


@pytest.mark.parametrize("attributes", [
    {"rollout_id": "..."}, {"rollout_id": "v1.0/.hidden"}, {"group": "g.", "task": "."}, {"task": ".x"},
])
def test_dots_that_are_no_path_segment_are_fine(attributes: dict[str, str]) -> None:
    """Only a whole segment `.` or `..` is dropped; a task is no path id when art.group names the group."""
    assert span_problem(rollout(1, **attributes)) is None
