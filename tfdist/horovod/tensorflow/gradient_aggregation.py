"""Horovod's `horovod.tensorflow.gradient_aggregation`, its own: the helper behind the `backward_passes_per_step` of
Horovod's graph-mode optimizer. tfdist's `DistributedOptimizer` accumulates for a Keras 3 optimizer itself."""

from horovod.tensorflow.gradient_aggregation import *  # noqa: F401,F403
