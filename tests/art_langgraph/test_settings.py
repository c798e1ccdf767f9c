"""The plugin's settings (`art_langgraph/_settings.py`): a set `ART_*` variable that no component reads is logged, the
OTLP headers variables are read once and a value no request can carry refused, and a forked child reads its own."""

from __future__ import annotations

import logging
import os

import pytest
from pydantic import ValidationError

from art_langgraph import _settings
from art_langgraph._settings import Settings, get_settings, update_settings
from tests.art_langgraph.forking import run_child_of_held_lock


def test_a_variable_no_setting_reads_is_logged_once(monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """pydantic-settings ignores `ART_MODLE`: the agent asked for the default model, and nothing said so. The app's
    environment is not the plugin's to refuse, so it warns, once however often the settings are read again; the
    services' variables, set where the app runs too, are no mistake."""
    monkeypatch.setattr(_settings, "_settings", None)
    monkeypatch.setattr(_settings, "_checked", set(), raising=False)  # no variable seen yet
    monkeypatch.setenv("ART_MODLE", "agent@3")
    monkeypatch.setenv("ART_COLLECTOR_JUDGE_ATTEMPTS", "5")
    monkeypatch.setenv("ART_TRAINER_LORA_R", "16")
    with caplog.at_level(logging.WARNING, logger=_settings.__name__):
        assert get_settings().model == "agent@latest"
        update_settings(model="agent@2")
        update_settings()
    assert [record.getMessage() for record in caplog.records] == [
        "art_langgraph: ART_MODLE (did you mean ART_MODEL?) is set, but no setting reads it: rename or unset it (the "
        "README lists every ART_* variable)"]


def test_a_variable_no_setting_reads_is_logged_in_lower_case_too(monkeypatch: pytest.MonkeyPatch,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """pydantic-settings reads `art_trace_graphs` as `ART_TRACE_GRAPHS`, so `art_modle` was as much a misspelling as
    `ART_MODLE`, yet only upper-case names were checked: it left the default model in force without a word."""
    monkeypatch.setattr(_settings, "_settings", None)
    monkeypatch.setattr(_settings, "_checked", set(), raising=False)
    monkeypatch.setenv("art_modle", "agent@3")
    monkeypatch.setenv("art_trace_graphs", "false")
    monkeypatch.setenv("art_collector_judge_attempts", "5")
    with caplog.at_level(logging.WARNING, logger=_settings.__name__):
        settings = get_settings()
    assert (settings.model, settings.trace_graphs) == ("agent@latest", False)
    assert [record.getMessage() for record in caplog.records] == [
        "art_langgraph: art_modle (did you mean ART_MODEL?) is set, but no setting reads it: rename or unset it (the "
        "README lists every ART_* variable)"]


@pytest.fixture
def no_collector_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """Neither `ART_API_KEY` nor an OTLP headers variable set."""
    for name in ("ART_API_KEY", "OTEL_EXPORTER_OTLP_TRACES_HEADERS", "OTEL_EXPORTER_OTLP_HEADERS"):
        monkeypatch.delenv(name, raising=False)


def test_the_otlp_headers_are_read_once_per_settings(
    no_collector_key: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """`collector_authorization` parsed `OTEL_EXPORTER_OTLP_HEADERS` again at each read (each late reward), and
    OpenTelemetry's parser logged a malformed pair each time. The settings read it once, when they are made."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-tenant=acme,not a pair")
    with caplog.at_level(logging.WARNING, logger="opentelemetry.util.re"):
        settings = Settings()
        for _ in range(3):
            assert settings.collector_authorization is None
    (logged,) = [record.getMessage() for record in caplog.records]
    assert logged.startswith("Header format invalid!") and logged.endswith(": not a pair")
    assert settings.collector_headers == {"x-tenant": "acme"}  # the pairs around it


@pytest.mark.parametrize("value", ["%E2%82%AC", "a%0Ab", "a%01b", "a%7Fb"], ids=["euro", "line-break", "ctl", "del"])
def test_an_otlp_header_value_no_request_can_carry_is_refused_without_showing_it(
    no_collector_key: None, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    """A value past U+00FF (not Latin-1) or with a line break, which requests refuses to send, or with another control
    character, which uvicorn refuses to read (400): every span export failed, one log line per batch, and late
    rewards, which now send these headers too, could send none. Refused at once, naming the variable and the header but
    not the value (often a secret); `ART_API_KEY`'s `Authorization`, sent in its place, leaves it unused."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", f"x-tenant=acme,authorization=Bearer%20{value}")
    with pytest.raises(ValidationError) as raised:
        Settings()
    message = str(raised.value)
    assert "OTEL_EXPORTER_OTLP_HEADERS gives the header 'authorization' a value no HTTP request can carry" in message
    assert "Bearer" not in message
    monkeypatch.setenv("ART_API_KEY", "key")
    assert Settings().collector_headers == {"x-tenant": "acme", "authorization": "Bearer key"}


@pytest.mark.parametrize("name", ["caf%C3%A9", "x%20tenant", "x%3Atenant"], ids=["not-ascii", "space", "colon"])
def test_an_otlp_header_name_no_request_can_carry_is_refused_naming_it(
    no_collector_key: None, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """A name the parser URL-decodes into no HTTP token passed: one not ASCII failed every span export and raised
    `UnicodeEncodeError` out of each late reward (documented to raise `httpx.HTTPError`), one with a space or colon
    was sent for the collector to refuse. Refused at once, as a value no request can carry is, naming it."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", f"x-ok=1,{name}=secret-value")
    with pytest.raises(ValidationError) as raised:
        Settings()
    message = str(raised.value)
    assert "OTEL_EXPORTER_OTLP_HEADERS names a header" in message and "secret-value" not in message


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_child_forked_while_another_thread_reads_the_settings_can_read_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """A thread of the parent held the lock the settings are read under (`get_settings`, `configure`) when the process
    forked: the child inherited it held, with no thread to release it, and hung at its first span or model call."""
    monkeypatch.setenv("ART_MODEL", "agent@child")
    out = run_child_of_held_lock("from art_langgraph import _settings", "_settings._lock", """
        assert _settings.get_settings().model == "agent@child"
        """)
    assert out.returncode == 0, out.stderr
