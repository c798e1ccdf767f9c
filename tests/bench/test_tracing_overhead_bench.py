"""`bench/tracing_overhead.py` reports each comparison under the name of the client it measured."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import pytest

import art_langgraph
from bench import tracing_overhead


def test_each_client_is_reported_under_its_own_name(monkeypatch: pytest.MonkeyPatch) -> None:
    measured: list[dict[str, Callable[[str], Any]]] = []
    baselines: list[str] = []

    def run(clients: dict[str, Callable[[str], Any]], rounds: int) -> dict[str, tuple[list[float], list[float]]]:
        measured.append(clients)
        return {name: ([0.01], [0.001]) for name in clients}

    monkeypatch.setattr(art_langgraph, "configure", lambda **_: None)
    monkeypatch.setattr(art_langgraph, "flush", lambda timeout: True)
    monkeypatch.setattr(tracing_overhead, "graph_of", lambda model: model)  # a step's client: the graph's model
    monkeypatch.setattr(tracing_overhead, "run", run)
    monkeypatch.setattr(tracing_overhead, "report", lambda title, samples, baseline: baselines.append(baseline))
    tracing_overhead.measure(argparse.Namespace(collector="http://127.0.0.1:1", trainer="http://127.0.0.1:2",
                                                model="agent@latest", rounds=1, max_tokens=1))
    calls, steps = measured
    assert set(calls) == {"openai", "openai+ids", "art"}
    models = {name: step.__defaults__[0] for name, step in steps.items()}  # type: ignore[attr-defined]
    # "openai" is plain ChatOpenAI in the call table: an agent step asking for the extras is not reported under it
    assert set(models) == {"openai+ids", "art"}
    assert models["openai+ids"].logprobs and models["openai+ids"].extra_body == {"return_token_ids": True}
    assert baselines == ["openai+ids", "openai+ids"]
