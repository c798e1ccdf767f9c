"""HTTP API of the trainers (`collector/server.py`): lease, ack and release batches, list and reopen groups."""

from __future__ import annotations

import json
import random
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from collector import store_reads
from collector.protocol import Batch, Group, Sequence, Trajectory
from collector.server import _lease_answer, create_app
from collector.store import SqlStore
from tests.collector.server_helpers import JSON, PB, assert_error, collector_app
from tests.collector.span_builders import llm, rollout, rollout_group, to_request, trajectory


def test_batches_groups_and_acks(client: TestClient) -> None:
    client.post("/v1/traces", content=to_request(rollout_group({"a": 1.0, "b": 0.0})).SerializeToString(), headers=PB)
    assert [(g["id"], g["state"], g["size"]) for g in client.get("/v1/groups").json()] == [("g", "ready", 2)]
    batch = client.post("/v1/batches", json={"max_groups": 4, "trainer": "t"}).json()
    assert [g["id"] for g in batch["groups"]] == ["g"]
    assert {t["id"] for t in batch["groups"][0]["trajectories"]} == {"a", "b"}
    assert client.post("/v1/batches", json={}).json()["groups"] == []
    ack = client.post(f"/v1/batches/{batch['id']}/ack", json={"policy_step": 3})
    assert ack.status_code == 200 and ack.json() == {"batch_id": batch["id"], "groups": ["g"], "policy_step": 3}
    assert client.get("/v1/groups").json()[0]["state"] == "trained"
    assert client.get("/v1/groups", params={"state": "ready"}).json() == []
    assert [g["id"] for g in client.get("/v1/groups?state=ready&state=trained").json()] == ["g"]
    assert_error(client.get("/v1/groups", params={"state": "done"}), 400, "invalid_request")
    assert_error(client.post("/v1/batches/unknown/ack", json={}), 404, "not_found")
    assert_error(client.get("/v1/trajectories/unknown"), 404, "not_found")
    assert_error(client.post("/v1/batches", json={"max_groups": 0}), 400, "invalid_request")
    assert client.get("/health").json() == {"status": "ok"}


@pytest.mark.parametrize(("body", "fragment"), [
    ({"min_groups": 5, "max_groups": 4}, "min_groups=5 exceeds max_groups=4"),
    ({"lease_seconds": 1e309}, "lease_seconds"),
    ({"lease_seconds": 8 * 24 * 3600}, "body.lease_seconds: Input should be less than or equal to 604800"),
    ({"lease_seconds": 1e-300}, "body.lease_seconds: Input should be greater than or equal to 1"),
    ({"lease_seconds": 0.5}, "body.lease_seconds: Input should be greater than or equal to 1"),
    ({"lease_seconds": 0}, "body.lease_seconds: Input should be greater than or equal to 1"),
    ({"trainer": "t" * 257}, "trainer"),
    # a line break would forge a log line (`leased ... to <trainer>`)
    ({"trainer": "t\nleased 9 groups to u"}, "body.trainer: Value error, holds U+000A"),
    ({"trainer": "t\x85u"}, "body.trainer: Value error, holds U+0085"),
    ({"trainer": "t\u2028u"}, "body.trainer: Value error, holds U+2028"),
])
def test_a_lease_request_that_could_never_be_met_or_kept_is_refused(
    client: TestClient, body: dict[str, Any], fragment: str
) -> None:
    # `Infinity` for 1e309, as Python writes it
    answer = client.post("/v1/batches", content=json.dumps(body), headers=JSON)
    assert fragment in assert_error(answer, 400, "invalid_request")["message"]
    assert_error(client.post("/v1/batches/b/ack", json={"policy_step": 2**31}), 400, "invalid_request")


@pytest.mark.parametrize("body", [
    {"max_groups": True}, {"min_groups": True}, {"lease_seconds": True}, {"max_groups": "2"}, {"lease_seconds": "60"},
])
def test_a_lease_bound_that_is_no_json_number_is_refused_not_read_as_one(
    client: TestClient, body: dict[str, Any]
) -> None:
    """`true` was read as 1 and `"60"` as 60: `{"lease_seconds": true}` leased for one second, after which each group
    counted a failed attempt."""
    client.post("/v1/traces", content=to_request(rollout_group({"a": 1.0, "b": 0.0})).SerializeToString(), headers=PB)
    message = assert_error(client.post("/v1/batches", json=body), 400, "invalid_request")["message"]
    assert message.startswith(f"body.{next(iter(body))}: "), message
    assert [g["state"] for g in client.get("/v1/groups").json()] == ["ready"]


def test_an_ack_step_that_is_no_json_integer_is_refused_not_read_as_one(client: TestClient) -> None:
    """`{"policy_step": true}` acked the batch at step 1 (and `"3"` at step 3), which the reward curve then showed."""
    client.post("/v1/traces", content=to_request(rollout_group({"a": 1.0, "b": 0.0})).SerializeToString(), headers=PB)
    batch = client.post("/v1/batches", json={}).json()
    for step in (True, "3"):
        answer = client.post(f"/v1/batches/{batch['id']}/ack", json={"policy_step": step})
        assert assert_error(answer, 400, "invalid_request")["message"].startswith("body.policy_step: ")
    assert [g["state"] for g in client.get("/v1/groups").json()] == ["leased"]
    assert client.post(f"/v1/batches/{batch['id']}/ack", json={"policy_step": 3}).json()["policy_step"] == 3


def test_a_lease_that_takes_nothing_leaves_no_batch(client: TestClient) -> None:
    """Trainers poll; a poll that finds too few ready groups must not leave a batch that later 'expires'."""
    assert client.post("/v1/batches", json={}).json()["groups"] == []  # nothing stored yet
    client.post("/v1/traces", content=to_request(rollout_group({"a": 1.0, "b": 0.0})).SerializeToString(), headers=PB)
    nothing = client.post("/v1/batches", json={"min_groups": 2, "max_groups": 4})  # one group is ready
    assert nothing.status_code == 200 and nothing.json()["groups"] == []
    assert_error(client.post(f"/v1/batches/{nothing.json()['id']}/ack", json={}), 404, "not_found")
    assert client.get("/v1/view/batches").json() == []
    leased = client.post("/v1/batches", json={}).json()
    assert [b["id"] for b in client.get("/v1/view/batches").json()] == [leased["id"]]


def test_release_gives_groups_back_now_and_shows_on_the_batch(tmp_path: Path) -> None:
    client = TestClient(collector_app(tmp_path, max_failed_attempts=2))
    client.post("/v1/traces", content=to_request(rollout_group({"a": 1.0, "b": 0.0})).SerializeToString(), headers=PB)
    assert_error(client.post("/v1/batches/unknown/release", json={"reason": "x"}), 404, "not_found")
    first = client.post("/v1/batches", json={"trainer": "t"}).json()
    assert_error(client.post(f"/v1/batches/{first['id']}/release", json={}), 400, "invalid_request")  # reason needed
    assert_error(client.post(f"/v1/batches/{first['id']}/release", json={"reason": ""}), 400, "invalid_request")
    released = client.post(f"/v1/batches/{first['id']}/release", json={"reason": "NonFiniteStepError: " + "n" * 3000})
    assert released.status_code == 200
    assert released.json() == {"batch_id": first["id"], "returned": ["g"], "skipped": [], "max_failed_attempts": 2}
    assert [(g["state"], g["failed_attempts"]) for g in client.get("/v1/groups").json()] == [("ready", 1)]
    [shown] = client.get("/v1/view/batches").json()
    assert shown["state"] == "released" and shown["reason"].startswith("NonFiniteStepError: nnn")
    assert len(shown["reason"]) == 2000  # cut, not refused: a trainer's long traceback still releases
    assert_error(client.post(f"/v1/batches/{first['id']}/ack", json={"policy_step": 1}), 409, "batch_released")

    second = client.post("/v1/batches", json={}).json()
    assert [g["id"] for g in second["groups"]] == ["g"]
    skipped = client.post(f"/v1/batches/{second['id']}/release", json={"reason": "RuntimeError: again"}).json()
    assert (skipped["returned"], skipped["skipped"]) == ([], ["g"])
    [group] = client.get("/v1/groups").json()
    assert (group["state"], group["reason"]) == ("skipped", "training failed 2 times; last: RuntimeError: again")
    assert client.post("/v1/batches", json={}).json()["groups"] == []

    # once the trainer's bug is fixed, an operator puts the group back: leased again, attempts forgotten
    assert_error(client.post("/v1/groups/unknown/reopen"), 404, "not_found")
    reopened = client.post("/v1/groups/g/reopen")
    assert reopened.status_code == 200
    assert reopened.json() == {"group_id": "g", "previous_state": "skipped",
                               "previous_reason": "training failed 2 times; last: RuntimeError: again",
                               "failed_attempts": 2}
    assert [(g["state"], g["failed_attempts"]) for g in client.get("/v1/groups").json()] == [("ready", 0)]
    assert_error(client.post("/v1/groups/g/reopen"), 409, "group_not_reopenable")
    third = client.post("/v1/batches", json={}).json()
    assert [g["id"] for g in third["groups"]] == ["g"]


def test_a_release_whose_reason_holds_a_lone_surrogate_gives_the_groups_back(client: TestClient) -> None:
    """JSON's `"\\ud800"` reads as a lone surrogate, which no UTF-8 text holds: the release was refused (400) while its
    body was read, and the groups stayed leased until the lease expired. The reason is a trainer's error text: stored
    with U+FFFD in its place. Other fields with one are still refused."""
    client.post("/v1/traces", content=to_request(rollout_group({"a": 1.0, "b": 0.0})).SerializeToString(), headers=PB)
    batch = client.post("/v1/batches", json={}).json()
    body = '{"reason": "UnicodeError: \\ud800 \\udfff end", "failed": false}'
    released = client.post(f"/v1/batches/{batch['id']}/release", content=body, headers=JSON)
    assert released.status_code == 200 and released.json()["returned"] == ["g"]
    assert [(g["state"], g["failed_attempts"]) for g in client.get("/v1/groups").json()] == [("ready", 0)]
    [shown] = client.get("/v1/view/batches").json()
    assert (shown["state"], shown["reason"]) == ("released", "UnicodeError: \ufffd \ufffd end")
    refused = client.post("/v1/batches", content='{"trainer": "t\\ud800"}', headers=JSON)
    assert "body.trainer" in assert_error(refused, 400, "invalid_request")["message"]


def test_batch_and_ack_without_body(client: TestClient) -> None:
    client.post("/v1/traces", content=to_request(rollout_group({"a": 1.0, "b": 0.0})).SerializeToString(), headers=PB)
    batch = client.post("/v1/batches")
    assert batch.status_code == 200 and [g["id"] for g in batch.json()["groups"]] == ["g"]
    ack = client.post(f"/v1/batches/{batch.json()['id']}/ack")
    assert ack.status_code == 200 and ack.json() == {"batch_id": batch.json()["id"], "groups": ["g"],
                                                     "policy_step": None}


def test_a_reply_nested_past_what_a_response_can_encode_is_read_as_absent(client: TestClient) -> None:
    """Content nested 300 levels deep was stored, then every read of it and the lease of its group were a 500 (pydantic
    stops encoding at 255 levels), the lease committed all the same: the groups stayed leased to no trainer."""
    deep: Any = "7"
    for _ in range(300):
        deep = [deep]
    spans = []
    for i, content in enumerate([deep, "8"]):
        trace = f"{i + 1:032x}"
        reply = [{"role": "assistant", "content": content}]
        spans += [llm(10 * i + 1, rollout=f"r{i}", trace=trace, start=5, prompt=[1], completion=[2], output=reply),
                  rollout(10 * i + 2, f"r{i}", trace=trace, group="g", size=2, rewards={"reward": float(i)})]
    client.post("/v1/traces", content=to_request(spans).SerializeToString(), headers=PB)
    assert client.get("/v1/trajectories/r0").json()["messages"] == []
    assert client.get("/v1/view/trajectories").status_code == 200
    batch = client.post("/v1/batches")
    assert batch.status_code == 200
    messages = {t["id"]: t["messages"] for t in batch.json()["groups"][0]["trajectories"]}
    assert messages == {"r0": [], "r1": [{"role": "assistant", "content": "8"}]}


def test_a_lease_sent_again_with_its_idempotency_key_answers_the_same_batch(client: TestClient) -> None:
    client.post("/v1/traces", content=to_request(rollout_group({"a": 1.0, "b": 0.0})).SerializeToString(), headers=PB)
    keyed = {"Idempotency-Key": "5f0c8e1d"}
    first = client.post("/v1/batches", json={"lease_seconds": 60}, headers=keyed)
    assert first.status_code == 200 and [g["id"] for g in first.json()["groups"]] == ["g"]
    assert client.post("/v1/batches", json={"lease_seconds": 60}, headers=keyed).json() == first.json()
    assert client.post("/v1/batches", json={"idempotency_key": "5f0c8e1d", "lease_seconds": 60}).json() == first.json()
    other = assert_error(client.post("/v1/batches", json={"lease_seconds": 90}, headers=keyed), 409,
                         "idempotency_key_mismatch")  # a key reused for another request: a client bug
    assert "for another request (lease_seconds 60, not 90)" in other["message"]
    bounds = assert_error(client.post("/v1/batches", json={"lease_seconds": 60, "max_groups": 9}, headers=keyed),
                          409, "idempotency_key_mismatch")  # bounds the batch still meets: still another request
    assert "for another request (max_groups 8, not 9)" in bounds["message"]
    assert client.post("/v1/batches", json={}).json()["groups"] == []  # no key: a lease of its own
    assert [b["id"] for b in client.get("/v1/view/batches").json()] == [first.json()["id"]]
    client.post(f"/v1/batches/{first.json()['id']}/ack", json={"policy_step": 1})
    refused = assert_error(client.post("/v1/batches", json={}, headers=keyed), 409, "idempotency_key_used")
    assert refused["message"].endswith("which is acked now: its lease ended; send a new key to lease again")


@pytest.mark.parametrize(("body", "key", "fragment"), [
    ({}, "k" * 257, "header.Idempotency-Key: String should have at most 256 characters"),
    ({}, "", "header.Idempotency-Key: String should have at least 1 character"),
    ({"idempotency_key": "a"}, "b", "the Idempotency-Key header and the body's idempotency_key differ"),
])
def test_an_idempotency_key_that_cannot_be_kept_is_refused(
    client: TestClient, body: dict[str, Any], key: str, fragment: str
) -> None:
    answer = client.post("/v1/batches", json=body, headers={"Idempotency-Key": key})
    assert fragment in assert_error(answer, 400, "invalid_request")["message"]


def _unencodable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Leased trajectories carry a value no JSON answer can hold: the lease commits, its answer then fails."""
    assemble = store_reads.assemble
    monkeypatch.setattr(store_reads, "assemble", lambda *args: [
        t.model_copy(update={"messages": [{"content": object()}]}) for t in assemble(*args)
    ])


def test_a_lease_whose_answer_cannot_be_sent_is_released_at_once(
    make_store: Callable[..., SqlStore], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The lease committed, then encoding its answer failed: a 500 that no trainer could ack or release, its groups
    leased until the lease expired. Released as failed before the 500 (a group whose data fails every answer is
    skipped in the end, not leased again forever); its key's retry is refused."""
    store = make_store()
    client = TestClient(create_app(store.settings, store), raise_server_exceptions=False)
    client.post("/v1/traces", content=to_request(rollout_group({"a": 1.0, "b": 0.0})).SerializeToString(), headers=PB)
    _unencodable(monkeypatch)
    keyed = {"Idempotency-Key": "k1"}
    failed = assert_error(client.post("/v1/batches", json={}, headers=keyed), 500, "internal_error")
    assert failed["message"].startswith("PydanticSerializationError")
    monkeypatch.undo()
    assert [(g.state, g.failed_attempts) for g in store.groups()] == [("ready", 1)]
    assert "releasing its 1 groups" in caplog.text
    [batch] = store.batches()
    assert (batch.state, batch.reason) == ("released", f"its answer could not be sent: {failed['message']}")
    assert_error(client.post("/v1/batches", json={}, headers=keyed), 409, "idempotency_key_used")
    assert [g["id"] for g in client.post("/v1/batches", json={}).json()["groups"]] == ["g"]


def test_a_release_that_fails_after_an_unsent_lease_is_logged_not_answered(
    client: TestClient, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    client.post("/v1/traces", content=to_request(rollout_group({"a": 1.0, "b": 0.0})).SerializeToString(), headers=PB)
    _unencodable(monkeypatch)
    store = client.app.state.store

    def release_fails(*_: Any) -> None:
        raise RuntimeError("store gone")

    monkeypatch.setattr(store, "release", release_fails)
    unsent = TestClient(client.app, raise_server_exceptions=False)
    failed = assert_error(unsent.post("/v1/batches", json={}), 500, "internal_error")
    assert failed["message"].startswith("PydanticSerializationError")  # the cause, not the release's error
    assert "could not be released: its groups stay leased until it expires" in caplog.text
    assert "RuntimeError: store gone" in caplog.text


def test_a_lease_whose_answer_ran_out_of_memory_is_released_without_a_failed_attempt(
    make_store: Callable[..., SqlStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Encoding the answer raised MemoryError, the server's want, not the data's fault: counted as a failed attempt on
    each group, a few such failures skipped good data for good."""
    store = make_store(max_failed_attempts=1)
    client = TestClient(create_app(store.settings, store), raise_server_exceptions=False)
    client.post("/v1/traces", content=to_request(rollout_group({"a": 1.0, "b": 0.0})).SerializeToString(), headers=PB)

    def out_of_memory(*_: Any, **__: Any) -> str:
        raise MemoryError

    monkeypatch.setattr(Batch, "model_dump_json", out_of_memory)
    assert_error(client.post("/v1/batches", json={}), 500, "internal_error")
    monkeypatch.undo()
    assert [(g.state, g.failed_attempts) for g in store.groups()] == [("ready", 0)]
    assert [batch.state for batch in store.batches()] == ["released"]
    assert [g["id"] for g in client.post("/v1/batches", json={}).json()["groups"]] == ["g"]


def test_a_lease_answer_is_the_batch_json_byte_for_byte(
    make_store: Callable[..., SqlStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The answer, encoded a group at a time, is `Batch.model_dump_json()`: groups, commas, escapes, the lease's end."""
    store = make_store()
    client = TestClient(create_app(store.settings, store))
    for n, group in enumerate(['q"1', "é\u2028\\", "g"]):
        spans = trajectory(100 * n + 10, f"{group}-a", reward=1.0, group=group)
        spans += trajectory(100 * n + 20, f"{group}-b", reward=0.25 * n, group=group)
        client.post("/v1/traces", content=to_request(spans).SerializeToString(), headers=PB)
    leased: list[Batch] = []
    lease = store.lease

    def kept(request: Any) -> Batch:
        leased.append(lease(request))
        return leased[-1].model_copy(deep=True)  # the route empties the one it answers

    monkeypatch.setattr(store, "lease", kept)
    answer = client.post("/v1/batches", json={"max_groups": 8})
    assert sorted(g.id for g in leased[0].groups) == ["g", 'q"1', "é\u2028\\"]
    assert answer.content == leased[0].model_dump_json().encode()
    empty = client.post("/v1/batches", json={})
    assert leased[1].groups == [] and empty.content == leased[1].model_dump_json().encode()


def _large_batch(groups: int, members: int, tokens: int) -> Batch:
    """A batch of `groups` groups of `members` trajectories with one sequence of `tokens` tokens each."""
    rng = random.Random(0)

    def member(group: int, n: int) -> Trajectory:
        sequence = Sequence(token_ids=[rng.randrange(150_000) for _ in range(tokens)],
                            logprobs=[None if i < tokens // 2 else -rng.random() for i in range(tokens)],
                            assistant_mask=[int(i >= tokens // 2) for i in range(tokens)])
        return Trajectory(id=f"r{group}-{n}", trace_id=f"{group:016x}{n:016x}", group_id=f"g{group}",
                          sequences=[sequence], reward=float(n))

    return Batch(id="b1", lease_expires_at=1e9 + 0.25, groups=[
        Group(id=f"g{g}", task="t", trajectories=[member(g, n) for n in range(members)]) for g in range(groups)
    ])


def test_a_large_lease_answer_is_encoded_in_the_memory_its_objects_leave() -> None:
    """A lease answer's objects take several times its JSON: encoded whole beside them, a large batch needed about
    twice its JSON's size more (the JSON text, then its bytes); encoded a group at a time, each group's objects go as
    its bytes come, and the answer takes little more than the batch held."""
    expected = _large_batch(groups=8, members=2, tokens=4000).model_dump_json().encode()
    tracemalloc.start()  # before the batch is made: tracemalloc counts the frees of what it saw allocated only
    try:
        batch = _large_batch(groups=8, members=2, tokens=4000)
        start = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        answer = _lease_answer(batch)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak - start < len(expected) / 2
    assert answer.body == expected
    assert batch.groups == []  # each group's objects let go once encoded
