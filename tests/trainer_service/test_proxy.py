"""The service's proxy to vLLM, against a fake vLLM: a client that leaves stops counting as in flight; a stream
vLLM breaks off ends with an error event; a compressed stream reaches the client decoded.

Both servers run in uvicorn on localhost, so a client's disconnect is a real closed socket.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest
from pydantic import BaseModel, ConfigDict
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tests.served import served
from tests.trainer_service.builders import make_service
from trainer_service.server import create_app
from trainer_service.service import TrainerService


class VLLMRequest(BaseModel):
    """The part of vLLM's request models that decides streaming (`stream: bool | None = False`, pydantic, lax)."""

    model_config = ConfigDict(extra="allow")
    stream: bool | None = False


_CHUNK = b'data: {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "base-model", ' \
         b'"choices": [{"index": 0, "delta": {"content": "5"}}]}\n\n'


class FakeVLLM:
    """A chat endpoint that answers (headers included) only once `answer` is set, and records whether its client
    (the proxy) left while it waited or streamed. It reads `stream` as vLLM does (`VLLMRequest`). `mode` `dies`
    breaks an answer off after its first bytes (the connection drops, as when vLLM dies); `gzip` sends one event
    and `[DONE]` gzip-encoded."""

    def __init__(self) -> None:
        self.arrived = threading.Event()
        self.answer = threading.Event()
        self.client_left = threading.Event()
        self.mode = "endless"
        self.app = Starlette(routes=[Route("/v1/chat/completions", self.chat, methods=["POST"])])

    async def chat(self, request: Request) -> Response:
        body = await request.json()
        self.arrived.set()
        while not self.answer.is_set():
            if await request.is_disconnected():
                self.client_left.set()
                return Response(status_code=499)
            await asyncio.sleep(0.01)
        if not VLLMRequest.model_validate(body).stream:
            if self.mode == "dies":
                return StreamingResponse(self.dying(b'{"choices": [{"message": '), media_type="application/json")
            return JSONResponse({"choices": [{"message": {"content": "5"}}]})
        if self.mode == "gzip":
            return Response(gzip.compress(_CHUNK + b"data: [DONE]\n\n"), media_type="text/event-stream",
                            headers={"Content-Encoding": "gzip"})
        events = self.dying(_CHUNK) if self.mode == "dies" else self.tokens()
        return StreamingResponse(events, media_type="text/event-stream")

    async def dying(self, first: bytes) -> AsyncIterator[bytes]:
        """`first`, then the connection drops mid-answer."""
        yield first
        await asyncio.sleep(0.05)
        raise RuntimeError("vLLM died (a fake's death: uvicorn logs it and drops the connection)")

    async def tokens(self) -> AsyncIterator[bytes]:
        """One event every 20 ms until the proxy closes the stream."""
        try:
            while True:
                yield b'data: {"choices": [{"delta": {"content": "5"}}]}\n\n'
                await asyncio.sleep(0.02)
        finally:
            self.client_left.set()


@pytest.fixture()
def stack(tmp_path: Path) -> Iterator[tuple[FakeVLLM, TrainerService, str]]:
    """The fake vLLM, and a service proxying to it (served); yields both and the service's URL."""
    vllm = FakeVLLM()
    service = make_service(tmp_path, [], [])
    with served(vllm.app) as vllm_url:
        service.engine.base_url = vllm_url
        with served(create_app(service=service)) as url:
            yield vllm, service, url


def open_chat(url: str, *, stream: bool) -> socket.socket:
    """Send a chat request on a raw socket (to close it at will); returns the socket."""
    body = json.dumps({"model": "base-model", "messages": [{"role": "user", "content": "2+3?"}], "stream": stream})
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
    return sock


def wait_until(condition: Callable[[], bool], timeout: float = 5.0) -> bool:
    """Whether `condition` held within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_before_vllm_answers_stops_counting_and_vllm_sees_it_leave(
        stack: tuple[FakeVLLM, TrainerService, str], stream: bool) -> None:
    vllm, service, url = stack
    sock = open_chat(url, stream=stream)
    assert vllm.arrived.wait(10)
    assert service.lender.in_flight == 1
    sock.close()  # before vLLM has sent even its headers
    assert wait_until(lambda: service.lender.in_flight == 0), "the abandoned request is still counted as in flight"
    assert vllm.client_left.wait(5), "the proxy kept waiting on vLLM for a client that left"


def test_a_client_that_leaves_mid_stream_stops_counting_and_the_stream_to_vllm_closes(
        stack: tuple[FakeVLLM, TrainerService, str]) -> None:
    vllm, service, url = stack
    vllm.answer.set()
    sock = open_chat(url, stream=True)
    assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    assert service.lender.in_flight == 1
    sock.close()
    assert wait_until(lambda: service.lender.in_flight == 0), "the abandoned stream is still counted as in flight"
    assert vllm.client_left.wait(5), "the stream from vLLM stayed open for a client that left"


def test_a_stream_vllm_breaks_off_ends_with_an_error_event_the_openai_client_raises(
        stack: tuple[FakeVLLM, TrainerService, str]) -> None:
    vllm, service, url = stack
    vllm.answer.set()
    vllm.mode = "dies"
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    received: list[str | None] = []
    with pytest.raises(openai.APIError, match="stopped answering mid-stream") as failed:
        for chunk in client.chat.completions.create(model="base-model", messages=[{"role": "user", "content": "2+3?"}],
                                                    stream=True):
            received.append(chunk.choices[0].delta.content)
    assert received == ["5"], "the events before the break reach the client"
    assert failed.value.body == {"message": failed.value.message, "type": "server_error", "param": None,
                                 "code": "engine_unavailable"}
    assert wait_until(lambda: service.lender.in_flight == 0)


@pytest.mark.parametrize("stream", ["false", "no", "0", 0, None])
def test_a_stream_value_vllm_reads_as_false_gets_an_answer_in_one_piece(
        stack: tuple[FakeVLLM, TrainerService, str], stream: object) -> None:
    """vLLM reads `"false"` as false and answers in one piece: one vLLM breaks off is a 503, not a cut 200."""
    vllm, service, url = stack
    vllm.answer.set()
    vllm.mode = "dies"
    body = {"model": "base-model", "messages": [{"role": "user", "content": "2+3?"}], "stream": stream}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=10)
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "engine_unavailable"
    assert service.lender.in_flight == 0


@pytest.mark.parametrize("stream", [True, False])
def test_an_answer_carries_one_date_and_one_server_header(stack: tuple[FakeVLLM, TrainerService, str],
                                                           stream: bool) -> None:
    """vLLM's server and the proxy's each set `date` and `server`; a client gets one of each (`date` is single)."""
    vllm, _, url = stack
    vllm.answer.set()
    vllm.mode = "gzip"  # a stream that ends
    body = {"model": "base-model", "messages": [{"role": "user", "content": "2+3?"}], "stream": stream}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=10)
    assert response.status_code == 200
    assert len(response.headers.get_list("date")) == len(response.headers.get_list("server")) == 1


def test_a_compressed_stream_reaches_the_client_decoded(stack: tuple[FakeVLLM, TrainerService, str]) -> None:
    vllm, _, url = stack
    vllm.answer.set()
    vllm.mode = "gzip"
    body = {"model": "base-model", "messages": [{"role": "user", "content": "2+3?"}], "stream": True}
    with httpx.Client(base_url=url, timeout=10) as client, client.stream("POST", "/v1/chat/completions",
                                                                          json=body) as response:
        assert "content-encoding" not in response.headers  # dropped by the proxy: what follows must be plain
        assert response.read() == _CHUNK + b"data: [DONE]\n\n"
