"""Loopback addresses for local multi-process jobs: free ports, and whether a task listens.

TensorFlow-free, so the launcher can use it without loading TensorFlow.
"""

from __future__ import annotations

import socket

__all__ = ["accepts_connections", "free_loopback_ports"]


def free_loopback_ports(count: int) -> list[int]:
    """Ports on 127.0.0.1 that were free a moment ago (all held at once, so distinct)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def accepts_connections(address: str, timeout: float = 2.0) -> bool:
    """Whether something listens at `host:port` (a killed task's port refuses at once)."""
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return True
    except OSError:
        return False
