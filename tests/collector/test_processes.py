"""Real `art-collector serve` processes: two replicas on one PostgreSQL, and `kill -9` mid-ingest."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.collector.server_helpers import PB
from tests.collector.services import CollectorProcess, PostgresServer
from tests.collector.span_builders import llm, rollout, to_request


def _group_spans(i: int) -> tuple[bytes, bytes]:
    """Export bodies of group `g{i}`: one per trajectory (so two replicas can take one each)."""
    bodies = []
    for k, reward in enumerate((1.0, 0.0)):
        n, trace, rollout_id = 1000 * i + 10 * k + 1, f"{1000 * i + k + 1:032x}", f"g{i}-{k}"
        spans = [
            llm(n, rollout=rollout_id, trace=trace, start=5, prompt=[1, 2], completion=[3 + k]),
            rollout(n + 1, rollout_id, trace=trace, group=f"g{i}", size=2, rewards={"reward": reward}),
        ]
        bodies.append(to_request(spans).SerializeToString())
    return bodies[0], bodies[1]


def _parallel(count: int, work: Callable[[int], None]) -> None:
    """Run `work(0..count-1)` on as many threads at once; a worker's exception fails the test."""
    with ThreadPoolExecutor(count) as pool:
        for future in [pool.submit(work, k) for k in range(count)]:
            future.result(timeout=120)


def test_two_replicas_on_one_postgres_never_lease_a_group_twice(postgres: PostgresServer, tmp_path: Path) -> None:
    db = postgres.create_database()
    replicas = [CollectorProcess(db, tmp_path / f"collector{k}.log").start() for k in range(2)]
    try:
        urls = [r.url for r in replicas]
        groups = 40

        def ingest(worker: int) -> None:  # the two halves of each group go to different replicas, at once
            with httpx.Client(timeout=30) as http:
                for i in range(worker, groups, 4):
                    first, second = _group_spans(i)
                    assert http.post(f"{urls[i % 2]}/v1/traces", content=first, headers=PB).status_code == 200
                    assert http.post(f"{urls[(i + 1) % 2]}/v1/traces", content=second, headers=PB).status_code == 200

        _parallel(4, ingest)
        states = httpx.get(f"{urls[0]}/v1/groups", timeout=30).json()
        assert (sorted((g["id"], g["state"], g["size"]) for g in states)
                == sorted((f"g{i}", "ready", 2) for i in range(groups)))

        leased: list[tuple[int, str, str]] = []
        start = threading.Barrier(8, timeout=60)

        def lease(worker: int) -> None:
            with httpx.Client(timeout=30) as http:
                start.wait()
                empty = 0
                while empty < 3:
                    reply = http.post(f"{urls[worker % 2]}/v1/batches", json={"max_groups": 2, "trainer": f"t{worker}"})
                    assert reply.status_code == 200, reply.text  # a refused lease shows its reason, not a KeyError
                    batch = reply.json()
                    empty = 0 if batch["groups"] else empty + 1
                    leased.extend((worker % 2, batch["id"], g["id"]) for g in batch["groups"])

        _parallel(8, lease)
        ids = [group for _, _, group in leased]
        assert len(ids) == len(set(ids)), f"leased twice: {sorted(i for i in ids if ids.count(i) > 1)}"
        assert sorted(ids) == sorted(f"g{i}" for i in range(groups))
        assert {replica for replica, _, _ in leased} == {0, 1}  # both replicas handed out groups
        for replica, batch_id in {(r, b) for r, b, _ in leased}:
            assert httpx.post(f"{urls[1 - replica]}/v1/batches/{batch_id}/ack", json={"policy_step": 1},
                              timeout=30).status_code == 200
        assert {g["state"] for g in httpx.get(f"{urls[1]}/v1/groups", timeout=30).json()} == {"trained"}
    finally:
        for replica in replicas:
            replica.stop()


SPANS_PER_EXPORT = 20


def _export(worker: int, i: int) -> bytes:
    """One export: one trajectory of `SPANS_PER_EXPORT` unrelated turns (one sequence each)."""
    rollout_id, trace = f"w{worker}-{i}", f"{worker + 1:08x}{i + 1:024x}"
    spans = [
        llm((worker * 100_000 + i) * 100 + t + 1, rollout=rollout_id, trace=trace, start=t, prompt=[t + 1000, 7],
            completion=[t])
        for t in range(SPANS_PER_EXPORT)
    ]
    return to_request(spans).SerializeToString()


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_kill_9_mid_ingest_loses_no_acknowledged_span(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    db = (request.getfixturevalue("postgres").create_database() if backend == "postgresql"
          else f"sqlite:///{tmp_path / 'c.db'}")
    collector = CollectorProcess(db, tmp_path / "collector.log").start()
    acked: list[str] = []
    failed: list[str] = []
    stop = threading.Event()

    def client(worker: int) -> None:
        with httpx.Client(timeout=30) as http:
            i = 0
            while not stop.is_set():
                try:
                    response = http.post(f"{collector.url}/v1/traces", content=_export(worker, i), headers=PB)
                except httpx.TransportError:
                    failed.append(f"w{worker}-{i}")
                    return
                if response.status_code == 200:
                    acked.append(f"w{worker}-{i}")
                i += 1

    threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 120
    while len(acked) < 60 and time.monotonic() < deadline:
        time.sleep(0.01)
    collector.kill()  # SIGKILL while the clients keep exporting
    stop.set()
    for thread in threads:
        thread.join(30)
    assert len(acked) >= 60, "the collector acknowledged too few exports before the deadline"
    assert failed, "no export was in flight when the collector was killed"

    restarted = CollectorProcess(db, tmp_path / "collector.log").start()
    try:
        stored = {t["id"]: len(t["sequences"])
                  for t in httpx.get(f"{restarted.url}/v1/trajectories", timeout=120).json()}
        lost = [rollout_id for rollout_id in acked if stored.get(rollout_id) != SPANS_PER_EXPORT]
        assert not lost, f"acknowledged exports missing after kill -9: {lost[:5]} of {len(acked)}"
    finally:
        restarted.stop()


def test_a_replica_whose_clock_runs_ahead_leaves_another_replicas_lease_alone(
    postgres: PostgresServer, tmp_path: Path
) -> None:
    """On PostgreSQL the store's time is the database's: a replica on a machine whose clock is an hour ahead sees a
    lease another replica gave as running, and does not lease its group to a second trainer."""
    ahead = tmp_path / "ahead"
    ahead.mkdir()
    (ahead / "sitecustomize.py").write_text("import time\n_real = time.time\ntime.time = lambda: _real() + 3600\n")
    path = os.pathsep.join(filter(None, [str(ahead), os.environ.get("PYTHONPATH")]))
    db = postgres.create_database()
    replicas = [
        CollectorProcess(db, tmp_path / "collector0.log").start(),
        CollectorProcess(db, tmp_path / "collector1.log", env={"PYTHONPATH": path}).start(),
    ]
    try:
        with httpx.Client(timeout=30) as http:
            for body in _group_spans(0):
                assert http.post(f"{replicas[0].url}/v1/traces", content=body, headers=PB).status_code == 200
            first = http.post(f"{replicas[0].url}/v1/batches", json={"lease_seconds": 600, "trainer": "t1"}).json()
            assert [g["id"] for g in first["groups"]] == ["g0"]
            second = http.post(f"{replicas[1].url}/v1/batches", json={"trainer": "t2"}).json()
            assert second["groups"] == []
            shown = http.get(f"{replicas[1].url}/v1/groups").json()
            assert [(g["id"], g["state"]) for g in shown] == [("g0", "leased")]
            assert http.post(f"{replicas[1].url}/v1/batches/{first['id']}/ack", json={}).status_code == 200
    finally:
        for replica in replicas:
            replica.stop()
