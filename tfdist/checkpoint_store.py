"""Checkpoints on disk that a kill at any moment cannot corrupt.

Each checkpoint is a directory, `step-000000001200/`, holding TensorFlow's
checkpoint files (`state.index`, `state.data-*`) and `meta.json` (where in
training it was taken). It is written whole under a temporary name
(`.tmp-...`), flushed to disk, and then renamed: a rename is atomic, so a
process killed during a save leaves the previous checkpoints as they were and
at most a temporary directory, which the next save removes. The newest `keep`
checkpoints are kept. A checkpoint that cannot be read (a disk fault, a
truncated copy) is skipped for the one before it, with one warning.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from typing import Any, Callable, Optional

from tfdist.errors import CheckpointWriteError, error_reason

__all__ = ["CheckpointMismatch", "CheckpointStore", "EXIT_PREEMPTED", "EXIT_TERMINATED", "SIGTERM_RECEIVED"]

# The line a process prints when a scheduler's SIGTERM reaches it (the launcher names those tasks).
SIGTERM_RECEIVED = "tfdist: SIGTERM received"
EXIT_TERMINATED = 143  # 128 + SIGTERM: stopped by SIGTERM without a checkpoint to resume from
EXIT_PREEMPTED = 75  # sysexits.h EX_TEMPFAIL: stopped by SIGTERM after saving; run the job again to resume

_NAME = re.compile(r"step-(\d{12})")
_TMP_PREFIX = ".tmp-"
PREFIX = "state"  # TensorFlow's files in a checkpoint directory: state.index, state.data-*


class CheckpointMismatch(ValueError):
    """A readable checkpoint of another model: an error, not a reason to fall back to an older one."""


class CheckpointStore:
    """The checkpoints in one directory.

    Args:
      directory: where they are (made when missing).
      keep: how many of the newest to keep.
    """

    def __init__(self, directory: str, keep: int = 3):
        self.directory = directory
        self.keep = keep

    def steps(self) -> list[int]:
        """The steps of the complete checkpoints, newest first."""
        if not os.path.isdir(self.directory):
            return []
        found = (_NAME.fullmatch(name) for name in os.listdir(self.directory))
        return sorted((int(m[1]) for m in found if m), reverse=True)

    def path(self, step: int) -> str:
        return os.path.join(self.directory, f"step-{step:012d}")

    def prefix(self, step: int) -> str:
        """The TensorFlow checkpoint prefix of step's checkpoint (for tf.train.Checkpoint.read)."""
        return os.path.join(self.path(step), PREFIX)

    def save(self, step: int, write: Callable[[str], Any], meta: dict) -> str:
        """Writes a checkpoint of `step`: `write(prefix)` writes TensorFlow's files; `meta` goes to meta.json."""
        os.makedirs(self.directory, exist_ok=True)
        for name in os.listdir(self.directory):  # what a killed save left
            if name.startswith(_TMP_PREFIX):
                shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
        staging = os.path.join(self.directory, f"{_TMP_PREFIX}{step}-{os.getpid()}")
        try:
            os.makedirs(staging)
            write(os.path.join(staging, PREFIX))
            with open(os.path.join(staging, "meta.json"), "w") as f:
                json.dump({"step": step, **meta}, f, indent=1)
            _sync_tree(staging)
        except Exception as error:  # noqa: BLE001  (only a failure to write files is turned into one line)
            if not _write_failure(error):
                raise
            shutil.rmtree(staging, ignore_errors=True)  # frees what it took; the earlier checkpoints stay
            earlier = self.steps()
            resumes = f"a rerun resumes from step {earlier[0]}" if earlier else "there is no earlier checkpoint"
            reason = error.strerror if isinstance(error, OSError) and error.strerror else error_reason(str(error))
            raise CheckpointWriteError(f"could not write the checkpoint of step {step} to {self.directory} "
                                       f"({reason}); {resumes}.") from None
        final = self.path(step)
        if os.path.exists(final):  # saved again at the same step (the end of training after a periodic save)
            shutil.rmtree(staging)
            return final
        os.rename(staging, final)
        _sync(self.directory)
        for old in self.steps()[self.keep:]:
            shutil.rmtree(self.path(old), ignore_errors=True)
        return final

    def restore_latest(self, read: Callable[[str, dict], Any]) -> Optional[dict]:
        """Calls `read(prefix, meta)` on the newest checkpoint that reads; returns its meta, or None if there is none.

        Raises:
          CheckpointMismatch: `read` found the checkpoint written for another model.
        """
        for step in self.steps():
            path = self.path(step)
            try:
                with open(os.path.join(path, "meta.json")) as f:
                    meta = json.load(f)
                read(self.prefix(step), meta)
                return meta
            except CheckpointMismatch:
                raise
            except Exception as e:  # noqa: BLE001 - any unreadable checkpoint falls back the same way
                reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                warnings.warn(f"checkpoint {path} cannot be read ({reason[:200]}); trying the one before it",
                              stacklevel=2)
        return None


def _write_failure(error: Exception) -> bool:
    """An error of writing the files: the OS's, or TensorFlow's for a full disk (ResourceExhaustedError) or a
    directory it may not write. Not TensorFlow's other errors: reading the state may fail otherwise (a lost
    parameter server), which the job reports as such."""
    if isinstance(error, OSError):
        return True
    import tensorflow as tf  # only here: the launchers import this module, and must not load TensorFlow

    return isinstance(error, (tf.errors.ResourceExhaustedError, tf.errors.PermissionDeniedError))


def _sync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sync_tree(directory: str) -> None:
    for name in os.listdir(directory):
        _sync(os.path.join(directory, name))
    _sync(directory)
