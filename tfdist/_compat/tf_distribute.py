"""TensorFlow's private distribution modules whose classes tfdist's strategies extend or call.

`MirroredExtended` (the replica groups' and Horovod's extended strategies),
the cross-device-ops helpers, collective ops, the ClusterCoordinator's closure
errors, the graph `ops` module and `Trackable` (the base of what a checkpoint
saves, which a split optimizer's whole slots extend) have no public API. They are imported here
and only here, so that a TensorFlow upgrade that moves them breaks one file;
each use says in its module what it needs them for.
"""

from tensorflow.python.distribute import (
    collective_util,
    cross_device_ops as cross_device_ops_lib,
    cross_device_utils,
    device_util,
    distribute_lib,
    distribute_utils,
    input_util,
    mirrored_strategy,
    numpy_dataset,
    values,
)
from tensorflow.python.distribute.coordinator import cluster_coordinator
from tensorflow.python.eager import context
from tensorflow.python.framework import ops
from tensorflow.python.ops import collective_ops
from tensorflow.python.trackable.base import Trackable  # tf.__internal__.tracking.Trackable

__all__ = ["cluster_coordinator", "collective_ops", "collective_util", "context", "cross_device_ops_lib",
           "cross_device_utils", "device_util", "distribute_lib", "distribute_utils", "input_util",
           "mirrored_strategy", "numpy_dataset", "ops", "Trackable", "values"]
