"""The listening socket of a service (the collector's, the trainer's): bound when the command starts and held until
uvicorn serves on it, so that no other socket takes the port meanwhile."""

from __future__ import annotations

import contextlib
import socket
import sys

import uvicorn
from uvicorn.main import STARTUP_FAILURE

__all__ = ["bind_address", "serve_on"]


def bind_address(host: str, port: int, fix: str) -> socket.socket:
    """Bind `host:port` as uvicorn would (`SO_REUSEADDR`), without listening yet: a port another process holds, or a
    host that names no interface of this machine, stops the start at once rather than after minutes of it (the
    trainer's vLLM and model load). Held bound, the port cannot go meanwhile to another program's socket, nor to a
    connection's local end: an outgoing connection from that port (the trainer asks vLLM whether it is up, many times)
    had made uvicorn's bind fail with "address already in use" once the start was done. Until `serve_on`, a client is
    refused, as before.

    Raises:
        ValueError: names the address, the reason and `fix` (the flags and variables to change).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:  # in use, no permission, an unknown host name (socket.gaierror)
        sock.close()
        raise ValueError(f"host={host!r} port={port}: cannot listen there ({exc.strerror or exc}); {fix}") from exc
    return sock


def serve_on(server: uvicorn.Server, sock: socket.socket) -> None:
    """Run `server` on `sock` (from `bind_address`) until SIGINT or SIGTERM, as `uvicorn.run` does on its own socket.

    Raises:
        SystemExit: uvicorn's status 3 when the server did not start.
    """
    with sock, contextlib.suppress(KeyboardInterrupt):  # the Ctrl-C uvicorn raises again once it has shut down
        server.run(sockets=[sock])
    if not server.started:
        sys.exit(STARTUP_FAILURE)
