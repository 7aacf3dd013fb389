"""Tensor-parallel layers on 2 logical CPUs against the plain Keras layers."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from helpers import ops_per_device
from tfdist.layers import ColumnParallelDense, ParallelMLP, ParallelMultiHeadAttention, RowParallelDense
from tfdist.parallel import DeviceGroup

TOLERANCE = 1e-5


@pytest.fixture
def group():
    return DeviceGroup(["/cpu:0", "/cpu:1"])


def _inputs(shape, seed=0):
    return tf.constant(np.random.default_rng(seed).standard_normal(shape).astype("float32"))


def _outputs_and_grads(layer, inputs, weights):
    with tf.GradientTape() as tape:
        tape.watch(inputs)
        out = layer(*inputs)
        loss = tf.reduce_sum(tf.sin(out))  # a loss whose gradient differs per output
    grads = tape.gradient(loss, list(inputs) + weights)
    return out, [tf.convert_to_tensor(g) for g in grads]


def _assert_same_math(sharded, plain, inputs):
    """Forward outputs, input gradients and (unsharded) weight gradients agree."""
    plain(*inputs)
    sharded(*inputs)
    sharded.set_unsharded_weights(plain.get_weights())
    out_s, grads_s = _outputs_and_grads(sharded, inputs, sharded.trainable_weights)
    out_p, grads_p = _outputs_and_grads(plain, inputs, plain.trainable_weights)
    np.testing.assert_allclose(out_s, out_p, atol=TOLERANCE)
    for g_s, g_p in zip(grads_s[: len(inputs)], grads_p[: len(inputs)]):
        np.testing.assert_allclose(g_s, g_p, atol=TOLERANCE)
    # Weight gradients in the unsharded layout: concatenate the shards' gradients.
    sharded_grads = iter(grads_s[len(inputs):])
    whole = []
    for shards, axis in sharded._parameters:
        pieces = [next(sharded_grads) for _ in shards]
        whole.append(np.concatenate(pieces, axis=axis) if axis is not None else pieces[0])
    for g_s, g_p in zip(whole, grads_p[len(inputs):]):
        np.testing.assert_allclose(g_s, g_p, atol=TOLERANCE)


def test_column_parallel_dense_equals_dense(group):
    _assert_same_math(ColumnParallelDense(6, activation="tanh", group=group), keras.layers.Dense(6, activation="tanh"),
                      [_inputs((4, 5))])


def test_row_parallel_dense_equals_dense(group):
    _assert_same_math(RowParallelDense(3, activation="relu", group=group), keras.layers.Dense(3, activation="relu"),
                      [_inputs((4, 3, 6))])


def test_parallel_mlp_equals_two_dense_layers(group):
    class TwoDense(keras.layers.Layer):
        def __init__(self):
            super().__init__()
            self.hidden, self.out = keras.layers.Dense(8, activation="gelu"), keras.layers.Dense(5)

        def call(self, x):
            return self.out(self.hidden(x))

    _assert_same_math(ParallelMLP(8, group=group), TwoDense(), [_inputs((2, 3, 5))])


@pytest.mark.parametrize("causal", [False, True])
def test_parallel_attention_equals_keras_multi_head_attention(group, causal):
    sharded = ParallelMultiHeadAttention(4, 3, group=group)
    plain = keras.layers.MultiHeadAttention(4, 3)
    query, value = _inputs((2, 5, 6), 1), _inputs((2, 7, 6), 2)
    if causal:
        sharded_call = lambda q, v: sharded(q, v, use_causal_mask=True)  # noqa: E731
        plain_call = lambda q, v: plain(q, v, use_causal_mask=True)  # noqa: E731
        plain(query, value)
        sharded(query, value)
        sharded.set_unsharded_weights(plain.get_weights())
        np.testing.assert_allclose(sharded_call(query, value), plain_call(query, value), atol=TOLERANCE)
    else:
        _assert_same_math(sharded, plain, [query, value])


def test_each_device_holds_half_of_every_sharded_kernel(group):
    with group.scope():
        mlp = ParallelMLP(64)
    mlp(_inputs((2, 16)))
    per_device = {}
    for shards, axis in mlp._parameters:
        for shard in shards:
            device = tf.DeviceSpec.from_string(shard.value.device).device_index
            per_device.setdefault(device, 0)
            per_device[device] += shard.value.numpy().nbytes if axis is not None else 0
    whole = sum(w.nbytes for w, (_, axis) in zip(mlp.unsharded_weights(), mlp._parameters) if axis is not None)
    assert per_device == {0: whole // 2, 1: whole // 2}


def test_fit_matches_single_device_training_and_saves_unsharded(group, tmp_path):
    x, y = _inputs((64, 8)).numpy(), np.random.default_rng(3).integers(0, 3, 64)

    def model(devices):
        with DeviceGroup(devices).scope():
            keras.utils.set_random_seed(0)
            m = keras.Sequential([keras.Input((8,)), ColumnParallelDense(8, activation="relu"),
                                  RowParallelDense(6), ParallelMLP(4), keras.layers.Dense(3, activation="softmax")])
        m.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
        return m

    sharded, single = model(group.devices), model(["/cpu:0"])
    for a, b in zip(sharded.layers, single.layers):
        assert all(np.array_equal(u, v) for u, v in zip(_weights(a), _weights(b)))
    sharded.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    single.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    for a, b in zip(sharded.layers, single.layers):
        for u, v in zip(_weights(a), _weights(b)):
            np.testing.assert_allclose(u, v, atol=TOLERANCE)

    sharded.save(tmp_path / "m.keras")
    with DeviceGroup(["/cpu:0"]).scope():
        loaded = keras.saving.load_model(tmp_path / "m.keras")
    assert len(loaded.layers[0].kernels) == 1
    np.testing.assert_allclose(loaded.predict(x, verbose=0), sharded.predict(x, verbose=0), atol=TOLERANCE)


def _weights(layer):
    return layer.unsharded_weights() if hasattr(layer, "unsharded_weights") else layer.get_weights()


@pytest.mark.parametrize("make, message", [
    (lambda g: ColumnParallelDense(5, group=g), r"`units` must divide evenly by the group's 2 devices"),
    (lambda g: ParallelMLP(7, group=g), r"`hidden_units` must divide evenly"),
    (lambda g: ParallelMultiHeadAttention(3, 4, group=g), r"`num_heads` must divide evenly"),
])
def test_sizes_that_do_not_split_are_clear_errors(group, make, message):
    with pytest.raises(ValueError, match=message):
        make(group)


def test_row_parallel_input_width_must_split(group):
    with pytest.raises(ValueError, match=r"`input width` must divide evenly .* Received: input width=5"):
        RowParallelDense(3, group=group)(_inputs((2, 5)))


def test_a_layer_outside_any_group_is_a_clear_error():
    with pytest.raises(ValueError, match="must be made inside a device group"):
        ColumnParallelDense(4)


@pytest.mark.parametrize("devices, message", [
    (["/cpu:0", "/cpu:9"], r"must exist in this process; \['/cpu:9'\] do not"),
    (["/gpu:0"], r"must exist in this process; \['/gpu:0'\] do not"),
    (["/cpu:1", "/device:CPU:1"], "must not repeat a device"),
    ([], "at least one device"),
])
def test_bad_device_groups_are_clear_errors(devices, message):
    with pytest.raises(ValueError, match=message):
        DeviceGroup(devices)


def test_a_layer_from_scope_computes_on_the_group_in_scope_when_called(group):
    with group.scope():
        layer = ColumnParallelDense(4)
    pinned = ColumnParallelDense(4, group=group)
    other = DeviceGroup(["/cpu:2", "/cpu:3"])

    @tf.function
    def forward(x):
        return layer(x) + pinned(x)

    with other.scope():
        graph = forward.get_concrete_function(tf.TensorSpec((2, 8))).graph
    devices = ops_per_device(graph, ["MatMul"])
    # `layer` follows the scope to /cpu:2 and /cpu:3; `pinned` stays on its own group.
    assert devices == {"CPU:0": 1, "CPU:1": 1, "CPU:2": 1, "CPU:3": 1}
    with DeviceGroup(["/cpu:0"]).scope(), pytest.raises(ValueError, match=r"has 2 shard\(s\) and must be called with a group of as many"):
        layer(_inputs((2, 8)))
