"""An ASGI app served by a real uvicorn on a free localhost port, for tests that need real HTTP."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Literal

import uvicorn

from examples.stack import free_port


@contextmanager
def served(app: Callable, *, lifespan: Literal["auto", "on", "off"] = "auto") -> Iterator[str]:
    """Serve `app` in uvicorn on a background thread; yield its base URL, then stop it."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan=lifespan))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
