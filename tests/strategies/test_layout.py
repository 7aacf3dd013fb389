"""LayoutStrategy: an unchanged Keras model split by a keras.distribution LayoutMap trains as on one device."""

import contextlib
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

from helpers import attention_and_mlp, megatron_layout_map
from oracle import keras_alone
from tfdist.parallel.layout import Layout, LayoutError
from tfdist.parallel.mesh_groups import collectives_of_a_step
from tfdist.parallel.split_variables import is_split, shards
from tfdist.strategies.layout import LayoutStrategy
from tfdist.strategies.tensor_parallel import TensorParallelStrategy

X = np.random.default_rng(0).normal(size=(64, 6, 16)).astype("float32")
Y = np.random.default_rng(1).integers(0, 5, size=(64,))


def _model(optimizer):
    return attention_and_mlp(16, optimizer)


FIT = {"batch_size": 16, "epochs": 2, "shuffle": False}


def _trained(strategy, optimizer):
    with strategy.scope():
        model = _model(optimizer())
    history = model.fit(X, Y, verbose=0, **FIT).history
    return model, history


def _keras_alone(optimizer):
    """The model trained by Keras in a process that never imported tfdist: its "weights", "history", "evaluation"
    on X and Y, and "predictions" on the first 23 examples."""
    return keras_alone("fit", _model(optimizer()), X, Y, evaluate=(X, Y), predict=X[:23], **FIT)


@pytest.mark.parametrize("data, devices", [(1, 2), (1, 4), (2, 2)], ids=["1x2", "1x4", "data2x2"])
def test_a_layout_map_splits_an_unchanged_model_which_trains_as_on_one_device(data, devices):
    optimizer = lambda: keras.optimizers.SGD(0.05, momentum=0.9)  # noqa: E731
    one = _keras_alone(optimizer)
    split, history = _trained(LayoutStrategy(megatron_layout_map(devices, data)), optimizer)
    assert history["loss"] == pytest.approx(one["history"]["loss"], abs=1e-6)
    assert history["accuracy"] == one["history"]["accuracy"]
    for whole, got in zip(one["weights"], split.get_weights()):
        np.testing.assert_allclose(got, whole, atol=1e-5)
    matched = [v for v in split.variables if is_split(v)]
    assert len(matched) == 10  # q, k, v kernels and biases, the output kernel, the MLP's two kernels, its bias
    for variable in matched:  # each device holds 1/N of a split variable, the same shard along the data axis
        assert [s.shape.num_elements() for s in shards(variable)] == [variable.shape.num_elements() // devices] * (
            devices * data)
        assert sorted(tf.DeviceSpec.from_string(s.device).device_index for s in shards(variable)) == list(
            range(devices * data))
        for row in range(1, data):
            for m in range(devices):
                # exact: each row applies the same reduced gradient to the same shard with the same kernels
                np.testing.assert_array_equal(shards(variable)[row * devices + m], shards(variable)[m])
    momentums = [v for v in split.optimizer.variables if is_split(v)]
    assert len(momentums) == len(matched)  # each split variable's momentum is split beside it
    # Keras's predict, also several steps per call, and a last batch the rows share unevenly (7 = 4 + 3)
    np.testing.assert_allclose(split.predict(X[:23], batch_size=8, verbose=0), one["predictions"], atol=1e-5)
    if data == 1:
        return
    split.compile(optimizer=split.optimizer, loss=split.loss, metrics=["accuracy"], steps_per_execution=2)
    np.testing.assert_allclose(split.predict(X[:23], batch_size=8, verbose=0), one["predictions"], atol=1e-5)
    assert split.evaluate(X, Y, batch_size=24, verbose=0) == pytest.approx(one["evaluation"], abs=1e-5)


@pytest.mark.parametrize("axes", [("model", None), (None, "model")], ids=["vocabulary", "hidden"])
def test_an_embedding_split_along_its_vocabulary_or_its_hidden_axis_trains_as_on_one_device(axes):
    tokens = np.random.default_rng(2).integers(0, 40, size=(32, 5))

    def model():
        keras.utils.set_random_seed(3)
        inputs = keras.Input((5,), dtype="int32")
        h = keras.layers.Embedding(40, 8, name="tokens")(inputs)
        outputs = keras.layers.Dense(5, name="head")(keras.layers.GlobalAveragePooling1D()(h))
        built = keras.Model(inputs, outputs)
        built.compile(optimizer=keras.optimizers.SGD(0.5), loss=keras.losses.SparseCategoricalCrossentropy(True))
        return built

    one = keras_alone("fit", model(), tokens, Y[:32], batch_size=8, epochs=2, shuffle=False)
    mesh = keras.distribution.DeviceMesh((1, 2), ("batch", "model"), devices=["cpu:0", "cpu:1"])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["tokens/embeddings"] = axes
    with LayoutStrategy(layout_map).scope():
        split = model()
    split.fit(tokens, Y[:32], batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert is_split(split.get_layer("tokens").embeddings)
    for whole, got in zip(one["weights"], split.get_weights()):
        np.testing.assert_allclose(got, whole, atol=1e-5)


def test_adams_two_slots_are_split_beside_each_variable_and_training_follows_one_device():
    optimizer = lambda: keras.optimizers.Adam(0.01)  # noqa: E731
    one = _keras_alone(optimizer)
    split, history = _trained(LayoutStrategy(megatron_layout_map(2)), optimizer)
    assert history["loss"] == pytest.approx(one["history"]["loss"], abs=1e-6)
    # Adam divides by each gradient's own scale, so a rounding difference of a near-zero gradient (the split
    # step sums partial products in another order) moves a weight by up to about lr x 1e-2 after 8 steps.
    for whole, got in zip(one["weights"], split.get_weights()):
        np.testing.assert_allclose(got, whole, atol=2e-4)
    assert sum(is_split(v) for v in split.optimizer.variables) == 2 * 10


def test_the_optimizer_state_and_weights_split_over_the_data_axis_train_as_unsplit(tmp_path):
    """`shard_optimizer` on a 2 x 2 mesh (a LayoutStrategy's, and TensorParallelStrategy's split by Megatron's
    split): each device splits its own shard (or whole variable) over the 2 rows.
    Stage 3 trains the unsplit layout's weights; each device holds half its slots and about half its weights
    (the attention's projections recomputed inside their paired block; the variables under 64 elements whole,
    their state split as at stage 2), and its Keras file loads on one device with the same predictions."""
    from tfdist.parallel.optimizer_shards import shards_of
    from tfdist.parallel.weight_shards import is_sharded
    from tfdist.strategies.replica_groups import bytes_by_device

    # SGD: Adam would scale the rounding noise of the attention key bias's gradient (zero in exact arithmetic),
    # which the split sums in another order, up to lr x 1e-2 (see the test above).
    optimizer = lambda: keras.optimizers.SGD(0.05, momentum=0.9)  # noqa: E731
    whole, _ = _trained(LayoutStrategy(megatron_layout_map(2, data=2)), optimizer)
    unsplit_slots = bytes_by_device([v for v in whole.optimizer.variables if len(v.shape)])
    unsplit_weights = bytes_by_device(whole.trainable_variables)
    # Stage 3 splits the state of the variables it keeps whole (under 64 elements) as stage 2 does.
    split, _ = _trained(LayoutStrategy(megatron_layout_map(2, data=2), shard_optimizer=3, keep_whole_below=64),
                        optimizer)
    for a, b in zip(whole.get_weights(), split.get_weights()):
        np.testing.assert_allclose(b, a, atol=1e-6, rtol=0)
    shards = shards_of(split.optimizer)
    slots = bytes_by_device([s for copy in shards.copies for s in copy.variables if len(s.shape)])
    assert set(slots) == set(unsplit_slots) == {f"CPU:{i}" for i in range(4)}
    for device, nbytes in slots.items():
        assert nbytes <= 1.15 / 2 * unsplit_slots[device], (device, slots, unsplit_slots)
    # The kernels of 64 elements and more split: about half the weights on each device.
    assert [is_sharded(v) for v in split.trainable_variables] == [
        int(np.prod(v.shape)) >= 64 for v in whole.trainable_variables]
    # The layout's split stays (the attention's and the MLP's kernels and biases).
    assert [is_split(v) for v in split.trainable_variables] == [is_split(v) for v in whole.trainable_variables]
    assert sum(is_split(v) for v in split.trainable_variables) == 10
    weights = bytes_by_device(split.trainable_variables)
    for device, nbytes in weights.items():
        assert nbytes <= 0.6 * unsplit_weights[device], (device, weights, unsplit_weights)
    split.save(tmp_path / "stage3.keras")
    loaded = keras.models.load_model(tmp_path / "stage3.keras")  # one device, whole
    np.testing.assert_allclose(loaded.predict(X, verbose=0), whole.predict(X, verbose=0), atol=1e-5)
    # Megatron's split found by TensorParallelStrategy over 2 groups of 2: the same mesh, split the same way.
    tensor_parallel, _ = _trained(TensorParallelStrategy([f"/cpu:{i}" for i in range(4)], group_size=2,
                                                         shard_optimizer=3, keep_whole_below=64), optimizer)
    for a, b in zip(whole.get_weights(), tensor_parallel.get_weights()):
        np.testing.assert_allclose(b, a, atol=1e-6, rtol=0)
    assert bytes_by_device(tensor_parallel.trainable_variables) == weights


def test_ordinary_keras_training_on_a_2x2_mesh_follows_one_device(tmp_path):
    """Sample and class weights, a validation split, a synchronized BatchNormalization, clipvalue, a learning
    rate callback and ModelCheckpoint: the History, the weights and every checkpoint as on one device."""
    weights = np.random.default_rng(4).uniform(0.5, 1.5, 64).astype("float32")

    def run(strategy, directory):
        with strategy.scope() if strategy else contextlib.nullcontext():
            keras.utils.set_random_seed(1)
            inputs = keras.Input((6, 16))
            h = keras.layers.MultiHeadAttention(num_heads=4, key_dim=8, name="attention")(inputs, inputs)
            h = keras.layers.BatchNormalization(synchronized=True, name="norm")(h + inputs)
            m = keras.layers.Dense(32, activation="relu", name="mlp_up")(h)
            h = keras.layers.GlobalAveragePooling1D()(h + keras.layers.Dense(16, name="mlp_down")(m))
            model = keras.Model(inputs, keras.layers.Dense(5, name="head")(h))
            model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9, clipvalue=0.5),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          metrics=["accuracy"], weighted_metrics=["accuracy"])
        callbacks = [keras.callbacks.ModelCheckpoint(str(directory / "epoch{epoch}.keras")),
                     keras.callbacks.LearningRateScheduler(lambda epoch, rate: rate * 0.5)]
        history = model.fit(X, Y, sample_weight=weights, batch_size=16, epochs=2, validation_split=0.25,
                            shuffle=False, callbacks=callbacks, verbose=0).history
        history.update(model.fit(X, Y, class_weight={0: 2.0, 1: 0.5}, batch_size=16, epochs=1, shuffle=False,
                                 verbose=0).history)
        return model, history

    (tmp_path / "one").mkdir()
    (tmp_path / "split").mkdir()
    one, one_history = run(None, tmp_path / "one")
    split, history = run(LayoutStrategy(megatron_layout_map(2, data=2)), tmp_path / "split")
    assert history.keys() == one_history.keys() and "val_weighted_accuracy" in history
    for key, values in one_history.items():
        assert history[key] == pytest.approx(values, abs=1e-5), key
    for whole, got in zip(one.get_weights(), split.get_weights()):  # moving statistics included
        np.testing.assert_allclose(got, whole, atol=1e-5)
    for epoch in (1, 2):  # the checkpoints the split run wrote load on one device as the one-device run's
        saved = [keras.saving.load_model(tmp_path / run / f"epoch{epoch}.keras") for run in ("one", "split")]
        np.testing.assert_allclose(saved[1].predict(X, verbose=0), saved[0].predict(X, verbose=0), atol=1e-5)


def test_a_split_model_saves_whole_and_loads_on_one_device_and_back(tmp_path):
    split, _ = _trained(LayoutStrategy(megatron_layout_map(2)), lambda: keras.optimizers.SGD(0.05))
    split.save(tmp_path / "model.keras")
    loaded = keras.models.load_model(tmp_path / "model.keras")  # one device, the unchanged model's layout
    for saved, got in zip(split.get_weights(), loaded.get_weights()):
        np.testing.assert_array_equal(got, saved)  # exact: saving and loading copy the bytes
    strategy = LayoutStrategy(megatron_layout_map(2))
    with strategy.scope():
        again = _model(keras.optimizers.SGD(0.05))
    again.load_weights(tmp_path / "model.keras")
    strategy.split(again)  # as the optimizer's build would
    for saved, got in zip(split.get_weights(), again.get_weights()):
        np.testing.assert_array_equal(got, saved)  # exact: loading and splitting copy the bytes
    np.testing.assert_allclose(again.predict(X[:4], verbose=0), loaded.predict(X[:4], verbose=0), atol=1e-5)


def test_a_checkpoint_holds_the_whole_variables_and_restores_them_exactly(tmp_path):
    split, _ = _trained(LayoutStrategy(megatron_layout_map(2)), lambda: keras.optimizers.Adam(0.01))
    path = tf.train.Checkpoint(model=split, optimizer=split.optimizer).write(str(tmp_path / "ckpt"))
    saved_shapes = [shape for name, shape in tf.train.list_variables(path) if "_trainable_variables/" in name]
    assert sorted(saved_shapes) == sorted(list(v.shape) for v in split.trainable_variables)  # whole, not shards
    saved = [w.copy() for w in split.get_weights()]
    split.fit(X, Y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    tf.train.Checkpoint(model=split, optimizer=split.optimizer).read(path).assert_consumed()
    for before, after in zip(saved, split.get_weights()):
        np.testing.assert_array_equal(after, before)  # exact: a restore copies the saved bytes


@pytest.mark.parametrize("rule, axes, message", [
    ("mlp_upp/kernel", (None, "model"), "Rule 'mlp_upp/kernel' matches no variable of the model"),
    ("head/kernel", (None, "model"), r"splits axis 1 of variable 'head/kernel' \(shape \(16, 5\)\) over 2 devices"),
    ("mlp_up/kernel", ("model",), r"gives 1 axes \('model',\) to variable 'mlp_up/kernel' of shape \(16, 32\)"),
    ("norm/gamma", ("model",), "only the kernels, biases and embeddings of Dense, EinsumDense"),
])
def test_a_layout_that_does_not_fit_the_model_is_one_line_naming_the_variable_and_rule(rule, axes, message):
    mesh = keras.distribution.DeviceMesh((1, 2), ("batch", "model"), devices=["cpu:0", "cpu:1"])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[rule] = axes
    strategy = LayoutStrategy(layout_map)
    with strategy.scope():
        model = _model(keras.optimizers.SGD(0.05))
    with pytest.raises(LayoutError, match=message):
        strategy.split(model)
    assert not any(is_split(v) for v in model.variables)  # refused before anything was split


def test_a_mesh_larger_than_the_devices_or_than_the_devices_given_is_refused_in_one_line():
    have = len(tf.config.list_logical_devices("CPU"))  # TensorFlow has started: the CPU is split as it is
    with pytest.raises(LayoutError, match=f"The mesh has {2 * have} devices: this strategy needs {2 * have} "
                                          f"devices and TensorFlow already started with {have} CPU device"):
        LayoutStrategy(Layout(model=have, data=2))
    with pytest.raises(LayoutError, match=r"The mesh \('batch': 2, 'model': 2\) has 4 places, and 2 devices are given"):
        LayoutStrategy(Layout(model=2, data=2), ["/cpu:0", "/cpu:1"])


def test_a_model_parallel_distribution_gives_its_layout():
    distribution = keras.distribution.ModelParallel(layout_map=megatron_layout_map(2), batch_dim_name="batch")
    layout = Layout.from_keras(distribution)
    assert (layout.data, layout.model, layout.model_axis) == (1, 2, "model")
    assert layout.split_axis("attention/query/kernel", (16, 4, 8)) == 1
    assert layout.split_axis("head/kernel", (16, 5)) is None


def test_a_keras_distribution_written_for_jax_becomes_a_tfdist_strategy():
    import tfdist

    model_parallel = keras.distribution.ModelParallel(layout_map=megatron_layout_map(2), batch_dim_name="batch")
    strategy = tfdist.strategy_from(model_parallel)
    assert isinstance(strategy, LayoutStrategy) and strategy.num_replicas_in_sync == 2
    data_parallel = tfdist.strategy_from(keras.distribution.DataParallel(devices=["cpu:0", "cpu:1", "cpu:2"]))
    assert isinstance(data_parallel, tfdist.MirroredStrategy) and data_parallel.num_replicas_in_sync == 3
    with pytest.raises(ValueError, match="must be a keras.distribution.ModelParallel, LayoutMap or DataParallel"):
        tfdist.strategy_from("model")
    # Several local devices are not how a multi-process launcher runs data parallel (tests/strategies/
    # test_process_groups.py runs one device per process under both launchers).
    with pytest.raises(ValueError, match=r"DataParallel over 2 devices of one process \(/cpu:0, /cpu:1\) cannot run "
                                         "under horovod, which runs one replica per process"):
        tfdist.strategy_from(keras.distribution.DataParallel(devices=["cpu:0", "cpu:1"]), data_parallel="horovod")
    with pytest.raises(ValueError, match="`data_parallel` must be local, multi_worker or horovod. Received: 'mpi'"):
        tfdist.strategy_from(model_parallel, data_parallel="mpi")


def test_a_data_parallel_distribution_under_workers_is_tensorflows_multi_worker_strategy(monkeypatch):
    """Under a TF_CONFIG of several workers a DataParallel becomes tfdist's MultiWorkerMirroredStrategy (made here
    without its cluster: tests/strategies/test_multi_worker.py trains it across processes)."""
    import tfdist
    from tfdist.strategies import layout as layout_module

    made = []
    monkeypatch.setattr(layout_module, "MultiWorkerMirroredStrategy", lambda: made.append("made") or "multi-worker")
    monkeypatch.setenv("TF_CONFIG", '{"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, '
                                    '"task": {"type": "worker", "index": 0}}')
    assert tfdist.strategy_from(keras.distribution.DataParallel(devices=["cpu:0"])) == "multi-worker"
    assert made == ["made"]


@pytest.mark.parametrize("environment, launched", [
    ({}, "local"),
    ({"TF_CONFIG": '{"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, "task": {"type": "worker", "index": 0}}'},
     "multi_worker"),
    ({"TF_CONFIG": '{"cluster": {"worker": ["127.0.0.1:1"]}, "task": {"type": "worker", "index": 0}}'}, "local"),
    ({"HOROVOD_SIZE": "2", "HOROVOD_RANK": "1"}, "horovod"),
    ({"OMPI_COMM_WORLD_SIZE": "4"}, "horovod"),
    ({"HOROVOD_SIZE": "1"}, "local"),
])
def test_the_launcher_picks_the_data_axis_backend(monkeypatch, environment, launched):
    from tfdist.strategies.layout import launched_data_parallel

    for name in ("TF_CONFIG", "HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    assert launched_data_parallel() == launched


def test_the_config_kind_splits_by_its_rules_or_by_the_layout_map_a_function_returns(tmp_path, monkeypatch):
    from tfdist import ConfigError, load_config, make_strategy

    rules = ('[[".*attention/(query|key|value)/kernel", [null, model, null]], '
             '[".*attention/attention_output/kernel", [model, null, null]], [".*mlp_up/kernel", [null, model]]]')
    config = load_config(None, ["strategy.kind=layout", f"layout.rules={rules}", "layout.model_devices=2"])
    strategy = make_strategy(config)
    assert isinstance(strategy, LayoutStrategy) and strategy.num_replicas_in_sync == 2
    one = _keras_alone(lambda: keras.optimizers.SGD(0.05))
    split, _ = _trained(strategy, lambda: keras.optimizers.SGD(0.05))
    assert sum(is_split(v) for v in split.variables) == 5
    for whole, got in zip(one["weights"], split.get_weights()):
        np.testing.assert_allclose(got, whole, atol=1e-5)

    (tmp_path / "my_layouts.py").write_text(
        "import keras\n"
        "def layout_map(device_mesh):\n"
        "    layout_map = keras.distribution.LayoutMap(device_mesh)\n"
        "    layout_map['.*mlp_up/kernel'] = (None, 'model')\n"
        "    return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name='batch')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    config = load_config(None, ["strategy.kind=layout", "layout.layout_map=my_layouts:layout_map"])
    strategy = make_strategy(config)
    with strategy.scope():
        model = _model(keras.optimizers.SGD(0.05))
    strategy.check_model(model)
    assert [v.path for v in model.variables if is_split(v)] == ["mlp_up/kernel"]

    # layout.megatron alone: the attention's heads and the MLP's pair, as the rules above and more
    strategy = make_strategy(load_config(None, ["strategy.kind=layout", "layout.megatron=true"]))
    with strategy.scope():
        model = _model(keras.optimizers.SGD(0.05))
    strategy.check_model(model)
    assert sum(is_split(v) for v in model.variables) == 10
    strategy = make_strategy(load_config(None, ["strategy.kind=layout", "layout.megatron=true"]))
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ConfigError, match=r"^`layout.megatron` does not fit the model: .* no MultiHeadAttention, no "
                                          "Dense pair") as refused:
        strategy.check_model(model)
    assert "Received" not in str(refused.value)  # the line says what it received; it ended "Received: 'see above'"


@pytest.mark.parametrize("overrides, key, message", [
    (["strategy.kind=layout"], "layout.rules", "or layout.layout_map, one of the two, or layout.megatron, says how"),
    (["strategy.kind=layout", "layout.rules=[[a, [rows]]]"], "layout.rules[0]", "with the axes model, batch or null"),
    (["strategy.kind=layout", "layout.rules=[['(', [model]]]"], "layout.rules[0]", "is not a regular expression"),
    (["layout.model_devices=4"], "layout", "only applies with strategy.kind=layout"),
    (["strategy.kind=layout", "layout.megatron=true", "strategy.shard_optimizer=3"], "strategy.shard_optimizer",
     "layout.data_devices is 1 in one process: nothing would be split"),  # it trained, silently unsplit
])
def test_a_layout_config_that_cannot_work_is_refused_at_load(overrides, key, message):
    from tfdist import ConfigError, load_config

    with pytest.raises(ConfigError, match=re.escape(f"`{key}` ") + ".*" + re.escape(message)):
        load_config(None, overrides)


def test_rules_that_do_not_fit_the_model_are_the_config_keys_error():
    from tfdist import ConfigError, load_config, make_strategy

    strategy = make_strategy(load_config(None, ["strategy.kind=layout", "layout.rules=[[mlp_upp/kernel, [null, model]]]"]))
    with strategy.scope():
        model = _model(keras.optimizers.SGD(0.05))
    with pytest.raises(ConfigError, match=r"^`layout.rules` does not fit the model: Rule 'mlp_upp/kernel' matches no"):
        strategy.check_model(model)


@pytest.mark.parametrize("data", [1, 2], ids=["1x2", "data2x2"])
def test_megatrons_pairs_make_two_sums_forward_and_two_backward_per_block(data):
    """The model's attention block and MLP block each pair their column split with their row split: one
    sum forward (the output projections), one backward (their inputs' copies, the query, key and value
    sharing one), no gather; with a data axis, one more sum per split variable over the column."""
    strategy = LayoutStrategy(megatron_layout_map(2, data))
    with strategy.scope():
        model = _model(keras.optimizers.SGD(0.05))
    model.fit(X[:16], Y[:16], batch_size=16, epochs=1, verbose=0)  # builds the optimizer, which splits the model
    counts = collectives_of_a_step(model, strategy, (X[:16], Y[:16]))
    expected = {"model_group CollectiveReduceV2": 4}
    if data > 1:
        expected["data_group CollectiveReduceV2"] = 10
    assert counts == expected


def test_a_megatron_layout_finds_the_attention_heads_and_the_dense_pairs_itself():
    """No rules: every MultiHeadAttention on its heads, every Dense whose output only a Dense consumes column
    then row; the same split, collectives and training as the hand-written map's. A softmax Dense keeps its
    output whole: it needs the whole axis."""
    found = LayoutStrategy(Layout(model=2, megatron=True))
    written = LayoutStrategy(megatron_layout_map(2))
    optimizer = lambda: keras.optimizers.SGD(0.05, momentum=0.9)  # noqa: E731
    (split, history), (reference, written_history) = _trained(found, optimizer), _trained(written, optimizer)
    assert {v.path for v in split.variables if is_split(v)} == {v.path for v in reference.variables if is_split(v)}
    assert history["loss"] == pytest.approx(written_history["loss"], abs=1e-6)
    for a, b in zip(split.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-6)
    assert collectives_of_a_step(split, found, (X[:16], Y[:16])) == {"model_group CollectiveReduceV2": 4}

    inputs = keras.Input((16,))
    probabilities = keras.layers.Dense(8, activation="softmax", name="softmax")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(4, name="after")(probabilities), name="softmax_model")
    with pytest.raises(LayoutError, match="Model .softmax_model. has no MultiHeadAttention, no Dense pair"):
        Layout(model=2, megatron=True).axes_of(model)

    def softmax_model():  # split by a rule, its softmax sees the whole gathered axis
        keras.utils.set_random_seed(2)
        inputs = keras.Input((16,))
        probabilities = keras.layers.Dense(8, activation="softmax", name="softmax")(inputs)
        built = keras.Model(inputs, keras.layers.Dense(4, name="after")(probabilities))
        built.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
        return built

    one = softmax_model()
    with LayoutStrategy(Layout(model=2, rules=(("softmax/kernel", (None, "model")),))).scope():
        split = softmax_model()
    for trained in (one, split):
        trained.fit(X[:32, 0], Y[:32, None] * np.ones((1, 4)), batch_size=16, shuffle=False, verbose=0)
    for whole, got in zip(one.get_weights(), split.get_weights()):
        np.testing.assert_allclose(got, whole, atol=1e-6)
    with pytest.raises(LayoutError, match="Layer 'attention' has 4 heads, which do not divide over 3 devices"):
        Layout(model=3, megatron=True).axes_of(_model(None))


@pytest.mark.parametrize("policy, tolerance", [("mixed_float16", 1e-3), ("mixed_bfloat16", 1e-2)])
def test_mixed_precision_splits_the_slots_of_the_optimizer_a_loss_scale_wraps_and_follows_one_device(
        policy, tolerance):
    """Under mixed_float16 Keras wraps the optimizer in a LossScaleOptimizer, whose inner optimizer makes the
    slots: they are split beside their variables too. The shards' partial sums are rounded to the compute
    dtype before they are summed, one rounding more than one device's: 1.1e-4 apart (float16) and 1.5e-3
    (bfloat16) after 8 steps."""
    keras.mixed_precision.set_dtype_policy(policy)
    try:
        optimizer = lambda: keras.optimizers.SGD(0.05, momentum=0.9)  # noqa: E731
        one = _keras_alone(optimizer)  # the model's file carries the policy of each layer and the loss scale
        split, history = _trained(LayoutStrategy(megatron_layout_map(2)), optimizer)
    finally:
        keras.mixed_precision.set_dtype_policy("float32")
    assert isinstance(split.optimizer, keras.optimizers.LossScaleOptimizer) == (policy == "mixed_float16")
    assert sum(is_split(v) for v in split.optimizer.variables) == 10  # each split variable's momentum
    assert history["loss"] == pytest.approx(one["history"]["loss"], rel=tolerance)
    for whole, got in zip(one["weights"], split.get_weights()):
        np.testing.assert_allclose(got, whole, atol=tolerance)


@pytest.mark.slow
def test_tfdist_train_runs_the_shipped_layout_config_and_reports_its_mesh(tmp_path):
    from helpers import train_with_metrics

    proc, result = train_with_metrics(tmp_path, "configs/layout.yaml", "train.epochs=2")
    assert result["strategy"] == "layout" and result["devices"] == ["/cpu:0", "/cpu:1"]
    assert result["layout"]["mesh"] == {"batch": 1, "model": 2} and result["layout"]["split_variables"] == 3
    assert result["final"]["val_accuracy"] >= 0.9
    assert "layout          mesh batch 1 x model 2 over 1 process(es), 3 variable(s) split" in proc.stdout
    assert "global batch    64 (64 per replica" in proc.stdout  # both replicas of the one copy see every example


def test_a_custom_training_loop_is_refused_in_one_line():
    """TensorFlow's custom-loop guide divides each replica's loss by the global batch and its regularization by
    the replicas; under a layout every device of the model axis sees the same examples, which would count each
    one model-axis times and not the regularization: refused, where `fit` (whose loss scaling tfdist knows)
    trains as one device does. So is a model the layout has not split (never given to `fit`)."""
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    for split in (True, False):
        strategy = LayoutStrategy(megatron_layout_map(2))
        with strategy.scope():
            model = attention_and_mlp(16)
            optimizer = keras.optimizers.SGD(0.05)
        if split:
            strategy.split(model)

        @tf.function
        def step(x, y):
            def replica_step(x, y):
                with tf.GradientTape() as tape:
                    loss = tf.nn.compute_average_loss(loss_fn(y, model(x, training=True)), global_batch_size=16)
                optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                              model.trainable_variables))
            strategy.run(replica_step, args=(x, y))

        with pytest.raises(ValueError, match="LayoutStrategy trains a model split over 2 devices with Keras.s fit "
                                             r"\(or train_on_batch\) in this version, not in a custom training loop"):
            step(X[:16], Y[:16])


def test_keras_own_global_distribution_beside_a_layouts_is_one_line_at_compile():
    """Keras's global distribution set beside tfdist's layout strategy failed at the first step ("'NoneType'
    object has no attribute 'batch_reduce'"): tfdist.set_distribution leaves Keras's unset, and a model compiled
    with both is refused in one line. (A DataParallel's MirroredStrategy trains with it set, as Keras does.)"""
    import tfdist

    mesh = keras.distribution.DeviceMesh((1, 2), ["batch", "model"], devices=["cpu:0", "cpu:1"])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*dense.*kernel"] = (None, "model")
    distribution = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
    strategy = tfdist.strategy_from(distribution)
    keras.distribution.set_distribution(distribution)
    try:
        with strategy.scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, name="dense")])
            with pytest.raises(ValueError, match="keras.distribution.set_distribution was called too"):
                model.compile(optimizer="sgd", loss="mse")
    finally:
        keras.distribution.set_distribution(None)


@pytest.mark.parametrize("data", [1, 2], ids=["1x2", "2x2"])
def test_lora_on_a_megatron_pair_trains_as_on_one_device(data):
    """A Dense pair with LoRA enabled: the column's `lora_kernel_b` splits with its kernel's columns (and bias) and its
    `lora_kernel_a` stays whole, the row's `lora_kernel_a` splits with its kernel's rows; the frozen kernels stay as
    they were."""
    def lora_pair(strategy=None):
        keras.utils.set_random_seed(0)
        with strategy.scope() if strategy else contextlib.nullcontext():
            inputs = keras.Input((8,))
            hidden = keras.layers.Dense(16, activation="relu", name="column")(inputs)
            model = keras.Model(inputs, keras.layers.Dense(8, name="row")(hidden))
            for layer in model.layers[1:]:
                layer.enable_lora(2)
                layer.lora_kernel_b.assign(np.random.default_rng(1).normal(size=layer.lora_kernel_b.shape) * 0.1)
            model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        x = np.random.default_rng(0).normal(size=(32, 8)).astype("float32")
        return model, model.fit(x, x[:, ::-1], batch_size=16, epochs=3, shuffle=False, verbose=0).history["loss"]

    one, one_loss = lora_pair()
    split, loss = lora_pair(LayoutStrategy(Layout(model=2, data=data, megatron=True)))
    assert loss == pytest.approx(one_loss, abs=1e-6)
    for expected, got in zip(one.get_weights(), split.get_weights()):
        np.testing.assert_allclose(got, expected, atol=1e-6)
    assert sorted(v.path for v in split.variables if is_split(v)) == [
        "column/bias", "column/kernel", "column/lora_kernel_b", "row/kernel", "row/lora_kernel_a"]
