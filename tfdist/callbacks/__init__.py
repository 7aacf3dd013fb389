"""Keras callbacks tfdist adds to training."""

from tfdist.callbacks.checkpoint import EXIT_PREEMPTED, Checkpoint, weights_digest
from tfdist.callbacks.device_metrics import DeviceMetrics
from tfdist.callbacks.input_stalls import InputStalls
from tfdist.callbacks.preemption import EXIT_TERMINATED, Preemption
from tfdist.callbacks.throughput import Throughput

__all__ = ["Checkpoint", "DeviceMetrics", "EXIT_PREEMPTED", "EXIT_TERMINATED", "InputStalls", "Preemption",
           "Throughput", "weights_digest"]
