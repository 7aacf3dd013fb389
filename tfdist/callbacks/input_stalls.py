"""`InputStalls`: the share of step time spent waiting for input, from TensorFlow's profiler.

For a window of training steps (as Keras's TensorBoard does with
`profile_batch`) it runs `tf.profiler`, then reads the trace: every time a
step waits for its batch is an `IteratorGetNextOp::DoCompute` event (the
kernel that takes a batch from tf.data; TensorFlow's own input-pipeline
analysis counts the same events). The share is the time covered by those
events over the window's wall time. Replicas fetch their batches side by
side, so overlapping waits count once.

The share goes into the Keras logs of the epoch the window ends in
(`input_wait_share`), and a report with a plain hint when it is above
`threshold` is printed when training ends:

    input stalls: 62% of step time waiting for input (steps 5-24: 31.2 of 50.3 ms per step)
      hint: the input pipeline does not keep up ...

Example:

    >>> stalls = InputStalls(start_step=5, steps=20)
    >>> model.fit(dataset, callbacks=[stalls])  # doctest: +SKIP
    >>> stalls.input_wait_share  # doctest: +SKIP
"""

from __future__ import annotations

import glob
import os
import shutil
import tempfile
import time
import warnings
from typing import Iterable, Optional

import keras
import tensorflow as tf

from tfdist import _compat

__all__ = ["InputStalls", "HINT", "input_wait_ns"]

# The kernels a step waits in for its batch (TensorFlow's profiler classifies the same two).
WAIT_EVENTS = frozenset({"IteratorGetNextOp::DoCompute", "IteratorGetNextAsOptionalOp::DoCompute"})

HINT = (
    "hint: the input pipeline does not keep up with the step. Prepare batches ahead "
    "(data.prefetch: -1), cache preprocessed examples (data.cache: true), run the map in "
    "parallel (data.map_parallelism: -1), give the pipeline its own threads (data.threads), "
    "or train on larger batches."
)


class InputStalls(keras.callbacks.Callback):
    """Measures how much of the step time `model.fit` waits for input, over a window of steps.

    Args:
      start_step: training steps left out first (tracing, warm-up, filling buffers).
      steps: steps in the measured window (it also ends at the epoch end).
      threshold: the share above which the report gives its hint.
      log_dir: keep the profile here (TensorBoard's Profile tab shows it);
        None profiles into a temporary directory, deleted afterwards.
      verbose: print the report when training ends.

    Attributes:
      input_wait_share: the measured share (None before the window is measured).
      step_time_ms: the window's mean wall time per step (None before).
      report: the report's text ("" before).
    """

    def __init__(self, *, start_step: int = 5, steps: int = 20, threshold: float = 0.1,
                 log_dir: Optional[str] = None, verbose: bool = True):
        super().__init__()
        if start_step < 0:
            raise ValueError(f"`start_step` must be >= 0. Received: {start_step}")
        if steps < 1:
            raise ValueError(f"`steps` must be >= 1. Received: {steps}")
        if not 0 < threshold < 1:
            raise ValueError(f"`threshold` must be in (0, 1). Received: {threshold}")
        self.start_step, self.steps, self.threshold = start_step, steps, threshold
        self.log_dir = log_dir
        self.verbose = verbose
        self.input_wait_share: Optional[float] = None
        self.step_time_ms: Optional[float] = None
        self.report = ""

    def on_train_begin(self, logs=None):
        self.input_wait_share, self.step_time_ms, self.report = None, None, ""
        self._steps_done = 0
        self._last_batch = -1
        self._profile_dir: Optional[str] = None
        self._window_steps = 0
        self._done = self._logged = False

    def on_epoch_begin(self, epoch, logs=None):
        self._last_batch = -1

    def on_train_batch_begin(self, batch, logs=None):
        if self._done or self._profile_dir is not None or self._steps_done < self.start_step:
            return
        profile_dir = self.log_dir or tempfile.mkdtemp(prefix="tfdist_input_stalls_")
        try:
            tf.profiler.experimental.start(profile_dir)
        except tf.errors.AlreadyExistsError:  # another profiler (TensorBoard's profile_batch) is running
            warnings.warn("InputStalls: another profiler session is running; no input-stall report.", stacklevel=2)
            self._done = True
            return
        self._profile_dir = profile_dir
        self._first_step = self._steps_done
        self._start_ns = self._end_ns = time.time_ns()

    def on_train_batch_end(self, batch, logs=None):
        steps = batch - self._last_batch  # > 1 with steps_per_execution
        self._last_batch = batch
        self._steps_done += steps
        if self._profile_dir is None:
            return
        self._end_ns = time.time_ns()
        self._window_steps = self._steps_done - self._first_step
        if self._window_steps >= self.steps:
            self._finish()

    def on_test_begin(self, logs=None):
        if self._profile_dir is not None:  # the epoch ended inside the window; validation is not a train step
            self._finish()

    def on_epoch_end(self, epoch, logs=None):
        if self._profile_dir is not None:
            self._finish()
        if self.input_wait_share is not None and logs is not None and not self._logged:
            logs["input_wait_share"] = self.input_wait_share
            self._logged = True

    def on_train_end(self, logs=None):
        if self._profile_dir is not None:
            self._finish()
        if not self._done:
            warnings.warn(
                f"InputStalls: training ended after {self._steps_done} step(s), before step "
                f"{self.start_step} where the measured window starts; no input-stall report.",
                stacklevel=2,
            )
        elif self.report and self.verbose:
            print(self.report, flush=True)

    def _finish(self):
        tf.profiler.experimental.stop()
        profile_dir, self._profile_dir = self._profile_dir, None
        self._done, self._logged = True, False
        try:
            traces = glob.glob(os.path.join(profile_dir, "plugins", "profile", "*", "*.xplane.pb"))
            if not traces:
                warnings.warn(f"InputStalls: the profiler wrote no trace in {profile_dir}; no input-stall report.",
                              stacklevel=2)
                return
            wait_ns = input_wait_ns(_compat.xspace(max(traces, key=os.path.getmtime)), self._start_ns, self._end_ns)
        finally:
            if not self.log_dir:
                shutil.rmtree(profile_dir, ignore_errors=True)
        window_ns = max(self._end_ns - self._start_ns, 1)
        self.input_wait_share = wait_ns / window_ns
        self.step_time_ms = per_step = window_ns / 1e6 / self._window_steps
        last = self._first_step + self._window_steps - 1
        self.report = (
            f"input stalls: {self.input_wait_share:.0%} of step time waiting for input "
            f"(steps {self._first_step}-{last}: {self.input_wait_share * per_step:.1f} of {per_step:.1f} ms per step)"
        )
        if self.input_wait_share > self.threshold:
            self.report += "\n  " + HINT


def input_wait_ns(space, start_ns: int, end_ns: int) -> int:
    """Nanoseconds within [start_ns, end_ns] (wall clock) covered by any wait-for-batch event of an XSpace."""
    return _covered(_wait_intervals(space), start_ns, end_ns)


def _wait_intervals(space) -> Iterable[tuple[int, int]]:
    """(start, end) wall-clock ns of every wait-for-batch event."""
    profile_start = _profile_start_ns(space)
    for plane in space.planes:
        waits = {key for key, meta in plane.event_metadata.items() if meta.name in WAIT_EVENTS}
        for line in plane.lines:
            # The profiler stores line times relative to the profile's start.
            line_start = line.timestamp_ns + (profile_start if line.timestamp_ns < profile_start else 0)
            for event in line.events:
                if event.metadata_id in waits:
                    start = line_start + event.offset_ps // 1000
                    yield start, start + event.duration_ps // 1000


def _profile_start_ns(space) -> int:
    for plane in space.planes:
        for stat in plane.stats:
            if plane.stat_metadata[stat.metadata_id].name == "profile_start_time":
                return stat.uint64_value or stat.int64_value
    return 0


def _covered(intervals: Iterable[tuple[int, int]], low: int, high: int) -> int:
    """Length of the union of the intervals, clipped to [low, high]."""
    covered, reach = 0, low
    for start, end in sorted((max(s, low), min(e, high)) for s, e in intervals):
        if end > start and end > reach:
            covered += end - max(start, reach)
            reach = end
    return covered
