"""What the exception that ended a rollout's, node's or tool's work says about its span: error or not."""

from __future__ import annotations

import asyncio

from opentelemetry.trace import Span, Status, StatusCode

from art_langgraph import semconv


def mark_ended_by(span: Span, exc: BaseException | None) -> None:
    """Record on `span` the exception its work ended with (None: it finished); the span is not ended here.

    A `GeneratorExit` is a consumer that stopped reading (it broke out of a graph's `stream()` or
    closed a generator): nothing to record. An `asyncio.CancelledError` is a task cancelled from
    outside (the app left `astream()` while the node ran, or a timeout): an `art.cancelled` event,
    not an error. Any other exception is recorded and marks the span ERROR.
    """
    if exc is None or isinstance(exc, GeneratorExit):
        return
    if isinstance(exc, asyncio.CancelledError):
        span.add_event(semconv.CANCELLED_EVENT, {"exception.type": type(exc).__name__})
        return
    span.record_exception(exc)
    span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
