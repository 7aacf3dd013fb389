"""TensorParallelStrategy: Megatron's split of each group (tfdist.layers, attention heads, Dense pairs), placement,
optimizer state, numerics and the config path."""

import re

import keras
import numpy as np
import pytest
import tensorflow as tf

from helpers import ops_per_device, train_with_metrics
from tfdist.layers import ColumnParallelDense, ParallelMLP, RowParallelDense
from tfdist.parallel.split_variables import is_split, shards
from tfdist import ConfigError, load_config, make_strategy, training
from tfdist.strategies import TensorParallelStrategy


def _model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((8,)), keras.layers.Dense(8, activation="relu"), ColumnParallelDense(8, activation="relu"),
        RowParallelDense(8), ParallelMLP(16), keras.layers.Dense(3, activation="softmax"),
    ])


def _device_index(variable):
    return tf.DeviceSpec.from_string(variable.value.device).device_index


def _shard_devices(variable):
    return [tf.DeviceSpec.from_string(s.device).device_index for s in shards(variable)]


def test_the_layers_split_their_kernels_and_slots_one_shard_per_device():
    strategy = TensorParallelStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        model = _model()
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    model.fit(np.ones((8, 8)), np.zeros(8), epochs=1, verbose=0)
    column, row, mlp = model.layers[1:4]
    split = [v for v in model.weights if is_split(v)]
    assert [v.path for v in split] == [v.path for v in (column.kernel, column.bias, row.kernel, mlp.hidden.kernel,
                                                         mlp.hidden.bias, mlp.output_dense.kernel)]
    for variable in split:
        assert _shard_devices(variable) == [0, 1]
        assert shards(variable)[0].shape.num_elements() == variable.shape.num_elements() // 2
    assert sum(is_split(v) for v in model.optimizer.variables) == 2 * len(split)  # Adam's two slots beside each


def test_training_under_the_strategy_matches_one_device():
    x = np.random.default_rng(0).standard_normal((64, 8)).astype("float32")
    y = np.random.default_rng(1).integers(0, 3, 64)
    with TensorParallelStrategy(["/cpu:0", "/cpu:1"]).scope():
        sharded = _model()
        sharded.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
    single = _model()
    single.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
    sharded.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    single.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    for u, v in zip(sharded.get_weights(), single.get_weights()):
        np.testing.assert_allclose(u, v, atol=1e-5)


def test_a_missing_device_is_a_clear_error():
    with pytest.raises(ValueError, match=r"must exist in this process; \['/cpu:7'\] do not"):
        TensorParallelStrategy(["/cpu:0", "/cpu:7"])


@pytest.mark.slow
def test_transformer_config_trains_with_tensor_parallelism(tmp_path):
    proc, result = train_with_metrics(tmp_path, "configs/tensor_parallel.yaml", "train.epochs=8")
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


def _trained_beside_one_device(strategy, *, atol):
    """`_layers_model` trained under `strategy`, its weights asserted equal to the same training on one device."""
    with strategy.scope():
        model = _layers_model()
        model.compile(optimizer="adam", loss="mse")
    reference = _layers_model()
    reference.compile(optimizer="adam", loss="mse")
    x, y = np.random.default_rng(0).random((64, 8), "float32"), np.random.default_rng(1).random((64, 3), "float32")
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, atol=atol)
    return model


def test_placed_layers_keep_variables_state_and_computation_on_their_device():
    strategy = TensorParallelStrategy(["/cpu:0", "/cpu:1"], placement={"b": "/cpu:1", "c": "/cpu:1"})
    model = _trained_beside_one_device(strategy, atol=1e-6)
    assert {v.path.split("/")[1]: _device_index(v) for v in model.weights} == {"a": 0, "b": 1, "c": 1}
    slots = [v for v in model.optimizer.variables if "_b_" in v.path or "_c_" in v.path]
    assert slots and all(_device_index(v) == 1 for v in slots)

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x))
        return tape.gradient(loss, model.trainable_weights)

    graph = step.get_concrete_function(tf.TensorSpec((None, 8))).graph
    # a's forward and kernel gradient stay unplaced (first device); b's and c's
    # forward (2) and backward (input and kernel gradients: 4) run on /cpu:1.
    assert ops_per_device(graph, ["MatMul"]).get("CPU:1") == 6


def test_a_placement_naming_no_layer_fails_before_the_first_step():
    strategy = TensorParallelStrategy(["/cpu:0", "/cpu:1"], placement={"nope": "/cpu:1"})
    with strategy.scope():
        model = _layers_model()
        model.compile(optimizer="adam", loss="mse")
    with pytest.raises(ValueError, match=r"`placement` must name layers of the model .* Received: \['nope'\]"):
        model.fit(np.ones((4, 8)), np.ones((4, 3)), verbose=0)


def test_a_placement_off_the_group_is_a_clear_error():
    with pytest.raises(ValueError, match=r"`placement` must use the devices of the first group \[./cpu:0., ./cpu:1.\]"):
        TensorParallelStrategy(["/cpu:0", "/cpu:1"], placement={"a": "/cpu:2"})


def test_config_places_the_transformer_by_memory(tmp_path):
    proc, result = train_with_metrics(tmp_path, "configs/tensor_parallel.yaml", "train.epochs=1",
                                      "placement.balance_by_memory=true", timeout=300)
    placement = result["placement"]
    assert "layer(s) on /cpu:0" in placement and "layer(s) on /cpu:1" in placement
    assert f"placement       {placement}" in proc.stdout


FOUR = ["/cpu:0", "/cpu:1", "/cpu:2", "/cpu:3"]
# The config's thread pools cannot be applied once this process has started TensorFlow.
SHARED_THREADS = ["runtime.intra_op_threads=0", "runtime.inter_op_threads=0"]


def _component_devices(variable):
    return [tf.DeviceSpec.from_string(c.device).device_index for c in variable.value.values]


def test_groups_train_data_parallel_and_match_one_device():
    x = np.random.default_rng(0).standard_normal((64, 8)).astype("float32")
    y = np.random.default_rng(1).integers(0, 3, 64)
    strategy = TensorParallelStrategy(FOUR, group_size=2)  # a replica per device, a model copy per group
    assert strategy.num_replicas_in_sync == 4 and [g.devices for g in strategy.groups] == [FOUR[:2], FOUR[2:]]
    with strategy.scope():
        sharded = _model()
        sharded.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
    single = _model()
    single.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
    sharded.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    single.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    for u, v in zip(sharded.get_weights(), single.get_weights()):
        np.testing.assert_allclose(u, v, atol=1e-5)
    # Shard i of every split kernel on device i of each group.
    for variable in (v for v in sharded.weights if is_split(v)):
        assert _shard_devices(variable) == [0, 1, 2, 3], variable.path
        # exact: both groups apply the same all-reduced gradient to the same shard with the same kernels
        np.testing.assert_array_equal(shards(variable)[2], shards(variable)[0])


def test_a_users_own_model_is_split_where_megatron_would_and_trains_as_one_device():
    """The one-line change from a Keras guide: the user's model (no tfdist.layers), a strategy from a config that
    names no model. Its Dense pair splits column then row; nothing else changes."""
    x = np.random.default_rng(0).standard_normal((64, 8)).astype("float32")
    y = np.random.default_rng(1).integers(0, 3, 64)

    def plain():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu", name="hidden"),
                                  keras.layers.Dense(3, name="logits")], name="users_model")
        model.compile(optimizer=keras.optimizers.SGD(0.1),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    strategy = make_strategy(load_config(None, ["strategy.kind=tensor_parallel", "strategy.logical_devices=4",
                                                "strategy.tensor_parallel_size=2", *SHARED_THREADS]))
    with strategy.scope():
        model = plain()
        model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    single = plain()
    single.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    for a, b in zip(model.get_weights(), single.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5)
    assert model.evaluate(x, y, verbose=0) == pytest.approx(single.evaluate(x, y, verbose=0), abs=1e-5)
    assert sorted(v.path for v in model.weights if is_split(v)) == [
        "users_model/hidden/bias", "users_model/hidden/kernel", "users_model/logits/kernel"]


def test_each_group_computes_its_replica_on_its_own_devices():
    strategy = TensorParallelStrategy(FOUR, group_size=2)
    with strategy.scope():
        model = _model()
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
    model.fit(np.ones((16, 8), "float32"), np.zeros(16), verbose=0)  # Keras's training step, marked as such
    data = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((np.ones((16, 8), "float32"), np.zeros(16))).batch(16)
    )

    @tf.function(autograph=False)  # the step as Keras builds it
    def step(iterator):
        return strategy.run(model.train_step, args=(next(iterator),))

    counts = ops_per_device(step.get_concrete_function(iter(data)).graph, ["MatMul"])
    # A replica per device, each computing its shards: every device does the same work.
    assert len(set(counts.values())) == 1 and sorted(counts) == ["CPU:0", "CPU:1", "CPU:2", "CPU:3"], counts


def test_placement_repeats_in_every_group():
    strategy = TensorParallelStrategy(FOUR, group_size=2, placement={"b": "/cpu:1", "c": "/cpu:1"})
    model = _trained_beside_one_device(strategy, atol=1e-5)
    assert {v.path.split("/")[1]: _component_devices(v) for v in model.weights} == {"a": [0, 2], "b": [1, 3], "c": [1, 3]}


def test_a_group_size_that_does_not_divide_the_devices_is_a_clear_error():
    with pytest.raises(ValueError, match=r"`group_size` must divide the 4 devices into whole groups. Received: 3"):
        TensorParallelStrategy(FOUR, group_size=3)


def test_config_makes_mirrored_groups():
    strategy = make_strategy(load_config(
        "configs/tensor_parallel.yaml", ["strategy.logical_devices=4", "strategy.tensor_parallel_size=2", *SHARED_THREADS]
    ))
    assert [g.devices for g in strategy.groups] == [FOUR[:2], FOUR[2:]]
    assert strategy.num_replicas_in_sync == 4 and strategy.layout.data == 2  # a replica per device, 2 copies


@pytest.mark.parametrize("path, overrides, key, rule", [
    ("configs/tensor_parallel.yaml", ["strategy.logical_devices=4", "strategy.tensor_parallel_size=3"],
     "strategy.tensor_parallel_size", "must divide the 4 devices into whole groups"),
    ("configs/tensor_parallel.yaml", ["strategy.logical_devices=4", "strategy.tensor_parallel_size=2",
                                      "placement.layers=[classifier=/cpu:2]"],
     r"placement.layers\[0\]", r"must place on a device of the first group \['/cpu:0', '/cpu:1'\]"),
    ("configs/pipeline.yaml", ["strategy.tensor_parallel_size=2", "strategy.logical_devices=2", "model.name=transformer",
                               "model.width=32"],
     "strategy.logical_devices", r"pipeline.num_stages \(2\) x strategy.tensor_parallel_size \(2\) devices"),
])
def test_config_errors_of_groups(path, overrides, key, rule):
    with pytest.raises(ConfigError, match=f"^`{key}` .*{rule}"):
        make_strategy(load_config(path, [*overrides, *SHARED_THREADS]))


@pytest.mark.parametrize("path, overrides, key, rule", [
    ("configs/default.yaml", ["strategy.tensor_parallel_size=2"],
     "strategy.tensor_parallel_size", "only applies to strategy.kind=pipeline or tensor_parallel"),
])
def test_config_errors_found_at_load(path, overrides, key, rule):
    with pytest.raises(ConfigError, match=f"^`{key}` .*{rule}"):
        load_config(path, overrides)


@pytest.mark.parametrize("path, overrides, key, rule", [
    ("configs/pipeline.yaml", ["strategy.tensor_parallel_size=2"],
     "model.name", "must be transformer with strategy.kind=pipeline and strategy.tensor_parallel_size > 1"),
    ("configs/tensor_parallel.yaml", ["strategy.logical_devices=4", "strategy.tensor_parallel_size=4", "model.heads=2",
                                      "model.width=32"],
     "strategy.tensor_parallel_size", r"devices per group that divides model.heads \(2\). This config gives 4"),
])
def test_the_transformer_of_tfdist_train_must_split_over_the_groups(path, overrides, key, rule):
    with pytest.raises(ConfigError, match=f"^`{key}` .*{rule}"):
        training.prepare(load_config(path, [*overrides, *SHARED_THREADS]))


@pytest.mark.slow
def test_config_trains_mirrored_tensor_parallel_groups(tmp_path):
    proc, result = train_with_metrics(tmp_path, "configs/tensor_parallel.yaml", "strategy.logical_devices=4",
                                      "strategy.tensor_parallel_size=2", "train.epochs=8")
    assert result["num_replicas"] == 4 and result["tensor_parallel_groups"] == [FOUR[:2], FOUR[2:]]
    assert result["layout"]["model_copies"] == 2
    assert result["final"]["val_accuracy"] >= 0.9
    assert "tensor groups   2 of 2 devices: [/cpu:0, /cpu:1], [/cpu:2, /cpu:3]" in proc.stdout


@pytest.mark.parametrize("option, refusal", [
    ({"use_ema": True}, "use_ema would keep each weight's moving average whole"),
    ({"clipnorm": 1.0}, "clipnorm and global_clipnorm would clip a split variable's shard by its own norm"),
])
def test_an_optimizer_option_a_split_model_cannot_honour_is_refused_at_compile(option, refusal):
    """Refused in one line when the model is compiled, before any step (use_ema failed in Keras's first
    moving-average update: a whole average assigned a kernel's shard)."""
    with TensorParallelStrategy(["/cpu:0", "/cpu:1"]).scope():
        inputs = keras.Input((8,))
        model = keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Dense(16, activation="relu")(inputs)))
        with pytest.raises(ValueError, match=re.escape(f"TensorParallelStrategy: {refusal}")):
            model.compile(loss="mse", optimizer=keras.optimizers.Adam(0.01, **option))
