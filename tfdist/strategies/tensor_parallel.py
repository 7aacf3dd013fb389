"""`TensorParallelStrategy`: one model replica spread over a device group.

TensorFlow's `OneDeviceStrategy` puts every variable on its one device; this
strategy adds two ways to use the other devices of its `DeviceGroup`:

- tensor parallelism: the layers of `tfdist.layers` split their kernels over
  the group, each shard created (inside a `tf.device` scope, which this
  strategy honours) and computed on its device;
- model parallelism: `placement` maps layer names to devices; a placed
  layer's variables are created there (matched by the Keras name scope they
  are built in) and its forward and backward run there.

Optimizer slots live beside their variables and updates run there. Everything
else stays on the first device. `model.fit` is plain Keras: one replica, so
the batch, loss and updates are exactly single-device training's.

Example:

    >>> strategy = TensorParallelStrategy(["/cpu:0"])
    >>> with strategy.scope():
    ...     layer = tfdist.layers.ParallelMLP(8)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import keras
import tensorflow as tf
from tensorflow.python.distribute import device_util, distribute_lib
from tensorflow.python.distribute.one_device_strategy import OneDeviceExtended
from tensorflow.python.framework import ops
from tensorflow.python.util import nest

from tfdist import _compat
from tfdist.parallel.device_group import DeviceGroup
from tfdist.parallel.placement import device_for_scope, place_computation

__all__ = ["TensorParallelStrategy"]


class TensorParallelStrategy(distribute_lib.Strategy):
    """One replica; tensor-parallel layers split over `devices`, placed layers go to theirs.

    Args:
      devices: the group, in shard order; the first also holds everything
        that is neither sharded nor placed. Default: every GPU, else every
        logical CPU.
      placement: layer name -> device (one of `devices`), for layers built in
        this strategy's scope (see `tfdist.parallel.placement`).

    Raises:
      ValueError: a device that does not exist, one named twice, or a placement
        device outside the group.
    """

    def __init__(self, devices: Optional[Sequence[str]] = None, *, placement: Optional[Mapping[str, str]] = None):
        self.tensor_parallel_group = DeviceGroup(devices or _default_devices())
        super().__init__(_TensorParallelExtended(self, self.tensor_parallel_group.devices[0]))
        self.placement: dict[str, str] = {}
        self.place(placement or {})

    @property
    def devices(self) -> list[str]:
        return list(self.tensor_parallel_group.devices)

    def place(self, placement: Mapping[str, str]) -> None:
        """Sets layer name -> device for the layers built in this scope from now on.

        Raises:
          ValueError: a device outside the strategy's group.
        """
        outside = sorted({d for d in placement.values() if d not in self.devices})
        if outside:
            raise ValueError(f"`placement` must use the strategy's devices {self.devices}. Received: {outside}")
        self.placement = dict(placement)
        if self.placement:
            _compat.install_trainer_hooks()

    def keras_hooks(self, model: keras.Model) -> dict[str, Any]:
        """Places the named layers' computation before Keras makes its step functions; no hooks."""
        place_computation(model, self.placement)
        return {}


class _TensorParallelExtended(OneDeviceExtended):
    def _create_variable(self, next_creator, **kwargs):
        if device_util.current():  # a shard placed by its layer (or the user's own tf.device)
            kwargs.pop("colocate_with", None)
            return next_creator(**kwargs)
        device = device_for_scope(self._container_strategy().placement, ops.get_name_scope())
        if device is not None and "colocate_with" not in kwargs:
            with ops.device(device):
                return next_creator(**kwargs)
        return super()._create_variable(next_creator, **kwargs)  # optimizer slots: beside their variable

    def _update_non_slot(self, colocate_with, fn, args, kwargs, group):
        # OneDeviceExtended runs every update on its one device; a variable's runs where it is.
        device = getattr(colocate_with, "device", None) or self._device
        with ops.device(device), distribute_lib.UpdateContext(device):
            result = fn(*args, **kwargs)
            return result if group else nest.map_structure(self._local_results, result)


def _default_devices() -> list[str]:
    gpus = tf.config.list_logical_devices("GPU")
    return [d.name for d in (gpus or tf.config.list_logical_devices("CPU"))]
