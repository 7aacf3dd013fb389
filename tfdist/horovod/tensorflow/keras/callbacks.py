"""Horovod's Keras callbacks, for Keras 3 models.

Horovod's versions read and write `optimizer.lr` and broadcast with
`tf.Variable` APIs that Keras 3 variables lack; these do the same work through
Keras 3's variables and Horovod's collective ops on tensors.
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import keras
import numpy as np

from tfdist import _compat

_compat.horovod()  # one clear line when Horovod is missing

from horovod.common.util import is_version_greater_equal_than  # noqa: E402,F401  (Horovod's module has it)

__all__ = [
    "BestModelCheckpoint",
    "BroadcastGlobalVariablesCallback",
    "LearningRateScheduleCallback",
    "LearningRateWarmupCallback",
    "MetricAverageCallback",
]


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Sets every model and optimizer variable to `root_rank`'s value before training.

    Keras 3 creates the optimizer's variables before the first step, so this
    happens at `on_train_begin`, before any rank takes a step.

    Args:
      root_rank: the rank whose values every rank takes.
      device: accepted for compatibility; Horovod places the ops.
      local_variables: variables to leave alone (they differ per rank on purpose).
    """

    def __init__(self, root_rank: int, device: str = "", local_variables=None):
        super().__init__()
        self.root_rank = root_rank
        self._local = {id(v) for v in local_variables or []}
        self._hvd = _compat.horovod()

    def on_train_begin(self, logs=None):
        optimizer_variables = self.model.optimizer.variables if self.model.optimizer else []
        variables = [v for v in list(self.model.variables) + list(optimizer_variables) if id(v) not in self._local]
        for i, variable in enumerate(variables):
            variable.assign(self._hvd.broadcast(variable.value, self.root_rank, name=f"tfdist_broadcast_{i}"))


class MetricAverageCallback(keras.callbacks.Callback):
    """Replaces each epoch's logs with their average over all ranks.

    Put it before callbacks that read the logs (checkpoints, TensorBoard).

    Args:
      device: accepted for compatibility; Horovod places the ops.
    """

    def __init__(self, device: str = ""):
        super().__init__()
        self._hvd = _compat.horovod()

    def on_epoch_end(self, epoch, logs=None):
        if not logs:
            return
        for name in sorted(logs):  # the same order on every rank
            value = np.asarray(logs[name], dtype="float64")
            logs[name] = float(self._hvd.allreduce(value, op=self._hvd.Average, name=f"tfdist_metric_{name}"))


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Sets the learning rate to `initial_lr * multiplier(epoch)` between `start_epoch` and `end_epoch`.

    Args:
      initial_lr: the base learning rate.
      multiplier: a function of the (fractional) epoch, or a constant `c` for
        `c ** (epoch - start_epoch)`.
      start_epoch: first epoch the schedule applies to.
      end_epoch: first epoch it no longer applies to (None: never ends).
      staircase: change the rate once per epoch; otherwise every batch, with
        fractional epochs.
      momentum_correction: when the rate changes, scale the momentum buffer by
        new/old rate (Goyal et al. 2017), as Horovod does.
      steps_per_epoch: batches per epoch (needed when not staircase; else
        taken from `fit`).
    """

    def __init__(self, initial_lr: float, multiplier: Union[float, Callable], start_epoch: int = 0,
                 end_epoch: Optional[int] = None, staircase: bool = True, momentum_correction: bool = True,
                 steps_per_epoch: Optional[int] = None):
        super().__init__()
        if initial_lr is None:
            raise ValueError("`initial_lr` is required. Received: None")
        self.initial_lr = float(initial_lr)
        self.multiplier = multiplier if callable(multiplier) else (lambda epoch: multiplier ** (epoch - start_epoch))
        self.start_epoch, self.end_epoch = start_epoch, end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = 0

    def on_train_begin(self, logs=None):
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self.params.get("steps")
            if not self.steps_per_epoch:
                raise ValueError(
                    f"{type(self).__name__} needs `steps_per_epoch`: fit was given none to read."
                )

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if self.current_epoch < self.start_epoch or (
            self.end_epoch is not None and self.current_epoch >= self.end_epoch
        ):
            return
        if self.staircase and batch == 0:
            self._set_rate(self.initial_lr * self.multiplier(self.current_epoch))
        elif not self.staircase:
            self._set_rate(self.initial_lr * self.multiplier(self.current_epoch + batch / self.steps_per_epoch))

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))

    def _set_rate(self, rate: float) -> None:
        optimizer = self.model.optimizer
        old = float(keras.ops.convert_to_numpy(optimizer.learning_rate))
        optimizer.learning_rate = rate
        if self.momentum_correction and old > 0 and rate != old:
            _scale_momentum(optimizer, rate / old)


def _scale_momentum(optimizer, ratio: float) -> None:
    """Goyal et al.'s momentum correction for Keras 3 SGD.

    Keras 3 SGD keeps its velocity in learning-rate units (`m = momentum*m - lr*g`),
    so scaling the velocity by new/old rate equals Horovod's one-step momentum
    scaling. Optimizers without such a velocity are left alone, as in Horovod.
    """
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    if getattr(inner, "momentum", 0) and getattr(inner, "momentums", None):
        for velocity in inner.momentums:
            velocity.assign(velocity * ratio)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramps the learning rate from `initial_lr / size` to `initial_lr` over `warmup_epochs`
    (gradual warmup, Goyal et al. 2017), batch by batch.

    Args:
      initial_lr: the rate after warmup (usually the single-rank rate x size).
      warmup_epochs: epochs to ramp over.
      momentum_correction: see LearningRateScheduleCallback.
      steps_per_epoch: batches per epoch (default: from `fit`).
      verbose: print when warmup ends (rank 0).
    """

    def __init__(self, initial_lr: float, warmup_epochs: int = 5, momentum_correction: bool = True,
                 steps_per_epoch: Optional[int] = None, verbose: int = 0):
        size = _compat.horovod().size()

        def multiplier(epoch):
            epoch += 1.0 / self.steps_per_epoch  # reach the full rate at the end of the last warmup epoch
            return 1.0 / size * (epoch * (size - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs, staircase=False,
                         momentum_correction=momentum_correction, steps_per_epoch=steps_per_epoch)
        self.verbose = verbose
        self._rank = _compat.horovod().rank()

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose and self._rank == 0:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {logs['lr'] if logs else ''}.")


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """Horovod's `ModelCheckpoint` that keeps only the best model by `monitor` (`save_best_only=True`).

    Horovod's leaves the path for its Spark estimator to set and fails on Keras 3, which checks the path when the
    callback is made. Here the path is `filepath=` (ending `.keras`, or `.weights.h5` with `save_weights_only`), or
    `callback.filepath` set before `fit`; `fit` without either raises `ValueError`.
    """

    def __init__(self, monitor="val_loss", verbose=0, save_weights_only=False, mode="auto", save_freq="epoch",
                 filepath=None):
        # Keras checks a given path's ending here; with none, a path of the right ending stands in until fit.
        stand_in = "best.weights.h5" if save_weights_only else "best.keras"
        super().__init__(filepath=filepath or stand_in, monitor=monitor, verbose=verbose, save_best_only=True,
                         save_weights_only=save_weights_only, mode=mode, save_freq=save_freq)
        self.filepath = None if filepath is None else self.filepath

    def on_train_begin(self, logs=None):
        if not self.filepath:
            raise ValueError("BestModelCheckpoint has no path to save to: pass filepath=..., or set "
                             "callback.filepath before fit")
