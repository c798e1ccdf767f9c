"""Export settings the plugin refuses at once, with one line that names the variable: values with which every export
would fail (spans dropped, one log line per batch) instead of a mistake seen when the plugin starts."""

from __future__ import annotations

import sys

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


def test_a_queue_size_past_what_python_can_make_is_refused(monkeypatch) -> None:
    """`ART_MAX_QUEUE_SIZE` past `sys.maxsize` was taken, and the export queue then failed the app's first span with
    `OverflowError` (a deque holds at most `sys.maxsize`); it is refused with the settings' own error."""
    monkeypatch.setenv("ART_MAX_QUEUE_SIZE", str(sys.maxsize + 1))
    with pytest.raises(ValidationError, match="max_queue_size\n  Input should be less than or equal to"):
        Settings()
    monkeypatch.setenv("ART_MAX_QUEUE_SIZE", str(sys.maxsize))
    assert Settings().max_queue_size == sys.maxsize


@pytest.mark.parametrize("value", ["0", "-1", "604800001", str(10**20)])
def test_a_batch_delay_out_of_range_is_refused(monkeypatch, value: str) -> None:
    """`OTEL_BSP_SCHEDULE_DELAY`, which the SDK's batch processor reads: 0 or less failed the app's first span with the
    SDK's `ValueError` (`schedule_delay_millis must be positive.`, no variable named); past about 9.2e12 ms the export
    thread died at its first wait, and spans waited for a flush until the queue filled and dropped them."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", value)
    with pytest.raises(ValidationError, match=f"OTEL_BSP_SCHEDULE_DELAY must be from 1 to a week \\(604800000\\) "
                                              f"milliseconds, got '{value}'"):
        Settings()
    for taken in ("1", "604800000", "soon"):  # text no integer: the SDK logs it and waits its default 5000 ms
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", taken)
        assert Settings()
