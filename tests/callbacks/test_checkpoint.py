"""Checkpoint: atomic saves, fallback, and exact mid-epoch resumes with plain `model.fit`."""

import json
import os
import signal

import keras
import numpy as np
import pytest
import tensorflow as tf

from helpers import tensorflow_mirrored
from tfdist.callbacks import EXIT_PREEMPTED, Checkpoint, weights_digest
from tfdist.checkpoint_store import CheckpointMismatch, CheckpointStore
from tfdist.layers import ColumnParallelDense, RowParallelDense
from tfdist.strategies import PipelineStrategy, TensorParallelStrategy

STEPS_PER_EPOCH = 6


def _data():
    rng = np.random.RandomState(0)
    x = rng.rand(96, 5).astype("float32")
    y = (x.sum(axis=1) > 2.5).astype("int32")
    # A seeded shuffle that reshuffles each pass, repeated: one iterator for the whole fit.
    return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(96, seed=3).repeat().batch(8)


def _model(strategy):
    keras.utils.set_random_seed(0)
    with strategy.scope():
        if isinstance(strategy, TensorParallelStrategy):
            hidden = [ColumnParallelDense(16, activation="relu"), RowParallelDense(16)]
        else:
            hidden = [keras.layers.Dense(16, activation="relu")]
        model = keras.Sequential([
            keras.Input((5,)), *hidden, keras.layers.BatchNormalization(), keras.layers.Dropout(0.3),
            keras.layers.Dense(2),
        ])
        model.compile(optimizer=keras.optimizers.Adam(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model


class _Killed(Exception):
    pass


class _KillAt(keras.callbacks.Callback):
    """Stands for SIGKILL: training stops at this step with no callback's end hooks run."""

    def __init__(self, step):
        super().__init__()
        self.step, self.seen = step, 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.step:
            raise _Killed()


def _fit(strategy, directory, epochs=3, extra=()):
    model = _model(strategy)
    checkpoint = Checkpoint(str(directory), every_steps=4)
    history = model.fit(_data(), epochs=epochs, steps_per_epoch=STEPS_PER_EPOCH, verbose=0,
                        callbacks=[checkpoint, *extra])
    return model, checkpoint, history


STRATEGIES = {
    "one_device": lambda: tf.distribute.OneDeviceStrategy("/cpu:0"),
    "mirrored": tensorflow_mirrored,
    "pipeline": lambda: PipelineStrategy(2, 4, devices=["/cpu:0", "/cpu:1"], verbose=False),
    "tensor_parallel": lambda: TensorParallelStrategy(["/cpu:0", "/cpu:1"]),
}


@pytest.mark.parametrize("kind", STRATEGIES)
def test_a_run_killed_mid_epoch_resumes_to_the_same_weights_and_history(tmp_path, kind):
    strategy = STRATEGIES[kind]()
    whole, _, whole_history = _fit(strategy, tmp_path / "whole")
    with pytest.raises(_Killed):
        _fit(strategy, tmp_path / "killed", extra=[_KillAt(11)])  # epoch 1, step 5; last checkpoint at step 8
    assert CheckpointStore(str(tmp_path / "killed")).steps()[0] == 8
    resumed, checkpoint, history = _fit(strategy, tmp_path / "killed")
    assert checkpoint.resumed_from_step == 8
    assert weights_digest(resumed) == weights_digest(whole)
    # Epoch 1's logs include the steps before the kill, so they equal the uninterrupted run's.
    for key in ("loss", "accuracy"):
        assert history.history[key] == whole_history.history[key][1:], key
    assert int(resumed.optimizer.iterations.numpy()) == 3 * STEPS_PER_EPOCH


def test_a_run_resumed_at_an_epoch_boundary_starts_the_next_epoch(tmp_path):
    strategy = tf.distribute.get_strategy()
    whole, _, _ = _fit(strategy, tmp_path / "whole")
    model = _model(strategy)
    model.fit(_data(), epochs=2, steps_per_epoch=STEPS_PER_EPOCH, verbose=0,
              callbacks=[Checkpoint(str(tmp_path / "killed"))])  # saves at each epoch end
    assert json.load(open(os.path.join(CheckpointStore(str(tmp_path / "killed")).path(12), "meta.json")))[
        "step_in_epoch"] == 0
    resumed, checkpoint, history = _fit(strategy, tmp_path / "killed")
    assert checkpoint.resumed_from_step == 12 and len(history.history["loss"]) == 1
    assert weights_digest(resumed) == weights_digest(whole)


class _SigtermDuringValidation(keras.callbacks.Callback):
    """A scheduler's SIGTERM arriving in the middle of the first epoch's validation; counts what runs after it."""

    def __init__(self):
        super().__init__()
        self.sent, self.train_steps, self.validations = False, 0, 0

    def on_train_batch_end(self, batch, logs=None):
        self.train_steps += 1

    def on_test_begin(self, logs=None):
        self.validations += 1

    def on_test_batch_begin(self, batch, logs=None):
        if batch == 1 and not self.sent:
            self.sent = True
            os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_during_validation_saves_at_the_epoch_end_without_another_step_or_validation(tmp_path):
    strategy = tf.distribute.get_strategy()
    validation = _data().take(3)
    whole = _model(strategy)
    whole.fit(_data(), validation_data=validation, epochs=2, steps_per_epoch=STEPS_PER_EPOCH, verbose=0)
    model, sigterm = _model(strategy), _SigtermDuringValidation()
    with pytest.raises(SystemExit) as exited:
        model.fit(_data(), validation_data=validation, epochs=2, steps_per_epoch=STEPS_PER_EPOCH, verbose=0,
                  callbacks=[Checkpoint(str(tmp_path), every_steps=4), sigterm])
    assert exited.value.code == EXIT_PREEMPTED
    assert (sigterm.train_steps, sigterm.validations) == (STEPS_PER_EPOCH, 1)
    store = CheckpointStore(str(tmp_path))
    assert store.steps()[0] == STEPS_PER_EPOCH
    assert json.load(open(os.path.join(store.path(STEPS_PER_EPOCH), "meta.json")))["step_in_epoch"] == 0
    resumed = _model(strategy)
    checkpoint = Checkpoint(str(tmp_path), every_steps=4)
    resumed.fit(_data(), validation_data=validation, epochs=2, steps_per_epoch=STEPS_PER_EPOCH, verbose=0,
                callbacks=[checkpoint])
    assert checkpoint.resumed_from_step == STEPS_PER_EPOCH
    assert weights_digest(resumed) == weights_digest(whole)


def test_a_save_killed_midway_leaves_the_previous_checkpoint(tmp_path):
    store = CheckpointStore(str(tmp_path), keep=2)
    store.save(1, lambda prefix: open(prefix + ".index", "w").write("one"), {"epoch": 0})

    def dies_while_writing(prefix):
        open(prefix + ".index", "w").write("partial")
        raise KeyboardInterrupt  # the process dies here

    with pytest.raises(KeyboardInterrupt):
        store.save(2, dies_while_writing, {"epoch": 0})
    assert store.steps() == [1]
    assert store.restore_latest(lambda prefix, meta: open(prefix + ".index").read() == "one")["step"] == 1
    for step in (3, 4, 5):
        store.save(step, lambda prefix: open(prefix + ".index", "w").write("x"), {"epoch": 0})
    assert store.steps() == [5, 4]  # keep=2, and the killed save's leftovers are gone
    assert sorted(os.listdir(tmp_path)) == ["step-000000000004", "step-000000000005"]


def test_an_unreadable_latest_checkpoint_falls_back_to_the_one_before_with_one_warning(tmp_path):
    strategy = tf.distribute.get_strategy()
    _fit(strategy, tmp_path, epochs=2)
    store = CheckpointStore(str(tmp_path))
    newest, before = store.steps()[:2]
    data_file = next(n for n in os.listdir(store.path(newest)) if n.startswith("state.data"))
    with open(os.path.join(store.path(newest), data_file), "r+b") as f:
        f.truncate(10)
    with pytest.warns(UserWarning, match=f"checkpoint {store.path(newest)} cannot be read") as warned:
        _, checkpoint, _ = _fit(strategy, tmp_path, epochs=2)
    assert len([w for w in warned if "cannot be read" in str(w.message)]) == 1
    assert checkpoint.resumed_from_step == before


def test_checkpoints_of_another_model_are_an_error_not_a_fallback(tmp_path):
    strategy = tf.distribute.get_strategy()
    _fit(strategy, tmp_path, epochs=1)
    keras.utils.set_random_seed(0)
    other = keras.Sequential([keras.Input((5,)), keras.layers.Dense(2)])
    other.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(CheckpointMismatch, match="were written for another model"):
        other.fit(_data(), epochs=2, steps_per_epoch=STEPS_PER_EPOCH, verbose=0,
                  callbacks=[Checkpoint(str(tmp_path))])
