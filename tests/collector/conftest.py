"""Fixtures of the collector tests: a store on each backend, with a clock the test moves."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from collector.config import CollectorSettings
from collector.store import SqlStore


class Clock:
    """A settable clock (Unix seconds)."""

    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


_BACKENDS = ["sqlite-file", "sqlite-memory"]  # a PostgreSQL store joins this list when it exists


@pytest.fixture(params=_BACKENDS)
def make_store(request: pytest.FixtureRequest, tmp_path: Path, clock: Clock) -> Iterator[Callable[..., SqlStore]]:
    """Factory of set-up stores on the parametrised backend; settings fields as keyword arguments."""
    made: list[SqlStore] = []

    def make(**fields: object) -> SqlStore:
        urls = {
            "sqlite-file": f"sqlite:///{tmp_path / f'sub{len(made)}' / 'collector.db'}",
            "sqlite-memory": "sqlite://",
        }
        store = SqlStore(CollectorSettings(db=urls[request.param], **fields), clock=clock)
        store.setup()
        made.append(store)
        return store

    yield make
    for store in made:
        store.close()
