"""Fixtures for the plugin tests: the OpenAI-compatible server, and spans kept in memory.

`openai_url` / `served_model` are the session's trainer service (real vLLM, bundled SmolLM2)
unless `ART_TEST_OPENAI_URL` / `ART_TEST_MODEL` name another server.

Async tests here are marked `asyncio(loop_scope="session")`: LangChain's OpenAI client caches
its async HTTP client, which a fresh loop per test would find bound to a closed loop.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

# Keep exports to the (deliberately closed) collector short; set before the exporter exists.
os.environ.setdefault("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "1")

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import art_langgraph
from art_langgraph import ARTChatModel, _tracing
from examples.stack import free_port
from tests.art_langgraph.otlp_receiver import Receiver


class MemoryTracing:
    """The plugin's pipeline pointed at a closed collector port, plus an in-memory exporter."""

    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        self.collector_url = f"http://127.0.0.1:{free_port()}"

    def install(self) -> None:
        """(Re)configure the plugin and attach a fresh in-memory exporter to its provider.

        Fresh, because reconfiguring shuts the previous provider down, exporters included.
        """
        _tracing.configure(collector_url=self.collector_url)
        self.exporter = InMemorySpanExporter()
        _tracing.get_tracer_provider().add_span_processor(SimpleSpanProcessor(self.exporter))


@pytest.fixture(scope="session")
def openai_url(request: pytest.FixtureRequest) -> str:
    """Base URL (`.../v1`) of the OpenAI-compatible server: the session's trainer service.

    `ART_TEST_OPENAI_URL` points the tests at another running server instead (faster while
    developing the plugin alone).
    """
    url = os.environ.get("ART_TEST_OPENAI_URL")
    if url is None:
        url = f"{request.getfixturevalue('trainer_service').url}/v1"
    return url.rstrip("/")


@pytest.fixture(scope="session")
def served_model() -> str:
    """Model name the server answers to (`ART_TEST_MODEL`, default `agent@latest`)."""
    return os.environ.get("ART_TEST_MODEL", "agent@latest")


@pytest.fixture(scope="session")
def memory_tracing() -> MemoryTracing:
    """Session-wide tracing setup; tests that reconfigure call `.install()` afterwards."""
    tracing = MemoryTracing()
    tracing.install()
    return tracing


@pytest.fixture
def spans(memory_tracing: MemoryTracing) -> Iterator[InMemorySpanExporter]:
    """The in-memory exporter, emptied before the test."""
    memory_tracing.exporter.clear()
    yield memory_tracing.exporter


@pytest.fixture
def chat_model(openai_url: str, served_model: str) -> ARTChatModel:
    """An `ARTChatModel` on the test server, short completions.

    One retry, as every OpenAI client has (its default is 2): langchain-openai pools connections
    across models, and a keep-alive connection the server closed between two tests failed a
    request with `ReadError` once (CI of e7d67fd, test_graph_in_rollout_tags_every_llm_span).
    """
    return ARTChatModel(model=served_model, base_url=openai_url, max_tokens=16, temperature=1.0, max_retries=1)


@pytest.fixture
def receivers(memory_tracing) -> Iterator[tuple[Receiver, Receiver]]:
    """(collector stand-in, Langfuse stand-in); the test pipeline is restored afterwards."""
    collector, langfuse = Receiver(), Receiver()
    try:
        yield collector, langfuse
    finally:
        collector.close()
        langfuse.close()
        memory_tracing.install()


@pytest.fixture
def dead_url() -> str:
    """`http://127.0.0.1:<port>` with nothing listening on the port."""
    return f"http://127.0.0.1:{free_port()}"


@pytest.fixture
def add_tool():
    """The `add(a, b)` LangChain tool the agent tests call."""
    from langchain_core.tools import tool

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    return add


Send = Callable[..., Awaitable[None]]
"""`art_langgraph.reward` or `areward`, awaitable either way."""


@pytest.fixture(params=["sync", "async"])
def send(request: pytest.FixtureRequest) -> Send:
    """`reward` or `areward`, each awaitable: both post a late reward the same way (one retry policy, one
    `Authorization`)."""
    if request.param == "async":
        return art_langgraph.areward

    async def sync(*args: Any, **kwargs: Any) -> None:
        art_langgraph.reward(*args, **kwargs)

    return sync
