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
