"""Model-parallel building blocks: device groups, pipeline partitioning and schedules."""

from tfdist.parallel.device_group import DeviceGroup

__all__ = ["DeviceGroup"]
