"""Seed data for the judge, Langfuse and web-page tests: complete groups of answered questions."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI

from collector.otlp import SpanRecord
from tests.collector import span_builders as sb
from tests.collector.server_helpers import collector_app

QUESTION = [
    {"role": "system", "content": "You add numbers. Reply with only the number."},
    {"role": "user", "content": "What is 3 + 4?"},
]



def trace_id(group: str, n: int) -> str:
    """A deterministic 32-hex trace id for member `n` of `group`."""
    return hashlib.sha256(f"{group}/{n}".encode()).hexdigest()[:32]


def group_spans(
    group: str,
    answers: list[str],
    *,
    rewards: list[float] | None = None,
    steps: list[int] | None = None,
    task: str = "add",
    complete: bool = True,
    tool_call: bool = False,
    first_span: int = 1,
) -> list[SpanRecord]:
    """Spans of one group: member i answers `answers[i]` (rollout ids `{group}-{i}`)."""
    records: list[SpanRecord] = []
    for i, answer in enumerate(answers):
        rid, trace = f"{group}-{i}", trace_id(group, i)
        output: list[dict[str, Any]] = [{"role": "assistant", "content": answer}]
        if tool_call:
            output = [{"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 3, "b": 4}'}}
            ]}]
        n = first_span + 10 * i
        records.append(
            sb.llm(n, rollout=rid, trace=trace, start=10, prompt=[1, 2, 3, 4], completion=[5, 6, 7],
                   step=(steps[i] if steps else 0), task=task, messages=QUESTION, output=output, model="agent@0")
        )
        if complete:
            reward = {"reward": rewards[i]} if rewards is not None else None
            records.append(sb.rollout(n + 1, rid, trace=trace, group=group, task=task, size=len(answers),
                                      rewards=reward))
    return records


def make_app(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, env: dict[str, str] | None = None,
             **fields: Any) -> FastAPI:
    """The collector's app on a fresh SQLite file, with `env` set (e.g. `ART_COLLECTOR_JUDGE_*`)."""
    for key, value in (env or {}).items():
        monkeypatch.setenv(key, value)
    return collector_app(tmp_path, **fields)
