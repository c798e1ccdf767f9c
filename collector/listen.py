"""The listening socket of a service (the collector's, the trainer's): bound when the command starts, listening once
the service is ready, and handed to uvicorn, so that no connection's local end takes the port meanwhile."""

from __future__ import annotations

import contextlib
import logging
import socket
import sys

import uvicorn
from uvicorn.main import STARTUP_FAILURE

__all__ = ["AnnouncedServer", "bind_address", "serve_on", "start_listening"]

log = logging.getLogger("uvicorn.error")  # where uvicorn says where it serves


def bind_address(host: str, port: int, fix: str) -> socket.socket:
    """Bind `host:port` as uvicorn would (`SO_REUSEADDR`; an IPv6 address serves IPv6 alone, as asyncio binds it; a
    host name, its IPv4 address), without listening yet: a port another process holds, or a host that names no
    interface of this machine, stops the start at once rather than after minutes of it (the trainer's vLLM and model
    load). Bound, the port cannot go meanwhile to a connection's local end, nor to a server that binds without
    `SO_REUSEADDR` (one with it can: `start_listening` then says so): an outgoing connection from that port (the
    trainer asks vLLM whether it is up, many times) had made uvicorn's bind fail once the start was done. Until
    `start_listening`, a client is refused, as before.

    Raises:
        ValueError: names the address, the reason and `fix` (the flags and variables to change).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((host, port))
    except OSError as exc:  # in use, no permission, an unknown host name (socket.gaierror)
        sock.close()
        raise ValueError(f"host={host!r} port={port}: cannot listen there ({exc.strerror or exc}); {fix}") from exc
    return sock


def start_listening(sock: socket.socket, fix: str) -> None:
    """Listen on `sock` (from `bind_address`), once the service is ready to serve.

    Raises:
        ValueError: another program's server took the port meanwhile (one that binds with `SO_REUSEADDR`, as uvicorn
            and Python's `socket.create_server` do, may bind beside a socket that does not listen yet), naming the
            address and `fix`.
    """
    try:
        sock.listen()
    except OSError as exc:
        host, port = sock.getsockname()[:2]
        raise ValueError(f"host={host!r} port={port}: another program took the port while the service started "
                         f"({exc.strerror or exc}); {fix}") from exc


class AnnouncedServer(uvicorn.Server):
    """uvicorn's server, which says where it serves once started on the socket it was given, as it does on one it
    binds itself ("Uvicorn running on ...")."""

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if sockets and not self.should_exit:
            host, port = sockets[0].getsockname()[:2]
            address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            log.info("Uvicorn running on %s://%s (Press CTRL+C to quit)", "https" if self.config.ssl else "http",
                     address)


def serve_on(server: uvicorn.Server, sock: socket.socket) -> None:
    """Run `server` on `sock` (listening: `start_listening`) until SIGINT or SIGTERM, as `uvicorn.run` does on its own
    socket.

    Raises:
        SystemExit: uvicorn's status 3 when the server did not start.
    """
    with sock, contextlib.suppress(KeyboardInterrupt):  # the Ctrl-C uvicorn raises again once it has shut down
        server.run(sockets=[sock])
    if not server.started:
        sys.exit(STARTUP_FAILURE)
