"""Helpers for tests that run tfdist in subprocesses."""

import os
import subprocess
import sys

from tfdist.strategies.cluster import free_loopback_ports as free_ports  # noqa: F401

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
