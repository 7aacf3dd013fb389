"""A group of devices: one model replica's (a pipeline's stages, a placement's devices), checked to exist.

Example:

    >>> DeviceGroup(["/cpu:0"]).index("CPU:0")
    0
"""

from __future__ import annotations

from typing import Optional, Sequence

import tensorflow as tf

__all__ = ["DeviceGroup", "current_replica", "split_into_groups"]


class DeviceGroup:
    """Devices, in order.

    Args:
      devices: device names (`/cpu:0`, `/gpu:1`), each at most once.

    Raises:
      ValueError: no devices, a repeated device, or a device this process
        does not have.
    """

    def __init__(self, devices: Sequence[str]):
        devices = list(devices)
        if not devices:
            raise ValueError("`devices` must name at least one device. Received: []")
        resolved = [_resolve(d) for d in devices]
        if len(set(resolved)) != len(resolved):
            raise ValueError(f"`devices` must not repeat a device. Received: {devices}")
        known = {_resolve(d.name) for d in tf.config.list_logical_devices()}
        missing = [d for d, r in zip(devices, resolved) if r not in known]
        if missing:
            raise ValueError(
                f"`devices` must exist in this process; {missing} do not. Available: "
                f"{sorted(known)} (more CPUs: strategy.logical_devices)."
            )
        self.devices = devices

    @property
    def size(self) -> int:
        return len(self.devices)

    def index(self, device: str) -> Optional[int]:
        """The position of `device` in the group (any spelling of its name), or None."""
        resolved = [_resolve(d) for d in self.devices]
        target = _resolve(device)
        return resolved.index(target) if target in resolved else None

    def __repr__(self) -> str:
        return f"DeviceGroup({self.devices})"


def split_into_groups(devices: Sequence[str], size: int) -> list[DeviceGroup]:
    """Consecutive groups of `size` devices (the caller checks that `size` divides them)."""
    return [DeviceGroup(devices[i : i + size]) for i in range(0, len(devices), size)]


def current_replica() -> int:
    """The id in this process of the replica whose step is being built; 0 outside a replica
    (cross-replica context). Replicas of other processes are not counted (`data_parallel`)."""
    context = tf.distribute.get_replica_context()
    if context is None:
        return 0
    replica = tf.get_static_value(context.replica_id_in_sync_group)
    return 0 if replica is None else int(context.strategy.extended._get_local_replica_id(int(replica)))


def _resolve(device: str) -> str:
    spec = tf.DeviceSpec.from_string(device)
    return f"{(spec.device_type or 'CPU').upper()}:{spec.device_index or 0}"
