"""`Preemption`: a scheduler's SIGTERM stops training within a grace period, in every process at one step.

Without it, a multi-worker task ignores SIGTERM: TensorFlow's own preemption
notifier takes the signal and nothing acts on it, so the task trains to its
end. Here the current step finishes, every process of the job agrees at that
step to stop (a scheduler may signal only one of them, and a process that
stops alone would leave the others waiting in a collective), training stops,
and the process exits 143 (128 + SIGTERM) with one line. If that takes longer
than `grace_seconds` (a step stuck in a collective), it exits at once.
`Checkpoint` extends it to save at that step and exit 75, so that the job is
run again and resumes.

Example:
    >>> model.fit(data, epochs=10, callbacks=[Preemption()])  # doctest: +SKIP
"""

from __future__ import annotations

import os
import signal
import sys
import threading

import keras

from tfdist.checkpoint_store import EXIT_TERMINATED, SIGTERM_RECEIVED
from tfdist.contract import contract

__all__ = ["EXIT_TERMINATED", "Preemption"]


class Preemption(keras.callbacks.Callback):
    """Stops training at the step every process is at when any of them gets SIGTERM.

    Args:
      grace_seconds: after SIGTERM, the time allowed to finish the step (and
        whatever `on_preempted` does) before the process exits regardless.

    Attributes:
      preempted: whether SIGTERM stopped training.
    """

    exit_code = EXIT_TERMINATED
    # Agreeing is a collective in a multi-process job: every 10th step is soon enough to stop within the
    # grace period, and costs a tenth of agreeing every step. (Checkpoint agrees every step: it saves there.)
    agree_every_steps = 10

    def __init__(self, grace_seconds: float = 30.0):
        super().__init__()
        self.grace_seconds = grace_seconds
        self.preempted = False
        self._batch_ends = 0
        self._sigterm = threading.Event()
        self._previous_handler, self._deadline = None, None

    def on_train_begin(self, logs=None):
        self._previous_handler, self._deadline = None, None
        if threading.current_thread() is threading.main_thread():
            self._previous_handler = signal.signal(signal.SIGTERM, lambda signum, frame: self._on_sigterm())

    def _on_sigterm(self):
        if not self._sigterm.is_set():
            say(f"{SIGTERM_RECEIVED}: {self._plan()} (within {self.grace_seconds:g} s)")
            self._sigterm.set()
            self._deadline = threading.Timer(self.grace_seconds, self._exit_at_deadline)
            self._deadline.daemon = True
            self._deadline.start()

    def _plan(self) -> str:
        return (f"stopping within {self.agree_every_steps} steps, every process at the same one; nothing is saved "
                "(set checkpoint.dir to resume)")

    def _exit_at_deadline(self):  # a step stuck (in a collective, say) must not outlive the grace period
        say(f"tfdist: error: stopped (SIGTERM); the step did not finish within {self.grace_seconds:g} s; exiting "
            f"(exit {self.exit_code})")
        os._exit(self.exit_code)

    def on_train_batch_end(self, batch, logs=None):
        self._batch_ends += 1  # the same count in every process
        alone = not contract(self.model.distribute_strategy).multi_process
        if (alone or self._batch_ends % self.agree_every_steps == 0) and self._any_process_preempted():
            self._stop_here()

    def _stop_here(self) -> None:
        self.on_preempted()
        self.preempted = True
        self.model.stop_training = True

    def on_preempted(self) -> None:
        """What to do at the step every process stops at (Checkpoint: save)."""

    def _any_process_preempted(self) -> bool:
        """Whether any process of the job got SIGTERM. A multi-process strategy (`any_process`) agrees on it
        (a collective every process calls at the same step), so every process stops at the same step."""
        return contract(self.model.distribute_strategy).any_process(self._sigterm.is_set())

    def on_test_batch_end(self, batch, logs=None):
        # Validation after the step that stopped training: its logs are not needed.
        if self.preempted:
            self.model.stop_evaluating = True

    def on_epoch_end(self, epoch, logs=None):
        # SIGTERM during the epoch's validation: stop here, not after another step and validation.
        if not self.preempted and self._any_process_preempted():
            self._stop_here()

    def on_train_end(self, logs=None):
        if self._previous_handler is not None:
            signal.signal(signal.SIGTERM, self._previous_handler)
        if self._deadline is not None:
            self._deadline.cancel()
        self.on_stopped()
        if self.preempted:
            say(self._exit_line())
            sys.exit(self.exit_code)
        if self._sigterm.is_set():  # it came after the last step: training is done; now obey it
            os.kill(os.getpid(), signal.SIGTERM)

    def on_stopped(self) -> None:
        """Before the exit: training has ended (Checkpoint: save what is not saved)."""

    def _exit_line(self) -> str:
        return (f"tfdist: stopped by SIGTERM; no checkpoint.dir, so nothing was saved: the job starts over if run "
                f"again (exit {self.exit_code})")


def say(line: str) -> None:
    """Writes `line` to stderr. A reader that is gone (a launcher killed outright, whose guard then sends SIGTERM)
    must not stop what the line announces: the write's BrokenPipeError would end the process before its save, so
    stdout and stderr go to /dev/null from then on, and the save goes on."""
    try:
        print(line, file=sys.stderr, flush=True)
    except OSError:  # EPIPE
        nowhere = os.open(os.devnull, os.O_WRONLY)
        for stream in (sys.stdout, sys.stderr):
            try:
                os.dup2(nowhere, stream.fileno())
            except (OSError, ValueError):  # a stream without a file descriptor
                pass
