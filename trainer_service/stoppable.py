"""Waiting for a call that may never return, given up once the engine (or the service) is stopping.

A request to a vLLM that accepts but no longer answers holds whoever waits for it (the engine's lock, for
`VLLMEngine.stop`; a step's hot-load, for `TrainerService.aclose`) until its timeout; `wait_unless_stopping` runs it
aside and stops waiting when told to, at once or after a grace.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, wait
from typing import TypeVar

__all__ = ["wait_unless_stopping"]

_Result = TypeVar("_Result")

_STOP_CHECK = 0.1
"""Seconds between two looks at `stopping` while a call runs."""


def wait_unless_stopping(call: Callable[[], _Result], stopping: threading.Event, name: str,
                         grace: float = 0.0) -> Future[_Result]:
    """Run `call` in a daemon thread named `name`, waited for in `_STOP_CHECK` slices; return its future once it is
    done (its result, or the error it raised), or not done once `stopping` is set and `grace` more seconds passed:
    the call is then left to end on its own (vLLM, being stopped, drops its connection)."""
    answer: Future[_Result] = Future()
    threading.Thread(target=_run, args=(answer, call), name=name, daemon=True).start()
    while not answer.done() and not stopping.is_set():
        wait([answer], timeout=_STOP_CHECK)
    wait([answer], timeout=grace)  # returns at once when done, or without a grace
    return answer


def _run(answer: Future[_Result], call: Callable[[], _Result]) -> None:
    """Run `call` (in its own thread); its result, or the error it raised, goes to `answer`."""
    try:
        answer.set_result(call())
    except Exception as exc:  # handed over: the caller of `wait_unless_stopping` gets it from `answer.result()`
        answer.set_exception(exc)
