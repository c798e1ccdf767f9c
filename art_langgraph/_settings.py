"""Plugin settings, read from the environment (prefix `ART_`) and overridable by `configure`.

The standard `OTEL_EXPORTER_OTLP_*` variables are read by the OTLP exporter itself; this module
only uses `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` and `OTEL_EXPORTER_OTLP_ENDPOINT` as fallbacks for
the collector's base URL (where late rewards go: `collector_base_url`), reads them and their headers variables once per
settings object (`collector_headers`, which late rewards send too; their `Authorization` is a fallback for the key),
as the span exporter configured from that object reads them once, and refuses an
endpoint, timeout or header value among them with which every export would fail. A set `ART_*` variable that no
component reads (a misspelling) is logged once with the closest names (`collector.env_names`): the app's environment
is not the plugin's to refuse.
"""

from __future__ import annotations

import logging
import math
import os
import re
import sys
from urllib.parse import urlsplit

from opentelemetry.util.re import parse_env_headers
from pydantic import Field, PrivateAttr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from art_langgraph._counts import ProcessLock
from collector.auth import configured_key
from collector.env_names import PREFIX, settings_env_names, under_prefix, unknown_env_problem

__all__ = ["Settings", "get_settings", "update_settings"]

DEFAULT_COLLECTOR_URL = "http://localhost:4318"
DEFAULT_TRAINER_URL = "http://localhost:8000/v1"
DEFAULT_MODEL = "agent@latest"
TRACES_PATH = "/v1/traces"
"""Path of the OTLP/HTTP traces endpoint under the collector's base URL."""
ENDPOINT_ENV = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
"""Where the OTLP exporter sends spans when `ART_COLLECTOR_URL` is unset: the first of these that is set."""
HEADERS_ENV = ("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "OTEL_EXPORTER_OTLP_HEADERS")
"""The OTLP exporter's extra headers (`name=value` pairs, URL-encoded, comma-separated): the first of these that is
set."""
_HEADER_VALUE = re.compile(r"[\t\x20-\x7e\x80-\xff]*")
"""A header value HTTP can carry, as the span exporter's requests sends it (Latin-1) and late rewards do too: no
control character but a tab, no character past U+00FF."""
_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
"""A header name HTTP can carry (RFC 9110's token): the parser URL-decodes names too (`caf%C3%A9`, `x%20y`)."""
TIMEOUT_ENV = ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT")
"""The OTLP exporter's budget for a request and its retries, in seconds: the first of these that is set."""
MAX_EXPORT_TIMEOUT_SECONDS = 7 * 24 * 3600
"""Longest OTLP exporter timeout taken: a week. Past about 9.2e9 s the exporter cannot compute a request's deadline
(`timestamp out of range for platform time_t`), and every export failed."""
SCHEDULE_DELAY_ENV = "OTEL_BSP_SCHEDULE_DELAY"
"""Milliseconds the OpenTelemetry SDK's batch processors, the plugin's too, wait between exports: an integer (the SDK
logs other text and takes 5000)."""
MAX_OTLP_REQUEST_BYTES = 64 * 1024 * 1024
"""The OTLP/HTTP exporter's own limit (OpenTelemetry 1.45): it drops a larger request unsent, whatever the receiver
takes, so `max_export_bytes` may not pass it."""


class Settings(BaseSettings):
    """Where the plugin sends traces and model calls.

    Each field is read from the environment variable `ART_<FIELD>` (e.g. `ART_COLLECTOR_URL`).
    """

    model_config = SettingsConfigDict(env_prefix="ART_", extra="ignore", allow_inf_nan=False, hide_input_in_errors=True)
    _collector_headers: dict[str, str] = PrivateAttr(default_factory=dict)
    """`collector_headers`, read when the settings are made."""
    _collector_base_url: str = PrivateAttr(default=DEFAULT_COLLECTOR_URL)
    """`collector_base_url`, read when the settings are made."""

    collector_url: str | None = Field(
        default=None,
        description=(
            "Base URL of the collector; spans go to `{collector_url}/v1/traces`, rewards to "
            "`{collector_url}/v1/rewards`. When unset, the OTLP exporter's own variables "
            f"(`OTEL_EXPORTER_OTLP_*`) decide, and {DEFAULT_COLLECTOR_URL} otherwise."
        ),
    )
    trainer_url: str = Field(
        default=DEFAULT_TRAINER_URL,
        description="OpenAI-compatible base URL of the trainer service (ends in `/v1`).",
    )
    model: str = Field(
        default=DEFAULT_MODEL,
        description="Model name sent to the trainer (`name@latest`, `name@step` or the base name).",
    )
    api_key: str | None = Field(
        default=None,
        description=(
            "Bearer token for the trainer (as the OpenAI api key) and the collector; surrounding whitespace is "
            "dropped and a blank key counts as unset, as both services read `ART_API_KEY`."
        ),
    )
    langfuse: bool = Field(
        default=False,
        description="Also export every span to Langfuse's OTLP endpoint (see `configure(langfuse=True)`).",
    )
    max_queue_size: int = Field(
        default=2048,
        ge=1,
        le=sys.maxsize,
        description=(
            "Spans held per destination while waiting for export; past it, new spans are dropped and counted. At most "
            "`sys.maxsize`, the longest queue Python makes (a larger one failed the first span with `OverflowError`)."
        ),
    )
    max_export_bytes: int = Field(
        default=8 * 1024 * 1024,
        ge=64 * 1024,
        le=MAX_OTLP_REQUEST_BYTES,
        description=(
            "Largest OTLP request the exporters send, in bytes before compression: a batch past it goes out in "
            "several requests. Keep it under the collector's `ART_COLLECTOR_MAX_BODY_BYTES` (20 MiB), which "
            "refuses a larger body (413, not retried)."
        ),
    )
    exit_flush_timeout: float = Field(
        default=5.0,
        ge=0,
        description="Seconds the exit hook waits to export the spans still queued when the program ends.",
    )
    trace_graphs: bool = Field(
        default=True,
        description=(
            "Record graph node and tool spans, and make each top-level graph run outside "
            "`rollout(...)` one trajectory (`ART_TRACE_GRAPHS=false` turns this off)."
        ),
    )

    @field_validator("collector_url", "trainer_url")
    @classmethod
    def _http_url(cls, url: str | None) -> str | None:
        """Refuse a URL that is not http(s), such as `localhost:4318` without its scheme, or names no host (`http://`):
        every request would fail (each span was dropped)."""
        if url and (problem := _url_problem(url)):
            raise ValueError(problem)
        return url

    @model_validator(mode="after")
    def _usable_otlp_variables(self) -> Settings:
        """Refuse the OTLP exporter's endpoint without its scheme (`localhost:4318`: no request could be made), a
        timeout that is no positive number (0 or less failed every request at once) or is past a week, and a batch
        delay (`OTEL_BSP_SCHEDULE_DELAY`) of 0 or less (the SDK's `ValueError` failed the app's first span) or past a
        week (past about 9.2e12 ms its export thread died: spans waited for a flush, and the queue filled), and a header
        value no request can carry (`_collector_headers`); the headers and the collector's base URL are read here,
        once."""
        if self.collector_url is None and (endpoint := _first_set(ENDPOINT_ENV)):
            name, url = endpoint
            if problem := _url_problem(url):
                raise ValueError(f"{name} {problem}")
        if timeout := _first_set(TIMEOUT_ENV):
            name, value = timeout
            if not _positive_number(value):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
            if float(value) > MAX_EXPORT_TIMEOUT_SECONDS:
                raise ValueError(f"{name} must be at most a week ({MAX_EXPORT_TIMEOUT_SECONDS} s), got {value!r}")
        if (delay := _env_int(SCHEDULE_DELAY_ENV)) is not None and not 0 < delay <= MAX_EXPORT_TIMEOUT_SECONDS * 1000:
            raise ValueError(f"{SCHEDULE_DELAY_ENV} must be from 1 to a week ({MAX_EXPORT_TIMEOUT_SECONDS * 1000}) "
                             f"milliseconds, got {os.environ[SCHEDULE_DELAY_ENV]!r}")
        self._collector_headers = _collector_headers(self.api_key)
        self._collector_base_url = _collector_base_url(self.collector_url)
        return self

    @field_validator("api_key")
    @classmethod
    def _bare_key(cls, key: str | None) -> object:
        """The key as both services read theirs (`configured_key`): one with surrounding whitespace made an illegal
        `Authorization` header, and one that is not ASCII a header httpx refuses (every export failed)."""
        return configured_key(key)

    @property
    def collector_base_url(self) -> str:
        """The collector's base URL, without a trailing slash and without `/v1/traces`: where late rewards go.

        The first of `ART_COLLECTOR_URL`, `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` (the traces URL
        itself, so `/v1/traces` is taken off), `OTEL_EXPORTER_OTLP_ENDPOINT`: where the spans go.
        Read once, when these settings were made, as `collector_headers` is and as the span exporter
        (built from them by `configure`) reads its endpoint: a variable changed later counts from the
        next `configure`, for spans and rewards alike. Read at each reward, it sent rewards to another
        collector than the spans, with the headers (a key) read for the first.
        """
        return self._collector_base_url

    @property
    def collector_headers(self) -> dict[str, str]:
        """The headers the collector gets, with spans and late rewards alike (names in lower case): those of the first
        of `HEADERS_ENV` set, as the OTLP exporter reads them, with `authorization` `Bearer <api_key>` when the key is
        set. Read once, when these settings were made: the exporter's parser logs a malformed pair (which it leaves
        out) each time it reads one."""
        return dict(self._collector_headers)

    @property
    def collector_authorization(self) -> str | None:
        """The `Authorization` header the collector gets, with spans and late rewards alike: `Bearer <api_key>`, else
        the `Authorization` of the first of `HEADERS_ENV` set (`collector_headers`); None when neither sets one."""
        return self._collector_headers.get("authorization") or None


def _url_problem(url: str) -> str | None:
    """Why no request could go to `url`: it is not http(s) (`localhost:4318`) or names no host (`http://`,
    `http://:4318`); None when it is usable.

    Raises:
        ValueError: `url` cannot be split (`http://[::1`: an unclosed IPv6 address).
    """
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        return f"must be an http:// or https:// URL, got {url!r}"
    return None if parts.hostname else f"must be an http:// or https:// URL with a host, got {url!r}"


def _collector_base_url(collector_url: str | None) -> str:
    """`Settings.collector_base_url` for `collector_url` (`ART_COLLECTOR_URL`), from the environment as it is now."""
    traces = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").rstrip("/").removesuffix(TRACES_PATH)
    url = collector_url or traces or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or DEFAULT_COLLECTOR_URL
    return url.rstrip("/")


def _collector_headers(api_key: str | None) -> dict[str, str]:
    """The headers of the first of `HEADERS_ENV` set, read with the OTLP exporter's own parser (URL-encoded or not; it
    logs and leaves out a malformed pair), with `authorization` `Bearer <api_key>` when `api_key` is set, as the
    exporter sends our header in place of theirs.

    Raises:
        ValueError: A name that is no HTTP token (not ASCII, a space or a colon in it), or a value (not shown: it may
            be a secret) with a control character but a tab, or a character past U+00FF: the span exporter could send
            no request with it, and late rewards none either.
    """
    name, text = _first_set(HEADERS_ENV) or ("", "")
    headers = dict(parse_env_headers(text, liberal=True))
    if api_key:
        headers["authorization"] = f"Bearer {api_key}"
    if bad := next((header for header in headers if not _HEADER_NAME.fullmatch(header)), None):
        raise ValueError(f"{name} names a header {bad!r} that no HTTP request can carry (a header name is ASCII "
                         "letters, digits and !#$%&'*+-.^_`|~ only): every export would fail")
    if bad := next((header for header, value in headers.items() if not _HEADER_VALUE.fullmatch(value)), None):
        raise ValueError(
            f"{name} gives the header {bad!r} a value no HTTP request can carry (a control character other than a "
            "tab, or a character past U+00FF): every export would fail"
        )
    return headers


def _first_set(names: tuple[str, ...]) -> tuple[str, str] | None:
    """The first of the environment variables `names` set to a non-empty value, with its value."""
    return next(((name, value) for name in names if (value := os.environ.get(name))), None)


def _env_int(name: str) -> int | None:
    """The environment variable `name` read as the SDK reads it, with `int`; None when unset or no integer (which the
    SDK logs, taking its default)."""
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return None


def _positive_number(value: str) -> bool:
    try:
        number = float(value)
    except ValueError:
        return False
    return math.isfinite(number) and number > 0


_logger = logging.getLogger(__name__)
_lock = ProcessLock()
"""Held while the settings are built and made current; a forked child gets a new one (`_counts`)."""
_settings: Settings | None = None
_checked: set[str] = set()
"""The `ART_*` variables `_warn_unknown_variables` has seen: an unknown one is logged once per process."""


def _warn_unknown_variables() -> None:
    """Log each newly set `ART_*` variable (in any case, as pydantic-settings reads them) that no component reads, with
    the closest known names. The plugin's own variables are left out first, so an app that sets only those never
    loads the services' settings modules."""
    own = {var.name for var in settings_env_names(Settings)}
    new = {name: value for name, value in os.environ.items()
           if under_prefix(name, PREFIX) and name.upper() not in own and name not in _checked}
    _checked.update(new)
    if problem := unknown_env_problem(new):
        _logger.warning("art_langgraph: %s", problem)


def get_settings() -> Settings:
    """Return the current settings, reading the environment on first use."""
    global _settings
    with _lock:
        if _settings is None:
            _settings = Settings()
            _warn_unknown_variables()
        return _settings


def update_settings(**overrides: str | bool | int | None) -> Settings:
    """Re-read the environment, apply the non-`None` overrides and make the result current.

    Args:
        **overrides: Field values (`collector_url`, `trainer_url`, `model`, `api_key`, ...).

    Returns:
        The new current settings.
    """
    global _settings
    values = {k: v for k, v in overrides.items() if v is not None}
    new = Settings(**values)  # type: ignore[arg-type]
    with _lock:
        _settings = new
        _warn_unknown_variables()
    return new
