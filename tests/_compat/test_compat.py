"""tfdist._compat: the trainer hooks strategies use to supply Keras's step functions."""

import keras
import pytest
import tensorflow as tf

from helpers import tensorflow_mirrored
from tfdist.contract import StrategyContract


def test_trainer_hooks_are_made_again_after_a_recompile():
    made = []

    class Strategy(StrategyContract, tf.distribute.OneDeviceStrategy):  # installs the patches when made
        def keras_hooks(self, model):
            made.append(model.optimizer)
            return {}

    with Strategy("/cpu:0").scope():
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    model.make_train_function()
    model.make_test_function()
    assert len(made) == 1  # once per compile, shared by every step function
    model.compile(optimizer="adam", loss="mse")
    model.make_train_function()
    assert len(made) == 2 and made[1] is model.optimizer


def test_versions_outside_the_tested_ones_warn_once_naming_them():
    import warnings

    from tfdist import _compat

    assert _compat.check_versions({"tensorflow": "2.21.0", "keras": "3.15.1"}) == []
    with pytest.warns(UserWarning, match=r"tested with tensorflow 2\.21, keras 3\.15; this environment has keras 3\.16\.0"):
        assert _compat.check_versions({"tensorflow": "2.21.0", "keras": "3.16.0"}) == ["keras 3.16.0"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _compat.check_versions() == []  # the environment the suite runs in is the tested one


def test_a_keras_file_saved_under_a_strategys_scope_creates_no_variable_there(tmp_path):
    """Keras's saving built a bare `Optimizer(1.0)` on every save; under a multi-worker strategy's scope its
    variable's initial value is broadcast from the chief, so ModelCheckpoint's save on the chief alone waited for
    workers that never joined. The bare objects are built once, outside any strategy."""
    from tfdist import MirroredStrategy

    created = []

    def creator(next_creator, **kwargs):
        created.append(kwargs.get("name"))
        return next_creator(**kwargs)

    with MirroredStrategy(["/cpu:0", "/cpu:1"]).scope():
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        model.compile(optimizer="adam", loss="mse", metrics=["mae"])
        model.optimizer.build(model.trainable_variables)
        with tf.variable_creator_scope(creator):
            model.save(tmp_path / "first.keras")
            model.save(tmp_path / "second.keras")
    assert created == []
    assert keras.models.load_model(tmp_path / "second.keras").optimizer.iterations.numpy() == 0


def test_keras_builds_the_model_without_reading_a_distributed_iterator(monkeypatch):
    """Keras builds the model from a first batch read from a distributed iterator it drops at once, at every
    fit and evaluate; such drops crashed TensorFlow natively under load. tfdist's build reads the batch before
    distribution, and only while something is unbuilt."""
    import traceback

    import numpy as np
    from tensorflow.python.data.ops import multi_device_iterator_ops

    from tfdist import MirroredStrategy

    made_by_build = []
    init = multi_device_iterator_ops.OwnedMultiDeviceIterator.__init__

    def counted(self, *args, **kwargs):
        if any("symbolic_build" in frame.name for frame in traceback.extract_stack()):
            made_by_build.append(self)
        init(self, *args, **kwargs)

    monkeypatch.setattr(multi_device_iterator_ops.OwnedMultiDeviceIterator, "__init__", counted)
    with MirroredStrategy(["/cpu:0", "/cpu:1"]).scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="softmax")])
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    x, y = np.ones((24, 4), "float32"), np.arange(24) % 3
    history = model.fit(x, y, batch_size=8, epochs=2, validation_data=(x[:5], y[:5]), verbose=0)
    model.evaluate(x[:5], y[:5], verbose=0)
    assert made_by_build == [] and len(history.history["val_accuracy"]) == 2


@pytest.mark.parametrize("kind", ["mirrored", "pipeline"])
def test_autograph_converts_a_custom_loops_step_and_leaves_tfdist_as_it_is(cpus, kind):
    """tfdist's modules are excluded from AutoGraph as TensorFlow's and Keras's are (a fresh process spent
    most of its trace rewriting them), while a user's step that branches on a tensor still becomes a
    `tf.cond` under `strategy.run`, as with TensorFlow's own strategies."""
    from tensorflow.python.autograph.impl import conversion

    from tfdist import MirroredStrategy
    from tfdist.parallel import partition
    from tfdist.strategies import PipelineStrategy

    strategy = (MirroredStrategy(["/cpu:0", "/cpu:1"]) if kind == "mirrored"
                else PipelineStrategy(2, 2, devices=["/cpu:0", "/cpu:1"], verbose=False))
    assert conversion.is_allowlisted(partition.split)

    def step(x):
        if tf.reduce_sum(x) > 0:  # a tensor in Python's `if`: runs only if AutoGraph converted the step
            return x * 2.0
        return -x

    @tf.function
    def run(x):
        return strategy.run(step, args=(x,))

    results = strategy.experimental_local_results(run(tf.constant([1.0, 2.0])))
    assert [r.numpy().tolist() for r in results] == [[2.0, 4.0]] * len(results)


@pytest.mark.parametrize("kind", ["tfdist", "tensorflow"])
def test_each_epoch_starts_one_iterator_over_the_devices(monkeypatch, cpus, kind):
    """Keras starts an iterator for the next epoch at each epoch's end and another at its start, dropping the
    first unread: under tfdist's strategies an iterator starts when a step reads it, so an epoch of `fit` or
    `evaluate` costs one MultiDeviceIterator. TensorFlow's own strategy keeps Keras's behaviour."""
    import numpy as np
    from tensorflow.python.data.ops import multi_device_iterator_ops

    import tfdist

    started = []
    init = multi_device_iterator_ops.OwnedMultiDeviceIterator.__init__

    def counted(self, *args, **kwargs):
        if kwargs.get("components") is None:  # not one a traced step rebuilds from its tensors
            started.append(self)
        init(self, *args, **kwargs)

    monkeypatch.setattr(multi_device_iterator_ops.OwnedMultiDeviceIterator, "__init__", counted)
    strategy = {"tfdist": tfdist.MirroredStrategy, "tensorflow": tensorflow_mirrored}[kind]
    with strategy(["/cpu:0", "/cpu:1"]).scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="softmax")])
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    x, y = np.ones((24, 4), "float32"), np.arange(24) % 3
    history = model.fit(x, y, batch_size=8, epochs=3, validation_data=(x[:8], y[:8]), verbose=0)
    model.evaluate(x, y, batch_size=8, verbose=0)
    assert len(history.history["val_accuracy"]) == 3
    # Epochs of fit, of its validation and of evaluate: 3 + 3 + 1; Keras's own: two for each, and one for each of
    # its 5 builds (fit, each validation, evaluate), which read a batch from an iterator over the devices.
    assert len(started) == {"tfdist": 7, "tensorflow": 19}[kind]
