"""InputStalls: the wait arithmetic on a hand-made trace, then real profiles of a slow and a fast input."""

import time
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.tsl.profiler.protobuf import xplane_pb2

from helpers import run_tfdist, train_with_metrics
from tfdist.callbacks import InputStalls
from tfdist.callbacks.input_stalls import HINT, input_wait_ns

START = 1_700_000_000_000_000_000  # the profile's start, wall-clock ns


def _space(lines):
    """An XSpace like the profiler's: line times relative to the start; `lines` = [[(name, start_ns, ns)]]."""
    space = xplane_pb2.XSpace()
    host = space.planes.add(name="/host:CPU")
    names = {"IteratorGetNextOp::DoCompute": 1, "MatMul": 2, "IteratorGetNextAsOptionalOp::DoCompute": 3}
    for name, key in names.items():
        host.event_metadata[key].id, host.event_metadata[key].name = key, name
    for events in lines:
        line = host.lines.add(timestamp_ns=0)
        for name, start, duration in events:
            line.events.add(metadata_id=names[name], offset_ps=start * 1000, duration_ps=duration * 1000)
    env = space.planes.add(name="Task Environment")
    env.stat_metadata[1].id, env.stat_metadata[1].name = 1, "profile_start_time"
    env.stats.add(metadata_id=1, uint64_value=START)
    return space


def test_waits_of_replicas_side_by_side_count_once_and_the_window_clips():
    space = _space([
        [("IteratorGetNextOp::DoCompute", 100, 50), ("MatMul", 150, 500), ("IteratorGetNextOp::DoCompute", 700, 100)],
        [("IteratorGetNextOp::DoCompute", 120, 60), ("IteratorGetNextAsOptionalOp::DoCompute", 950, 100)],
    ])
    # [100, 180) from both replicas, [700, 800), [950, 1050) cut at 1000; the MatMul is not a wait.
    assert input_wait_ns(space, START, START + 1000) == 80 + 100 + 50
    assert input_wait_ns(space, START + 690, START + 760) == 60
    assert input_wait_ns(space, START + 2000, START + 3000) == 0


def _fit(dataset, callback, steps=30, epochs=1):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(1024, activation="relu"), keras.layers.Dense(10)])
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model.fit(dataset, steps_per_epoch=steps, epochs=epochs, verbose=0, shuffle=False, callbacks=[callback])


def _examples():
    rng = np.random.default_rng(0)
    return tf.data.Dataset.from_tensor_slices((rng.random((512, 64), "float32"), rng.integers(0, 10, 512)))


def test_a_slow_input_is_reported_with_the_hint(capsys):
    def slow(x, y):
        def wait(value):
            time.sleep(0.001)
            return value

        x = tf.py_function(wait, [x], tf.float32)
        x.set_shape((64,))
        return x, y

    stalls = InputStalls(start_step=3, steps=10)
    history = _fit(_examples().repeat().map(slow).batch(32), stalls)  # 32 ms of waiting per batch, nothing ahead
    assert stalls.input_wait_share > 0.5
    assert history.history["input_wait_share"] == [stalls.input_wait_share]
    out = capsys.readouterr().out
    assert f"input stalls: {stalls.input_wait_share:.0%} of step time waiting for input (steps 3-12:" in out
    assert stalls.step_time_ms > 32 and f"of {stalls.step_time_ms:.1f} ms per step)" in out
    assert HINT in out


def test_a_prefetched_in_memory_input_does_not_stall(capsys):
    stalls = InputStalls(start_step=3, steps=10)
    # Batches of 2048 make a step of 20 ms or more on every machine here: with 32 (3 ms), a 0.3 ms scheduling
    # hiccup on a busy 2-core machine was already 10% of the step, and with 256 the AVX-512 EPYC's 3.5 ms step
    # saw a 0.5 ms one as 14%.
    _fit(_examples().repeat(4).batch(2048).cache().repeat().prefetch(tf.data.AUTOTUNE), stalls)
    assert 0 <= stalls.input_wait_share < 0.1
    assert "hint" not in capsys.readouterr().out


def test_the_window_ends_with_the_epoch_before_validation():
    stalls = InputStalls(start_step=2, steps=50, verbose=False)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    data = _examples().batch(32)
    history = model.fit(data, validation_data=data, epochs=2, verbose=0, callbacks=[stalls])
    assert stalls.report.startswith("input stalls:") and "(steps 2-15:" in stalls.report  # 16 steps per epoch
    assert "input_wait_share" in history.history  # logged once, in the first epoch's logs
    assert len(history.history["input_wait_share"]) == 1


def test_no_window_or_a_busy_profiler_is_one_warning(tmp_path):
    with pytest.warns(UserWarning, match="training ended after 10 step"):
        _fit(_examples().batch(32).repeat(), InputStalls(start_step=20), steps=10)
    tf.profiler.experimental.start(str(tmp_path))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            stalls = InputStalls(start_step=1, steps=3)
            _fit(_examples().batch(32).repeat(), stalls, steps=10)
    finally:
        tf.profiler.experimental.stop()
    assert [str(w.message) for w in caught if "InputStalls" in str(w.message)] == [
        "InputStalls: another profiler session is running; no input-stall report."
    ]
    assert stalls.input_wait_share is None


def test_a_profile_without_a_trace_is_one_warning(monkeypatch):
    from tfdist.callbacks import input_stalls

    monkeypatch.setattr(input_stalls.glob, "glob", lambda pattern: [])
    stalls = InputStalls(start_step=1, steps=3)
    with pytest.warns(UserWarning, match="the profiler wrote no trace"):
        _fit(_examples().batch(32).repeat(), stalls, steps=10)
    assert stalls.input_wait_share is None and stalls.report == ""


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match=r"`steps` must be >= 1. Received: 0"):
        InputStalls(steps=0)
    with pytest.raises(ValueError, match=r"`threshold` must be in \(0, 1\). Received: 1.5"):
        InputStalls(threshold=1.5)


@pytest.mark.slow
def test_config_switch_reports_input_stalls_in_the_summary(tmp_path):
    proc, result = train_with_metrics(
        tmp_path, "configs/default.yaml", "train.epochs=1", "callbacks.input_stalls=true",
        "callbacks.input_stalls_steps=8", f"callbacks.tensorboard_dir={tmp_path / 'tb'}", timeout=300,
    )
    assert 0 <= result["input_wait_share"] < 1
    assert "  input stalls    " in proc.stdout and "(steps 5-12:" in proc.stdout
    assert list((tmp_path / "tb" / "plugins" / "profile").glob("*/*.xplane.pb"))  # for TensorBoard's Profile tab


def test_parameter_server_refuses_input_stalls():
    proc = run_tfdist("config", "--set", "strategy.kind=parameter_server", "--set", "callbacks.input_stalls=true")
    assert proc.returncode == 2
    assert "`callbacks.input_stalls` is not available with parameter_server" in proc.stderr
