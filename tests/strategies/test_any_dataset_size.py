"""Datasets of any size train, evaluate and predict under every in-process strategy as on one device.

61 training examples in batches of 8 end each epoch with a batch of 5, which
does not divide over 2 or 4 replicas (3 + 2, or 2 + 1 + 1 + 1); 3 validation
and 5 evaluation examples are one partial batch each, and over 4 replicas one
replica gets none. Keras 3 with TensorFlow's own MirroredStrategy fails on such
a batch (keras-team/keras#19246), and weights every replica alike, so a
partial batch's step is not one device's. The multi-process kinds are in
test_any_dataset_size_multiprocess.py.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfdist import MirroredStrategy
from tfdist.layers import ColumnParallelDense, RowParallelDense
from tfdist.parallel import DeviceGroup
from tfdist.strategies import PipelineStrategy, TensorParallelStrategy

FOUR = ["/cpu:0", "/cpu:1", "/cpu:2", "/cpu:3"]
BATCH = 8
_rng = np.random.default_rng(0)
X = _rng.standard_normal((69, 20)).astype("float32")
Y = _rng.integers(0, 3, 69)
TRAIN, VALIDATION, EVALUATE = slice(0, 61), slice(61, 64), slice(64, 69)


def _dense():
    return [keras.layers.Dense(16, activation="relu"), keras.layers.Dense(16, activation="relu")]


def _tensor_parallel():
    return [ColumnParallelDense(16, activation="relu"), RowParallelDense(16)]


def _run(strategy, hidden):
    """fit (2 epochs, with validation), evaluate and predict; (history, weights, evaluation, predictions)."""
    with strategy.scope():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((20,)), *hidden(), keras.layers.Dense(3, activation="softmax")])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"])
    history = model.fit(X[TRAIN], Y[TRAIN], batch_size=BATCH, epochs=2, shuffle=False,
                        validation_data=(X[VALIDATION], Y[VALIDATION]), verbose=0).history
    evaluation = model.evaluate(X[EVALUATE], Y[EVALUATE], batch_size=BATCH, verbose=0)
    predictions = model.predict(X[EVALUATE], batch_size=BATCH, verbose=0)
    weights = [w for layer in model.layers for w in getattr(layer, "unsharded_weights", layer.get_weights)()]
    return history, weights, evaluation, predictions


@pytest.mark.parametrize("make,hidden", [
    pytest.param(lambda: MirroredStrategy(FOUR[:2]), _dense, id="mirrored-2"),
    pytest.param(lambda: MirroredStrategy(FOUR), _dense, id="mirrored-4"),
    pytest.param(lambda: PipelineStrategy(2, 2, devices=FOUR, verbose=False), _dense, id="pipeline-2x2"),
    pytest.param(lambda: TensorParallelStrategy(FOUR[:2]), _tensor_parallel, id="tensor_parallel"),
    pytest.param(lambda: TensorParallelStrategy(FOUR, group_size=2), _tensor_parallel, id="tensor_parallel-2x2"),
])
def test_sizes_that_do_not_divide_the_batch_match_one_device(make, hidden):
    one_device = _run(DeviceGroup(["/cpu:0"]) if hidden is _tensor_parallel else tf.distribute.OneDeviceStrategy(
        "/cpu:0"), hidden)
    history, weights, evaluation, predictions = _run(make(), hidden)
    expected_history, expected_weights, expected_evaluation, expected_predictions = one_device
    assert history.keys() == expected_history.keys() == {"loss", "accuracy", "val_loss", "val_accuracy"}
    for key, values in expected_history.items():
        np.testing.assert_allclose(history[key], values, atol=1e-5, err_msg=key)
    for a, b in zip(weights, expected_weights):
        np.testing.assert_allclose(a, b, atol=1e-5)
    np.testing.assert_allclose(evaluation, expected_evaluation, atol=1e-5)
    assert predictions.shape == (5, 3)
    np.testing.assert_allclose(predictions, expected_predictions, atol=1e-5)  # in order
