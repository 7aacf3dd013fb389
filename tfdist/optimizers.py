"""Train config -> Keras optimizer, with the linear scaling rule and warmup.

Goyal et al. 2017 ("Accurate, Large Minibatch SGD"): when the batch grows k
times, multiply the learning rate by k, and reach that rate by a linear ramp
from the unscaled rate over the first epochs. Keras has no warmup schedule, so
`LinearWarmup` supplies one; it is a `LearningRateSchedule`, so it is applied
per step inside the compiled train function and saves with the model.

Example:

    >>> from tfdist.config import TrainConfig
    >>> scaled_learning_rate(TrainConfig(learning_rate=0.1, global_batch_size=512,
    ...                                  base_batch_size=256, scale_learning_rate=True))
    0.2
"""

from __future__ import annotations

import keras

from tfdist.config.schema import Optimizer, TrainConfig

__all__ = ["LinearWarmup", "build_optimizer", "scaled_learning_rate"]


def scaled_learning_rate(config: TrainConfig) -> float:
    """The learning rate after the linear scaling rule (if switched on)."""
    if not config.scale_learning_rate:
        return config.learning_rate
    return config.learning_rate * config.global_batch_size / config.base_batch_size


@keras.saving.register_keras_serializable(package="tfdist")
class LinearWarmup(keras.optimizers.schedules.LearningRateSchedule):
    """Ramps linearly from `initial` to `target` over `warmup_steps`, then holds.

    Args:
      initial: the learning rate at step 0.
      target: the learning rate from `warmup_steps` on.
      warmup_steps: length of the ramp in optimizer steps.
    """

    def __init__(self, initial: float, target: float, warmup_steps: int):
        self.initial = float(initial)
        self.target = float(target)
        self.warmup_steps = int(warmup_steps)

    def __call__(self, step):
        step = keras.ops.cast(step, "float32")
        fraction = keras.ops.minimum(step / max(self.warmup_steps, 1), 1.0)
        return self.initial + (self.target - self.initial) * fraction

    def get_config(self):
        return {"initial": self.initial, "target": self.target, "warmup_steps": self.warmup_steps}


def build_optimizer(
    config: TrainConfig, *, steps_per_epoch: int, accumulation_steps: int = 1
) -> keras.optimizers.Optimizer:
    """Builds the configured optimizer (call under a strategy's scope).

    Args:
      config: the train section.
      steps_per_epoch: batches per epoch (for the warmup length).
      accumulation_steps: batches whose gradients are summed before one update
        (Keras's `gradient_accumulation_steps`; the update uses their mean).
    """
    rate = scaled_learning_rate(config)
    if config.warmup_epochs:
        warmup_steps = max(1, round(config.warmup_epochs * steps_per_epoch))
        rate = LinearWarmup(config.learning_rate, rate, warmup_steps)
    options = {"gradient_accumulation_steps": accumulation_steps} if accumulation_steps > 1 else {}
    kind = Optimizer(config.optimizer)
    if kind == Optimizer.SGD:
        return keras.optimizers.SGD(rate, **options)
    if kind == Optimizer.MOMENTUM:
        return keras.optimizers.SGD(rate, momentum=0.9, **options)
    if kind == Optimizer.ADAM:
        return keras.optimizers.Adam(rate, **options)
    if kind == Optimizer.ADAMW:
        return keras.optimizers.AdamW(rate, **options)
    return keras.optimizers.RMSprop(rate, **options)
