"""PipelineStrategy: each stage's variables, optimizer slots and computation live on its own devices.

A CPU-only machine cannot show memory, so placement is proven by reading the
device of every copy of every variable and slot, and by reading the copies
TensorFlow's runtime made between devices (`tfdist.parallel.copies`).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfdist import PipelineStrategy
from tfdist.layers import ColumnParallelDense, RowParallelDense
from tfdist.parallel.copies import variable_copies, weight_bytes
from tfdist.strategies.replica_groups import bytes_by_device

FOUR = ["/cpu:0", "/cpu:1", "/cpu:2", "/cpu:3"]
BATCH = 32

rng = np.random.default_rng(0)
X = rng.standard_normal((3 * BATCH, 12)).astype("float32")
Y = rng.integers(0, 5, 3 * BATCH).astype("int32")


def _sequential(regularizer=None):
    keras.utils.set_random_seed(1)
    hidden = [
        keras.layers.Dense(24, activation="tanh", kernel_regularizer=regularizer, name=f"hidden{i}")
        for i in range(3)
    ]
    return keras.Sequential([keras.Input((12,)), *hidden, keras.layers.Dense(5, name="logits")])


def _skip_over_a_stage():
    """`a` (stage 0) feeds `e` (stage 2) past stage 1."""
    keras.utils.set_random_seed(1)
    inp = keras.Input((12,))
    a = keras.layers.Dense(24, activation="tanh", name="a")(inp)
    b = keras.layers.Dense(24, activation="tanh", name="b")(a)
    d = keras.layers.BatchNormalization(name="d")(keras.layers.Dense(24, name="c")(b))
    e = keras.layers.Concatenate(name="e")([d, a])
    return keras.Model(inp, keras.layers.Dense(5, name="logits")(e))


def _compile(model, optimizer=None):
    model.compile(
        optimizer=optimizer or keras.optimizers.Adam(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def _build(build, strategy, optimizer=None):
    with strategy.scope():
        return _compile(build(), optimizer() if optimizer else None)


def _copies(variable) -> list[str]:
    """The devices (`CPU:1`) of every copy of a Keras variable."""
    return [name for name in bytes_by_device([variable])]


def _short(device: str) -> str:
    return device.strip("/").upper()


def _assert_each_stage_holds_its_own(strategy, model):
    """Every variable of stage k (and every optimizer slot made from it) sits on stage k's devices, replica by replica."""
    partition = strategy.partition_of(model)
    stage_devices = {
        id(v): [[_short(replica[stage.index])] for replica in strategy.stage_devices]
        for stage in partition.stages
        for v in stage.model.variables
    }
    for v in model.variables:
        copies = _copies(v)
        assert len(copies) == strategy.num_replicas_in_sync, (v.path, copies)
        for copy, group in zip(copies, stage_devices[id(v)]):
            assert copy in group, (v.path, copies, stage_devices[id(v)])
    slots = [s for s in model.optimizer.variables if s.shape.rank]  # not the step counter or learning rate
    by_path = {v.path.replace("/", "_"): v for v in model.trainable_variables}
    assert slots
    for slot in slots:
        reference = next(v for p, v in by_path.items() if slot.path.split("/")[-1].startswith(p + "_"))
        assert _copies(slot) == _copies(reference), (slot.path, _copies(slot), reference.path)


def _assert_same(a, b, atol=1e-5):
    for x, y in zip(a.get_weights(), b.get_weights()):
        np.testing.assert_allclose(x, y, atol=atol, rtol=0)


def test_a_sequential_models_stages_hold_their_weights_and_slots_and_copy_none():
    strategy = PipelineStrategy(2, 4, devices=FOUR[:2], verbose=False)
    model = _build(_sequential, strategy)
    names = [v.path for v in model.weights]
    copies = variable_copies(lambda: model.fit(X, Y, batch_size=BATCH, epochs=1, verbose=0))
    _assert_each_stage_holds_its_own(strategy, model)
    assert [v.path for v in model.weights] == names
    assert weight_bytes(copies) == 0, [c for c in copies if not c.is_scalar]
    # What crosses is the optimizer's step counter, read by every update on stage 1.
    assert copies and {c.source for c in copies} == {"CPU:0"}
    assert weight_bytes(variable_copies(lambda: model.evaluate(X, Y, verbose=0))) == 0
    assert weight_bytes(variable_copies(lambda: model.predict(X, verbose=0))) == 0
    params, slots = bytes_by_device(model.weights), bytes_by_device(model.optimizer.variables)
    assert set(params) == {"CPU:0", "CPU:1"} and params["CPU:1"] > 0 and slots["CPU:1"] == 2 * params["CPU:1"]


def test_the_old_placement_copies_weights_every_micro_batch():
    """The measurement can fail: with every variable on the first device, stage 1 reads its weights from there."""
    strategy = PipelineStrategy(2, 4, devices=FOUR[:2], boundaries=["hidden2"], verbose=False, place_variables=False)
    model = _build(_sequential, strategy)
    copies = variable_copies(lambda: model.fit(X, Y, batch_size=BATCH, epochs=1, verbose=0))
    stage1 = sum(4 * int(np.prod(v.shape)) for v in model.get_layer("hidden2").weights + model.get_layer("logits").weights)
    assert weight_bytes(copies) == 4 * stage1  # 4 micro-batches, one read each
    assert set(bytes_by_device(model.weights)) == {"CPU:0"}


@pytest.mark.parametrize("schedule,recompute", [("gpipe", False), ("1f1b", True)])
def test_a_skip_connection_over_a_stage_on_two_replicas(schedule, recompute):
    strategy = PipelineStrategy(
        2, 2, devices=FOUR, schedule=schedule, recompute=recompute, boundaries=["c"], verbose=False
    )
    assert strategy.num_replicas_in_sync == 2
    model = _build(_skip_over_a_stage, strategy)
    copies = variable_copies(lambda: model.fit(X, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0))
    _assert_each_stage_holds_its_own(strategy, model)
    assert _copies(model.get_layer("a").kernel) == ["CPU:0", "CPU:2"]
    assert _copies(model.get_layer("d").moving_mean) == ["CPU:1", "CPU:3"]
    assert weight_bytes(copies) == 0, [c for c in copies if not c.is_scalar]


def test_tensor_parallel_shards_sit_on_their_own_device_of_the_stage():
    from tfdist.parallel.split_variables import shards

    def build():
        keras.utils.set_random_seed(0)
        return keras.Sequential([
            keras.Input((12,)), keras.layers.Dense(24, activation="tanh", name="embed"),
            ColumnParallelDense(24, activation="tanh", name="column"), RowParallelDense(24, name="row"),
            keras.layers.Dense(5, name="logits"),
        ])

    strategy = PipelineStrategy(2, 4, devices=FOUR, tensor_parallel_size=2, boundaries=["row"], verbose=False)
    model = _build(build, strategy)
    copies = variable_copies(lambda: model.fit(X, Y, batch_size=BATCH, epochs=1, verbose=0))
    assert [k.device[-5:] for k in shards(model.get_layer("column").kernel)] == ["CPU:0", "CPU:1"]
    assert [k.device[-5:] for k in shards(model.get_layer("row").kernel)] == ["CPU:2", "CPU:3"]
    assert _copies(model.get_layer("logits").kernel) == ["CPU:2", "CPU:3"]  # a whole layer: each device of its stage
    held = bytes_by_device(model.optimizer.variables)
    assert held["CPU:1"] > 0 and held["CPU:3"] > 0
    assert weight_bytes(copies) == 0, [c for c in copies if not c.is_scalar]


def test_mixed_float16_keeps_the_loss_scale_on_the_first_device():
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    strategy = PipelineStrategy(2, 2, devices=FOUR[:2], verbose=False)
    model = _build(_sequential, strategy)
    copies = variable_copies(lambda: model.fit(X, Y, batch_size=BATCH, epochs=2, verbose=0))
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    _assert_each_stage_holds_its_own(strategy, model)
    assert _copies(model.optimizer.dynamic_scale) == ["CPU:0"]
    assert weight_bytes(copies) == 0, [c for c in copies if not c.is_scalar]


def test_weight_penalties_and_weight_decay_exclusions_train_as_on_one_device():
    """Every stage's kernel penalty reaches its gradient (the last stage's loss alone reaches only its own
    weights); a weight decay exclusion made before the move still applies after it."""

    def train(strategy):
        model = _build(
            lambda: _sequential(keras.regularizers.L2(0.01)), strategy, lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1)
        )
        model.optimizer.exclude_from_weight_decay(var_list=[model.get_layer("hidden2").kernel])
        history = {}
        copies = variable_copies(
            lambda: history.update(model.fit(X, Y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0).history)
        )
        return model, history, copies

    reference, expected, _ = train(tf.distribute.get_strategy())
    model, history, copies = train(PipelineStrategy(2, 4, devices=FOUR[:2], boundaries=["hidden2"], verbose=False))
    _assert_same(reference, model)
    np.testing.assert_allclose(history["loss"], expected["loss"], atol=1e-5)
    assert weight_bytes(copies) == 0, [c for c in copies if not c.is_scalar]


def test_a_loss_added_in_a_layers_call_is_refused():
    strategy = PipelineStrategy(2, 2, devices=FOUR[:2], verbose=False)
    with strategy.scope():
        model = _compile(keras.Sequential([
            keras.Input((12,)), keras.layers.Dense(8, activity_regularizer="l2", name="noisy"), keras.layers.Dense(5),
        ]))
    with pytest.raises(ValueError, match=r"cannot train stage 0 \(noisy\): a layer adds a loss in its call"):
        model.fit(X, Y, batch_size=BATCH, epochs=1, verbose=0)


def test_an_optimizer_built_before_the_first_step_moves_its_state(tmp_path):
    """Plain -> pipelined: a saved model's optimizer state loads first, moves with the weights, and training goes on as on one device."""
    plain = _build(_sequential, tf.distribute.get_strategy())
    plain.fit(X, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    path = str(tmp_path / "plain.keras")
    plain.save(path)

    strategy = PipelineStrategy(2, 4, devices=FOUR[:2], verbose=False)
    with strategy.scope():
        loaded = keras.models.load_model(path)
    assert loaded.optimizer.built and loaded.optimizer.iterations.numpy() == 3
    np.testing.assert_allclose(loaded.predict(X, verbose=0), plain.predict(X, verbose=0), atol=1e-6)
    plain.fit(X, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    loaded.fit(X, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    _assert_each_stage_holds_its_own(strategy, loaded)
    _assert_same(plain, loaded)


def test_a_pipelined_model_saves_and_loads_as_plain_keras(tmp_path):
    """Pipelined -> plain, as a .keras file and as weights."""
    strategy = PipelineStrategy(2, 4, devices=FOUR[:2], verbose=False)
    model = _build(_sequential, strategy)
    model.fit(X, Y, batch_size=BATCH, epochs=1, verbose=0)
    model.save(tmp_path / "model.keras")
    model.save_weights(tmp_path / "model.weights.h5")
    expected = model.predict(X, verbose=0)

    np.testing.assert_allclose(keras.models.load_model(tmp_path / "model.keras").predict(X, verbose=0), expected, atol=1e-6)
    plain = _sequential()
    plain.load_weights(tmp_path / "model.weights.h5")
    np.testing.assert_allclose(plain.predict(X, verbose=0), expected, atol=1e-6)


def test_a_weight_shared_across_stages_stays_with_the_first_and_trains_as_on_one_device():
    class Tied(keras.layers.Layer):
        """Projects back with the transposed kernel of another layer."""

        def __init__(self, source, **kwargs):
            super().__init__(**kwargs)
            self.source = source

        def call(self, x):
            return keras.ops.matmul(x, keras.ops.transpose(self.source.kernel))

    def build():
        inp = keras.Input((12,))
        encode = keras.layers.Dense(24, name="encode")
        hidden = keras.layers.Dense(24, name="hidden")(encode(inp))
        return keras.Model(inp, Tied(encode, name="decode")(hidden))

    keras.utils.set_random_seed(0)
    plain = build()
    plain.compile(optimizer="sgd", loss="mse")
    plain.fit(X, X, batch_size=BATCH, epochs=1, verbose=0, shuffle=False)
    strategy = PipelineStrategy(2, 2, devices=FOUR[:2], boundaries=["decode"], verbose=False)
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = build()
        model.compile(optimizer="sgd", loss="mse")
    model.fit(X, X, batch_size=BATCH, epochs=1, verbose=0, shuffle=False)
    # The tied kernel's gradient is the sum of both stages' (its bias's, stage 0's alone): as one device's.
    for want, got in zip(plain.get_weights(), model.get_weights()):
        np.testing.assert_allclose(got, want, atol=1e-6)  # float32 sums of 2 micro-batches in another order
    assert "CPU:0" in model.get_layer("encode").kernel.value.device  # with stage 0, which stage 1 reads


def test_the_partition_printout_gives_each_stages_bytes(capsys):
    strategy = PipelineStrategy(2, 4, devices=FOUR[:2], boundaries=["hidden2"])
    model = _build(_sequential, strategy)
    model.fit(X, Y, batch_size=BATCH, epochs=1, verbose=0)
    out = capsys.readouterr().out
    stage1 = 4 * (24 * 24 + 24 + 24 * 5 + 5)
    assert f"stage 1 on /cpu:1: hidden2, logits (725 params, holds {stage1:,} bytes of weights and " in out
    assert strategy.stage_memory(model)[1] == {"params": stage1, "optimizer": 2 * stage1}


def test_a_stage_of_many_layers_prints_its_first_and_last_and_reports_them_all(capsys):
    def deep():
        keras.utils.set_random_seed(1)
        return keras.Sequential([keras.Input((12,)), *(keras.layers.Dense(8, name=f"layer{i}") for i in range(10)),
                                 keras.layers.Dense(5, name="logits")])

    strategy = PipelineStrategy(2, 4, devices=FOUR[:2], boundaries=["layer5"])
    model = _build(deep, strategy)
    model.fit(X, Y, batch_size=BATCH, epochs=1, verbose=0)
    out = capsys.readouterr().out
    assert "stage 0 on /cpu:0: layer0 ... layer4 (5 layers) (" in out
    assert "stage 1 on /cpu:1: layer5 ... logits (6 layers) (" in out
    stages = strategy.job_report(model)["pipeline"]["partition"]["stages"]
    assert [stage["layers"] for stage in stages] == [[f"layer{i}" for i in range(5)],
                                                     [f"layer{i}" for i in range(5, 10)] + ["logits"]]
