"""Loopback ports for the servers a process starts beside itself (an SGLang server, a rendezvous, a redis-server)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now: the kernel's pick, so another process may still take it
    before it is used."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
