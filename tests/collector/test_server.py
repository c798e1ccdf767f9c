"""HTTP API (`collector/server.py`): OTLP ingest in every encoding, rewards, errors in one envelope, auth;
the real OpenTelemetry SDK against the served app. The trainers' routes: `test_server_batches.py`."""

from __future__ import annotations

import gzip
import json
import logging
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest.mock import patch

import httpx
import pytest
from fastapi import FastAPI
from fastapi.dependencies import utils as fastapi_dependencies
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from pydantic import ValidationError
from sqlalchemy import event
from sqlalchemy.exc import DataError

from art_langgraph import semconv as sc
from collector.config import CollectorSettings
from collector.otlp import SpanRecord
from collector.server import _refuse_nul, create_app
from collector.store import SqlStore
from tests.collector.server_helpers import JSON, PB, assert_error, collector_app
from tests.collector.span_builders import llm, rollout, rollout_group, to_otlp_json, to_request
from tests.served import served as served_app


def test_protobuf_export_answers_protobuf(client: TestClient) -> None:
    body = to_request(rollout_group({"a": 1.0, "b": 0.0})).SerializeToString()
    response = client.post("/v1/traces", content=body, headers=PB)
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/x-protobuf"
    assert ExportTraceServiceResponse.FromString(response.content) == ExportTraceServiceResponse()
    rows = client.get("/v1/trajectories", params={"group": "g"}).json()
    assert sorted((t["id"], t["reward"], t["complete"]) for t in rows) == [("a", 1.0, True), ("b", 0.0, True)]


@pytest.mark.parametrize("encoding", ["gzip", "x-gzip"])  # x-gzip was 415; RFC 9110 reads it as gzip
def test_gzip_json_export_answers_json(client: TestClient, encoding: str) -> None:
    body = gzip.compress(to_otlp_json(rollout_group({"a": 1.0})))
    response = client.post("/v1/traces", content=body, headers={**JSON, "content-encoding": encoding})
    assert response.status_code == 200 and response.json() == {}
    assert response.headers["content-type"] == "application/json"
    traj = client.get("/v1/trajectories/a").json()
    assert traj["sequences"] == [{"token_ids": [1, 2], "logprobs": [None, -0.5], "assistant_mask": [0, 1],
                                  "policy_step": 0}]


def test_export_errors(tmp_path: Path) -> None:
    client = TestClient(collector_app(tmp_path, max_body_bytes=2048))
    assert_error(client.post("/v1/traces", content=b"\xff\xff", headers=PB), 400, "malformed_body")
    assert_error(client.post("/v1/traces", content=b"{", headers=JSON), 400, "malformed_body")
    for spans in (b'[{"attributes": ["\\ud800"]}]', b'[{"attributes": "\\ud800"}]'):  # were 500
        body = b'{"resourceSpans": [{"scopeSpans": [{"spans": %s}]}]}' % spans
        assert "surrogate" in assert_error(client.post("/v1/traces", content=body, headers=JSON),
                                           400, "malformed_body")["message"]
    assert_error(client.post("/v1/traces", content=b"x" * 4096, headers=PB), 413, "body_too_large")
    bomb = gzip.compress(b"\0" * 100_000)
    assert_error(client.post("/v1/traces", content=bomb, headers={**PB, "content-encoding": "gzip"}),
                  413, "body_too_large")
    assert_error(client.post("/v1/traces", content=b"", headers={"content-type": "text/plain"}),
                  415, "unsupported_media_type")
    assert_error(client.post("/v1/traces", content=b"", headers={**PB, "content-encoding": "br"}),
                  415, "unsupported_encoding")


@pytest.mark.parametrize("path", ["/v1/rewards", "/v1/batches", "/v1/batches/b/release", "/v1/groups/g/judge"])
def test_every_write_refuses_a_body_past_the_limit(tmp_path: Path, path: str) -> None:
    """`ART_COLLECTOR_MAX_BODY_BYTES` held on /v1/traces only: the other writes read a body of any size whole."""
    client = TestClient(collector_app(tmp_path, max_body_bytes=2048))
    padded = json.dumps({"rollout_id": "a", "value": 1, "reason": "r", "pad": "x" * 4096}).encode()
    body = assert_error(client.post(path, content=padded, headers=JSON), 413, "body_too_large")
    assert body["message"] == f"body of {len(padded)} bytes exceeds the limit of 2048 bytes"

    def chunked() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        yield from (padded[i : i + 1000] for i in range(0, len(padded), 1000))

    assert_error(client.post(path, content=chunked(), headers=JSON), 413, "body_too_large")
    assert client.post("/v1/rewards", json={"rollout_id": "a", "value": 1}).status_code == 200


def test_partial_success_rejects_bad_spans_and_stores_the_rest(client: TestClient) -> None:
    spans = rollout_group({"a": 1.0, "b": 0.0})
    spans[3].events[0].attributes[sc.REWARD_VALUE] = float("nan")  # rollout span of b
    spans.append(llm(99, rollout="x" * 300, start=1, prompt=[1], completion=[2]))
    response = client.post("/v1/traces", content=to_request(spans).SerializeToString(), headers=PB)
    assert response.status_code == 200
    partial = ExportTraceServiceResponse.FromString(response.content).partial_success
    assert partial.rejected_spans == 2
    assert "reward 'reward' on span" in partial.error_message and "must be a finite number" in partial.error_message
    assert "art.rollout.id is longer than 256 characters" in partial.error_message
    assert client.get("/v1/trajectories/a").json()["reward"] == 1.0
    b = client.get("/v1/trajectories/b").json()
    assert (b["complete"], b["reward"]) == (False, None)  # its rollout span was rejected, its LLM span kept
    body = json.loads(to_otlp_json(spans[3:4]))
    answer = client.post("/v1/traces", json=body)
    assert answer.status_code == 200 and answer.json()["partialSuccess"]["rejectedSpans"] == "1"
    clean = client.post("/v1/traces", content=to_otlp_json(spans[:2]), headers=JSON)  # a retry: duplicates are fine
    assert clean.status_code == 200 and clean.json() == {}


@pytest.mark.parametrize(("key", "value"), [
    (sc.GROUP_SIZE, float("inf")), (sc.GROUP_SIZE, 1e300), (sc.GROUP_SIZE, 2**31), (sc.GROUP_SIZE, 0),
    (sc.GROUP_SIZE, 2.5), (sc.GROUP_SIZE, "4"), (sc.POLICY_STEP, float("nan")), (sc.POLICY_STEP, -1),
])
def test_a_count_that_is_no_whole_number_rejects_its_span_alone(client: TestClient, key: str, value: object) -> None:
    spans = rollout_group({"a": 1.0, "b": 0.0})
    bad = spans[1] if key == sc.GROUP_SIZE else spans[0]  # the rollout span, the llm span of a
    bad.attributes[key] = value
    response = client.post("/v1/traces", content=to_request(spans).SerializeToString(), headers=PB)
    assert response.status_code == 200
    partial = ExportTraceServiceResponse.FromString(response.content).partial_success
    assert partial.rejected_spans == 1
    assert f"attribute {key} is {value!r}; it must be a whole number" in partial.error_message
    assert client.get("/v1/trajectories/b").json()["reward"] == 0.0


def test_a_span_id_sent_twice_keeps_its_first_copy_in_one_export_as_in_two(tmp_path: Path) -> None:
    """Of two spans with one id the first sent is kept: two exports kept the first, one export kept the last."""
    turn = llm(1, start=5, prompt=[1], completion=[2])
    first, second = (rollout(2, group="g", rewards={"reward": value}) for value in (1.0, 0.0))  # one span id
    for exports in ([[turn, first, second]], [[turn, first], [second]]):
        (tmp_path / str(len(exports))).mkdir()
        client = TestClient(collector_app(tmp_path / str(len(exports))))
        for spans in exports:
            answer = client.post("/v1/traces", content=to_request(spans).SerializeToString(), headers=PB)
            assert answer.status_code == 200
        assert client.get("/v1/trajectories/r1").json()["rewards"] == {"reward": 1.0}


def _reseeded_export(rollout_id: str, trace: str, *more: SpanRecord) -> bytes:
    """An OTLP protobuf export of a rollout whose span ids (1 and 2) every trace of an app that reseeds `random` per
    rollout repeats (the OTel SDK's ids come from `random`)."""
    return to_request([llm(1, rollout=rollout_id, trace=trace, start=5, prompt=[1], completion=[2]),
                       rollout(2, rollout_id, trace=trace, group="g", size=2, rewards={"reward": 1.0}),
                       *more]).SerializeToString()


def test_spans_whose_ids_another_trace_holds_are_stored_on_every_backend(db_url: Callable[[], str]) -> None:
    """OpenTelemetry makes a span id unique within its trace only: a second trace's spans with the first's ids were
    rejected (`partial_success`, never sent again by the exporter), and a writer that sent a span id first took it
    from the trace it belongs to."""
    url = db_url()
    if url == "sqlite://":
        pytest.skip("the app's threads do not share one in-memory SQLite database")
    first, second, claimer = "1" * 32, "2" * 32, "3" * 32
    with TestClient(create_app(CollectorSettings(db=url))) as client:

        def export(body: bytes) -> ExportTraceServiceResponse:
            answer = client.post("/v1/traces", content=body, headers=PB)
            assert answer.status_code == 200
            return ExportTraceServiceResponse.FromString(answer.content)

        claim = to_request([llm(3, rollout="x", trace=claimer, start=1, prompt=[7], completion=[8])])
        assert not export(claim.SerializeToString()).HasField("partial_success")
        assert not export(_reseeded_export("a", first)).HasField("partial_success")
        turn = llm(3, rollout="b", trace=second, start=20, prompt=[1, 2, 4], completion=[5])
        assert not export(_reseeded_export("b", second, turn)).HasField("partial_success")
        retries = _reseeded_export("a", first) + _reseeded_export("b", second, turn)  # one export: messages merge
        assert not export(retries).HasField("partial_success")
        for rollout_id, tokens in (("a", [[1, 2]]), ("b", [[1, 2, 4, 5]]), ("x", [[7, 8]])):
            got = client.get(f"/v1/trajectories/{rollout_id}").json()
            assert [s["token_ids"] for s in got["sequences"]] == tokens, rollout_id
        assert sorted(t["id"] for t in client.get("/v1/trajectories").json()) == ["a", "b", "x"]
        assert client.get("/v1/trajectories/b").json()["reward"] == 1.0


_BIG_INT, _TOO_DEEP = "1" * 5000, "[" * 100_000  # Python's json reads neither: past 4300 digits, past recursion


@pytest.mark.parametrize(("span", "key", "value"), [
    (0, sc.GEN_AI_INPUT_MESSAGES, f'[{{"role": "user", "content": {_BIG_INT}}}]'),
    (0, sc.GEN_AI_OUTPUT_MESSAGES, _TOO_DEEP),
    (0, sc.GEN_AI_TOOL_DEFINITIONS, _BIG_INT),
    (0, "gen_ai.prompt.0.content", _TOO_DEEP),
    (0, "gen_ai.completion.0.tool_calls.0.arguments", _BIG_INT),
    (0, "langfuse.observation.input", _TOO_DEEP),
    (0, "llm.tools.0.tool.json_schema", _BIG_INT),
    (1, sc.METADATA, f'{{"n": {_BIG_INT}}}'),
])
def test_json_text_python_cannot_read_is_read_as_absent_not_a_500(
    client: TestClient, span: int, key: str, value: str
) -> None:
    """Such an attribute was stored (200), then every read that assembled its trajectory was a 500 (`ValueError` or
    `RecursionError` from `json.loads`): one span broke the trajectory list, the web page and every lease."""
    spans = rollout_group({"a": 1.0, "b": 0.0})
    spans[span].attributes[key] = value  # the llm span of a, its rollout span
    assert client.post("/v1/traces", content=to_request(spans).SerializeToString(), headers=PB).status_code == 200
    assert sorted(t["id"] for t in client.get("/v1/trajectories").json()) == ["a", "b"]
    assert client.get("/v1/trajectories/a").json()["sequences"][0]["token_ids"] == [1, 2]
    assert client.get("/v1/view/trajectory", params={"id": "a"}).status_code == 200
    assert client.get("/v1/view/trajectories").json()["total"] == 2
    leased = client.post("/v1/batches", json={"max_groups": 4})
    assert leased.status_code == 200 and [g["id"] for g in leased.json()["groups"]] == ["g"]


@pytest.mark.parametrize(("span", "key", "value", "read"), [
    (1, sc.METADATA, '{"note": "bad \\udcff byte", "\\ud800": 1}', lambda t: t["metadata"]),
    (0, sc.GEN_AI_OUTPUT_MESSAGES, '[{"role": "assistant", "content": "yo \\udcff"}]',
     lambda t: t["messages"][-1]["content"]),
])
def test_an_escaped_lone_surrogate_in_json_text_reads_as_u_fffd(
    client: TestClient, span: int, key: str, value: str, read: Callable[[dict], object]
) -> None:
    """JSON text may escape a lone surrogate (`"\\udcff"`, plain ASCII): read as one, no answer holding it could be
    encoded, so every read of its trajectory was a 500, and a lease was stored before its answer failed, leaving the
    group leased and the trainer without it."""
    spans = rollout_group({"a": 1.0, "b": 0.0})
    spans[span].attributes[key] = value  # the llm span of a, its rollout span
    assert client.post("/v1/traces", content=to_request(spans).SerializeToString(), headers=PB).status_code == 200
    got = client.get("/v1/trajectories/a")
    assert got.status_code == 200 and "\ufffd" in str(read(got.json()))
    assert client.get("/v1/view/trajectory", params={"id": "a"}).status_code == 200
    leased = client.post("/v1/batches", json={"max_groups": 4})
    assert leased.status_code == 200 and [g["id"] for g in leased.json()["groups"]] == ["g"]


def test_counts_stored_before_they_were_checked_neither_fail_a_lease_nor_count(tmp_path: Path) -> None:
    """Spans stored by a collector that did not check their counts yet assemble, those counts read as absent."""
    settings = CollectorSettings(db=f"sqlite:///{tmp_path / 'c.db'}")
    store = SqlStore(settings)
    store.setup()
    spans = rollout_group({"a": 1.0, "b": 0.0})
    spans[0].attributes[sc.POLICY_STEP] = float("nan")
    spans[1].attributes[sc.GROUP_SIZE] = float("inf")
    with patch("collector.assembly.span_problem", return_value=None):
        store.add_spans(spans)
    store.close()
    client = TestClient(create_app(settings))
    assert client.get("/v1/trajectories/a").json()["sequences"][0]["policy_step"] is None
    leased = client.post("/v1/batches", json={"max_groups": 4})
    assert leased.status_code == 200 and [g["id"] for g in leased.json()["groups"]] == ["g"]


def test_rewards_endpoint(client: TestClient) -> None:
    answer = client.post("/v1/rewards", json={"rollout_id": "a", "name": "judge", "value": 0.5})
    assert answer.status_code == 200 and answer.json()["trajectory_known"] is False
    client.post("/v1/traces", content=to_request(rollout_group({"a": 1.0})).SerializeToString(), headers=PB)
    assert client.get("/v1/trajectories/a").json()["rewards"] == {"reward": 1.0, "judge": 0.5}
    nan = client.post("/v1/rewards", content=b'{"rollout_id": "a", "value": NaN}', headers=JSON)
    assert "finite" in assert_error(nan, 400, "invalid_request")["message"]
    assert_error(client.post("/v1/rewards", content=b'{"rollout_id": "a", "value": Infinity}', headers=JSON),
                  400, "invalid_request")
    assert_error(client.post("/v1/rewards", json={"value": 1.0}), 400, "invalid_request")
    assert_error(client.post("/v1/rewards", json={"rollout_id": "a"}), 400, "invalid_request")


@pytest.mark.parametrize(("body", "reason"), [
    (b'{"rollout_id": "a", "value": }', "Expecting value at character 29"),
    (b'{"rollout_id": "a" "value": 1}', "Expecting ',' delimiter at character 19"),
    (b'{"rollout_id": "a", "value": 1}}', "Extra data at character 31"),
])
def test_a_body_that_is_no_json_is_refused_naming_why_and_where(client: TestClient, body: bytes, reason: str) -> None:
    """FastAPI's error for it read `body.29: JSON decode error`: neither what is wrong nor that it is the JSON."""
    answer = client.post("/v1/rewards", content=body, headers=JSON)
    assert assert_error(answer, 400, "invalid_request")["message"] == f"the body is not valid JSON: {reason}"


@pytest.mark.parametrize(("body", "fragment"), [
    ({"rollout_id": "x" * 257, "value": 1.0}, "rollout_id"),
    ({"rollout_id": "a\x00b", "value": 1.0}, "rollout_id"),
    ({"rollout_id": "a", "name": "n" * 257, "value": 1.0}, "name"),
    ({"rollout_id": "a", "name": "", "value": 1.0}, "name"),
    ({"trace_id": "0af7651916cd43dd8448eb211c80319g", "value": 1.0}, "trace_id"),  # 32 characters, the last not hex
    ({"trace_id": "ab" * 17, "value": 1.0}, "trace_id"),
    ({"trace_id": "0" * 32, "value": 1.0}, "trace_id must not be all zeros"),  # stored, matched by no span
])
def test_a_reward_the_store_could_not_keep_or_match_is_refused(
    client: TestClient, body: dict[str, Any], fragment: str
) -> None:
    assert fragment in assert_error(client.post("/v1/rewards", json=body), 400, "invalid_request")["message"]


@pytest.mark.parametrize("value", [True, False, "0.5", "1"])
def test_a_reward_value_that_is_no_json_number_is_refused(client: TestClient, value: object) -> None:
    """Pydantic's lax mode stored `true` as 1.0 and `"0.5"` as 0.5, where ingest rejects a span reward that is no
    number; a JSON integer is a number and stays one."""
    answer = client.post("/v1/rewards", json={"rollout_id": "a", "value": value})
    assert assert_error(answer, 400, "invalid_request")["message"].startswith("body.value: ")
    assert client.post("/v1/rewards", json={"rollout_id": "a", "value": 2}).json()["value"] == 2.0


def test_a_reward_by_trace_id_in_upper_case_finds_its_trajectory(client: TestClient) -> None:
    spans = [llm(1, rollout="a", start=5, prompt=[1], completion=[2]), rollout(2, "a", rewards={"reward": 1.0})]
    client.post("/v1/traces", content=to_request(spans).SerializeToString(), headers=PB)
    trace = client.get("/v1/trajectories/a").json()["trace_id"]
    assert trace.upper() != trace  # hex letters: the upper-case id differs from the stored one
    answer = client.post("/v1/rewards", json={"trace_id": trace.upper(), "name": "judge", "value": 0.5})
    assert (answer.status_code == 200 and answer.json()["trace_id"] == trace
            and answer.json()["trajectory_known"] is True)
    assert client.get("/v1/trajectories/a").json()["rewards"] == {"reward": 1.0, "judge": 0.5}


def test_a_span_of_a_dashed_uuid_rollout_id_is_rewarded_by_its_hex(client: TestClient) -> None:
    """Another tracer writes `art.rollout.id` as a UUID's dashed text; `art_langgraph.reward(rollout_id=...)` sends a
    UUID as its 32 hex digits. The reward reached no trajectory (kept, never applied): the trajectory was keyed as
    written, and a reward by the dashed text was the only one that matched. Now every form names it, by its hex."""
    dashed = "123e4567-e89b-12d3-a456-426614174000"
    key = uuid.UUID(dashed).hex
    spans = [llm(1, rollout=dashed, start=5, prompt=[1], completion=[2]), rollout(2, dashed, task="t")]
    assert client.post("/v1/traces", content=to_request(spans).SerializeToString(), headers=PB).status_code == 200
    for rollout_id, name in ((key, "plugin"), (dashed, "dashed"), (dashed.upper(), "upper")):
        answer = client.post("/v1/rewards", json={"rollout_id": rollout_id, "name": name, "value": 0.5})
        assert answer.status_code == 200 and answer.json()["rollout_id"] == key, answer.text
        assert answer.json()["trajectory_known"] is True
    assert [t["id"] for t in client.get("/v1/trajectories").json()] == [key]
    for path in (f"/v1/trajectories/{dashed}", f"/v1/view/trajectories/{dashed}", f"/v1/view/trajectory?id={dashed}"):
        found = client.get(path)
        assert found.status_code == 200 and found.json()["id"] == key, path
    assert client.get(f"/v1/trajectories/{key}").json()["rewards"] == {"plugin": 0.5, "dashed": 0.5, "upper": 0.5}


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING]


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/rewards", {"rollout_id": "a", "value": 0.5}),
    ("/v1/batches", {"max_groups": 2}),
    ("/v1/batches/b/ack", {"policy_step": 1}),
    ("/v1/batches/b/release", {"reason": "RuntimeError: x"}),
    ("/v1/groups/g/judge", {"rubric": "be fair"}),
])
def test_every_request_body_logs_its_unknown_fields_by_name_and_serves_the_request(
    client: TestClient, caplog: pytest.LogCaptureFixture, path: str, body: dict[str, Any]
) -> None:
    """A typo (`vaule`) or a newer client's field was dropped without a trace; it is still ignored, not refused, and
    one warning names the route and the field, never its value."""
    with caplog.at_level(logging.WARNING):
        plain = client.post(path, json=body)
        assert plain.status_code in (200, 404) and _warnings(caplog) == []
        extra = client.post(path, json={**body, "vaule": "sekret-value", "max_group": 1})
    assert extra.status_code == plain.status_code
    [warning] = _warnings(caplog)
    assert f"POST {path}:" in warning and "'max_group', 'vaule'" in warning and "sekret" not in warning


def test_an_unknown_otlp_json_field_is_no_request_field(client: TestClient, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert client.post("/v1/traces", json={"resourceSpans": [], "vaule": 1}).status_code == 200
    assert _warnings(caplog) == []


def test_api_key_guards_writes_only(tmp_path: Path) -> None:
    client = TestClient(collector_app(tmp_path, api_key="sekret"))
    body = to_request(rollout_group({"a": 1.0})).SerializeToString()
    for path, kwargs in [
        ("/v1/traces", {"content": body, "headers": PB}),
        ("/v1/rewards", {"json": {"rollout_id": "a", "value": 1.0}}),
        ("/v1/batches", {"json": {}}),
        ("/v1/batches/x/ack", {"json": {}}),
        ("/v1/batches/x/release", {"json": {"reason": "RuntimeError: boom"}}),
        ("/v1/groups/x/reopen", {}),
    ]:
        assert_error(client.post(path, **kwargs), 401, "unauthorized")
        wrong = {**kwargs.get("headers", {}), "authorization": "Bearer nope"}
        assert_error(client.post(path, **{**kwargs, "headers": wrong}), 401, "unauthorized")
    good = {**PB, "authorization": "Bearer sekret"}
    assert client.post("/v1/traces", content=body, headers=good).status_code == 200
    assert client.get("/v1/trajectories").status_code == 200
    assert client.get("/v1/groups").status_code == 200


@pytest.mark.parametrize(("body", "headers", "fragment"), [
    (b'{"value": "\xff"}', {}, "'utf-8' codec can't decode byte 0xff"),
    (gzip.compress(b'{"value": 1}'), {"content-encoding": "gzip"}, "'gzip' is read on POST /v1/traces only"),
    (b'{"value": ' + b"1" * 5000 + b"}", {}, "Exceeds the limit (4300 digits)"),
    (b"[" * 100_000 + b"]" * 100_000, {}, "it nests too deeply"),
], ids=["not-utf-8", "gzip", "big-int", "too-deep"])
def test_a_json_body_that_cannot_be_read_is_401_without_the_key_else_400_naming_why(
    tmp_path: Path, body: bytes, headers: dict[str, str], fragment: str
) -> None:
    """FastAPI answered such a body 400 `http_error` "There was an error parsing the body" before `Auth` ran: no 401
    without the key, as for a body that is not JSON, and no word of what was wrong."""
    client = TestClient(collector_app(tmp_path, api_key="sekret"))
    sent = {**JSON, **headers}
    for path in ("/v1/rewards", "/v1/batches", "/v1/batches/x/release", "/v1/groups/g/judge"):
        assert_error(client.post(path, content=body, headers=sent), 401, "unauthorized")
        answer = client.post(path, content=body, headers={**sent, "authorization": "Bearer sekret"})
        assert fragment in assert_error(answer, 400, "invalid_request")["message"]


def test_an_empty_api_key_means_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As in the plugin, which then sends no header: an empty `ART_API_KEY` must not lock every write."""
    monkeypatch.setenv("ART_API_KEY", "")
    client = TestClient(create_app(CollectorSettings(db=f"sqlite:///{tmp_path / 'c.db'}")))
    assert client.post("/v1/traces", content=to_request(rollout_group({"a": 1.0})).SerializeToString(),
                       headers=PB).status_code == 200
    assert client.post("/v1/rewards", json={"rollout_id": "a", "value": 1.0}).status_code == 200


def test_every_write_route_of_the_app_needs_the_key(tmp_path: Path) -> None:
    """Read from the app itself (judge and Langfuse routes, `{id:path}` routes), so a new write route without the
    key fails here; a body FastAPI cannot decode, which it reads before the key is checked, is 401 too."""
    app = collector_app(tmp_path, api_key="sekret")
    client = TestClient(app)
    writes = [(method, route.path.replace("{group_id:path}", "g").replace("{batch_id}", "b"))
              for route in app.routes if isinstance(route, APIRoute) for method in route.methods if method != "GET"]
    assert {path for _, path in writes} >= {"/v1/traces", "/v1/rewards", "/v1/batches", "/v1/batches/b/ack",
                                            "/v1/batches/b/release", "/v1/groups/g/reopen", "/v1/groups/g/judge",
                                            "/v1/langfuse/sync"}
    assert all("{" not in path for _, path in writes), writes
    broken = {"content": b"{not json", "headers": JSON}
    for method, path in writes:
        for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": "Basic sekret"}):
            assert_error(client.request(method, path, headers=headers), 401, "unauthorized")
            refused = client.request(method, path, content=broken["content"], headers={**JSON, **headers})
            assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer", (path, refused.text)
        assert client.request(method, path, headers={"authorization": "Bearer sekret"}).status_code != 401, path
        answered = client.request(method, path, **{**broken, "headers": {**JSON, "authorization": "bearer  sekret"}})
        assert answered.status_code != 401, (path, answered.text)
    assert_error(client.post("/v1/rewards", **{**broken, "headers": {**JSON, "authorization": "Bearer sekret"}}),
                 400, "invalid_request")


@pytest.mark.parametrize("key", ["  ", "\t\n"])
def test_a_blank_api_key_means_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, key: str) -> None:
    monkeypatch.setenv("ART_API_KEY", key)
    assert CollectorSettings().api_key is None
    client = TestClient(create_app(CollectorSettings(db=f"sqlite:///{tmp_path / 'c.db'}")))
    assert client.post("/v1/rewards", json={"rollout_id": "a", "value": 1.0}).status_code == 200


def test_a_key_that_is_not_ascii_is_refused_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """No HTTP client sends it (httpx refuses, Starlette reads headers as Latin-1): every write would be 401."""
    monkeypatch.setenv("ART_API_KEY", "clé")
    with pytest.raises(ValidationError, match="ART_API_KEY must be ASCII"):
        CollectorSettings()


def test_a_key_with_surrounding_whitespace_matches_the_header_that_carries_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """HTTP drops a header value's surrounding whitespace, so the key `" sekret\\n"` arrives as `sekret`."""
    monkeypatch.setenv("ART_API_KEY", " sekret\n")
    client = TestClient(create_app(CollectorSettings(db=f"sqlite:///{tmp_path / 'c.db'}")))
    assert client.post("/v1/batches", headers={"authorization": "Bearer sekret"}).status_code == 200
    assert_error(client.post("/v1/batches"), 401, "unauthorized")


def test_a_full_disk_answers_503_stores_nothing_and_the_retry_succeeds(tmp_path: Path) -> None:
    """SQLite's page limit stands in for a full disk: the insert fails with the same `database or disk
    is full` error. OTLP exporters retry 503 (`Retry-After`), so the spans are not lost."""
    app = collector_app(tmp_path)
    client = TestClient(app)
    engine = app.state.store.engine
    engine.dispose()
    limit = {"pages": 0}

    @event.listens_for(engine, "connect")
    def _cap(dbapi_connection: Any, _: Any) -> None:
        cursor = dbapi_connection.cursor()
        pages = cursor.execute("PRAGMA page_count").fetchone()[0]
        cursor.execute(f"PRAGMA max_page_count={pages + limit['pages']}" if limit["pages"]
                       else "PRAGMA max_page_count=1073741823")
        cursor.close()

    limit["pages"] = 2
    big = [llm(i, rollout=f"r{i}", trace=f"{i:032x}", start=5, prompt=list(range(2000)), completion=[1])
           for i in range(1, 30)]
    body = to_request(big).SerializeToString()
    full = client.post("/v1/traces", content=body, headers=PB)
    message = assert_error(full, 503, "store_unavailable")["message"]
    assert "database or disk is full" in message and "INSERT" not in message
    assert full.headers["retry-after"] == "5"
    assert client.get("/v1/trajectories").json() == []
    limit["pages"] = 0
    engine.dispose()
    assert client.post("/v1/traces", content=body, headers=PB).status_code == 200
    assert len(client.get("/v1/trajectories").json()) == 29


_NUL_IN_A_PATH = [  # every route with a path parameter: a NUL in it, and where the answer says it is
    ("GET", "/v1/trajectories/{trajectory_id}", "/v1/trajectories/a%00b", "path.trajectory_id"),
    ("GET", "/v1/view/trajectories/{trajectory_id}", "/v1/view/trajectories/a%00", "path.trajectory_id"),
    ("GET", "/v1/groups/{group_id}/judge", "/v1/groups/g%00/judge", "path.group_id"),
    ("POST", "/v1/groups/{group_id}/judge", "/v1/groups/g/%00/judge", "path.group_id"),
    ("POST", "/v1/groups/{group_id}/reopen", "/v1/groups/%00/reopen", "path.group_id"),
    ("POST", "/v1/batches/{batch_id}/ack", "/v1/batches/b%00/ack", "path.batch_id"),
    ("POST", "/v1/batches/{batch_id}/release", "/v1/batches/b%00/release", "path.batch_id"),
]
_NUL_IN_A_QUERY = [
    ("GET", "/v1/trajectories?task=%00", "query.task"),
    ("GET", "/v1/trajectories?group=g%00&split=train", "query.group"),
    ("GET", "/v1/view/trajectories?split=%00&limit=5", "query.split"),
    ("GET", "/v1/view/trajectory?id=a%00", "query.id"),
    ("GET", "/v1/view/reward-curve?split=t%00", "query.split"),
    ("GET", "/v1/view/reward-curve?name=%00", "query.name"),  # was [] on PostgreSQL too: no query compares it
    ("GET", "/v1/groups?state=open&state=%00", "query.state"),
    ("GET", "/v1/trajectories?task=%00&split=%00", "query.task query.split"),
]


def test_a_nul_in_a_path_parameter_or_query_value_is_a_bad_request_on_every_backend(db_url: Callable[[], str]) -> None:
    """No id or name the collector stores holds a NUL (span attributes, rewards and names refuse it): PostgreSQL's
    driver refused such a value of the URL (400 from its DataError, 500 before), SQLite looked it up and answered 404
    or `[]`, and `?name=` of the reward curve, compared by no query, answered `[]` on both. Refused before the
    store is read, naming the parameter as a validation error does; a write without the key is still 401 first."""
    app = create_app(CollectorSettings(db=db_url(), api_key="k"))
    statements: list[str] = []
    event.listen(app.state.store.engine, "before_cursor_execute", lambda *args: statements.append(args[2]))
    routes = {
        (method, route.path.replace(":path", ""))
        for route in app.routes
        if isinstance(route, APIRoute) and route.param_convertors
        for method in route.methods
    }
    assert routes == {(method, route) for method, route, _, _ in _NUL_IN_A_PATH}  # a new route: add it above
    client = TestClient(app, headers={"Authorization": "Bearer k"})
    bodies = {"/release": {"reason": "r"}, "/ack": {"policy_step": 1}}
    cases = [(method, url, where) for method, _, url, where in _NUL_IN_A_PATH] + _NUL_IN_A_QUERY
    for method, url, where in cases:
        body = next((b for end, b in bodies.items() if url.endswith(end)), None)
        problems = assert_error(client.request(method, url, json=body), 400, "invalid_request")["message"].split("; ")
        assert [p.partition(": ")[0] for p in problems] == where.split(), (url, problems)
        assert all("NUL" in p for p in problems), (url, problems)
    assert_error(client.post("/v1/batches/b%00/ack", headers={"Authorization": ""}), 401, "unauthorized")
    assert statements == []


def test_the_nul_check_takes_no_worker_thread(client: TestClient) -> None:
    """The check of every request for a NUL (about 1 us) was a plain function, which FastAPI sends to its thread pool:
    some 80 us more on every request, OTLP exports included, each waiting for a free thread while the pool is busy."""
    sent: list[Callable[..., Any]] = []
    hop = fastapi_dependencies.run_in_threadpool

    async def recorded(func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        sent.append(func)
        return await hop(func, *args, **kwargs)

    with patch.object(fastapi_dependencies, "run_in_threadpool", recorded):
        body = to_request(rollout_group({"a": 1.0, "b": 0.0})).SerializeToString()
        assert client.post("/v1/traces", content=body, headers=PB).status_code == 200
        assert_error(client.get("/v1/trajectories?task=%00"), 400, "invalid_request")
    assert sent and _refuse_nul not in sent, sent  # the pool ran other dependencies (the key check), not this one


def test_a_value_the_store_cannot_hold_is_a_bad_request_without_the_sql(client: TestClient) -> None:
    """A value no check refused that the database cannot hold (the driver's DataError): 400 with the driver's reason,
    not the statement. Its message no longer looks for a parameter holding a NUL: `_refuse_nul` keeps those from the
    store."""
    refused = DataError("SELECT trajectories.id FROM trajectories", {}, ValueError("value out of range"))
    with patch.object(SqlStore, "trajectories", side_effect=refused):
        message = assert_error(client.get("/v1/trajectories?task=t"), 400, "invalid_request")["message"]
    assert message == "the store cannot hold a value of this request (value out of range)"


# --- the real OpenTelemetry SDK against the app served by uvicorn ---------------------------


class _RecordEncodings:
    """ASGI middleware that records the Content-Encoding of every request."""

    def __init__(self, app: FastAPI) -> None:
        self.app, self.seen = app, []

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001
        if scope["type"] == "http":
            self.seen.append(dict(scope["headers"]).get(b"content-encoding", b"").decode())
        await self.app(scope, receive, send)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[str, _RecordEncodings]]:
    """The collector app on a free localhost port, in a background thread."""
    app = _RecordEncodings(collector_app(tmp_path, api_key="k"))
    with served_app(app, lifespan="off") as url:
        yield url, app


def _run_rollout(tracer, rollout_id: str, group: str, reward: float, completion: list[int]) -> None:
    attrs = {sc.SPAN_KIND: sc.SPAN_KIND_ROLLOUT, sc.ROLLOUT_ID: rollout_id, sc.GROUP: group, sc.GROUP_SIZE: 2,
             sc.TASK: "sum"}
    with tracer.start_as_current_span("rollout", attributes=attrs) as root:
        for turn, prompt in enumerate(([5, 6], [5, 6, *completion, 7])):
            llm_attrs = {
                sc.SPAN_KIND: sc.SPAN_KIND_LLM, sc.ROLLOUT_ID: rollout_id, sc.POLICY_STEP: 0,
                sc.PROMPT_TOKEN_IDS: prompt, sc.COMPLETION_TOKEN_IDS: completion if turn == 0 else [9],
                sc.COMPLETION_LOGPROBS: [-0.5] * len(completion) if turn == 0 else [-0.25],
            }
            with tracer.start_as_current_span("chat", attributes=llm_attrs):
                pass
        root.add_event(sc.REWARD_EVENT, {sc.REWARD_NAME: "reward", sc.REWARD_VALUE: reward})


def test_real_sdk_export_lease_ack_and_expiry(served: tuple[str, _RecordEncodings]) -> None:
    base, recorder = served
    exporter = OTLPSpanExporter(
        endpoint=f"{base}/v1/traces", compression=Compression.Gzip, headers={"authorization": "Bearer k"}, timeout=10
    )
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    _run_rollout(tracer, "a", "g1", 1.0, [3])
    _run_rollout(tracer, "b", "g1", 0.0, [4])
    _run_rollout(tracer, "c", "g2", 0.5, [3])
    _run_rollout(tracer, "d", "g2", 0.25, [4])
    provider.shutdown()
    assert recorder.seen and set(recorder.seen) == {"gzip"}

    http = httpx.Client(base_url=base, headers={"authorization": "Bearer k"}, timeout=10)
    a = http.get("/v1/trajectories/a").json()
    assert a["complete"] and a["reward"] == 1.0 and a["group_id"] == "g1" and a["token_exact"]
    assert a["sequences"][0]["token_ids"] == [5, 6, 3, 7, 9]
    assert a["sequences"][0]["assistant_mask"] == [0, 0, 1, 0, 1]
    assert a["sequences"][0]["logprobs"] == [None, None, -0.5, None, -0.25]

    first = http.post("/v1/batches", json={"max_groups": 1, "lease_seconds": 60}).json()
    assert [g["id"] for g in first["groups"]] == ["g1"]
    assert http.post(f"/v1/batches/{first['id']}/ack", json={"policy_step": 1}).status_code == 200

    short = http.post("/v1/batches", json={"max_groups": 8, "lease_seconds": 1}).json()  # the shortest lease
    assert [g["id"] for g in short["groups"]] == ["g2"]  # g1 was acked: never again
    time.sleep(1.2)
    again = http.post("/v1/batches", json={"max_groups": 8}).json()
    assert [g["id"] for g in again["groups"]] == ["g2"]  # the expired lease came back
    assert http.post(f"/v1/batches/{short['id']}/ack", json={}).status_code == 409
    assert http.post(f"/v1/batches/{again['id']}/ack", json={}).status_code == 200
    assert http.post("/v1/batches", json={"max_groups": 8}).json()["groups"] == []
    states = {g["id"]: g["state"] for g in http.get("/v1/groups").json()}
    assert states == {"g1": "trained", "g2": "trained"}


def test_an_id_no_client_keeps_in_a_path_is_refused_where_it_enters(served: tuple[str, _RecordEncodings]) -> None:
    """httpx (as browsers and requests) drops a path segment `.` or `..`: a trajectory `.` was stored, yet
    `GET /v1/trajectories/.` answered the list of all, and a group `a/../b` could only be judged as group `b`."""
    base, _ = served
    http = httpx.Client(base_url=base, headers={"authorization": "Bearer k"}, timeout=10)
    assert http.build_request("GET", "/v1/trajectories/.").url.path == "/v1/trajectories"  # why it is refused
    spans = rollout_group({".": 1.0, "x": 0.0}, group="a/../b")
    answer = http.post("/v1/traces", content=to_request(spans).SerializeToString(), headers=PB)
    partial = ExportTraceServiceResponse.FromString(answer.content).partial_success
    assert answer.status_code == 200 and partial.rejected_spans == 3  # the two spans of `.`, the rollout span of x
    assert "attribute art.rollout.id '.' has a path segment '.' or '..'" in partial.error_message
    assert "attribute art.group 'a/../b' has a path segment '.' or '..'" in partial.error_message
    assert_error(http.get("/v1/view/trajectory", params={"id": "."}), 404, "not_found")
    assert http.get("/v1/groups").json() == []  # x, its rollout span refused, is in no group yet
