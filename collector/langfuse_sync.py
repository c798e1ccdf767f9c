"""Langfuse sync: human scores in as rewards, computed rewards out as scores.

Uses the `langfuse` SDK's REST client (`LangfuseAPI`): scores are read with
`GET /api/public/v3/scores` (cursor paging, filtered by source, name and data type, with the
`subject` field group that carries the trace id) and written with `POST /api/public/scores` (a
list). A score becomes a reward of the same name on the trajectory of its trace (Langfuse's
trace id is the OpenTelemetry trace id when the agent's spans fan out to Langfuse). Only numeric
and boolean scores can be rewards, and only they are read; each score of a page is read with the SDK's model on
its own, so one it rejects (a NUMERIC score whose value is null) is ignored and logged, not the page. Scores already
pulled at the same `updatedAt` are not applied again (a reward and the record of its score's pull are stored in
one transaction, which claims the score: a replica on the same database that pulled that version or a later one
first keeps its reward from being stored). Langfuse
lists no deletions: a score pulled within the lookback that the listing leaves out is asked for
by id (the `id` filter of the same endpoint), and one that is gone has its rewards taken back
(with its record, in one transaction) unless its group is leased or trained. Pushed scores get a stable id per
(trajectory, reward name), so a changed reward updates the same score in Langfuse; the scores pushed for a
trajectory the store deleted since (another instrumentation's calls in a rollout's trace) are deleted there
(`DELETE /api/public/scores/{scoreId}`) by the next sync, `INGEST_DELAY` after the deletion at the earliest
(Langfuse's 404: gone already); one Langfuse fails to delete
for now is tried again after a growing delay (no sooner than its `Retry-After` asks, within an hour), one it refuses
(another 4xx, a proxy's 404 too) is given up. A later trajectory of the deleted one's id pushes its scores under other
ids, once the deleted one's are deleted. Each call of Langfuse's API, retries included, ends within `timeout_seconds`
(`LangfuseSync._call`): the SDK's own retries, which wait up to a minute each, are off.
"""

from __future__ import annotations

import datetime as dt
import email.utils
import functools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import httpx
from langfuse import __version__
from langfuse.api import (
    CreateScoreBatchResults,
    CreateScoreRequest,
    CreateScoreSource,
    GetScoresV3Meta,
    GetScoresV3Response,
    LangfuseAPI,
    ScoreDataType,
    ScoreV3,
)
from langfuse.api.core.api_error import ApiError
from langfuse.api.core.datetime_utils import serialize_datetime
from langfuse.api.core.http_client import HttpClient
from langfuse.api.core.pydantic_utilities import parse_obj_as
from langfuse.api.core.request_options import RequestOptions
from pydantic import ValidationError
from sqlalchemy import Connection, func, select
from sqlalchemy.exc import DBAPIError

from collector.errors import CollectorError
from collector.protocol import RewardAccepted, RewardIn
from collector.read_protocol import LangfuseSyncResult
from collector.schema import langfuse_pulled, score_version
from collector.scoring_config import LangfuseSettings
from collector.scoring_store import INGEST_DELAY, ScoringStore
from collector.spans import warn_once
from collector.store_base import Store
from collector.transactions import LANGFUSE_SYNC_LOCK

__all__ = ["LangfuseSync", "LangfuseSyncError", "make_client"]

log = logging.getLogger(__name__)

PAGE = 100
"""Scores per page (Langfuse's maximum)."""

REWARD_TYPES = "NUMERIC,BOOLEAN"
"""The score data types that can be rewards (the listing's `dataType` filter)."""

SCORES = "api/public/v3/scores"
"""The path of the scores listing, from the host."""

_KEYS = "check ART_COLLECTOR_LANGFUSE_PUBLIC_KEY and ART_COLLECTOR_LANGFUSE_SECRET_KEY (or LANGFUSE_*):"
_HINTS = {
    401: f"{_KEYS} a key pair of a project on this host",
    403: f"{_KEYS} a key pair of a project on this host, allowed to read and write scores",
    404: "is the host Langfuse's base URL? A self-hosted Langfuse serves GET /api/public/v3/scores only when started "
    "with LANGFUSE_ENABLE_SCORES_V3_API=true (Langfuse Cloud always does)",
}
"""What to check when Langfuse answers a status that a configuration mistake gives."""

_GONE = "Score not found within authorized project"
"""The message of Langfuse's 404 to the deletion of a score it does not have: a Langfuse before January 2025 looks the
score up (a later one queues the deletion of any id, 202). A 404 without it is none of Langfuse's (a proxy's)."""

_DELETE_HINTS = {
    **{status: hint for status, hint in _HINTS.items() if status != 404},
    404: f"not Langfuse's answer for a score it does not have ({_GONE!r}): does a proxy in front of it pass "
    "DELETE /api/public/scores/{scoreId} on?",
}
"""`_HINTS` for the deletion of a score; its 404 is Langfuse's only with `_GONE` (the score is gone), and the sync,
which pulls first, has found Langfuse's API on the host."""

RETRY_DELAY = (60.0, 3600.0)
"""The least and the most seconds before a deletion that failed for now (`_transient`), or a score Langfuse rejected,
is tried again."""

RETRIES = 2
"""How many times a call of Langfuse's API that failed for now with an answer (`_transient`) is tried again at most,
as the SDK's default, within the call's deadline (`LangfuseSync._call`)."""

FIRST_RETRY_WAIT = 1.0
"""Seconds before a call's first retry when Langfuse sends no `Retry-After`; doubles with each retry."""


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
    """The HTTP status Langfuse answered in `exc` (`LangfuseSync._call`'s error); None when it gave no answer."""
    cause = exc.__cause__
    return cause.status_code if isinstance(cause, ApiError) else None


def _gone(exc: LangfuseSyncError) -> bool:
    """Whether `exc`, the failed deletion of a score, is Langfuse's 404 for a score it does not have (`_GONE`)."""
    cause = exc.__cause__
    return (isinstance(cause, ApiError) and cause.status_code == 404 and isinstance(cause.body, dict)
            and cause.body.get("message") == _GONE)


def _transient(exc: LangfuseSyncError) -> bool:
    """Whether a request that failed with `exc` may succeed later: no answer (an outage, a timeout, a body the SDK
    cannot read), a 5xx, 408 or 429; any other 4xx is final."""
    status = _status(exc)
    return status is None or not 400 <= status < 500 or status in (408, 429)


def _retry_after(exc: LangfuseSyncError, now: float) -> float | None:
    """The seconds Langfuse's answer in `exc` asks to wait before a retry (`Retry-After`: delay seconds, or an HTTP
    date, counted from `now`; at least 0); None without the header, or with one that is neither (then the caller's own
    delay applies)."""
    cause = exc.__cause__
    headers = cause.headers if isinstance(cause, ApiError) and cause.headers else {}
    value = next((str(v).strip() for k, v in headers.items() if k.lower() == "retry-after"), None)
    if value is None:
        return None
    if value.isascii() and value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, (when if when.tzinfo else when.replace(tzinfo=dt.UTC)).timestamp() - now)


def _retry_delay(age: float) -> float:
    """Seconds before a failed deletion of a score pushed `age` seconds ago is tried again: as long as its age, within
    `RETRY_DELAY`, so each failure of the same score (at least) doubles its age and the delay grows. A score pushed at
    a time still ahead of the clock (which moved back since) has its age counted from its first failure instead
    (`LangfuseSync._retract`), so that the delay grows all the same."""
    least, most = RETRY_DELAY
    return min(most, max(least, age))


class LangfuseSyncError(CollectorError):
    """Langfuse could not be reached or refused a request (502)."""

    status = 502
    code = "langfuse_error"


def _http_client(client: LangfuseAPI) -> HttpClient:
    """The SDK's HTTP client in `client` (its auth, headers, timeout and retries), through which `LangfuseSync._get`
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


def _unlock(conn: Connection, idle_timeout: bool) -> None:
    """Release the sync's one-replica lock on `conn` (`LangfuseSync._one_replica`), and reset the session's idle
    timeout (`idle_timeout`) before the connection goes back to the pool. A connection lost during the sync (the
    server restarted, a network cut) took the lock with it: logged, as another replica may have synced meanwhile;
    the sync's work is stored, so it is not reported as failed."""
    try:
        conn.execute(select(func.pg_advisory_unlock(LANGFUSE_SYNC_LOCK, 0)))
        if idle_timeout:
            conn.exec_driver_sql("RESET idle_session_timeout")
    except DBAPIError as exc:
        if not exc.connection_invalidated:
            raise
        log.warning("the database connection holding the Langfuse sync's one-replica lock was lost during the sync "
                    "(%s): another replica may have synced at the same time", exc.orig)


def _score_id(trajectory_id: str, created_at: float, name: str) -> str:
    """The id of the score pushed for the reward `name` of the trajectory `trajectory_id` that the store created at
    `created_at`: the same on every push and replica, and another for a later trajectory of the same id (a deleted
    one's), so that a deletion of the earlier one's score that Langfuse applies late cannot delete it. Scores pushed
    before this derivation keep their recorded ids (`ScoringStore.pushed`)."""
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"art-langgraph:{trajectory_id}:{name}:{created_at!r}"))


def _trace_of(score: object) -> str | None:
    """Trace id of a trace- or observation-level score; None for session and experiment scores."""
    subject = getattr(score, "subject", None)
    kind = getattr(subject, "kind", None)
    if kind == "trace":
        return str(subject.id).replace("-", "").lower()
    if kind == "observation" and getattr(subject, "trace_id", None):
        return str(subject.trace_id).replace("-", "").lower()
    return None


def _numeric(score: object) -> float | None:
    """A reward value from a numeric or boolean score; None for text, categorical and correction scores."""
    kind, value = getattr(score, "data_type", None), getattr(score, "value", None)
    if kind == "BOOLEAN":
        return 1.0 if value else 0.0
    if kind == "NUMERIC" and isinstance(value, int | float):
        return float(value)
    return None


def _storable(score_id: str) -> bool:
    """Whether every backend can hold `score_id` (`langfuse_pulled.score_id`): UTF-8 with no NUL (JSON's `\\u0000`,
    which PostgreSQL's text cannot hold), at most as long as the column."""
    try:
        score_id.encode()
    except UnicodeEncodeError:  # a lone surrogate, which JSON's escapes can carry
        return False
    return "\x00" not in score_id and len(score_id) <= langfuse_pulled.c.score_id.type.length


def _reward_of(score: object) -> RewardIn | None:
    """The reward a score gives its trace, or None: session and experiment scores, and scores on a trace id that is
    no OpenTelemetry one or with an id the store cannot hold (logged once per process: every sync pulls the whole
    lookback again), give none."""
    trace_id, value = _trace_of(score), _numeric(score)
    if trace_id is None or value is None:
        return None
    if not _storable(getattr(score, "id")):
        warn_once(log, "Langfuse score %r cannot be a reward: its id is no UTF-8 text of at most %d characters with "
                  "no NUL; ignored", getattr(score, "id"), langfuse_pulled.c.score_id.type.length)
        return None
    try:
        return RewardIn(trace_id=trace_id, name=getattr(score, "name"), value=value)
    except ValidationError as exc:  # a trace id that is no OpenTelemetry one, an over-long name
        warn_once(log, "Langfuse score %s cannot be a reward: %s; ignored", getattr(score, "id"),
                  exc.errors()[0]["msg"])
        return None


class _Rejection(NamedTuple):
    """A score Langfuse rejected (`LangfuseSync.push`), remembered by the process: its value, how many times in a row
    that value was rejected, and when it is sent again at the earliest (unless its value changes)."""

    value: float
    times: int
    retry_at: float


class _Claimed(Exception):
    """Scores of a page that another sync marked pulled first (`LangfuseSync._claim`); rolls the page back."""

    def __init__(self, score_ids: set[str]) -> None:
        super().__init__(f"pulled by another sync: {sorted(score_ids)}")
        self.score_ids = score_ids


class LangfuseSync:
    """Pulls scores into the store and pushes rewards to Langfuse; `sync()` does both."""

    def __init__(
        self,
        store: Store,
        scoring: ScoringStore,
        settings: LangfuseSettings,
        *,
        client: LangfuseAPI | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store, self.scoring, self.settings = store, scoring, settings
        self.client = client or make_client(settings)
        self._http = _http_client(self.client)
        self.clock = clock
        self._lock = threading.Lock()
        self._rejections: dict[tuple[str, str], _Rejection] = {}
        """The scores Langfuse rejected, by (trajectory id, reward name): `push` holds them back a while."""

    def _call(
        self, what: str, fn: Callable[[RequestOptions], object], hints: dict[int, str] = _HINTS, retries: int = RETRIES
    ) -> object:
        """`fn(options)`, a call of Langfuse's API with the SDK's request options `options`; any way Langfuse fails, a
        malformed answer too, raises `LangfuseSyncError` (502), with the hint of `hints` for its status, if any.

        The whole call, retries included, ends within `timeout_seconds`: the SDK's own retries are off (each of them
        waits up to a minute, whatever the timeout), and an answer that failed for now (`_transient`: a 5xx, 408 or
        429) is asked again at most `retries` times, after its `Retry-After` or else a doubling wait
        (`FIRST_RETRY_WAIT`), only when that wait ends before the deadline; a try gets what is left of it."""
        deadline = time.monotonic() + self.settings.timeout_seconds
        attempt = 0
        while True:
            options: RequestOptions = {"max_retries": 0, "timeout_in_seconds": deadline - time.monotonic()}
            try:
                return self._once(what, functools.partial(fn, options), hints)
            except LangfuseSyncError as exc:
                wait = self._retry_wait(exc, attempt)
                if attempt == retries or wait is None or time.monotonic() + wait >= deadline:
                    raise
            time.sleep(wait)
            attempt += 1

    @staticmethod
    def _retry_wait(exc: LangfuseSyncError, attempt: int) -> float | None:
        """Seconds before the retry of a call whose try `attempt` (0: the first) failed with `exc`: its `Retry-After`,
        else `FIRST_RETRY_WAIT` doubled per try; None when it is not to be retried within the call (no answer, which
        took its time already, or a final 4xx)."""
        if _status(exc) is None or not _transient(exc):
            return None
        after = _retry_after(exc, time.time())
        return FIRST_RETRY_WAIT * 2**attempt if after is None else after

    def _once(self, what: str, fn: Callable[[], object], hints: dict[int, str]) -> object:
        """`fn()`, one try of a call of Langfuse's API (`_call`), its failures raised as `LangfuseSyncError`."""
        try:
            return fn()
        except ApiError as exc:
            hint = f"; {hints[exc.status_code]}" if exc.status_code in hints else ""
            raise LangfuseSyncError(f"Langfuse {what} answered {exc.status_code}: {exc.body!r}{hint}") from exc
        except ValidationError as exc:  # a 2xx body the SDK cannot read: a proxy's page, no page of scores
            raise LangfuseSyncError(f"Langfuse {what} answered something its API does not define: {exc}") from exc
        except httpx.HTTPError as exc:
            raise LangfuseSyncError(
                f"Langfuse {what} unreachable at {self.settings.host}: {exc}", code="langfuse_unreachable"
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

    def _scores(self, **params: Any) -> tuple[list[Any], str | None, list[str | None]]:
        """One page of `GET /api/public/v3/scores` with the query `params`: its scores, the next page's cursor, and the
        ids (None: it has none) of the scores in it that the SDK's model rejects (`_page_of`), logged and left out."""
        scores, cursor, rejected = self._call("GET /api/public/v3/scores",
                                              lambda options: _page_of(self._get(SCORES, params, options)))
        for item, exc in rejected:
            score_id = _item_id(item)
            # once per process: every sync pulls the whole lookback again, and logged the same score each time
            warn_once(log, "Langfuse score %s does not fit Langfuse's API definition (%s); ignored",
                      "without an id" if score_id is None else score_id,
                      "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()))
        return scores, cursor, [_item_id(item) for item, _ in rejected]

    def pull(self) -> LangfuseSyncResult:
        """Read scores (configured sources and names, within the lookback) and store new or changed ones as rewards."""
        s = self.settings
        start = self.clock() - s.lookback_hours * 3600
        since = dt.datetime.fromtimestamp(start, tz=dt.UTC)
        found, rejected, cursor, cursors = [], [], None, set()
        while True:
            page, cursor, unread = self._scores(
                limit=PAGE, cursor=cursor, fields="subject", source=",".join(s.sources) or None,
                name=",".join(s.score_names) or None, dataType=REWARD_TYPES, fromTimestamp=serialize_datetime(since),
            )
            found += page
            rejected += unread
            if not cursor:
                break
            if cursor in cursors:  # the same page again, and again: a proxy that caches by path, a broken server
                raise LangfuseSyncError(f"Langfuse GET /{SCORES} answered the cursor of an earlier page again "
                                        f"({cursor!r}): its pages would never end")
            cursors.add(cursor)
        found.sort(key=lambda score: (score.timestamp, score.updated_at))  # the latest score of a name wins
        usable = [(score, reward) for score in found if (reward := _reward_of(score)) is not None]
        seen = self.scoring.pulled_versions([score.id for score, _ in usable])
        latest: dict[tuple[str | None, str], tuple[str, RewardIn]] = {}
        marks: dict[str, dict[str, Any]] = {}  # the new or changed scores, by id
        for score, reward in usable:
            latest[(reward.trace_id, reward.name)] = (score.id, reward)
            version = score_version(score.updated_at)
            if seen.get(score.id) != version:
                marks[score.id] = {"score_id": score.id, "updated_at": version, "trace_id": reward.trace_id,
                                   "name": reward.name, "value": reward.value, "pulled_at": self.clock()}
        # only a new or edited latest score of its trace and name is applied: an edit to an older score changes
        # nothing (the newer one holds, applied when it came), and applying the unchanged newer one again would
        # override a reward given since (the store's newest API reward of a name wins)
        due = [(score_id, reward) for score_id, reward in latest.values() if score_id in marks]
        applied, unmatched = self._apply(due, marks) if marks else (0, 0)
        # a score the SDK's model rejects is still Langfuse's: not one deleted there
        listed = {score.id for score in found} | {score_id for score_id in rejected if score_id is not None}
        withdrawn = self._withdraw(start, listed, latest)
        return LangfuseSyncResult(pulled=len(found) + len(rejected), applied=applied, unmatched=unmatched,
                                  ignored=len(found) - len(usable) + len(rejected), withdrawn=withdrawn, pushed=0)

    def _apply(self, due: list[tuple[str, RewardIn]], marks: dict[str, dict[str, Any]]) -> tuple[int, int]:
        """Store the `due` rewards (score id, reward), `PAGE` at a time, each transaction with the marks (`marks`, by
        score id) of its scores, so that a score is marked pulled exactly when its reward is stored: after a store
        error the next sync applies what was not stored, and nothing twice. The marks of the other new or changed
        scores (none of them the latest of its trace and name: nothing to apply) go with the first. Returns how many
        rewards were stored, and how many of them found no trajectory."""
        applied = {score_id for score_id, _ in due}
        others = [mark for score_id, mark in marks.items() if score_id not in applied]
        stored = unmatched = 0
        for first in range(0, max(len(due), 1), PAGE):
            chunk = due[first : first + PAGE]
            rows = [marks[score_id] for score_id, _ in chunk] + (others if first == 0 else [])
            accepted = self._apply_page(chunk, rows)
            stored += len(accepted)
            unmatched += sum(not reward.trajectory_known for reward in accepted)
        return stored, unmatched

    def _apply_page(self, chunk: list[tuple[str, RewardIn]], rows: list[dict[str, Any]]) -> list[RewardAccepted]:
        """Store a page's rewards (score id, reward) with the marks `rows` in one transaction, but not the rewards of
        scores that another sync (a replica's on the same database) marked pulled at the same or a later version
        since this one read the marks: it applied them, and storing them (again, or an older version) would override
        the rewards given since. Such a page's transaction is rolled back and run again without them."""
        while True:
            due = {score_id for score_id, _ in chunk}
            try:
                return self.store.add_rewards(
                    [reward for _, reward in chunk], score_ids=[score_id for score_id, _ in chunk],
                    also=functools.partial(self._claim, rows=rows, due=due),
                )
            except _Claimed as claimed:
                log.info("Langfuse scores %s were pulled at this or a later version by another sync meanwhile: "
                         "not applied", sorted(claimed.score_ids))
                chunk = [(score_id, reward) for score_id, reward in chunk if score_id not in claimed.score_ids]
                rows = [row for row in rows if row["score_id"] not in claimed.score_ids]

    def _claim(self, conn: Connection, rows: list[dict[str, Any]], due: set[str]) -> None:
        """Mark the scores of `rows` pulled, on `conn` (`Store.add_rewards`'s `also`); raises `_Claimed`, rolling
        the transaction back, when another sync marked one of the `due` scores (those whose rewards it stores)."""
        claimed = due - self.scoring.mark_pulled(conn, rows)
        if claimed:
            raise _Claimed(claimed)

    def _withdraw(
        self, start: float, listed: set[str], latest: dict[tuple[str | None, str], tuple[str, RewardIn]]
    ) -> int:
        """Take back the rewards of pulled scores deleted in Langfuse; returns how many.

        A score pulled within the lookback (from `start` on) that the listing left out is asked for by id: it may only
        have aged out of the lookback, or have a name or source no longer pulled. One Langfuse does not return is
        gone: its rewards are withdrawn and the latest remaining score of its trace and name (in `latest`) holds.
        """
        missing = {  # an id with a comma cannot be asked for (the `id` filter is comma-separated): never withdrawn
            row["score_id"]: row for row in self.scoring.pulled_since(start)
            if row["score_id"] not in listed and "," not in row["score_id"]
        }
        ids = sorted(missing)
        for first in range(0, len(ids), PAGE):
            page, _, rejected = self._scores(limit=PAGE, id=",".join(ids[first : first + PAGE]))
            for score_id in [score.id for score in page] + rejected:
                missing.pop(score_id, None)
        withdrawn = 0
        for score_id, row in missing.items():
            # the score's record goes in the transaction that takes its rewards back: both, or neither
            forget = functools.partial(self.scoring.forget_pulled, score_id=score_id)
            if self.store.withdraw_score(score_id, latest.get((row["trace_id"], row["name"])), also=forget):
                withdrawn += 1
            else:
                log.info("Langfuse score %s was deleted, but trace %s is in a leased or trained group: its reward "
                         "stays (tried again next sync while it is leased)", score_id, row["trace_id"])
        return withdrawn

    def _retract(self) -> tuple[int, int, int]:
        """Delete in Langfuse the pushed scores marked for it (their trajectories were deleted,
        `ScoringStore.retract_pushed`) whose try is due, `PAGE` records read at a time, then each one's record;
        returns (deleted, refused, failed).

        Langfuse's 404 (`_gone`) says the score is gone already: done. Any other 4xx but 408 and 429 (a server that
        refuses deletions, a key not allowed to delete, a proxy's 404) is final: logged, the record dropped, the score
        left in Langfuse. A transient failure (5xx, 408, 429, no answer) is logged and tried again after a growing
        delay (`_retry_delay`), or after Langfuse's `Retry-After` where that is longer (at most `RETRY_DELAY`'s
        most: Langfuse Cloud limits deletions per day), and stops this sync's deletions: the others wait for the next
        sync, not for Langfuse's timeout one by one."""
        now = self.clock()
        deleted = refused = 0
        while rows := self.scoring.to_retract(now, limit=PAGE):
            for row in rows:
                failure = self._delete_score(row["score_id"])
                if failure is not None and _transient(failure):
                    since = min(row["pushed_at"], now)  # a push time ahead of the clock (it moved back): now
                    delay = min(RETRY_DELAY[1], max(_retry_delay(now - since), _retry_after(failure, now) or 0.0))
                    log.warning("Langfuse score %s of deleted trajectory %s not deleted (tried again in %.0f s): %s",
                                row["score_id"], row["trajectory_id"], delay, failure)
                    self.scoring.retract_later(row, now + delay, since)
                    return deleted, refused, 1
                if failure is not None:
                    log.warning("Langfuse score %s of deleted trajectory %s not deleted, and not tried again: %s",
                                row["score_id"], row["trajectory_id"], failure)
                    refused += 1
                else:
                    deleted += 1
                self.scoring.forget_pushed(row)
        return deleted, refused, 0

    def _delete_score(self, score_id: str) -> LangfuseSyncError | None:
        """Delete the score `score_id` in Langfuse; None when done (Langfuse's 404 too: it is gone, `_gone`), else the
        failure (another 404 too: a proxy's, which says nothing of the score). Not tried again within the call: a
        failure for now is tried again at a later sync (`_retract`)."""
        try:
            self._call(f"DELETE /api/public/scores/{score_id}",
                       lambda options: self.client.scores.delete(score_id, request_options=options), _DELETE_HINTS,
                       retries=0)
        except LangfuseSyncError as exc:
            return None if _gone(exc) else exc
        return None

    def push(self) -> tuple[int, int]:
        """Send the configured rewards whose value changed since the last push; returns (sent, rejected). A score
        keeps the id it was first pushed under; a trajectory's whose record is a deleted one's of the same id, still
        to delete (`ScoringStore.retracting`), waits for the sync after that deletion (`_score_id`).

        Only the scores Langfuse accepts are recorded as pushed (`_create`). One it rejects (in a 207) is logged once
        per value and sent again when its value changes, or else after a delay that doubles with each rejection of
        the same value, within `RETRY_DELAY` (a minute to an hour); the process remembers the rejections, so a
        restart sends such a score again at once."""
        names = self.settings.push_names
        if not names:
            return 0, 0
        before, waiting = self.scoring.pushed(), self.scoring.retracting()
        # read before the trajectories: one deleted and created again of the same id in between is pushed with the
        # deleted one's time, and `mark_pushed` marks its score to delete, as it does a deleted one's
        created = self.scoring.created_at()
        trajectories = self.store.trajectories()
        explanations = self.scoring.judgements([t.id for t in trajectories])
        now = self.clock()
        requests, marks = [], []
        for t in trajectories:
            notes = {row["name"]: row["explanation"] for row in explanations[t.id]}
            for name in names:
                value, record = t.rewards.get(name), before.get((t.id, name))
                unchanged = record is not None and record.value == value
                if value is None or unchanged or (t.id, name) in waiting or t.id not in created:
                    continue
                if (held := self._rejections.get((t.id, name))) and held.value == value and now < held.retry_at:
                    continue
                first = record.pushed_at if record else now
                score_id = record.score_id if record else _score_id(t.id, created[t.id], name)
                requests.append(
                    CreateScoreRequest(
                        id=score_id, trace_id=t.trace_id, name=name, value=value, data_type=ScoreDataType.NUMERIC,
                        source=CreateScoreSource.API, comment=notes.get(name),
                        metadata={"art.rollout.id": t.id, "art.group": t.group_id},
                        timestamp=dt.datetime.fromtimestamp(first, tz=dt.UTC),
                    )
                )
                marks.append(
                    {"trajectory_id": t.id, "name": name, "value": value, "score_id": score_id, "pushed_at": first,
                     "created_at": created[t.id]}
                )
        live = {t.id for t in trajectories}
        self._rejections = {key: held for key, held in self._rejections.items() if key[0] in live}
        rejected = 0
        for start in range(0, len(requests), PAGE):
            accepted, refused = self._create(list(zip(requests[start : start + PAGE], marks[start : start + PAGE],
                                                      strict=True)))
            self._note(accepted, refused, now)
            rejected += len(refused)
            self.scoring.mark_pushed(accepted, now + INGEST_DELAY)
        return len(requests), rejected

    def _create(
        self, scores: list[tuple[CreateScoreRequest, dict[str, Any]]]
    ) -> tuple[list[dict[str, Any]], list[tuple[dict[str, Any], str]]]:
        """Send `scores` (request, record) to Langfuse in one request; returns the records of those it accepted, and
        those of the ones it rejected, each with Langfuse's message. A 207's errors name no score (a message each,
        `CreateScoreBatchError`), so a batch with rejections is sent again a score at a time, which tells them apart:
        an accepted score is sent twice, which updates it in place (the same id and value)."""
        answer = self._call("POST /api/public/scores", lambda options: self.client.scores.create(
            request=[request for request, _ in scores], request_options=options))
        if not isinstance(answer, CreateScoreBatchResults) or not answer.rejected:
            return [record for _, record in scores], []
        if len(scores) == 1:
            return [], [(scores[0][1], "; ".join(error.message for error in answer.errors))]
        accepted: list[dict[str, Any]] = []
        refused: list[tuple[dict[str, Any], str]] = []
        for score in scores:
            one, other = self._create([score])
            accepted += one
            refused += other
        return accepted, refused

    def _note(self, accepted: list[dict[str, Any]], refused: list[tuple[dict[str, Any], str]], now: float) -> None:
        """Remember the scores Langfuse rejected at `now` (`refused`: record, message) and when to send each again
        (`push`); forget those it `accepted`. A value's first rejection is logged as a warning, the later ones at
        debug level."""
        for record in accepted:
            self._rejections.pop((record["trajectory_id"], record["name"]), None)
        for record, why in refused:
            key = (record["trajectory_id"], record["name"])
            before = self._rejections.get(key)
            times = before.times + 1 if before and before.value == record["value"] else 1
            delay = min(RETRY_DELAY[1], RETRY_DELAY[0] * 2 ** min(times - 1, 16))  # capped: past 2**1023, no float
            self._rejections[key] = _Rejection(record["value"], times, now + delay)
            log.log(logging.WARNING if times == 1 else logging.DEBUG,
                    "Langfuse rejected score %s (reward %r = %s of trajectory %s): %s; sent again when the value "
                    "changes, or in %.0f s", record["score_id"], record["name"], record["value"],
                    record["trajectory_id"], why, delay)

    @contextmanager
    def _one_replica(self) -> Iterator[bool]:
        """Whether no other replica's sync runs on the database: on PostgreSQL, whether this one got the session-level
        advisory lock (`LANGFUSE_SYNC_LOCK`), held on a connection of its own until the block ends; on SQLite always
        True (the replicas of a file share one machine; syncs are one at a time per process, `_lock`)."""
        engine = self.scoring.engine
        if engine.dialect.name != "postgresql":
            yield True
            return
        # autocommit: the lock is the session's, and the connection holds no transaction open while the sync runs
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            if not conn.execute(select(func.pg_try_advisory_lock(LANGFUSE_SYNC_LOCK, 0))).scalar_one():
                yield False
                return
            # the session idles while the sync runs: a server's `idle_session_timeout` (PostgreSQL 14) would end it,
            # and the lock with it, mid-sync
            idle_timeout = engine.dialect.server_version_info >= (14,)
            if idle_timeout:
                conn.exec_driver_sql("SET idle_session_timeout = 0")
            try:
                yield True
            finally:  # explicitly: a closed connection's session may hold the lock a while after the close
                _unlock(conn, idle_timeout)

    def sync(self) -> LangfuseSyncResult:
        """Pull, push, then delete the scores pushed for trajectories deleted since (`_retract`); one sync at a time
        (the schedule and `POST /v1/langfuse/sync` may overlap), and on PostgreSQL one replica at a time: a sync while
        another replica's runs is skipped (`skipped`), as the two could push one score under two ids.

        The deletions come after the push; a score pushed for a trajectory deleted meanwhile
        (`ScoringStore.mark_pushed`) is deleted by the first sync `INGEST_DELAY` after its push. A later trajectory of
        a deleted one's id pushes its scores in the sync after their deletion, under other ids (`_score_id`):
        Langfuse queues a deletion, and may apply it after a later push of the same id."""
        with self._lock, self._one_replica() as alone:
            if not alone:
                log.info("Langfuse sync skipped: another replica is syncing the same database")
                return LangfuseSyncResult(pulled=0, applied=0, unmatched=0, ignored=0, pushed=0, skipped=True)
            result = self.pull()
            result.pushed, result.push_rejected = self.push()
            result.retracted, result.retract_refused, result.retract_failed = self._retract()
        log.info("Langfuse sync: %s", result.model_dump())
        return result
