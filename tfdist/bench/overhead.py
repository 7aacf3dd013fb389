"""`tfdist bench overhead`: tfdist's mirrored job against hand-written TF code.

Both sides train the same model on the same devices, data and global batch with
`model.fit`; the tfdist side is built by `tfdist.training.prepare` (exactly what
`tfdist train` runs), the other side is what a user would write by hand with
`tf.distribute.MirroredStrategy`. Rounds alternate; each round times
`steps_per_round` steps with the same Throughput callback (its warm-up steps
excluded). Figure: `ratio` = median step time tfdist / hand-written (target <= 1.02).
"""

from __future__ import annotations

from typing import Any, Optional

import keras
import tensorflow as tf

from tfdist import training
from tfdist.callbacks import Throughput
from tfdist.config import load_config
from tfdist.config.schema import Config
from tfdist.data.sources import load
from tfdist.errors import ConfigError
from tfdist.timing import alternate, medians

__all__ = ["run"]

STEPS_PER_ROUND = 100
TARGET_RATIO = 1.02


def _default_config() -> Config:
    # Threads pinned so both sides get the same pools (DESIGN.md, measuring).
    return load_config(
        None,
        [
            "train.verbose=0",
            "strategy.logical_devices=4",
            "runtime.intra_op_threads=1",
            "runtime.inter_op_threads=2",
        ],
    )


def _handwritten(config: Config, devices: list[str]):
    """The same job written directly against tf.distribute and Keras."""
    strategy = tf.distribute.MirroredStrategy(devices=devices)
    split = load(config.data, seed=config.train.seed)
    width = config.model.width
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input(split.input_shape),
                keras.layers.Conv2D(width, 3, padding="same", activation="relu"),
                keras.layers.Conv2D(2 * width, 3, padding="same", activation="relu"),
                keras.layers.MaxPooling2D(),
                keras.layers.Flatten(),
                keras.layers.Dense(4 * width, activation="relu"),
                keras.layers.Dropout(config.model.dropout),
                keras.layers.Dense(split.num_classes),
                keras.layers.Activation("softmax", dtype="float32"),
            ]
        )
        model.compile(
            optimizer=keras.optimizers.Adam(config.train.learning_rate),
            loss="sparse_categorical_crossentropy",
            metrics=["accuracy"],
        )
    batch = config.train.global_batch_size
    dataset = (
        tf.data.Dataset.from_tensor_slices((split.x_train, split.y_train))
        .shuffle(len(split.x_train), seed=config.train.seed)
        .repeat()
        .batch(batch, drop_remainder=True)
        .prefetch(tf.data.AUTOTUNE)
    )
    return model, dataset


def _round(model: keras.Model, dataset, batch: int, warmup_steps: int):
    def one_round() -> float:
        timer = Throughput(batch, warmup_steps=warmup_steps)
        model.fit(
            dataset,
            epochs=1,
            steps_per_epoch=STEPS_PER_ROUND,
            shuffle=False,
            verbose=0,
            callbacks=[timer],
        )
        return timer.step_time_ms

    return one_round


def run(*, config: Optional[Config] = None, repeats: int = 5) -> dict[str, Any]:
    config = config or _default_config()
    s, t = config.strategy, config.train
    # The hand-written side is this one job; other settings have no twin there.
    required = {
        "strategy.kind": (s.kind, "mirrored"),
        "model.name": (config.model.name, "digits_cnn"),
        "train.optimizer": (t.optimizer.value, "adam"),
        "train.scale_learning_rate": (t.scale_learning_rate, False),
        "precision.policy": (config.precision.policy.value, "float32"),
    }
    for key, (value, wanted) in required.items():
        if value != wanted:
            raise ConfigError(
                key, f"must be {wanted} for the overhead benchmark (its hand-written side).", value
            )
    job = training.prepare(config)
    devices = list(job.strategy.extended.worker_devices)
    hand_model, hand_data = _handwritten(config, devices)
    if hand_model.count_params() != job.model.count_params():
        raise AssertionError("the hand-written model must match tfdist's model")
    warmup = config.callbacks.throughput_warmup_steps
    samples = alternate(
        {
            "tfdist": _round(job.model, job.train_data, t.global_batch_size, warmup),
            "handwritten": _round(hand_model, hand_data, t.global_batch_size, warmup),
        },
        repeats=repeats,
    )
    median = medians(samples)
    ratio = median["tfdist"] / median["handwritten"]
    return {
        "benchmark": "overhead",
        "strategy": s.kind,
        "devices": devices,
        "num_replicas": job.strategy.num_replicas_in_sync,
        "global_batch_size": t.global_batch_size,
        "steps_per_round": STEPS_PER_ROUND,
        "repeats": repeats,
        "step_time_ms": median,
        "samples_per_sec": {k: 1000 * t.global_batch_size / v for k, v in median.items()},
        "samples": samples,
        "figures": {"ratio": ratio, "target_ratio": TARGET_RATIO, "meets_target": ratio <= TARGET_RATIO},
    }
