"""Export settings the plugin refuses at once, with one line that names the variable: values with which every export
would fail (spans dropped, one log line per batch) instead of a mistake seen when the plugin starts."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from art_langgraph._settings import Settings


@pytest.mark.parametrize("name", ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"])
def test_otlp_endpoint_without_its_scheme_is_refused(monkeypatch, name: str) -> None:
    """`localhost:4318` was taken: the exporter found no connection adapter for it and dropped every span."""
    for var in ("ART_COLLECTOR_URL", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(name, "localhost:4318")
    with pytest.raises(ValidationError, match=f"{name} must be an http:// or https:// URL, got 'localhost:4318'"):
        Settings()
    monkeypatch.setenv("ART_COLLECTOR_URL", "http://localhost:4318")  # which the plugin uses instead
    assert Settings().collector_base_url == "http://localhost:4318"


_NOT_POSITIVE = "must be a positive number of seconds"  # 0 or less failed every request at once, unretried; `ten`
# was replaced by 10 s with a warning
_PAST_A_WEEK = "must be at most a week \\(604800 s\\)"  # past about 9.2e9 s the exporter could not compute a
# request's deadline: every export failed, every span lost


@pytest.mark.parametrize(("value", "says"), [
    *((value, _NOT_POSITIVE) for value in ("0", "-5", "nan", "inf", "ten")),
    *((value, _PAST_A_WEEK) for value in ("604801", "1e10", "1e300")),
])
@pytest.mark.parametrize("name", ["OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT"])
def test_an_otlp_timeout_out_of_range_is_refused(monkeypatch, name: str, value: str, says: str) -> None:
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TIMEOUT", raising=False)
    monkeypatch.setenv(name, value)
    with pytest.raises(ValidationError, match=f"{name} {says}, got '{value}'"):
        Settings()
    for bound in ("2.5", "604800"):
        monkeypatch.setenv(name, bound)
        assert Settings()
