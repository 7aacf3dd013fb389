"""tfdist.layers' tensor-parallel layers: Keras's own layers, split by a strategy's model axis (Megatron's split),
against the plain Keras layers on one device."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfdist.layers import ColumnParallelDense, ParallelMLP, ParallelMultiHeadAttention, RowParallelDense
from tfdist.parallel import DeviceGroup
from tfdist.parallel.layout import LayoutError
from tfdist.parallel.split_variables import is_split, shards
from tfdist.strategies import TensorParallelStrategy

TOLERANCE = 1e-5
X = np.random.default_rng(0).standard_normal((32, 6, 8)).astype("float32")


class _TwoDense(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden, self.out = keras.layers.Dense(8, activation="gelu"), keras.layers.Dense(8)

    def call(self, x):
        return self.out(self.hidden(x))


class _Attention(keras.layers.Layer):
    """An attention layer called on itself, causal or not."""

    def __init__(self, attention, causal, **kwargs):
        super().__init__(**kwargs)
        self.attention, self.causal = attention, causal

    def call(self, x):
        return self.attention(x, x, use_causal_mask=self.causal)


# name -> (the tfdist layer, the plain Keras layer that computes the same), each on (batch, 6, 8) inputs
LAYERS = {
    "column": (lambda: ColumnParallelDense(8, activation="tanh"), lambda: keras.layers.Dense(8, activation="tanh")),
    "row": (lambda: RowParallelDense(8, activation="relu"), lambda: keras.layers.Dense(8, activation="relu")),
    "mlp": (lambda: ParallelMLP(8), _TwoDense),
    "attention": (lambda: _Attention(ParallelMultiHeadAttention(4, 3), causal=False),
                  lambda: _Attention(keras.layers.MultiHeadAttention(4, 3), causal=False)),
    "causal_attention": (lambda: _Attention(ParallelMultiHeadAttention(4, 3), causal=True),
                         lambda: _Attention(keras.layers.MultiHeadAttention(4, 3), causal=True)),
}


def _model(make_layer):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6, 8)), make_layer(), keras.layers.GlobalAveragePooling1D(),
                              keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@pytest.mark.parametrize("name", LAYERS)
def test_each_layer_split_over_two_devices_trains_as_the_plain_keras_layer(name):
    tfdist_layer, plain_layer = LAYERS[name]
    with TensorParallelStrategy(["/cpu:0", "/cpu:1"]).scope():
        split = _model(tfdist_layer)
    plain = _model(plain_layer)
    plain.set_weights(split.get_weights())  # the same start (the layers draw their initial values in other orders)
    y = np.random.default_rng(1).integers(0, 3, 32)
    for model in (split, plain):
        model.fit(X, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert any(is_split(v) for v in split.weights)
    for got, whole in zip(split.get_weights(), plain.get_weights()):  # the plain layers' weights, in their order
        np.testing.assert_allclose(got, whole, atol=TOLERANCE)


def test_each_device_holds_half_of_every_split_kernel():
    with TensorParallelStrategy(["/cpu:0", "/cpu:1"]).scope():
        model = _model(lambda: ParallelMLP(64))
        model.fit(X, np.zeros(32), verbose=0)
    mlp = model.layers[0]
    split = [v for v in mlp.weights if is_split(v)]
    assert [v.path.split("/", 2)[2] for v in split] == ["hidden/kernel", "hidden/bias", "output/kernel"]
    for variable in split:
        assert [tf.DeviceSpec.from_string(s.device).device_index for s in shards(variable)] == [0, 1]
        assert [s.shape.num_elements() for s in shards(variable)] == [variable.shape.num_elements() // 2] * 2
    assert not is_split(mlp.output_dense.bias)


def test_a_model_trained_split_saves_as_the_plain_layers_and_loads_on_one_device(tmp_path):
    with TensorParallelStrategy(["/cpu:0", "/cpu:1"]).scope():
        model = _model(lambda: ParallelMLP(8))
        model.fit(X, np.zeros(32), verbose=0)
    model.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras")  # no strategy: the plain layers, whole
    assert not any(is_split(v) for v in loaded.weights)
    np.testing.assert_allclose(loaded.predict(X, verbose=0), model.predict(X, verbose=0), atol=TOLERANCE)
    plain = _model(_TwoDense)
    plain.set_weights(model.get_weights())  # the layout of two Dense layers
    np.testing.assert_allclose(plain.predict(X, verbose=0), model.predict(X, verbose=0), atol=TOLERANCE)


@pytest.mark.parametrize("make, message", [
    (lambda: ColumnParallelDense(5), r"Layer 'column_parallel_dense.*' splits axis 1 of its kernel \(shape \(8, 5\)\) "
                                     "over 2 devices, which does not divide it"),
    (lambda: ParallelMLP(7), r"of its kernel \(shape \((8, 7|7, 8)\)\) over 2 devices, which does not divide it"),
    (lambda: _Attention(ParallelMultiHeadAttention(3, 4), causal=False), r"has 3 heads, which do not divide over 2"),
])
def test_sizes_that_do_not_split_are_one_line_at_the_first_step(make, message):
    with TensorParallelStrategy(["/cpu:0", "/cpu:1"]).scope():
        model = _model(make)
    with pytest.raises(LayoutError, match=message):
        model.fit(X, np.zeros(32), verbose=0)


def test_outside_a_strategy_the_layers_are_keras_layers():
    out = ParallelMLP(8)(X)
    assert out.shape == (32, 6, 8)
    assert isinstance(ParallelMultiHeadAttention(2, 4), keras.layers.MultiHeadAttention)


@pytest.mark.parametrize("devices, message", [
    (["/cpu:0", "/cpu:9"], r"must exist in this process; \['/cpu:9'\] do not"),
    (["/gpu:0"], r"must exist in this process; \['/gpu:0'\] do not"),
    (["/cpu:1", "/device:CPU:1"], "must not repeat a device"),
    ([], "at least one device"),
])
def test_bad_device_groups_are_clear_errors(devices, message):
    with pytest.raises(ValueError, match=message):
        DeviceGroup(devices)
