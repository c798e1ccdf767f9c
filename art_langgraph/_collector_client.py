"""Small HTTP client for the collector's non-OTLP endpoints (rewards given after the fact).

A reward the collector may not have taken is sent again (`_Tries`): after no answer (refused, reset, timed out) or a
502, 503 or 504 (the collector's 503 `store_unavailable`: nothing stored, try again after `Retry-After`). Sending one
twice is safe: the collector keeps the last reward of a name per trajectory, so the same reward again changes nothing
that a reader, a lease or a late ack sees (tests/art_langgraph/test_late_reward_retry.py proves it on the real app).
A refusal (4xx) or another answer is raised at once.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

import httpx
import requests

from art_langgraph._settings import get_settings

__all__ = ["SendAuthorization", "apost_reward", "post_reward"]

_logger = logging.getLogger(__name__)

_TIMEOUT = httpx.Timeout(10.0)
"""Timeout of each try."""
_TRIES = 3
"""Tries of one reward, the first included."""
_FIRST_WAIT_S = 0.5
"""Wait before the second try, doubled before each further one; longer when the collector's `Retry-After` asks."""
_WAIT_BUDGET_S = 10.0
"""Most seconds one reward waits between its tries in all (the collector's `Retry-After` of 5 s fits twice): a wait
that would pass it is not made, and the last answer is raised."""
_RETRIED_STATUSES = frozenset({502, 503, 504})
"""Answers after which a reward is sent again: a proxy without the collector behind it, the store busy or down."""
_RETRIED_ERRORS = (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError)
"""No answer, after which a reward is sent again: refused, timed out, reset or cut off (it may have been stored)."""


class SendAuthorization:
    """A requests session's `auth` (the span exporter's) that sends `Authorization: authorization` as given: requests
    then looks up no netrc entry (its `trust_env`; proxies from the environment still apply) nor takes the user and
    password of the URL, either of which put Basic auth in place of the configured key. Late rewards need none: httpx
    reads no netrc, and `_request` gives it the URL without its user and password."""

    def __init__(self, authorization: str) -> None:
        self.authorization = authorization

    def __call__(self, request: requests.PreparedRequest) -> requests.PreparedRequest:
        request.headers["Authorization"] = self.authorization
        return request


def _request(
    rollout_id: str | None, name: str, value: float, trace_id: str | None
) -> tuple[str, dict[str, bytes], httpx.BasicAuth | None, dict[str, object]]:
    """The URL, headers, auth and body of one reward's POST: the headers the span exporter sends the collector too
    (`Settings.collector_headers`: a gateway's own, the configured key's `Authorization`), each value encoded as
    requests encodes it there (Latin-1), and with no `Authorization` among them the user and password of the
    collector's URL as Basic auth. The URL goes without them, so that no error or log line (httpx's own `HTTP Request:
    POST ...` at INFO included) names a password."""
    settings = get_settings()
    url = httpx.URL(f"{settings.collector_base_url}/v1/rewards")
    headers = {header: text.encode("latin-1") for header, text in settings.collector_headers.items()}
    auth = None
    if not settings.collector_authorization and (url.username or url.password):
        auth = httpx.BasicAuth(url.username, url.password)
    body: dict[str, object] = {"name": name, "value": value}
    if rollout_id is not None:
        body["rollout_id"] = rollout_id
    if trace_id is not None:
        body["trace_id"] = trace_id
    return str(url.copy_with(username=None, password=None)), headers, auth, body


def _retry_after(response: httpx.Response) -> float:
    """The seconds `response`'s `Retry-After` asks to wait; 0 without one, or with one that is not a number of seconds
    (an HTTP date is not read: the collector sends seconds)."""
    try:
        asked = float(response.headers.get("retry-after", ""))
    except ValueError:
        return 0.0
    return max(asked, 0.0) if math.isfinite(asked) else 0.0


class _Tries:
    """The tries of one reward's POST to `url`, the policy `post_reward` and `apost_reward` share: whether and when
    to send it again after each outcome (`wait_after`), and what to raise once it ends (`settle`)."""

    def __init__(self, url: str, body: dict[str, object]) -> None:
        self.url = url
        self.what = f"reward {body['name']!r} of " + (
            f"rollout {body['rollout_id']}" if "rollout_id" in body else f"trace {body['trace_id']}"
        )
        self.made = 0
        self.waited = 0.0
        self.given_up = ""
        """Why no further try was made while tries were left, for the error raised."""

    def wait_after(self, outcome: httpx.Response | httpx.TransportError) -> float | None:
        """Seconds to wait before sending the reward again after `outcome` (a retry, logged once), or None: no
        further try (an answer that is not retried, the last try, or a wait past `_WAIT_BUDGET_S`)."""
        self.made += 1
        if isinstance(outcome, httpx.Response):
            if outcome.status_code not in _RETRIED_STATUSES:
                return None
            problem = f"HTTP {outcome.status_code}: {outcome.text[:300]}"
            asked = _retry_after(outcome)
        else:
            if not isinstance(outcome, _RETRIED_ERRORS):
                return None
            problem = type(outcome).__name__ + (f": {outcome}" if str(outcome) else "")
            asked = 0.0
        if self.made == _TRIES:
            return None
        wait = max(_FIRST_WAIT_S * 2 ** (self.made - 1), asked)
        if self.waited + wait > _WAIT_BUDGET_S:
            why = (  # the backoff's own wait passes it only after earlier Retry-After waits took the budget
                f"the collector asked to wait {wait:g} s (Retry-After), past"
                if wait == asked
                else f"waiting {wait:g} s more after {self.waited:g} s would pass"
            )
            self.given_up = f"; not tried again: {why} the {_WAIT_BUDGET_S:g} s a late reward waits in all"
            return None
        self.waited += wait
        _logger.warning(
            "the %s could not be posted to the collector at %s (%s; try %d of %d); trying again in %g s",
            self.what,
            self.url,
            problem,
            self.made,
            _TRIES,
            wait,
        )
        return wait

    def settle(self, outcome: httpx.Response | httpx.TransportError) -> None:
        """Raise for the last `outcome` unless it is a success, its message naming the collector and the tries.

        Raises:
            httpx.HTTPError: No answer (as its own type), or an error status.
        """
        said = (f" ({self.made} tries)" if self.made > 1 else "") + self.given_up
        if isinstance(outcome, httpx.TransportError):
            # httpx's message says only `Connection refused`: not which URL it could not reach
            raise type(outcome)(
                f"could not POST to the collector at {self.url}: {outcome}{said}", request=outcome.request
            ) from outcome
        if not outcome.is_success:  # with the collector's answer: its error envelope names what it refused
            raise httpx.HTTPStatusError(
                f"the collector answered {outcome.status_code} {outcome.reason_phrase} to POST {self.url}: "
                f"{outcome.text[:1000]}{said}",
                request=outcome.request,
                response=outcome,
            )


def post_reward(rollout_id: str | None, name: str, value: float, trace_id: str | None = None) -> None:
    """Send one reward for a finished rollout (by rollout id or trace id) to `POST {collector}/v1/rewards`, sent
    again (`_TRIES` in all, waits within `_WAIT_BUDGET_S`) when the collector may not have taken it.

    Raises:
        httpx.HTTPError: The collector is unreachable or answered with an error status.
    """
    url, headers, auth, body = _request(rollout_id, name, value, trace_id)
    tries = _Tries(url, body)
    outcome: httpx.Response | httpx.TransportError
    with httpx.Client(timeout=_TIMEOUT) as client:
        while True:
            try:
                outcome = client.post(url, json=body, headers=headers, auth=auth)
            except httpx.TransportError as exc:
                outcome = exc
            if (wait := tries.wait_after(outcome)) is None:
                break
            time.sleep(wait)
    tries.settle(outcome)


async def apost_reward(rollout_id: str | None, name: str, value: float, trace_id: str | None = None) -> None:
    """Async `post_reward`: send one reward for a finished rollout to the collector, sent again as `post_reward`'s.

    Raises:
        httpx.HTTPError: The collector is unreachable or answered with an error status.
    """
    url, headers, auth, body = _request(rollout_id, name, value, trace_id)
    tries = _Tries(url, body)
    outcome: httpx.Response | httpx.TransportError
    async with httpx.AsyncClient(timeout=_TIMEOUT) as client:
        while True:
            try:
                outcome = await client.post(url, json=body, headers=headers, auth=auth)
            except httpx.TransportError as exc:
                outcome = exc
            if (wait := tries.wait_after(outcome)) is None:
                break
            await asyncio.sleep(wait)
    tries.settle(outcome)
