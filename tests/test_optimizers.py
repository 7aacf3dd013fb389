"""The linear scaling rule and gradual warmup (Goyal et al. 2017)."""

import keras
import pytest

from tfdist import load_config
from tfdist.optimizers import LinearWarmup, build_optimizer, scaled_learning_rate


def _train_config(*overrides):
    return load_config(None, list(overrides)).train


def test_learning_rate_unscaled_by_default():
    assert scaled_learning_rate(_train_config("train.global_batch_size=512")) == pytest.approx(0.002)


def test_linear_scaling_rule():
    cfg = _train_config(
        "train.learning_rate=0.1",
        "train.global_batch_size=1024",
        "train.base_batch_size=256",
        "train.scale_learning_rate=true",
    )
    assert scaled_learning_rate(cfg) == pytest.approx(0.4)


def test_warmup_ramps_from_base_to_scaled_rate():
    schedule = LinearWarmup(0.1, 0.4, warmup_steps=10)
    assert float(schedule(0)) == pytest.approx(0.1)
    assert float(schedule(5)) == pytest.approx(0.25)
    assert float(schedule(10)) == pytest.approx(0.4)
    assert float(schedule(1000)) == pytest.approx(0.4)


def test_optimizer_gets_the_warmup_schedule():
    cfg = _train_config(
        "train.optimizer=momentum",
        "train.learning_rate=0.1",
        "train.global_batch_size=512",
        "train.base_batch_size=256",
        "train.scale_learning_rate=true",
        "train.warmup_epochs=2",
    )
    optimizer = build_optimizer(cfg, steps_per_epoch=50)
    assert isinstance(optimizer, keras.optimizers.SGD)
    assert optimizer.momentum == pytest.approx(0.9)
    schedule = optimizer._learning_rate
    assert isinstance(schedule, LinearWarmup)
    assert (schedule.initial, schedule.target, schedule.warmup_steps) == pytest.approx((0.1, 0.2, 100))


def test_warmup_schedule_serializes():
    schedule = LinearWarmup(0.1, 0.4, warmup_steps=10)
    again = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(schedule))
    assert again.get_config() == schedule.get_config()


@pytest.mark.parametrize(
    "name,cls",
    [("sgd", "SGD"), ("adam", "Adam"), ("adamw", "AdamW"), ("rmsprop", "RMSprop")],
)
def test_each_optimizer(name, cls):
    optimizer = build_optimizer(_train_config(f"train.optimizer={name}"), steps_per_epoch=10)
    assert type(optimizer).__name__ == cls
