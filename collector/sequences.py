"""LLM spans → token sequences: pure functions, no I/O.

The spans, in start-time order, are a trajectory's turns. A turn whose prompt starts with
everything the previous sequence holds (prompt and completion, token for token) extends that
sequence; any other turn starts a new one. Prompt tokens get mask 0 and no logprob, sampled
tokens mask 1 and their logprob. A turn that starts a new sequence although its messages
extend the previous turn's messages is recorded as retokenization drift. A turn without token
ids (or with ids that are not whole numbers from 0, or logprobs that do not match them) is left
out, and the sequences are not token-exact.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from art_langgraph import semconv as sc
from collector import foreign
from collector.otlp import SpanRecord
from collector.protocol import Drift, Sequence
from collector.spans import COUNTS, unique_sorted, warn_once, whole_number

__all__ = ["Sequences", "build_sequences", "token_turn"]

log = logging.getLogger(__name__)


def _token_ids(span: SpanRecord, key: str) -> list[int] | None:
    """The span's token ids under `key`: None when absent, or (logged) when not a list of whole numbers from 0."""
    value = span.attributes.get(key)
    if isinstance(value, list) and _whole_numbers(value):
        return value
    if value is not None:  # a negative id would fail the trainer's embedding lookup for the whole batch
        warn_once(log, "span %s: %s is not a list of token ids (whole numbers from 0); turn dropped", span.span_id, key)
    return None


def _whole_numbers(values: list[Any]) -> bool:
    """Whether every item of `values` is an int (not a bool) from 0."""
    if list(map(type, values)).count(int) == len(values):  # the usual list, checked in C
        return not values or min(values) >= 0
    return all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values)


def _logprobs(raw: list[Any]) -> list[float | None]:
    """Each logprob as a float; None for one that is not a number."""
    if list(map(type, raw)).count(float) == len(raw):  # the usual list: `float(v)` would give each `v` back
        return list(raw)
    return [float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None for v in raw]


def token_turn(span: SpanRecord) -> tuple[list[int], list[int], list[float | None]] | None:
    """(prompt ids, completion ids, logprobs) of an LLM span, or None when not token-exact."""
    prompt = _token_ids(span, sc.PROMPT_TOKEN_IDS)
    completion = _token_ids(span, sc.COMPLETION_TOKEN_IDS)
    if prompt is None or completion is None:
        return None
    raw = span.attributes.get(sc.COMPLETION_LOGPROBS)
    if raw is None:
        logprobs: list[float | None] = [None] * len(completion)
    elif isinstance(raw, list) and len(raw) == len(completion):
        logprobs = _logprobs(raw)
    else:
        warn_once(
            log,
            "span %s: %s has %s entries for %d completion tokens; turn dropped",
            span.span_id,
            sc.COMPLETION_LOGPROBS,
            len(raw) if isinstance(raw, list) else type(raw).__name__,
            len(completion),
        )
        return None
    return prompt, completion, logprobs


@dataclass
class Sequences:
    """What `build_sequences` makes of a trajectory's LLM spans."""

    sequences: list[Sequence] = field(default_factory=list)
    token_exact: bool = True
    drift: list[Drift] = field(default_factory=list)


def _extends(messages: list[dict[str, Any]], previous: foreign.Conversation) -> bool:
    """Whether `messages` start with the previous turn's input and output and hold more than its input.

    A turn sent right after the previous reply, with no new message (its input is that turn's input and output),
    extends it too.
    """
    said = previous.input + previous.output
    return (
        bool(said)
        and len(messages) >= len(said)
        and len(messages) > len(previous.input)
        and foreign.same_messages(messages[: len(said)], said)
    )


def _drift(span: SpanRecord, turn: int, prompt: list[int], previous: list[int]) -> Drift:
    position = next((i for i, (a, b) in enumerate(zip(prompt, previous)) if a != b), min(len(prompt), len(previous)))
    return Drift(
        span_id=span.span_id,
        turn=turn,
        position=position,
        expected=previous[position : position + 8],
        got=prompt[position : position + 8],
    )


def build_sequences(llm_spans: Iterable[SpanRecord]) -> Sequences:
    """Turn LLM spans into token sequences, noting turns without token ids and drifting turns."""
    out = Sequences()
    previous = foreign.Conversation()
    for turn_index, span in enumerate(unique_sorted(llm_spans)):
        turn = token_turn(span)
        if turn is None:
            out.token_exact = False
            continue
        prompt, completion, logprobs = turn
        step = whole_number(span.attributes.get(sc.POLICY_STEP), COUNTS[sc.POLICY_STEP])
        talk = foreign.conversation(span.attributes, span_id=span.span_id)
        last = out.sequences[-1] if out.sequences else None
        if last is not None and last.token_ids and prompt[: len(last.token_ids)] == last.token_ids:
            tail = prompt[len(last.token_ids) :]
            last.token_ids += tail + completion
            last.logprobs += [None] * len(tail) + logprobs
            last.assistant_mask += [0] * len(tail) + [1] * len(completion)
            last.policy_step = step
        else:
            if last is not None and _extends(talk.input, previous):
                out.drift.append(_drift(span, turn_index, prompt, last.token_ids))
            out.sequences.append(
                Sequence(
                    token_ids=prompt + completion,
                    logprobs=[None] * len(prompt) + logprobs,
                    assistant_mask=[0] * len(prompt) + [1] * len(completion),
                    policy_step=step,
                )
            )
        previous = talk
    if out.drift:
        log.info("retokenization drift in %d turns (first at span %s)", len(out.drift), out.drift[0].span_id)
    return out
