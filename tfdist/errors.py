"""Errors tfdist raises for input a user can fix."""

from __future__ import annotations

import re

__all__ = ["CheckpointWriteError", "ClusterError", "ConfigError", "LayoutError", "MemoryLimitError", "error_reason"]

_MISSING = object()


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the dotted key.

    The message reads: the key in backticks, the rule, then `Received: ...`.

    Attributes:
      key: the dotted config key (`train.epochs`), or `config` for the file itself.
      received: the offending value.
    """

    def __init__(self, key: str, rule: str, received=_MISSING):
        self.key = key
        self.received = None if received is _MISSING else received
        message = f"`{key}` {rule}"
        if received is not _MISSING:
            message += f" Received: {received!r}."
        super().__init__(message)


class HostsError(RuntimeError):
    """`tfdist launch --hosts` cannot make its network-namespace hosts here (not root, no `ip`, `tc` or sshd)."""


class ClusterError(RuntimeError):
    """A multi-process job lost, or never found, one of its tasks.

    The message names the tasks and the timeout that ran out.
    """


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (a full disk, a lost mount); the ones written before it are intact.

    The message names the step, the directory and the reason, and says which checkpoint a rerun resumes from.
    """


class MemoryLimitError(MemoryError):
    """Training would take more memory than this process's limit allows (`tfdist.memory_limit`): the message
    names the bytes, the limit and what splits them, where the kernel would have killed the process unexplained.
    """


# How a Horovod rank that lost another begins its one line; `tfdist launch` names the other rank instead.
PEER_LOST_UNDER_HOROVOD = "Horovod stopped: another rank"


# Lines of a TensorFlow graph error that say where, not why.
_ERROR_FRAMING = (
    "Graph execution error", "Detected at node", "<stack traces unavailable>", "File ", "[[", "Traceback",
    "Additional GRPC error information",
)


def error_reason(message) -> str:
    """The reason in a TensorFlow error message, for a one-line error.

    Its first root error (`(0) ...`), else its first line that is not framing
    (the graph-error header, the node and stack-trace lines), else its first line.
    """
    lines = [line.strip() for line in (message or "").splitlines() if line.strip()]
    root_errors = [line[len("(0) "):] for line in lines if line.startswith("(0) ")]
    reasons = [line for line in lines if not line.startswith(_ERROR_FRAMING)]
    reason = (root_errors or reasons or lines or ["no reason given"])[0]
    # An eager op's error wraps the reason in the function's node and the op's name (a full disk's SaveV2: about
    # 400 characters of which the reason is 23).
    return re.sub(r"^\{\{function_node [^}]*\}\}\s*|\s*\[Op:[^\]]*\].*$", "", reason) or reason


class LayoutError(ValueError):
    """A layout that does not fit the model or the devices, in one line naming the variable, rule and shapes
    (`tfdist.parallel.layout`)."""
