"""Tables of the judges, next to the store's: judge runs, judge explanations, Langfuse sync state.

They live in the store's database (same engine); `collector.schema` defines them, and the
store's versioned migrations create them (version 3). The rewards themselves go through
`Store.add_rewards`; these tables keep what a reward row cannot: the explanation, the judge
run's outcome, and which Langfuse scores were already pulled or pushed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, NamedTuple, TypeVar

from sqlalchemy import Connection, Engine, Table, delete, exists, func, or_, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import IntegrityError

from collector.engine import chunks
from collector.schema import groups, judge_runs, judgements, langfuse_pulled, langfuse_pushed, spans, trajectories
from collector.transactions import GROUP_LOCKS, TRAJECTORY_LOCKS, Transactions

__all__ = ["INGEST_DELAY", "MemberStamp", "PushedScore", "ScoringStore", "SeenRun"]

T = TypeVar("T")

INGEST_DELAY = 300.0
"""Seconds after its last push (a changed reward pushes it again) before a score pushed to Langfuse for a trajectory
deleted since is deleted there: Langfuse ingests a push asynchronously (its worker, within a minute normally) and may
apply a deletion that comes first to nothing, leaving the pushed score in place for good
(`ScoringStore.retract_pushed`, `ScoringStore.mark_pushed`)."""


def _insert(conn: Connection, table: Table) -> postgresql.Insert | sqlite.Insert:
    """An insert into `table` in `conn`'s dialect, which can upsert (`on_conflict_do_update`)."""
    return (postgresql if conn.dialect.name == "postgresql" else sqlite).insert(table)


class PushedScore(NamedTuple):
    """The record of a reward pushed to Langfuse as a score (`ScoringStore.pushed_in`)."""

    value: float
    """The value last pushed."""
    pushed_at: float
    """The score's timestamp: its trajectory's creation (its first push's time for a score pushed before that rule)."""
    score_id: str
    """The score's id in Langfuse."""


class MemberStamp(NamedTuple):
    """What changes whenever a group member's messages, which its spans make, may have changed
    (`ScoringStore.member_stamps`): the judge compares them instead of the messages."""

    trace_id: str
    """Its trace (an export of the trace locks it)."""
    spans: int
    """Its stored spans: only ever added while it exists (deleted with it, `foreign_deletion._forget_trajectories`)."""
    updated_at: float
    """When its row last changed (an export of its spans, a member of its group deleted, a reward withdrawn): a
    member deleted and stored again with as many spans has a later one."""


def _stamps(conn: Connection, group_id: str) -> dict[str, MemberStamp]:
    """The stamp of each trajectory in the group, by id."""
    rows = conn.execute(
        select(trajectories.c.id, trajectories.c.trace_id, trajectories.c.updated_at)
        .where(trajectories.c.group_id == group_id)
    ).all()
    counts: dict[str, int] = {}
    for chunk in chunks(sorted(row.id for row in rows)):
        query = select(spans.c.trajectory_id, func.count()).where(spans.c.trajectory_id.in_(chunk))
        counts.update(dict(conn.execute(query.group_by(spans.c.trajectory_id)).all()))
    return {row.id: MemberStamp(row.trace_id, counts.get(row.id, 0), row.updated_at) for row in rows}


class SeenRun(NamedTuple):
    """A group's last judge run as a judge saw it when it found the group due (see `ScoringStore.claim_run`)."""

    started_at: float | None
    """When that run started; None when the group had no run."""


class ScoringStore:
    """Reads and writes the judges' tables on `engine` (the collector store's engine)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._tx = Transactions(engine)

    # --- judge runs ---------------------------------------------------------------------
    def run(self, group_id: str) -> dict[str, Any] | None:
        """The last judge run of a group, or None."""
        with self.engine.connect() as conn:
            row = conn.execute(select(judge_runs).where(judge_runs.c.group_id == group_id)).mappings().first()
        return dict(row) if row else None

    def runs(self, group_ids: Iterable[str] | None = None) -> dict[str, dict[str, Any]]:
        """Judge runs by group id (all of them, or those of `group_ids`)."""
        with self.engine.connect() as conn:
            if group_ids is None:
                rows = list(conn.execute(select(judge_runs)).mappings())
            else:
                rows = []
                for chunk in chunks(list(group_ids)):
                    rows += conn.execute(select(judge_runs).where(judge_runs.c.group_id.in_(chunk))).mappings()
        return {row["group_id"]: dict(row) for row in rows}

    def claim_run(self, run: dict[str, Any], *, stale_before: float, seen: SeenRun | None = None) -> bool:
        """Start the judge run `run` (a `running` row) of `run["group_id"]`, unless another run holds the group.

        The row is taken when the group has none, when its last run finished, or when its `running` run
        started before `stale_before` (its judge died mid-run). The database decides between judges racing
        for the group, on one collector or on replicas sharing the database: exactly one gets True.
        With `seen`, the group's last run when the caller found it due, it is refused too once another run
        started since: a group another judge took up (and may have finished) meanwhile is not judged twice.
        """
        group = judge_runs.c.group_id == run["group_id"]
        takeover = update(judge_runs).where(
            group, or_(judge_runs.c.state != "running", judge_runs.c.started_at < stale_before)
        )
        if seen is not None and seen.started_at is not None:
            takeover = takeover.where(judge_runs.c.started_at == seen.started_at)
        first_only = seen is not None and seen.started_at is None  # the caller saw no run: any row is another's
        with self.engine.begin() as conn:
            if not first_only and conn.execute(takeover.values(**run)).rowcount:
                return True
            if conn.execute(select(judge_runs.c.group_id).where(group)).first() is not None:
                return False
        try:
            with self.engine.begin() as conn:
                conn.execute(judge_runs.insert().values(**run))
        except IntegrityError:
            if self.run(run["group_id"]) is None:  # not the group's key: no lost race but a bad row
                raise
            return False  # another judge inserted the group's first run since the check above
        return True

    def finish_run(self, group_id: str, started_at: float, **values: Any) -> bool:
        """Record the outcome (`values`) of the group's run that `claim_run` started at `started_at`, a run that
        stores no scores.

        Returns False, writing nothing, when that run no longer holds the group (another judge took over
        its claim as stale).
        """
        with self.engine.begin() as conn:
            return self.finish_run_in(conn, group_id, started_at, **values)

    def finish_run_in(
        self, conn: Connection, group_id: str, started_at: float, *,
        judgements: tuple[str, list[dict[str, Any]]] | None = None, **values: Any
    ) -> bool:
        """`finish_run` in the caller's transaction `conn` (the run's rewards', see `Store.add_rewards`), with
        `judgements` (reward name, rows as `save_judgements` takes them) the run's judgements too.

        The claim check is the update of the run's row: it locks the row until `conn`'s transaction ends, so a
        `claim_run` taking the run over meanwhile waits for that transaction and then sees the run finished. On
        False nothing was written here; the caller rolls back what it wrote before.
        """
        ours = (
            judge_runs.c.group_id == group_id, judge_runs.c.state == "running", judge_runs.c.started_at == started_at
        )
        if conn.execute(update(judge_runs).where(*ours).values(**values)).rowcount != 1:
            return False
        if judgements is not None:
            self._replace_judgements(conn, group_id, *judgements)
        return True

    def member_stamps(self, group_id: str) -> dict[str, MemberStamp]:
        """The stamp of each of the group's trajectories, by id, as committed (see `member_stamps_held`), read without
        the write lock."""
        return self._tx.read(lambda conn: _stamps(conn, group_id))

    def member_stamps_held(
        self, conn: Connection, group_id: str, seen: dict[str, MemberStamp]
    ) -> dict[str, MemberStamp]:
        """The stamp of each of the group's trajectories, by id, as committed, read in `conn`'s transaction (a run's
        scores', see `Store.add_rewards`' `before`) once it holds the advisory locks an export changing them takes
        (`Transactions.lock`, namespaces in ascending order): those of the `seen` members' ids and traces, then the
        group's key. An export in flight commits first and is seen here; a later one waits for the commit.

        Nothing is assembled, so the transaction (on SQLite, the write lock) is held briefly however large the group:
        the stamps differ from `seen` when a member came or left, or got spans (its messages come from its spans
        only), or its row changed otherwise (a harmless extra `judge_stale`)."""
        self._tx.lock(conn, TRAJECTORY_LOCKS, [*seen, *(stamp.trace_id for stamp in seen.values())])
        key = conn.execute(select(groups.c.key).where(groups.c.id == group_id)).scalar()
        self._tx.lock(conn, GROUP_LOCKS, [key] if key is not None else [])
        return _stamps(conn, group_id)

    def save_judgements(self, name: str, group_id: str, rows: list[dict[str, Any]]) -> None:
        """Replace the group's judgements under reward `name` with `rows` (trajectory_id, score, explanation, ...)."""
        with self.engine.begin() as conn:
            self._replace_judgements(conn, group_id, name, rows)

    @staticmethod
    def _replace_judgements(conn: Connection, group_id: str, name: str, rows: list[dict[str, Any]]) -> None:
        conn.execute(delete(judgements).where(judgements.c.group_id == group_id, judgements.c.name == name))
        if rows:
            conn.execute(judgements.insert(), [{"name": name, "group_id": group_id, **row} for row in rows])

    @staticmethod
    def forget_trajectories(conn: Connection, trajectory_ids: list[str], group_ids: list[str]) -> None:
        """Drop the judgements of deleted trajectories and the judge runs of their groups `group_ids`, on `conn`: the
        transaction that deletes the trajectories (`foreign_deletion._forget_trajectories`), so the members left are
        judged again without them (a run in flight loses its claim and stores nothing)."""
        for chunk in chunks(sorted(trajectory_ids)):
            conn.execute(delete(judgements).where(judgements.c.trajectory_id.in_(chunk)))
        for chunk in chunks(sorted(group_ids)):
            conn.execute(delete(judge_runs).where(judge_runs.c.group_id.in_(chunk)))

    def judgements(self, trajectory_ids: list[str]) -> dict[str, list[dict[str, Any]]]:
        """Judgements by trajectory id."""
        out: dict[str, list[dict[str, Any]]] = {tid: [] for tid in trajectory_ids}
        with self.engine.connect() as conn:
            for chunk in chunks(trajectory_ids):
                for row in conn.execute(select(judgements).where(judgements.c.trajectory_id.in_(chunk))).mappings():
                    out[row["trajectory_id"]].append(dict(row))
        return out

    # --- Langfuse -----------------------------------------------------------------------
    def pulled_versions(self, score_ids: list[str]) -> dict[str, str]:
        """`updated_at` of the Langfuse scores already pulled, by score id."""
        out: dict[str, str] = {}
        with self.engine.connect() as conn:
            for chunk in chunks(score_ids):
                rows = conn.execute(
                    select(langfuse_pulled.c.score_id, langfuse_pulled.c.updated_at)
                    .where(langfuse_pulled.c.score_id.in_(chunk))
                )
                out.update({score_id: updated for score_id, updated in rows})
        return out

    def pulled_since(self, since: float) -> list[dict[str, Any]]:
        """The Langfuse scores pulled (new or changed) at `since` or later."""
        with self.engine.connect() as conn:
            return [dict(row) for row in conn.execute(
                select(langfuse_pulled).where(langfuse_pulled.c.pulled_at >= since)
            ).mappings()]

    @staticmethod
    def forget_pulled(conn: Connection, score_id: str) -> None:
        """Drop a pulled Langfuse score's record (the score was deleted there), on `conn`: the transaction that takes
        its rewards back (`Store.withdraw_score`'s `also`), so the record goes if and only if they do."""
        conn.execute(delete(langfuse_pulled).where(langfuse_pulled.c.score_id == score_id))

    @staticmethod
    def mark_pulled(conn: Connection, rows: list[dict[str, Any]]) -> set[str]:
        """Remember pulled Langfuse scores (score_id, updated_at, trace_id, name, value, pulled_at; one row per score),
        on `conn`: the transaction that stores their rewards (`Store.add_rewards`'s `also`), so a score is marked if
        and only if its reward is stored.

        Returns the ids of the scores marked here. A score already marked at the same or a later `updated_at` is not:
        another sync (a replica's on the same database) pulled that version or a newer one since this sync read the
        marks (on PostgreSQL, one still in its transaction is waited for); the caller rolls back the rewards of such
        scores. `updated_at` is an ISO 8601 time in UTC with microseconds (`schema.score_version`; schema version 9
        rewrote the versions stored before so), which sorts as a string as the times do.
        """
        marked: set[str] = set()
        for chunk in chunks(rows):
            insert = _insert(conn, langfuse_pulled).values(chunk)
            claim = insert.on_conflict_do_update(
                index_elements=[langfuse_pulled.c.score_id],
                set_={column: insert.excluded[column] for column in chunk[0] if column != "score_id"},
                where=langfuse_pulled.c.updated_at < insert.excluded.updated_at,
            )
            marked.update(conn.execute(claim.returning(langfuse_pulled.c.score_id)).scalars())
        return marked

    def own_scores(self, score_ids: list[str]) -> set[str]:
        """Those of `score_ids` that are scores this store pushed to Langfuse (`mark_pushed`), deleted there or not."""
        found: set[str] = set()
        with self.engine.connect() as conn:
            for chunk in chunks(score_ids):
                query = select(langfuse_pushed.c.score_id).where(langfuse_pushed.c.score_id.in_(chunk))
                found.update(conn.execute(query).scalars())
        return found

    @staticmethod
    def pushed_in(conn: Connection) -> dict[tuple[str, str], PushedScore]:
        """What was pushed to Langfuse, by (trajectory id, reward name), read on `conn`; not the scores marked to
        delete there (`retract_pushed`): they are a deleted trajectory's, and a later one of the same id pushes its own
        under another score id once that one is deleted there (`retracting_in`)."""
        rows = conn.execute(
            select(
                langfuse_pushed.c.trajectory_id,
                langfuse_pushed.c.name,
                langfuse_pushed.c.value,
                langfuse_pushed.c.pushed_at,
                langfuse_pushed.c.score_id,
            ).where(langfuse_pushed.c.retract_at.is_(None))
        )
        return {(tid, name): PushedScore(value, at, score_id) for tid, name, value, at, score_id in rows}

    @staticmethod
    def retracting_in(conn: Connection) -> set[tuple[str, str]]:
        """(trajectory id, reward name) of the stored trajectories whose record of a pushed score is one marked to be
        deleted in Langfuse (`retract_pushed`), read on `conn`: a deleted trajectory's, of the same id. Until that
        score is deleted (or the deletion given up) the record holds its id, and a push of the same name would
        overwrite it."""
        live = exists().where(trajectories.c.id == langfuse_pushed.c.trajectory_id)
        return {(tid, name) for tid, name in conn.execute(
            select(langfuse_pushed.c.trajectory_id, langfuse_pushed.c.name)
            .where(langfuse_pushed.c.retract_at.is_not(None), live)
        )}

    @staticmethod
    def trajectory_rows(conn: Connection) -> list[dict[str, Any]]:
        """Each stored trajectory's `id`, `trace_id`, `group_id` and `created_at`, read on `conn` from its row alone
        (neither its spans nor its digest)."""
        columns = (trajectories.c.id, trajectories.c.trace_id, trajectories.c.group_id, trajectories.c.created_at)
        return [dict(row) for row in conn.execute(select(*columns)).mappings()]

    def read(self, work: Callable[[Connection], T]) -> T:
        """`work(conn)` in a transaction that only reads, every statement of it on one snapshot of the database
        (`Transactions.read`)."""
        return self._tx.read(work)

    @staticmethod
    def retract_pushed(conn: Connection, trajectory_ids: list[str], at: float) -> None:
        """Mark the records of the scores pushed to Langfuse for deleted trajectories as to be deleted there, on `conn`:
        the transaction that deletes the trajectories (`foreign_deletion._forget_trajectories`). Due `INGEST_DELAY`
        after `at`: a deletion right after a push of the score could reach Langfuse before the push is ingested, and
        every push recorded so far (the last one too: a changed reward pushes the score again, and Langfuse ingests it
        anew) came before `at`; a push still in flight marks its record itself (`mark_pushed`). The first sync when
        they are due deletes them (`LangfuseSync.sync`); a later trajectory of the same id pushes its own scores, under
        other ids, once they are (`retracting_in`)."""
        for chunk in chunks(sorted(trajectory_ids)):
            conn.execute(update(langfuse_pushed).where(langfuse_pushed.c.trajectory_id.in_(chunk))
                         .values(retract_at=at + INGEST_DELAY))

    def to_retract(self, due_at: float | None = None, limit: int | None = None) -> list[dict[str, Any]]:
        """The records of pushed scores marked to be deleted in Langfuse (`retract_pushed`) whose next try
        (`retract_at`) is due at `due_at` (None: all of them), the earliest due first; at most `limit` of them."""
        marked = langfuse_pushed.c.retract_at
        with self.engine.connect() as conn:
            return [dict(row) for row in conn.execute(
                select(langfuse_pushed).where(marked.is_not(None) if due_at is None else marked <= due_at)
                .order_by(langfuse_pushed.c.retract_at, langfuse_pushed.c.trajectory_id, langfuse_pushed.c.name)
                .limit(limit)
            ).mappings()]

    def retract_later(self, row: dict[str, Any], at: float, since: float) -> None:
        """Try the deletion in Langfuse of the pushed score of the record `row` (a `to_retract` row) again at `at`
        (`retract_at` is when to try next), its age counted from `since` (`pushed_at`, which a record marked to delete
        serves for nothing else: a timestamp ahead of a clock that moved back is replaced so), unless its record was
        pushed again or dropped since."""
        with self.engine.begin() as conn:
            conn.execute(update(langfuse_pushed).where(
                langfuse_pushed.c.trajectory_id == row["trajectory_id"], langfuse_pushed.c.name == row["name"],
                langfuse_pushed.c.score_id == row["score_id"], langfuse_pushed.c.retract_at.is_not(None),
            ).values(retract_at=at, pushed_at=since))

    def forget_pushed(self, row: dict[str, Any]) -> None:
        """Drop the record `row` (trajectory_id, name) of a pushed score, once deleted in Langfuse (or refused for
        good): whether still marked or pushed again since (a replica's push of a later trajectory of the same id,
        whose score the deletion may have deleted), so the next push sends whatever reward of that name the store
        has again."""
        with self.engine.begin() as conn:
            conn.execute(delete(langfuse_pushed).where(
                langfuse_pushed.c.trajectory_id == row["trajectory_id"], langfuse_pushed.c.name == row["name"]
            ))

    def mark_pushed(self, rows: list[dict[str, Any]], retract_at: float) -> None:
        """Remember pushed scores (trajectory_id, name, value, score_id, pushed_at: the score's timestamp; created_at:
        when the trajectory the push read was created, `trajectory_rows`), clearing a mark to delete them
        (`retract_pushed`) that a deletion set after the push read the records: the score sent is the later value of
        the same one. Except where that trajectory is gone by now, deleted while its score was pushed (re-created since,
        of the same id, too: its `created_at` is another): such a record is marked to be deleted at `retract_at`, as
        the score sent may be the deleted one's."""
        if not rows:
            return
        with self.engine.begin() as conn:
            for chunk in chunks(rows):
                records = [{key: value for key, value in row.items() if key != "created_at"} for row in chunk]
                insert = _insert(conn, langfuse_pushed).values([{**record, "retract_at": None} for record in records])
                conn.execute(insert.on_conflict_do_update(
                    index_elements=[langfuse_pushed.c.trajectory_id, langfuse_pushed.c.name],
                    set_={column: insert.excluded[column] for column in ("value", "score_id", "pushed_at",
                                                                         "retract_at")},
                ))
                pushed_for = {row["trajectory_id"]: row["created_at"] for row in chunk}
                live = dict(conn.execute(select(trajectories.c.id, trajectories.c.created_at)
                                         .where(trajectories.c.id.in_(sorted(pushed_for)))).all())
                gone = sorted(tid for tid, created in pushed_for.items() if tid not in live or live[tid] != created)
                if gone:
                    conn.execute(update(langfuse_pushed).where(langfuse_pushed.c.trajectory_id.in_(gone))
                                 .values(retract_at=retract_at))
