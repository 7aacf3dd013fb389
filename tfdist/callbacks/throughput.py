"""Samples per second, step time, how busy the host's cores were and a host link's bytes per step: completed work
over wall time, inside `model.fit`.

Keras reports neither. Each epoch's figure is the steps that finished in a
window of wall time divided by that window. The window opens when the epoch
begins, or, in the epoch where warm-up ends, when the first `warmup_steps`
steps (tracing, autotuning) have finished. It closes when the epoch's last step
has finished. So the figure covers everything the training loop does per step
(input, step, callbacks) but not validation.

Most strategies finish a step before Keras's step call returns. A
parameter-server job's step call only queues the step on a worker
(`ClusterCoordinator.schedule`), so a clock read there counts queued steps as
done. Such a strategy has a `wait_for_steps()` (tfdist's
ParameterServerStrategy: the coordinator's join), and the window's ends wait
for it: once when warm-up ends and once at each epoch's last step, where the
epoch's logs would wait anyway.

The window's ends also read the machine's CPU time counters (psutil, from
/proc/stat), so `host_cpu_busy` is the share of all its cores that were busy
over the same steps (given half a second of them or more): every process on
the machine counts, which on the namespace hosts of `tfdist launch --hosts`
is every task of the job. Given a network interface (`link=`, as on those
hosts), the window also reads the interface's byte counters at its ends, so
the bytes the host's link carried per step are measured over the same steps,
validation and start-up left out. With them it reads the TCP segments the
host's network namespace retransmitted (/proc/net/snmp): a retransmitted
segment crosses the link again, so those bytes are TCP's, not the job's.

Example:

    >>> throughput = Throughput(global_batch_size=64)
    >>> model.fit(x, y, batch_size=64, callbacks=[throughput])  # doctest: +SKIP
    >>> throughput.samples_per_sec  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Optional

import keras
import psutil

from tfdist.contract import contract

__all__ = ["Throughput", "Window", "fit_round"]

# Linux counts CPU time in ticks (/proc/stat in 10 ms units): two readings blur a share by up to
# 0.02 s / the window's seconds, so under half a second of measured steps none is given.
MIN_BUSY_SECONDS = 0.5


@dataclasses.dataclass(frozen=True)
class Window:
    """One epoch's measured window: `steps` finished between `start` and `end` (perf_counter seconds),
    while the machine's cores were busy `busy_core_seconds` in all, the link sent `sent` bytes and
    received `received`, and TCP retransmitted `retransmitted` segments (0 without a link)."""

    start: float
    end: float
    steps: int
    sent: int = 0
    received: int = 0
    busy_core_seconds: float = 0.0
    retransmitted: int = 0

    @property
    def seconds(self) -> float:
        return self.end - self.start


class Throughput(keras.callbacks.Callback):
    """Adds `samples_per_sec` and `step_time_ms` to each epoch's logs.

    Args:
      global_batch_size: examples per step over all replicas.
      warmup_steps: steps at the start of training left out of the figures.
      link: a network interface whose bytes per step to measure too
        (`link_bytes_per_step`), or None.

    Attributes:
      windows: the measured window of each epoch that has one, in order.
    """

    def __init__(self, global_batch_size: int, *, warmup_steps: int = 5, link: Optional[str] = None):
        super().__init__()
        if global_batch_size < 1:
            raise ValueError(f"`global_batch_size` must be >= 1. Received: {global_batch_size}")
        if warmup_steps < 0:
            raise ValueError(f"`warmup_steps` must be >= 0. Received: {warmup_steps}")
        self.global_batch_size = global_batch_size
        self.warmup_steps = warmup_steps
        self.link = link
        self.windows: list[Window] = []
        self._steps_seen = 0
        self._wait_for_steps: Callable[[], None] = _nothing

    def on_train_begin(self, logs=None):
        self.windows = []
        self._steps_seen = 0
        self._wait_for_steps = _completion_wait(self.model)

    def on_epoch_begin(self, epoch, logs=None):
        self._last_batch = -1
        self._steps = 0
        # Nothing is queued between epochs: the last one's logs waited for all its steps.
        self._start = time.perf_counter() if self._steps_seen >= self.warmup_steps else None
        self._end = self._start
        self._counters_at_start = self._counters_at_end = self._counters()

    def on_train_batch_end(self, batch, logs=None):
        steps = batch - self._last_batch  # > 1 with steps_per_execution
        self._last_batch = batch
        self._steps_seen += steps
        epoch_steps = (self.params or {}).get("steps")
        last_of_epoch = bool(epoch_steps) and batch + 1 >= epoch_steps
        warmup_ends = self._start is None and self._steps_seen >= self.warmup_steps
        if warmup_ends or last_of_epoch:
            self._wait_for_steps()
        now = time.perf_counter()
        # The counters only matter at the window's ends; an epoch of unknown length may end at any step.
        if warmup_ends or last_of_epoch or not epoch_steps:
            self._counters_at_end = self._counters()
        if warmup_ends:
            self._start, self._counters_at_start = now, self._counters_at_end
        elif self._start is not None:
            self._steps += steps
        self._end = now

    def on_epoch_end(self, epoch, logs=None):
        if not self._steps:
            return
        sent, received, busy, retransmitted = (end - start for start, end in
                                               zip(self._counters_at_start, self._counters_at_end))
        window = Window(self._start, self._end, self._steps, sent, received, busy, retransmitted)
        self.windows.append(window)
        if logs is not None:
            logs["samples_per_sec"] = self.global_batch_size * window.steps / window.seconds
            logs["step_time_ms"] = 1000 * window.seconds / window.steps

    @property
    def measured_steps(self) -> int:
        return sum(w.steps for w in self.windows)

    @property
    def measured_seconds(self) -> float:
        return sum(w.seconds for w in self.windows)

    @property
    def samples_per_sec(self) -> float:
        """Samples of every measured step over the measured wall time (0 before any)."""
        if not self.windows:
            return 0.0
        return self.global_batch_size * self.measured_steps / self.measured_seconds

    @property
    def step_time_ms(self) -> float:
        """Measured wall time per measured step, in milliseconds (0 before any)."""
        return 1000 * self.measured_seconds / self.measured_steps if self.windows else 0.0

    @property
    def link_bytes_per_step(self) -> Optional[dict[str, float]]:
        """Bytes the link sent and received per measured step; None without a link or a measured step."""
        if not self.link or not self.windows:
            return None
        steps = self.measured_steps
        return {"sent": sum(w.sent for w in self.windows) / steps,
                "received": sum(w.received for w in self.windows) / steps}

    @property
    def link_retransmits_per_step(self) -> Optional[float]:
        """TCP segments the host retransmitted per measured step; None without a link or a measured step."""
        if not self.link or not self.windows:
            return None
        return sum(w.retransmitted for w in self.windows) / self.measured_steps

    @property
    def host_cpu_busy(self) -> Optional[float]:
        """The share of the machine's cores busy over the measured steps (1.0: all of them all the
        time); None under MIN_BUSY_SECONDS of them, where the counters' ticks would blur it."""
        if self.measured_seconds < MIN_BUSY_SECONDS:
            return None
        busy = sum(w.busy_core_seconds for w in self.windows)
        return min(1.0, busy / (self.measured_seconds * psutil.cpu_count()))  # above 1.0: the ticks' blur

    def _counters(self) -> tuple[int, int, float, int]:
        """Bytes sent and received by the link so far (Linux's counters), the seconds the machine's cores
        have been busy, summed over them, and the TCP segments retransmitted in this network namespace
        (the counts 0 without a link)."""
        times = psutil.cpu_times()
        # Linux counts a guest's time in user and nice already.
        busy = sum(times) - sum(getattr(times, name, 0.0) for name in ("idle", "iowait", "guest", "guest_nice"))
        if not self.link:
            return 0, 0, busy, 0
        statistics = f"/sys/class/net/{self.link}/statistics"
        with open(f"{statistics}/tx_bytes") as sent, open(f"{statistics}/rx_bytes") as received:
            return int(sent.read()), int(received.read()), busy, _tcp_retransmitted_segments()


def _tcp_retransmitted_segments() -> int:
    """RetransSegs of /proc/net/snmp's `Tcp:` table (a header line, then a line of values)."""
    with open("/proc/net/snmp") as snmp:
        header, values = [line.split() for line in snmp if line.startswith("Tcp:")]
    return int(values[header.index("RetransSegs")])


def _nothing() -> None:
    pass


def _completion_wait(model) -> Callable[[], None]:
    """What waits until every step Keras has called has finished: the strategy's
    `wait_for_steps` where it schedules steps asynchronously; with any other
    strategy a step has finished when its call returns."""
    strategy = getattr(model, "distribute_strategy", None)  # a callback used without a model has none
    return contract(strategy).wait_for_steps if strategy is not None else _nothing


def fit_round(model, dataset, *, batch: int, steps: int, warmup_steps: int = 1) -> Callable[[], float]:
    """A round for `tfdist.timing.alternate`: `model.fit` for `steps` steps; returns its wall time per step (ms),
    the first `warmup_steps` left out. Slow steps (input stalls) count in full."""

    def one_round() -> float:
        timer = Throughput(batch, warmup_steps=warmup_steps)
        model.fit(dataset, epochs=1, steps_per_epoch=steps, verbose=0, shuffle=False, callbacks=[timer])
        return timer.step_time_ms

    return one_round
