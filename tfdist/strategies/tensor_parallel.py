"""`TensorParallelStrategy`: model replicas, each spread over a group of devices.

The devices form groups of `group_size`; each group holds one model replica
and the replicas train data parallel (a `MirroredStrategy` over the first
device of every group: batch splitting, variable mirroring and the gradient
all-reduce are TensorFlow's own). Inside a group, two ways to use its devices:

- tensor parallelism: the layers of `tfdist.layers` split their kernels over
  the group, each shard created (inside a `tf.device` scope) and computed on
  its device;
- model parallelism: `placement` maps layer names to devices of the first
  group; a placed layer's variables are created there (matched by the Keras
  name scope they are built in) and its forward and backward run there.

What this adds to `MirroredStrategy`: a variable made on a group device is
mirrored onto the same position of every group (shard 1 of a kernel on the
second device of each group), where MirroredStrategy would put every copy on
the groups' first devices; and each replica's layers compute on its own group.
Optimizer slots live beside their variables and updates run there. Everything
else stays on each group's first device. `model.fit` is plain Keras; with one
group the numerics are single-device training's, with several they are data
parallel training's.

Example:

    >>> strategy = TensorParallelStrategy(["/cpu:0"])
    >>> with strategy.scope():
    ...     layer = tfdist.layers.ParallelMLP(8)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import keras
from tensorflow.python.distribute import device_util, mirrored_strategy
from tensorflow.python.framework import ops

from tfdist import _compat
from tfdist.parallel.device_group import DeviceGroup, current_replica, split_into_groups
from tfdist.parallel.placement import device_for_scope, place_computation
from tfdist.strategies.data_parallel import MirroredStrategy
from tfdist.strategies.devices import default_devices

__all__ = ["TensorParallelStrategy"]


class _OnDevices:
    """What MirroredExtended reads from `colocate_with`: the devices of the copies."""

    def __init__(self, devices: Sequence[str]):
        self._devices = tuple(devices)


class _TensorParallelExtended(mirrored_strategy.MirroredExtended):
    def _create_variable(self, next_creator, **kwargs):
        if kwargs.get("colocate_with") is None:  # optimizer slots come colocated with their variable
            strategy = self._container_strategy()
            # A shard placed by its layer (or the user's own tf.device), else a placed layer's variable.
            device = device_util.current() or device_for_scope(strategy.placement, ops.get_name_scope())
            devices = strategy.mirrored_devices(device) if device else None
            if devices:
                kwargs["colocate_with"] = _OnDevices(devices)
        return super()._create_variable(next_creator, **kwargs)


class TensorParallelStrategy(MirroredStrategy):
    """Replicas of `group_size` devices each; tensor-parallel layers split over a group, placed layers go to theirs.

    Args:
      devices: every device; group g is devices[g*S:(g+1)*S] for group size
        S, in shard order. A group's first device also holds everything that
        is neither sharded nor placed. Default: every GPU, else every logical
        CPU.
      group_size: devices per group (S); None puts all devices in one group.
      placement: layer name -> device of the first group, for layers built in
        this strategy's scope (see `tfdist.parallel.placement`); the other
        groups place the same layers at the same positions.

    Raises:
      ValueError: a device that does not exist or is named twice, a group size
        that does not divide the device count, or a placement device outside
        the first group.
    """

    _extended_type = _TensorParallelExtended

    def __init__(
        self,
        devices: Optional[Sequence[str]] = None,
        *,
        group_size: Optional[int] = None,
        placement: Optional[Mapping[str, str]] = None,
    ):
        devices = list(devices or default_devices())
        size = group_size or len(devices)
        if size < 1 or len(devices) % size:
            raise ValueError(
                f"`group_size` must divide the {len(devices)} devices into whole groups. Received: {group_size}"
            )
        DeviceGroup(devices)  # one check for missing and repeated devices
        self.groups = split_into_groups(devices, size)
        super().__init__(devices=[group.devices[0] for group in self.groups])
        self.placement: dict[str, str] = {}
        self.place(placement or {})

    @property
    def devices(self) -> list[str]:
        """Every device, group by group."""
        return [device for group in self.groups for device in group.devices]

    @property
    def tensor_parallel_group(self) -> DeviceGroup:
        """The group of the replica whose step is being built (the first outside a step)."""
        return self.groups[current_replica()]

    def local_device(self, device: str) -> str:
        """A device of the first group, as the device at its position in the current replica's group."""
        index = self.groups[0].index(device)
        return device if index is None else self.tensor_parallel_group.devices[index]

    def mirrored_devices(self, device: str) -> Optional[list[str]]:
        """A device of the first group and its counterparts in the other groups; None for other devices."""
        index = self.groups[0].index(device)
        return None if index is None else [group.devices[index] for group in self.groups]

    def place(self, placement: Mapping[str, str]) -> None:
        """Sets layer name -> device for the layers built in this scope from now on.

        Raises:
          ValueError: a device outside the strategy's first group.
        """
        first = self.groups[0]
        outside = sorted({d for d in placement.values() if first.index(d) is None})
        if outside:
            raise ValueError(f"`placement` must use the devices of the first group {first.devices}. Received: {outside}")
        self.placement = dict(placement)
        if self.placement:
            _compat.install_trainer_hooks()

    def keras_hooks(self, model: keras.Model) -> dict[str, Any]:
        """Places the named layers' computation before Keras makes its step functions; no hooks."""
        place_computation(model, self.placement, resolve=self.local_device)
        return {}
