"""Calls of Langfuse's REST API as the Langfuse sync makes them (`langfuse_sync`, `langfuse_push`).

Through the `langfuse` SDK's REST client (`LangfuseAPI`, `make_client`). Each call, retries included, ends within
`timeout_seconds` (`LangfuseCalls.call`): the SDK's own retries, which wait up to a minute each, are off, and an answer
that failed for now (`transient`) is asked again after its `Retry-After` (`retry_after`) or a doubling wait. Any way
Langfuse fails raises `LangfuseSyncError` (502), with what to check for a status a configuration mistake gives
(`HINTS`). A page of scores (`GET /api/public/v3/scores`, `LangfuseCalls.scores`) is read score by score with the
SDK's model, so that one it rejects (a NUMERIC score whose value is null) is ignored and logged, not the page.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any

import httpx
from langfuse import __version__
from langfuse.api import GetScoresV3Meta, GetScoresV3Response, LangfuseAPI, ScoreV3
from langfuse.api.core.api_error import ApiError
from langfuse.api.core.http_client import HttpClient
from langfuse.api.core.pydantic_utilities import parse_obj_as
from langfuse.api.core.request_options import RequestOptions
from pydantic import ValidationError

from collector.config import hide_password
from collector.errors import CollectorError
from collector.retry_after import seconds_asked
from collector.scoring_config import LangfuseSettings
from collector.spans import warn_once

__all__ = [
    "HINTS", "PAGE", "SCORES", "LangfuseCalls", "LangfuseSyncError", "make_client", "retry_after", "transient",
]

log = logging.getLogger(__name__)

PAGE = 100
"""Scores per page (Langfuse's maximum)."""

SCORES = "api/public/v3/scores"
"""The path of the scores listing, from the host."""

_KEYS = "check ART_COLLECTOR_LANGFUSE_PUBLIC_KEY and ART_COLLECTOR_LANGFUSE_SECRET_KEY (or LANGFUSE_*):"
HINTS = {
    401: f"{_KEYS} a key pair of a project on this host",
    403: f"{_KEYS} a key pair of a project on this host, allowed to read and write scores",
    404: "is the host Langfuse's base URL? A self-hosted Langfuse serves GET /api/public/v3/scores only when started "
    "with LANGFUSE_ENABLE_SCORES_V3_API=true (Langfuse Cloud always does)",
}
"""What to check when Langfuse answers a status that a configuration mistake gives."""

RETRIES = 2
"""How many times a call of Langfuse's API that failed for now with an answer (`transient`) is tried again at most,
as the SDK's default, within the call's deadline (`LangfuseCalls.call`)."""

FIRST_RETRY_WAIT = 1.0
"""Seconds before a call's first retry when Langfuse sends no `Retry-After`; doubles with each retry."""

LEAST_TRY_SECONDS = 0.1
"""The least time a retry must have left before the call's deadline (`LangfuseCalls.call`)."""


class LangfuseSyncError(CollectorError):
    """Langfuse could not be reached or refused a request (502)."""

    status = 502
    code = "langfuse_error"


def _page_of(body: Any) -> tuple[list[Any], str | None, list[tuple[Any, ValidationError]]]:
    """The scores, the next page's cursor (None on the last page) and the scores the SDK's model rejects (each with
    why) of a `GET /api/public/v3/scores` answer `body`. Each score is read with the SDK's model on its own, so one it
    rejects (a NUMERIC score whose value is null, as JavaScript's JSON writes a NaN) does not fail the page;
    raises `ValidationError` for a body that is no page at all."""
    if not isinstance(body, dict) or not isinstance(body.get("data"), list):
        parse_obj_as(GetScoresV3Response, body)  # raises, naming what is wrong
    meta = parse_obj_as(GetScoresV3Meta, body.get("meta"))
    scores, rejected = [], []
    for item in body["data"]:
        try:
            scores.append(parse_obj_as(ScoreV3, item))
        except ValidationError as exc:
            rejected.append((item, exc))
    return scores, meta.cursor, rejected


def _item_id(item: Any) -> str | None:
    """The id of a score the SDK's model rejected (`_page_of`), if it has one."""
    score_id = item.get("id") if isinstance(item, dict) else None
    return score_id if isinstance(score_id, str) else None


def _status(exc: LangfuseSyncError) -> int | None:
    """The HTTP status Langfuse answered in `exc` (`LangfuseCalls.call`'s error); None when it gave no answer."""
    cause = exc.__cause__
    return cause.status_code if isinstance(cause, ApiError) else None


def transient(exc: LangfuseSyncError) -> bool:
    """Whether a request that failed with `exc` may succeed later: no answer (an outage, a timeout, a body the SDK
    cannot read), a 5xx, 408 or 429; any other 4xx is final."""
    status = _status(exc)
    return status is None or not 400 <= status < 500 or status in (408, 429)


def retry_after(exc: LangfuseSyncError, now: float) -> float | None:
    """The seconds Langfuse's answer in `exc` asks to wait before a retry (`Retry-After`: delay seconds, or an HTTP
    date, counted from `now`; at least 0); None without the header, or with one that is neither (then the caller's own
    delay applies)."""
    cause = exc.__cause__
    headers = cause.headers if isinstance(cause, ApiError) and cause.headers else {}
    value = next((str(v) for k, v in headers.items() if k.lower() == "retry-after"), None)
    return seconds_asked(value, now)


def _http_client(client: LangfuseAPI) -> HttpClient:
    """The SDK's HTTP client in `client` (its auth, headers, timeout and retries), through which `LangfuseCalls._get`
    reads a page of scores without the SDK's model of the whole page: the SDK has no public way to (its
    `with_raw_response` reads the page with that model too), so this is a private attribute of `langfuse>=5.0.4,<6`.
    Raises `LangfuseSyncError`, naming the installed SDK's version, when that SDK has it no longer."""
    http = getattr(getattr(client, "_client_wrapper", None), "httpx_client", None)
    if not isinstance(http, HttpClient):
        raise LangfuseSyncError(
            f"the installed langfuse SDK {__version__} has no HTTP client where 5.0.4 keeps it "
            "(`LangfuseAPI._client_wrapper.httpx_client`), which the Langfuse sync reads scores through: "
            "install langfuse>=5.0.4,<6", code="langfuse_sdk_unsupported",
        )
    return http


def make_client(settings: LangfuseSettings) -> LangfuseAPI:
    """The SDK's REST client for the configured project (Basic auth with the key pair)."""
    if not settings.enabled:
        raise LangfuseSyncError(
            "Langfuse is not configured: set ART_COLLECTOR_LANGFUSE_HOST and its keys", code="langfuse_not_configured"
        )
    return LangfuseAPI(
        base_url=str(settings.host).rstrip("/"),
        username=settings.public_key,
        password=settings.secret_key.get_secret_value() if settings.secret_key else None,
        x_langfuse_sdk_name="python",
        x_langfuse_sdk_version=__version__,
        x_langfuse_public_key=settings.public_key,
        timeout=settings.timeout_seconds,
    )


class LangfuseCalls:
    """Langfuse's API through the SDK's client `client` (its HTTP client too, `_http_client`), each call within the
    timeout of `settings` (`call`)."""

    def __init__(self, client: LangfuseAPI, settings: LangfuseSettings) -> None:
        self.client, self.settings = client, settings
        self._http = _http_client(client)

    def call(
        self, what: str, fn: Callable[[RequestOptions], object], hints: dict[int, str] = HINTS, retries: int = RETRIES
    ) -> object:
        """`fn(options)`, a call of Langfuse's API with the SDK's request options `options`; any way Langfuse fails, a
        malformed answer too, raises `LangfuseSyncError` (502), with the hint of `hints` for its status, if any.

        The call, retries included, waits for Langfuse within `timeout_seconds` of its start: the SDK's own retries
        are off (each of them waits up to a minute, whatever the timeout), and an answer that failed for now
        (`transient`: a 5xx, 408 or 429) is asked again at most `retries` times, after its `Retry-After` or else a
        doubling wait (`FIRST_RETRY_WAIT`), only when that wait leaves the try `LEAST_TRY_SECONDS` before the
        deadline. A try gets what is left, which bounds its connection and each read (httpx's timeouts are per
        operation: an answer trickling in a byte at a time may take longer)."""
        deadline = time.monotonic() + self.settings.timeout_seconds
        attempt = 0
        while True:
            options: RequestOptions = {"max_retries": 0, "timeout_in_seconds": deadline - time.monotonic()}
            try:
                return self._once(what, functools.partial(fn, options), hints)
            except LangfuseSyncError as exc:
                wait = self._retry_wait(exc, attempt)
                if attempt == retries or wait is None or time.monotonic() + wait + LEAST_TRY_SECONDS >= deadline:
                    raise
                failure = exc
            time.sleep(wait)
            if deadline - time.monotonic() < LEAST_TRY_SECONDS:  # the sleep ran late: no time left to try (httpx
                raise failure  # refused a timeout below 0 with a ValueError, which escaped the sync)
            attempt += 1

    @staticmethod
    def _retry_wait(exc: LangfuseSyncError, attempt: int) -> float | None:
        """Seconds before the retry of a call whose try `attempt` (0: the first) failed with `exc`: its `Retry-After`,
        else `FIRST_RETRY_WAIT` doubled per try; None when it is not to be retried within the call (no answer, which
        took its time already, or a final 4xx)."""
        if _status(exc) is None or not transient(exc):
            return None
        after = retry_after(exc, time.time())
        return FIRST_RETRY_WAIT * 2**attempt if after is None else after

    def _once(self, what: str, fn: Callable[[], object], hints: dict[int, str]) -> object:
        """`fn()`, one try of a call of Langfuse's API (`call`), its failures raised as `LangfuseSyncError`."""
        try:
            return fn()
        except ApiError as exc:
            hint = f"; {hints[exc.status_code]}" if exc.status_code in hints else ""
            raise LangfuseSyncError(f"Langfuse {what} answered {exc.status_code}: {exc.body!r}{hint}") from exc
        except ValidationError as exc:  # a 2xx body the SDK cannot read: a proxy's page, no page of scores
            raise LangfuseSyncError(f"Langfuse {what} answered something its API does not define: {exc}") from exc
        except httpx.HTTPError as exc:
            raise LangfuseSyncError(
                f"Langfuse {what} unreachable at {hide_password(str(self.settings.host))}: {exc}",
                code="langfuse_unreachable",
            ) from exc

    def _get(self, path: str, params: dict[str, Any], options: RequestOptions) -> Any:
        """Langfuse's JSON answer to `GET {path}` with the query `params` (the API's names; None: left out), through
        the SDK's HTTP client (`_http_client`: its auth and headers; its timeout and retries as the request options
        `options` set them) but not its model of the whole answer (`_page_of` reads it); raises the SDK's `ApiError`
        for a status other than 2xx or a body that is no JSON, as the SDK's own methods do."""
        response = self._http.request(path, method="GET", params=params, request_options=options)
        try:
            body = response.json()
        except ValueError as exc:
            raise ApiError(status_code=response.status_code, headers=dict(response.headers),
                           body=response.text) from exc
        if not 200 <= response.status_code < 300:
            raise ApiError(status_code=response.status_code, headers=dict(response.headers), body=body)
        return body

    def scores(self, **params: Any) -> tuple[list[Any], str | None, list[str | None]]:
        """One page of `GET /api/public/v3/scores` with the query `params`: its scores, the next page's cursor, and the
        ids (None: it has none) of the scores in it that the SDK's model rejects (`_page_of`), logged and left out."""
        scores, cursor, rejected = self.call("GET /api/public/v3/scores",
                                             lambda options: _page_of(self._get(SCORES, params, options)))
        for item, exc in rejected:
            score_id = _item_id(item)
            # once per process: every sync pulls the whole lookback again, and logged the same score each time
            warn_once(log, "Langfuse score %s does not fit Langfuse's API definition (%s); ignored",
                      "without an id" if score_id is None else score_id,
                      "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()))
        return scores, cursor, [_item_id(item) for item, _ in rejected]
