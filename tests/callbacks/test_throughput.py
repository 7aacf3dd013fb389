"""Throughput: warm-up excluded, per-epoch logs, steps_per_execution, queued steps timed when finished."""

import subprocess
import time
import types

import keras
import numpy as np
import psutil
import pytest

from tfdist.callbacks import Throughput, throughput as throughput_module
from tfdist.contract import StrategyContract


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(throughput_module.time, "perf_counter", fake)
    return fake


def _epoch(callback, clock, step_seconds, logs, stride=1):
    """One epoch of len(step_seconds) calls of `stride` steps; Keras's params name its steps."""
    callback.set_params({"steps": len(step_seconds) * stride})
    callback.on_epoch_begin(0)
    batch = 0
    for seconds in step_seconds:
        clock.now += seconds
        callback.on_train_batch_end(batch + stride - 1)
        batch += stride
    callback.on_epoch_end(0, logs)


def test_warmup_steps_are_excluded_and_later_epochs_are_timed_from_their_start(clock):
    callback = Throughput(global_batch_size=100, warmup_steps=2)
    callback.on_train_begin()
    logs = {}
    # Steps 1-2 are warm-up; the window opens when step 2 has finished.
    _epoch(callback, clock, [5.0, 5.0, 0.1, 0.1, 0.2], logs)
    [window] = callback.windows
    assert (window.start, window.end, window.steps) == (10.0, pytest.approx(10.4), 3)
    assert callback.host_cpu_busy is None  # under half a second: Linux's ticks would blur it
    assert logs["samples_per_sec"] == pytest.approx(300 / 0.4)
    assert logs["step_time_ms"] == pytest.approx(400 / 3)
    # The next epoch's window opens when it begins: its first step is wall time too.
    logs = {}
    _epoch(callback, clock, [9.0, 0.5, 0.5], logs)
    assert logs["samples_per_sec"] == pytest.approx(300 / 10.0)
    assert callback.samples_per_sec == pytest.approx(600 / 10.4)
    assert callback.step_time_ms == pytest.approx(1000 * 10.4 / 6)


def test_steps_per_execution_counts_every_step(clock):
    callback = Throughput(global_batch_size=10, warmup_steps=0)
    callback.on_train_begin()
    logs = {}
    _epoch(callback, clock, [1.0, 0.4, 0.4], logs, stride=4)
    assert callback.measured_steps == 12
    assert logs["samples_per_sec"] == pytest.approx(120 / 1.8)


class QueuedSteps(StrategyContract):
    """A strategy whose step calls return at once and whose steps run later, one after another
    (ClusterCoordinator.schedule): `wait_for_steps` returns when the last one has run."""

    def __init__(self, clock, seconds_per_step):
        self.clock, self.seconds_per_step, self.done_at = clock, seconds_per_step, 0.0

    def queue(self):
        self.done_at = max(self.done_at, self.clock.now) + self.seconds_per_step

    def wait_for_steps(self):
        self.clock.now = max(self.clock.now, self.done_at)


def test_queued_steps_count_when_they_have_finished_not_when_queued(clock):
    strategy = QueuedSteps(clock, seconds_per_step=1.0)
    callback = Throughput(global_batch_size=10, warmup_steps=2)
    callback.set_model(types.SimpleNamespace(distribute_strategy=strategy))
    callback.on_train_begin()
    callback.set_params({"steps": 10})
    logs = {}
    callback.on_epoch_begin(0)
    for batch in range(10):
        clock.now += 0.01  # the call that queues the step
        strategy.queue()
        callback.on_train_batch_end(batch)
    callback.on_epoch_end(0, logs)
    # Warm-up ends when step 2 has run (t = 2.01); step 3 is queued after that, and the
    # epoch ends when step 10 has run (t = 10.02): 8 steps in 8.01 s, where the calls took 0.08.
    [window] = callback.windows
    assert (window.start, window.end, window.steps) == (pytest.approx(2.01), pytest.approx(10.02), 8)
    assert logs["samples_per_sec"] == pytest.approx(80 / 8.01)
    assert callback.step_time_ms == pytest.approx(8010 / 8)


def test_nothing_measured_reports_zero(clock):
    callback = Throughput(global_batch_size=10, warmup_steps=10)
    callback.on_train_begin()
    logs = {}
    _epoch(callback, clock, [1.0, 1.0], logs)
    assert "samples_per_sec" not in logs
    assert callback.samples_per_sec == 0.0 and callback.step_time_ms == 0.0  # exact: nothing was timed


@pytest.mark.parametrize("args", [dict(global_batch_size=0), dict(global_batch_size=8, warmup_steps=-1)])
def test_bad_arguments(args):
    with pytest.raises(ValueError, match="must be >= "):
        Throughput(**args)


def test_host_cpu_busy_counts_a_core_kept_busy_during_the_steps():
    """A callback that spins a core for 40 ms every step keeps at least that core's share busy (the
    machine's other processes can only add to it)."""

    class Spin(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            end = time.process_time() + 0.04
            while time.process_time() < end:
                pass

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    callback = Throughput(global_batch_size=8, warmup_steps=1)
    x, y = np.ones((160, 4), "float32"), np.ones((160, 1), "float32")
    model.fit(x, y, batch_size=8, epochs=1, callbacks=[Spin(), callback], verbose=0)
    spun = 0.04 * callback.measured_steps / callback.measured_seconds  # cores' worth of the spinning alone
    blur = 0.02 / callback.measured_seconds  # two readings of 10 ms ticks
    assert spun / psutil.cpu_count() - blur <= callback.host_cpu_busy <= 1.0
    assert all(w.busy_core_seconds > 0 for w in callback.windows)


def test_in_a_real_fit_the_figures_reach_the_history():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    callback = Throughput(global_batch_size=8, warmup_steps=1)
    x, y = np.ones((64, 4), "float32"), np.ones((64, 1), "float32")
    history = model.fit(x, y, batch_size=8, epochs=2, callbacks=[callback], verbose=0)
    assert [w.steps for w in callback.windows] == [7, 8]  # epoch 1: steps 2..8 (1 is warm-up); epoch 2: all
    assert all(v > 0 for v in history.history["samples_per_sec"])
    assert all(v > 0 for v in history.history["step_time_ms"])


def test_the_retransmit_counter_reads_what_iproute2s_nstat_reads():
    # Both read this network namespace's /proc/net/snmp; -s leaves nstat's history file alone.
    nstat = subprocess.run(["nstat", "-azs", "TcpRetransSegs"], capture_output=True, text=True, check=True)
    (count,) = [int(line.split()[1]) for line in nstat.stdout.splitlines() if line.startswith("TcpRetransSegs")]
    assert count <= throughput_module._tcp_retransmitted_segments() <= count + 100  # a counter only grows
