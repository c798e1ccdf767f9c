"""The listening socket a service binds at its start and serves on once it is up (collector/listen.py)."""

from __future__ import annotations

import errno
import logging
import socket
import threading

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from collector.listen import AnnouncedServer, bind_address, serve_on, start_listening


def test_a_bound_address_is_no_other_sockets_until_served() -> None:
    """The start bound the port for a moment only: during the trainer's minutes of start an outgoing connection from
    that port (it asks vLLM many times whether it is up) made uvicorn's bind fail with "address already in use"."""
    with socket.create_server(("127.0.0.1", 0)) as peer, bind_address("127.0.0.1", 0, "fix it") as sock:
        port = sock.getsockname()[1]
        with socket.socket() as client, pytest.raises(OSError) as info:
            client.bind(("127.0.0.1", port))  # the local end of a connection to `peer`
            client.connect(peer.getsockname())
        assert info.value.errno == errno.EADDRINUSE
        with socket.socket() as other, pytest.raises(OSError) as info:
            other.bind(("127.0.0.1", port))  # another program's listener
        assert info.value.errno == errno.EADDRINUSE
        with socket.socket() as client, pytest.raises(ConnectionRefusedError):
            client.connect(("127.0.0.1", port))  # bound, not listening: a client is refused until the service is up


def test_an_address_in_use_is_refused_with_the_fix() -> None:
    with socket.create_server(("127.0.0.1", 0)) as held, pytest.raises(ValueError) as info:
        port = held.getsockname()[1]
        bind_address("127.0.0.1", port, "give another --port")
    assert str(info.value) == f"host='127.0.0.1' port={port}: cannot listen there (Address already in use); " \
                              "give another --port"


def test_serve_on_serves_on_the_bound_socket_and_closes_it() -> None:
    app = FastAPI()
    app.get("/ping")(lambda: {"ok": True})
    sock = bind_address("127.0.0.1", 0, "fix it")
    port = sock.getsockname()[1]
    start_listening(sock, "fix it")
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=serve_on, args=(server, sock))  # uvicorn sets no signal handlers off the main one
    thread.start()
    try:
        for _ in range(500):
            if server.started:
                break
            threading.Event().wait(0.01)
        assert httpx.get(f"http://127.0.0.1:{port}/ping").json() == {"ok": True}
    finally:
        server.should_exit = True
        thread.join(10)
    assert not thread.is_alive() and sock.fileno() == -1


def test_a_server_that_does_not_start_exits_with_uvicorns_status() -> None:
    async def refuse(scope: dict, receive: object, send: object) -> None:  # a lifespan whose startup fails
        message = await receive()  # type: ignore[operator]
        assert message["type"] == "lifespan.startup"
        await send({"type": "lifespan.startup.failed", "message": "no"})  # type: ignore[operator]

    sock = bind_address("127.0.0.1", 0, "fix it")
    server = uvicorn.Server(uvicorn.Config(refuse, lifespan="on", log_level="critical"))
    with pytest.raises(SystemExit) as info:
        serve_on(server, sock)
    assert info.value.code == 3 and sock.fileno() == -1


def test_a_server_that_took_the_port_while_the_service_started_is_named() -> None:
    """A server binding with `SO_REUSEADDR` (uvicorn's, a second service on the port) may bind beside a socket that
    does not listen yet: the service then seemed up while the other one took its connections (or, on asyncio's loop,
    ended in a traceback)."""
    sock = bind_address("127.0.0.1", 0, "fix it")
    port = sock.getsockname()[1]
    with sock, socket.create_server(("127.0.0.1", port)), pytest.raises(ValueError) as info:
        start_listening(sock, "give another --port")
    assert str(info.value) == f"host='127.0.0.1' port={port}: another program took the port while the service " \
                              "started (Address already in use); give another --port"


def test_an_announced_server_says_where_it_serves(caplog: pytest.LogCaptureFixture) -> None:
    """uvicorn says "Uvicorn running on ..." only for a socket it binds itself: the line had gone."""
    app = FastAPI()
    sock = bind_address("127.0.0.1", 0, "fix it")
    port = sock.getsockname()[1]
    start_listening(sock, "fix it")
    server = AnnouncedServer(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="info"))
    thread = threading.Thread(target=serve_on, args=(server, sock))
    uvicorns = logging.getLogger("uvicorn.error")  # its logging config does not pass it on to the root logger
    uvicorns.addHandler(caplog.handler)
    try:
        thread.start()
        for _ in range(500):
            if server.started:
                break
            threading.Event().wait(0.01)
    finally:
        server.should_exit = True
        thread.join(10)
        uvicorns.removeHandler(caplog.handler)
    assert f"Uvicorn running on http://127.0.0.1:{port} (Press CTRL+C to quit)" in caplog.messages


@pytest.mark.skipif(not socket.has_ipv6, reason="no IPv6 here")
def test_an_ipv6_address_serves_ipv6_alone() -> None:
    """asyncio binds `::` with IPV6_V6ONLY; the socket bound for it served IPv4 too."""
    try:
        sock = bind_address("::", 0, "fix it")
    except ValueError:
        pytest.skip("no IPv6 interface here")
    with sock, socket.socket() as ipv4:
        ipv4.bind(("0.0.0.0", sock.getsockname()[1]))  # the same port on IPv4 is another address
