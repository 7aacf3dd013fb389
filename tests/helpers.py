"""Helpers for tests that run tfdist in subprocesses."""

import os
import socket
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_ports(count):
    """Ports on 127.0.0.1 that were free a moment ago."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def tfdist_command(*args):
    """`tfdist ARGS` run with this interpreter (works without the console script)."""
    return [sys.executable, "-m", "tfdist.cli", *args]


def run_tfdist(*args, timeout=120, env=None):
    """Runs `tfdist ARGS` from the repository root; returns the CompletedProcess."""
    return subprocess.run(
        tfdist_command(*args),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})},
    )
