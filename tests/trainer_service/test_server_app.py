"""The trainer's HTTP app (`server.create_app`) in process, over `make_service`'s fake engine and mock collector.

The API key, the error envelope, the model list and the pause, resume and SFT endpoints; the service's logic
behind them is `test_service`'s, the real service behind its proxy `test_server`'s.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from collector.listen import bind_address
from collector.protocol import Batch
from examples.stack import free_port
from tests.trainer_service.builders import group, make_service


def test_api_key_guards_every_endpoint(tmp_path: Path) -> None:
    """The routes are read from the app itself (its OpenAPI pages too), so a new one without the key fails here."""
    from fastapi.testclient import TestClient
    from starlette.routing import Route

    from trainer_service.server import create_app

    service = make_service(tmp_path, [], [])
    service.settings.api_key = "sekret"
    app = create_app(service=service)
    routes = [(method, route.path) for route in app.routes if isinstance(route, Route)
              for method in sorted(route.methods or ()) if method != "HEAD"]
    assert {("POST", "/v1/chat/completions"), ("POST", "/v1/train"), ("GET", "/docs"), ("GET", "/health")} <= set(
        routes) and all("{" not in path for _, path in routes), routes
    with TestClient(app) as client:
        for method, path in [*routes, ("GET", "/v1/unknown")]:
            for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic sekret"}):
                response = client.request(method, path, headers=headers)
                assert response.status_code == 401, (method, path, headers)
                assert response.json()["error"]["code"] == "invalid_api_key"
            if path != "/v1/unknown":
                answered = client.request(method, path, headers={"Authorization": "Bearer sekret"})
                assert answered.status_code != 401, (method, path)
        authorized = client.get("/v1/models", headers={"Authorization": "Bearer sekret"})
        assert authorized.status_code == 200
        assert [m["id"] for m in authorized.json()["data"]] == ["base-model", "agent@latest"]


def test_unexpected_errors_are_500_training_failed_in_the_error_envelope(tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from trainer_service.server import create_app

    batches: list[Batch] = []
    service = make_service(tmp_path, batches, [])
    assert service.trainer is not None
    batches.append(Batch(id="b1", groups=[group(service.trainer, (1.0, 0.0))], lease_expires_at=0))

    def bug(*args: Any) -> Any:  # an error no handler expects
        raise KeyError("a bug")

    service._train_and_publish = bug  # type: ignore[method-assign]
    with TestClient(create_app(service=service)) as client:
        response = client.post("/v1/train")
        assert response.status_code == 500
        error = response.json()["error"]
        assert error["code"] == "training_failed" and error["type"] == "server_error"
        assert "KeyError" in error["message"] and "a bug" in error["message"]
        assert client.get("/v1/status").json()["last_error"] == error["message"]


def test_models_lists_only_names_that_resolve(tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from trainer_service.server import create_app

    batches: list[Batch] = []
    service = make_service(tmp_path, batches, [])
    assert service.trainer is not None
    with TestClient(create_app(service=service)) as client:
        for index in (1, 2):
            batches.append(Batch(id=f"b{index}", groups=[group(service.trainer, (1.0, 0.0))], lease_expires_at=0))
            assert client.post("/v1/train").status_code == 200
        service.engine.adapters.pop("agent@1")  # an adapter vLLM no longer has
        response = client.get("/v1/models")
        assert response.status_code == 200, response.text
        assert [m["id"] for m in response.json()["data"]] == ["base-model", "agent@2", "agent@latest"]
        assert client.get("/v1/status").json()["counters"]["unresolved_models"] == 1
        service.engine.pending_adapters = ["agent@2"]  # being re-loaded after a restart of vLLM: not lost
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["base-model"]
        # agent@1 is missed again; agent@2 and agent@latest, re-loading, were counted (and logged as lost) too
        assert client.get("/v1/status").json()["counters"]["unresolved_models"] == 2


def test_api_key_scheme_is_case_insensitive_and_the_key_compared_in_constant_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import hmac

    from fastapi.testclient import TestClient

    from trainer_service.server import create_app

    compared: list[tuple[bytes, bytes]] = []
    constant_time = hmac.compare_digest

    def compare_digest(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return constant_time(a, b)

    monkeypatch.setattr(hmac, "compare_digest", compare_digest)
    service = make_service(tmp_path, [], [])
    service.settings.api_key = "sekret"
    with TestClient(create_app(service=service)) as client:
        for header in ("Bearer sekret", "bearer sekret", "BEARER sekret"):  # RFC 7235: the scheme has no case
            assert client.get("/health", headers={"Authorization": header}).status_code == 200, header
        for header in ("Bearer wrong", "Bearer Sekret", "Basic sekret", "Bearersekret", "sekret"):
            assert client.get("/health", headers={"Authorization": header}).status_code == 401, header
    assert (b"wrong", b"sekret") in compared and (b"sekret", b"sekret") in compared


@pytest.mark.parametrize(("key", "needed"), [("  ", None), ("\n", None), (" sekret\n", "sekret")])
def test_a_blank_key_is_none_and_a_padded_one_matches_the_header_that_carries_it(
        tmp_path: Path, key: str, needed: str | None) -> None:
    """HTTP drops a header value's surrounding whitespace (the plugin's `Bearer  sekret` arrives as that), so such a
    key could never match, and a blank one would lock every route: as the collector does, they are read stripped."""
    from fastapi.testclient import TestClient

    from trainer_service.server import create_app

    service = make_service(tmp_path, [], [], api_key=key)
    assert service.settings.api_key == needed
    with TestClient(create_app(service=service)) as client:
        assert client.get("/v1/models", headers={"Authorization": f"Bearer {key}".strip()}).status_code == 200
        assert client.get("/v1/models").status_code == (401 if needed else 200)


def test_an_unexpected_error_is_answered_in_the_envelope(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """A route's unexpected exception was Starlette's plain-text 500, outside OpenAI's error envelope."""
    from fastapi.testclient import TestClient

    from trainer_service.server import create_app

    service = make_service(tmp_path, [], [])

    async def broken() -> None:
        raise KeyError("step")

    monkeypatch.setattr(service, "status", broken)
    with TestClient(create_app(service=service), raise_server_exceptions=False) as client:
        answer = client.get("/v1/status")
    assert answer.status_code == 500
    assert answer.json()["error"] == {"message": "KeyError: 'step'", "type": "server_error", "param": None,
                                      "code": "internal_error"}
    assert any("unhandled error on GET /v1/status" in r.getMessage() and r.exc_info for r in caplog.records)


def test_a_key_that_is_not_ascii_is_refused_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """No HTTP client sends it (httpx refuses, Starlette reads headers as Latin-1): every route would be 401."""
    from pydantic import ValidationError

    from trainer_service.config import TrainerSettings

    monkeypatch.setenv("ART_API_KEY", "clé")
    with pytest.raises(ValidationError, match="ART_API_KEY must be ASCII"):
        TrainerSettings()


def test_pause_resume_and_sft_endpoints(tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from trainer_service.server import create_app

    acks: list[tuple[str, dict]] = []
    batches: list[Batch] = []
    service = make_service(tmp_path, batches, acks)
    assert service.trainer is not None
    batches.append(Batch(id="b1", groups=[group(service.trainer, (1.0, 0.0))], lease_expires_at=0))
    with TestClient(create_app(service=service)) as client:
        assert client.post("/v1/pause").json() == {"paused": True}
        paused = client.post("/v1/train")
        assert paused.status_code == 409 and paused.json()["error"]["code"] == "paused"
        status = client.get("/v1/status").json()
        assert status["schedule"]["paused"] is True and status["queue_depth"] == 1
        assert client.post("/v1/resume").json() == {"paused": False}
        sft = client.post("/v1/sft")
        assert sft.status_code == 200, sft.text
        body = sft.json()
        assert body["kind"] == "sft" and body["model"] == "agent@1" and body["latest_model"] == "agent@1"
        assert "loss/sft" in body["metrics"] and acks == [("b1", {"policy_step": 1})]
        status = client.get("/v1/status").json()
        assert status["step"] == 1 and status["queue_depth"] == 0 and status["checkpoints"] == [1]


def test_control_routes_refuse_a_body_with_parameters_and_take_none_or_an_empty_object(tmp_path: Path) -> None:
    """`{"min_groups": 9}` to `/v1/train` was accepted and ignored; now every control route refuses any body but
    none or `{}` (what the repo's clients send) with a 400 that names the flags, and does nothing; the key comes
    first."""
    from fastapi.testclient import TestClient

    from trainer_service.server import create_app

    acks: list[tuple[str, dict]] = []
    batches: list[Batch] = []
    service = make_service(tmp_path, batches, acks)
    assert service.trainer is not None
    batches.append(Batch(id="b1", groups=[group(service.trainer, (1.0, 0.0))], lease_expires_at=0))
    with TestClient(create_app(service=service)) as client:
        for path in ("/v1/train", "/v1/sft", "/v1/pause", "/v1/resume"):
            for body in (b'{"min_groups": 9}', b'{"steps": 3}', b"not json", b"[]", b"null", b"{}{}"):
                refused = client.post(path, content=body, headers={"Content-Type": "application/json"})
                assert refused.status_code == 400, (path, body, refused.text)
                error = refused.json()["error"]
                assert error["code"] == "unexpected_body" and error["type"] == "invalid_request_error"
                assert f"POST {path} takes no parameters" in error["message"] and "--min-groups" in error["message"]
        status = client.get("/v1/status").json()
        assert status["schedule"]["paused"] is False and status["step"] == 0 and len(batches) == 1 and acks == []
        assert client.post("/v1/pause", json={}).json() == {"paused": True}
        assert client.post("/v1/resume", content=b" { }\n").json() == {"paused": False}
        trained = client.post("/v1/train", json={})
        assert trained.status_code == 200 and trained.json()["model"] == "agent@1", trained.text
        assert client.post("/v1/sft").json()["error"]["code"] == "no_batch_ready"
        service.settings.api_key = "sekret"
        keyless = client.post("/v1/train", content=b'{"steps": 3}')
        assert keyless.status_code == 401 and keyless.json()["error"]["code"] == "invalid_api_key"


def test_control_routes_refuse_parameters_in_the_query_string_too(tmp_path: Path) -> None:
    """`POST /v1/train?min_groups=9` trained on the one ready group and `POST /v1/pause?paused=false` paused: the
    query string was ignored. It is refused as a body with fields is, and nothing runs."""
    from fastapi.testclient import TestClient

    from trainer_service.server import create_app

    acks: list[tuple[str, dict]] = []
    batches: list[Batch] = []
    service = make_service(tmp_path, batches, acks)
    assert service.trainer is not None
    batches.append(Batch(id="b1", groups=[group(service.trainer, (1.0, 0.0))], lease_expires_at=0))
    with TestClient(create_app(service=service)) as client:
        for path in ("/v1/train", "/v1/sft", "/v1/pause", "/v1/resume"):
            for query in ("min_groups=9", "paused=false", "x"):
                refused = client.post(f"{path}?{query}")
                assert refused.status_code == 400, (path, query, refused.text)
                error = refused.json()["error"]
                assert error["code"] == "unexpected_body" and f"POST {path} takes no parameters" in error["message"]
        status = client.get("/v1/status").json()
        assert status["schedule"]["paused"] is False and status["step"] == 0 and len(batches) == 1 and acks == []
        assert client.post("/v1/train?").status_code == 200  # an empty query string is no parameter


def test_a_control_route_refuses_a_long_body_without_reading_it_all() -> None:
    """A control route read a body of any length whole before refusing it (memory on the service); it reads no more
    than it could take, and refuses the rest unread."""
    import asyncio

    from starlette.requests import Request

    from trainer_service.protocol import ServiceError
    from trainer_service.server import _takes_no_parameters

    sent: list[int] = []

    async def receive() -> dict[str, Any]:
        sent.append(1)
        return {"type": "http.request", "body": b" " * 1024, "more_body": len(sent) < 10_000}

    scope = {"type": "http", "method": "POST", "path": "/v1/train", "query_string": b"", "headers": []}
    with pytest.raises(ServiceError) as refused:
        asyncio.run(_takes_no_parameters(Request(scope, receive)))
    assert refused.value.status == 400 and refused.value.body.error.code == "unexpected_body"
    assert len(sent) < 10


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity", "1e400"])
def test_a_body_with_a_number_json_has_not_is_400_invalid_json(tmp_path: Path, number: str) -> None:
    """Python's `json` reads these; sent on to vLLM they failed to encode (a 500 outside the envelope)."""
    from fastapi.testclient import TestClient

    from trainer_service.server import create_app

    service = make_service(tmp_path, [], [])
    with TestClient(create_app(service=service), raise_server_exceptions=False) as client:
        response = client.post("/v1/chat/completions", content=f'{{"model": "base-model", "temperature": {number}}}',
                               headers={"Content-Type": "application/json"})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["code"] == "invalid_json"


@pytest.mark.parametrize(("body", "param", "says"), [
    (b'{"model": "base-model", "messages": ' + b"[" * 5000 + b"]" * 5000 + b"}", None, "nested too deeply"),
    (b"[" * 100_000, None, "nested too deeply"),
    (b'{"model": "agent@\\ud800", "messages": []}', "model", "surrogates not allowed"),
    (b'{"model": "base-model", "messages": "\\udc80"}', None, "lone UTF-16 surrogate"),
])
def test_deep_nesting_and_lone_surrogates_are_400_invalid_json(
        tmp_path: Path, body: bytes, param: str | None, says: str) -> None:
    """Nesting past Python's recursion limit, and a lone surrogate in the model name (echoed by the 404 of an unknown
    name, which could then not be encoded), were a plain-text 500 outside the envelope."""
    from fastapi.testclient import TestClient

    from trainer_service.server import create_app

    service = make_service(tmp_path, [], [])
    with TestClient(create_app(service=service), raise_server_exceptions=False) as client:
        for route in ("/v1/chat/completions", "/v1/completions"):
            response = client.post(route, content=body, headers={"Content-Type": "application/json"})
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["code"] == "invalid_json" and error["param"] == param and says in error["message"], error


def test_errors_carry_their_headers_and_starlettes_own_use_the_envelope(tmp_path: Path) -> None:
    """A 503 says when to retry (vLLM restarting: nothing listens), a 401 which scheme to use; an unknown route and
    a method a route does not take answer in OpenAI's envelope too, the 405 with `Allow`."""
    from fastapi.testclient import TestClient

    from examples.stack import free_port
    from trainer_service.server import create_app

    service = make_service(tmp_path, [], [])
    service.engine.base_url = f"http://127.0.0.1:{free_port()}"
    with TestClient(create_app(service=service)) as client:
        down = client.post("/v1/chat/completions", json={"model": "base-model", "messages": []})
        assert down.status_code == 503 and down.json()["error"]["code"] == "engine_unavailable"
        assert down.headers["retry-after"] == "10"
        unknown = client.get("/v1/embeddings")
        assert unknown.status_code == 404
        assert unknown.json()["error"] == {"message": "GET /v1/embeddings: Not Found", "type": "not_found_error",
                                           "param": None, "code": "not_found"}
        wrong = client.get("/v1/chat/completions")
        assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
        assert wrong.json()["error"]["code"] == "method_not_allowed"
        service.settings.api_key = "sekret"
        refused = client.get("/v1/models")
        assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"


def test_sigterm_stops_the_schedule_while_uvicorn_waits_for_open_requests(tmp_path: Path) -> None:
    """uvicorn waits for every open request before the app's lifespan ends, and the schedule stopped only there: an
    `--every` job kept firing (and could start a step) all the while. `serve` now begins the service's shutdown as its
    own begins: the schedule stops, no step starts (and a running one's hot-load vLLM does not answer is given up)."""
    from trainer_service.protocol import ServiceError
    from trainer_service.server import create_app, serve

    service = make_service(tmp_path, [], [], every="0.1s")
    app = create_app(service=service)
    release = threading.Event()
    loops: list[asyncio.AbstractEventLoop] = []

    @app.get("/slow")
    async def slow() -> dict[str, bool]:  # an open request: a streamed answer, a manual step
        loops.append(asyncio.get_running_loop())
        await asyncio.to_thread(release.wait)
        return {"done": True}

    port = free_port()
    answers: list[int] = []
    stopped_while_open: list[bool] = []
    refused_while_open: list[BaseException | None] = []

    def client() -> None:
        http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)
        opened = threading.Thread(target=lambda: answers.append(http.get("/slow").status_code))
        try:
            with http:
                until = time.monotonic() + 30
                while service.schedule.counts["no_batch_ready"] < 1 and time.monotonic() < until:
                    time.sleep(0.05)  # serving, and the job has fired
                opened.start()
                time.sleep(0.2)  # the request is open
                os.kill(os.getpid(), signal.SIGTERM)
                until = time.monotonic() + 5
                while service.schedule.next_run() is not None and time.monotonic() < until:
                    time.sleep(0.05)
                fired = sum(service.schedule.counts.values())
                time.sleep(0.5)  # five periods
                stopped_while_open.append(service.schedule.next_run() is None and not answers
                                          and sum(service.schedule.counts.values()) == fired)
                # was 409 `no_batch_ready`: the collector was asked for a batch until the lifespan ended
                manual = asyncio.run_coroutine_threadsafe(service.train_once(), loops[0])
                refused_while_open.append(manual.exception(10))
                release.set()
                opened.join()
        finally:
            release.set()

    previous = signal.signal(signal.SIGTERM, lambda *args: None)  # uvicorn raises it again once shut down
    try:
        driver = threading.Thread(target=client)
        driver.start()
        serve(app, bind_address("127.0.0.1", port, "a free port"), log_level="warning")
        driver.join()
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert stopped_while_open == [True] and answers == [200]
    [refused] = refused_while_open
    assert isinstance(refused, ServiceError) and refused.body.error.code == "shutting_down"
