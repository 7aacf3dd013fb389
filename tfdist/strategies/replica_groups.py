"""`ReplicaGroupsStrategy`: data parallelism over model replicas that each span several devices.

The base of `TensorParallelStrategy` and `PipelineStrategy`. It is a
`MirroredStrategy` over each replica's first device, so batch splitting,
variable mirroring and the gradient all-reduce stay TensorFlow's own. What it
adds is where a variable lives:

- a variable made under a device of the first replica (a `tf.device` scope,
  as tensor-parallel layers do for each shard, or a layer placement) is
  mirrored onto that device's counterpart in every replica, where
  MirroredStrategy would put every copy on the replicas' first devices;
- `move_variables` makes existing variables again on other devices, once,
  with their current values; the optimizer slots made beside them go with
  them. A pipeline needs this: its stages are known only once the model is
  built, and by then Keras may have built the optimizer too.

Optimizer slots are made beside their variable and updates run where the
variable lives (MirroredStrategy's own `update`), so each device holds and
updates only its own part. Gradients are all-reduced between the copies of
one variable, that is between counterpart devices.

Example:

    >>> strategy = ReplicaGroupsStrategy([["/cpu:0"]])
    >>> strategy.mirrored_devices("/cpu:0")
    ['/cpu:0']
"""

from __future__ import annotations

import weakref
from typing import Optional, Sequence

import keras
import tensorflow as tf
from tensorflow.python.distribute import device_util, mirrored_strategy, values

from tfdist import _compat
from tfdist.parallel.device_group import DeviceGroup, current_replica
from tfdist.strategies.data_parallel import MirroredStrategy

__all__ = ["ReplicaGroupsStrategy", "bytes_by_device"]


class _OnDevices:
    """What MirroredExtended reads from `colocate_with`: the devices of the copies."""

    def __init__(self, devices: Sequence[str]):
        self._devices = tuple(devices)


class _ReplicaGroupsExtended(mirrored_strategy.MirroredExtended):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # (variable, the variable it was made beside): optimizer slots, found again by `move_variables`.
        self._made_beside: list[tuple[weakref.ref, weakref.ref]] = []

    def _create_variable(self, next_creator, **kwargs):
        reference = kwargs.get("colocate_with")
        if reference is None:
            strategy = self._container_strategy()
            device = strategy.variable_device()
            devices = strategy.mirrored_devices(device) if device else None
            if devices:
                kwargs["colocate_with"] = _OnDevices(devices)
        variable = super()._create_variable(next_creator, **kwargs)
        if isinstance(reference, values.DistributedVariable):
            self._made_beside = [pair for pair in self._made_beside if pair[0]() is not None]
            self._made_beside.append((weakref.ref(variable), weakref.ref(reference)))
        return variable

    def made_beside(self) -> dict[int, int]:
        """id of a variable's storage -> id of the storage it was made beside, for live variables."""
        pairs = ((made(), reference()) for made, reference in self._made_beside)
        return {id(made): id(reference) for made, reference in pairs if made is not None and reference is not None}


class ReplicaGroupsStrategy(MirroredStrategy):
    """Model replicas of several devices each, trained data parallel.

    Args:
      replica_devices: per replica, its devices; every replica has as many,
        and a device's counterpart in another replica is the one at the same
        position. A replica's first device runs its step and holds what is
        placed nowhere else.

    Raises:
      ValueError: no replicas, replicas of different sizes, or a device that
        does not exist or is named twice.
    """

    _extended_type = _ReplicaGroupsExtended

    def __init__(self, replica_devices: Sequence[Sequence[str]]):
        sizes = {len(devices) for devices in replica_devices}
        if len(sizes) != 1:
            raise ValueError(
                f"`replica_devices` must give every replica the same number of devices. Received: {replica_devices}"
            )
        DeviceGroup([d for devices in replica_devices for d in devices])  # one check for missing and repeated devices
        self.replicas = [DeviceGroup(devices) for devices in replica_devices]
        super().__init__(devices=[group.devices[0] for group in self.replicas])

    @property
    def devices(self) -> list[str]:
        """Every device, replica by replica."""
        return [device for group in self.replicas for device in group.devices]

    def variable_device(self) -> Optional[str]:
        """The device a variable made now belongs on: the `tf.device` in scope, if any."""
        return device_util.current()

    def mirrored_devices(self, device: str) -> Optional[list[str]]:
        """A device of the first replica and its counterparts in the others; None for other devices."""
        index = self.replicas[0].index(device)
        return None if index is None else [group.devices[index] for group in self.replicas]

    def local_device(self, device: str) -> str:
        """A device of the first replica, as its counterpart in the replica whose step is being built."""
        index = self.replicas[0].index(device)
        return device if index is None else self.replicas[current_replica()].devices[index]

    def move_variables(
        self, destinations: Sequence[tuple[keras.Variable, str]], optimizer: Optional[keras.optimizers.Optimizer]
    ) -> None:
        """Makes each variable again on a device of the first replica and its counterparts.

        The Keras variables stay the same objects (`model.weights`, names and
        checkpoints do not change) and keep their values; the slots `optimizer`
        made beside them move with them. Call it outside any step function,
        before the variables are first read in one.

        Args:
          destinations: (variable, device of the first replica) pairs.
          optimizer: the optimizer training these variables, built or not.
        """
        made_beside = self.extended.made_beside()
        device_of = {id(variable.value): device for variable, device in destinations}
        moves = list(destinations)
        for slot in optimizer.variables if optimizer is not None else []:
            reference = made_beside.get(id(slot.value))
            if reference in device_of:
                moves.append((slot, device_of[reference]))
        with tf.init_scope(), self.scope():
            _compat.remake_variables([(variable, tf.device(device)) for variable, device in moves], optimizer)


def bytes_by_device(variables: Sequence[keras.Variable]) -> dict[str, int]:
    """Bytes of every copy of `variables`, by the device that holds it (`CPU:1`, `GPU:0`)."""
    held: dict[str, int] = {}
    for variable in variables:
        for copy in getattr(variable.value, "values", (variable.value,)):
            spec = tf.DeviceSpec.from_string(copy.device)
            device = f"{spec.device_type}:{spec.device_index}"
            held[device] = held.get(device, 0) + copy.dtype.size * copy.shape.num_elements()
    return held
