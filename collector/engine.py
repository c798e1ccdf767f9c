"""Database engines: SQLite tuned for durability and one writer at a time, or any other URL."""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError
from sqlalchemy.pool import StaticPool

__all__ = ["READ_ONLY", "chunks", "driver_reason", "make_engine", "use_wal"]

log = logging.getLogger(__name__)

BUSY_TIMEOUT_S = 30.0
"""Seconds a SQLite connection waits for another's lock (its busy timeout), and `use_wal` for the switch to WAL."""
CHUNK = 500
"""Most values in one `IN (...)` list."""
READ_ONLY = "art_read_only"
"""Execution option of a connection whose transactions only read: on SQLite they begin deferred (`BEGIN`), and
in WAL mode such a reader neither waits for the writer nor holds it up."""


_PLAN_CACHE_MODE_SINCE = 120000
"""The first PostgreSQL version (as `server_version_num`) that has `plan_cache_mode`."""


def _plan_for_the_values(dbapi_conn: Any, _record: Any) -> None:
    """Have PostgreSQL plan each statement of a new connection for its values (`plan_cache_mode`), not reuse a plan
    made for any. psycopg prepares a statement at its fifth run, and PostgreSQL may then keep a generic plan, costed
    for the tables as they were: prepared while a new store was small, an export's lookup of 125 keys among 20,000
    groups stayed a sequential scan comparing each row with every key (~25-40 ms, against ~1 ms planned for its
    values) until an ANALYZE. Statements stay prepared (parsed once): only their plans are made anew. A server older
    than PostgreSQL 12 has no such setting (setting it failed every connection): it keeps its own planning."""
    if dbapi_conn.info.server_version < _PLAN_CACHE_MODE_SINCE:
        return
    autocommit = dbapi_conn.autocommit
    dbapi_conn.autocommit = True  # a session setting, not one that the pool's rollback of a transaction would undo
    try:
        with dbapi_conn.cursor() as cursor:
            cursor.execute("SET plan_cache_mode = force_custom_plan")
    finally:
        dbapi_conn.autocommit = autocommit


def make_engine(url: str) -> Engine:
    """An engine for `url`; SQLite gets `synchronous=FULL` and `BEGIN IMMEDIATE` transactions (`BEGIN` with
    `READ_ONLY`), and WAL from `use_wal`."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        engine = create_engine(parsed, pool_pre_ping=True)
        event.listen(engine, "connect", _plan_for_the_values)
        return engine
    memory = _in_memory(parsed.database)
    kwargs: dict[str, Any] = {"connect_args": {"check_same_thread": False, "timeout": BUSY_TIMEOUT_S}}
    if memory:
        kwargs["poolclass"] = StaticPool
    else:
        Path(parsed.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(parsed, **kwargs)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None  # we emit BEGIN ourselves (see _on_begin)
        cursor = dbapi_conn.cursor()  # per-connection settings only: nothing here changes the file
        cursor.execute("PRAGMA synchronous=FULL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        conn.exec_driver_sql("BEGIN" if conn.get_execution_options().get(READ_ONLY) else "BEGIN IMMEDIATE")

    return engine


def use_wal(engine: Engine) -> None:
    """Put a SQLite file in WAL mode; nothing on other engines or in memory.

    WAL is a lasting change to the file, so call this once the file is known to be the collector's (after
    `schema.migrate`): a file refused as another application's, or a newer collector's, keeps its journal mode.
    """
    if engine.dialect.name != "sqlite" or _in_memory(engine.url.database):
        return
    dbapi_conn = engine.raw_connection()  # outside a transaction: SQLite cannot change into WAL within one
    try:
        mode = _switch_to_wal(dbapi_conn)
    finally:
        dbapi_conn.close()
    if mode != "wal":
        log.warning("SQLite kept %s in journal mode %s, not WAL: reads wait for writes", engine.url.database, mode)


def _switch_to_wal(dbapi_conn: Any) -> str:
    """`PRAGMA journal_mode=WAL` on `dbapi_conn`; the journal mode it leaves. SQLite answers `database is locked` at
    once, without waiting its busy timeout, while another connection writes (a replica started beside this one, still
    migrating the same new file): tried again until `BUSY_TIMEOUT_S`."""
    deadline = time.monotonic() + BUSY_TIMEOUT_S
    while True:
        cursor = dbapi_conn.cursor()
        try:
            return str(cursor.execute("PRAGMA journal_mode=WAL").fetchone()[0])
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
        finally:
            cursor.close()
        time.sleep(0.05)


def _in_memory(database: str | None) -> bool:
    """Whether a SQLite URL's database part names an in-memory database."""
    return database in (None, "", ":memory:")


def driver_reason(exc: DBAPIError) -> str:
    """The first line of the database driver's message, or its exception's name."""
    text = str(exc.orig).strip()
    return text.splitlines()[0] if text else type(exc.orig).__name__


def chunks(items: list[Any]) -> Iterator[list[Any]]:
    """`items` in slices of at most `CHUNK`."""
    for start in range(0, len(items), CHUNK):
        yield items[start : start + CHUNK]
