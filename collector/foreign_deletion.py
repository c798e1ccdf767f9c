"""The deletion of another instrumentation's model calls in the traces of ART rollouts.

Another model's calls (a tool's client, traced beside a rollout: `assembly.FactsDigest.foreign_only`) are no sample
of our policy: an export leaves out such a trajectory of a trace that holds a rollout, and deletes one stored before
the rollout's spans came (`without_foreign_calls_in_rollouts`, called by `placement.write_trajectories`) unless its
group is leased or trained; one kept so is deleted when its group returns to the pool (`forget_deferred_foreign`).
Functions over an open transaction.
"""

from __future__ import annotations

import logging
from typing import Any

from sqlalchemy import Connection, delete, select

from collector.assembly import FactsDigest, TrajectoryFacts
from collector.engine import chunks
from collector.rows import counts, group_order, lock_trajectories
from collector.schema import groups, rewards, spans, trajectories
from collector.scoring_store import ScoringStore

__all__ = ["FOREIGN_IN_ROLLOUT", "forget_deferred_foreign", "without_foreign_calls_in_rollouts"]

log = logging.getLogger(__name__)

FOREIGN_IN_ROLLOUT = "model calls of another instrumentation in the trace of an ART rollout (not our policy's text)"
"""Why a trace's trajectory is left out: its calls are another model's (a tool's client), traced beside a rollout."""


def _trace_rows(conn: Connection, trace_ids: list[str]) -> dict[str, Any]:
    """The stored trajectories keyed by trace id (outside any rollout) of `trace_ids`, by id."""
    found: dict[str, Any] = {}
    for chunk in chunks(sorted(trace_ids)):
        query = select(trajectories).where(trajectories.c.id.in_(chunk), trajectories.c.by_rollout.is_(False))
        found.update({row["id"]: row for row in conn.execute(query).mappings()})
    return found


def _rollout_traces(conn: Connection, known: set[str], trace_ids: set[str]) -> set[str]:
    """Those of `trace_ids` that hold an ART rollout: those of `known` (the traces of the export's rollout spans), and
    those that a stored span of a rollout is in.

    A trace holds a rollout when it holds any of the rollout's spans (stored under the rollout id; the export's are
    stored by now), not only when it is the rollout row's `trace_id`: a rollout spread over traces (a graph run
    resumed in a new trace) names the trace of its first rollout span there, which a later span may change, and a
    trace may hold only its model calls. Two lookups by key, the spans' (led by the trace id since schema version
    12), then the trajectories': joined in one query, PostgreSQL scanned every trajectory row."""
    held = known & trace_ids
    for chunk in chunks(sorted(trace_ids - held)):
        traces_of: dict[str, set[str]] = {}
        for trajectory_id, trace_id in conn.execute(
            select(spans.c.trajectory_id, spans.c.trace_id).where(spans.c.trace_id.in_(chunk)).distinct()
        ):
            traces_of.setdefault(trajectory_id, set()).add(trace_id)
        for ids in chunks(sorted(traces_of)):
            query = select(trajectories.c.id).where(trajectories.c.id.in_(ids), trajectories.c.by_rollout.is_(True))
            for rollout_id in conn.execute(query).scalars():
                held |= traces_of[rollout_id]
    return held


def _forget_trajectories(conn: Connection, rows: list[Any], now: float) -> None:
    """Delete the trajectories `rows`, their spans and what was scored of them: the rewards given to their ids (a
    judge's, the API's), which a later trajectory of the same id would take as its own, the judge's explanations of
    them, and the judge runs of their groups (`ScoringStore.forget_trajectories`), so the members left are judged again
    without them (a run in flight loses its claim and stores nothing).

    A trajectory's spans are those stored under its id (`spans.trajectory_id`, the trace id): the rollout's spans of
    the same trace are stored under the rollout id, and a rollout whose id is the trace id shares this row, not only
    its spans. More of the trace's foreign calls make no trajectory again: they are left out on arrival, their spans
    deleted (`without_foreign_calls_in_rollouts`). The records of their scores pushed to Langfuse
    (`langfuse_pushed`) stay, marked as of `now` (`ScoringStore.retract_pushed`: due once Langfuse has ingested the
    push): they name the scores that the first Langfuse sync when due deletes there (`LangfuseSync.sync`), and go once
    each is deleted or its deletion refused for good (one failing for now is tried again later).
    """
    ids = sorted(row["id"] for row in rows)
    for chunk in chunks(ids):
        conn.execute(delete(trajectories).where(trajectories.c.id.in_(chunk)))
        conn.execute(delete(spans).where(spans.c.trajectory_id.in_(chunk)))
        conn.execute(delete(rewards).where(rewards.c.rollout_id.in_(chunk)))
    ScoringStore.forget_trajectories(conn, ids, sorted({row["group_id"] for row in rows} - {None}))
    ScoringStore.retract_pushed(conn, ids, now)


def _group_states(conn: Connection, group_ids: list[str]) -> dict[str, str]:
    """The state of each of the groups `group_ids` (sorted), their rows locked (FOR UPDATE) in id order
    (`rows.BYTE_ORDER`, as `pool.lock_groups` takes them) before any trajectory's."""
    states: dict[str, str] = {}
    for chunk in chunks(group_ids):
        query = (
            select(groups.c.id, groups.c.state).where(groups.c.id.in_(chunk))
            .order_by(group_order(conn)).with_for_update()
        )
        states.update(dict(conn.execute(query).all()))
    return states


def _lock_with_members(conn: Connection, trajectory_ids: list[str], group_ids: list[str]) -> None:
    """Hold the trajectory rows `trajectory_ids` and those of the groups `group_ids` (`lock_trajectories`), in one
    pass in id order, across chunks too (Python sorts ids as `BYTE_ORDER` does), on PostgreSQL."""
    if conn.dialect.name != "postgresql":
        return
    ids = set(trajectory_ids)
    for chunk in chunks(group_ids):
        ids.update(conn.execute(select(trajectories.c.id).where(trajectories.c.group_id.in_(chunk))).scalars())
    for chunk in chunks(sorted(ids)):
        lock_trajectories(conn, trajectories.c.id.in_(chunk))


def _delete_foreign(conn: Connection, rows: list[Any], now: float) -> set[str]:
    """Delete the stored trajectories `rows` (`without_foreign_calls_in_rollouts`, `_forget_trajectories`) but those
    whose group is leased or trained; a group they leave empty is skipped. The members they leave are dated `now`, so
    a late ack of a lease that held a group sees it changed (`leases._changed_since`). The ids of those deleted.

    The groups' rows are locked first, in id order, then the trajectories' (those deleted and the members left), in
    id order too."""
    states = _group_states(conn, sorted({row["group_id"] for row in rows} - {None}))
    deleted = []
    for row in sorted(rows, key=lambda row: row["id"]):
        state = states.get(row["group_id"])
        if state in ("leased", "trained"):
            log.warning("trajectory %s: %s, kept: its group %s is %s", row["id"], FOREIGN_IN_ROLLOUT, row["group_id"],
                        state)
        else:
            deleted.append(row)
    left = sorted({row["group_id"] for row in deleted} - {None})
    _lock_with_members(conn, [row["id"] for row in deleted], left)
    _forget_trajectories(conn, deleted, now)
    for row in deleted:
        log.info("trajectory %s deleted: %s", row["id"], FOREIGN_IN_ROLLOUT)
    for chunk in chunks(left):
        conn.execute(trajectories.update().where(trajectories.c.group_id.in_(chunk)).values(updated_at=now))
    opened = [group_id for group_id in left if states.get(group_id) == "open"]
    members = counts(conn, trajectories.c.group_id, opened)
    for chunk in chunks([group_id for group_id in opened if not members[group_id]]):
        conn.execute(
            groups.update().where(groups.c.id.in_(chunk))
            .values(state="skipped", reason=f"its trajectory was deleted: {FOREIGN_IN_ROLLOUT}", updated_at=now)
        )
    return {row["id"] for row in deleted}


def forget_deferred_foreign(conn: Connection, group_ids: list[str], now: float) -> None:
    """Delete the trajectories of `group_ids` that `without_foreign_calls_in_rollouts` kept because their group was
    leased when their trace's rollout came (`_delete_foreign`, as an export deletes them): called when the
    groups return to the pool (`pool.give_back`), so another instrumentation's calls are not leased again as samples of
    our policy. A group it leaves empty is skipped, as an export's deletion leaves it."""
    rows: dict[str, Any] = {}
    for chunk in chunks(sorted(group_ids)):
        query = select(trajectories).where(trajectories.c.group_id.in_(chunk), trajectories.c.by_rollout.is_(False))
        rows.update({row["id"]: row for row in conn.execute(query).mappings()})
    held = _rollout_traces(conn, set(), set(rows))
    _delete_foreign(conn, [rows[key] for key in sorted(held)
                           if rows[key]["digest"] and FactsDigest.from_json(rows[key]["digest"]).foreign_only], now)


def without_foreign_calls_in_rollouts(
    conn: Connection,
    found: dict[tuple[str, bool], TrajectoryFacts],
    digests: dict[tuple[str, bool], FactsDigest],
    existing: dict[str, Any],
    rollout_traces: set[str],
    now: float,
) -> tuple[dict[tuple[str, bool], TrajectoryFacts], dict[tuple[str, bool], FactsDigest]]:
    """`found` and `digests` without the trajectory of a trace that holds an ART rollout when its model calls are all
    another instrumentation's (`FactsDigest.foreign_only`: a tool inside the rollout calling another model through a
    traced client). Another model's text is no sample of our policy, and the trace's rewards (a Langfuse score) are the
    rollout's. One stored before the rollout's spans came is deleted (`_delete_foreign`), in whichever export they come:
    one in any trace of the export's rollout spans (`rollout_traces`), not only the rollout row's (a rollout spread
    over traces names the trace of its first rollout span).

    The spans of calls left out on arrival (with or after the rollout's) are deleted in the export's transaction, as a
    deleted trajectory's are, with the trace's earlier spans outside any rollout (e.g. the tool's span, stored for a
    model call to come): such spans are read only for their trace's own trajectory, which a later call of ours outside
    the rollout may still make (without them, as after a deleted one); a later export of the trace is left out again
    by its rollout's spans (`_rollout_traces`), not by these.
    """
    candidates = {
        key: existing.get(key) for key, by_rollout in found if not by_rollout and digests[key, False].foreign_only
    }
    stored = _trace_rows(conn, sorted(rollout_traces - {key for key, _ in found}))
    candidates.update(
        {key: row for key, row in stored.items() if row["digest"] and FactsDigest.from_json(row["digest"]).foreign_only}
    )
    held = _rollout_traces(conn, rollout_traces, set(candidates))
    stored = [candidates[key] for key in sorted(held) if candidates[key] is not None]
    left_out = {key for key in held if candidates[key] is None} | _delete_foreign(conn, stored, now)
    for key in sorted(left_out):
        if candidates[key] is None:
            conn.execute(delete(spans).where(spans.c.trajectory_id == key))
            log.info("trace %s: %s; left out, its spans deleted", key, FOREIGN_IN_ROLLOUT)
    if not left_out:
        return found, digests
    keep = [trajectory for trajectory in found if not (trajectory[0] in left_out and not trajectory[1])]
    return {t: found[t] for t in keep}, {t: digests[t] for t in keep}

