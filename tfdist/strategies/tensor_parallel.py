"""`TensorParallelStrategy`: one model replica whose tensor-parallel layers span a device group.

TensorFlow's `OneDeviceStrategy` puts every variable on its one device; this
strategy is the same except that a variable created inside a `tf.device`
scope stays there. The tensor-parallel layers (`tfdist.layers`) create each
kernel shard that way, on its device of the strategy's `DeviceGroup`, and pin
each shard's computation there; the rest of the model (embeddings, norms, the
classifier) lives on the first device. `model.fit` is plain Keras: one replica,
so the batch, loss and optimizer are exactly single-device training's.

Example:

    >>> strategy = TensorParallelStrategy(["/cpu:0"])
    >>> with strategy.scope():
    ...     layer = tfdist.layers.ParallelMLP(8)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Optional, Sequence

import tensorflow as tf
from tensorflow.python.distribute import device_util, distribute_lib
from tensorflow.python.distribute.one_device_strategy import OneDeviceExtended
from tensorflow.python.framework import ops
from tensorflow.python.util import nest

from tfdist.parallel.device_group import DeviceGroup

__all__ = ["TensorParallelStrategy"]


class TensorParallelStrategy(distribute_lib.Strategy):
    """One replica; tensor-parallel layers built in its scope split over `devices`.

    Args:
      devices: the group, in shard order; the first also holds everything
        that is not sharded. Default: every GPU, else every logical CPU.

    Raises:
      ValueError: a device that does not exist, or one named twice.
    """

    def __init__(self, devices: Optional[Sequence[str]] = None):
        self.tensor_parallel_group = DeviceGroup(devices or _default_devices())
        super().__init__(_TensorParallelExtended(self, self.tensor_parallel_group.devices[0]))

    @property
    def devices(self) -> list[str]:
        return list(self.tensor_parallel_group.devices)


class _TensorParallelExtended(OneDeviceExtended):
    def _create_variable(self, next_creator, **kwargs):
        if device_util.current():  # a shard placed by its layer (or the user's own tf.device)
            kwargs.pop("colocate_with", None)
            return next_creator(**kwargs)
        return super()._create_variable(next_creator, **kwargs)  # optimizer slots: beside their variable

    def _update_non_slot(self, colocate_with, fn, args, kwargs, group):
        # OneDeviceExtended runs every update on its one device; a shard's runs where the shard is.
        device = getattr(colocate_with, "device", None) or self._device
        with ops.device(device), distribute_lib.UpdateContext(device):
            result = fn(*args, **kwargs)
            return result if group else nest.map_structure(self._local_results, result)


def _default_devices() -> list[str]:
    gpus = tf.config.list_logical_devices("GPU")
    return [d.name for d in (gpus or tf.config.list_logical_devices("CPU"))]
