"""The `Authorization` the collector gets: spans and late rewards send the same one (`Settings.collector_authorization`:
`ART_API_KEY`, else the one of `OTEL_EXPORTER_OTLP_[TRACES_]HEADERS`), and nothing else replaces it, neither a netrc
entry for the collector's host nor a user and password in its URL; proxies from the environment still carry both. The
other headers of those variables (a gateway's) go with both too (`Settings.collector_headers`).

Against the real collector app with `ART_API_KEY` set, over real HTTP."""

from __future__ import annotations

import base64
import logging
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import httpx
import pytest

import art_langgraph
from art_langgraph import rollout
from tests.art_langgraph.conftest import Send
from tests.art_langgraph.otlp_receiver import LocalServer
from tests.collector.seeding import group_spans, make_app
from tests.served import served

KEY = "collector-key"
_AUTH_ENV = ("ART_API_KEY", "OTEL_EXPORTER_OTLP_HEADERS", "OTEL_EXPORTER_OTLP_TRACES_HEADERS", "NETRC")


class _Recording:
    """An ASGI app in front of `app` that records each POST's path, `Authorization` and the status it was answered,
    and its headers as received (`headers`)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.posts: list[tuple[str, str, int]] = []
        self.headers: list[dict[bytes, bytes]] = []

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        self.headers.append(dict(scope["headers"]))
        authorization = dict(scope["headers"]).get(b"authorization", b"").decode()

        async def recording(message: dict) -> None:
            if message["type"] == "http.response.start":
                self.posts.append((scope["path"], authorization, message["status"]))
            await send(message)

        await self.app(scope, receive, recording)


@pytest.fixture
def keyed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, memory_tracing) -> Iterator[tuple[str, _Recording]]:
    """The real collector app with `ART_API_KEY` set (every write needs `Bearer collector-key`), holding rollout
    `sums-0`, served with its POSTs recorded: (URL, recording). The plugin's own key variables are unset."""
    for name in _AUTH_ENV:
        monkeypatch.delenv(name, raising=False)
    app = make_app(tmp_path, monkeypatch, api_key=KEY)
    app.state.store.add_spans(group_spans("sums", ["7", "8"], rewards=[1.0, 0.0]))
    recording = _Recording(app)
    try:
        with served(recording, lifespan="off") as url:
            yield url, recording
    finally:
        memory_tracing.install()


async def _span_and_late_reward(url: str, send: Send) -> None:
    """Export a rollout's spans, then post a late reward to `sums-0`; check the reward was stored."""
    with rollout("auth"):
        pass
    assert art_langgraph.flush(timeout=10)
    await send(0.5, rollout_id="sums-0", name="judge")
    rewards = httpx.get(f"{url}/v1/trajectories/sums-0").raise_for_status().json()["rewards"]
    assert rewards == {"reward": 1.0, "judge": 0.5}


async def _span_and_late_reward_under(
    variables: dict[str, str], url: str, send: Send, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`_span_and_late_reward` with the environment `variables` set and the plugin configured for `url`."""
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    art_langgraph.configure(collector_url=url)
    await _span_and_late_reward(url, send)


_BOTH_WITH_KEY = [("/v1/traces", f"Bearer {KEY}", 200), ("/v1/rewards", f"Bearer {KEY}", 200)]


@pytest.mark.parametrize(
    "variables",
    [
        {"OTEL_EXPORTER_OTLP_HEADERS": f"Authorization=Bearer%20{KEY}"},
        {
            "OTEL_EXPORTER_OTLP_HEADERS": "Authorization=Bearer%20other",
            "OTEL_EXPORTER_OTLP_TRACES_HEADERS": f"x-tenant=a,authorization=Bearer {KEY}",
        },
    ],
    ids=["otlp-headers", "traces-headers-first"],
)
@pytest.mark.asyncio(loop_scope="session")
async def test_a_key_in_the_otlp_headers_variables_authorizes_late_rewards_as_it_does_spans(
    keyed: tuple[str, _Recording], send: Send, monkeypatch: pytest.MonkeyPatch, variables: dict[str, str]
) -> None:
    """Without `ART_API_KEY`, the span exporter sends the `Authorization` of `OTEL_EXPORTER_OTLP_TRACES_HEADERS`, else
    `OTEL_EXPORTER_OTLP_HEADERS` (URL-encoded or not, as OpenTelemetry reads them); late rewards sent none, and the
    collector that took the spans refused them (401). Both now send the same one."""
    url, recording = keyed
    await _span_and_late_reward_under(variables, url, send, monkeypatch)
    assert recording.posts == _BOTH_WITH_KEY


@pytest.mark.parametrize(
    ("variables", "tenant"),
    [
        ({"OTEL_EXPORTER_OTLP_HEADERS": f"X-Tenant=acme,Authorization=Bearer%20{KEY}"}, b"acme"),
        (
            {
                "OTEL_EXPORTER_OTLP_HEADERS": "x-tenant=other",
                "OTEL_EXPORTER_OTLP_TRACES_HEADERS": f"x-tenant=acme,authorization=Bearer {KEY}",
            },
            b"acme",
        ),
        ({"ART_API_KEY": KEY, "OTEL_EXPORTER_OTLP_HEADERS": "x-tenant=acme,Authorization=Bearer%20other"}, b"acme"),
        ({"OTEL_EXPORTER_OTLP_HEADERS": f"x-tenant=caf%C3%A9,Authorization=Bearer%20{KEY}"}, "café".encode("latin-1")),
    ],
    ids=["otlp-headers", "traces-headers-first", "api-key-first", "latin-1"],
)
@pytest.mark.asyncio(loop_scope="session")
async def test_late_rewards_send_the_other_headers_of_the_otlp_headers_variables_as_spans_do(
    keyed: tuple[str, _Recording],
    send: Send,
    monkeypatch: pytest.MonkeyPatch,
    variables: dict[str, str],
    tenant: bytes,
) -> None:
    """A gateway in front of the collector that needs a header of its own (a tenant), set where OpenTelemetry takes
    it (`OTEL_EXPORTER_OTLP_TRACES_HEADERS`, else `OTEL_EXPORTER_OTLP_HEADERS`): spans carried it and passed, late
    rewards sent only the `Authorization` and were refused. Late rewards now send every header of the variable in use,
    as the span exporter does (a Latin-1 value as the same bytes), with `ART_API_KEY`'s `Authorization` in place of
    the variable's."""
    url, recording = keyed
    await _span_and_late_reward_under(variables, url, send, monkeypatch)
    assert recording.posts == _BOTH_WITH_KEY
    assert [headers.get(b"x-tenant") for headers in recording.headers] == [tenant, tenant]


@pytest.mark.asyncio(loop_scope="session")
async def test_a_malformed_pair_in_the_otlp_headers_is_not_logged_again_at_each_late_reward(
    keyed: tuple[str, _Recording], send: Send, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Each late reward read `OTEL_EXPORTER_OTLP_HEADERS` again, and OpenTelemetry's parser logged its `Header format
    invalid!` warning for a malformed pair each time. The settings read it once (`configure`); late rewards log
    nothing of it, and send the pairs around it."""
    url, recording = keyed
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", f"x-tenant=acme,not a pair,Authorization=Bearer%20{KEY}")
    art_langgraph.configure(collector_url=url)  # where the settings and the span exporter each log it
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="opentelemetry.util.re"):
        for _ in range(3):
            await send(0.5, rollout_id="sums-0", name="judge")
    assert caplog.records == []
    assert recording.posts == [("/v1/rewards", f"Bearer {KEY}", 200)] * 3
    assert [headers.get(b"x-tenant") for headers in recording.headers] == [b"acme"] * 3


def _netrc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, host: str) -> None:
    """A netrc file (`$NETRC`) giving `host` a login and password."""
    (tmp_path / "netrc").write_text(f"machine {host} login netrc-user password netrc-password\n")
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))


@pytest.mark.parametrize("basic", ["netrc", "url"])
@pytest.mark.parametrize("key_from", ["api_key", "otlp-headers"])
@pytest.mark.asyncio(loop_scope="session")
async def test_a_netrc_entry_or_the_urls_password_never_replaces_the_configured_key(
    keyed: tuple[str, _Recording],
    send: Send,
    receivers,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    basic: str,
    key_from: str,
) -> None:
    """requests (the span exporter's client) put a netrc entry for the collector's host, or the URL's user and
    password, in place of the configured key's `Authorization` (Basic auth: the collector refused every span, 401);
    httpx (late rewards') the URL's too. The configured key is now what both send; Langfuse's own Basic auth stays
    its own too."""
    url, recording = keyed
    _, langfuse = receivers
    if basic == "netrc":  # for Langfuse's host too: both are 127.0.0.1
        _netrc(tmp_path, monkeypatch, "127.0.0.1")
    else:
        url = url.replace("http://", "http://url-user:url-password@")
    if key_from == "otlp-headers":
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", f"Authorization=Bearer%20{KEY}")
    for name, value in {
        "LANGFUSE_PUBLIC_KEY": "pk",
        "LANGFUSE_SECRET_KEY": "sk",
        "LANGFUSE_BASE_URL": langfuse.url,
    }.items():
        monkeypatch.setenv(name, value)
    art_langgraph.configure(collector_url=url, api_key=KEY if key_from == "api_key" else None, langfuse=True)
    await _span_and_late_reward(url, send)
    assert recording.posts == _BOTH_WITH_KEY
    assert {h["authorization"] for _, h, _ in langfuse.requests} == {f"Basic {base64.b64encode(b'pk:sk').decode()}"}


@pytest.mark.asyncio(loop_scope="session")
async def test_without_a_key_a_late_reward_sends_the_urls_user_and_password_and_names_neither(
    keyed: tuple[str, _Recording], send: Send, caplog: pytest.LogCaptureFixture
) -> None:
    """With no key configured, a user and password in `ART_COLLECTOR_URL` (a proxy's Basic auth) are what a late
    reward sends, as Basic auth; the URL its retries, its error and httpx's own `HTTP Request` line name goes without
    them (that INFO line showed the password whole)."""
    url, recording = keyed
    art_langgraph.configure(collector_url=url.replace("http://", "http://url-user:url-password@"))
    with caplog.at_level(logging.INFO, logger="httpx"), pytest.raises(httpx.HTTPStatusError, match="401") as raised:
        await send(0.5, rollout_id="sums-0", name="judge")
    basic = f"Basic {base64.b64encode(b'url-user:url-password').decode()}"
    assert recording.posts == [("/v1/rewards", basic, 401)]
    assert f"to POST {url}/v1/rewards" in str(raised.value)
    assert "HTTP Request: POST" in caplog.text and "url-password" not in caplog.text + str(raised.value)


class _Proxy(LocalServer):
    """A stand-in HTTP proxy: records each POST's target (an absolute URL, as a client sends a proxy) and
    `Authorization`, and answers 200 with an empty JSON object."""

    def __init__(self) -> None:
        self.posts: list[tuple[str, str | None]] = []
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                self.rfile.read(int(self.headers["Content-Length"]))
                proxy.posts.append((self.path, self.headers.get("Authorization")))
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args: object) -> None:
                pass

        self._serve(Handler)


@pytest.mark.asyncio(loop_scope="session")
async def test_a_proxy_from_the_environment_still_carries_spans_and_late_rewards_with_the_key(
    memory_tracing, send: Send, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What keeps netrc out must not keep the environment's proxy out (requests' `trust_env = False` would do both):
    with `HTTP_PROXY` set and a netrc entry for the collector's host, spans and late rewards go through the proxy,
    each with the configured key."""
    for name in (*_AUTH_ENV, "NO_PROXY", "no_proxy", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    collector = "http://collector.invalid:4318"
    _netrc(tmp_path, monkeypatch, "collector.invalid")
    proxy = _Proxy()
    monkeypatch.setenv("HTTP_PROXY", proxy.url)
    try:
        art_langgraph.configure(collector_url=collector, api_key=KEY)
        with rollout("proxied"):
            pass
        assert art_langgraph.flush(timeout=10)
        await send(0.5, rollout_id="proxied", name="judge")
    finally:
        proxy.close()
        memory_tracing.install()
    assert proxy.posts == [(f"{collector}/v1/traces", f"Bearer {KEY}"), (f"{collector}/v1/rewards", f"Bearer {KEY}")]
