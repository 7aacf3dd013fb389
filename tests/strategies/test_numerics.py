"""Mirrored training over 2 and 4 replicas matches one device (same global batch, seed, SGD)."""

import numpy as np
import pytest

from tfdist import load_config, prepare


STEPS = 5


def _train(*overrides, initial_weights=None):
    config = load_config(
        None,
        [
            "train.optimizer=sgd",
            "train.learning_rate=0.1",
            "train.global_batch_size=32",
            "model.dropout=0.0",
            "train.verbose=0",
            *overrides,
        ],
    )
    job = prepare(config)
    if initial_weights is not None:
        job.model.set_weights(initial_weights)
    start = job.model.get_weights()
    job.model.fit(job.train_data, epochs=1, steps_per_epoch=STEPS, verbose=0)
    return start, job.model.get_weights()


@pytest.mark.parametrize("replicas", [2, 4])
def test_mirrored_matches_one_device(replicas):
    start, single = _train("strategy.kind=one_device")
    devices = ", ".join(f"/cpu:{i}" for i in range(replicas))
    _, mirrored = _train(f"strategy.devices=[{devices}]", initial_weights=start)
    moved = max(np.abs(a - b).max() for a, b in zip(start, single))
    assert moved > 1e-3  # the comparison below is about trained weights
    for a, b in zip(single, mirrored):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def _regression_data():
    rng = np.random.default_rng(0)
    return rng.standard_normal((64, 8)).astype("float32"), rng.standard_normal((64, 2)).astype("float32")


def _dense_model(**compile_options):
    """A seeded Dense regression model, compiled in the strategy scope the caller opened."""
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(2)])
    model.compile(loss="mse", **compile_options)
    return model


@pytest.mark.parametrize("clipping", ["clipnorm", "global_clipnorm", "clipvalue"])
def test_gradient_clipping_sees_the_all_reduced_gradient_as_on_one_device(clipping):
    """Keras clips each replica's gradient before the all-reduce; tfdist's strategies clip their sum."""
    import keras
    import tensorflow as tf

    from tfdist import MirroredStrategy

    x, y = _regression_data()

    def step(strategy):
        with strategy.scope():
            # A threshold well below the gradient's size, so clipping decides the step.
            model = _dense_model(optimizer=keras.optimizers.SGD(1.0, **{clipping: 0.01}))
        start = model.get_weights()
        model.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0)
        return [b - a for a, b in zip(start, model.get_weights())]

    one_device = step(tf.distribute.OneDeviceStrategy("/cpu:0"))
    mirrored = step(MirroredStrategy(["/cpu:0", "/cpu:1"]))
    if clipping == "global_clipnorm":
        assert np.sqrt(sum(np.sum(d**2) for d in one_device)) == pytest.approx(0.01, rel=1e-4)
    for a, b in zip(one_device, mirrored):
        np.testing.assert_allclose(b, a, atol=1e-7, rtol=1e-5)


def test_steps_per_execution_over_several_replicas_matches_one_device():
    """Keras's own multi-step loop fails under a MirroredStrategy of 2 replicas (a step inside a tf.cond)."""
    import keras
    import tensorflow as tf

    from tfdist import MirroredStrategy

    x, y = _regression_data()

    def train(strategy):
        with strategy.scope():
            model = _dense_model(optimizer=keras.optimizers.SGD(0.1), steps_per_execution=3)
        history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
        return model, history

    reference, expected = train(tf.distribute.get_strategy())  # Keras without a strategy
    model, history = train(MirroredStrategy(["/cpu:0", "/cpu:1"]))
    assert int(model.optimizer.iterations.numpy()) == 2 * 8  # 3 + 3 + 2 steps an epoch
    for a, b in zip(reference.get_weights(), model.get_weights()):
        np.testing.assert_allclose(b, a, atol=1e-5, rtol=0)
    np.testing.assert_allclose(history["loss"], expected["loss"], atol=1e-5)


def _accumulated(strategy, optimizer):
    """The seeded model trained 2 epochs of 8 steps with `optimizer()`, under `strategy` or, with None, Keras's own
    code (no strategy: tfdist's replacement of Keras's accumulation steps aside)."""
    import contextlib

    import keras

    x, y = _regression_data()
    with strategy.scope() if strategy else contextlib.nullcontext():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((8,))
        model = keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Dense(16, activation="relu")(inputs)))
        model.compile(loss="mse", optimizer=optimizer())
    history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
    return model, history


@pytest.mark.parametrize("kind", ["mirrored", "pipeline", "tensor_parallel", "mirrored_4_replicas",
                                  "mirrored_shard_optimizer_1", "mirrored_4_replicas_shard_optimizer_2",
                                  "pipeline_2_replicas_shard_optimizer_3"])
def test_gradient_accumulation_matches_one_device(kind):
    """Keras accumulates gradients under a conditional whose branches enter the cross-replica context, which fails
    under every TensorFlow strategy at the first step (keras-team/keras#20582); tfdist's kinds accumulate as one
    device does, an optimizer split over the replicas too (at stage 3 with its weights and their accumulators), and
    the tensor-parallel model split by Megatron's split found in it (its Dense pair, whose accumulators are split
    beside the kernels)."""
    import keras

    from tfdist import MirroredStrategy, PipelineStrategy, TensorParallelStrategy

    strategies = {
        "mirrored": lambda: MirroredStrategy(["/cpu:0", "/cpu:1"]),
        "mirrored_4_replicas": lambda: MirroredStrategy([f"/cpu:{i}" for i in range(4)]),
        "mirrored_shard_optimizer_1": lambda: MirroredStrategy(["/cpu:0", "/cpu:1"], shard_optimizer=1),
        "mirrored_4_replicas_shard_optimizer_2": lambda: MirroredStrategy([f"/cpu:{i}" for i in range(4)],
                                                                          shard_optimizer=2),
        # The weights split too, and their accumulators with them (the kernels and the first bias); mirrored at
        # stage 3 in test_optimizer_shards.
        "pipeline_2_replicas_shard_optimizer_3": lambda: PipelineStrategy(2, 2, devices=[f"/cpu:{i}" for i in range(4)],
                                                                          verbose=False, shard_optimizer=3,
                                                                          keep_whole_below=16),
        "pipeline": lambda: PipelineStrategy(2, 4, devices=["/cpu:0", "/cpu:1"], verbose=False),
        "tensor_parallel": lambda: TensorParallelStrategy(["/cpu:0", "/cpu:1"]),
    }

    def optimizer():
        return keras.optimizers.Adam(0.05, gradient_accumulation_steps=4)

    reference, expected = _accumulated(None, optimizer)
    model, history = _accumulated(strategies[kind](), optimizer)
    assert int(model.optimizer.iterations.numpy()) == int(reference.optimizer.iterations.numpy()) == 2 * 8 // 4
    for a, b in zip(reference.get_weights(), model.get_weights()):
        np.testing.assert_allclose(b, a, atol=1e-5, rtol=0)
    np.testing.assert_allclose(history["loss"], expected["loss"], atol=1e-5)


@pytest.mark.parametrize("accumulation, overwrite_frequency", [(2, None), (2, 3), (None, 3)])
@pytest.mark.parametrize("kind", ["mirrored", "pipeline"])
def test_a_moving_average_of_the_weights_ends_at_keras_own_weights(kind, accumulation, overwrite_frequency):
    """`use_ema`: the moving average moves every step and Keras copies it into the weights at the end of `fit`
    (and every `ema_overwrite_frequency` steps). With `gradient_accumulation_steps`, tfdist's accumulation under a
    strategy left it at zero, so every weight ended at 0.0; without, Keras's overwrite failed under a strategy
    (it enters the cross-replica context inside a conditional)."""
    import keras

    from tfdist import MirroredStrategy, PipelineStrategy

    strategy = {"mirrored": lambda: MirroredStrategy(["/cpu:0", "/cpu:1"]),
                "pipeline": lambda: PipelineStrategy(2, 4, devices=["/cpu:0", "/cpu:1"], verbose=False)}[kind]()

    def optimizer():
        return keras.optimizers.Adam(0.05, gradient_accumulation_steps=accumulation, use_ema=True, ema_momentum=0.5,
                                     ema_overwrite_frequency=overwrite_frequency)

    reference, expected = _accumulated(None, optimizer)
    model, history = _accumulated(strategy, optimizer)
    assert max(float(np.abs(w).max()) for w in reference.get_weights()) > 0.5
    for a, b in zip(reference.get_weights(), model.get_weights()):
        np.testing.assert_allclose(b, a, atol=1e-5, rtol=0)  # as the accumulation test: 2 replicas' sums, 8 steps
    np.testing.assert_allclose(history["loss"], expected["loss"], atol=1e-5)
