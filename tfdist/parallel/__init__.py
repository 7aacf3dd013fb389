"""Model-parallel building blocks: device groups, pipeline partitioning and schedules."""

from tfdist.parallel.device_group import DeviceGroup, current_group

__all__ = ["DeviceGroup", "current_group"]
