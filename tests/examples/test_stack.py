"""examples/stack.py: the ports a stack's services are given."""

from __future__ import annotations

import socket

from examples.stack import free_ports


def test_free_ports_are_different_and_free() -> None:
    ports = free_ports(16)
    assert len(set(ports)) == 16  # the trainer refuses an API port equal to its vLLM port
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))
