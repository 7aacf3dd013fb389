"""TensorParallelStrategy: placement, optimizer state, numerics and the config path."""

import json

import keras
import numpy as np
import pytest
import tensorflow as tf

from helpers import run_tfdist
from tfdist.layers import ColumnParallelDense, ParallelMLP, RowParallelDense
from tfdist.parallel import DeviceGroup
from tfdist.strategies import TensorParallelStrategy


def _model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((8,)), keras.layers.Dense(8, activation="relu"), ColumnParallelDense(8, activation="relu"),
        RowParallelDense(8), ParallelMLP(16), keras.layers.Dense(3, activation="softmax"),
    ])


def _device_index(variable):
    return tf.DeviceSpec.from_string(variable.value.device).device_index


def test_shards_and_their_optimizer_state_live_on_their_devices():
    strategy = TensorParallelStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        model = _model()
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    model.fit(np.ones((8, 8)), np.zeros(8), epochs=1, verbose=0)
    for variable in model.weights:
        expected = 1 if "_shard_1" in variable.path else 0
        assert _device_index(variable) == expected, variable.path
    slots = [v for v in model.optimizer.variables if "_shard_" in v.path]
    assert slots and all(_device_index(v) == (1 if "_shard_1" in v.path else 0) for v in slots)


def test_training_under_the_strategy_matches_one_device():
    x = np.random.default_rng(0).standard_normal((64, 8)).astype("float32")
    y = np.random.default_rng(1).integers(0, 3, 64)
    with TensorParallelStrategy(["/cpu:0", "/cpu:1"]).scope():
        sharded = _model()
        sharded.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
    with DeviceGroup(["/cpu:0"]).scope():
        single = _model()
        single.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
    sharded.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    single.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    for a, b in zip(sharded.layers, single.layers):
        unsharded = getattr(a, "unsharded_weights", a.get_weights)()
        for u, v in zip(unsharded, getattr(b, "unsharded_weights", b.get_weights)()):
            np.testing.assert_allclose(u, v, atol=1e-5)


def test_a_missing_device_is_a_clear_error():
    with pytest.raises(ValueError, match=r"must exist in this process; \['/cpu:7'\] do not"):
        TensorParallelStrategy(["/cpu:0", "/cpu:7"])


@pytest.mark.slow
def test_transformer_config_trains_with_tensor_parallelism(tmp_path):
    metrics = tmp_path / "metrics.json"
    proc = run_tfdist("train", "--config", "configs/tensor_parallel.yaml", "--set", "train.epochs=8",
                      "--metrics_out", str(metrics), timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(metrics.read_text())
    assert result["strategy"] == "tensor_parallel"
    assert result["devices"] == ["/cpu:0", "/cpu:1"]
    assert result["final"]["val_accuracy"] >= 0.9
    assert "local devices   /cpu:0, /cpu:1" in proc.stdout


def _layers_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((8,)), keras.layers.Dense(32, activation="relu", name="a"),
        keras.layers.Dense(32, activation="relu", name="b"), keras.layers.Dense(3, name="c"),
    ])


def test_balance_by_memory_cuts_the_layers_into_contiguous_even_runs():
    from tfdist.parallel.placement import balance_by_memory

    # Parameters: a 288, b 1056, c 99: [a] [b, c] leaves the larger run smallest.
    assert balance_by_memory(_layers_model(), ["/cpu:0", "/cpu:1"]) == {"a": "/cpu:0", "b": "/cpu:1", "c": "/cpu:1"}
    with pytest.raises(ValueError, match="must not outnumber the model's layers \\(3\\)"):
        balance_by_memory(_layers_model(), ["/cpu:0", "/cpu:1", "/cpu:2", "/cpu:3"])


def test_placed_layers_keep_variables_state_and_computation_on_their_device():
    strategy = TensorParallelStrategy(["/cpu:0", "/cpu:1"], placement={"b": "/cpu:1", "c": "/cpu:1"})
    with strategy.scope():
        model = _layers_model()
        model.compile(optimizer="adam", loss="mse")
    reference = _layers_model()
    reference.compile(optimizer="adam", loss="mse")
    x, y = np.random.default_rng(0).random((64, 8), "float32"), np.random.default_rng(1).random((64, 3), "float32")
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-6)
    assert {v.path.split("/")[1]: _device_index(v) for v in model.weights} == {"a": 0, "b": 1, "c": 1}
    slots = [v for v in model.optimizer.variables if "_b_" in v.path or "_c_" in v.path]
    assert slots and all(_device_index(v) == 1 for v in slots)

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x))
        return tape.gradient(loss, model.trainable_weights)

    graph = step.get_concrete_function(tf.TensorSpec((None, 8))).graph
    matmul_devices = [op.device for op in _all_ops(graph) if op.type == "MatMul"]
    # a's forward and kernel gradient stay unplaced (first device); b's and c's
    # forward (2) and backward (input and kernel gradients: 4) run on /cpu:1.
    assert sum("CPU:1" in d for d in matmul_devices) == 6


def _all_ops(graph):
    ops = list(graph.get_operations())
    for function in graph._functions.values():
        ops += list(function.graph.get_operations()) if hasattr(function, "graph") else []
    return ops


def test_a_placement_naming_no_layer_fails_before_the_first_step():
    strategy = TensorParallelStrategy(["/cpu:0", "/cpu:1"], placement={"nope": "/cpu:1"})
    with strategy.scope():
        model = _layers_model()
        model.compile(optimizer="adam", loss="mse")
    with pytest.raises(ValueError, match=r"`placement` must name layers of the model .* Received: \['nope'\]"):
        model.fit(np.ones((4, 8)), np.ones((4, 3)), verbose=0)


def test_a_placement_off_the_group_is_a_clear_error():
    with pytest.raises(ValueError, match=r"`placement` must use the strategy's devices"):
        TensorParallelStrategy(["/cpu:0", "/cpu:1"], placement={"a": "/cpu:2"})


def test_config_places_the_transformer_by_memory(tmp_path):
    metrics = tmp_path / "metrics.json"
    proc = run_tfdist("train", "--config", "configs/tensor_parallel.yaml", "--set", "train.epochs=1",
                      "--set", "placement.balance_by_memory=true", "--metrics_out", str(metrics), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    placement = json.loads(metrics.read_text())["placement"]
    assert "layer(s) on /cpu:0" in placement and "layer(s) on /cpu:1" in placement
    assert f"placement       {placement}" in proc.stdout
