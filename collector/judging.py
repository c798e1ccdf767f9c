"""Run the RULER judge on groups: on request, or automatically once a group is complete.

A run reads the group's trajectories from the store, sends the distinct ones to the judge,
and writes the scores as rewards (`JudgeSettings.reward_name`, default `ruler`) through
`Store.add_rewards`, with the explanations and the run's outcome in `ScoringStore`, all in one
transaction (see `GroupJudge._record`). A failed run follows the configured policy (`retry`,
`skip`, `zero`) and its state and error show on the group.

A run claims its group in the `judge_runs` table before it calls the judge, so two collector
replicas on one database (or two requests to one collector) never judge a group at once, and an
automatic run leaves a group that another run took up since it was found due. A run whose claim
another run took over as stale (`claim_seconds`) stores nothing: its transaction checks the claim. Nor does a run
whose group changed while the judge answered (`judge_stale`): the same transaction compares each member's stamp,
read before the judge was shown the group, with the one committed, holding the locks an export changing it takes
(`ScoringStore.member_stamps_held`).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import time
from collections.abc import Callable
from typing import Any, NoReturn

from sqlalchemy import Connection

from collector.errors import Conflict, NotFound
from collector.judge_client import JudgeClient
from collector.protocol import GroupState, RewardIn, Trajectory
from collector.read_protocol import Judgement, JudgeRun
from collector.ruler import (
    JudgeError,
    Score,
    build_messages,
    dedupe,
    explanation_limit,
    parse_cut,
    parse_scores,
    response_format,
    scores_only_tokens,
)
from collector.scoring_config import JudgeSettings
from collector.scoring_store import MemberStamp, ScoringStore, SeenRun
from collector.store_base import Store

__all__ = ["GroupJudge", "claim_seconds", "run_view"]

log = logging.getLogger(__name__)

_IN_POOL: frozenset[GroupState] = frozenset({"open", "ready", "skipped"})
"""Group states a new reward can still matter in (a skipped group reopens on one)."""


def run_view(row: dict, judgements: list[Judgement] | None = None) -> JudgeRun:
    """A `judge_runs` row as a `JudgeRun`."""
    return JudgeRun(
        group_id=row["group_id"], state=row["state"], attempts=row["attempts"], error=row["error"], model=row["model"],
        trajectories=row["trajectories"], distinct=row["distinct_count"], started_at=row["started_at"],
        finished_at=row["finished_at"], next_try_at=row["next_try_at"], max_tokens=row["max_tokens"],
        judgements=judgements or [],
    )


_MAX_BACKOFF = 10.0
"""Longest wait between two tries of one run, in seconds: of the doubling back-off, and of a judge's `Retry-After`
(`_wait`; a run asked to wait longer ends at once). `claim_seconds` allows it after every try: no wait makes a run
outlive its claim."""


_MOST_ASKED = 86_400.0
"""Longest a judge's `Retry-After` puts off a failed run's next try (`next_try_at`), in seconds: a day."""


def _tries(settings: JudgeSettings) -> int:
    """Judge calls one run makes at most."""
    return settings.attempts if settings.on_failure == "retry" else 1


class _ClaimLost(Exception):
    """Raised when a run no longer holds its group (another run took it over as stale), in the transaction of its
    scores too: nothing of the run is stored."""


class _Changed(Exception):
    """Raised in the transaction of a run's scores when the group is no longer what the judge was shown: nothing is
    stored."""


def _wait(error: JudgeError, attempt: int) -> float:
    """Seconds to wait after try `attempt` (from 1) failed with `error`: the back-off (1 s, doubling up to
    `_MAX_BACKOFF`), or the judge's `Retry-After` (`JudgeError.retry_after`) where that is longer, however long."""
    return max(min(2.0 ** (attempt - 1), _MAX_BACKOFF), error.retry_after or 0.0)


def _asked_too_long(error: JudgeError, wait: float) -> JudgeError:
    """`error`, whose judge asked to wait `wait` seconds, past `_MAX_BACKOFF`, saying that the run ends on it."""
    return JudgeError(
        f"{error}; not tried again in this run: the judge asked to wait {wait:g} s, more than the {_MAX_BACKOFF:g} s a "
        "run waits between two tries; the group is due again after ART_COLLECTOR_JUDGE_RETRY_SECONDS or the wait "
        f"asked, whichever is longer (at most {_MOST_ASKED:g} s)",
        code=error.code, retry_after=error.retry_after,
    )


def claim_seconds(settings: JudgeSettings) -> float:
    """How long a `running` run holds its group before another judge may take it over as stale: every try
    timing out after the longest wait (`_MAX_BACKOFF`), plus a minute for reading and writing the store."""
    return _tries(settings) * (settings.timeout_seconds + _MAX_BACKOFF) + 60.0


def _final(error: JudgeError, explanation_chars: int) -> bool:
    """Whether the same request would fail again with `error`: the judge rejected it (`judge_rejected`), or cut an
    answer that had room for no explanation (`explanation_chars` 0: the scores alone do not fit in `max_tokens`)."""
    return error.code == "judge_rejected" or (error.code == "judge_truncated" and explanation_chars == 0)


def _explained(error: JudgeError, count: int, explanation_chars: int) -> JudgeError:
    """`error`, saying how many tokens the scores of `count` blocks take when they alone were cut (see `_final`)."""
    if error.code != "judge_truncated" or explanation_chars:
        return error
    return JudgeError(
        f"{error}; the scores alone of {count} trajectories take up to {scores_only_tokens(count)} tokens (one per "
        "character), no room is left for explanations", code=error.code,
    )


class GroupJudge:
    """Judges groups with one `JudgeClient`; one run per group at a time, across every collector on the database.

    A run first claims its group in `judge_runs` (`ScoringStore.claim_run`); a judge that loses the claim calls
    no model.
    """

    def __init__(
        self,
        store: Store,
        scoring: ScoringStore,
        settings: JudgeSettings,
        *,
        client: JudgeClient | None = None,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.store, self.scoring, self.settings = store, scoring, settings
        key = settings.api_key.get_secret_value() if settings.api_key else None
        self.client = client or JudgeClient(
            settings.url, settings.model, api_key=key, timeout=settings.timeout_seconds,
            max_answer_bytes=settings.max_answer_bytes,
        )
        self.clock, self.sleep = clock, sleep  # `sleep` waits between two tries of a run

    # --- one run ------------------------------------------------------------------------
    def judge(self, group_id: str, *, rubric: str | None = None) -> JudgeRun:
        """Judge one group now and store the scores; failures follow the configured policy, but for a `rubric` of the
        request's own that the judge rejects (see `_rubric_rejected`).

        Raises:
            NotFound: the group does not exist or has no trajectories, or was deleted while it was judged
                (`group_deleted`).
            Conflict: `judge_running`, another run of the group has not finished (here or on another replica), or
                took the group over from this run, which outlived its claim (`claim_seconds`) and stored nothing.
        """
        try:
            run = self._try(group_id, rubric or self.settings.rubric)
        except _ClaimLost:
            raise Conflict(
                f"group {group_id!r} was taken over by another run: this run outlived its claim "
                f"({claim_seconds(self.settings):.0f} s) and stored nothing; GET /v1/groups/{group_id}/judge shows the "
                "other run's outcome",
                code="judge_running",
            ) from None
        if run is None:  # said as the claim saw it: the other run may have ended since, and its row says so
            raise Conflict(
                f"group {group_id!r} is being judged: its run is running (another run, here or on another replica, "
                f"held the group when this one claimed it; {self._holder(group_id)}); GET /v1/groups/{group_id}/judge "
                "shows its outcome",
                code="judge_running",
            )
        return run

    def _holder(self, group_id: str) -> str:
        """The group's run as read now, after a refused claim: when the running one started, or that none runs now."""
        row = self.scoring.run(group_id)
        if row is None or row["state"] != "running":
            return "it is no longer running"
        started = dt.datetime.fromtimestamp(row["started_at"], tz=dt.UTC).isoformat(timespec="seconds")
        return f"the group's running run started at {started}, {max(0.0, self.clock() - row['started_at']):.0f} s ago"

    def _try(self, group_id: str, rubric: str, seen: SeenRun | None = None) -> JudgeRun | None:
        """Judge the group if its claim is won: this run's outcome; None, with no judge call, when another run holds it
        or, with `seen` (the group's last run when it was found due), started since.

        Raises:
            NotFound: the group does not exist or has no trajectories, or was deleted while it was judged.
            _ClaimLost: the run outlived its claim and another run took the group over; nothing of it is stored.
        """
        stamps = self.scoring.member_stamps(group_id)  # first: a change after it, whenever, is seen (`_record`)
        members = self._members(group_id)
        if not members:
            raise NotFound(f"no group {group_id!r} with trajectories; see GET /v1/groups")
        distinct, owner = dedupe([t.messages for t in members])
        started = self.clock()
        claim = {
            "group_id": group_id, "model": self.settings.model, "trajectories": len(members),
            "distinct_count": len(distinct), "started_at": started, "state": "running", "attempts": 0, "error": None,
            "finished_at": None, "next_try_at": None, "max_tokens": self.settings.max_tokens,
        }
        if not self.scoring.claim_run(claim, stale_before=started - claim_seconds(self.settings), seen=seen):
            log.info("group %s is being judged, or was since it was found due, by another run; left to it", group_id)
            return None
        try:
            return self._judge(group_id, members, stamps, distinct, owner, rubric, claim)
        except (NotFound, _ClaimLost):  # the group was deleted, or taken over, mid-run: nothing to free
            raise
        except Exception as exc:  # e.g. the store failed mid-run: free the group now, not after claim_seconds
            now = self.clock()
            with contextlib.suppress(_ClaimLost):  # taken over meanwhile: logged, nothing to free
                self._finish(group_id, claim, state="failed", attempts=0, error=f"{type(exc).__name__}: {exc}",
                             finished_at=now, next_try_at=now + self.settings.retry_seconds)
            raise

    def _judge(
        self, group_id: str, members: list[Trajectory], stamps: dict[str, MemberStamp],
        distinct: list[list[dict[str, Any]]], owner: list[int], rubric: str, claim: dict[str, Any]
    ) -> JudgeRun:
        """The run `claim` (its `judge_runs` row as claimed) of the group's `members` (their `stamps` read before
        them): call the judge, store the scores and the outcome."""
        s = self.settings
        tries = _tries(s)
        messages = build_messages(rubric, distinct)
        limit = explanation_limit(len(distinct), s.max_tokens, s.explanation_max_chars)
        fmt = response_format(len(distinct), limit)
        error: JudgeError | None = None
        for attempt in range(1, tries + 1):
            try:
                scores = self._scores(messages, fmt, len(distinct), limit)
            except JudgeError as exc:
                error = _explained(exc, len(distinct), limit)
                log.warning("judge of group %s failed (try %d/%d): %s", group_id, attempt, tries, error)
                if _final(error, limit):  # the same request never succeeds
                    break
                if attempt < tries:
                    if (wait := _wait(error, attempt)) > _MAX_BACKOFF:  # past the claim's allowance: a later run asks
                        error = _asked_too_long(error, wait)
                        break
                    self.sleep(wait)
                continue
            rows = self._scored(members, owner, scores)
            return self._record(group_id, claim, rows, shown=stamps, state="ok", attempts=attempt, error=None,
                                next_try_at=None)
        assert error is not None
        if error.code == "judge_rejected" and rubric.strip() != s.rubric.strip():
            return self._rubric_rejected(group_id, claim, attempt, error)
        return self._failed(group_id, claim, members, attempt, error, final=_final(error, limit))

    def _scores(self, messages: list[dict[str, Any]], fmt: dict[str, Any], count: int, limit: int) -> list[Score]:
        """One judge call's scores of `count` blocks, explanations cut to `limit`; an answer cut at `max_tokens` that
        holds every score whole is taken (`parse_cut`): a judge held to the schema may be cut just before its end token.

        Raises:
            JudgeError: the call failed, or its answer is unusable (`parse_scores`, or `judge_truncated` when cut).
        """
        s = self.settings
        try:
            text = self.client.complete(messages, fmt, temperature=s.temperature, max_tokens=s.max_tokens)
        except JudgeError as exc:
            if exc.code != "judge_truncated":
                raise
            return parse_cut(exc, count, limit)
        return parse_scores(text, count, limit)

    def _failed(self, group_id: str, claim: dict[str, Any], members: list[Trajectory], attempts: int,
                error: JudgeError, *, final: bool) -> JudgeRun:
        """Record the run `claim`, whose judge failed with `error`, by the configured policy, due again after
        `retry_seconds` or the judge's `Retry-After` (up to `_MOST_ASKED`), whichever is longer; a `final`
        error (see `_final`) is not retried until the group grows, or for a cut answer `max_tokens` is raised (see
        `due_groups`)."""
        s = self.settings
        message = f"{error.code}: {error}"
        now = self.clock()
        if s.on_failure == "zero":
            rows = self._zeros(members, message)
            return self._record(group_id, claim, rows, state="zeroed", attempts=attempts, error=message,
                                next_try_at=None)
        wait = max(s.retry_seconds, min(error.retry_after or 0.0, _MOST_ASKED))  # a judge's `Retry-After` counts too
        state, next_try = ("failed", now + wait) if s.on_failure == "retry" else ("skipped", None)
        if state == "failed" and final:
            raised = " or the judge's max_tokens is raised" if error.code == "judge_truncated" else ""
            message, next_try = f"{message}; not retried until the group grows{raised}", None
        return self._finish(group_id, claim, state=state, attempts=attempts, error=message, finished_at=now,
                            next_try_at=next_try)

    def _rubric_rejected(self, group_id: str, claim: dict[str, Any], attempts: int, error: JudgeError) -> JudgeRun:
        """Record the run `claim`, asked for with a rubric of its own that the judge rejected, as `failed`
        and due again now, whatever `on_failure` says: the rejection may be the rubric's (too long, say), so it
        must not keep the automatic judge, with the configured rubric, from the group."""
        now = self.clock()
        return self._finish(group_id, claim, state="failed", attempts=attempts, finished_at=now, next_try_at=now,
                            error=f"{error.code}: {error}; it judged with the request's rubric: the group is due again "
                                  "for the automatic judge, with the configured rubric")

    def _members(self, group_id: str) -> list[Trajectory]:
        """The group's trajectories as the store holds them now."""
        return [t for t in self.store.trajectories(group=group_id) if t.group_id == group_id]

    def _stale(self, group_id: str, claim: dict[str, Any], attempts: int) -> JudgeRun:
        """Record the run `claim` as `failed`, its answer unstored, due again now: its group changed
        while the judge answered (a member came, left or got more messages), so the scores judged what is gone."""
        now = self.clock()
        log.warning("group %s changed while the judge answered; its scores are not stored", group_id)
        return self._finish(group_id, claim, state="failed", attempts=attempts, finished_at=now, next_try_at=now,
                            error="judge_stale: the group's trajectories changed while the judge answered; its scores "
                                  "are not stored and the group is judged again")

    def _finish(self, group_id: str, claim: dict[str, Any], **outcome: object) -> JudgeRun:
        """Record the outcome of the run `claim`, which stores no scores; the run as recorded (see `_outlived` for a
        run that outlived its claim)."""
        if not self.scoring.finish_run(group_id, claim["started_at"], **outcome):
            self._outlived(group_id, claim["started_at"], str(outcome["state"]))
        return run_view({**claim, **outcome})

    def _outlived(self, group_id: str, started: float, outcome: str) -> NoReturn:
        """Log that the run started at `started` lost its group to another run and leaves `outcome` unrecorded.

        Raises:
            NotFound: the group's run is gone: the group was deleted while it was judged (a trajectory of another
                instrumentation's calls whose rollout came, see README), its run with it.
            _ClaimLost: otherwise; the group's run is the other run's.
        """
        if self.scoring.run(group_id) is None:
            raise NotFound(f"group {group_id!r} was deleted while it was judged; nothing is stored",
                           code="group_deleted")
        log.warning(
            "judge run of group %s started at %s outlived its claim (%.0f s) and another run took the group over; "
            "its outcome (%s) and scores are not recorded",
            group_id, started, claim_seconds(self.settings), outcome,
        )
        raise _ClaimLost

    def _scored(self, members: list[Trajectory], owner: list[int], scores: list[Score]) -> list[Judgement]:
        """The judgement of each member: the score of its distinct block (`owner`)."""
        first: dict[int, str] = {}
        rows = []
        for trajectory, index in zip(members, owner, strict=True):
            score = scores[index]
            duplicate_of = first.setdefault(index, trajectory.id)
            rows.append(
                Judgement(
                    trajectory_id=trajectory.id, name=self.settings.reward_name, score=score.score,
                    explanation=score.explanation, block=score.block,
                    duplicate_of=None if duplicate_of == trajectory.id else duplicate_of,
                )
            )
        return rows

    def _zeros(self, members: list[Trajectory], message: str) -> list[Judgement]:
        """A judgement of 0 for each member, by the `zero` policy after the judge failed with `message`."""
        return [
            Judgement(
                trajectory_id=t.id, name=self.settings.reward_name, score=0.0,
                explanation=f"judge failed, scored 0 by policy: {message}",
            )
            for t in members
        ]

    def _record(self, group_id: str, claim: dict[str, Any], rows: list[Judgement], *, attempts: int,
                shown: dict[str, MemberStamp] | None = None, **outcome: object) -> JudgeRun:
        """Store the scores `rows` of the run `claim` with their explanations and `outcome`; the run as recorded, with
        `rows` (not the group's run as read afterwards: another run may have claimed the group since). With `shown`,
        the stamps of the members the judge scored (read before the members were), the run is `judge_stale` instead
        (see `_stale`) when the group's, read again first in the same transaction, differ
        (`ScoringStore.member_stamps_held`: a change committed before the scores is always seen; one committed between
        the two reads of the run start makes an extra `judge_stale`, never a missed one).

        All of it is one transaction, the rewards' (`Store.add_rewards`, the rest in its `also`), committed whole or
        not at all. In it the run's outcome is written only while the run still holds its group
        (`ScoringStore.finish_run_in`, which makes a concurrent `claim_run` wait for the commit): a run another run
        took over as stale, at any moment before, stores nothing over the other run's scores (`_outlived`). A store
        error leaves the group's rewards and explanations as they were and the run `failed` (`_try`), due again.
        """
        now, started = self.clock(), claim["started_at"]
        explained = [{**row.model_dump(exclude={"name"}), "created_at": now} for row in rows]
        judgements = (self.settings.reward_name, explained)

        def finish(conn: Connection) -> None:
            if not self.scoring.finish_run_in(conn, group_id, started, judgements=judgements, finished_at=now,
                                              attempts=attempts, **outcome):
                raise _ClaimLost

        def unchanged(conn: Connection) -> None:
            if shown is not None and self.scoring.member_stamps_held(conn, group_id, shown) != shown:
                raise _Changed

        rewards = [RewardIn(rollout_id=row.trajectory_id, name=row.name, value=row.score) for row in rows]
        try:
            self.store.add_rewards(rewards, before=unchanged, also=finish)
        except _ClaimLost:
            self._outlived(group_id, started, str(outcome["state"]))
        except _Changed:
            return self._stale(group_id, claim, attempts)
        run = run_view({**claim, **outcome, "attempts": attempts, "finished_at": now}, rows)
        log.info("judged group %s (%s): %d trajectories, %d distinct", group_id, run.state, run.trajectories,
                 run.distinct)
        return run

    # --- automatic runs -----------------------------------------------------------------
    def due_groups(self) -> list[str]:
        """Groups in the pool (open, ready or skipped) whose trajectories are all complete and that
        reached their expected size, not judged yet, grown since their last finished run (a group
        without an announced size takes members as they come), `failed` and due for another try (one the judge
        rejected, `judge_rejected`, or whose scores alone were cut at `max_tokens`, has no `next_try_at`: it is due
        once the group grows), finished with an answer cut at a `max_tokens` below the one set now (whatever the
        policy: see `_cut_before_raise`), or `running` past `claim_seconds` (its judge died mid-run)."""
        return list(self._due())

    def _due(self) -> dict[str, SeenRun]:
        """The groups of `due_groups`, each with its last run as seen here (for `ScoringStore.claim_run`)."""
        complete = {
            g.id: g.size for g in self.store.groups(states=_IN_POOL)
            if g.size == g.complete and g.size >= g.expected
        }
        runs = self.scoring.runs(complete)
        now = self.clock()

        def due(group_id: str) -> bool:
            run = runs.get(group_id)
            if run is None:
                return True
            if run["state"] == "failed" and run["next_try_at"] is not None:
                return run["next_try_at"] <= now
            if run["state"] == "running":
                return run["started_at"] < now - claim_seconds(self.settings)
            return run["trajectories"] < complete[group_id] or self._cut_before_raise(run)

        return {
            group_id: SeenRun(runs[group_id]["started_at"] if group_id in runs else None)
            for group_id in complete if due(group_id)
        }

    def _cut_before_raise(self, run: dict[str, Any]) -> bool:
        """Whether the finished `run` was cut at a `max_tokens` (`judge_truncated`) below the one set now: raised
        since, the group may fit. A run from before schema version 10 has no `max_tokens` recorded: unknown, no."""
        cut = (run["error"] or "").startswith("judge_truncated")
        return cut and run["max_tokens"] is not None and run["max_tokens"] < self.settings.max_tokens

    def run_due(self) -> list[JudgeRun]:
        """Judge every due group (see `due_groups`), one after the other; a group another run claimed first, or
        took up since it was found due (another replica, a request), is left to it, and so is one that outlived its
        claim (logged; it stores nothing). A run that fails unexpectedly
        (not a `JudgeError`: a store error, a bug) is logged with its traceback, shows `failed` on its group (see
        `_try`) and is left out of the result; the others still run."""
        runs = []
        for group_id, seen in self._due().items():
            try:
                run = self._try(group_id, self.settings.rubric, seen)
            except NotFound as exc:  # emptied or deleted since it was found due: nothing left to judge
                log.info("group %s left unjudged: %s", group_id, exc)
                continue
            except _ClaimLost:  # taken over by another run, logged (`_outlived`): left to it
                continue
            except Exception:  # one group's failure must not starve the groups due after it, poll after poll
                log.exception("judge run of group %s failed unexpectedly; judging the other due groups", group_id)
                continue
            if run is not None:
                runs.append(run)
        return runs

    def close(self) -> None:
        """Release the judge client."""
        self.client.close()

