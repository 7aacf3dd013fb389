"""Throughput: warm-up excluded, per-epoch logs, steps_per_execution."""

import keras
import numpy as np
import pytest

from tfdist.callbacks import Throughput, throughput as throughput_module


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


def _epoch(callback, clock, step_seconds, logs, first_batch=0, stride=1):
    callback.on_epoch_begin(0)
    batch = first_batch
    for seconds in step_seconds:
        clock.now += seconds
        callback.on_train_batch_end(batch + stride - 1)
        batch += stride
    callback.on_epoch_end(0, logs)


def test_warmup_steps_and_first_step_of_each_epoch_are_excluded(clock):
    callback = Throughput(global_batch_size=100, warmup_steps=2)
    callback.on_train_begin()
    logs = {}
    # Steps 1-2 are warm-up; step 3's interval starts after step 2: measured.
    _epoch(callback, clock, [5.0, 5.0, 0.1, 0.1, 0.2], logs)
    assert callback.step_times == pytest.approx([0.1, 0.1, 0.2])
    assert logs["samples_per_sec"] == pytest.approx(300 / 0.4)
    assert logs["step_time_ms"] == pytest.approx(100)
    # Next epoch: the first step has no previous batch end in this epoch.
    logs = {}
    _epoch(callback, clock, [9.0, 0.5, 0.5], logs)
    assert logs["samples_per_sec"] == pytest.approx(200 / 1.0)
    assert callback.samples_per_sec == pytest.approx(500 / 1.4)


def test_steps_per_execution_counts_every_step(clock):
    callback = Throughput(global_batch_size=10, warmup_steps=0)
    callback.on_train_begin()
    logs = {}
    _epoch(callback, clock, [1.0, 0.4, 0.4], logs, stride=4)
    assert callback.step_times == pytest.approx([0.1] * 8)
    assert logs["samples_per_sec"] == pytest.approx(100.0)


def test_nothing_measured_reports_zero(clock):
    callback = Throughput(global_batch_size=10, warmup_steps=10)
    callback.on_train_begin()
    logs = {}
    _epoch(callback, clock, [1.0, 1.0], logs)
    assert "samples_per_sec" not in logs
    assert callback.samples_per_sec == 0.0


@pytest.mark.parametrize("args", [dict(global_batch_size=0), dict(global_batch_size=8, warmup_steps=-1)])
def test_bad_arguments(args):
    with pytest.raises(ValueError, match="must be >= "):
        Throughput(**args)


def test_in_a_real_fit_the_figures_reach_the_history():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    callback = Throughput(global_batch_size=8, warmup_steps=1)
    x, y = np.ones((64, 4), "float32"), np.ones((64, 1), "float32")
    history = model.fit(x, y, batch_size=8, epochs=2, callbacks=[callback], verbose=0)
    assert len(callback.step_times) == 7 + 7  # epoch 1: steps 2..8 (1 is warm-up); epoch 2: 2..8
    assert all(v > 0 for v in history.history["samples_per_sec"])
    assert all(v > 0 for v in history.history["step_time_ms"])
