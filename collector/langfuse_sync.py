"""Langfuse sync: human scores in as rewards, computed rewards out as scores.

Uses the `langfuse` SDK's REST client (`LangfuseAPI`, called through `langfuse_api`): scores are read with
`GET /api/public/v3/scores` (cursor paging, filtered by source, name and data type, with the
`subject` field group that carries the trace id) and written with `POST /api/public/scores` (a
list, `langfuse_push`). A score becomes a reward of the same name on the trajectory of its trace (Langfuse's
trace id is the OpenTelemetry trace id when the agent's spans fan out to Langfuse). Only numeric
and boolean scores can be rewards, and only they are read; each score of a page is read with the SDK's model on
its own, so one it rejects (a NUMERIC score whose value is null) is ignored and logged, not the page. Scores already
pulled at the same `updatedAt` are not applied again (a reward and the record of its score's pull are stored in
one transaction, which claims the score: a replica on the same database that pulled that version or a later one
first keeps its reward from being stored). Langfuse
lists no deletions: a score pulled within the lookback that the listing leaves out is asked for
by id (the `id` filter of the same endpoint), and one that is gone has its rewards taken back
(with its record, in one transaction) unless its group is leased or trained. The push of rewards as scores, and the
deletion of the scores pushed for trajectories the store deleted since, are `langfuse_push`'s. Each call of
Langfuse's API, retries included, waits for Langfuse within `timeout_seconds` (`LangfuseCalls.call`): the SDK's own
retries, which wait up to a minute each, are off.
"""

from __future__ import annotations

import datetime as dt
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from langfuse.api import LangfuseAPI
from langfuse.api.core.datetime_utils import serialize_datetime
from pydantic import ValidationError
from sqlalchemy import Connection, func, select
from sqlalchemy.exc import DBAPIError

from collector.langfuse_api import PAGE, SCORES, LangfuseCalls, LangfuseSyncError, make_client
from collector.langfuse_push import ScorePush
from collector.protocol import RewardAccepted, RewardIn
from collector.read_protocol import LangfuseSyncResult
from collector.schema import langfuse_pulled, score_version
from collector.scoring_config import LangfuseSettings
from collector.scoring_store import ScoringStore
from collector.spans import warn_once
from collector.store_base import Store
from collector.transactions import LANGFUSE_SYNC_LOCK

__all__ = ["LangfuseSync", "LangfuseSyncError", "make_client"]

log = logging.getLogger(__name__)


REWARD_TYPES = "NUMERIC,BOOLEAN"
"""The score data types that can be rewards (the listing's `dataType` filter)."""


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
        self.api = LangfuseCalls(client or make_client(settings), settings)
        self.client = self.api.client
        self.clock = clock
        self._lock = threading.Lock()
        self._push = ScorePush(scoring, settings, self.api)

    def pull(self) -> LangfuseSyncResult:
        """Read scores (configured sources and names, within the lookback) and store new or changed ones as rewards."""
        s = self.settings
        start = self.clock() - s.lookback_hours * 3600
        since = dt.datetime.fromtimestamp(start, tz=dt.UTC)
        found, rejected, cursor, cursors = [], [], None, set()
        while True:
            page, cursor, unread = self.api.scores(
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
        readable = [(score, reward) for score in found if (reward := _reward_of(score)) is not None]
        # not the scores this store pushed: with the API among the sources, each came back as a reward of its trace,
        # given then to every trajectory with a span there, not only the one it scored
        own = self.scoring.own_scores([score.id for score, _ in readable])
        usable = [(score, reward) for score, reward in readable if score.id not in own]
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
            page, _, rejected = self.api.scores(limit=PAGE, id=",".join(ids[first : first + PAGE]))
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

    def push(self) -> tuple[int, int]:
        """Send the configured rewards whose value changed since the last push; returns (sent, rejected)
        (`ScorePush.push`)."""
        return self._push.push(self.clock)

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
        """Pull, push, then delete the scores pushed for trajectories deleted since (`ScorePush.retract`); one sync at a
        time (the schedule and `POST /v1/langfuse/sync` may overlap), and on PostgreSQL one replica at a time: a sync
        while another replica's runs is skipped (`skipped`), as the two could push one score under two ids.

        The deletions come after the push; a score pushed for a trajectory deleted meanwhile
        (`ScoringStore.mark_pushed`) is deleted by the first sync `INGEST_DELAY` after its push. A later trajectory of
        a deleted one's id pushes its scores in the sync after their deletion, under other ids
        (`langfuse_push._score_id`): Langfuse queues a deletion, and may apply it after a later push of the same id."""
        with self._lock, self._one_replica() as alone:
            if not alone:
                log.info("Langfuse sync skipped: another replica is syncing the same database")
                return LangfuseSyncResult(pulled=0, applied=0, unmatched=0, ignored=0, pushed=0, skipped=True)
            result = self.pull()
            result.pushed, result.push_rejected = self.push()
            result.retracted, result.retract_refused, result.retract_failed = self._push.retract(self.clock)
        log.info("Langfuse sync: %s", result.model_dump())
        return result
