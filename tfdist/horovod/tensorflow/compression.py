"""Horovod's `horovod.tensorflow.compression`, its own: compressors act on tensors, which Keras 3 does not change."""

from horovod.tensorflow.compression import *  # noqa: F401,F403
