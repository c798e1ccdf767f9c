"""Tests of the HTTP call to a judge (`collector/judge_client.py`) against local sockets: time and size bounds,
status classes, answers that are not usable scores."""

from __future__ import annotations

import contextlib
import email.utils
import gzip
import json
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from collector.judge_client import JudgeClient, _shut
from collector.ruler import JudgeError, response_format

USER = {"role": "user", "content": "Score these."}


def _client_answering(status: int, body: object) -> JudgeClient:
    """A `JudgeClient` whose endpoint answers every call with HTTP `status` and `body` (JSON, or text as it is)."""

    def chat(request: httpx.Request) -> httpx.Response:
        if isinstance(body, str):
            return httpx.Response(status, text=body)
        return httpx.Response(status, json=body)

    client = JudgeClient("http://judge/v1", "m")
    client._http = httpx.Client(transport=httpx.MockTransport(chat))
    return client


_COMPLETION = json.dumps({"choices": [{"message": {"content": "{}"}, "finish_reason": "stop"}]}).encode()


def _read_request(conn: socket.socket) -> bool:
    """Read one HTTP request with a `Content-Length` body from `conn`: left unread, a close resets the connection.
    False when the client closed the connection before a request."""
    data = b""
    while b"\r\n\r\n" not in data:
        if not (chunk := conn.recv(1 << 16)):
            return False
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line for line in head.lower().split(b"\r\n") if line.startswith(b"content-length:"))[15:])
    while len(body) < length:
        body += conn.recv(1 << 16)
    return True


@contextlib.contextmanager
def _serving(parts: list[bytes], step: float) -> Iterator[tuple[JudgeClient, threading.Event]]:
    """A client of a real local judge that answers one call with `parts`, one each `step` seconds, and an event set
    when the client hung up before the judge sent them all."""
    server = socket.create_server(("127.0.0.1", 0))
    cut = threading.Event()

    def answer() -> None:
        conn, _ = server.accept()
        with conn:
            conn.settimeout(10)
            _read_request(conn)
            for part in parts:
                time.sleep(step)
                try:
                    conn.sendall(part)
                except OSError:  # the client shut its socket
                    cut.set()
                    return
            while conn.recv(1 << 16):  # closed once the client is done: no reset cuts the answer short
                pass

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        yield JudgeClient(f"http://127.0.0.1:{server.getsockname()[1]}/v1", "m", timeout=1.0), cut
    finally:
        thread.join(timeout=30)
        server.close()


def _head(length: int) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % length


def test_a_judge_that_sends_its_headers_slowly_is_cut_at_the_timeout() -> None:
    """httpx's timeout bounds each read: a judge sending its status line and headers a byte at a time held a call (and
    the run, and a judge request) as long as it liked, the whole answer read; now it is cut at `timeout`."""
    head = _head(len(_COMPLETION))
    slow = b"X-Slow: y\r\n" * 4
    parts = [head[:-2], *(slow[i:i + 1] for i in range(len(slow))), b"\r\n", _COMPLETION]
    with _serving(parts, 0.1) as (client, cut), pytest.raises(JudgeError, match="no whole answer within 1 s") as caught:
        client.complete([USER], response_format(1), temperature=0, max_tokens=64)
    assert caught.value.code == "judge_unreachable"
    assert cut.is_set()


def test_a_judge_that_sends_its_body_slowly_is_cut_at_the_timeout() -> None:
    parts = [_head(len(_COMPLETION)), *(_COMPLETION[i:i + 2] for i in range(0, len(_COMPLETION), 2))]
    with _serving(parts, 0.1) as (client, cut), pytest.raises(JudgeError, match="no whole answer within 1 s") as caught:
        client.complete([USER], response_format(1), temperature=0, max_tokens=64)
    assert caught.value.code == "judge_unreachable"
    assert cut.is_set()


def test_an_answer_in_time_is_read_whole() -> None:
    with _serving([_head(len(_COMPLETION)), _COMPLETION], 0.0) as (client, cut):
        assert client.complete([USER], response_format(1), temperature=0, max_tokens=64) == "{}"
    assert not cut.is_set()


def test_an_answer_past_max_answer_bytes_is_left_unread() -> None:
    """A judge sending a huge body had it read whole into memory (300 MB took 1.5 GB)."""
    size = 64 * 1024 * 1024
    with _serving([_head(size), *[b" " * (1 << 20)] * 64], 0.0) as (client, cut):
        client.max_answer_bytes = 4096
        with pytest.raises(JudgeError, match="body past 4096 bytes, left unread") as caught:
            client.complete([USER], response_format(1), temperature=0, max_tokens=64)
    assert caught.value.code == "judge_http_error"
    assert cut.is_set()


def test_an_answer_of_max_answer_bytes_is_read() -> None:
    with _serving([_head(len(_COMPLETION)), _COMPLETION], 0.0) as (client, _):
        client.max_answer_bytes = len(_COMPLETION)
        assert client.complete([USER], response_format(1), temperature=0, max_tokens=64) == "{}"


def test_a_body_running_to_the_close_still_coming_at_the_timeout_is_cut() -> None:
    """A body without a length ends at the connection's close: the socket shut at the deadline ended it there, no
    error, and the cut answer was read as the judge's (`judge_http_error`, "no chat completion")."""
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n"
    parts = [head, *(_COMPLETION[i:i + 2] for i in range(0, len(_COMPLETION), 2))]
    with _serving(parts, 0.1) as (client, cut), pytest.raises(JudgeError, match="no whole answer within 1 s") as caught:
        client.complete([USER], response_format(1), temperature=0, max_tokens=64)
    assert caught.value.code == "judge_unreachable"
    assert cut.is_set()


def test_a_connection_another_call_opened_is_not_reused() -> None:
    """A call is bounded by shutting the sockets it opens: httpcore's pool can hand a connection that turned idle to a
    waiting call before it closes it (1 call in about 600, 50 at once), and that call's slow answer ran unbounded. Here
    a pool keeping its idle connections stands for that race: every call must still open, and watch, its own."""
    server = socket.create_server(("127.0.0.1", 0))
    calls, cut = [], threading.Event()

    def serve(conn: socket.socket) -> None:
        with conn:
            conn.settimeout(10)
            while _read_request(conn):
                calls.append(conn)
                slow = len(calls) > 1  # the second call's answer comes 2 bytes each 0.1 s, past its 1 s
                parts = [_head(len(_COMPLETION)), _COMPLETION] if not slow else [
                    _head(len(_COMPLETION)), *(_COMPLETION[i:i + 2] for i in range(0, len(_COMPLETION), 2))]
                for part in parts:
                    time.sleep(0.1 if slow else 0)
                    try:
                        conn.sendall(part)
                    except OSError:  # the client shut its socket
                        cut.set()
                        return

    def accept() -> None:
        with contextlib.suppress(OSError):  # the listening socket closed: the test is over
            while True:
                threading.Thread(target=serve, args=(server.accept()[0],), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    client = JudgeClient(f"http://127.0.0.1:{server.getsockname()[1]}/v1", "m", timeout=1.0)
    client._http = httpx.Client(timeout=1.0)  # keeps idle connections for reuse
    try:
        assert client.complete([USER], response_format(1), temperature=0, max_tokens=64) == "{}"
        with pytest.raises(JudgeError, match="no whole answer within 1 s") as caught:
            client.complete([USER], response_format(1), temperature=0, max_tokens=64)
    finally:
        client.close()
        server.close()
    assert caught.value.code == "judge_unreachable"
    assert len(calls) == 2 and calls[0] is not calls[1]
    assert cut.wait(10)  # the second answer was cut at the deadline, not read whole and refused after it


def test_concurrent_calls_share_one_watchdog_thread() -> None:
    """Each call started a timer thread to bound it: 50 calls at once ran 50 more threads (150, 150 more)."""
    calls = 20
    counted: list[int] = []
    in_flight = threading.Barrier(calls, action=lambda: counted.append(threading.active_count()), timeout=10)

    def chat(request: httpx.Request) -> httpx.Response:
        in_flight.wait()  # every call is under way, each with its deadline set
        return httpx.Response(200, content=_COMPLETION)

    client = JudgeClient("http://judge/v1", "m")
    client._http = httpx.Client(transport=httpx.MockTransport(chat))
    callers = [threading.Thread(target=client.complete, args=([USER], response_format(1)),
                                kwargs={"temperature": 0, "max_tokens": 64}) for _ in range(calls)]
    before = threading.active_count()
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join(timeout=30)
    assert len(counted) == 1
    assert counted[0] - before - calls <= 1  # the one watchdog thread, started by the first call of the process


@pytest.mark.parametrize(("status", "code"), [(400, "judge_rejected"), (413, "judge_rejected"), (422, "judge_rejected"),
                                              (200, "judge_http_error"), (503, "judge_http_error")])
@pytest.mark.parametrize(("unread", "headers"), [("compressed as 'gzip'", {"Content-Encoding": "gzip"}),
                                                 ("past 1024 bytes", {})])
def test_an_answer_left_unread_is_classed_by_its_status(status: int, code: str, unread: str,
                                                        headers: dict[str, str]) -> None:
    """A 400, 413 or 422 is `judge_rejected` (final) whatever its body: one compressed, or too long, was
    `judge_http_error` and sent again, though the same request never succeeds."""
    body = json.dumps({"object": "error", "message": "maximum context length is 2048 tokens " + "x" * 2048}).encode()
    content = gzip.compress(body) if headers else body

    def chat(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, content=content, headers=headers)

    client = JudgeClient("http://judge/v1", "m", max_answer_bytes=1024)
    client._http = httpx.Client(transport=httpx.MockTransport(chat))
    with pytest.raises(JudgeError, match=f"answered {status} with a body {unread}") as caught:
        client.complete([USER], response_format(1), temperature=0, max_tokens=64)
    assert caught.value.code == code


def test_a_compressed_answer_is_left_unread() -> None:
    """httpx decoded each piece read whole before `max_answer_bytes` counted it: 822 bytes of `gzip, gzip` took 800 MiB.
    The judge is asked for an uncompressed answer, and one compressed anyway is refused."""
    asked = []

    def chat(request: httpx.Request) -> httpx.Response:
        asked.append(request.headers.get("Accept-Encoding"))
        return httpx.Response(200, content=gzip.compress(_COMPLETION), headers={"Content-Encoding": "gzip"})

    client = JudgeClient("http://judge/v1", "m")
    client._http = httpx.Client(transport=httpx.MockTransport(chat))
    with pytest.raises(JudgeError, match="compressed as 'gzip', left unread") as caught:
        client.complete([USER], response_format(1), temperature=0, max_tokens=64)
    assert caught.value.code == "judge_http_error"
    assert asked == ["identity"]


@pytest.mark.parametrize("content", [[{"type": "text", "text": "{}"}], {"scores": {}}, 7])
def test_judge_content_that_is_not_text_is_a_judge_error(content: object) -> None:
    client = _client_answering(200, {"choices": [{"message": {"content": content}, "finish_reason": "stop"}]})
    with pytest.raises(JudgeError, match="not text") as caught:
        client.complete([USER], response_format(1), temperature=0, max_tokens=64)
    assert caught.value.code == "judge_http_error"


@pytest.mark.parametrize(
    ("status", "code"),
    [(400, "judge_rejected"), (413, "judge_rejected"), (422, "judge_rejected"), (401, "judge_http_error"),
     (404, "judge_http_error"), (408, "judge_http_error"), (429, "judge_http_error"), (503, "judge_http_error")],
)
def test_a_request_the_judge_refuses_is_judge_rejected_other_errors_may_pass(status: int, code: str) -> None:
    client = _client_answering(status, {"object": "error", "message": "maximum context length is 2048 tokens"})
    with pytest.raises(JudgeError, match=f"answered {status}: .*maximum context length") as caught:
        client.complete([USER], response_format(1), temperature=0, max_tokens=64)
    assert caught.value.code == code


_RATE_LIMITED = b'{"error": {"message": "rate limited"}}'


def _asking_to_wait(status: int, retry_after: str | None) -> JudgeError:
    """The error of a call to a real local judge that answers HTTP `status` with `retry_after` as its `Retry-After`
    header (none for None)."""
    field = b"" if retry_after is None else b"Retry-After: %s\r\n" % retry_after.encode()
    head = b"HTTP/1.1 %d Busy\r\n%sContent-Length: %d\r\n\r\n" % (status, field, len(_RATE_LIMITED))
    with _serving([head, _RATE_LIMITED], 0.0) as (client, _), pytest.raises(JudgeError) as caught:
        client.complete([USER], response_format(1), temperature=0, max_tokens=64)
    assert caught.value.code == "judge_http_error"
    return caught.value


@pytest.mark.parametrize(
    ("status", "retry_after", "asked"),
    [(429, "7", 7.0), (503, "120", 120.0), (429, "0", 0.0), (503, "Sun, 06 Nov 1994 08:49:37 GMT", 0.0),
     (429, None, None), (503, "soon", None), (429, "-3", None), (429, "1.5", None), (503, "1e3", None)],
)
def test_a_judge_answer_says_how_long_its_retry_after_asks_to_wait(
    status: int, retry_after: str | None, asked: float | None
) -> None:
    """A 429's or 503's `Retry-After` was dropped with the answer's other headers, and the run waited its own
    back-off. Now the error says how many seconds it asks (delay-seconds, a whole number; a date past is 0), and
    quotes it; a value of neither form of RFC 9110 asks for nothing."""
    error = _asking_to_wait(status, retry_after)
    assert error.retry_after == asked
    assert (f"answered {status} with Retry-After {retry_after!r}: " in str(error)) == (retry_after is not None)


@pytest.mark.parametrize("retry_after", [
    "Mon, 01 Jan 2024 99999999999999999999:00:00 GMT", "Mon, 99999999999999999999 Jan 2024 00:00:00 GMT",
    "Mon, 01 Jan 99999999999999999999 00:00:00 GMT",
])
def test_a_retry_after_date_with_a_field_past_any_clock_asks_for_nothing(retry_after: str) -> None:
    """A date whose hour, day or year is too large for a C long raised `OverflowError` out of the judge call, so the
    run failed as an unexpected error (a 500 for `POST /v1/groups/{id}/judge`) instead of a `judge_http_error`. Now
    it is a value of neither form of RFC 9110, asking for nothing."""
    assert _asking_to_wait(429, retry_after).retry_after is None


@pytest.mark.parametrize("form", [
    lambda when: email.utils.formatdate(when, usegmt=True),  # IMF-fixdate, the one HTTP sends
    lambda when: time.strftime("%A, %d-%b-%y %H:%M:%S GMT", time.gmtime(when)),  # RFC 850, obsolete
    lambda when: time.asctime(time.gmtime(when)),  # asctime, obsolete
], ids=["imf-fixdate", "rfc850", "asctime"])
def test_a_retry_after_date_is_read_in_every_form_http_recipients_accept(form: Callable[[float], str]) -> None:
    asked = _asking_to_wait(503, form(time.time() + 3600)).retry_after
    assert asked is not None and 3590 < asked <= 3600


@pytest.mark.parametrize("content", [None, "", "\n "])
def test_an_answer_of_tool_calls_without_content_says_so(content: str | None) -> None:
    """A judge that answers with tool calls (a chat template or proxy that forces tools) showed `not JSON: ''`; with
    a content of white space only, still `not JSON: '\\n '`."""
    calls = [{"id": "c", "type": "function", "function": {"name": "scores", "arguments": '{"scores": {}}'}}]
    message = {"role": "assistant", "content": content, "tool_calls": calls}
    client = _client_answering(200, {"choices": [{"message": message, "finish_reason": "tool_calls"}]})
    with pytest.raises(JudgeError, match='answered with tool calls, not JSON content: .*"name": "scores"') as caught:
        client.complete([USER], response_format(1), temperature=0, max_tokens=64)
    assert caught.value.code == "judge_bad_json"


@pytest.mark.parametrize("field", ["reasoning", "reasoning_content"])
@pytest.mark.parametrize("content", [None, "", "\n "])
def test_an_answer_in_the_reasoning_only_says_so(field: str, content: str | None) -> None:
    """A reasoning judge whose output never left its reasoning (vLLM's reasoning parser puts it all in `reasoning`)
    showed `judge answer is not JSON (...): ''`, as if the judge had said nothing."""
    message = {"role": "assistant", "content": content, field: 'Trajectory 1 is better. {"scores": {"1": ...'}
    client = _client_answering(200, {"choices": [{"message": message, "finish_reason": "stop"}]})
    with pytest.raises(JudgeError, match="in its reasoning only, no content .*Trajectory 1 is better") as caught:
        client.complete([USER], response_format(1), temperature=0, max_tokens=64)
    assert caught.value.code == "judge_bad_json"


def test_an_answer_with_content_is_read_whatever_its_reasoning() -> None:
    message = {"role": "assistant", "content": "{}", "reasoning": "Trajectory 1 is better."}
    client = _client_answering(200, {"choices": [{"message": message, "finish_reason": "stop"}]})
    assert client.complete([USER], response_format(1), temperature=0, max_tokens=64) == "{}"


def test_an_answer_cut_at_max_tokens_is_truncated_and_keeps_its_text() -> None:
    """The cut answer travels with its error, for `parse_cut` to take whole when it holds every score."""
    content = '{"scores": {"1": {"explanation": "x", "score": 1}}}'
    client = _client_answering(200, {"choices": [{"message": {"content": content}, "finish_reason": "length"}]})
    with pytest.raises(JudgeError, match="cut at max_tokens=64") as caught:
        client.complete([USER], response_format(1), temperature=0, max_tokens=64)
    assert caught.value.code == "judge_truncated" and caught.value.answer == content


def test_a_refusal_is_judge_refused_and_quotes_the_judge() -> None:
    """OpenAI's structured outputs answer a refusal as `message.refusal`, no content: it showed as `not JSON: ''`."""
    refusal = {"role": "assistant", "content": None, "refusal": "I can't help with that."}
    client = _client_answering(200, {"choices": [{"message": refusal, "finish_reason": "stop"}]})
    with pytest.raises(JudgeError, match="refused to score: \"I can't help with that.\"") as caught:
        client.complete([USER], response_format(1), temperature=0, max_tokens=64)
    assert caught.value.code == "judge_refused"


@pytest.mark.parametrize(("embedded", "code"), [(400, "judge_rejected"), (413, "judge_rejected"),
                                               (429, "judge_http_error"), (503, "judge_http_error")])
def test_an_error_object_answered_with_200_is_classed_by_its_embedded_code(embedded: int, code: str) -> None:
    """Some OpenAI-compatible proxies answer an error with 200 and `{"error": {"code": ...}}`: it was
    `judge_http_error` whatever its code, so a request the judge can never take (400, too long) was sent again."""
    error = {"error": {"code": embedded, "message": "maximum context length is 2048 tokens", "type": "invalid"}}
    with pytest.raises(JudgeError, match=f"answered 200 with error {embedded}: .*maximum context length") as caught:
        _client_answering(200, error).complete([USER], response_format(1), temperature=0, max_tokens=64)
    assert caught.value.code == code


@pytest.mark.parametrize("error", [{"error": {"code": "400", "message": "m"}}, {"error": {"code": True}},
                                   {"error": "busy"}])
def test_an_error_object_without_a_whole_number_code_may_pass_another_time(error: dict) -> None:
    with pytest.raises(JudgeError, match="sent no chat completion") as caught:
        _client_answering(200, error).complete([USER], response_format(1), temperature=0, max_tokens=64)
    assert caught.value.code == "judge_http_error"


@pytest.mark.parametrize("content", [None, "", " "])
def test_an_answer_the_content_filter_emptied_says_it_was_filtered(content: str | None) -> None:
    """Azure OpenAI's filter ends the choice with `content_filter` and no content: it showed as `not JSON: ''`."""
    choice = {"message": {"role": "assistant", "content": content}, "finish_reason": "content_filter"}
    with pytest.raises(JudgeError, match="judge .* filtered its answer .*finish_reason content_filter") as caught:
        _client_answering(200, {"choices": [choice]}).complete([USER], response_format(1), temperature=0,
                                                                max_tokens=64)
    assert caught.value.code == "judge_refused"


@pytest.mark.parametrize(
    ("status", "body"),
    [(500, "<html>\n<body>Internal\nError</body>\n</html>"), (429, "rate\r\nlimited"),
     (200, "<html>\n<body>proxy login</body>\n</html>"), (500, "oops\x00")],
)
def test_a_judge_error_is_one_line_whatever_the_body(status: int, body: str) -> None:
    """The error is logged once per try and shown on the group: a body's line breaks must not split it, and a NUL
    (which PostgreSQL text cannot hold) made the run's outcome a database error."""
    with pytest.raises(JudgeError) as caught:
        _client_answering(status, body).complete([USER], response_format(1), temperature=0, max_tokens=64)
    assert caught.value.code == "judge_http_error"
    message = str(caught.value)
    assert "\n" not in message and "\r" not in message and "\x00" not in message
    assert repr(body) in message  # the body is still all there, escaped


@pytest.mark.parametrize(("status", "body"), [(503, "overloaded"), (200, "<html>proxy</html>")])
def test_a_judge_error_hides_the_password_of_the_judges_url(status: int, body: str) -> None:
    """A judge behind a proxy's Basic auth (`http://user:password@host/v1`): every error named the URL whole, and
    an error is stored on the group's run, which `GET /v1/groups/{id}/judge` and the page show to anyone."""
    client = _client_answering(status, body)
    client.base_url = "http://judge:hunter2@judge/v1"
    with pytest.raises(JudgeError) as caught:
        client.complete([USER], response_format(1), temperature=0, max_tokens=64)
    assert "judge http://judge:***@judge/v1/chat/completions" in str(caught.value)
    assert "hunter2" not in str(caught.value)


def test_a_tls_socket_shut_at_the_deadline_keeps_its_ssl_object() -> None:
    """`SSLSocket.shutdown` set its SSL object to None, and a read of the call's thread between `recv`'s check of it
    and `read`'s raised `ValueError("Read on closed or unwrapped SSL socket")`, which escaped the judge call; shut as
    a plain socket, the read fails as the closed connection it is."""
    ours, theirs = socket.socketpair()
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    with theirs, context.wrap_socket(ours, do_handshake_on_connect=False) as tls:
        _shut(tls)
        assert tls._sslobj is not None
        assert theirs.recv(1) == b""  # the peer sees the connection shut
