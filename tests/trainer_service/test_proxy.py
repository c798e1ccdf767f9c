"""The service's proxy to vLLM, against a fake vLLM: a client that leaves stops counting as in flight; a stream
vLLM breaks off ends with an error event; a compressed stream reaches the client decoded; a shutdown waits for a
request vLLM holds only the service's grace.

Both servers run in uvicorn on localhost, so a client's disconnect is a real closed socket.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import httpx
import openai
import pytest
from pydantic import BaseModel, ConfigDict
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from collector.listen import bind_address
from examples.stack import free_port
from tests.served import served
from tests.trainer_service.builders import make_service
from trainer_service.server import create_app, serve
from trainer_service.service import TrainerService
from trainer_service.step_bookkeeping import SHUTDOWN_GRACE_S


class VLLMRequest(BaseModel):
    """The part of vLLM's request models that decides streaming (`stream: bool | None = False`, pydantic, lax)."""

    model_config = ConfigDict(extra="allow")
    stream: bool | None = False


_CHUNK = b'data: {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "base-model", ' \
         b'"choices": [{"index": 0, "delta": {"content": "5"}}]}\n\n'


class FakeVLLM:
    """A chat endpoint that answers (headers included) only once `answer` is set, and records whether its client
    (the proxy) left while it waited or streamed. It reads `stream` as vLLM does (`VLLMRequest`). `mode` (or a
    request's own `fake_mode`, which the proxy passes on as it passes any field) `dies` breaks an answer off after
    its first bytes (the connection drops, as when vLLM dies); `gzip` sends one event and `[DONE]` gzip-encoded;
    `silent` answers as `gzip` does only once `released`; `stalls` sends one event, then nothing until `released`;
    `paced` answers in 0.5 s: a stream as 5 events 0.1 s apart, then `[DONE]`."""

    def __init__(self) -> None:
        self.arrived = threading.Event()
        self.arrivals = 0
        self.answer = threading.Event()
        self.released = threading.Event()
        self.client_left = threading.Event()
        self.mode = "endless"
        self.app = Starlette(routes=[Route("/v1/chat/completions", self.chat, methods=["POST"])])

    async def chat(self, request: Request) -> Response:
        body = await request.json()
        mode = body.get("fake_mode", self.mode)
        self.arrivals += 1
        self.arrived.set()
        if not await self.until(self.answer, request) or (mode == "silent" and not await self.until(self.released,
                                                                                                     request)):
            return Response(status_code=499)
        if not VLLMRequest.model_validate(body).stream:
            if mode == "paced":
                await asyncio.sleep(0.5)
            if mode == "dies":
                return StreamingResponse(self.dying(b'{"choices": [{"message": '), media_type="application/json")
            return JSONResponse({"choices": [{"message": {"content": "5"}}]})
        if mode in ("gzip", "silent"):
            return Response(gzip.compress(_CHUNK + b"data: [DONE]\n\n"), media_type="text/event-stream",
                            headers={"Content-Encoding": "gzip"})
        events = {"dies": lambda: self.dying(_CHUNK), "stalls": self.stalling, "paced": self.paced}.get(mode,
                                                                                                     self.tokens)
        return StreamingResponse(events(), media_type="text/event-stream")

    async def until(self, event: threading.Event, request: Request) -> bool:
        """Wait for `event`; False (and `client_left` set) when the proxy leaves first."""
        while not event.is_set():
            if await request.is_disconnected():
                self.client_left.set()
                return False
            await asyncio.sleep(0.01)
        return True

    async def stalling(self) -> AsyncIterator[bytes]:
        """`_CHUNK`, then nothing until `released` (or the proxy leaves), then `[DONE]`."""
        yield _CHUNK
        while not self.released.is_set():
            await asyncio.sleep(0.01)
        yield b"data: [DONE]\n\n"

    async def paced(self) -> AsyncIterator[bytes]:
        """`_CHUNK` 5 times, 0.1 s apart, then `[DONE]`."""
        for _ in range(5):
            yield _CHUNK
            await asyncio.sleep(0.1)
        yield b"data: [DONE]\n\n"

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


def _listens(port: int) -> bool:
    """Whether a server listens on localhost's `port`."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


class _Answer(NamedTuple):
    """A chat request's answer, and when it came."""

    after_sigterm: float
    """Seconds from SIGTERM until the client had all of it."""
    status: int
    body: bytes


def _shut_down_during_chats(vllm: FakeVLLM, tmp_path: Path,
                            chats: list[tuple[str, bool]]) -> tuple[float, list[_Answer], bool]:
    """Serve a service proxying to `vllm` as `art-trainer serve` does (`server.serve`, on the main thread), send it a
    chat request for each `(fake_mode, stream)` of `chats`, and send this process SIGTERM once vLLM has them all;
    vLLM answers 0.5 s later (`FakeVLLM.answer`) and is released 20 s later, so that a shutdown it holds ends.

    Returns:
        the seconds from SIGTERM until `serve` returned, the answers in the order of `chats`, and whether vLLM saw
        the proxy leave a request it held (within 5 s of `serve`'s return, before it was released).
    """
    service = make_service(tmp_path, [], [])
    with served(vllm.app) as vllm_url:
        service.engine.base_url = vllm_url
        port = free_port()
        answers: dict[int, tuple[float, int, bytes]] = {}
        sigterm: list[float] = []

        def chat(index: int, mode: str, stream: bool) -> None:
            body = {"model": "base-model", "messages": [{"role": "user", "content": "2+3?"}], "stream": stream,
                    "fake_mode": mode}
            with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body,
                              timeout=60) as response:
                answer = response.read()
            answers[index] = (time.monotonic(), response.status_code, answer)

        def drive() -> None:
            assert wait_until(lambda: _listens(port), 30)
            clients = [threading.Thread(target=chat, args=(index, *request)) for index, request in enumerate(chats)]
            for client in clients:
                client.start()
            assert wait_until(lambda: vllm.arrivals == len(chats), 10)
            sigterm.append(time.monotonic())
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.5)
            vllm.answer.set()
            vllm.released.wait(20)
            vllm.released.set()
            for client in clients:
                client.join(30)

        previous = signal.signal(signal.SIGTERM, lambda *args: None)  # uvicorn raises it again once shut down
        try:
            driver = threading.Thread(target=drive)
            driver.start()
            serve(create_app(service=service), bind_address("127.0.0.1", port, "a free port"), log_level="warning")
            stopped = time.monotonic()
            left = vllm.client_left.wait(5)
        finally:
            vllm.released.set()
            signal.signal(signal.SIGTERM, previous)
        driver.join(60)
    return stopped - sigterm[0], [_Answer(answers[index][0] - sigterm[0], *answers[index][1:])
                                  for index in range(len(chats))], left


def _shutting_down(error: bytes, *, what: str) -> None:
    """Check that `error` is the envelope of a request given up for a shutdown, naming what vLLM had not done."""
    body = json.loads(error)["error"]
    assert body["code"] == "shutting_down" and body["type"] == "server_error", body
    assert body["message"].startswith(f"The service is shutting down: vLLM had not {what} "
                                      f"{SHUTDOWN_GRACE_S:g} s after the shutdown began"), body


@pytest.mark.parametrize("stream", [True, False])
def test_a_shutdown_waits_for_requests_vllm_holds_only_the_grace_and_lets_those_it_answers_finish(
        tmp_path: Path, stream: bool) -> None:
    """uvicorn waits for every open request before it stops, and the proxy waited on vLLM up to its client's 1800 s:
    a vLLM that took a chat request and never answered it (or stalled mid-stream) held SIGTERM's shutdown until it
    did (here 20 s, when the test releases it). Such a request is now given up once the service's grace is over:
    503 `shutting_down`, or a stream ended with that error event (its 200 is sent already), which OpenAI's client
    raises instead of taking the cut answer for whole. One vLLM answers within the grace gets its whole answer."""
    vllm = FakeVLLM()
    chats = [("paced", stream), ("silent", stream), *([("stalls", True)] if stream else [])]
    stopped, answers, vllm_saw_it_leave = _shut_down_during_chats(vllm, tmp_path, chats)
    assert stopped < SHUTDOWN_GRACE_S + 3, stopped  # was 20 s
    finished, given_up, *stalled = answers
    assert finished.status == 200 and finished.after_sigterm < SHUTDOWN_GRACE_S
    assert finished.body == (_CHUNK * 5 + b"data: [DONE]\n\n" if stream
                             else b'{"choices":[{"message":{"content":"5"}}]}')
    assert given_up.status == 503 and SHUTDOWN_GRACE_S - 0.2 < given_up.after_sigterm < stopped
    _shutting_down(given_up.body, what="answered this request")
    for cut in stalled:
        assert cut.status == 200 and SHUTDOWN_GRACE_S - 0.2 < cut.after_sigterm < stopped
        first, error, done = cut.body.split(b"\n\n", 2)
        assert first + b"\n\n" == _CHUNK and done == b"data: [DONE]\n\n"
        _shutting_down(error.removeprefix(b"data: "), what="finished this stream")
    assert vllm_saw_it_leave, "the proxy kept a given-up request open at vLLM"
