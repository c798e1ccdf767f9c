"""Helpers of the HTTP API tests (`collector/server.py`): the app on a fresh SQLite file, content types,
and the check of the error envelope."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI

from collector.config import CollectorSettings
from collector.server import create_app

PB = {"content-type": "application/x-protobuf"}
JSON = {"content-type": "application/json"}


def collector_app(tmp_path: Path, **fields: Any) -> FastAPI:
    """The collector's app on a fresh SQLite file (`collector.db` in `tmp_path`); settings fields as keywords."""
    return create_app(CollectorSettings(db=f"sqlite:///{tmp_path / 'collector.db'}", **fields))


def assert_error(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    """Check that `response` is the error envelope with `status` and `code`; returns its body."""
    assert response.status_code == status, response.text
    body = response.json()
    # pytest rewrites the asserts of test modules only: the body is this one's message
    assert set(body) == {"error", "message"} and body["error"] == code and body["message"], body
    return body
