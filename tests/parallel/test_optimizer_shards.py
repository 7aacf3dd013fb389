"""The optimizer state split over a mirrored job's devices (ZeRO stages 1 and 2), and the weights too (stage 3): the
same weights as unsplit, each device holding the slots (and at stage 3 the weights) of 1/N of every variable."""

import io
import math
import os
import re

import keras
import numpy as np
import pytest

from helpers import ROOT
from oracle import keras_alone
from tfdist import Checkpoint, MirroredStrategy, load_config
from benchmarks.sharded_optimizer import step_collectives
from tfdist.errors import ConfigError
from tfdist.parallel.optimizer_shards import ELEMENTWISE_OPTIMIZERS, shard_optimizer_state, shards_of
from tfdist.parallel.weight_shards import is_sharded
from tfdist.strategies import PipelineStrategy, TensorParallelStrategy
from tfdist.strategies.replica_groups import bytes_by_device
from tfdist.training import run

STEPS = 20  # 2 epochs of 10 batches of 32


def _adamw_without_decay_on_biases():
    optimizer = keras.optimizers.AdamW(0.01, weight_decay=0.1)
    optimizer.exclude_from_weight_decay(var_names=["bias"])
    return optimizer


OPTIMIZERS = {
    "sgd_momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adamw_excluding_biases": _adamw_without_decay_on_biases,
    "adam_global_clipnorm": lambda: keras.optimizers.Adam(0.01, global_clipnorm=0.1),
    "adam_schedule": lambda: keras.optimizers.Adam(keras.optimizers.schedules.ExponentialDecay(0.02, 5, 0.5)),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.01, momentum=0.5, centered=True),
    "adagrad": lambda: keras.optimizers.Adagrad(0.1),
    "mixed_float16_loss_scaling": lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.01)),
}


# At stage 3 the kernels (84 and 21 elements) are split, the biases (7 and 3) stay whole.
KEEP_WHOLE_BELOW = 8


# Stage 3 changes where the weights live, not the update: the optimizers, and clipping's own path.
STAGE_3 = ("sgd_momentum", "adam", "adamw_excluding_biases", "adam_global_clipnorm", "mixed_float16_loss_scaling")


def _train(devices, make_optimizer, stage, epochs=2, callbacks=()):
    """(model, optimizer, its shards or None) after `epochs` epochs of 10 steps under a MirroredStrategy on
    `devices` logical CPUs, with `shard_optimizer=stage` (0 or False: unsplit, 1 or True, 2, 3)."""
    strategy = MirroredStrategy([f"/cpu:{i}" for i in range(devices)], shard_optimizer=int(stage),
                                keep_whole_below=KEEP_WHOLE_BELOW)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((320, 12)).astype("float32")
    y = x[:, :3].argmax(axis=1).astype("int32")
    keras.utils.set_random_seed(0)
    with strategy.scope():
        # 91 + 7 + 21 + 3 weights: lengths that N = 2 and 4 do not all divide, so slices are padded.
        model = keras.Sequential([keras.Input((12,)), keras.layers.Dense(7, activation="tanh"),
                                  keras.layers.Dense(3, activation="softmax", dtype="float32")])
        optimizer = make_optimizer()
        model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")  # split here if `split`
        shards = shards_of(optimizer)
        assert (shards is not None) == bool(stage)
    if epochs:
        model.fit(x, y, batch_size=32, epochs=epochs, shuffle=False, verbose=0, callbacks=list(callbacks))
    return model, optimizer, shards


@pytest.mark.parametrize("devices", [2, 4])  # 4: other slice lengths and paddings
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_split_state_trains_the_same_weights_as_one_copy_per_device(cpus, name, devices):
    """Stage 1 (the gradients all-reduced), stage 2 (reduce-scattered) and stage 3 (the weights split too)
    against the same job unsplit."""
    keras.mixed_precision.set_dtype_policy("mixed_float16" if "float16" in name else "float32")
    whole, whole_optimizer, _ = _train(devices, OPTIMIZERS[name], stage=0)
    for stage in (1, 2, 3) if name in STAGE_3 else (1, 2):
        split, optimizer, shards = _train(devices, OPTIMIZERS[name], stage=stage)
        assert int(optimizer.iterations.numpy()) == STEPS and shards.collectives.stage == stage
        # Stage 3 runs each layer's float16 forward again in its backward pass, its products fused otherwise.
        tolerance = 1e-5 if stage == 3 and "float16" in name else 1e-6
        for a, b in zip(whole.get_weights(), split.get_weights()):
            np.testing.assert_allclose(a, b, atol=tolerance, rtol=0, err_msg=f"stage {stage}")
        if name == "adam" and stage < 3:
            _assert_each_device_holds_the_slots_of_its_slices_only(whole_optimizer, optimizer, shards, devices)
            _assert_the_reduced_gradients_are_split_at_stage_2(whole, split, stage, devices)
        if name == "adam" and stage == 3:
            _assert_each_device_holds_its_slices_of_the_kernels_only(whole, split, devices)


def _assert_each_device_holds_its_slices_of_the_kernels_only(whole, split, devices):
    """Weights and slots by device: the kernels and their slots 1/N each (padded), the biases whole on every device
    and their slots split as at stage 2."""
    unsplit = bytes_by_device(whole.weights + [v for v in whole.optimizer.variables if len(v.shape)])
    shards = shards_of(split.optimizer)
    held = bytes_by_device(split.weights + [v for copy in shards.copies for v in copy.variables if len(v.shape)])
    assert len(held) == devices and len(set(held.values())) == 1, held
    kernels, biases = 3 * 4 * (84 + 21), 3 * 4 * (7 + 3)  # weights and Adam's two slots
    assert set(unsplit.values()) == {kernels + biases}
    padded = 3 * 4 * (-(-84 // devices) + -(-21 // devices)) + 2 * 4 * (-(-7 // devices) + -(-3 // devices))
    assert set(held.values()) == {padded + 4 * (7 + 3)}, held
    assert sorted(shards.sharded) == [0, 2]


def _assert_the_reduced_gradients_are_split_at_stage_2(whole, split, stage, devices):
    batch = (np.zeros((8, 12), "float32"), np.zeros((8,), "int32"))
    unsplit = step_collectives(whole, batch)["reduced_bytes_by_device"]
    assert len(unsplit) == devices and len(set(unsplit.values())) == 1  # every device: the whole gradient
    held = step_collectives(split, batch)["reduced_bytes_by_device"]
    assert len(held) == devices, held
    largest = max(held.values()) / next(iter(unsplit.values()))
    if stage == 2:
        assert largest <= 1.15 / devices, held
    else:  # the whole sum reaches every device before it keeps its slice
        assert largest >= 1, held


def _assert_each_device_holds_the_slots_of_its_slices_only(whole, split, shards, devices):
    def slot_bytes_by_device(variables):
        by_device = {}
        for variable in variables:
            if len(variable.shape) == 0:  # the step counter
                continue
            for value in getattr(variable.value, "values", (variable.value,)):  # a mirrored one: each copy
                by_device[value.device] = by_device.get(value.device, 0) + 4 * math.prod(value.shape)
        return by_device

    unsplit = slot_bytes_by_device(whole.variables)
    assert len(unsplit) == devices and len(set(unsplit.values())) == 1  # every device: Adam's 2 slots, whole
    per_device = [slot_bytes_by_device(copy.variables) for copy in shards.copies]
    assert [list(d) for d in per_device] == [[device] for device in unsplit]  # each copy on its own device
    largest = max(bytes_ for d in per_device for bytes_ in d.values())
    assert largest <= 1.15 / devices * next(iter(unsplit.values()))
    assert all(len(v.shape) == 0 for v in split.variables)  # the optimizer itself: its step and rate only


def test_keras_features_train_the_same_weights_and_history_split_and_unsplit(cpus):
    """What a user's fit does besides the optimizer: BatchNorm's moving statistics, sample and class
    weights, validation, callbacks, a short last batch and clipnorm, at stages 2 and 3 on 2 devices against the
    same job unsplit."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((329, 12)).astype("float32")  # a last batch of 7 of 263: 4 and 3 on the devices
    y = x[:, :3].argmax(axis=1).astype("int32")
    sample_weight = rng.uniform(0.5, 1.5, 329).astype("float32")

    def fit(stage):
        strategy = MirroredStrategy(["/cpu:0", "/cpu:1"], shard_optimizer=stage, keep_whole_below=KEEP_WHOLE_BELOW)
        keras.utils.set_random_seed(0)
        with strategy.scope():
            # No bias before the BatchNormalization: its gradient is rounding noise, which Adam scales up to
            # steps of the learning rate's size, so any change in the order of a sum moves it.
            model = keras.Sequential([keras.Input((12,)), keras.layers.Dense(8, use_bias=False),
                                      keras.layers.BatchNormalization(),
                                      keras.layers.Activation("relu"), keras.layers.Dense(3, activation="softmax")])
            model.compile(optimizer=keras.optimizers.Adam(0.01, clipnorm=0.5), loss="sparse_categorical_crossentropy",
                          metrics=["accuracy"])
        lowered = []
        schedule = keras.callbacks.LearningRateScheduler(lambda epoch, rate: rate * 0.5 if epoch else rate)
        record = keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: lowered.append(logs["val_loss"]))
        history = model.fit(x, y, sample_weight=sample_weight, batch_size=32, epochs=2, validation_split=0.2,
                            shuffle=False, verbose=0, callbacks=[schedule, record]).history
        more = model.fit(x, y, class_weight={0: 1.0, 1: 2.0, 2: 0.5}, batch_size=32, epochs=1, shuffle=False,
                         verbose=0).history  # Keras takes sample or class weights, not both at once
        return model, {**history, **{f"then_{key}": value for key, value in more.items()}}, lowered

    whole, whole_history, whole_seen = fit(0)
    for stage in (2, 3):
        split, split_history, split_seen = fit(stage)
        assert shards_of(split.optimizer) is not None and set(split_history) == set(whole_history)
        for a, b in zip(whole.get_weights(), split.get_weights()):  # BatchNorm's moving mean and variance too
            np.testing.assert_allclose(a, b, atol=1e-6, rtol=0, err_msg=f"stage {stage}")
        for key in whole_history:
            np.testing.assert_allclose(split_history[key], whole_history[key], atol=1e-6, err_msg=f"{key} {stage}")
        np.testing.assert_allclose(split_seen, whole_seen, atol=1e-6)


def test_an_optimizer_that_does_not_split_element_by_element_is_refused(cpus):
    strategy = MirroredStrategy(["/cpu:0", "/cpu:1"])
    with pytest.raises(ValueError, match="Lamb does not or is not checked. Received: Lamb"):
        shard_optimizer_state(keras.optimizers.Lamb(), strategy)
    assert keras.optimizers.Lamb not in ELEMENTWISE_OPTIMIZERS


def test_a_built_optimizer_is_refused(cpus):
    strategy = MirroredStrategy(["/cpu:0", "/cpu:1"])
    optimizer = keras.optimizers.Adam()
    optimizer.build([keras.Variable(np.zeros(3, "float32"))])
    with pytest.raises(ValueError, match="must not be built yet"):
        shard_optimizer_state(optimizer, strategy)


def test_clipping_by_norm_with_accumulation_at_stage_3_is_refused(cpus):
    strategy = MirroredStrategy(["/cpu:0", "/cpu:1"], shard_optimizer=3)
    with pytest.raises(ValueError, match="cannot clip by norm weights split over devices"):
        shard_optimizer_state(keras.optimizers.Adam(clipnorm=1.0, gradient_accumulation_steps=2), strategy,
                              strategy.slice_collectives())


class _Killed(Exception):
    pass


class _KillAt(keras.callbacks.Callback):
    """Stands for SIGKILL: training stops at this step with no callback's end hooks run."""

    def __init__(self, step):
        super().__init__()
        self.step = step

    def on_train_batch_end(self, batch, logs=None):
        self.step -= 1
        if self.step == 0:
            raise _Killed()


def _assert_same_weights(a, b, exact=False):
    """`exact`: the same steps from the same bytes, with the same kernels on the same shapes, in the same order."""
    for x, y in zip(a.get_weights(), b.get_weights()):
        np.testing.assert_allclose(x, y, atol=0 if exact else 1e-6, rtol=0)  # exact: see the docstring


def test_gradient_accumulation_at_stage_3_splits_the_accumulators_and_trains_as_one_device(cpus, tmp_path):
    """Keras's gradient_accumulation_steps with the weights split: AdamW, clipvalue, 3 batches a step and a short
    last batch (60 examples in batches of 8 over 4 replicas) train one device's weights and History; each split
    weight's accumulator is split beside it, and a Keras file holds it whole."""
    from tfdist import _compat

    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((60, 8)).astype("float32"), rng.standard_normal((60, 2)).astype("float32")
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    model = keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Dense(16, activation="relu")(inputs)))
    model.compile(loss="mse", optimizer=keras.optimizers.AdamW(0.05, weight_decay=0.1, clipvalue=0.5,
                                                               gradient_accumulation_steps=3))
    model.save(tmp_path / "model.keras")
    expected = keras_alone("fit", str(tmp_path / "model.keras"), x, y, batch_size=8, epochs=2, shuffle=False)
    with MirroredStrategy(FOUR, shard_optimizer=3, keep_whole_below=16).scope():
        model = keras.models.load_model(tmp_path / "model.keras")
    history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
    for a, b in zip(expected["weights"], model.get_weights()):
        np.testing.assert_allclose(b, a, atol=1e-6, rtol=0)
    np.testing.assert_allclose(history["loss"], expected["history"]["loss"], atol=1e-6)
    split = [v for v in model.trainable_variables if is_sharded(v)]  # the kernels and the first bias
    accumulators = [a for a in _compat.gradient_accumulators(model.optimizer) if is_sharded(a)]
    assert len(split) == len(accumulators) == 3
    for weight, accumulator in zip(split, accumulators):
        assert [c.shape for c in accumulator.value.values] == [c.shape for c in weight.value.values]
    model.save(tmp_path / "split.keras")
    loaded = keras.models.load_model(tmp_path / "split.keras")
    assert [tuple(v.shape) for v in loaded.optimizer.variables] == expected["optimizer_shapes"]


def test_a_custom_training_loop_trains_split_weights_as_unsplit(cpus):
    """TensorFlow's custom-training guide's loop (a tape inside `strategy.run`, `tf.nn.compute_average_loss`,
    `apply_gradients`) with the model compiled under the scope: at stage 3 the optimizer is built at `compile`,
    so the loop's first forward pass already gathers split weights, and it trains the unsplit weights. A model
    built only in the loop is refused in one line."""
    import tensorflow as tf

    rng = np.random.default_rng(0)
    x = rng.standard_normal((128, 12)).astype("float32")
    y = x[:, :3].argmax(axis=1).astype("int32")

    def train(stage, built=True):
        strategy = MirroredStrategy(["/cpu:0", "/cpu:1"], shard_optimizer=stage, keep_whole_below=KEEP_WHOLE_BELOW)
        keras.utils.set_random_seed(0)
        with strategy.scope():
            model = keras.Sequential([*([keras.Input((12,))] if built else []), keras.layers.Dense(16, "relu"),
                                      keras.layers.Dense(3)])
            optimizer = keras.optimizers.Adam(0.01)
            model.compile(optimizer=optimizer)
            loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

        def step(batch):
            features, labels = batch
            with tf.GradientTape() as tape:
                loss = tf.nn.compute_average_loss(loss_fn(labels, model(features, training=True)),
                                                  global_batch_size=32)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))

        distributed_step = tf.function(lambda batch: strategy.run(step, args=(batch,)))
        for batch in strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(32)):
            distributed_step(batch)
        return model

    unsplit, split = train(0), train(3)
    assert [is_sharded(v) for v in split.trainable_variables] == [True, True, True, False]
    for a, b in zip(unsplit.get_weights(), split.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="must be built before the first step reads them"):
        train(3, built=False)


@pytest.mark.parametrize("name, stage", [("adam", 1), ("mixed_float16_loss_scaling", 1), ("adam", 3)])
def test_a_killed_split_run_resumes_from_its_checkpoint_bit_exact(cpus, tmp_path, name, stage):
    keras.mixed_precision.set_dtype_policy("mixed_float16" if "float16" in name else "float32")
    whole, _, _ = _train(2, OPTIMIZERS[name], stage=stage)
    with pytest.raises(_Killed):
        _train(2, OPTIMIZERS[name], stage=stage, callbacks=[Checkpoint(str(tmp_path), every_steps=4), _KillAt(15)])
    checkpoint = Checkpoint(str(tmp_path), every_steps=4)
    resumed, optimizer, _ = _train(2, OPTIMIZERS[name], stage=stage, callbacks=[checkpoint])
    assert checkpoint.resumed_from_step == 12 and int(optimizer.iterations.numpy()) == STEPS
    _assert_same_weights(resumed, whole, exact=True)


@pytest.fixture(scope="module")
def three_unsplit_epochs(cpus):
    return _train(2, OPTIMIZERS["adam"], stage=0, epochs=3)[0].get_weights()


# (devices, stage) saved and resumed.
@pytest.mark.parametrize("saved, resumed", [((2, 1), (4, 1)), ((4, 0), (2, 3)), ((2, 3), (4, 3)), ((4, 3), (2, 0))])
def test_a_checkpoint_resumes_split_or_unsplit_on_another_number_of_devices(three_unsplit_epochs, tmp_path, saved,
                                                                           resumed):
    """A checkpoint holds each slot (and at stage 3 each weight) whole, so the next epoch trains as the unsplit
    job's does."""
    (devices, split), adam = saved, OPTIMIZERS["adam"]
    _train(devices, adam, split, epochs=2, callbacks=[Checkpoint(str(tmp_path))])
    (devices, split), checkpoint = resumed, Checkpoint(str(tmp_path))
    model, _, _ = _train(devices, adam, split, epochs=3, callbacks=[checkpoint])
    assert checkpoint.resumed_from_step == STEPS
    for a, b in zip(model.get_weights(), three_unsplit_epochs):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)


@pytest.mark.parametrize("stage", [1, 3])
def test_a_keras_file_holds_the_unsplit_state_and_loads_both_ways(cpus, tmp_path, stage):
    unsplit, unsplit_optimizer, _ = _train(2, OPTIMIZERS["adam"], stage=0)
    split, _, _ = _train(2, OPTIMIZERS["adam"], stage=stage)
    split.save(tmp_path / "split.keras")
    loaded = keras.models.load_model(tmp_path / "split.keras")  # Keras's own optimizer, not split
    assert len(loaded.optimizer.variables) == len(unsplit_optimizer.variables)
    for a, b in zip(loaded.optimizer.variables + loaded.weights, unsplit_optimizer.variables + unsplit.weights):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-6, rtol=0, err_msg=b.path)

    unsplit.save_weights(tmp_path / "unsplit.weights.h5")
    into, optimizer, shards = _train(4, OPTIMIZERS["adam"], stage=stage, epochs=0)
    optimizer.build(into.trainable_variables)
    into.load_weights(tmp_path / "unsplit.weights.h5")
    assert int(optimizer.iterations.numpy()) == STEPS
    for whole, slot in zip(unsplit_optimizer.variables[2:], shards.whole_slots):
        np.testing.assert_array_equal(slot.numpy(), whole.numpy())  # exact: loading copies the saved bytes
    for whole, weight in zip(unsplit.get_weights(), into.get_weights()):
        np.testing.assert_array_equal(weight, whole)  # exact: loading copies the saved bytes


FOUR = ["/cpu:0", "/cpu:1", "/cpu:2", "/cpu:3"]
REPLICA_GROUPS = {  # 2 replicas of 2 devices each: a stage, or a placed layer's device
    "pipeline": lambda split: PipelineStrategy(2, 2, devices=FOUR, boundaries=["second"], verbose=False,
                                               shard_optimizer=split, keep_whole_below=KEEP_WHOLE_BELOW),
    "tensor_parallel": lambda split: TensorParallelStrategy(FOUR, group_size=2, placement={"second": "/cpu:1"},
                                                            shard_optimizer=split),
}


@pytest.mark.parametrize("kind", REPLICA_GROUPS)
def test_the_replicas_of_a_pipeline_or_tensor_parallel_job_split_the_state_beside_each_variable(cpus, kind):
    """The data-parallel dimension: each of the 2 replicas keeps the slots of its slice of every variable,
    on the device where that replica's copy of the variable lives (its stage's, or its placed layer's)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((320, 12)).astype("float32")
    y = x[:, :3].argmax(axis=1).astype("int32")

    def train(split):
        strategy = REPLICA_GROUPS[kind](split)
        keras.utils.set_random_seed(0)
        with strategy.scope():
            hidden = [keras.layers.Dense(8, activation="tanh", name="first"), keras.layers.Dense(7, name="second")]
            model = keras.Sequential([keras.Input((12,)), *hidden, keras.layers.Dense(3, activation="softmax")])
            model.compile(optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy")
        model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
        return model

    whole = train(0)
    # The gradients all-reduced, or reduce-scattered; in a pipeline the weights split too, each stage's among
    # its devices.
    for stage in (1, 2, 3) if kind == "pipeline" else (1, 2):
        split = train(stage)
        for a, b in zip(whole.get_weights(), split.get_weights()):
            np.testing.assert_allclose(a, b, atol=1e-6, rtol=0, err_msg=f"stage {stage}")
        shards = shards_of(split.optimizer)
        assert int(split.optimizer.iterations.numpy()) == STEPS
        unsplit = bytes_by_device([v for v in whole.optimizer.variables if len(v.shape)])
        held = bytes_by_device([slot for copy in shards.copies for slot in copy.variables if len(slot.shape)])
        assert set(held) == set(unsplit) == {"CPU:0", "CPU:1", "CPU:2", "CPU:3"}, (held, unsplit)
        for device, nbytes in held.items():  # every device: about half of what it held unsplit
            assert nbytes <= 1.15 / 2 * unsplit[device], (device, held, unsplit)
        report = split.distribute_strategy.job_report(split)  # the summary and --metrics_out
        assert report["optimizer_state"]["devices"] == 2 and report["optimizer_state"]["stage"] == stage
        assert "optimizer_state" not in whole.distribute_strategy.job_report(whole)
        if kind == "pipeline":  # the stages' bytes count the slices' slots (and weights) where they live
            for whole_stage, split_stage in zip(*(m.distribute_strategy.stage_memory(m) for m in (whole, split))):
                assert 0 < split_stage["optimizer"] <= 1.15 / 2 * whole_stage["optimizer"], (whole_stage, split_stage)
                held_by = 1.15 / 2 if stage == 3 else 1
                assert 0 < split_stage["params"] <= held_by * whole_stage["params"], (stage, whole_stage, split_stage)
        if stage == 3:  # each replica's copy of a split weight is its slice, on its stage's device
            for v, unsplit_v in zip(split.trainable_variables, whole.trainable_variables):
                assert is_sharded(v) == (math.prod(v.shape) >= KEEP_WHOLE_BELOW), v.path
                if is_sharded(v):
                    assert [c.shape[0] for c in v.value.values] == [-(-math.prod(v.shape) // 2)] * 2
                    assert [c.device for c in v.value.values] == [c.device for c in unsplit_v.value.values]
            assert report["optimizer_state"]["weight_bytes_per_device"][0] < report["optimizer_state"][
                "unsplit_weight_bytes"] * 1.15 / 2
            if kind == "pipeline":  # each stage's split weights are gathered on its own devices
                # Per device: 2 split variables x 2 micro-batches x (forward + backward) gathers, and 2 x 2
                # reduce-scatters; on the first stage's also the whole variables' packed update (1 of each).
                expected = {"CollectiveGatherV2": [9, 8, 9, 8], "CollectiveAllToAllV2": [5, 4, 5, 4]}
                assert _collectives_by_device(split, x[:32], y[:32]) == expected


def _collectives_by_device(model, x, y) -> dict:
    """The collective ops of one traced training step of `model` (under its strategy), by type: how many on
    each of CPU:0-3."""
    import tensorflow as tf

    from tfdist import _compat

    strategy = model.distribute_strategy
    data = next(iter(strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensors((x, y)))))
    step = tf.function(tf.autograph.experimental.do_not_convert(
        lambda batch: strategy.run(model.train_step, args=(batch,))))
    graph = step.get_concrete_function(data).graph
    counts = {}
    for op in (op for g in (graph, *_compat.graph_functions(graph)) for op in g.get_operations()):
        if op.type.startswith("Collective"):
            counts.setdefault(op.type, [0] * 4)[int(op.device.rsplit(":", 1)[-1])] += 1
    return counts


@pytest.mark.parametrize("path, placed", [("configs/pipeline.yaml", []),
                                          ("configs/tensor_parallel.yaml", ["placement.layers=[classifier=/cpu:1]"])])
def test_a_pipeline_or_tensor_parallel_config_passes_the_split_to_its_strategy(cpus, path, placed):
    from tfdist import make_strategy

    # TensorFlow runs already here: its thread counts stay as they are.
    config = load_config(os.path.join(ROOT, path), ["strategy.shard_optimizer=1", "runtime.intra_op_threads=0",
                                                    "runtime.inter_op_threads=0", *placed])
    assert make_strategy(config).shard_optimizer == 1


@pytest.mark.parametrize("kind", ["mirrored", "multi_worker_mirrored", "horovod", "pipeline", "tensor_parallel",
                                  "layout"])
def test_a_config_passes_the_weights_split_to_its_strategy(cpus, monkeypatch, kind):
    """`strategy.keep_whole_below` and `prefetch_weights` reach each kind's strategy (each strategy's
    constructor stands in, taking what the factory gives it)."""
    from tfdist.strategies import factory

    given = {}
    for name in ("MirroredStrategy", "MultiWorkerMirroredStrategy", "HorovodStrategy", "PipelineStrategy",
                 "TensorParallelStrategy", "LayoutStrategy"):
        monkeypatch.setattr(factory, name, lambda *args, **kwargs: given.update(kwargs))
    monkeypatch.setattr(factory, "cluster_resolver", lambda config: _NoCluster())
    layout = ["layout.megatron=true", "layout.data_devices=2"] if kind == "layout" else []  # 2 rows to split over
    config = load_config(None, [f"strategy.kind={kind}", *layout, "strategy.shard_optimizer=3",
                                "strategy.keep_whole_below=10", "strategy.prefetch_weights=false",
                                "runtime.intra_op_threads=0", "runtime.inter_op_threads=0"])
    factory._builder(kind)(config, 0)
    assert (given["shard_optimizer"], given["keep_whole_below"], given["prefetch_weights"]) == (3, 10, False)


class _NoCluster:
    def cluster_spec(self):
        return type("Spec", (), {"jobs": []})()


def test_a_placed_model_does_not_split_its_weights_yet(cpus):
    from tfdist import ConfigError, make_strategy

    with pytest.raises(ValueError, match="`shard_optimizer` 3 .* does not apply to a placed model"):
        TensorParallelStrategy(FOUR, group_size=2, placement={"second": "/cpu:1"}, shard_optimizer=3)
    config = load_config(os.path.join(ROOT, "configs/tensor_parallel.yaml"), [
        "strategy.shard_optimizer=3", "placement.layers=[classifier=/cpu:1]", "runtime.intra_op_threads=0",
        "runtime.inter_op_threads=0"])
    with pytest.raises(ConfigError, match="^`strategy.shard_optimizer` 3 .* does not apply to a placed model"):
        make_strategy(config)


def test_a_config_splits_the_state_and_trains_the_same_weights(tmp_path):
    common = ["train.epochs=2", "train.steps_per_epoch=6", "train.verbose=0", "strategy.devices=[/cpu:0, /cpu:1]",
              "train.optimizer=adamw", "model.width=16"]
    whole = run(load_config(None, common), out=io.StringIO())
    out = io.StringIO()
    split = run(load_config(None, [*common, "strategy.shard_optimizer=1"]), out=out)
    assert split["final_weights_digest"] == whole["final_weights_digest"]
    state = split["optimizer_state"]
    assert state["devices"] == 2 and max(state["slot_bytes_per_device"]) <= 1.15 / 2 * state["unsplit_slot_bytes"]
    assert "optimizer state split over 2 devices (ZeRO stage 1): " in out.getvalue()
    assert "optimizer_state" not in whole
    out = io.StringIO()  # the weights split too: the digits MLP's kernels, its biases whole
    split = run(load_config(None, [*common, "strategy.shard_optimizer=3", "strategy.keep_whole_below=100"]), out=out)
    state = split["optimizer_state"]
    assert max(state["weight_bytes_per_device"]) <= 0.55 * state["unsplit_weight_bytes"], state
    assert "(ZeRO stage 3): " in out.getvalue() and " weight bytes, 0.5" in out.getvalue()
    assert split["final"]["loss"] == pytest.approx(whole["final"]["loss"], abs=1e-5)


@pytest.mark.parametrize("setting, message", [
    ("strategy.shard_optimizer=4", "`strategy.shard_optimizer` must be >= 0 and <= 3. Received: 4"),
    ("strategy.kind=pipeline,strategy.tensor_parallel_size=2", "`strategy.shard_optimizer` cannot split the "
                                                               "optimizer of a pipeline whose stages are split"),
    ("strategy.keep_whole_below=10", "`strategy.keep_whole_below` only applies with strategy.shard_optimizer: 3"),
    ("strategy.prefetch_weights=false", "`strategy.prefetch_weights` only applies with strategy.shard_optimizer: 3"),
    ("strategy.kind=one_device", "`strategy.shard_optimizer` only applies to strategy.kind=mirrored, "
                                 "multi_worker_mirrored, pipeline, horovod, tensor_parallel or layout"),
    ("strategy.kind=horovod,horovod.elastic=true", "`strategy.shard_optimizer` cannot split the optimizer of a "
                                                   "Horovod job with horovod.op adasum"),
])
def test_a_config_the_split_does_not_cover_is_refused_in_one_line(setting, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, ["strategy.shard_optimizer=1", *setting.split(",")])
