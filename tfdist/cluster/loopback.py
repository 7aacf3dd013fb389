"""Loopback addresses for local multi-process jobs: free ports, and whether a task listens.

TensorFlow-free, so the launcher can use it without loading TensorFlow.
"""

from __future__ import annotations

import fcntl
import os
import random
import socket
import tempfile
import time

import psutil

__all__ = ["accepts_connections", "free_loopback_ports", "listens", "port_holders", "port_is_free"]

LOWEST_PORT = 10000
_ATTEMPTS = 200
# Ports handed out lately on this machine, a line "PORT TIME" each, and how long one stays reserved:
# longer than any task takes to start and bind it.
RESERVATIONS = os.path.join(tempfile.gettempdir(), "tfdist-ports")
RESERVE_SECONDS = 120


def free_loopback_ports(count: int, *, consecutive: bool = False) -> list[int]:
    """`count` distinct ports that were free a moment ago, on every address (as TensorFlow's gRPC
    server binds). They come from below the kernel's ephemeral range: a port from that range can be
    taken meanwhile by any process's outgoing connection (in CI, srun's I/O and, once, another job's
    task took one), one from below it only by a process that asks for it by number. A port handed out
    here is not handed out again on this machine for RESERVE_SECONDS (`_reserve`).

    Args:
      consecutive: a block `first, first + 1, ...` (as `cluster.port_base` numbers a job's tasks).

    Raises:
      RuntimeError: no such ports after many tries.
    """
    highest = _ephemeral_range_start() - 1
    for _ in range(_ATTEMPTS):
        if consecutive:
            first = random.randrange(LOWEST_PORT, highest - count + 2)
            ports = list(range(first, first + count))
        else:
            ports = random.sample(range(LOWEST_PORT, highest + 1), count)
        if all(port_is_free(port) for port in ports) and _reserve(ports):
            return ports
    raise RuntimeError(f"no {count} free ports in {LOWEST_PORT}-{highest} after {_ATTEMPTS} tries")


def _reserve(ports: list[int]) -> bool:
    """Records `ports` as handed out, unless one was handed out in the last RESERVE_SECONDS: two jobs
    starting at once on this machine (pytest's workers, in CI) would otherwise get the same free port,
    and the task that binds second fails. Without the shared file (another user's), nothing is kept."""
    now = time.time()
    try:
        with open(RESERVATIONS, "a+", encoding="ascii") as f:
            fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
            f.seek(0)
            recent = {port: at for port, at in map(_reservation, f) if now - at < RESERVE_SECONDS}
            if recent.keys() & set(ports):
                return False
            recent.update((port, now) for port in ports)
            f.seek(0)
            f.truncate()
            f.write("".join(f"{port} {at}\n" for port, at in recent.items()))
    except OSError:
        pass
    return True


def _reservation(line: str) -> tuple[int, float]:
    """A reservation file's line as (port, time); a line a killed writer left half written is long
    expired (time 0), so the next write drops it."""
    try:
        port, at = line.split()
        return int(port), float(at)
    except ValueError:
        return 0, 0.0


def port_is_free(port: int, *, reuse_address: bool = False) -> bool:
    """Whether a server could bind `port` on every address now; with `reuse_address` as one that sets
    SO_REUSEADDR (gRPC) could, which a closed connection still waiting on the port does not stop."""
    with socket.socket() as s:
        if reuse_address:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
            return True
        except OSError:
            return False


def port_holders(port: int) -> str:
    """Who has TCP `port` bound on this machine, as "python pid 42 LISTEN, ..." (pids need the same
    user or root; "unknown" when no socket shows: it was released meanwhile)."""
    holders = []
    for s in psutil.net_connections(kind="tcp"):
        if s.laddr and s.laddr.port == port:
            try:
                name = psutil.Process(s.pid).name() if s.pid else "a closed socket"
            except psutil.Error:
                name = "an exited process"
            holders.append(f"{name}{f' pid {s.pid}' if s.pid else ''} {s.status}")
    return ", ".join(sorted(set(holders))) or "unknown"


def listens(pid: int, port: int) -> bool:
    """Whether process `pid` itself listens on TCP `port` (not some other process that took it)."""
    try:
        sockets = psutil.Process(pid).net_connections(kind="tcp")
    except psutil.Error:  # exited meanwhile
        return False
    return any(s.status == psutil.CONN_LISTEN and s.laddr.port == port for s in sockets)


def accepts_connections(address: str, timeout: float = 2.0) -> bool:
    """Whether something listens at `host:port` (a killed task's port refuses at once)."""
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return True
    except OSError:
        return False


def _ephemeral_range_start() -> int:
    """The lowest port Linux gives outgoing connections (32768 unless configured), or above our range."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            start = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        start = 32768
    return max(start, LOWEST_PORT + 1000)
