"""The reward curve's policy steps (`collector/curve.py`): computed as assembly builds the sequences, and stored in the
trajectories' rows so that a restarted collector reads them instead of the spans."""

from __future__ import annotations

import random
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import delete, event, select, update
from sqlalchemy.exc import OperationalError

from art_langgraph import semconv as sc
from collector import curve, foreign
from collector.assembly import model_calls
from collector.config import CollectorSettings
from collector.otlp import SpanRecord
from collector.schema import spans, trajectories
from collector.sequences import build_sequences
from collector.spans import unique_sorted
from collector.store import SqlStore
from collector.views import reward_curve
from tests.collector import span_builders as sb
from tests.collector.test_views import assembled_curve, grow

_STEPS = [None, 0, 1, 2, 3, 2.0, 2.5, -1, True, "1"]
"""Policy steps a turn may carry: whole numbers, and values that are none (`spans.whole_number`)."""


def _random_turn(rng: random.Random, n: int, tokens: list[int]) -> tuple[SpanRecord, list[int]]:
    """A model-call span with random tokens, step and marks: it extends `tokens` or not, is kept or dropped (no or
    bad token ids, logprobs that do not match, failed), an `llm` span or another instrumentation's call; and its
    tokens, for the next turn to extend."""
    prompt = tokens + [rng.randint(0, 3)] if tokens and rng.random() < 0.6 else [rng.randint(0, 3)] * rng.randint(0, 2)
    completion = rng.choice([[rng.randint(0, 3)], [], [5, 6], None])
    span = sb.llm(n, start=rng.randint(0, 5), prompt=prompt, completion=completion, step=None,
                  messages=[{"role": "user", "content": "hi"}], output=[{"role": "assistant", "content": "yo"}])
    attrs: dict[str, Any] = dict(span.attributes)
    if (step := rng.choice(_STEPS)) is not None:
        attrs[sc.POLICY_STEP] = step
    if rng.random() < 0.1:
        attrs[sc.PROMPT_TOKEN_IDS] = rng.choice([[-1], [1.5], "12", [True]])
    if rng.random() < 0.1 and completion:
        attrs[sc.COMPLETION_LOGPROBS] = [-0.1] * (len(completion) + 1)
    if rng.random() < 0.1:
        attrs[sc.ERROR_TYPE] = "timeout"
    if rng.random() < 0.15:
        del attrs[sc.SPAN_KIND]  # a foreign model call (`gen_ai.operation.name` = chat)
    record = SpanRecord(span.trace_id, span.span_id, None, "chat", span.start_ns, span.end_ns, attrs,
                        failed=rng.random() < 0.05)
    return record, prompt + (completion or [])


def _random_spans(rng: random.Random) -> list[SpanRecord]:
    """Random model calls of one trajectory, some sent twice, with its rollout span."""
    records: list[SpanRecord] = [sb.rollout(1000)]
    tokens: list[int] = []
    for n in range(rng.randint(0, 6)):
        record, tokens = _random_turn(rng, n, tokens)
        records.append(record)
    records += rng.sample(records, k=min(len(records), rng.randint(0, 2)))  # a retried export: the same span ids
    rng.shuffle(records)
    return records


def test_the_step_is_the_one_of_the_sequences_assembly_builds() -> None:
    """`step_of` follows `build_sequences` for the steps alone: same step on random trajectories."""
    rng = random.Random(11)
    for _ in range(3000):
        records = _random_spans(rng)
        sequences = build_sequences(model_calls(unique_sorted(records))).sequences
        assert curve.step_of(records) == curve.highest_step(sequences), records


def test_the_step_reads_no_messages(monkeypatch: pytest.MonkeyPatch) -> None:
    """The step was computed by building the sequences, which read each turn's messages for their drift only (60%
    of the time of a first curve read)."""
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the step read the messages")

    monkeypatch.setattr(foreign, "conversation", refuse)
    records = [sb.llm(1, start=1, prompt=[1], completion=[2], step=3),
               sb.llm(2, start=2, prompt=[1, 2, 3], completion=[4], step=4, messages=[{"role": "user", "content": "?"}],
                      output=[{"role": "assistant", "content": "!"}]),
               sb.llm(3, start=3, prompt=[9], completion=[9], step=1)]
    assert curve.step_of(records) == 4


def _restarted(db: Path) -> SqlStore:
    """A new store on the database file (a collector started again)."""
    store = SqlStore(CollectorSettings(db=f"sqlite:///{db}"))
    store.setup()
    return store


@pytest.fixture
def read_ids(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The trajectories (by rollout id, else trace id) whose steps the curve computes from their spans."""
    read: list[str] = []
    step_of = curve.step_of

    def counted(records: list[SpanRecord]) -> int | None:
        read.append(next((str(r.attributes[sc.ROLLOUT_ID]) for r in records if sc.ROLLOUT_ID in r.attributes),
                         records[0].trace_id if records else "?"))
        return step_of(records)

    monkeypatch.setattr(curve, "step_of", counted)
    return read


def test_a_restarted_collector_reads_the_stored_steps_not_the_spans(tmp_path: Path, read_ids: list[str]) -> None:
    """A first curve read after a start computed every trajectory's step from its spans (3.6-4.2 s of CPU at 10,000
    trajectories of 5 spans). Same curve as the assembled trajectories', on a random store, as it grows, each read by a
    new store: only the trajectories that got spans since the last read are read."""
    rng = random.Random(5)
    db, ids = tmp_path / "c.db", list[str]()
    for n, (added, touched) in enumerate([(40, 40), (10, 20), (0, 0)]):
        store = _restarted(db)
        grow(rng, store, ids, added=added, touched=touched, base=100_000 * (n + 1))
        with store.engine.connect() as conn:
            rows = conn.execute(curve.ROWS).all()
        stale = sorted(row.id for row in rows if row.policy_step_spans != row.spans)
        store.close()
        store = _restarted(db)
        read_ids.clear()
        assert reward_curve(store) == assembled_curve(store, None, None) and sorted(read_ids) == stale
        assert [bool(stale), len(stale) < len(rows)] == [n < 2, n > 0]  # some changed, not all; the last: none
        for split in (None, "train", "test"):
            assert reward_curve(store, split=split) == assembled_curve(store, None, split)
        store.close()


def test_a_step_is_stored_only_in_the_row_it_was_computed_from(tmp_path: Path) -> None:
    """A step is stored after the read that computed it: not in a row that got a span, or was made again, since."""
    store = _restarted(tmp_path / "c.db")
    store.add_spans([*sb.trajectory(10, "a", reward=1.0), *sb.trajectory(20, "b", reward=1.0),
                     *sb.trajectory(30, "c", reward=1.0)])
    store._read(lambda conn: curve.curve_facts(conn, curve.ROWS, store._steps, store.training, every=True))
    store.add_spans([sb.llm(99, rollout="b", trace=f"{20:032x}", start=50, prompt=[7], completion=[8], step=6)])
    with store.engine.begin() as conn:
        conn.execute(update(trajectories).where(trajectories.c.id == "c").values(created_at=-1.0))
    store._tx.run(store._steps.save)
    with store.engine.connect() as conn:
        stored = conn.execute(select(trajectories.c.id, trajectories.c.policy_step, trajectories.c.policy_step_spans))
        assert sorted(stored) == [("a", 0, 2), ("b", None, None), ("c", None, None)]
    assert [(p.policy_step, p.count) for p in reward_curve(store)] == [(0, 2), (6, 1)]
    with store.engine.connect() as conn:
        stored = conn.execute(select(trajectories.c.id, trajectories.c.policy_step, trajectories.c.policy_step_spans))
        assert sorted(stored) == [("a", 0, 2), ("b", 6, 3), ("c", 0, 2)]
    store.close()


def test_steps_the_store_cannot_take_now_are_logged_and_the_curve_answered(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Storing the computed steps is a write after the read: a full disk or a lock held too long there is logged, not
    a failed read (the steps are computed again after the next start)."""
    store = _restarted(tmp_path / "c.db")
    store.add_spans([*sb.trajectory(10, "a", reward=1.0)])

    def disk_full(conn: object) -> None:
        raise OperationalError("UPDATE trajectories", {}, sqlite3.OperationalError("database or disk is full"))

    monkeypatch.setattr(store._steps, "save", disk_full)
    assert [(p.policy_step, p.count) for p in reward_curve(store)] == [(0, 1)]
    assert "the policy steps the reward curve computed could not be stored" in caplog.text
    assert "database or disk is full" in caplog.text
    store.close()


def test_steps_are_stored_by_a_save_tried_again_after_a_deadlock(tmp_path: Path) -> None:
    """On PostgreSQL the save can be a deadlock's victim (it locks rows in id order, another transaction updating two
    members of a trace or group in another order), and `Transactions.run` tries it again: that try stored nothing, as
    the first had already let go of the steps to store."""
    store = _restarted(tmp_path / "c.db")
    store.add_spans([*sb.trajectory(10, "a", reward=1.0), *sb.trajectory(20, "b", reward=1.0)])

    class Deadlock(Exception):
        sqlstate = "40P01"

    aborted: list[str] = []

    @event.listens_for(store.engine, "before_cursor_execute")
    def deadlock_once(conn: object, cursor: object, statement: str, *args: object) -> None:
        if statement.startswith("UPDATE trajectories SET policy_step") and not aborted:
            aborted.append(statement)
            raise OperationalError(statement, {}, Deadlock("deadlock detected"))

    assert [(p.policy_step, p.count) for p in reward_curve(store)] == [(0, 2)]
    with store.engine.connect() as conn:
        stored = conn.execute(select(trajectories.c.id, trajectories.c.policy_step, trajectories.c.policy_step_spans))
        assert aborted and sorted(stored) == [("a", 0, 2), ("b", 0, 2)]
    assert not store._steps.unsaved
    store.close()


def test_the_curve_counts_spans_from_the_index_alone(tmp_path: Path) -> None:
    """The curve's span counts (`ROWS`, and `PolicySteps.save`'s check) read the index of the spans' trajectory ids
    alone, not every span's row (a count of `span_id`, not in it, read them: 2-4x slower at 2,000 trajectories of 100
    spans); a trajectory without spans counts none."""
    store = _restarted(tmp_path / "c.db")
    store.add_spans([*sb.trajectory(10, "a", reward=1.0), *sb.trajectory(20, "b", reward=1.0)])
    with store.engine.begin() as conn:
        conn.execute(delete(spans).where(spans.c.trajectory_id == "b"))
        assert sorted((row.id, row.spans) for row in conn.execute(curve.ROWS)) == [("a", 2), ("b", 0)]
    saves: list[tuple[str, tuple[object, ...]]] = []

    @event.listens_for(store.engine, "before_cursor_execute")
    def keep(conn: object, cursor: object, statement: str, parameters: list[tuple[object, ...]], *args: object) -> None:
        if statement.startswith("UPDATE trajectories SET policy_step"):
            saves.append((statement, parameters[0]))

    assert [(p.policy_step, p.count) for p in reward_curve(store)] == [(0, 1)]
    assert len(saves) == 1  # the save of a's step, with `executemany`
    with store.engine.connect() as conn:
        for statement, parameters in [(str(curve.ROWS.compile(conn)), ()), *saves]:
            plan = " ".join(row[-1] for row in conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {statement}", parameters))
            assert "SEARCH spans USING COVERING INDEX ix_spans_trajectory_id_trace_id" in plan, (statement, plan)
    store.close()
