"""tfdist's kinds train as Keras alone does: each test's reference comes from a process that never imported tfdist
(`oracle.keras_alone`), given the same compiled model as a `.keras` file and the same batches."""

import numpy as np
import pytest
from oracle import keras_alone

from tfdist import load_config, prepare

STEPS = 5


@pytest.mark.parametrize("replicas", [2, 4])
def test_mirrored_matches_one_device(replicas):
    devices = ", ".join(f"/cpu:{i}" for i in range(replicas))
    config = load_config(None, ["train.optimizer=sgd", "train.learning_rate=0.1", "train.global_batch_size=32",
                                "model.dropout=0.0", "train.verbose=0", f"strategy.devices=[{devices}]"])
    job = prepare(config)
    x, y = (np.concatenate(part) for part in zip(*job.train_data.take(STEPS).as_numpy_iterator()))
    start = job.model.get_weights()
    single = keras_alone("fit", job.model, x, y, batch_size=32, epochs=1, shuffle=False)  # from the untrained model
    job.model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    moved = max(np.abs(a - b).max() for a, b in zip(start, single["weights"]))
    assert moved > 1e-3  # the comparison below is about trained weights
    for a, b in zip(single["weights"], job.model.get_weights()):
        np.testing.assert_allclose(b, a, atol=1e-5, rtol=0)


def _regression_data():
    rng = np.random.default_rng(0)
    return rng.standard_normal((64, 8)).astype("float32"), rng.standard_normal((64, 2)).astype("float32")


def _saved_model(path, optimizer, hidden=0, **compile_options) -> str:
    """A seeded regression model (a Dense of 2, after a ReLU Dense of `hidden` where given), compiled with
    `optimizer` and saved untrained to `path`: Keras alone loads it in the reference's process, tfdist's run under
    its strategy's scope, as Keras's guides resume a model."""
    import keras

    keras.utils.set_random_seed(0)
    layers = [keras.layers.Dense(hidden, activation="relu")] if hidden else []
    model = keras.Sequential([keras.Input((8,)), *layers, keras.layers.Dense(2)])
    model.compile(loss="mse", optimizer=optimizer, **compile_options)
    model.save(path)
    return str(path)


def _fit_under(strategy, model_file, **fit_kwargs):
    """The saved model loaded under `strategy`'s scope and fitted on the regression data: the model, History."""
    import keras

    with strategy.scope():
        model = keras.models.load_model(model_file)
    keras.utils.set_random_seed(0)
    return model, model.fit(*_regression_data(), shuffle=False, verbose=0, **fit_kwargs).history


@pytest.mark.parametrize("clipping", ["clipnorm", "global_clipnorm", "clipvalue"])
def test_gradient_clipping_sees_the_all_reduced_gradient_as_on_one_device(clipping, tmp_path):
    """Keras clips each replica's gradient before the all-reduce; tfdist's strategies clip their sum."""
    import keras

    from tfdist import MirroredStrategy

    # A threshold well below the gradient's size, so clipping decides the step.
    model_file = _saved_model(tmp_path / "model.keras", keras.optimizers.SGD(1.0, **{clipping: 0.01}))
    start = keras.models.load_model(model_file).get_weights()
    reference = keras_alone("fit", model_file, *_regression_data(), under="one_device", batch_size=64,
                            shuffle=False)
    model, _ = _fit_under(MirroredStrategy(["/cpu:0", "/cpu:1"]), model_file, batch_size=64)
    one_device = [b - a for a, b in zip(start, reference["weights"])]
    mirrored = [b - a for a, b in zip(start, model.get_weights())]
    if clipping == "global_clipnorm":
        assert np.sqrt(sum(np.sum(d**2) for d in one_device)) == pytest.approx(0.01, rel=1e-4)
    for a, b in zip(one_device, mirrored):
        np.testing.assert_allclose(b, a, atol=1e-7, rtol=1e-5)


def test_steps_per_execution_over_several_replicas_matches_one_device(tmp_path):
    """Keras's own multi-step loop fails under a MirroredStrategy of 2 replicas (a step inside a tf.cond)."""
    import keras

    from tfdist import MirroredStrategy

    model_file = _saved_model(tmp_path / "model.keras", keras.optimizers.SGD(0.1), steps_per_execution=3)
    expected = keras_alone("fit", model_file, *_regression_data(), batch_size=8, epochs=2, shuffle=False)
    model, history = _fit_under(MirroredStrategy(["/cpu:0", "/cpu:1"]), model_file, batch_size=8, epochs=2)
    assert int(model.optimizer.iterations.numpy()) == 2 * 8  # 3 + 3 + 2 steps an epoch
    for a, b in zip(expected["weights"], model.get_weights()):
        np.testing.assert_allclose(b, a, atol=1e-5, rtol=0)
    np.testing.assert_allclose(history["loss"], expected["history"]["loss"], atol=1e-5)


def _same_as_keras_alone(strategy, optimizer, model_file):
    """The seeded model with a hidden layer, compiled with `optimizer` and trained 2 epochs of 8 steps by Keras
    alone (no strategy) and under `strategy`: equal weights (and the same number of updates) and losses."""
    model_file = _saved_model(model_file, optimizer, hidden=16)
    expected = keras_alone("fit", model_file, *_regression_data(), batch_size=8, epochs=2, shuffle=False)
    model, history = _fit_under(strategy, model_file, batch_size=8, epochs=2)
    assert int(model.optimizer.iterations.numpy()) == expected["iterations"]
    for a, b in zip(expected["weights"], model.get_weights()):
        np.testing.assert_allclose(b, a, atol=1e-5, rtol=0)  # 2 replicas' sums, 8 steps
    np.testing.assert_allclose(history["loss"], expected["history"]["loss"], atol=1e-5)
    return expected


@pytest.mark.parametrize("kind", ["mirrored", "pipeline", "tensor_parallel", "mirrored_4_replicas",
                                  "mirrored_shard_optimizer_1", "mirrored_4_replicas_shard_optimizer_2",
                                  "pipeline_2_replicas_shard_optimizer_3"])
def test_gradient_accumulation_matches_one_device(kind, tmp_path):
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
    expected = _same_as_keras_alone(strategies[kind](), keras.optimizers.Adam(0.05, gradient_accumulation_steps=4),
                                    tmp_path / "model.keras")
    assert expected["iterations"] == 2 * 8 // 4


@pytest.mark.parametrize("accumulation, overwrite_frequency", [(2, None), (2, 3), (None, 3)])
@pytest.mark.parametrize("kind", ["mirrored", "pipeline"])
def test_a_moving_average_of_the_weights_ends_at_keras_own_weights(kind, accumulation, overwrite_frequency, tmp_path):
    """`use_ema`: the moving average moves every step and Keras copies it into the weights at the end of `fit`
    (and every `ema_overwrite_frequency` steps). With `gradient_accumulation_steps`, tfdist's accumulation under a
    strategy left it at zero, so every weight ended at 0.0; without, Keras's overwrite failed under a strategy
    (it enters the cross-replica context inside a conditional)."""
    import keras

    from tfdist import MirroredStrategy, PipelineStrategy

    strategy = {"mirrored": lambda: MirroredStrategy(["/cpu:0", "/cpu:1"]),
                "pipeline": lambda: PipelineStrategy(2, 4, devices=["/cpu:0", "/cpu:1"], verbose=False)}[kind]()
    optimizer = keras.optimizers.Adam(0.05, gradient_accumulation_steps=accumulation, use_ema=True, ema_momentum=0.5,
                                      ema_overwrite_frequency=overwrite_frequency)
    expected = _same_as_keras_alone(strategy, optimizer, tmp_path / "model.keras")
    assert max(float(np.abs(w).max()) for w in expected["weights"]) > 0.5
