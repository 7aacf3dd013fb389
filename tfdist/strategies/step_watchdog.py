"""A watchdog that ends a process whose training step has stopped making progress.

A step blocked in a collective that another process will never join (a rank
alive but stuck) blocks inside a C++ kernel that nothing can interrupt; so
does a collective between steps (the ranks' agreement on SIGTERM, say).
Horovod's stall inspector ends it only at its next check, and not at all when
its shutdown time is shorter than its check interval. The watchdog turns
that hang into an error: when a step has run longer than `timeout_seconds`, it
prints one line naming the rank and exits the process (the launcher, e.g.
horovodrun, then stops the other ranks). The first step of each function is
exempt: it traces and compiles.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from typing import Callable, Iterator

__all__ = ["StepWatchdog"]

_CHECK_INTERVAL_SECONDS = 0.5


class StepWatchdog:
    """Wraps step functions (and watches collectives between steps); exits the process if one runs longer
    than `timeout_seconds`.

    Args:
      timeout_seconds: longest a step may run (after its first call).
      name: who this process is, for the message (e.g. "rank 1").
    """

    def __init__(self, timeout_seconds: float, name: str):
        self.timeout_seconds = timeout_seconds
        self.name = name
        self._deadline = None
        self.last_watched_seconds = 0.0  # how long the last step or collective ran (a failed one too), for its error
        self._lock = threading.Lock()
        threading.Thread(target=self._watch, name="tfdist-step-watchdog", daemon=True).start()

    def wrap(self, function: Callable) -> Callable:
        calls = [0]

        def watched(*args, **kwargs):
            calls[0] += 1
            with self.watching(exempt=calls[0] == 1):  # the first call traces and compiles
                return function(*args, **kwargs)

        return watched

    @contextlib.contextmanager
    def watching(self, exempt: bool = False) -> Iterator[None]:
        """Ends the process if the block runs longer than `timeout_seconds` (unless `exempt`)."""
        started = time.monotonic()
        if not exempt:
            with self._lock:
                self._deadline = started + self.timeout_seconds
        try:
            yield
        finally:
            with self._lock:
                self._deadline = None
            self.last_watched_seconds = time.monotonic() - started

    def _watch(self) -> None:
        while True:
            time.sleep(_CHECK_INTERVAL_SECONDS)
            with self._lock:
                expired = self._deadline is not None and time.monotonic() > self._deadline
            if expired:
                print(f"tfdist: error: {self.name}: a step (or a collective between steps) has not finished in "
                      f"{self.timeout_seconds:g} s; another rank is stuck or gone (horovod.stall_shutdown_seconds).",
                      file=sys.stderr, flush=True)
                os._exit(1)
