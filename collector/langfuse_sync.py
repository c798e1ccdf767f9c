"""Langfuse sync: human scores in as rewards, computed rewards out as scores.

Uses the `langfuse` SDK's REST client (`LangfuseAPI`): scores are read with
`GET /api/public/v3/scores` (cursor paging, filtered by source, name and data type, with the
`subject` field group that carries the trace id) and written with `POST /api/public/scores` (a
list). A score becomes a reward of the same name on the trajectory of its trace (Langfuse's
trace id is the OpenTelemetry trace id when the agent's spans fan out to Langfuse). Only numeric
and boolean scores can be rewards, and only they are read (a score of a type this SDK does not
know would fail the whole page); scores already pulled at the same `updatedAt` are not applied
again (a reward and the record of its score's pull are stored in one transaction, which claims the score: a replica
on the same database that pulled that version or a later one first keeps its reward from being stored). Langfuse
lists no deletions: a score pulled within the lookback that the listing leaves out is asked for
by id (the `id` filter of the same endpoint), and one that is gone has its rewards taken back
(with its record, in one transaction) unless its group is leased or trained. Pushed scores get a stable id per
(trajectory, reward name), so a changed reward updates the same score in Langfuse; the scores pushed for a
trajectory the store deleted since (another instrumentation's calls in a rollout's trace) are deleted there
(`DELETE /api/public/scores/{scoreId}`) by the next sync; one Langfuse fails to delete is tried again by the sync
after it.
"""

from __future__ import annotations

import datetime as dt
import functools
import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import httpx
from langfuse.api import CreateScoreBatchResults, CreateScoreRequest, CreateScoreSource, LangfuseAPI, ScoreDataType
from langfuse.api.core.api_error import ApiError
from pydantic import ValidationError
from sqlalchemy import Connection

from collector.errors import CollectorError
from collector.protocol import RewardAccepted, RewardIn
from collector.read_protocol import LangfuseSyncResult
from collector.schema import score_version
from collector.scoring_config import LangfuseSettings
from collector.scoring_store import ScoringStore
from collector.store_base import Store

__all__ = ["LangfuseSync", "LangfuseSyncError", "make_client"]

log = logging.getLogger(__name__)

PAGE = 100
"""Scores per page (Langfuse's maximum)."""

REWARD_TYPES = "NUMERIC,BOOLEAN"
"""The score data types that can be rewards (the listing's `dataType` filter)."""

_KEYS = "check ART_COLLECTOR_LANGFUSE_PUBLIC_KEY and ART_COLLECTOR_LANGFUSE_SECRET_KEY (or LANGFUSE_*):"
_HINTS = {
    401: f"{_KEYS} a key pair of a project on this host",
    403: f"{_KEYS} a key pair of a project on this host, allowed to read and write scores",
    404: "is the host Langfuse's base URL? A self-hosted Langfuse serves GET /api/public/v3/scores only when started "
    "with LANGFUSE_ENABLE_SCORES_V3_API=true (Langfuse Cloud always does)",
}
"""What to check when Langfuse answers a status that a configuration mistake gives."""

_DELETE_HINTS = {
    **_HINTS,
    404: "is the host Langfuse's base URL? Langfuse answers 202 to the deletion of any score id, one it does not have "
    "too: a 404 says this server has no DELETE /api/public/scores/{scoreId}",
}
"""`_HINTS` for the deletion of a score."""


class LangfuseSyncError(CollectorError):
    """Langfuse could not be reached or refused a request (502)."""

    status = 502
    code = "langfuse_error"


def make_client(settings: LangfuseSettings) -> LangfuseAPI:
    """The SDK's REST client for the configured project (Basic auth with the key pair)."""
    if not settings.enabled:
        raise LangfuseSyncError(
            "Langfuse is not configured: set ART_COLLECTOR_LANGFUSE_HOST and its keys", code="langfuse_not_configured"
        )
    from langfuse import __version__

    return LangfuseAPI(
        base_url=str(settings.host).rstrip("/"),
        username=settings.public_key,
        password=settings.secret_key.get_secret_value() if settings.secret_key else None,
        x_langfuse_sdk_name="python",
        x_langfuse_sdk_version=__version__,
        x_langfuse_public_key=settings.public_key,
        timeout=settings.timeout_seconds,
    )


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


def _reward_of(score: object) -> RewardIn | None:
    """The reward a score gives its trace, or None: session and experiment scores, and scores on a trace id that is
    no OpenTelemetry one (logged), give none."""
    trace_id, value = _trace_of(score), _numeric(score)
    if trace_id is None or value is None:
        return None
    try:
        return RewardIn(trace_id=trace_id, name=getattr(score, "name"), value=value)
    except ValidationError as exc:  # a trace id that is no OpenTelemetry one, an over-long name
        log.warning("Langfuse score %s cannot be a reward: %s; ignored", getattr(score, "id"), exc.errors()[0]["msg"])
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
        self.client = client or make_client(settings)
        self.clock = clock
        self._lock = threading.Lock()

    def _call(self, what: str, fn: Callable[[], object], hints: dict[int, str] = _HINTS) -> object:
        """`fn()`, a call of Langfuse's API; any way Langfuse fails, a malformed answer too, raises
        `LangfuseSyncError` (502), with the hint of `hints` for its status, if any."""
        try:
            return fn()
        except ApiError as exc:
            hint = f"; {hints[exc.status_code]}" if exc.status_code in hints else ""
            raise LangfuseSyncError(f"Langfuse {what} answered {exc.status_code}: {exc.body!r}{hint}") from exc
        except ValidationError as exc:  # a 2xx body the SDK cannot read: a proxy's page, a score its model rejects
            raise LangfuseSyncError(f"Langfuse {what} answered something its API does not define: {exc}") from exc
        except httpx.HTTPError as exc:
            raise LangfuseSyncError(
                f"Langfuse {what} unreachable at {self.settings.host}: {exc}", code="langfuse_unreachable"
            ) from exc

    def pull(self) -> LangfuseSyncResult:
        """Read scores (configured sources and names, within the lookback) and store new or changed ones as rewards."""
        s = self.settings
        start = self.clock() - s.lookback_hours * 3600
        since = dt.datetime.fromtimestamp(start, tz=dt.UTC)
        found, cursor = [], None
        while True:
            page = self._call(
                "GET /api/public/v3/scores",
                lambda: self.client.scores.get_many(
                    limit=PAGE, cursor=cursor, fields="subject", source=",".join(s.sources) or None,
                    name=",".join(s.score_names) or None, data_type=REWARD_TYPES, from_timestamp=since,
                ),
            )
            found += page.data
            cursor = page.meta.cursor
            if not cursor:
                break
        found.sort(key=lambda score: (score.timestamp, score.updated_at))  # the latest score of a name wins
        seen = self.scoring.pulled_versions([score.id for score in found])
        latest: dict[tuple[str | None, str], tuple[str, RewardIn]] = {}
        marks: dict[str, dict[str, Any]] = {}  # the new or changed scores, by id
        ignored = 0
        for score in found:
            reward = _reward_of(score)
            if reward is None:
                ignored += 1
                continue
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
        withdrawn = self._withdraw(start, {score.id for score in found}, latest)
        return LangfuseSyncResult(pulled=len(found), applied=applied, unmatched=unmatched, ignored=ignored,
                                  withdrawn=withdrawn, pushed=0)

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
            chunk = ",".join(ids[first : first + PAGE])
            page = self._call("GET /api/public/v3/scores",
                              lambda chunk=chunk: self.client.scores.get_many(limit=PAGE, id=chunk))
            for score in page.data:
                missing.pop(score.id, None)
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

    def _retract(self) -> tuple[int, int]:
        """Delete in Langfuse the pushed scores marked for it (their trajectories were deleted,
        `ScoringStore.retract_pushed`), then each one's record, one at a time; returns (deleted, failed). A deletion
        that fails is logged and its record kept, so the next sync tries it again; the others go on. Langfuse answers
        the deletion of a score it no longer has (a person deleted it) as any other."""
        deleted = failed = 0
        for row in self.scoring.to_retract():
            score_id = row["score_id"]
            try:
                self._call(f"DELETE /api/public/scores/{score_id}",
                           lambda score_id=score_id: self.client.scores.delete(score_id), _DELETE_HINTS)
            except LangfuseSyncError as exc:
                log.warning("Langfuse score %s of deleted trajectory %s not deleted (tried again next sync): %s",
                            score_id, row["trajectory_id"], exc)
                failed += 1
                continue
            self.scoring.forget_pushed(row)
            deleted += 1
        return deleted, failed

    def push(self) -> tuple[int, int]:
        """Send the configured rewards whose value changed since the last push; returns (sent, rejected)."""
        names = self.settings.push_names
        if not names:
            return 0, 0
        before = self.scoring.pushed()
        trajectories = self.store.trajectories()
        explanations = self.scoring.judgements([t.id for t in trajectories])
        now = self.clock()
        requests, marks = [], []
        for t in trajectories:
            notes = {row["name"]: row["explanation"] for row in explanations[t.id]}
            for name in names:
                value = t.rewards.get(name)
                if value is None or (t.id, name) in before and before[(t.id, name)][0] == value:
                    continue
                first = before[(t.id, name)][1] if (t.id, name) in before else now
                score_id = str(uuid.uuid5(uuid.NAMESPACE_URL, f"art-langgraph:{t.id}:{name}"))
                requests.append(
                    CreateScoreRequest(
                        id=score_id, trace_id=t.trace_id, name=name, value=value, data_type=ScoreDataType.NUMERIC,
                        source=CreateScoreSource.API, comment=notes.get(name),
                        metadata={"art.rollout.id": t.id, "art.group": t.group_id},
                        timestamp=dt.datetime.fromtimestamp(first, tz=dt.UTC),
                    )
                )
                marks.append(
                    {"trajectory_id": t.id, "name": name, "value": value, "score_id": score_id, "pushed_at": first}
                )
        rejected = 0
        for start in range(0, len(requests), PAGE):
            chunk = requests[start : start + PAGE]
            answer = self._call("POST /api/public/scores", lambda chunk=chunk: self.client.scores.create(request=chunk))
            if isinstance(answer, CreateScoreBatchResults) and answer.rejected:
                rejected += answer.rejected
                log.warning("Langfuse rejected %d of %d scores: %s", answer.rejected, len(chunk),
                            [e.message for e in answer.errors])
            self.scoring.mark_pushed(marks[start : start + PAGE], now)
        return len(requests), rejected

    def sync(self) -> LangfuseSyncResult:
        """Pull, push, then delete the scores pushed for trajectories deleted since (`_retract`); one sync at a time
        (the schedule and `POST /v1/langfuse/sync` may overlap).

        The deletions come after the push: a later trajectory of a deleted one's id has the same score ids, and its
        push (as new, `ScoringStore.pushed`) takes such a score over and clears its mark, so it is not deleted. Deleted
        first, then sent again, it might be lost: Langfuse queues both, and may apply the deletion last."""
        with self._lock:
            result = self.pull()
            result.pushed, result.push_rejected = self.push()
            result.retracted, result.retract_failed = self._retract()
        log.info("Langfuse sync: %s", result.model_dump())
        return result
