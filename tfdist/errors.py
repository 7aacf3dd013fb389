"""Errors tfdist raises for input a user can fix."""

from __future__ import annotations

__all__ = ["ClusterError", "ConfigError"]

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


class ClusterError(RuntimeError):
    """A multi-process job lost, or never found, one of its tasks.

    The message names the tasks and the timeout that ran out.
    """
