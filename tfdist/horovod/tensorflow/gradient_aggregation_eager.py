"""Horovod's `horovod.tensorflow.gradient_aggregation_eager`, its own: the helper behind the
`backward_passes_per_step` of Horovod's eager optimizer. tfdist's `DistributedOptimizer` accumulates for a Keras 3
optimizer itself."""

from horovod.tensorflow.gradient_aggregation_eager import *  # noqa: F401,F403
