"""Keras callbacks tfdist adds to training."""

from tfdist.callbacks.backup import RestoreOnlyBackup
from tfdist.callbacks.device_metrics import DeviceMetrics
from tfdist.callbacks.throughput import Throughput

__all__ = ["DeviceMetrics", "RestoreOnlyBackup", "Throughput"]
