"""Errors the collector answers with: each has an HTTP status, a code and a hint."""

from __future__ import annotations

__all__ = ["CollectorError", "Conflict", "InvalidRequest", "NotFound"]


class CollectorError(Exception):
    """Base of errors that map to the `ErrorResponse` envelope."""

    status: int = 500
    code: str = "internal_error"

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code


class InvalidRequest(CollectorError):
    """The request is malformed (400)."""

    status = 400
    code = "invalid_request"


class NotFound(CollectorError):
    """The named object does not exist (404)."""

    status = 404
    code = "not_found"


class Conflict(CollectorError):
    """The request conflicts with the current state (409)."""

    status = 409
    code = "conflict"
