"""A vLLM-shaped OpenAI server on `httpx.MockTransport`, for tests that need known, exact tokens.

It answers `POST /v1/chat/completions` the way vLLM does with `return_token_ids`:
`prompt_token_ids` at the top of a response (on each choice's first chunk when streaming),
`token_ids` and `logprobs` per choice (per chunk when streaming, each chunk tagged with its
choice's `index`, choices interleaved). LangChain's own code paths run against it, the
structured-output stream (`beta.chat.completions.stream`) included; no engine is started.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from art_langgraph import ARTChatModel

PROMPT_IDS = [1, 2, 3]
"""The prompt's token ids, whatever the request."""
STRUCTURED_REPLY = '{"answer": 3}'
"""The content of every choice when the request has a `response_format`."""


def completion_ids(choice: int) -> list[int]:
    """The ids choice `choice` samples (the last one is EOS)."""
    return [10 + choice, 20 + choice, 2]


def logprobs(choice: int) -> list[float]:
    """The sampled logprob of each of choice `choice`'s tokens."""
    return [-0.5 * (position + 1) - choice for position in range(3)]


def _text(choice: int, position: int, structured: bool) -> str:
    if structured:
        return STRUCTURED_REPLY if position == 0 else ""
    return f"<{completion_ids(choice)[position]}>"


def reply_text(choice: int, structured: bool = False) -> str:
    """The content choice `choice` answers with."""
    return "".join(_text(choice, position, structured) for position in range(3))


@dataclass
class FakeEngine:
    """The server: `chat_model(...)` gives an `ARTChatModel` wired to it."""

    model: str = "agent@7"
    """The model name every response carries (policy step 7)."""
    token_ids: bool = True
    """False: an OpenAI-compatible server that ignores `return_token_ids` (no ids at all)."""
    failures: int = 0
    """Answer this many requests with a 500 before serving."""
    stream_breaks_after: int | None = None
    """Cut every stream with a connection error after this many events (a server gone mid-stream)."""
    requests: list[dict[str, Any]] = field(default_factory=list)

    def chat_model(self, **kwargs: Any) -> ARTChatModel:
        """An `ARTChatModel` whose HTTP clients (sync and async) reach this server."""
        return ARTChatModel(
            model="agent@latest",
            base_url="http://fake-engine/v1",
            api_key="test",
            http_client=httpx.Client(transport=httpx.MockTransport(self._handle)),
            http_async_client=httpx.AsyncClient(transport=httpx.MockTransport(self._ahandle)),
            **kwargs,
        )

    async def _ahandle(self, request: httpx.Request) -> httpx.Response:
        return self._handle(request)

    def _handle(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.requests.append(body)
        if self.failures > 0:
            self.failures -= 1
            return httpx.Response(500, json={"error": {"message": "engine restarting", "type": "server_error"}})
        if body.get("stream"):
            events = self._stream(body)
            if self.stream_breaks_after is not None:
                return httpx.Response(200, stream=_BrokenStream(events[: self.stream_breaks_after]),
                                      headers={"content-type": "text/event-stream"})
            return httpx.Response(200, text="".join(events), headers={"content-type": "text/event-stream"})
        return httpx.Response(200, json=self._completion(body))

    def _logprobs(self, choice: int, positions: range) -> dict[str, Any]:
        ids, lps = completion_ids(choice), logprobs(choice)
        return {"content": [{"token": str(ids[p]), "logprob": lps[p], "bytes": [65], "top_logprobs": []}
                            for p in positions]}

    def _completion(self, body: dict[str, Any]) -> dict[str, Any]:
        structured = "response_format" in body
        n = body.get("n") or 1
        choices = []
        for i in range(n):
            choice: dict[str, Any] = {
                "index": i,
                "message": {"role": "assistant", "content": reply_text(i, structured)},
                "finish_reason": "stop",
                "logprobs": self._logprobs(i, range(3)),
            }
            if self.token_ids:
                choice["token_ids"] = completion_ids(i)
            choices.append(choice)
        response = {
            "id": "chatcmpl-fake",
            "object": "chat.completion",
            "created": 0,
            "model": self.model,
            "choices": choices,
            "usage": {"prompt_tokens": 3, "completion_tokens": 3 * n, "total_tokens": 3 + 3 * n},
        }
        if self.token_ids:
            response["prompt_token_ids"] = PROMPT_IDS
        return response

    def _stream(self, body: dict[str, Any]) -> list[str]:
        structured = "response_format" in body
        n = body.get("n") or 1
        head = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 0, "model": self.model}
        chunks = []
        for i in range(n):  # vLLM: one role chunk per choice, each with the prompt's ids
            first = {**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                          "finish_reason": None}]}
            if self.token_ids:
                first["prompt_token_ids"] = PROMPT_IDS
            chunks.append(first)
        for position in range(3):
            for i in range(n):
                choice: dict[str, Any] = {
                    "index": i,
                    "delta": {"content": _text(i, position, structured)},
                    "logprobs": self._logprobs(i, range(position, position + 1)),
                    "finish_reason": "stop" if position == 2 else None,
                }
                if self.token_ids:
                    choice["token_ids"] = [completion_ids(i)[position]]
                chunks.append({**head, "choices": [choice]})
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": 3, "completion_tokens": 3 * n, "total_tokens": 3 + 3 * n}
            chunks.append({**head, "choices": [], "usage": usage})
        return [f"data: {json.dumps(chunk)}\n\n" for chunk in chunks] + ["data: [DONE]\n\n"]


class _BrokenStream(httpx.SyncByteStream, httpx.AsyncByteStream):
    """A response body that sends `events`, then fails as a dropped connection does."""

    def __init__(self, events: list[str]) -> None:
        self._events = events

    def __iter__(self) -> Iterator[bytes]:
        for event in self._events:
            yield event.encode()
        raise httpx.ReadError("the server closed the connection mid-stream")

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for event in self._events:
            yield event.encode()
        raise httpx.ReadError("the server closed the connection mid-stream")
