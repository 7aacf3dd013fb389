"""Samples per second and step time, measured inside `model.fit`.

Keras reports neither. The clock runs between consecutive batch ends inside an
epoch, so the figure covers everything the training loop does per step (input,
step, callbacks) but not validation or epoch set-up, and the first
`warmup_steps` steps of training (tracing, autotuning) are left out.

Example:

    >>> throughput = Throughput(global_batch_size=64)
    >>> model.fit(x, y, batch_size=64, callbacks=[throughput])  # doctest: +SKIP
    >>> throughput.samples_per_sec  # doctest: +SKIP
"""

from __future__ import annotations

import statistics
import time

import keras

__all__ = ["Throughput"]


class Throughput(keras.callbacks.Callback):
    """Adds `samples_per_sec` and `step_time_ms` to each epoch's logs.

    Args:
      global_batch_size: examples per step over all replicas.
      warmup_steps: steps at the start of training left out of the figures.

    Attributes:
      step_times: seconds of each measured step, in order.
    """

    def __init__(self, global_batch_size: int, *, warmup_steps: int = 5):
        super().__init__()
        if global_batch_size < 1:
            raise ValueError(f"`global_batch_size` must be >= 1. Received: {global_batch_size}")
        if warmup_steps < 0:
            raise ValueError(f"`warmup_steps` must be >= 0. Received: {warmup_steps}")
        self.global_batch_size = global_batch_size
        self.warmup_steps = warmup_steps
        self.step_times: list[float] = []
        self._steps_seen = 0

    def on_train_begin(self, logs=None):
        self.step_times = []
        self._steps_seen = 0

    def on_epoch_begin(self, epoch, logs=None):
        self._last_end = None
        self._last_batch = -1
        self._epoch_first = len(self.step_times)

    def on_train_batch_end(self, batch, logs=None):
        now = time.perf_counter()
        steps = batch - self._last_batch  # > 1 with steps_per_execution
        self._last_batch = batch
        self._steps_seen += steps
        if self._last_end is not None and self._steps_seen - steps >= self.warmup_steps:
            self.step_times.extend([(now - self._last_end) / steps] * steps)
        self._last_end = now

    def on_epoch_end(self, epoch, logs=None):
        epoch_times = self.step_times[self._epoch_first :]
        if logs is not None and epoch_times:
            logs["samples_per_sec"] = self.global_batch_size * len(epoch_times) / sum(epoch_times)
            logs["step_time_ms"] = 1000 * statistics.median(epoch_times)

    @property
    def samples_per_sec(self) -> float:
        """Mean throughput over every measured step so far (0 before any)."""
        if not self.step_times:
            return 0.0
        return self.global_batch_size * len(self.step_times) / sum(self.step_times)

    @property
    def step_time_ms(self) -> float:
        """Median measured step time in milliseconds (0 before any)."""
        return 1000 * statistics.median(self.step_times) if self.step_times else 0.0
