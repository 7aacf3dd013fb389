"""A launched task's guard: runs the task's command, and ends it when the launcher dies.

    python -I -m tfdist.launch.guard -- COMMAND [ARGS...]

`tfdist launch` starts every task through a guard, so that no task outlives
the launcher, however the launcher ends: a SIGKILLed launcher runs no
cleanup of its own, and its tasks (each in a session of its own, so that a
signal reaches each once) would otherwise train on as orphans. The guard is
a small process beside the command, in its process group:

- it runs COMMAND and exits as COMMAND does (its exit code, or the same
  signal), so the launcher sees the task's own end;
- the signals the launcher sends the task's group reach COMMAND directly;
  the guard waits for COMMAND's end instead of dying first;
- it is its descendants' subreaper (PR_SET_CHILD_SUBREAPER): what COMMAND
  starts in sessions of its own (horovodrun's ranks) stays below it when
  COMMAND dies, and is killed when the guard ends;
- once its parent (the launcher) has gone, it stops everything below it:
  SIGTERM (a job saves or stops as it would for the launcher's own stop),
  SIGKILL after GRACE_SECONDS.

It imports nothing of TensorFlow (`-I`: nothing from the user's environment
either), so it costs a few milliseconds of CPU.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

from tfdist.launch import process_tree

__all__ = ["command", "GRACE_SECONDS"]

GRACE_SECONDS = 5  # from the launcher's death to SIGKILL (horovodrun stops its ranks within 5 s of SIGTERM)
POLL_SECONDS = 0.25
_PR_SET_CHILD_SUBREAPER = 36
# The launcher's signals for the task's group: COMMAND acts on them; the guard outlives it to report its end.
_PASSED_ON = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def command(task_command: list[str]) -> list[str]:
    """`task_command` run by a guard."""
    return [sys.executable, "-I", "-m", __name__, "--", *task_command]


def main(argv: list[str]) -> int:
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        print("usage: python -m tfdist.launch.guard -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    task_command = argv[argv.index("--") + 1:]
    ctypes.CDLL(None).prctl(_PR_SET_CHILD_SUBREAPER, 1)
    launcher = os.getppid()
    try:
        task = subprocess.Popen(task_command)
    except OSError as error:
        print(f"tfdist launch: cannot run {task_command[0]}: {error.strerror}", file=sys.stderr)
        return 127
    for number in _PASSED_ON:
        signal.signal(number, lambda *_: None)
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGCHLD])  # kept pending for sigtimedwait (after the fork)
    status = _wait(task.pid, launcher)
    task.returncode = status  # reaped here (with the orphans below the guard), not by Popen
    _kill_below(signal.SIGKILL)  # what the task left behind (a rank whose horovodrun died)
    if status < 0:  # the task died of a signal: so does its guard
        if -status not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    return status


def _wait(pid: int, launcher: int) -> int:
    """The task's return code (-N: killed by signal N), reaping every orphan meanwhile; if the launcher dies
    first, stops everything below the guard and returns when the task has gone."""
    orphaned_at = None
    while True:
        reaped, status = os.waitpid(-1, os.WNOHANG)
        while reaped:
            if reaped == pid:
                return os.waitstatus_to_exitcode(status)
            reaped, status = os.waitpid(-1, os.WNOHANG)
        if orphaned_at is None and os.getppid() != launcher:
            orphaned_at = time.monotonic()
            _kill_below(signal.SIGTERM)
            _kill_below(signal.SIGCONT)  # a stopped process cannot act on SIGTERM
        elif orphaned_at is not None and time.monotonic() - orphaned_at > GRACE_SECONDS:
            _kill_below(signal.SIGKILL)
        signal.sigtimedwait([signal.SIGCHLD], POLL_SECONDS)  # a child's end wakes it at once


def _kill_below(number: int) -> None:
    for pid in process_tree.descendants(os.getpid())[1:]:
        try:
            os.kill(pid, number)
        except ProcessLookupError:
            pass


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
