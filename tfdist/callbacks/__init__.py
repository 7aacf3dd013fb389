"""Keras callbacks tfdist adds to training."""

from tfdist.callbacks.throughput import Throughput

__all__ = ["Throughput"]
