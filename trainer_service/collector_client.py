"""The trainer's side of the collector's HTTP API: ready groups, batch leases, acks and releases.

Every failure (no answer, an HTTP error, an answer that is not what the API publishes) is a
`ServiceError` that names the collector call and what to do.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel, TypeAdapter, ValidationError

from collector.config import validation_problem
from collector.protocol import (
    IDEMPOTENCY_KEY_HEADER,
    AckRequest,
    AckResponse,
    Batch,
    BatchRequest,
    GroupStatus,
    ReleaseRequest,
    ReleaseResponse,
)
from trainer_service.backoff import Backoff
from trainer_service.config import LEASE_MARGIN_S, TrainerSettings
from trainer_service.protocol import ServiceError

__all__ = ["CollectorClient"]

logger = logging.getLogger(__name__)

_TIMEOUT_S = 60.0
"""HTTP timeout of every call to the collector."""
_RETRY_TRIES = 4
"""Tries of an ack or a release that meets a transient failure: 4 tries that each time out and their waits
(2 + 4 + 8 s) take 254 s, less than the lease's margin (`LEASE_MARGIN_S`, 300 s)."""
_RETRY_FIRST_S = 2.0
"""Wait before an ack's or a release's second try, doubled before each further one (`Backoff`)."""
_RETRY_LONGEST_S = 30.0
"""Longest wait between two tries of an ack or a release."""
_TRANSIENT_STATUSES = frozenset({502, 503, 504})
"""Answers to an ack or a release that are tried again: a proxy without the collector behind it, the store busy
or down."""
_TRANSIENT_ERRORS = (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError)
"""No answer to an ack or a release that is tried again: timed out, refused, reset, dropped mid-answer."""
_ANSWER_LOST = (httpx.ReadTimeout, httpx.WriteTimeout, httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)
"""No answer to a lease that is tried again, with the first try's `Idempotency-Key`: the request may have reached
the collector and leased a batch (timed out or cut off once sent), which the retry then gets. One that never left
(refused, no connection) is not tried again: the next step leases anew."""

_Answer = TypeVar("_Answer", bound=BaseModel)

_GROUPS = TypeAdapter(list[GroupStatus])
"""Reads `GET /v1/groups`."""


class CollectorClient:
    """Talks to the collector at `settings.collector`, with `ART_API_KEY` when one is set.

    Args:
        settings: `collector`, `api_key`, `batch_groups` and `name` (the trainer named in leases).
        transport: httpx transport (tests inject a mock).
    """

    def __init__(self, settings: TrainerSettings, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.settings = settings
        headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
        self.http = httpx.AsyncClient(base_url=settings.collector, headers=headers, timeout=_TIMEOUT_S,
                                      transport=transport)
        """The HTTP client (the evaluator reads an eval split through it too)."""
        self.shown_url = str(httpx.URL(settings.collector).copy_with(userinfo=b""))
        """The collector's URL as messages show it: without the user and password it may hold."""

    async def ready_groups(self) -> int:
        """Groups ready for training (`GET /v1/groups?state=ready`).

        Raises:
            ServiceError: 502 when the collector does not answer, or not with a list of groups.
        """
        response = await self._send("GET", "/v1/groups", params={"state": "ready"})
        if response.status_code != 200:
            raise ServiceError(502, "collector_error", f"GET /v1/groups?state=ready: {self._refusal(response)}",
                               type="server_error")
        try:
            listed = _GROUPS.validate_json(response.content)
        except ValidationError as exc:
            raise ServiceError(502, "collector_error", "GET /v1/groups?state=ready did not answer with groups: "
                               f"{_problems(exc)}", type="server_error") from exc
        return sum(1 for group in listed if group.state == "ready")  # a collector without the filter lists all

    async def lease(self, min_groups: int) -> Batch:
        """Lease up to `batch_groups` ready groups, none unless `min_groups` are ready (`POST /v1/batches`).

        The lease lasts `settings.lease_seconds()`, the step's timeout and a margin: the collector's default
        (900 s) would offer a batch to another trainer, and count a failed attempt, while a long step still trains.
        The request carries a fresh `Idempotency-Key`; one whose answer is lost (`_ANSWER_LOST`), or a 502, 503 or
        504, is tried again with it as an ack is, and gets the batch the lost answer held rather than a second lease
        while that one holds its groups.

        Raises:
            ServiceError: 502 when the collector does not answer or not with a batch (one whose answer names its
                batch and holds groups is released, not as failed); 409 `no_batch_ready` when it has nothing ready.
        """
        request = BatchRequest(max_groups=self.settings.batch_groups, min_groups=min_groups, trainer=self.settings.name,
                               lease_seconds=self.settings.lease_seconds())
        response, tried = await self._post_retried("/v1/batches", request.model_dump(), "lease",
                                                   headers={IDEMPOTENCY_KEY_HEADER: uuid.uuid4().hex},
                                                   retried=_ANSWER_LOST)
        if isinstance(response, httpx.HTTPError):
            raise self._unavailable(response, tried) from response
        if response.status_code != 200:
            raise ServiceError(502, "collector_error", f"The collector refused a batch lease: "
                               f"{self._refusal(response)}", type="server_error")
        try:
            batch = Batch.model_validate_json(response.content)
        except ValidationError as exc:
            fate = await self._release_unread(response, exc)
            raise ServiceError(502, "collector_error", f"The collector answered a batch lease with something that "
                               f"is not a batch: {_problems(exc)}{fate}", type="server_error") from exc
        if not batch.groups:
            ready = ("no rewarded group ready for training yet" if min_groups <= 1 else
                     f"fewer than {min_groups} rewarded groups ready for training (--min-groups {min_groups}), so it "
                     "leased none")
            raise ServiceError(409, "no_batch_ready", f"The collector has {ready}; record more rollouts with rewards "
                               "and try again.")
        return batch

    async def ack(self, batch_id: str, step: int | None) -> None:
        """Mark batch `batch_id` trained by `step` (None: acked without a step) (`POST /v1/batches/{id}/ack`).

        An ack that gets no answer, or a 502, 503 or 504, is tried again (`_RETRY_TRIES` in all, waits doubling
        from `_RETRY_FIRST_S`, each logged): the collector takes the same ack twice, and one not taken
        would let the lease expire and the batch train again.

        Raises:
            ServiceError: 502 `ack_failed` when the collector does not answer or answers 502, 503 or 504 to every
                try, refuses (any other error status, at once), or answers with something that is not an ack.
        """
        done = "nothing in it can train, no step was taken" if step is None else f"step {step} is saved and served"
        await self._post_to_batch(batch_id, "ack", AckRequest(policy_step=step), AckResponse, "an ack",
                                  f" ({done})", ". Its groups will be offered again after the lease.")

    async def release(self, batch_id: str, reason: str, failed: bool) -> ReleaseResponse:
        """Give batch `batch_id` back untrained (`POST /v1/batches/{id}/release`): its groups can be leased again now.

        A release that gets no answer, or a 502, 503 or 504, is tried again as an ack is: the collector takes the
        same release twice, and one not taken would let the lease expire, which counts a failed attempt for each
        group even when `failed` is False.

        Args:
            batch_id: the leased batch.
            reason: what went wrong (the step's error; the collector keeps 2000 characters).
            failed: True when the batch's data made the step fail (the collector counts a failed attempt for each
                group and skips a group at its limit); False when the trainer itself failed (disk, vLLM).

        Raises:
            ServiceError: 502 `release_failed` when the collector does not answer or answers 502, 503 or 504 to
                every try, refuses (any other error status, at once), or answers with something that is not a
                release.
        """
        return await self._post_to_batch(batch_id, "release", ReleaseRequest(reason=reason, failed=failed),
                                         ReleaseResponse, "a release")

    async def _release_unread(self, response: httpx.Response, error: ValidationError) -> str:
        """Give back a lease whose answer names its batch but is not one (a collector of another version): left
        leased, its groups would wait for the lease to expire and count a failed attempt. Returns what the
        lease's error message adds: the release, or why there was none."""
        answer = _json(response)
        batch_id, groups = (answer.get("id"), answer.get("groups")) if isinstance(answer, dict) else (None, None)
        if not isinstance(batch_id, str) or not isinstance(groups, list) or not groups:
            return ""  # no batch to release: a lease of no group stores none
        try:
            await self.release(batch_id, f"the trainer could not read the lease: {_problems(error)}", False)
        except ServiceError as exc:
            return f"; {exc.body.error.message}; its groups come back when the lease expires"
        return f"; batch {batch_id} was released (not as failed), its groups are back in the collector's pool"

    async def aclose(self) -> None:
        """Close the HTTP client."""
        await self.http.aclose()

    async def _post_to_batch(self, batch_id: str, call: str, body: BaseModel, answer: type[_Answer], named: str,
                             said: str = "", unanswered: str = "") -> _Answer:
        """`POST /v1/batches/{batch_id}/{call}` (`_post_retried`) and its `answer`; `named` is that answer with its
        article, `said` what the messages add after the batch, `unanswered` what they add when it got no answer.

        Raises:
            ServiceError: 502 `{call}_failed` when the collector does not answer or answers 502, 503 or 504 to every
                try, refuses (any other error status, at once), or answers with something that is not `answer`.
        """
        code = f"{call}_failed"
        response, tried = await self._post_retried(f"/v1/batches/{batch_id}/{call}", body.model_dump(),
                                                   f"{call} of batch {batch_id}")
        if isinstance(response, httpx.HTTPError):
            raise ServiceError(502, code, f"Could not {call} batch {batch_id}{said}{tried}: {_unanswered(response)}"
                               f"{unanswered}", type="server_error") from response
        if response.status_code != 200:
            raise ServiceError(502, code, f"The collector refused the {call} of batch {batch_id}{said}{tried}: "
                               f"{self._refusal(response)}", type="server_error")
        try:
            return answer.model_validate_json(response.content)
        except ValidationError as exc:
            raise ServiceError(502, code, f"The collector answered the {call} of batch {batch_id}{said} with something "
                               f"that is not {named}: {_problems(exc)}", type="server_error") from exc

    async def _post_retried(self, path: str, body: dict[str, Any], what: str, *,
                            headers: dict[str, str] | None = None,
                            retried: tuple[type[httpx.HTTPError], ...] = _TRANSIENT_ERRORS,
                            ) -> tuple[httpx.Response | httpx.HTTPError, str]:
        """POST `body` (and `headers`) to `path`, tried again on no answer (the errors `retried`) or a 502, 503 or
        504 (`_RETRY_TRIES` in all, waits doubling from `_RETRY_FIRST_S`, each logged as `what` failing); return
        the last answer, or the error that ended the tries (one not retried, or the last try's), and "" or
        " in N tries" for its message."""
        backoff, tries = Backoff(_RETRY_FIRST_S, _RETRY_LONGEST_S), 1
        while True:
            tried = "" if tries == 1 else f" in {tries} tries"
            try:
                response = await self.http.post(path, json=body, headers=headers)
            except httpx.HTTPError as exc:
                if not isinstance(exc, retried) or tries == _RETRY_TRIES:
                    return exc, tried
                problem = _unanswered(exc)
            else:
                if response.status_code not in _TRANSIENT_STATUSES or tries == _RETRY_TRIES:
                    return response, tried
                problem = f"HTTP {response.status_code}"
            delay = backoff.failed()
            logger.warning("%s failed (%s; try %d of %d); trying again in %.0f s", what, problem, tries, _RETRY_TRIES,
                           delay)
            await asyncio.sleep(delay)
            tries += 1

    async def _send(self, method: str, path: str, *, params: dict[str, str] | None = None,
                    json: dict[str, Any] | None = None) -> httpx.Response:
        try:
            return await self.http.request(method, path, params=params, json=json)
        except httpx.HTTPError as exc:
            raise self._unavailable(exc) from exc

    def _unavailable(self, error: httpx.HTTPError, tried: str = "") -> ServiceError:
        """The 502 `collector_unavailable` of a call that got no answer (`error`; `tried`: " in N tries" or "")."""
        return ServiceError(502, "collector_unavailable",
                            f"The collector at {self.shown_url} did not answer{tried} ({_unanswered(error)}). "
                            "Start it (`art-collector serve`) or point --collector at it.", type="server_error")

    def _refusal(self, response: httpx.Response) -> str:
        """An error answer as messages show it: its status and the start of its body, and for a 401 what to do
        about `ART_API_KEY`."""
        body = response.text[:300]
        shown = f"HTTP {response.status_code}: {body}" if body else f"HTTP {response.status_code}"
        if response.status_code == 409 and _error_code(response) == "lease_expired":  # an ack after the lease
            lease = self.settings.lease_seconds()
            return (f"{shown} (the step outlasted its lease, --train-step-timeout plus {LEASE_MARGIN_S:g} s = "
                    f"{lease:g} s: raise --train-step-timeout (ART_TRAINER_TRAIN_STEP_TIMEOUT) above the longest step)")
        if response.status_code != 401:
            return shown
        if self.http.base_url.userinfo:  # httpx sends them as Basic auth, in place of the Bearer key
            return (f"{shown} (the user and password in --collector's URL are sent in place of ART_API_KEY: "
                    "take them out of the URL)")
        key = ("ART_API_KEY is not the collector's key" if self.settings.api_key
               else "ART_API_KEY is not set and the collector requires one")
        return f"{shown} ({key}: set ART_API_KEY to the collector's ART_API_KEY and restart the trainer)"


def _json(response: httpx.Response) -> Any:
    """The JSON `response` holds, or None where it holds none Python reads (not JSON, not UTF-8, nested past the
    recursion limit, which pydantic's parser refuses as an error but `json.loads` raises as `RecursionError`)."""
    try:
        return json.loads(response.content)
    except (ValueError, RecursionError):
        return None


def _error_code(response: httpx.Response) -> str | None:
    """The `error` code of the collector's error envelope in `response`, or None."""
    body = _json(response)
    code = body.get("error") if isinstance(body, dict) else None
    return code if isinstance(code, str) else None


def _unanswered(error: httpx.HTTPError) -> str:
    """Why a call got no answer, as `ReadTimeout: no answer within 60 s`: httpx's timeouts, and some
    connections that broke, carry no message of their own."""
    if isinstance(error, httpx.TimeoutException):
        return f"{type(error).__name__}: no answer within {_TIMEOUT_S:g} s"
    return f"{type(error).__name__}: {str(error) or 'the connection ended without an answer'}"


def _problems(error: ValidationError) -> str:
    """What an answer lacks, on one line (`groups: Field required; id: Input should be a valid string`), at most
    500 characters: pydantic's own text spans lines and links its docs."""
    return "; ".join(validation_problem(problem) for problem in error.errors())[:500]
