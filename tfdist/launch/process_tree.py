"""The processes a launched task started, and which of them are stopped, from Linux's /proc.

`tfdist launch` uses it to name the task that stalls a job: a process stopped
by SIGSTOP (state `T`) holds up every collective, and its peers fail after
their own timeouts, so the first task to fail is rarely the one to blame.
Under Horovod the ranks are horovodrun's descendants; each is named by its
HOROVOD_RANK. TensorFlow-free, like the launcher.
"""

from __future__ import annotations

import os
from typing import Optional

__all__ = ["descendants", "horovod_rank", "is_stopped"]


def _stat(pid: int) -> Optional[tuple[str, int]]:
    """(state, parent pid) of `pid`, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # the command name in parentheses may hold spaces
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[1])


def descendants(root: int) -> list[int]:
    """`root` and every process below it, parents first."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat is not None:
                children.setdefault(stat[1], []).append(int(entry))
    found, pending = [], [root]
    while pending:
        pid = pending.pop(0)
        found.append(pid)
        pending += sorted(children.get(pid, []))
    return found


def is_stopped(pid: int) -> bool:
    """Whether `pid` is stopped by a signal (SIGSTOP, SIGTSTP): state T, not a debugger's t."""
    stat = _stat(pid)
    return stat is not None and stat[0] == "T"


def horovod_rank(pid: int) -> Optional[int]:
    """The HOROVOD_RANK in `pid`'s environment (a rank horovodrun started), if any."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            for item in f.read().split(b"\0"):
                if item.startswith(b"HOROVOD_RANK="):
                    return int(item.split(b"=", 1)[1])
    except (OSError, ValueError):
        pass
    return None
