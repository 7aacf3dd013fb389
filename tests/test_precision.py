"""Precision config -> dtype policy and loss scaling."""

import contextlib

import keras
import numpy as np
import pytest

from tfdist import load_config, prepare
from tfdist.config import PrecisionConfig
from tfdist.precision import apply_policy, wrap_optimizer


def test_float32_leaves_the_optimizer_alone():
    sgd = keras.optimizers.SGD()
    assert wrap_optimizer(sgd, PrecisionConfig()) is sgd


def test_bfloat16_needs_no_loss_scaling():
    sgd = keras.optimizers.SGD()
    assert wrap_optimizer(sgd, PrecisionConfig(policy="mixed_bfloat16")) is sgd


def test_float16_gets_dynamic_loss_scaling():
    wrapped = wrap_optimizer(keras.optimizers.SGD(), PrecisionConfig(policy="mixed_float16"))
    assert isinstance(wrapped, keras.optimizers.LossScaleOptimizer)
    assert float(wrapped.initial_scale) == 2.0**15


def test_float16_initial_scale_from_config():
    cfg = PrecisionConfig(policy="mixed_float16", loss_scale=1024.0)
    assert float(wrap_optimizer(keras.optimizers.SGD(), cfg).initial_scale) == 1024.0


def test_float16_without_scaling_when_opted_in():
    sgd = keras.optimizers.SGD()
    cfg = PrecisionConfig(policy="mixed_float16", loss_scale="none", allow_unscaled_float16=True)
    assert wrap_optimizer(sgd, cfg) is sgd


def test_apply_policy():
    apply_policy(PrecisionConfig(policy="mixed_float16"))
    assert keras.mixed_precision.dtype_policy().name == "mixed_float16"


@pytest.mark.parametrize("policy,compute", [("mixed_float16", "float16"), ("mixed_bfloat16", "bfloat16")])
def test_mixed_precision_trains_under_mirrored(policy, compute):
    config = load_config(
        None,
        [f"precision.policy={policy}", "train.verbose=0", "strategy.devices=[/cpu:0, /cpu:1]", "model.width=8"],
    )
    job = prepare(config)
    conv = job.model.layers[0]
    assert conv.compute_dtype == compute
    assert conv.kernel.dtype == "float32"  # variables stay float32
    assert job.model(np.zeros((2, 8, 8, 1), "float32")).dtype == "float32"  # float32 softmax
    if policy == "mixed_float16":
        assert isinstance(job.model.optimizer, keras.optimizers.LossScaleOptimizer)
    history = job.model.fit(job.train_data, epochs=2, steps_per_epoch=10, verbose=0)
    losses = history.history["loss"]
    assert np.isfinite(losses).all()
    assert losses[-1] < losses[0]


def test_an_overflow_in_one_replicas_part_skips_the_step_on_every_replica_as_on_one_device(cpus):
    """Keras's LossScaleOptimizer decides step-or-skip from the first replica's gradients; one device decides
    from the whole batch's, which an overflow in any part makes non-finite."""
    from tfdist import MirroredStrategy

    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 6)).astype("float32")
    y = x[:, :2].argmax(axis=1)
    x[31] = 1e5  # the first batch's last example: the second replica's part; float16 holds at most 65504
    keras.mixed_precision.set_dtype_policy("mixed_float16")  # conftest's fixture sets float32 back
    trained = []
    for strategy in (MirroredStrategy(["/cpu:0", "/cpu:1"]), None):
        keras.utils.set_random_seed(0)
        with strategy.scope() if strategy else contextlib.nullcontext():
            model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4, activation="tanh"),
                                      keras.layers.Dense(2, activation="softmax")])
            model.compile(optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy")
        model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
        trained.append(model)
    for model in trained:  # the overflowing batch skipped in both epochs, the scale halved each time
        assert int(model.optimizer.iterations.numpy()) == 2
        assert float(model.optimizer.dynamic_scale.numpy()) == 2.0**15 / 4
    for a, b in zip(*(model.get_weights() for model in trained)):
        np.testing.assert_allclose(a, b, atol=1e-4)
