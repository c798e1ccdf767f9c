"""The trainer's proxy to vLLM: how `POST /v1/chat/completions` and `POST /v1/completions` (`trainer_service.server`)
send a request on and relay vLLM's answer, streamed or not, and how a shutdown gives up the waits on a vLLM that does
not answer (`EngineWaits`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import httpx
from fastapi import Request
from pydantic import TypeAdapter, ValidationError

from trainer_service.core_lending import EngineRequest
from trainer_service.protocol import ErrorBody, ErrorResponse, ServiceError
from trainer_service.step_bookkeeping import SHUTDOWN_GRACE_S

__all__ = ["CLIENT_CLOSED_REQUEST", "DROPPED_HEADERS", "EngineWaits", "relay", "send_unless_client_leaves", "streams"]

logger = logging.getLogger(__name__)

CLIENT_CLOSED_REQUEST = 499
"""Status logged for a request whose client disconnected before vLLM answered (nginx's convention)."""
DROPPED_HEADERS = {"content-length", "transfer-encoding", "connection", "content-encoding", "keep-alive", "date",
                   "server"}
"""vLLM's answer headers the proxy does not pass on: those of vLLM's connection, and `date` and `server`, which the
proxy's own server sets on every answer (passed on, each came twice)."""
_STREAM = TypeAdapter(bool | None)
"""The type of `stream` in vLLM's request models (pydantic's lax mode: `"false"`, `"no"`, `"0"` and `0` are false)."""


class EngineWaits:
    """The proxy's waits on vLLM (for an answer, its headers, a stream's next chunk), which a shutdown cuts off once
    its grace is over (`cut_off`, by `trainer_service.server`'s `_Server`): uvicorn waits for every open request before
    it stops, and a vLLM that took a request and never answered it held the shutdown for the engine client's timeout
    (1800 s)."""

    def __init__(self) -> None:
        self.cut = False
        """Set by `cut_off`: every wait since is cancelled as it begins."""
        self._scopes: set[anyio.CancelScope] = set()

    @contextlib.contextmanager
    def scope(self) -> Iterator[anyio.CancelScope]:
        """A cancel scope around one wait on vLLM, cancelled by `cut_off` (at once after it)."""
        with anyio.CancelScope() as scope:
            if self.cut:
                scope.cancel()
            self._scopes.add(scope)
            try:
                yield scope
            finally:
                self._scopes.discard(scope)

    def cut_off(self) -> None:
        """Cancel every wait on vLLM, now and from now on; log how many were open."""
        self.cut = True
        if self._scopes:
            logger.warning("shutting down: gave up %d proxied request(s) vLLM had not answered %g s after the shutdown "
                           "began", len(self._scopes), SHUTDOWN_GRACE_S)
        for scope in list(self._scopes):
            scope.cancel()


_GIVEN_UP = (f"{SHUTDOWN_GRACE_S:g} s after the shutdown began, so the service gave it up. Send the request again "
             "once the service is back.")
"""The end of the message of a request a shutdown cut off (`EngineWaits`)."""


def _stream_error(message: str, code: str) -> bytes:
    """The end of a stream that failed: an error event in OpenAI's envelope and `[DONE]`, as vLLM ends its own failed
    streams, so the client raises instead of taking a cut answer for a whole one."""
    error = ErrorResponse(error=ErrorBody(message=message, type="server_error", code=code))
    return f"data: {error.model_dump_json()}\n\ndata: [DONE]\n\n".encode()


async def relay(response: httpx.Response, request_ticket: EngineRequest, waits: EngineWaits) -> AsyncIterator[bytes]:
    """A streamed answer from vLLM, chunk by chunk; the request stops counting when it ends or the client leaves.

    The chunks are decoded (`aiter_bytes`), as the dropped `content-encoding` header says. When vLLM stops
    answering mid-stream (it died or was restarted), or a shutdown cuts the stream off (`waits`), it ends with an
    error event (`_stream_error`).
    """
    chunks = response.aiter_bytes()
    try:
        while True:
            with waits.scope() as scope:  # around the wait only: a cancel scope must not span a generator's `yield`
                chunk = await anext(chunks, None)
            if scope.cancelled_caught:
                yield _stream_error(f"The service is shutting down: vLLM had not finished this stream {_GIVEN_UP}",
                                    "shutting_down")
                return
            if chunk is None:
                return
            yield chunk
    except httpx.HTTPError as exc:
        logger.warning("vLLM stopped answering a streamed request mid-answer: %s", exc)
        yield _stream_error(f"The vLLM engine stopped answering mid-stream: {exc}. See GET /v1/status and the vLLM "
                            "log.", "engine_unavailable")
    finally:
        await response.aclose()
        request_ticket.close()


async def _cancel_when_client_leaves(request: Request, scope: anyio.CancelScope) -> None:
    """Cancel `scope` when the client disconnects (once the body has been read, its only ASGI message left)."""
    await request.receive()
    scope.cancel()


async def send_unless_client_leaves(request: Request, client: httpx.AsyncClient, upstream: httpx.Request, *,
                                    stream: bool, waits: EngineWaits) -> httpx.Response | None:
    """vLLM's answer to `upstream` (its headers when `stream`), or None when the client disconnects first.

    The send is then cancelled, which closes the connection to vLLM, and vLLM aborts the request. Call it once the
    request body has been read.

    Raises:
        ServiceError: 503 `shutting_down` when a shutdown cut the send off (`waits`).
    """
    response: httpx.Response | None = None
    with waits.scope() as scope:
        watcher = asyncio.create_task(_cancel_when_client_leaves(request, scope))
        try:
            response = await client.send(upstream, stream=stream)
        finally:
            watcher.cancel()
    if response is None and waits.cut:
        raise ServiceError(503, "shutting_down", f"The service is shutting down: vLLM had not answered this request "
                           f"{_GIVEN_UP}", type="server_error")
    return response


def streams(body: dict[str, Any]) -> bool:
    """Whether vLLM answers `body` with a stream: its `stream` as vLLM's request models read it.

    A value they refuse (`2`, `"maybe"`, `[]`) is no stream: vLLM answers it with its own 400, in one piece.
    """
    try:
        return bool(_STREAM.validate_python(body.get("stream")))
    except ValidationError:
        return False
