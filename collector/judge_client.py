"""The HTTP call to a RULER judge: one OpenAI-compatible chat completion, bounded whole in time and size.

`JudgeClient.complete` sends the messages `collector.ruler` builds and returns the answer's text, or raises
`JudgeError` with a code that says whether the same request may pass another time. A single watchdog thread shuts a
call's sockets at its deadline, since httpx's timeout bounds each read, not the whole answer.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpcore
import httpx

from collector.config import hide_password
from collector.retry_after import seconds_asked
from collector.ruler import JudgeError, Messages

__all__ = ["MAX_ANSWER_BYTES", "JudgeClient"]


_REJECTED = frozenset({400, 413, 422})
"""HTTP statuses by which a judge refuses the request itself (a group too long for its context, say): the same
request never succeeds, so it is not sent again (`judge_rejected`). Other failures may pass (`judge_http_error`)."""


def _status_code(status: int) -> str:
    """The error code of a judge's answer with HTTP `status`, other than 200 (see `_REJECTED`), or with a body left
    unread (a 200 included): the status decides it, the body only makes the message."""
    return "judge_rejected" if status in _REJECTED else "judge_http_error"


def _embedded_status(payload: object) -> int | None:
    """The status of an error object answered with 200 (`{"error": {"code": 400, ...}}`, as some OpenAI-compatible
    proxies answer), for `_status_code`; None for another body, or an error whose code is no whole number."""
    error = payload.get("error") if isinstance(payload, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, int) and not isinstance(code, bool) else None


MAX_ANSWER_BYTES = 8 * 1024 * 1024
"""Default of the most bytes a judge's answer (its body, uncompressed as asked) may take: far more than any chat
completion of a judge holds, far less than a memory that a judge sending bytes without end would fill."""


def _shut(sock: socket.socket) -> None:
    """Shut `sock` down both ways, which wakes a thread blocked reading it; one closed already (its call ended) is
    left as it is. A TLS socket is shut as a plain one: `SSLSocket.shutdown` drops its SSL object first, and a read
    between its two checks of that object raised `ValueError` (no `OSError`, which httpx reports), escaping the call."""
    with contextlib.suppress(OSError):
        socket.socket.shutdown(sock, socket.SHUT_RDWR)


class _Watch:
    """The sockets of one judge call, which `_Watchdog` shuts down at the call's deadline: httpx's timeout bounds each
    read, so a judge that sent its status line, headers or body a little at a time held the call as long as it liked.

    It learns each socket from httpcore's `trace` extension as the call opens it (a TCP connection, then its TLS
    layer); `JudgeClient` reuses no connection, so every call opens its own.
    """

    def __init__(self) -> None:
        self.fired = False
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()

    def trace(self, event: str, info: dict[str, Any]) -> None:
        """httpcore's `trace` callback: note the socket of each stream the call opens, shut at once when late."""
        stream = info.get("return_value")
        sock = stream.get_extra_info("socket") if isinstance(stream, httpcore.NetworkStream) else None
        if not isinstance(sock, socket.socket):
            return
        with self._lock:
            self._sockets.append(sock)
            if self.fired:
                _shut(sock)

    def fire(self) -> None:
        """Shut down every socket the call opened, and any it opens from now on."""
        with self._lock:
            self.fired = True
            for sock in self._sockets:
                _shut(sock)


class _Watchdog:
    """One thread, started at the first call, that fires each judge call's `_Watch` at its deadline, for every
    `JudgeClient` of the process: a heap of deadlines, not a timer thread per call."""

    def __init__(self) -> None:
        self._due: list[tuple[float, int, _Watch]] = []  # a heap: (deadline on the monotonic clock, order, watch)
        self._order = itertools.count()  # ties on the deadline never compare two watches
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def watching(self, seconds: float) -> Iterator[_Watch]:
        """A `_Watch` fired `seconds` from now unless the block has ended by then."""
        watch = _Watch()
        entry = (time.monotonic() + seconds, next(self._order), watch)
        with self._wake:
            heapq.heappush(self._due, entry)
            if self._thread is None or not self._thread.is_alive():  # not alive: a child forked after it started
                self._thread = threading.Thread(target=self._run, name="judge-watchdog", daemon=True)
                self._thread.start()
            self._wake.notify()
        try:
            yield watch
        finally:
            with self._wake:
                if not watch.fired:  # a fired watch left the heap when it fired
                    self._due.remove(entry)
                    heapq.heapify(self._due)

    def _run(self) -> None:
        with self._wake:
            while True:
                now = time.monotonic()
                while self._due and self._due[0][0] <= now:
                    heapq.heappop(self._due)[2].fire()
                self._wake.wait(self._due[0][0] - now if self._due else None)


_WATCHDOG = _Watchdog()


class JudgeClient:
    """Calls one OpenAI-compatible chat endpoint (`{base_url}/chat/completions`); `timeout` seconds bound each call
    whole, from the connection to the end of the answer's body, and `max_answer_bytes` the answer's body, which it asks
    uncompressed."""

    def __init__(
        self, base_url: str, model: str, *, api_key: str | None = None, timeout: float = 300.0,
        max_answer_bytes: int = MAX_ANSWER_BYTES,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.timeout = timeout
        self.max_answer_bytes = max_answer_bytes
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # no connection kept between calls, nor reused (`_post`): each call's own is the one its `_Watch` sees opened
        self._http = httpx.Client(headers=headers, timeout=timeout, limits=httpx.Limits(max_keepalive_connections=0))

    def _post(self, url: str, body: dict[str, Any]) -> httpx.Response:
        """POST `body` to `url`; the response read whole within `timeout` seconds of the start, of its headers only
        `Retry-After`. Errors name `url` with its password hidden (`hide_password`): they are stored on the group's
        run, which reads show to anyone.

        Raises:
            JudgeError: `judge_unreachable`, no whole answer in time or none at all; `judge_http_error` (or
                `judge_rejected` for a status in `_REJECTED`), an answer longer than `max_answer_bytes` or compressed.
        """
        shown = hide_password(url)
        late = JudgeError(
            f"judge {shown} sent no whole answer within {self.timeout:g} s (ART_COLLECTOR_JUDGE_TIMEOUT_SECONDS)",
            code="judge_unreachable",
        )
        # `_body`; and a connection closed after its answer, which no other call can reuse: httpcore's pool hands a
        # connection that turned idle to a waiting call before it closes it, and that call's `_Watch` saw no socket
        headers = {"Accept-Encoding": "identity", "Connection": "close"}
        try:
            with _WATCHDOG.watching(self.timeout) as watchdog, self._http.stream(
                "POST", url, json=body, headers=headers, extensions={"trace": watchdog.trace}
            ) as answer:
                content = self._body(shown, answer)
                if watchdog.fired:  # the shut socket ended a body that runs to the connection's close: cut, no error
                    raise late
                kept = {"Retry-After": answer.headers["Retry-After"]} if "Retry-After" in answer.headers else {}
                return httpx.Response(answer.status_code, headers=kept, content=content)
        except httpx.HTTPError as exc:
            if watchdog.fired:
                raise late from exc
            raise JudgeError(
                f"judge {shown} unreachable: {type(exc).__name__}: {exc}", code="judge_unreachable"
            ) from exc

    def _body(self, shown: str, answer: httpx.Response) -> bytes:
        """The body of `answer`, read up to `max_answer_bytes`, as it was sent: uncompressed, as asked. A compressed
        one is refused unread: httpx decodes each piece read whole, and a few hundred bytes of `gzip, gzip` decode to
        gigabytes before any count of them. Errors name the judge's URL as `shown` (its password hidden, see `_post`).

        Raises:
            JudgeError: the body is compressed or longer: `judge_http_error`, or `judge_rejected` for a status in
                `_REJECTED` (`_status_code`).
        """
        if (encoding := answer.headers.get("Content-Encoding", "")).strip().lower() not in ("", "identity"):
            raise JudgeError(
                f"judge {shown} answered {answer.status_code} with a body compressed as {encoding[:50]!r}, left "
                "unread: it was asked for none (Accept-Encoding: identity)",
                code=_status_code(answer.status_code),
            )
        parts, size = [], 0
        for part in answer.iter_bytes():  # as sent: no decoder but identity gets here
            size += len(part)
            if size > self.max_answer_bytes:
                raise JudgeError(
                    f"judge {shown} answered {answer.status_code} with a body past {self.max_answer_bytes} bytes, left "
                    "unread (ART_COLLECTOR_JUDGE_MAX_ANSWER_BYTES)",
                    code=_status_code(answer.status_code),
                )
            parts.append(part)
        return b"".join(parts)

    def complete(self, messages: Messages, fmt: dict[str, Any], *, temperature: float, max_tokens: int) -> str:
        """The judge's answer text.

        Raises:
            JudgeError: `judge_unreachable` (no answer, or none whole within `timeout`), `judge_rejected` (see
                `_REJECTED`; the code of an error object answered with 200 counts as the status), `judge_http_error`,
                `judge_refused` (OpenAI's `message.refusal`, or no content and `finish_reason` `content_filter`),
                `judge_bad_json` (tool calls, or reasoning, and no content), or `judge_truncated` (hit max_tokens;
                the cut answer is the error's `answer`, see `parse_cut`). Every message is one line: a body the judge
                sent is quoted with its line breaks escaped. An answer with a status other than 200 quotes its
                `Retry-After`, and the seconds it asks (`seconds_asked`) are the error's `retry_after`.
        """
        body = {
            "model": self.model,
            "messages": messages,
            "response_format": fmt,
            "temperature": temperature,
            "max_tokens": max_tokens,
        }
        url = f"{self.base_url}/chat/completions"
        response = self._post(url, body)
        shown = hide_password(url)  # as errors name it (see `_post`)
        if response.status_code != 200:
            header = response.headers.get("Retry-After")
            asked = "" if header is None else f" with Retry-After {header[:50]!r}"
            raise JudgeError(
                f"judge {shown} answered {response.status_code}{asked}: {response.text[:300]!r}",
                code=_status_code(response.status_code), retry_after=seconds_asked(header, time.time()),
            )
        try:
            payload = response.json()
            if (status := _embedded_status(payload)) is not None:  # a JudgeError, which the except lets through
                raise JudgeError(f"judge {shown} answered 200 with error {status}: {response.text[:300]!r}",
                                 code=_status_code(status))
            choice = payload["choices"][0]
            message = choice["message"]
            text = message["content"] or ""
        except (ValueError, KeyError, IndexError, TypeError, RecursionError) as exc:
            raise JudgeError(
                f"judge {shown} sent no chat completion: {response.text[:300]!r}", code="judge_http_error"
            ) from exc
        if not isinstance(text, str):
            raise JudgeError(
                f"judge {shown} sent a message content that is not text: {response.text[:300]!r}",
                code="judge_http_error",
            )
        if refusal := message.get("refusal"):  # a dict: its `content` was read above
            raise JudgeError(f"judge {shown} refused to score: {str(refusal)[:300]!r}", code="judge_refused")
        if not text.strip() and choice.get("finish_reason") == "content_filter":  # Azure OpenAI's filter, say
            raise JudgeError(f"judge {shown} filtered its answer out (finish_reason content_filter, no content): its "
                             "provider's content filter blocked the prompt or the answer", code="judge_refused")
        if not text.strip() and (calls := message.get("tool_calls")):  # white space: no answer either
            raise JudgeError(
                f"judge {shown} answered with tool calls, not JSON content: {json.dumps(calls)[:300]!r}; it must "
                "answer in the message content (structured output, `response_format` json_schema)",
                code="judge_bad_json",
            )
        if choice.get("finish_reason") == "length":
            raise JudgeError(
                f"judge answer was cut at max_tokens={max_tokens} (it ended {text[-80:]!r}); "
                "raise ART_COLLECTOR_JUDGE_MAX_TOKENS",
                code="judge_truncated", answer=text,
            )
        # vLLM's field, and its older name (SGLang's, DeepSeek's); e.g. a reasoning that ran to the end-of-text token
        if not text.strip() and (reasoning := message.get("reasoning") or message.get("reasoning_content")):
            raise JudgeError(
                f"judge {shown} answered in its reasoning only, no content (it ended {str(reasoning)[-80:]!r}); a "
                "reasoning judge must end its reasoning and answer after it, in the message content",
                code="judge_bad_json",
            )
        return text

    def close(self) -> None:
        """Release the HTTP connection pool."""
        self._http.close()
