"""Settings of the collector service (`CollectorSettings`).

Every field is read from the environment variable `ART_COLLECTOR_<FIELD>` (for example
`ART_COLLECTOR_PORT`), except `api_key`, which is the shared `ART_API_KEY`. The flags of
`art-collector serve` override the environment. No field is named `url`: `ART_COLLECTOR_URL`
belongs to the plugin (the collector's address as seen by the agent).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx
from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError

from collector.auth import configured_key, refuse_key_name
from collector.groups import TrainingReward

__all__ = [
    "CollectorSettings", "art_home", "check_http_url", "default_db_url", "hide_password",
    "settings_error", "validation_problem",
]


_UNREAD_PASSWORD = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*://[^:/?#@]*:).*@", re.DOTALL)
"""The password of a URL no parser reads (a bad port, say): from the first `:` of its user info to its last `@`."""


def hide_password(value: str) -> str:
    """`value` with its password shown as `***` when it parses as a URL that has one (`--db
    postgresql+psycopg://u:***@h/db`); any other string as it is. An http(s) URL is read as httpx, which sends it,
    reads it: a raw `@` in its password belongs to the password (SQLAlchemy ends it there, and showed the rest). A URL
    neither reads (`https://u:p@h:80a/v1`) is refused where it is given, in a line that names it: its password goes
    as far as its last `@` (`_UNREAD_PASSWORD`)."""
    if value.lower().startswith(("http://", "https://")):
        try:
            http = httpx.URL(value)
        except httpx.InvalidURL:
            return _UNREAD_PASSWORD.sub(r"\1***@", value, count=1)
        return str(http.copy_with(username=http.username, password="***")) if http.password else value
    try:
        url = make_url(value)
    except (ArgumentError, ValueError):  # not a URL (a path, a number), or one it cannot read
        return _UNREAD_PASSWORD.sub(r"\1***@", value, count=1)
    return url.render_as_string(hide_password=True) if url.password else value


def check_http_url(value: str, example: str) -> str:
    """`value` when it is an http(s) URL with a host (`example` shows one in the error): a service address that is
    not fails every call to it, later and over and over (or, one httpx cannot parse, with a traceback).

    Raises:
        ValueError: not a URL, or one without `http://`/`https://` or a host.
    """
    try:
        url = httpx.URL(value)
    except httpx.InvalidURL as exc:
        raise ValueError(f"not a URL ({exc}); write e.g. {example}") from exc
    if url.scheme not in ("http", "https") or not url.host:
        raise ValueError(f"needs http:// or https:// and a host, e.g. {example}")
    return value


def validation_problem(error: Mapping[str, Any]) -> str:
    """One pydantic error as `where: message` (`body.max_groups: ...`), or the message alone for the object itself; a
    request body that is no JSON as the decoder's reason and where (FastAPI's `("body", offset)`: `body.29: JSON decode
    error` said neither)."""
    if error["type"] == "json_invalid" and len(error["loc"]) == 2 and error.get("ctx"):
        return f"the body is not valid JSON: {error['ctx']['error']} at character {error['loc'][1]}"
    where = ".".join(str(part) for part in error["loc"])
    return f"{where}: {error['msg']}" if where else error["msg"]


def settings_error(exc: ValidationError) -> str:
    """A settings validation error as a command line reports it: each problem on one line, the setting and its value
    first (`port='abc': ...`; a URL's password hidden, a key's value left out: `ART_API_KEY: ...`), without pydantic's
    type codes and links."""
    problems = []
    for error in exc.errors():
        where = ".".join(str(part) for part in error["loc"])
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] == "dict_type" and isinstance(error["input"], str):  # text a JSON decode did not take
            message += ": the text is not JSON; give a JSON object, e.g. '{\"name\": 1}'"
        value = hide_password(error["input"]) if isinstance(error["input"], str) else error["input"]
        if where.lower().endswith("_key"):  # api_key, ART_COLLECTOR_JUDGE_API_KEY, secret_key: `errors()` keeps it
            problems.append(f"{where}: {message}")
        else:
            problems.append(f"{where}={value!r}: {message}" if where else message)
    return "\n".join(problems)


def art_home() -> Path:
    """The data folder: `$ART_HOME`, or `~/.cache/art-langgraph` when unset."""
    value = os.environ.get("ART_HOME")
    return Path(value).expanduser() if value else Path.home() / ".cache" / "art-langgraph"


def default_db_url() -> str:
    """SQLite file `collector.db` in the data folder (see `art_home`)."""
    return f"sqlite:///{art_home() / 'collector.db'}"


class CollectorSettings(BaseSettings):
    """Where the collector listens, where it stores, and how it forms training groups."""

    model_config = SettingsConfigDict(
        env_prefix="ART_COLLECTOR_", extra="forbid", populate_by_name=True, allow_inf_nan=False,
        hide_input_in_errors=True,
    )

    host: str = Field(default="127.0.0.1", description="Interface the HTTP API listens on.")
    port: int = Field(
        default=4318, ge=1, le=65535, description="Port of the HTTP API (4318 is the standard OTLP/HTTP port)."
    )
    db: str = Field(
        default_factory=default_db_url,
        description=(
            "SQLAlchemy database URL. Default: `sqlite:///$ART_HOME/collector.db` "
            "(ART_HOME defaults to ~/.cache/art-langgraph)."
        ),
    )
    min_group_size: int = Field(
        default=2,
        ge=1,
        description="Trajectories a group needs before it trains, when its spans carry no `art.group.size`.",
    )
    reward_name: str = Field(default="reward", min_length=1, description="Which named reward trains.")
    reward_weights: dict[str, float] | None = Field(
        default=None,
        description=(
            "Train on a weighted sum of named rewards instead of `reward_name`, e.g. "
            "`{\"correct\": 1, \"short\": 0.5}` (env: JSON). A trajectory is rewarded once it has every name."
        ),
    )
    group_timeout_seconds: float = Field(
        default=86400.0,
        ge=0,
        description=(
            "An open group that is not ready and sees no new span or reward for this long expires, "
            "with the reason it was waiting for (0: never)."
        ),
    )
    keep_zero_spread: bool = Field(
        default=False,
        description="Lease groups whose rewards are all equal (they carry no GRPO signal; skipped by default).",
    )
    max_failed_attempts: int = Field(
        default=3,
        ge=0,
        description=(
            "A group whose training failed this many times (a trainer released its batch as failed, or the lease "
            "expired) is skipped with the last error and never leased again automatically (0: never give up)."
        ),
    )
    idle_seconds: float = Field(
        default=300.0,
        gt=0,
        description="A trajectory without a rollout span counts as complete after this many seconds without new spans.",
    )
    max_body_bytes: int = Field(
        default=20 * 1024 * 1024, ge=1024, description="Largest request body accepted (after gunzip); larger → 413."
    )
    api_key: SecretStr | None = Field(
        default=None,
        validation_alias="ART_API_KEY",
        description="When set, write endpoints need `Authorization: Bearer <key>` (env `ART_API_KEY`); "
        "surrounding whitespace is dropped and a blank key counts as unset, as in the trainer.",
    )

    @field_validator("db")
    @classmethod
    def _database_url(cls, value: str) -> str:
        try:
            make_url(value).get_dialect().import_dbapi()
        except (ArgumentError, NoSuchModuleError, ImportError) as exc:
            raise ValueError(
                f"not a database URL SQLAlchemy can open ({exc}); use sqlite:///FILE or "
                "postgresql+psycopg://USER:PASS@HOST:PORT/DB"
            ) from exc
        return value

    @field_validator("api_key", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: object) -> object:
        return configured_key(value)

    @model_validator(mode="after")
    def _check_key_name(self) -> CollectorSettings:
        refuse_key_name("ART_COLLECTOR_API_KEY")  # read as the key by field name: a second, undocumented name
        return self

    @model_validator(mode="after")
    def _check_reward(self) -> CollectorSettings:
        if self.reward_weights is None:
            return self
        if not self.reward_weights:
            raise ValueError("reward_weights is empty; give at least one name, or unset it to train on reward_name")
        if "" in self.reward_weights:  # weights are finite: NaN and inf are refused as every float setting is
            raise ValueError(f"reward_weights {self.reward_weights} need non-empty names")
        if self.reward_name != "reward":
            raise ValueError(
                f"reward_name={self.reward_name!r} and reward_weights are both set; set one "
                "(ART_COLLECTOR_REWARD_NAME or ART_COLLECTOR_REWARD_WEIGHTS)"
            )
        return self

    @property
    def training_reward(self) -> TrainingReward:
        """The reward that trains: `reward_weights` when set, else `reward_name`."""
        return TrainingReward(self.reward_name, self.reward_weights)
