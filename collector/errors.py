"""Errors the collector answers with: each has an HTTP status, a code and a hint."""

from __future__ import annotations

__all__ = ["CollectorError", "Conflict", "InvalidRequest", "NotFound", "SpanIdsTaken"]


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


class SpanIdsTaken(InvalidRequest):
    """Spans whose id the store holds, or an export sent earlier, for another trace: OpenTelemetry span ids are unique
    within a trace only, and the store keys spans by span id alone. Nothing was stored; `problems` says, per such span
    (span id, trace id), why."""

    def __init__(self, problems: dict[tuple[str, str], str]) -> None:
        (span_id, _), problem = next(iter(problems.items()))
        super().__init__(f"{len(problems)} spans refused, the first: span {span_id}: {problem}", code="invalid_span")
        self.problems = problems


class NotFound(CollectorError):
    """The named object does not exist (404)."""

    status = 404
    code = "not_found"


class Conflict(CollectorError):
    """The request conflicts with the current state (409)."""

    status = 409
    code = "conflict"
