"""The push of rewards to Langfuse as scores, and the deletion there of the scores of deleted trajectories.

Scores are written with `POST /api/public/scores` (a list). Pushed scores get a stable id per (trajectory, reward
name) and a stable timestamp, their trajectory's creation, so that a changed reward, or a push sent again after its
answer was lost, updates the same score in Langfuse, which keeps a score by its id, name and the date of its
timestamp: sent again with a timestamp on another date, it is a second score
(https://langfuse.com/faq/all/tracing-data-updates, "Updating scores"). The scores pushed for a trajectory the store
deleted since (another instrumentation's calls in a rollout's trace) are deleted there
(`DELETE /api/public/scores/{scoreId}`) by the next sync, `INGEST_DELAY` after the deletion at the earliest
(Langfuse's 404: gone already); one Langfuse fails to delete for now is tried again after a growing delay (no sooner
than its `Retry-After` asks, within an hour), one it refuses (another 4xx, a proxy's 404 too) is given up. A later
trajectory of the deleted one's id pushes its scores under other ids, once the deleted one's are deleted.
`LangfuseSync.sync` runs both, after its pull.
"""

from __future__ import annotations

import datetime as dt
import logging
import uuid
from collections.abc import Callable
from typing import Any, NamedTuple

from langfuse.api import CreateScoreBatchResults, CreateScoreRequest, CreateScoreSource, ScoreDataType
from langfuse.api.core.api_error import ApiError
from sqlalchemy import Connection

from collector import pool
from collector.langfuse_api import HINTS, PAGE, LangfuseCalls, LangfuseSyncError, retry_after, transient
from collector.scoring_config import LangfuseSettings
from collector.scoring_store import INGEST_DELAY, PushedScore, ScoringStore

__all__ = ["ScorePush"]

log = logging.getLogger(__name__)

_GONE = "Score not found within authorized project"
"""The message of Langfuse's 404 to the deletion of a score it does not have: a Langfuse before January 2025 looks the
score up (a later one queues the deletion of any id, 202). A 404 without it is none of Langfuse's (a proxy's)."""

_DELETE_HINTS = {
    **{status: hint for status, hint in HINTS.items() if status != 404},
    404: f"not Langfuse's answer for a score it does not have ({_GONE!r}): does a proxy in front of it pass "
    "DELETE /api/public/scores/{scoreId} on?",
}
"""`HINTS` for the deletion of a score; its 404 is Langfuse's only with `_GONE` (the score is gone), and the sync,
which pulls first, has found Langfuse's API on the host."""

RETRY_DELAY = (60.0, 3600.0)
"""The least and the most seconds before a deletion that failed for now (`transient`), or a score Langfuse rejected,
is tried again."""


def _gone(exc: LangfuseSyncError) -> bool:
    """Whether `exc`, the failed deletion of a score, is Langfuse's 404 for a score it does not have (`_GONE`)."""
    cause = exc.__cause__
    return (isinstance(cause, ApiError) and cause.status_code == 404 and isinstance(cause.body, dict)
            and cause.body.get("message") == _GONE)


def _retry_delay(age: float) -> float:
    """Seconds before a failed deletion of a score whose timestamp (`ScorePush.push`) is `age` seconds old is tried
    again: as long as its age, within `RETRY_DELAY`, so each failure of the same score (at least) doubles its age and
    the delay grows. A score whose timestamp is still ahead of the clock (which moved back since) has its age counted
    from its first failure instead (`ScorePush.retract`), so that the delay grows all the same."""
    least, most = RETRY_DELAY
    return min(most, max(least, age))


def _score_id(trajectory_id: str, created_at: float, name: str) -> str:
    """The id of the score pushed for the reward `name` of the trajectory `trajectory_id` that the store created at
    `created_at`: the same on every push and replica, and another for a later trajectory of the same id (a deleted
    one's), so that a deletion of the earlier one's score that Langfuse applies late cannot delete it. Scores pushed
    before this derivation keep their recorded ids (`ScoringStore.pushed_in`)."""
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"art-langgraph:{trajectory_id}:{name}:{created_at!r}"))


class _Rejection(NamedTuple):
    """A score Langfuse rejected (`ScorePush.push`), remembered by the process: its value, how many times in a row
    that value was rejected, and when it is sent again at the earliest (unless its value changes)."""

    value: float
    times: int
    retry_at: float


class _Scored(NamedTuple):
    """A stored trajectory as the push reads it (`_read`): its row's facts and its named rewards, not assembled."""

    id: str
    trace_id: str
    group_id: str
    created_at: float
    rewards: dict[str, float]


class _Snapshot(NamedTuple):
    """What a push reads, all of it in one snapshot of the database (`ScoringStore.read`)."""

    trajectories: list[_Scored]
    pushed: dict[tuple[str, str], PushedScore]
    """`ScoringStore.pushed_in`."""
    retracting: set[tuple[str, str]]
    """`ScoringStore.retracting_in`."""


def _read(conn: Connection) -> _Snapshot:
    """Every stored trajectory with its named rewards, as its assembled `Trajectory` has them (`pool.rewards_of`, from
    the reward rows and the traces its spans hold, without reading the spans' records), and the records of the scores
    pushed, on `conn`."""
    rows = ScoringStore.trajectory_rows(conn)
    named = pool.rewards_of(conn, rows)
    scored = [_Scored(row["id"], row["trace_id"], row["group_id"] or "", row["created_at"], named[row["id"]])
              for row in rows]
    return _Snapshot(scored, ScoringStore.pushed_in(conn), ScoringStore.retracting_in(conn))


class ScorePush:
    """Pushes the configured rewards of the stored trajectories to Langfuse as scores (`push`) and deletes there
    those of deleted trajectories (`retract`), through `api`; each reads the time from the `clock` it is given (the
    sync's, `LangfuseSync.clock`)."""

    def __init__(self, scoring: ScoringStore, settings: LangfuseSettings, api: LangfuseCalls) -> None:
        self.scoring, self.settings, self.api = scoring, settings, api
        self._rejections: dict[tuple[str, str], _Rejection] = {}
        """The scores Langfuse rejected, by (trajectory id, reward name): `push` holds them back a while."""

    def push(self, clock: Callable[[], float]) -> tuple[int, int]:
        """Send the configured rewards whose value changed since the last push; returns (sent, rejected). A score
        keeps the id and the timestamp it was first pushed with (recorded as `pushed_at`): the timestamp is its
        trajectory's creation, the same on a push sent again after its answer was lost (unrecorded), whatever the
        day; a score pushed before keeps the time of its first push. A trajectory's whose record is a deleted one's of
        the same id, still to delete (`ScoringStore.retracting_in`), waits for the sync after that deletion
        (`_score_id`).

        What changed is what differs from the records of the scores pushed (`ScoringStore.pushed_in`), read with the
        trajectories' rewards in one snapshot (`_read`): no trajectory is assembled, and only the judges' explanations
        of the scores sent are read. A trajectory deleted and created again of the same id since the snapshot is pushed
        with the deleted one's time, and `mark_pushed` marks its score to delete, as it does a deleted one's.

        Only the scores Langfuse accepts are recorded as pushed (`_create`). One it rejects (in a 207) is logged once
        per value and sent again when its value changes, or else after a delay that doubles with each rejection of
        the same value, within `RETRY_DELAY` (a minute to an hour); the process remembers the rejections, so a
        restart sends such a score again at once."""
        names = self.settings.push_names
        if not names:
            return 0, 0
        snapshot = self.scoring.read(_read)
        now = clock()
        due: list[tuple[_Scored, str, float, PushedScore | None]] = []
        for t in snapshot.trajectories:
            for name in names:
                value, record = t.rewards.get(name), snapshot.pushed.get((t.id, name))
                unchanged = record is not None and record.value == value
                if value is None or unchanged or (t.id, name) in snapshot.retracting:
                    continue
                if (held := self._rejections.get((t.id, name))) and held.value == value and now < held.retry_at:
                    continue
                due.append((t, name, value, record))
        explanations = self.scoring.judgements(sorted({t.id for t, _, _, _ in due}))
        requests, marks = [], []
        for t, name, value, record in due:
            at = record.pushed_at if record else t.created_at
            score_id = record.score_id if record else _score_id(t.id, t.created_at, name)
            comment = next((row["explanation"] for row in explanations[t.id] if row["name"] == name), None)
            requests.append(
                CreateScoreRequest(
                    id=score_id, trace_id=t.trace_id, name=name, value=value, data_type=ScoreDataType.NUMERIC,
                    source=CreateScoreSource.API, comment=comment,
                    metadata={"art.rollout.id": t.id, "art.group": t.group_id},
                    timestamp=dt.datetime.fromtimestamp(at, tz=dt.UTC),
                )
            )
            marks.append(
                {"trajectory_id": t.id, "name": name, "value": value, "score_id": score_id, "pushed_at": at,
                 "created_at": t.created_at}
            )
        live = {t.id for t in snapshot.trajectories}
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
        answer = self.api.call("POST /api/public/scores", lambda options: self.api.client.scores.create(
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

    def retract(self, clock: Callable[[], float]) -> tuple[int, int, int]:
        """Delete in Langfuse the pushed scores marked for it (their trajectories were deleted,
        `ScoringStore.retract_pushed`) whose try is due, `PAGE` records read at a time, then each one's record;
        returns (deleted, refused, failed).

        Langfuse's 404 (`_gone`) says the score is gone already: done. Any other 4xx but 408 and 429 (a server that
        refuses deletions, a key not allowed to delete, a proxy's 404) is final: logged, the record dropped, the score
        left in Langfuse. A transient failure (5xx, 408, 429, no answer) is logged and tried again after a growing
        delay (`_retry_delay`), or after Langfuse's `Retry-After` where that is longer (at most `RETRY_DELAY`'s
        most: Langfuse Cloud limits deletions per day), and stops this sync's deletions: the others wait for the next
        sync, not for Langfuse's timeout one by one."""
        now = clock()
        deleted = refused = 0
        while rows := self.scoring.to_retract(now, limit=PAGE):
            for row in rows:
                failure = self._delete_score(row["score_id"])
                if failure is not None and transient(failure):
                    since = min(row["pushed_at"], now)  # a timestamp ahead of the clock (it moved back): now
                    delay = min(RETRY_DELAY[1], max(_retry_delay(now - since), retry_after(failure, now) or 0.0))
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
        failure for now is tried again at a later sync (`retract`)."""
        try:
            self.api.call(f"DELETE /api/public/scores/{score_id}",
                          lambda options: self.api.client.scores.delete(score_id, request_options=options),
                          _DELETE_HINTS, retries=0)
        except LangfuseSyncError as exc:
            return None if _gone(exc) else exc
        return None
