"""Fixtures of the collector tests: a store on each backend, with a clock the test moves; a client of the HTTP API.

The PostgreSQL backend is a real server that this session starts from Debian's package
(see `services.PostgresServer`); every store gets a database of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from collector.config import CollectorSettings
from collector.spans import forget_warnings
from collector.store import SqlStore
from tests.collector.server_helpers import collector_app
from tests.collector.services import PostgresServer


class Clock:
    """A settable clock (Unix seconds)."""

    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture(autouse=True)
def _warnings_logged_again() -> None:
    """Each test sees the assembly warnings it causes, whatever an earlier test logged (`spans.warn_once`)."""
    forget_warnings()


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    """A PostgreSQL server for the whole session, on a free port in 24400-24499."""
    server = PostgresServer().start()
    yield server
    server.stop()


BACKENDS = ["sqlite-file", "sqlite-memory", "postgresql"]


@pytest.fixture(params=BACKENDS)
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[], str]:
    """Factory of fresh, empty databases on the parametrised backend."""
    made = [0]

    def make() -> str:
        made[0] += 1
        if request.param == "postgresql":
            return request.getfixturevalue("postgres").create_database()
        if request.param == "sqlite-memory":
            return "sqlite://"
        return f"sqlite:///{tmp_path / f'sub{made[0]}' / 'collector.db'}"

    return make


@pytest.fixture
def make_store(db_url: Callable[[], str], clock: Clock) -> Iterator[Callable[..., SqlStore]]:
    """Factory of set-up stores on the parametrised backend; settings fields as keyword arguments."""
    made: list[SqlStore] = []

    def make(**fields: object) -> SqlStore:
        store = SqlStore(CollectorSettings(db=db_url(), **fields), clock=clock)
        store.setup()
        made.append(store)
        return store

    yield make
    for store in made:
        store.close()


@pytest.fixture
def client(tmp_path: Path) -> TestClient:
    """A test client of the collector's app on a fresh SQLite file (`server_helpers.collector_app`)."""
    return TestClient(collector_app(tmp_path))
