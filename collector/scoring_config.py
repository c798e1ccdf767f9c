"""Settings of the collector's judges: RULER (`JudgeSettings`) and Langfuse (`LangfuseSettings`).

`JudgeSettings` reads `ART_COLLECTOR_JUDGE_<FIELD>`; `LangfuseSettings` reads
`ART_COLLECTOR_LANGFUSE_<FIELD>`, with Langfuse's own `LANGFUSE_BASE_URL` (then its older name
`LANGFUSE_HOST`, as the Langfuse SDK and the plugin read them), `LANGFUSE_PUBLIC_KEY` and
`LANGFUSE_SECRET_KEY` as fallbacks for the connection.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AliasChoices, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from collector.auth import configured_key
from collector.config import check_http_url
from collector.judge_client import MAX_ANSWER_BYTES
from collector.protocol import Name

__all__ = ["DEFAULT_RUBRIC", "MAX_TIMEOUT_SECONDS", "JudgeSettings", "LangfuseSettings"]

_SCORE_SOURCES = ("ANNOTATION", "API", "EVAL")
"""The sources of a Langfuse score (its API's `ScoreSource`): a person in the UI, the API or SDK, an evaluator."""

DEFAULT_RUBRIC = """\
- A trajectory that reaches the user's goal scores higher than one that does not.
- Among trajectories that reach the goal, shorter, clearer and more correct ones score higher.
- A trajectory with a wrong answer, an error, or an unfinished task scores low, even if it sounds confident.
- Partial progress earns partial credit: 0 is useless or harmful, 1 is as good as it gets.
- Compare the trajectories with each other; give them different scores when they differ in quality."""


def _default_judge_url() -> str:
    """The trainer service's OpenAI API: `ART_TRAINER_URL`, else `http://localhost:8000/v1`."""
    return os.environ.get("ART_TRAINER_URL", "http://localhost:8000/v1")


_MAX_LOOKBACK_HOURS = 24 * 365 * 100
"""100 years. Far longer ones reach back past year 1, which no `datetime` holds: every sync would fail."""


def _split_names(value: object) -> object:
    if isinstance(value, str):
        return [name.strip() for name in value.split(",") if name.strip()]
    return value


MAX_TIMEOUT_SECONDS = 7 * 24 * 3600.0
"""Longest HTTP timeout of one judge or Langfuse call: a week. Past about 9.2e9 s httpx cannot compute the call's
deadline, and every call raised `OverflowError`."""


class JudgeSettings(BaseSettings):
    """The RULER judge: which endpoint and model, which rubric, when it runs, what failures do."""

    model_config = SettingsConfigDict(
        env_prefix="ART_COLLECTOR_JUDGE_", extra="forbid", populate_by_name=True, allow_inf_nan=False,
        hide_input_in_errors=True,
    )

    url: str = Field(
        default_factory=_default_judge_url,
        description="Base URL of any OpenAI-compatible API (ending in /v1). "
        "Default: `ART_TRAINER_URL` or http://localhost:8000/v1.",
    )
    model: Name = Field(
        default="SmolLM2-135M-Instruct",
        description="Judge model name (default: the trainer's base model; 1 to 256 characters, no NUL).",
    )
    api_key: SecretStr | None = Field(
        default=None,
        validation_alias=AliasChoices("ART_COLLECTOR_JUDGE_API_KEY", "ART_API_KEY"),
        description="Bearer key of the judge endpoint; falls back to `ART_API_KEY` (the trainer's key).",
    )
    rubric: str = Field(
        default=DEFAULT_RUBRIC, min_length=1, description="What makes a trajectory good (the default is generic)."
    )
    rubric_file: Path | None = Field(default=None, description="Read the rubric from this file (overrides `rubric`).")
    reward_name: Name = Field(
        default="ruler", description="Name of the reward the judge writes (1 to 256 characters, no NUL)."
    )
    auto: bool = Field(
        default=False, description="Judge every group as soon as it is complete (all members ended, size reached)."
    )
    poll_seconds: float = Field(
        default=5.0, gt=0, description="How often the automatic judge looks for complete groups."
    )
    on_failure: Literal["retry", "skip", "zero"] = Field(
        default="retry",
        description=(
            "`retry`: up to `attempts` tries, then the group shows `failed` and is tried again after `retry_seconds` "
            "(a request the judge rejects with 400, 413 or 422 is not sent again: `failed` until the group grows); "
            "`skip`: one try, then the group stays unjudged (`skipped`); "
            "`zero`: one try, then every trajectory scores 0."
        ),
    )
    attempts: int = Field(default=3, ge=1, le=20, description="Tries per run under the `retry` policy.")
    retry_seconds: float = Field(
        default=60.0, gt=0, description="Wait before the automatic judge retries a `failed` group."
    )
    temperature: float = Field(default=0.0, ge=0, le=2, description="Sampling temperature of the judge.")
    max_tokens: int = Field(default=1024, ge=16, description="Most tokens the judge may answer with.")
    explanation_max_chars: int = Field(
        default=300,
        ge=0,
        description=(
            "`maxLength` of each explanation in the JSON schema (0: none), lowered per group so that the whole answer "
            "fits in `max_tokens` (OpenAI ignores it)."
        ),
    )
    timeout_seconds: float = Field(
        default=300.0, gt=0, le=MAX_TIMEOUT_SECONDS,
        description="Seconds one judge call may take whole, from its connection to the end of its answer's body (a "
        "status line, headers or body still coming then fail the try); at most a week.",
    )
    max_answer_bytes: int = Field(
        default=MAX_ANSWER_BYTES,
        ge=1024,
        description="Most bytes a judge's answer (its HTTP body, uncompressed as asked) may take; a longer or "
        "compressed one fails the try unread.",
    )

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        return check_http_url(value, "http://localhost:8000/v1")

    @field_validator("api_key", mode="before")
    @classmethod
    def _bare_key(cls, value: object) -> object:
        """The key as the services read `ART_API_KEY` (`configured_key`): with surrounding whitespace it made an
        illegal `Authorization` header (every judge call failed), blank it was sent as `Bearer `, and one that is not
        ASCII stopped the app with an error from inside httpx."""
        try:
            return configured_key(value)
        except ValueError as exc:
            raise ValueError(f"the judge's key (ART_COLLECTOR_JUDGE_API_KEY, else ART_API_KEY): {exc}") from exc

    @model_validator(mode="after")
    def _load_rubric(self) -> JudgeSettings:
        if self.rubric_file is None and not self.rubric.strip():
            raise ValueError("rubric is blank; write one in ART_COLLECTOR_JUDGE_RUBRIC or unset it for the default")
        if self.rubric_file is not None:
            try:
                text = self.rubric_file.expanduser().read_text().strip()
            except OSError as exc:
                raise ValueError(
                    f"rubric_file {self.rubric_file}: {exc}; point ART_COLLECTOR_JUDGE_RUBRIC_FILE at a text file"
                ) from exc
            if not text:
                raise ValueError(f"rubric_file {self.rubric_file} is empty; write the rubric in it or unset it")
            self.rubric = text
        return self


class LangfuseSettings(BaseSettings):
    """The Langfuse sync: pull human scores as rewards, push computed rewards as scores."""

    model_config = SettingsConfigDict(
        env_prefix="ART_COLLECTOR_LANGFUSE_", extra="forbid", populate_by_name=True, allow_inf_nan=False,
        hide_input_in_errors=True,
    )

    host: str | None = Field(
        default=None,
        validation_alias=AliasChoices("ART_COLLECTOR_LANGFUSE_HOST", "LANGFUSE_BASE_URL", "LANGFUSE_HOST"),
        description="Langfuse base URL, e.g. https://cloud.langfuse.com. Unset: no sync.",
    )
    public_key: str | None = Field(
        default=None, validation_alias=AliasChoices("ART_COLLECTOR_LANGFUSE_PUBLIC_KEY", "LANGFUSE_PUBLIC_KEY")
    )
    secret_key: SecretStr | None = Field(
        default=None, validation_alias=AliasChoices("ART_COLLECTOR_LANGFUSE_SECRET_KEY", "LANGFUSE_SECRET_KEY")
    )
    score_names: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Comma-separated score names to pull (empty: every name)."
    )
    sources: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["ANNOTATION"],
        description="Comma-separated score sources to pull (human scores: ANNOTATION).",
    )
    push_names: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Comma-separated reward names to push to Langfuse as scores (empty: no push)."
    )
    sync_seconds: float = Field(default=60.0, gt=0, description="Interval of the scheduled sync.")
    lookback_hours: float = Field(
        default=168.0,
        gt=0,
        le=_MAX_LOOKBACK_HOURS,
        description="Pull scores whose timestamp is at most this old (at most 100 years: further back is no date).",
    )
    timeout_seconds: float = Field(
        default=30.0, gt=0, le=MAX_TIMEOUT_SECONDS,
        description="How long one call of Langfuse's API waits for Langfuse, its retries included; at most a week.",
    )

    @field_validator("host")
    @classmethod
    def _check_host(cls, value: str | None) -> str | None:
        return value if value is None else check_http_url(value, "https://cloud.langfuse.com")

    @field_validator("sources")
    @classmethod
    def _check_sources(cls, value: list[str]) -> list[str]:
        """Langfuse's score sources, upper-cased as it names them; another name pulled nothing, silently."""
        sources = [source.upper() for source in value]
        if unknown := [name for name, source in zip(value, sources, strict=True) if source not in _SCORE_SOURCES]:
            raise ValueError(f"unknown score source {', '.join(unknown)}: Langfuse's are {', '.join(_SCORE_SOURCES)}")
        return sources

    @model_validator(mode="before")
    @classmethod
    def _lists(cls, data: object) -> object:
        if isinstance(data, dict):
            for key in ("score_names", "sources", "push_names"):
                if key in data:
                    data[key] = _split_names(data[key])
        return data

    @model_validator(mode="after")
    def _keys_with_host(self) -> LangfuseSettings:
        if self.host and not (self.public_key and self.secret_key):
            raise ValueError(
                "Langfuse host is set but its keys are not: set ART_COLLECTOR_LANGFUSE_PUBLIC_KEY and "
                "ART_COLLECTOR_LANGFUSE_SECRET_KEY (or LANGFUSE_PUBLIC_KEY / LANGFUSE_SECRET_KEY)"
            )
        return self

    @property
    def enabled(self) -> bool:
        """True when a host (and its keys) are configured."""
        return bool(self.host)
